"""Checkpoints: five state machines in safetensors + JSON, written atomically and verified on load."""
from pipeline.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
