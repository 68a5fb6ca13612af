"""A declarative numpy training pipeline whose resumed run equals the run that never stopped (ARCHITECTURE.md).
The tools in pipeline/cli/ run as `python -m pipeline.<tool>` and import as pipeline.cli.<tool>: that folder is on
this package's search path."""
import os as _os

__path__.append(_os.path.join(__path__[0], "cli"))
