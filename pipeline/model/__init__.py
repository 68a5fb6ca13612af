"""Models with explicit forward and backward over named numpy arrays."""
