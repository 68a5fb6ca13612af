"""A declarative numpy training pipeline whose resumed run equals the run that never stopped (ARCHITECTURE.md).

The command-line tools live in pipeline/cli/; that folder is on this package's search path, so each runs as
`python -m pipeline.<tool>` (pipeline.sample, pipeline.evaluate, ...) and imports as pipeline.cli.<tool>.
"""
import os as _os

__path__.append(_os.path.join(__path__[0], "cli"))
