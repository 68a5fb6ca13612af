"""Checkpoints: five state machines in safetensors + JSON, written atomically and verified on load."""
