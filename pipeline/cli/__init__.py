"""The command-line tools, each run as `python -m pipeline TOOL` (or `python -m pipeline.TOOL`, pipeline/__init__)."""
