"""Runtime: the Trainer, strategies, CUDA graphs, host memory policy, the torch.compile drop-in."""
