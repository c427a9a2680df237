"""ONNX Runtime backend."""
