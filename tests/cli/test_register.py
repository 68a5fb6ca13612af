"""`python -m pipeline.register` (pipeline/cli/register.py, pipeline/serving/): a checkpoint logged as an mlflow pyfunc
model from code and registered; loaded by `models:/NAME/1` in a fresh process it answers what the project's own
code answers (pipeline.cli.sample's text, the MLP's forward), `mlflow models serve` answers the same over HTTP, and
nothing in the logged model is a pickle."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import pytest
from conftest import (
    KERNODECK,
    TINY,
    env_for_subprocess,
    refused_in_one_line,
    run_pipeline,
    the_run,
    wait_until,
)

from pipeline.config.errors import ConfigError
from pipeline.run.directory import RunDir

GPT, MLP = "tiny-gpt", "kernodeck-mlp"
# Rows a MiniGPT model is asked (options left out take pipeline.cli.sample's defaults), as sample's arguments.
ROWS = [
    {"prompt": "the man", "max_new_tokens": 12, "seed": 3},
    {"prompt": "the", "max_new_tokens": 6, "temperature": 0.5, "top_k": 3, "seed": 1},
    {"prompt": "the man"},
]


def args_of(row: dict) -> list[str]:
    return [f"{k}={v}" for k, v in row.items()]


@pytest.fixture(scope="module")
def registered(tmp_path_factory, finished_job):
    """A tiny MiniGPT registered by the command into its output directory's store, and kernodeck's MLP by
    register() into a store of its own; {name: (checkpoint, tracking URI)}."""
    from pipeline.cli.register import register

    root = tmp_path_factory.mktemp("register")
    out = {}
    for name, overrides in ((GPT, TINY), (MLP, KERNODECK)):
        finished_job(*overrides, copy_to=root / name)  # a copy: its store is the output directory's
        out[name] = RunDir(the_run(root / name)).store.root / "final"
    (root / "cwd").mkdir()
    env = {
        k: v
        for k, v in env_for_subprocess().items()
        if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.register", str(out[GPT]), GPT],
        cwd=root / "cwd",
        env=env,
        capture_output=True,
        text=True,
    )  # the default store: the run's output directory's
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"models:/{GPT}/1"
    mlp_uri = f"sqlite:///{root / 'registry' / 'mlflow.db'}"
    uris = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    before = [os.environ.get(k) for k in uris]
    version, _ = register(out[MLP], MLP, mlp_uri)
    assert [
        os.environ.get(k) for k in uris
    ] == before  # nothing left behind for a child process to follow
    assert (version.name, str(version.version)) == (MLP, "1")
    assert not (root / "cwd" / "mlflow.db").exists() and not (root / "cwd" / "mlruns").exists()
    return {
        GPT: (out[GPT], f"sqlite:///{root / GPT / 'mlflow.db'}"),
        MLP: (out[MLP], mlp_uri),
    }, root


def mlp_forward(checkpoint: Path, x: np.ndarray) -> np.ndarray:
    from pipeline.run.trained import restore_checkpoint

    return restore_checkpoint(checkpoint)[1].model.forward(x, None)[0]


LOAD = (
    textwrap.dedent("""
    import json, sys
    import mlflow, numpy as np
    from mlflow.exceptions import MlflowException
    gpt_uri, mlp_uri, rows, x = json.loads(sys.stdin.read())
    mlflow.set_tracking_uri(gpt_uri)
    gpt = mlflow.pyfunc.load_model("models:/{gpt}/1")
    try:
        gpt.predict([{"prompt": "the zebra"}])
        refused = None
    except MlflowException as e:
        refused = str(e)
    try:
        gpt.predict([{"prompt": "the", "promt": "man"}])  # a typo'd column: mlflow's schema alone drops it
        unknown = None
    except MlflowException as e:
        unknown = str(e)
    mlflow.set_tracking_uri(mlp_uri)
    mlp = mlflow.pyfunc.load_model("models:/{mlp}/1")
    print(json.dumps({"texts": list(gpt.predict(rows)), "refused": refused, "unknown": unknown,
                      "outputs": np.asarray(mlp.predict(np.array(x))).tolist()}))
