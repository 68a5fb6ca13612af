"""Shared fixtures: the real config composed with Hydra, one tiny job, the job run in-process,
`python -m pipeline` as a subprocess where signals and exit codes are the point, and `slurm_cluster`.

Nothing here writes into the repository: composing writes nothing, every run gets `paths.output_dir` under
the test's tmp_path, and subprocesses start from an empty temporary cwd (so a test also proves outputs do
not depend on the cwd).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import hypothesis
import pytest

# Hypothesis keeps no example database and writes its caches outside the repository.
hypothesis.configuration.set_hypothesis_home_dir(
    tempfile.mkdtemp(prefix="pipeline-tests-hypothesis-")
)
hypothesis.settings.register_profile("pipeline", database=None, deadline=None)
hypothesis.settings.load_profile("pipeline")

PROJECT_ROOT = (
    Path(__file__).resolve().parents[1]
)  # tests/ -> the project root, independent of the package
# Each test's output directory is its own tracking URI, hence its own tracking agent: let idle ones go soon.
os.environ.setdefault("PIPELINE_TRACKING_AGENT_IDLE", "3")
# The one tiny job most tests train: MiniGPT on a small grammar corpus, a few seconds in-process.
TINY = (
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "data.n_sentences=400",
    "data.block_size=16",
    "data.val_batch_size=16",
    "optimizer.lr=0.01",
    "scheduler.warmup_steps=2",
    "trainer.batch_size=8",
    "trainer.max_steps=12",
    "trainer.eval_every=4",
    "trainer.log_every=1",
    "checkpoint=every_n_steps",
    "checkpoint.every_steps=3",
    "tracking=none",
    "trainer.progress_bar=false",
)
KERNODECK = ("experiment=kernodeck", "tracking=none", "trainer.progress_bar=false")


def central_differences(f, x, R=None, eps: float = 1e-6):
    """The oracle of every gradient test: central differences wrt every entry of x (perturbed in place, then
    restored) of the scalar f(), or, given R, of sum(f() * R): the output difference is taken before
    projecting, so untouched outputs cancel exactly and rounding noise stays that of the changed entries."""
    import numpy as np

    g = np.zeros_like(x)
    for i in np.ndindex(
        x.shape
    ):  # by index: x may be a view (a tied head is the embedding's transpose)
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        diff = fp - fm if R is None else np.sum((fp - fm) * R)
        g[i] = diff / (2 * eps)
    return g


def compose(*overrides: str, return_hydra_config: bool = False):
    """The real conf/config.yaml composed with `overrides`, exactly as `python -m pipeline` would."""
    from pipeline.config.compose import compose as compose_config

    return compose_config(overrides, return_hydra_config=return_hydra_config)


def config_of(*overrides: str) -> dict:
    """The composed config as the job sees it: plain, resolved."""
    from pipeline.config.compose import to_plain

    return to_plain(compose(*overrides))


def run_job(*overrides: str) -> tuple[int, float | None]:
    """`python -m pipeline *overrides` in this process: (exit code, the objective it returned)."""
    from omegaconf import OmegaConf

    from pipeline.config.compose import to_plain
    from pipeline.run import job as app

    cfg = compose(*overrides)  # once: a composition costs about a second, as much as a tiny run
    outcome = app.main(to_plain(cfg), list(overrides), OmegaConf.to_yaml(cfg))
    return outcome.code, outcome.value


def the_run(output_dir: Path) -> Path:
    """The one run directory under an output directory."""
    (d,) = [p for p in (Path(output_dir) / "runs").iterdir() if p.is_dir()]
    return d


def env_for_subprocess() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PIPELINE_CHAOS")}
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_pipeline(
    args: Sequence[str], cwd: Path, module: str = "pipeline"
) -> subprocess.CompletedProcess:
    """`python -m <module> *args` from `cwd`, output captured; this checkout's package first on the path."""
    Path(cwd).mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )


