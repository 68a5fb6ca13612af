"""One multirun as one sweep: the Hydra callback, its end table and its Optuna study."""
