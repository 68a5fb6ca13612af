"""The training loop and the objects it drives."""