def pasted(line: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """A command line the pipeline printed, run as pasted into a shell (its `PYTHONPATH=...` prefix applies), from
    `cwd`, in `env` (this checkout's first on the path, if not given)."""
    return subprocess.run(
        ["bash", "-c", line],
        cwd=cwd,
        env=env_for_subprocess() if env is None else env,
        capture_output=True,
        text=True,
    )


def refused_in_one_line(args: Sequence[str], cwd: Path, module: str = "pipeline") -> str:
    """`python -m <module> *args` must refuse: exit 2, nothing on stdout, one line on stderr (returned)."""
    proc = run_pipeline(args, cwd, module=module)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


class Proc:
    """A running `python -m pipeline`, its output going to files (a full pipe would block it)."""

    # every Proc of the current test; the `no_leftover_procs` fixture kills survivors
    started: ClassVar[list[Proc]] = []

    def __init__(self, args: Sequence[str], cwd: Path, env: dict | None = None):
        Path(cwd).mkdir(parents=True, exist_ok=True)
        self.err_path = Path(cwd) / f"stderr-{time.monotonic_ns()}.txt"
        with open(self.err_path, "w") as err:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "pipeline", *args],
                cwd=cwd,
                env={**env_for_subprocess(), **(env or {})},
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
            )
        Proc.started.append(self)

    def wait(self) -> int:
        return self.p.wait()

    def send_signal(self, sig) -> None:
        self.p.send_signal(sig)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()


@pytest.fixture(autouse=True)
def no_leftover_procs():
    """A test that fails (or times out) while its pipeline runs must not leave that process running on."""
    yield
    while Proc.started:
        proc = Proc.started.pop()
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait()


def wait_until(predicate, what: str, proc: Proc | None = None, limit: float = 600) -> None:
    """Poll until predicate() holds; fail naming `what` (a generous limit: a loaded machine is slow)."""
    t0 = time.time()
    while not predicate():
        if proc is not None and proc.p.poll() is not None:
            pytest.fail(
                f"the process exited ({proc.p.returncode}) before {what}: {proc.stderr[-2000:]}"
            )
        if time.time() - t0 > limit:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def preempt_at():
    """preempt_at(k): a SIGTERM arrives during update k (sigterm_during, for the test's length)."""
    with sigterm_during() as at:
        yield at


@pytest.fixture
def tiny(tmp_path) -> tuple[str, ...]:
    """The tiny job's overrides, writing under tmp_path/out."""
    return (*TINY, f"paths.output_dir={tmp_path / 'out'}")


@pytest.fixture
def kernodeck(tmp_path) -> tuple[str, ...]:
    return (*KERNODECK, f"paths.output_dir={tmp_path / 'out'}")


