"""Export: saved steps, the optimized step as Python / ONNX / ORT training artifacts."""
