"""Analyses: cost, memory and communication models, device profiles, calibration, prediction."""
