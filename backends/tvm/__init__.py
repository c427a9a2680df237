"""Apache TVM backend."""
