"""Experiment tracking: mlflow as a thin index over the manifests on disk."""
