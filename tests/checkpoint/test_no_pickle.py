"""No pickle anywhere in the package: every .py under pipeline/ is parsed (nothing excluded) and any
pickle-based loading or saving fails the test, naming the file, the line and the call.

Hydra's joblib launcher pickles jobs inside Hydra's own code; that is not ours and not scanned.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"
MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "shelve",
    "marshal",
    "copyreg",
    "pickletools",
}
CALLS = {  # fully qualified callables that pickle (np.save pickles object arrays; joblib and torch always do)
    "numpy.save",
    "numpy.savez",
    "numpy.savez_compressed",
    "joblib.load",
    "joblib.dump",
    "torch.load",
    "torch.save",
    "pandas.read_pickle",
}


def _qualify(node: ast.AST, names: dict[str, str]) -> str | None:
    """'numpy.load' for `np.load` after `import numpy as np`, 'numpy.load' for `load` after `from numpy import load`."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    base = names.get(node.id, node.id)
    return ".".join([base, *reversed(parts)])


def violations(source: str, filename: str = "<string>") -> list[str]:
    tree = ast.parse(source, filename)
    names: dict[str, str] = {}  # local name -> qualified name, from every import in the module
    found = []

    def flag(node, what):
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
                if a.name.split(".")[0] in MODULES:
                    flag(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
                if root in MODULES or f"{node.module}.{a.name}" in CALLS:
                    flag(node, f"from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        q = _qualify(node.func, names)
        if q is None:
            continue
        if q in CALLS:
            flag(node, f"{q}(...)")
        elif q == "numpy.load":
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is False
                ):
                    flag(node, "numpy.load(..., allow_pickle=...)")
        elif q.endswith((".to_pickle", ".read_pickle")):
            flag(node, f"{q}(...)")
        elif (
            q in ("importlib.import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] in MODULES
        ):
            flag(node, f"{q}({node.args[0].value!r})")
    return found


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_python_files():
    files = package_files()
    assert len(files) > 20 and PACKAGE / "checkpoint" / "store.py" in files


def test_no_pickle_in_the_package():
    found = []
    for path in package_files():
        found += violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "pickle-based serialisation in the package:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import pickle as p",
        "import cPickle",
        "from pickle import loads",
        "import dill",
        "import shelve",
        "import marshal",
        "import joblib\njoblib.load('x')",
        "import joblib\njoblib.dump(1, 'x')",
        "from joblib import dump",
        "import numpy as np\nnp.load('x', allow_pickle=True)",
        "import numpy\nnumpy.load('x', allow_pickle=flag)",
        "from numpy import load\nload('x', allow_pickle=True)",
        "import numpy as np\nnp.save('x', a)",
        "import numpy as np\nnp.savez('x', a=a)",
        "from numpy import save",
        "import torch\ntorch.load('x')",
        "import pandas as pd\npd.read_pickle('x')",
        "df.to_pickle('x')",
        "import importlib\nimportlib.import_module('pickle')",
        "__import__('marshal')",
    ],
)
def test_scanner_catches(source):
    assert violations(source), source


@pytest.mark.parametrize(
    "source",
    [
        "import numpy as np\nnp.load('x')",
        "import numpy as np\nnp.load('x', allow_pickle=False)",
        "import json\njson.dump(obj, f)\njson.loads(s)",
        "from safetensors.numpy import save_file, load_file\nsave_file(d, 'x')",
        "import numpy as np\nnp.fromfile('x', dtype=np.int64)",
    ],
)
def test_scanner_passes(source):
    assert violations(source) == [], source
