"""Learning-rate schedules with PyTorch's semantics; their state is the step counter."""
