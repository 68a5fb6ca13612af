"""The command-line tools, each run as `python -m pipeline.<tool>` (this folder is on the package's search path)."""
