"""A declarative numpy training pipeline whose resumed run equals the run that never stopped (ARCHITECTURE.md);
the finder below (the one process state importing it changes) keeps the tools' names `pipeline.TOOL` working."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

TOOLS = ("archive", "evaluate", "export_hf", "register", "reindex", "roundtrip", "sample", "show")


class _ToolNames(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """`pipeline.sample` is `pipeline.cli.sample`; `python -m pipeline.sample` is `python -m pipeline sample`."""

    def find_spec(self, name, path=None, target=None):
        tool = name.removeprefix(f"{__name__}.")
        if tool not in TOOLS or tool == name:
            return None
        # the origin is what `python -m` puts in argv[0]
        return importlib.machinery.ModuleSpec(name, self, origin=f"{__path__[0]}/cli/{tool}.py")

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.cli.{spec.name.rsplit('.', 1)[1]}")

    def exec_module(self, module):  # the import system gave it the alias's spec: its own again
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)

    def get_source(self, name):  # what `python -m pipeline.TOOL` runs: the one entry, signals first
        tool = name.rsplit(".", 1)[1]
        return f"from pipeline.run.signals import run_command\nrun_command('{name}', 'pipeline.cli.{tool}')\n"


sys.meta_path.append(_ToolNames())
