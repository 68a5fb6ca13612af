"""`python -m pipeline.inspect PATH [--json]`: a checkpoint's or a run's contents and validity (pipeline/inspect_cli.py).

This file's name is also the standard library's `inspect`. Imported as a package module it shadows
nothing; but a Python started with its working directory inside pipeline/ finds this file first for
every `import inspect` (dataclasses, argparse and Hydra all do it). Then it loads the real module and
steps aside, so that such a process works as anywhere else.
"""
if __name__ == "inspect":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    _spec = importlib.machinery.PathFinder.find_spec("inspect", _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["inspect"] = _module  # what `import inspect` hands back once this file has run
    _spec.loader.exec_module(_module)
    globals().update({k: v for k, v in vars(_module).items() if k not in ("__name__", "__spec__", "__loader__")})
else:
    import sys

    from pipeline.inspect_cli import describe_checkpoint, describe_run, main, render_checkpoint, render_run  # noqa: F401

    if __name__ == "__main__":
        sys.exit(main())
