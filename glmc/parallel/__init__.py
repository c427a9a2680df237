"""Parallel strategies: the parallel plan, data parallelism (ZeRO), pipeline parallelism."""
