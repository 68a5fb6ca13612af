"""One checkpoint directory (layout: docs/checkpoints.md): the only code that opens, creates or renames its files."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint import tensors
from pipeline.checkpoint.errors import CheckpointError, MisfitError
from pipeline.files import atomic, jsonio, killpoint, listing, reading
from pipeline.files.limits import MAX_CHECKPOINT_JSON
from pipeline.stateful import PARTS, SEP, StateMismatch, capture, check, merge, split

WEIGHTS, OPTIM = "weights.safetensors", "optim.safetensors"
EXTRA, MANIFEST, DATA = "extra.json", "manifest.json", "data.json"
REQUIRED = (WEIGHTS, OPTIM, EXTRA, DATA)
# schema_version -> files it lists
REQUIRED_BY = {"2.0": (WEIGHTS, OPTIM, EXTRA), mf.SCHEMA_VERSION: REQUIRED}
# data.json's strings, bounded: decoding costs what its tokens say (characters or words, join '' or ' ', eos)
MAX_TOKEN, MAX_JOIN, MAX_SPECIALS = 256, 16, 16
STEP_DIR = re.compile(r"^step-(\d{8,})$")
# The parts optim.safetensors ("optimizer/exp_avg/...") and extra.json hold (weights.safetensors: the model's);
# a key of another is refused: merged in, it would be dropped or shadow what the right file holds.
NOT_MODEL = tuple(p for p in PARTS if p != "model")


def step_number(name: str) -> int:
    """step-00000042 -> 42; ValueError for a name no step directory has."""
    if (m := STEP_DIR.match(name)) is None:
        raise ValueError(f"{name!r} is not a step directory's name")
    return int(m.group(1))


STORE = "checkpoints"  # what a run's store of checkpoints is called (pipeline/run/directory.py puts it in the run)
MAX_HOPS = 8  # links followed from a path to its checkpoint directory
CORRUPTED = "sha256 differs from manifest.json (corrupted)"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Checkpoint:
    directory: Path
    manifest: dict
    state: dict  # {part: state_dict}: arrays (tied names one object) and JSON values
    data: dict | None = None  # data.json, verified (None: schema 2.0, written without it)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def _by_file(tree: dict) -> tuple[dict, dict, dict]:
    """A state tree as what weights.safetensors, optim.safetensors and extra.json hold."""
    arrays, json_tree = split(tree)
    other = {k: a for k, a in arrays.items() if not k.startswith("model" + SEP)}
    return tree["model"], other, {k: v for k, v in json_tree.items() if k != "model"}


def _shown(target: str) -> str:
    return repr(target if len(target) <= 200 else target[:200] + "...")


def link_problem(name: str, target: str) -> str | None:
    """Why a link called `name` inside checkpoints/ may not point at `target` (None: it may)."""
    if STEP_DIR.match(name):
        return "a step directory must be a directory, not a link"
    if not STEP_DIR.match(target):
        return "a link in checkpoints/ names a step directory beside it (step-NNNNNNNN)"
    return None


def weights_bytes(manifest: dict) -> int:
    """The size the manifest lists for the weights file: what the model its config describes can hold at most."""
    return int(manifest["files"][WEIGHTS]["size"])


def file_hashes(manifest: dict) -> dict[str, str | None]:
    """{"weights", "optim", "extra", "data": sha256} of the files a manifest (verified or as written) lists readably."""
    files = manifest["files"] if isinstance(manifest.get("files"), dict) else {}
    listed = {n: e for n, e in files.items() if n in REQUIRED and isinstance(e, dict)}
    return {n.split(".")[0]: e.get("sha256") for n, e in listed.items()}


def _os_reason(e: BaseException) -> str:
    if not isinstance(e, OSError):
        return str(e)
    return reading.LINKED if e.errno == errno.ELOOP else e.strerror or type(e).__name__


def _data_problem(data, spec: dict) -> str | None:
    """Why data.json cannot be the data of a checkpoint whose manifest says `spec` (None: it can)."""
    if not (isinstance(data, dict) and set(data) == {"vocab", "decode_join", "specials"}):
        return "must be an object of vocab, decode_join and specials"
    vocab, join, specials = data["vocab"], data["decode_join"], data["specials"]
    size = spec.get("vocab_size")
    if vocab is None:
        if size or join is not None or specials != {}:
            return f"has no vocabulary, but the manifest's data_spec says vocab_size {size!r:.20}"
        return None
    tokens = isinstance(vocab, list) and all(isinstance(t, str) for t in vocab)
    if not tokens or len(set(vocab)) != len(vocab):
        return "vocab must be a list of distinct tokens"
    if len(vocab) != size:
        return f"vocab holds {len(vocab)} tokens, but the manifest's data_spec says vocab_size {size!r:.20}"
    if longest := max((t for t in vocab if len(t) > MAX_TOKEN), key=len, default=None):
        return f"a token of {len(longest)} characters: tokens are at most {MAX_TOKEN}"
    if not isinstance(join, str) or len(join) > MAX_JOIN:
        why = f"decode_join must be a string of at most {MAX_JOIN} characters"
        return why + " (a text's is '' or ' ')"
    small = isinstance(specials, dict) and len(specials) <= MAX_SPECIALS
    roles = small and all(isinstance(r, str) and len(r) <= MAX_TOKEN for r in specials)
    if not (roles and all(isinstance(t, str) and t in vocab for t in specials.values())):
        return f"specials must map at most {MAX_SPECIALS} roles to tokens of vocab"
    return None


def _read_listed(d: Path, name: str, listed: dict, expect: list[dict] | None = None, problem=None):
    """A listed file read bounded, checked against its listing: tensors by `expect`ed layouts, JSON by `problem`."""
    try:
        sha = listed[name]["sha256"]
        if name.endswith(".safetensors"):
            return tensors.read_tensors(d / name, expected_sha256=sha, expect=expect)[0]
        raw = reading.read_bytes(d / name, MAX_CHECKPOINT_JSON)
        if hashlib.sha256(raw).hexdigest() != sha:
            raise tensors.DigestMismatch
        value = jsonio.loads(raw)
    except tensors.DigestMismatch:
        raise CheckpointError(d, name, CORRUPTED) from None
    except tensors.LayoutMisfit as e:
        raise MisfitError(d, name, str(e)) from None
    except (ValueError, OSError) as e:
        raise CheckpointError(d, name, _os_reason(e)) from None
    if problem is not None and (why := problem(value)):
        raise CheckpointError(d, name, why)
    return value


def _holders(part: str, value) -> set[str]:
    if part == "model" or isinstance(value, np.ndarray):
        return {WEIGHTS if part == "model" else OPTIM}
    if isinstance(value, dict) and value:
        return set().union(*(_holders(part, v) for v in value.values()))
    return {EXTRA}


def files_of(e: StateMismatch, saved: dict, live: dict) -> str:
    """The file(s) holding a StateMismatch's value: where the saved one was read from, the live one would be."""
    files = set()
    for value in (saved, live):
        for k in (e.part, *e.path):
            in_list = isinstance(k, int) and isinstance(value, list) and 0 <= k < len(value)
            if not (in_list or (isinstance(k, str) and isinstance(value, dict) and k in value)):
                break
            value = value[k]
        else:  # the value is there
            files |= _holders(e.part, value)
    return " and ".join(f for f in (WEIGHTS, OPTIM, EXTRA) if f in files) or EXTRA


