"""Capture: from a user's model, loss and optimizer to a TrainGraph (and pipeline stages)."""
