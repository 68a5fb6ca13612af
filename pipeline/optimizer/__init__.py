"""Optimizers with PyTorch's update formulas, updating named arrays in place."""