""")
    .replace("{gpt}", GPT)
    .replace("{mlp}", MLP)
)


@pytest.mark.slow
def test_a_fresh_process_loads_each_model_by_name_and_gets_the_projects_own_answers(
    registered, tmp_path
):
    from pipeline.cli.sample import sample

    models, _ = registered
    x = np.random.default_rng(0).normal(size=(5, 2))  # kernodeck's 2 features
    proc = subprocess.run(
        [sys.executable, "-c", LOAD],
        input=json.dumps([models[GPT][1], models[MLP][1], ROWS, x.tolist()]),
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    checkpoint = models[GPT][0]
    assert got["texts"] == [sample(checkpoint, args_of(r)) for r in ROWS]
    command = run_pipeline([str(checkpoint), *args_of(ROWS[0])], tmp_path, module="pipeline.sample")
    assert command.returncode == 0 and command.stdout == got["texts"][0] + "\n"
    assert len(got["texts"][2].split(" ")) == 2 + 50  # sample's default max_new_tokens
    assert "prompt: not in the corpus vocabulary" in got["refused"] and "'zebra'" in got["refused"]
    assert "unknown column(s) ['promt']: a row gives prompt, max_new_tokens" in got["unknown"], got[
        "unknown"
    ]
    assert np.array_equal(
        np.array(got["outputs"]), mlp_forward(models[MLP][0], x)
    )  # exact: JSON keeps float64


def pickle_files(directory: Path) -> list[str]:
    """Files of `directory` that are, or are named as, pickles (protocol 2-5 begins with PROTO, b'\\x80' N)."""
    found = []
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                head = f.read(2)
            if p.suffix in (".pkl", ".pickle") or (
                len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5
            ):
                found.append(str(p.relative_to(directory)))
    return found


def test_the_pickle_check_finds_pickles(tmp_path):
    for protocol in range(2, 6):
        (tmp_path / f"p{protocol}").write_bytes(pickle.dumps({"a": 1}, protocol=protocol))
    (tmp_path / "python_model.pkl").write_bytes(b"")
    (tmp_path / "ok.json").write_text("{}")
    assert pickle_files(tmp_path) == ["p2", "p3", "p4", "p5", "python_model.pkl"]


def model_dir(name: str, uri: str) -> Path:
    from mlflow import MlflowClient

    location = urlparse(
        MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version_download_uri(name, "1")
    )
    assert location.scheme == "file", location
    return Path(unquote(location.path))


@pytest.mark.slow
def test_nothing_in_the_logged_models_is_a_pickle_and_the_checkpoint_is_its_own_bytes(registered):
    import yaml

    models, root = registered
    for name, (checkpoint, uri) in models.items():
        where = model_dir(name, uri)
        assert (
            where.is_dir() and root in where.parents
        )  # under the store's own mlartifacts, not the cwd
        assert pickle_files(where) == []
        flavor = yaml.safe_load((where / "MLmodel").read_text())["flavors"]["python_function"]
        assert (
            flavor["model_code_path"].endswith("pyfunc_model.py") and "python_model" not in flavor
        )
        (saved,) = [p for p in (where / "artifacts").iterdir() if p.is_dir()]
        src = checkpoint.resolve()
        assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in src.iterdir())
        assert all((saved / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())
        # the vocabulary travels in the checkpoint (data.json); a vocab.json only for a schema 2.0 checkpoint
        assert (saved / "data.json").is_file() and not (where / "artifacts" / "vocab.json").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": e.code, "body": e.read().decode(errors="replace")[:2000]}


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.slow
def test_mlflow_models_serve_answers_invocations_with_the_samples_text(registered, tmp_path):
    from pipeline.cli.sample import sample

    models, _ = registered
    checkpoint, uri = models[GPT]
    port = free_port()
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "models",
                "serve",
                "-m",
                f"models:/{GPT}/1",
                "--env-manager",
                "local",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=tmp_path,
            env={**env_for_subprocess(), "MLFLOW_TRACKING_URI": uri},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def up() -> bool:
            if server.poll() is not None:
                pytest.fail(
                    f"mlflow models serve exited ({server.returncode}): "
                    f"{(tmp_path / 'serve.log').read_text()[-3000:]}"
                )
            return answers(port)

        wait_until(up, "mlflow models serve to answer /ping")
        expected = sample(checkpoint, args_of(ROWS[1]))
        assert post(port, {"inputs": [ROWS[1]]}) == {"predictions": [expected]}
        refused = post(
            port, {"inputs": [{**ROWS[1], "promt": "the"}]}
        )  # a typo'd column: refused, not dropped
        assert refused["error"] == 400 and "unknown column(s) ['promt']" in refused["body"], refused
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers: the session it leads
        try:
            server.wait(
                timeout=600
            )  # cleanup only: past it, SIGKILL (no assertion depends on this time)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_a_checkpoint_that_is_not_one_is_refused_in_one_line_before_mlflow(tmp_path):
    line = refused_in_one_line(
        [str(tmp_path / "nowhere"), "x"], tmp_path / "cwd", module="pipeline.register"
    )
    assert line.startswith("pipeline.register: ") and "nowhere" in line
    assert not (tmp_path / "cwd" / "mlflow.db").exists()
    line = refused_in_one_line(
        [str(tmp_path / "nowhere"), "a/b"], tmp_path / "cwd", module="pipeline.register"
    )
    assert "NAME='a/b'" in line
    for name, why in (
        ("a\nb", "control characters"),
        ("..", "'..'"),
        ("n" * 300, "300 bytes"),
        (" ", "blank"),
    ):
        line = refused_in_one_line(
            [str(tmp_path / "nowhere"), name], tmp_path / "cwd", module="pipeline.register"
        )
        assert f"NAME={repr(name)[:20]}" in line and why in line, line
    assert os.listdir(tmp_path / "cwd") == []


def test_a_refused_checkpoint_never_imports_mlflow(tmp_path):
    """The refusal comes before mlflow is imported (seconds of every refused command), as docs/serving.md says."""
    probe = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('mlflow imported' if 'mlflow' in sys.modules else 'no mlflow'))\n"
        "sys.argv = ['pipeline.register', *sys.argv[1:]]\n"
        "runpy.run_module('pipeline.register', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "nowhere"), "x"],
        cwd=tmp_path,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "nowhere" in proc.stderr, proc.stderr
    assert proc.stdout == "no mlflow\n"


def test_a_row_becomes_samples_arguments_missing_values_taking_its_defaults():
    from mlflow.exceptions import MlflowException

    from pipeline.serving.checkpoint_model import _args

    nan = float("nan")
    assert _args(
        {
            "prompt": "the man",
            "max_new_tokens": 12.0,
            "temperature": nan,
            "top_k": None,
            "seed": np.int64(3),
        }
    ) == ["prompt=the man", "max_new_tokens=12", "seed=3"]
    assert _args({"prompt": "a", "temperature": 1.0, "seed": 2.5}) == [
        "prompt=a",
        "temperature=1.0",
        "seed=2.5",
    ]
    with pytest.raises(MlflowException, match=r"unknown column\(s\) \['promt'\]"):
        _args({"promt": "the"})


def test_the_vocabulary_is_the_checkpoints_own_data_json_when_it_has_one(tmp_path, monkeypatch):
    """data.json, verified by the store (CheckpointDir.data_facts, tested with the checkpoint), else (schema 2.0) the
    vocab.json registered beside the checkpoint."""
    from mlflow.exceptions import MlflowException

    from pipeline.checkpoint.directory import CheckpointDir
    from pipeline.serving.checkpoint_model import read_vocab

    (tmp_path / "vocab.json").write_text(json.dumps({"vocab": ["<eos>", "a"], "decode_join": " "}))
    monkeypatch.setattr(CheckpointDir, "data_facts", lambda self: None)
    assert read_vocab(tmp_path, str(tmp_path / "vocab.json")) == (["<eos>", "a"], " ", "<eos>")
    monkeypatch.setattr(
        CheckpointDir,
        "data_facts",
        lambda self: {"vocab": ["x", "y"], "decode_join": "", "specials": {}},
    )
    assert read_vocab(tmp_path, str(tmp_path / "vocab.json")) == (["x", "y"], "", None)
    monkeypatch.setattr(CheckpointDir, "data_facts", lambda self: None)
    (tmp_path / "vocab.json").write_text(json.dumps({"vocab": [1, 2], "decode_join": ""}))
    with pytest.raises(MlflowException, match="a list of strings `vocab`"):
        read_vocab(tmp_path, str(tmp_path / "vocab.json"))
    with pytest.raises(MlflowException, match="needs its vocabulary"):
        read_vocab(tmp_path, None)


def test_the_store_is_the_one_named_else_the_runs_and_an_archive_needs_one_named(
    tmp_path, monkeypatch
):
    """A checkpoint in an archive is registered only into a store the user names: never silently into the
    archive (it stays as it was checked) nor into the checkout's outputs/."""
    from pipeline.cli.register import store_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    step = tmp_path / "out" / "runs" / "r-0123456789ab" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    assert store_uri(step, None) == f"sqlite:///{tmp_path / 'out'}/mlflow.db"
    assert store_uri(step, f"sqlite:///{tmp_path}/mine.db") == f"sqlite:///{tmp_path}/mine.db"
    (tmp_path / "out" / "recovery.json").write_text("{}")  # now an archive
    with pytest.raises(
        ConfigError,
        match=r"lies in an archive: name the store to register it in with --tracking-uri",
    ):
        store_uri(step, None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")
    assert store_uri(step, None) == f"sqlite:///{tmp_path}/env.db"