def _step_witnesses(directory: Path, manifest_step: int, progress) -> tuple[str, str] | None:
    """(file(s), reason) if manifest.json's step, extra.json's progress.step and the directory's name disagree."""
    saved_step = progress.get("step") if isinstance(progress, dict) else None
    named = int(m.group(1)) if (m := STEP_DIR.match(directory.name)) else None
    # JSON true == 1 and 10.0 == 10 in Python
    agree = type(saved_step) is int and saved_step == manifest_step
    if agree and named in (None, manifest_step):
        return None
    if agree:
        why = f"but manifest.json and extra.json say step {manifest_step} (renamed or copied in"
        return "", f"its name says step {named}, {why} from another step)"
    if named == manifest_step:
        why = f"progress.step {saved_step!r:.40} differs from step {manifest_step} of manifest.json"
        return EXTRA, f"{why} and the directory's name"
    if named is not None and named == saved_step:
        why = f"step {manifest_step} differs from progress.step {saved_step} of extra.json"
        return MANIFEST, f"{why} and the directory's name"
    neither = "" if named is None else f" (and the directory's name says {named})"
    why = f"the manifest's step {manifest_step} and progress.step {saved_step!r:.40} differ"
    return f"{MANIFEST} and {EXTRA}", why + neither


def _extra_problem(extra) -> str | None:
    if not isinstance(extra, dict):
        return "not a JSON object"
    stranger = next((k for k in extra if k not in NOT_MODEL), None)
    return None if stranger is None else _stranger(f"key {stranger!r:.80}")


def _stranger(what: str) -> str:
    return f"{what} is the state of no part it holds (those of {', '.join(NOT_MODEL)})"


def _read_data(directory: Path, manifest: dict, listed: dict) -> dict | None:
    """data.json, checked against the manifest's data_spec; None for a schema 2.0 checkpoint."""
    if DATA not in REQUIRED_BY[manifest["schema_version"]]:
        return None
    spec = manifest["data_spec"]
    return _read_listed(directory, DATA, listed, problem=lambda data: _data_problem(data, spec))


