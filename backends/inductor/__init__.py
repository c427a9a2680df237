"""TorchInductor backend."""
