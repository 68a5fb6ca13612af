"""A declarative numpy training pipeline whose resumed run equals the run that never stopped."""