class CheckpointDir:
    """A checkpoint directory (a step directory, or a link to one): written once, atomically; every read verified."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def exists(self) -> bool:
        """Whether it has a manifest.json (even a dangling link): a checkpoint, if perhaps a damaged one."""
        return os.path.lexists(self.path / MANIFEST)

    def resolved(self) -> Path:
        """The directory the path stands for (links: docs/checkpoints.md), else CheckpointError naming the link."""
        given = self.path
        # `best`, typed inside the store, is a run's link
        path = given if given.is_absolute() else Path.cwd() / given
        for hop in range(MAX_HOPS):
            if path.parent.name == STORE and os.path.islink(path.parent):
                link = f"{path.parent} is a symlink to {_shown(os.readlink(path.parent))}"
                why = f"{link}; a run's {STORE}/ must be a directory inside it"
                raise CheckpointError(given, "", why)
            if not os.path.islink(path):
                return path if hop else given
            target = os.readlink(path)
            if path.parent.name == STORE and (problem := link_problem(path.name, target)):
                where = f"{_shown(target)} (reached through {given})" if hop else _shown(target)
                why = f"is a symlink to {where}, out of its run's {STORE}/: {problem}; remove it"
                raise CheckpointError(path, "", why)
            path = path.parent / target
        raise CheckpointError(given, "", f"more than {MAX_HOPS} symlinks to follow")

    def write(self, tree: dict, fields: dict, replace: bool = False) -> dict:
        """`tree` as a checkpoint here, atomically; `fields`: the manifest's (but files) and data.json's data_facts."""
        directory, data = self.path, fields[mf.DATA_FACTS]
        weights, other, extra = _by_file(tree)
        os.makedirs(directory.parent, exist_ok=True)
        atomic.remove_temporaries(directory.parent)
        # a signal or an error mid-save: the half-made temporary goes now or at the next save
        tmp = atomic.new_temp_dir(directory.parent, directory.name)
        with atomic.temporary(tmp, directory):
            # each file hashed as written, fsynced before listed; the tensor files side by side (sha256 < disk)
            with ThreadPoolExecutor(1, thread_name_prefix="save-weights") as pool:
                weights_entry = pool.submit(tensors.write_tensors, tmp / WEIGHTS, weights)
                files = {OPTIM: tensors.write_tensors(tmp / OPTIM, other)}
                files[WEIGHTS] = weights_entry.result()
            killpoint.point("save", "after weights")
            killpoint.point("save", "after optim")
            files[EXTRA] = atomic.write_new(tmp / EXTRA, jsonio.dumps(extra, indent=None))
            files[DATA] = atomic.write_new(tmp / DATA, jsonio.dumps(data, indent=None))
            manifest = {k: v for k, v in fields.items() if k != mf.DATA_FACTS} | {"files": files}
            killpoint.point("save", "before manifest")
            # last: a directory with a manifest is complete
            atomic.write_new(tmp / MANIFEST, jsonio.dumps(manifest))
            killpoint.point("save", "before rename")
            atomic.publish_dir(tmp, directory, replace=replace)
            killpoint.point("save", "after rename")
        return manifest

    def manifest(self) -> dict:
        """manifest.json, bounded in size and depth and checked against itself; CheckpointError otherwise."""
        try:
            return mf.check(jsonio.loads(self.manifest_file()[1]))
        except (jsonio.JSONError, mf.ManifestError) as e:
            raise self.fault(str(e)) from None

    def fault(self, reason: str, error: type = CheckpointError) -> CheckpointError:
        """The error naming its manifest.json for `reason`."""
        return error(self.path, MANIFEST, reason)

    def manifest_as_written(self) -> dict:
        """manifest.json as on disk, bounded but unchecked ({}: unreadable or not an object), shown beside a verdict."""
        with contextlib.suppress(ValueError, CheckpointError):
            if isinstance(manifest := jsonio.loads(self.manifest_file()[1]), dict):
                return manifest
        return {}

    def manifest_file(self) -> tuple[str, bytes]:
        """(name, bytes) of manifest.json as on disk, bounded, for an index to upload; CheckpointError otherwise."""
        try:
            return MANIFEST, reading.read_bytes(self.resolved() / MANIFEST, MAX_CHECKPOINT_JSON)
        except FileNotFoundError:
            raise self.fault("missing (an incomplete or foreign directory)") from None
        except OSError as e:
            raise self.fault(_os_reason(e)) from None

    def weights_file(self) -> Path:
        """weights.safetensors, checked a regular file of its listed size, to stream; else CheckpointError."""
        return self._opened()[0] / WEIGHTS

    def copy_to(self, dest: Path, manifest: dict) -> dict[str, dict]:
        """Its files, still those the verified `manifest` lists, copied into the new `dest`, hashed: {name: entry}."""
        directory, _, listed = self._opened(manifest)
        os.mkdir(dest)
        copied = {}
        for name in [*sorted(listed), MANIFEST]:
            entry = listed.get(name)
            bound = entry["size"] if entry else MAX_CHECKPOINT_JSON
            copied[name] = reading.copy_new(directory / name, dest / name, bound)
            if entry is not None and copied[name] != {k: entry[k] for k in ("size", "sha256")}:
                why = "its bytes differ from manifest.json (changed or damaged while being copied)"
                raise CheckpointError(directory, name, why)
        atomic.fsync_dir(dest)
        return copied

    def second_names(self, dest: Path) -> None:
        """Every file of it given a second name (a hard link: its files are never rewritten) in the new `dest`."""
        os.mkdir(dest)
        with os.scandir(self.path) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    atomic.second_name(Path(e.path), dest / e.name)
        atomic.fsync_dir(dest)

    def data_facts(self, manifest: dict | None = None) -> dict | None:
        """Its data.json, verified, tensors unread (None: schema 2.0); its manifest still `manifest`, if given."""
        return _read_data(*self._opened(manifest))

    def json_state(self) -> tuple[dict, dict]:
        """(manifest, extra.json), each verified, without reading the tensors; else CheckpointError."""
        directory, manifest, listed = self._opened()
        return manifest, _read_listed(directory, EXTRA, listed, problem=_extra_problem)

    def _opened(self, expected: dict | None = None) -> tuple[Path, dict, dict]:
        """(directory, manifest, listing), its files as listed (sizes, not hashes) and its manifest `expected`'s."""
        directory = self.resolved()  # read from where the links lead; errors name that directory
        if not directory.is_dir():
            raise CheckpointError(self.path, "", "not a directory")
        manifest = CheckpointDir(directory).manifest()
        listed = manifest["files"]
        if unlisted := [n for n in REQUIRED_BY[manifest["schema_version"]] if n not in listed]:
            raise CheckpointError(directory, MANIFEST, f"does not list {unlisted[0]}")
        # the files are hashed as they are read (load), not here
        if problem := next(listing.problems(directory, listed, MANIFEST, hashed=False), None):
            raise CheckpointError(directory, f"{problem[0]:.100}", problem[1])
        if expected is not None and manifest != expected:
            raise CheckpointError(directory, MANIFEST, "changed while it was read")
        return directory, manifest, listed

    def load(self, parts: Mapping | None = None) -> Checkpoint:
        """Read and fully verify a checkpoint (fitting the live `parts`, if given), else CheckpointError."""
        directory, manifest, listed = self._opened()
        extra = _read_listed(directory, EXTRA, listed, problem=_extra_problem)
        data = _read_data(directory, manifest, listed)
        live = capture(parts) if parts is not None else None
        weights_fit = optim_fits = None
        if parts is not None and live is not None:
            # a part's state as older code saved it fits too (legacy_state: afe8033's iterator's permutation)
            older = {n: p.legacy_state() for n, p in parts.items() if hasattr(p, "legacy_state")}
            weights_fit = [tensors.layout(live["model"])]
            fits = [live, {**live, **older}] if older else [live]
            optim_fits = [tensors.layout(_by_file(t)[1]) for t in fits]
        # side by side, as in write()
        with ThreadPoolExecutor(1, thread_name_prefix="load-weights") as pool:
            weights_read = pool.submit(_read_listed, directory, WEIGHTS, listed, weights_fit)
            try:
                other = _read_listed(directory, OPTIM, listed, optim_fits)
            finally:
                # weights.safetensors' own error first, as the files are listed
                weights = weights_read.result()
        if bad := [p for p in other if SEP not in p or p.partition(SEP)[0] not in NOT_MODEL]:
            raise CheckpointError(directory, OPTIM, _stranger(f"tensor {bad[0]!r:.80}"))
        try:
            tree = merge(other, extra)
        except ValueError as e:
            raise CheckpointError(directory, OPTIM, str(e)) from None
        tree["model"] = weights
        if missing := [p for p in PARTS if p not in tree]:
            raise CheckpointError(directory, EXTRA, f"lacks the state of {missing}")
        if lie := _step_witnesses(directory, manifest["step"], tree["progress"]):
            raise CheckpointError(directory, *lie)
        if parts is not None and live is not None:
            try:
                check(parts, tree)
            except StateMismatch as e:
                why = f"{e.part} does not fit the live run: {e.reason}"
                raise MisfitError(directory, files_of(e, tree, live), why) from None
        return Checkpoint(self.path, manifest, tree, data)