@pytest.fixture(scope="session")
def finished_job(tmp_path_factory):
    """finished_job(*overrides, copy_to=None): the output directory of the job `overrides` run in-process to its
    end (exit 0) once per worker, shared by every test that asks for the same overrides: read it, never change
    it; given `copy_to`, a copy of it there (links kept as links) to change instead. Ask before patching
    anything the job calls: the first asker's run is everyone's."""
    import shutil

    done: dict[tuple[str, ...], Path] = {}

    def get(*overrides: str, copy_to: Path | None = None) -> Path:
        if overrides not in done:
            out = tmp_path_factory.mktemp("finished") / "out"
            assert run_job(*overrides, f"paths.output_dir={out}")[0] == 0
            done[overrides] = out
        if copy_to is None:
            return done[overrides]
        shutil.copytree(done[overrides], copy_to, symlinks=True)
        return Path(copy_to)

    return get


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides, return_hydra_config=False) -> the composed DictConfig."""
    return compose


@pytest.fixture(scope="session")
def pipeline_runner():
    """run_pipeline(args, cwd=...) for module- or session-scoped fixtures."""

    def _run(
        args: Sequence[str], cwd: Path, timeout: float | None = None
    ) -> subprocess.CompletedProcess:
        return run_pipeline(args, cwd)

    return _run


@pytest.fixture
def cli(tmp_path):
    """cli(*args) runs `python -m pipeline *args` from an empty tmp cwd (tmp_path/"cwd")."""

    def _run(
        *args: str, cwd: Path | None = None, module: str = "pipeline"
    ) -> subprocess.CompletedProcess:
        return run_pipeline(args, cwd if cwd is not None else tmp_path / "cwd", module)

    return _run


# --- a failing child process shows its output --------------------------------------------------------------
CHILD_TAIL_LINES = 40


def _tail(text, n: int = CHILD_TAIL_LINES) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = (text or "").rstrip().splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def child_outputs(excinfo) -> list[tuple[str, str]]:
    """(title, tail) of every child process a failure involves: a CalledProcessError in the exception's
    chain, and a CompletedProcess or Proc that failed in a frame of the traceback (the test's `proc`)."""
    found, seen = [], set()

    def add(obj, where: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Proc):
            try:
                code, err, out, args = obj.p.returncode, obj.stderr, "", obj.p.args
            except OSError:  # its stderr file went with its directory
                return
        else:
            code, err, out, args = obj.returncode, obj.stderr, obj.stdout, obj.args
        cmd = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        for name, text in (("stderr", err), ("stdout", out)):
            if text and str(text).strip():
                found.append((f"child {name} ({where}exit {code}): {cmd[:200]}", _tail(text)))

    e = excinfo.value
    while e is not None and id(e) not in seen:
        if isinstance(e, subprocess.CalledProcessError):
            add(e, "")
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    for entry in excinfo.traceback:
        for name, value in entry.frame.f_locals.items():
            if isinstance(value, (subprocess.CompletedProcess, Proc)):
                add(value, f"{name}, ")
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the tail of each child process's stderr (and stdout) involved."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        for title, tail in child_outputs(call.excinfo):
            report.sections.append((title, tail))


# --- `slurm_cluster`: a live single-node SLURM cluster for the tests marked `slurm` -------------------------
# `.ci/run` brings one up before pytest and names its directory in PIPELINE_SLURM_DIR; the fixture then uses
# it and leaves it running. Otherwise the fixture brings its own up in a temporary directory and stops it at
# the end of the session. Without the packages (or without root) every slurm test skips, saying how to
# enable them. (Here, not in tests/slurm/conftest.py: two modules named `conftest` would shadow each other.)
sys.path.insert(0, str(Path(__file__).parent / "slurm"))
import cluster as slurm  # noqa: E402  (tests/slurm/cluster.py is also a script, not a package module)

SLURM_DIR_ENV = "PIPELINE_SLURM_DIR"
SLURM_HOW = "run `python tests/slurm/cluster.py install` as root (CI does)"


def slurm_unavailable() -> str | None:
    """Why this machine cannot run a cluster, in one line; None when it can."""
    missing = slurm.missing()
    if missing:
        return (
            f"slurm tests skipped: {'/'.join(missing[:3])}{'...' if len(missing) > 3 else ''} not installed; "
            f"{SLURM_HOW}"
        )
    if os.geteuid() != 0:
        return "slurm tests skipped: slurmd must run as root; run the tests as root (CI does)"
    return None


def pytest_xdist_auto_num_workers(config) -> int:
    """`--numprocesses=auto`: a worker per core, and one more when the slurm tests run: their worker spends
    minutes asleep on the cluster's clock (one-minute time limits, requeues, paced jobs) while its core idles."""
    cores = len(os.sched_getaffinity(0))
    slurm_tests_run = slurm_unavailable() is None and "not slow" not in (
        config.getoption("markexpr") or ""
    )
    return cores + 1 if slurm_tests_run else cores


def pytest_collection_modifyitems(items) -> None:
    """The longest go first, the slurm tests (one chain on one worker: their modules' xdist_group, given where
    they are defined, since xdist reads the marks in its own hook of this name, before or after this one), then
    the other slow tests: one of minutes begun last would be the suite's tail, alone on a core while the other
    idles; the short ones fill the end."""
    first = ("slurm", "slow")
    items.sort(
        key=lambda item: next(
            (i for i, m in enumerate(first) if item.get_closest_marker(m)), len(first)
        )
    )


def pytest_runtest_setup(item) -> None:
    """Skip every `slurm` test here with one reason from one place, so the summary shows it on one line."""
    if item.get_closest_marker("slurm") is not None:
        why = slurm_unavailable()
        if why:
            pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_installed() -> None:
    """Skips (one line, saying how to enable) unless the packages are installed and we are root."""
    why = slurm_unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_cluster(slurm_installed, tmp_path_factory):
    """The running cluster (tests/slurm/cluster.py's Cluster); `.env` is what client commands need."""
    shared = os.environ.get(SLURM_DIR_ENV)
    if shared:
        c = slurm.Cluster.load(shared)
        dead = sorted(set(c.pids) - set(c.alive()))
        if dead:
            pytest.fail(
                f"{SLURM_DIR_ENV}={shared}: {', '.join(dead)} not running; bring it up with "
                f"`python tests/slurm/cluster.py up --dir {shared}`\n{c.logs()}"
            )
        yield c
        return
    # a short path: the munge socket and slurmd's step sockets live inside it (sun_path is 108 bytes)
    c = slurm.up(tmp_path_factory.mktemp("slurm", numbered=True))
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch) -> dict[str, str]:
    """os.environ plus the cluster's client variables, also set in this test's environment."""
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    return slurm_cluster.client_env()


