"""The IR: the step graph, its node metadata, fused kernels, programs that span devices, parallel plans."""
