"""Installed, not only cloned: a wheel built from the checkout carries conf/ (as pipeline/conf/), and installed
into a fresh virtualenv it runs from an empty directory, writing under that directory's outputs/, with the
user's own configs found outside the package through hydra.searchpath."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT


def copy_source(dest: Path) -> Path:
    """What an sdist holds, copied out: building writes build/ and *.egg-info beside the sources, never here."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(PROJECT_ROOT / name, dest / name)
    for name in ("pipeline", "conf"):
        shutil.copytree(
            PROJECT_ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    return dest


def outer_site_dirs() -> list[str]:
    """Where this interpreter's packages are: a virtualenv's site-packages (and its base's, if it sees them),
    or the system interpreter's."""
    import site
    import sysconfig

    dirs = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def outer_pipeline_entries() -> dict[str, list[str]]:
    return {d: sorted(p.name for p in Path(d).glob("*pipeline*")) for d in outer_site_dirs()}


def fresh_venv_seeing_ours(venv: Path, env: dict) -> str:
    """A new virtualenv whose interpreter also finds this one's installed packages (the dependencies), after
    its own; its python. `--system-site-packages` would not do: from inside a virtualenv it exposes the base
    interpreter's site-packages, not the virtualenv's, and the dependencies are not there."""
    subprocess.run(
        [sys.executable, "-m", "venv", str(venv)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    python = str(venv / "bin" / "python")
    inner = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    # a .pth file's lines that name directories are appended to sys.path, after the venv's own site-packages
    (Path(inner) / "outer-site-packages.pth").write_text(
        "".join(f"{d}\n" for d in outer_site_dirs())
    )
    return python


def env_without_checkout() -> dict:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR", "PIPELINE_CHAOS")
    }


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_venv_runs_from_an_empty_directory(tmp_path):
    src = copy_source(tmp_path / "src")
    # built as docs/install.md builds it: in pip's isolated build environment (build-system.requires), since the
    # running interpreter's own setuptools may be older (a fresh Python 3.11 virtualenv has 65.5)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env_without_checkout(),
    )
    (wheel,) = (tmp_path / "dist").glob("pipeline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    yaml = {
        f"pipeline/conf/{p.relative_to(PROJECT_ROOT / 'conf')}"
        for p in (PROJECT_ROOT / "conf").rglob("*.yaml")
    }
    code = {str(p.relative_to(PROJECT_ROOT)) for p in (PROJECT_ROOT / "pipeline").rglob("*.py")}
    assert yaml and yaml <= names, sorted(yaml - names)
    assert code <= names, sorted(code - names)

    # A virtualenv inside someone's git repository: its commit must not be taken for the pipeline's.
    project = tmp_path / "project"
    project.mkdir()
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "theirs"], check=True)
    venv = project / ".venv"
    env = env_without_checkout()
    python = fresh_venv_seeing_ours(venv, env)
    ours = outer_pipeline_entries()
    # --ignore-installed puts the wheel's pipeline into the venv although the outer environment has one
    # (editable, visible through the .pth): pip installs into the venv's own site-packages, which comes first.
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    inner = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        ).stdout.strip()
    )
    assert inner.is_relative_to(venv) and (inner / "pipeline-0.1.0.dist-info").is_dir()
    assert outer_pipeline_entries() == ours  # the outer environment's pipeline untouched

    work = project / "work"
    work.mkdir()
    where = subprocess.run(
        [
            python,
            "-c",
            "import json, pipeline, pipeline.config.compose as s; print(json.dumps("
            "[pipeline.__file__, str(s.CONFIG_DIR), s.in_checkout(), s.default_output_dir()]))",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    package_file, config_dir, in_checkout, output_dir = json.loads(where.stdout)
    site = Path(package_file).parent.parent
    assert (
        Path(package_file).is_relative_to(venv) and Path(config_dir) == site / "pipeline" / "conf"
    )
    assert in_checkout is False and output_dir == str(work / "outputs")

    run = subprocess.run(
        [python, "-m", "pipeline", "experiment=kernodeck", "tracking=none"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in work.iterdir()) == ["outputs"]
    (run_dir,) = (work / "outputs" / "runs").iterdir()
    assert run_dir.name.startswith("kernodeck-")
    manifest = json.loads((run_dir / "checkpoints" / "final" / "manifest.json").read_text())
    assert (
        manifest["step"] == 10
        and manifest["git_sha"] == "unknown"
        and manifest["versions"]["pipeline"] == "0.1.0"
    )
    # the tools, files of pipeline/cli/ in the wheel, run by their documented names
    for tool, says in (
        (["pipeline.show", str(run_dir)], "status: complete  step 10/10"),
        (["pipeline.evaluate", str(run_dir / "checkpoints" / "final")], "step=10 val/loss="),
    ):
        used = subprocess.run(
            [python, "-m", *tool], cwd=work, env=env, capture_output=True, text=True
        )
        assert used.returncode == 0 and says in used.stdout, (tool, used.stdout, used.stderr)

    # One's own configs, outside the package: a directory on the search path, an experiment overlay in it.
    mine = project / "myconf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "short.yaml").write_text(
        "# @package _global_\ndefaults:\n  - kernodeck\n  - _self_\nname: short\n"
        "trainer:\n  max_steps: 4\n"
    )
    run = subprocess.run(
        [
            python,
            "-m",
            "pipeline",
            f"hydra.searchpath=[file://{project / 'myconf'}]",
            "experiment=short",
            "tracking=none",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    (short,) = (work / "outputs" / "runs").glob("short-*")
    assert json.loads((short / "run.json").read_text())["step"] == 4