from mlflow_servers import mlflow_server, postgres, postgres_mlflow_server  # noqa: E402,F401  (fixtures)

SHARED_SERVER = pytest.mark.xdist_group(
    "mlflow-server"
)  # the tests of the shared server: one worker, one start


@pytest.fixture(scope="session")
def shared_mlflow_server(tmp_path_factory):
    """(URI, artifacts destination) of one `mlflow server` for the session, serving artifacts (mlflow's default
    --artifacts-destination): a start costs ~15 s, so the tests marked SHARED_SERVER share it, each in an
    experiment of its own."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with mlflow_server(root, "--artifacts-destination", str(root / "server-artifacts")) as uri:
        yield uri, root / "server-artifacts"


def tree(root: Path, mtimes: str = "files", skip: Path | None = None) -> dict:
    """Every entry under `root` (but `skip` and what it holds) by relative path: its kind, size, mode, content (a
    file's sha256, a link's target) and mtime (mtimes="files": of files only; "all"; "none"), nothing followed
    or changed."""
    import hashlib
    import stat

    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath) / d != skip]
        for name in sorted(dirnames + filenames):
            if (p := Path(dirpath) / name) == skip:
                continue
            st = p.lstat()
            kind = stat.S_IFMT(st.st_mode)
            content = (
                os.readlink(p)
                if stat.S_ISLNK(st.st_mode)
                else hashlib.sha256(p.read_bytes()).hexdigest()
                if stat.S_ISREG(st.st_mode)
                else None
            )
            when = (
                st.st_mtime_ns
                if mtimes == "all" or (mtimes == "files" and content is not None)
                else None
            )
            out[str(p.relative_to(root))] = (kind, st.st_size, st.st_mode, content, when)
    return out


def cross_device(monkeypatch, other) -> None:
    """The directory `other` is another filesystem: os.rename and os.link refuse to reach into it from outside."""

    def inside(p) -> bool:
        return os.path.commonpath([os.path.abspath(p), os.path.abspath(other)]) == os.path.abspath(
            other
        )

    def refusing(real):
        def call(src, to, *args, **kwargs):
            if inside(to) and not inside(src):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(to))
            return real(src, to, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "rename", refusing(os.rename))
    monkeypatch.setattr(os, "link", refusing(os.link))


def kept(run_dir: Path, store=None) -> tuple[dict, dict]:
    """{step: sha256 of weights, optim and extra} of every checkpoint kept, and the links."""
    from pipeline.checkpoint.directory import EXTRA, OPTIM, WEIGHTS
    from pipeline.run.directory import RunDir

    store = store or RunDir(run_dir).store
    out = {}
    for step, d in store.steps():
        out[step] = {
            n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in (WEIGHTS, OPTIM, EXTRA)
        }
    return out, store.links()


def metrics(run_dir: Path) -> list[dict]:
    from pipeline.run.directory import RunDir

    return [{k: v for k, v in ln.items() if k != "time"} for ln in RunDir(run_dir).read_metrics()]


def text_overrides(path: Path) -> tuple[str, ...]:
    return (
        "data=text",
        f"data.path={path}",
        "data.block_size=8",
        "data.val_batch_size=4",
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=2",
        "trainer.batch_size=4",
        "trainer.max_steps=3",
        "trainer.eval_every=3",
        "tracking=none",
        "trainer.progress_bar=false",
    )


# --- shared by many test files (issue 40: one of each) -----------------------------------------------------
@contextlib.contextmanager
def sigterm_during(step: int | None = None):
    """Inside the block a SIGTERM arrives during update `step` (the handler's flag, as the real handler sets it);
    it yields at(k), which moves it to update k (None: none). Usable by a fixture of any scope."""
    import pipeline.trainer.loop as loop
    from pipeline.run.signals import SIGNALS_STATE

    real, target = loop.train_step, {"step": step}

    def train_step(state):
        record = real(state)
        if state.step == target["step"]:
            SIGNALS_STATE.received = signal.SIGTERM
        return record

    loop.train_step = train_step
    try:
        yield lambda k: target.update(step=k)
    finally:
        loop.train_step, SIGNALS_STATE.received = real, None


def relist(directory: Path, name: str | None = None, drop: str | None = None, **fields) -> None:
    """Rewrite a checkpoint's manifest.json as if it had been written so: `name`'s size and sha256 as the file is
    now, `drop`'s entry removed, `fields` set."""
    import json

    from pipeline.checkpoint.directory import MANIFEST

    m = json.loads((directory / MANIFEST).read_text())
    if name:
        h = hashlib.sha256()
        with open(directory / name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        m["files"][name] = {"size": (directory / name).stat().st_size, "sha256": h.hexdigest()}
    if drop:
        del m["files"][drop]
    m.update(fields)
    (directory / MANIFEST).write_text(json.dumps(m))


@pytest.fixture(scope="module")
def finished(request, finished_job) -> Path:
    """The output directory of a run trained to its end, shared by every test that asks for the same run: the
    test module's FINISHED overrides (default KERNODECK: checkpoints at 6 and 10, best and final links). Read it;
    copy it to change it."""
    return finished_job(*getattr(request.module, "FINISHED", KERNODECK))


# The n-gram baseline's oracles: pipeline.data.ngram fits and scores one level at a time, these hold them all.
import numpy as np  # noqa: E402

from pipeline.data import ngram  # noqa: E402


def ngram_fit(tokens, order: int, V: int) -> tuple:
    """The interpolated modified Kneser-Ney model of one token stream: its levels, order 1 first."""
    return tuple(ngram._levels(np.asarray(tokens), order, V))


def ngram_log_probs(levels: tuple, V: int, tokens, positions) -> np.ndarray:
    """log p(tokens[i] | the up to order-1 tokens before i in the same stream) for each i in positions."""
    return np.log(ngram._raised(levels, V, np.asarray(tokens), positions))


def ngram_perplexity(levels: tuple, V: int, tokens, positions) -> float:
    return float(np.exp(-np.mean(ngram_log_probs(levels, V, tokens, positions))))


def ngram_distribution(levels: tuple, V: int, history) -> np.ndarray:
    """The full next-token distribution [V] after a history (its last order-1 tokens are used)."""
    n, history = len(levels) - 1, [int(t) for t in history]
    h = history[max(0, len(history) - n) :] if n else []  # its last n tokens (all of a shorter one)
    return np.array([ngram._raised(levels, V, np.array([*h, t]), [len(h)])[0] for t in range(V)])
