"""The only code that touches checkpoint directories (layout: docs/checkpoints.md): write, load, list, link, prune."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from pipeline.files import jsonio
from pipeline.files import killpoint
from pipeline.files import reading
from pipeline.files.atomic import (TMP_PREFIX, UnsafePathError, discard_dir, ensure_dirs, fsync_dir, new_temp_dir,
                                   publish_dir, remove_temporaries, remove_tree, replace_link, second_name, write_new)
from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.errors import CheckpointError, MisfitError
from pipeline.checkpoint.retention import AnyOf, Named, Policy, Record, Steps, select_one
from pipeline.checkpoint.tensors import DigestMismatch, LayoutMisfit, layout, read_tensors, write_tensors
from pipeline.stateful import PARTS, SEP, StateMismatch, capture, check, merge, split

WEIGHTS, OPTIM, EXTRA, MANIFEST = "weights.safetensors", "optim.safetensors", "extra.json", "manifest.json"
DATA = "data.json"
REQUIRED = (WEIGHTS, OPTIM, EXTRA, DATA)
REQUIRED_BY = {"2.0": (WEIGHTS, OPTIM, EXTRA), mf.SCHEMA_VERSION: REQUIRED}  # schema_version -> files it lists
MAX_JSON = 16 << 20  # bytes of manifest.json, extra.json or data.json: a few KB (a 65,536-token vocabulary, < 1 MB)
# data.json's strings, bounded so that decoding a sample costs what its tokens say: a corpus's tokens are
# characters or lexicon words, its decode_join '' or ' ', its specials a role or two (eos).
MAX_TOKEN, MAX_JOIN, MAX_SPECIALS = 256, 16, 16
STEP_DIR = re.compile(r"^step-(\d{8,})$")
CHECKPOINTS = "checkpoints"  # the name of a run's checkpoint store: links inside it stay inside it
MAX_HOPS = 8  # links followed from a path to its checkpoint directory
LINKED = "is a symlink; a checkpoint's files must be regular files inside it"
CORRUPTED = "sha256 differs from manifest.json (corrupted)"
SCHEMA_VERSION = mf.SCHEMA_VERSION


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Checkpoint:
    directory: Path
    manifest: dict
    state: dict  # {part: state_dict}: arrays (tied names one object) and JSON values
    data: dict | None = None  # data.json, verified (None: a schema 2.0 checkpoint, written without it)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def record_of(manifest: dict) -> Record:
    metrics = {k: jsonio.number(v) for k, v in manifest["metrics"].items()}
    return Record(int(manifest["step"]), metrics, frozenset(manifest["tags"]), manifest["lineage"]["id"])


def _by_file(tree: dict) -> tuple[dict, dict, dict]:
    """A state tree as what weights.safetensors, optim.safetensors and extra.json hold."""
    arrays, json_tree = split(tree)
    other = {k: a for k, a in arrays.items() if not k.startswith("model" + SEP)}
    return tree["model"], other, {k: v for k, v in json_tree.items() if k != "model"}


# --- one checkpoint directory ------------------------------------------------------------------------

def write(directory: Path, tree: dict, fields: dict, replace: bool = False) -> dict:
    """Write `tree` as a checkpoint at `directory`, atomically (replace=True swaps out one already there);
    `fields`: the manifest's but `files`, and `data_facts`, written as data.json. Returns the manifest."""
    directory = Path(directory)
    fields = dict(fields)
    data = fields.pop(mf.DATA_FACTS)
    weights, other, extra = _by_file(tree)
    os.makedirs(directory.parent, exist_ok=True)
    remove_temporaries(directory.parent)
    tmp = new_temp_dir(directory.parent, directory.name)
    try:
        # Each file is hashed from the bytes as they are written and fsynced before it is listed; the two
        # tensor files are written side by side, as sha256 of one stream is slower than the disk.
        with ThreadPoolExecutor(1, thread_name_prefix="save-weights") as pool:
            weights_entry = pool.submit(write_tensors, tmp / WEIGHTS, weights)
            files = {OPTIM: write_tensors(tmp / OPTIM, other)}
            files[WEIGHTS] = weights_entry.result()
        killpoint.point("save", "after weights")
        killpoint.point("save", "after optim")
        files[EXTRA] = write_new(tmp / EXTRA, jsonio.dumps(extra, indent=None))
        files[DATA] = write_new(tmp / DATA, jsonio.dumps(data, indent=None))  # sorted keys: the same bytes each save
        manifest = {**fields, "files": files}
        killpoint.point("save", "before manifest")
        write_new(tmp / MANIFEST, jsonio.dumps(manifest))  # last: a directory with a manifest is complete
        killpoint.point("save", "before rename")
        publish_dir(tmp, directory, replace=replace)
        killpoint.point("save", "after rename")
    except BaseException:
        remove_tree(tmp)  # a signal or an error mid-save: the half-made temporary goes now or at the next save
        raise
    return manifest


def _shown(target: str) -> str:
    return repr(target if len(target) <= 200 else target[:200] + "...")


def link_problem(name: str, target: str) -> str | None:
    """Why a link called `name` inside checkpoints/ may not point at `target` (None: it may)."""
    if STEP_DIR.match(name):
        return "a step directory must be a directory, not a link"
    if not STEP_DIR.match(target):
        return "a link in checkpoints/ names a step directory beside it (step-NNNNNNNN)"
    return None


def checkpoint_dir(path: Path) -> Path:
    """The directory `path` stands for, else CheckpointError naming the link and where it points. Every reader
    comes here: a link inside checkpoints/ must name a step directory beside it (best, final), checkpoints/
    must not be a link; a link elsewhere (`ln -s RUN/checkpoints/best mine`) is followed, as its target could
    be typed instead."""
    given = Path(path)
    path = given if given.is_absolute() else Path.cwd() / given  # `best`, typed inside checkpoints/, is a run's link
    for hop in range(MAX_HOPS):
        if path.parent.name == CHECKPOINTS and os.path.islink(path.parent):
            raise CheckpointError(given, "", f"{path.parent} is a symlink to {_shown(os.readlink(path.parent))}; "
                                             "a run's checkpoints/ must be a directory inside it")
        if not os.path.islink(path):
            return path if hop else given
        target = os.readlink(path)
        if path.parent.name == CHECKPOINTS and (problem := link_problem(path.name, target)):
            where = f" (reached through {given})" if hop else ""
            raise CheckpointError(path, "", f"is a symlink to {_shown(target)}{where}, out of its run's checkpoints/: "
                                            f"{problem}; remove it")
        path = path.parent / target
    raise CheckpointError(given, "", f"more than {MAX_HOPS} symlinks to follow")


def read_manifest(directory: Path) -> dict:
    """manifest.json, bounded in size and depth and checked against itself; CheckpointError otherwise."""
    directory = Path(directory)
    real = checkpoint_dir(directory)
    try:
        raw = reading.read_bytes(real / MANIFEST, MAX_JSON)
    except FileNotFoundError:
        raise CheckpointError(directory, MANIFEST, "missing (an incomplete or foreign directory)") from None
    except OSError as e:
        raise CheckpointError(directory, MANIFEST, _os_reason(e)) from None
    try:
        return mf.check(jsonio.loads(raw))
    except (jsonio.JSONError, mf.ManifestError) as e:
        raise CheckpointError(directory, MANIFEST, str(e)) from None


def manifest_fault(directory: Path, reason: str, error: type = CheckpointError) -> CheckpointError:
    return error(directory, MANIFEST, reason)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` has a manifest.json (even a dangling link): a checkpoint, if perhaps a damaged one."""
    return os.path.lexists(Path(path) / MANIFEST)


def manifest_as_written(directory: Path) -> dict:
    """manifest.json as on disk, bounded but unchecked ({}: unreadable or not an object), to show beside a verdict."""
    try:
        manifest = jsonio.read(checkpoint_dir(directory) / MANIFEST, MAX_JSON)
    except (OSError, ValueError, CheckpointError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def manifest_file(directory: Path) -> tuple[str, bytes]:
    """(name, bytes) of manifest.json as on disk, bounded, for an index to upload; CheckpointError otherwise."""
    directory = checkpoint_dir(directory)
    try:
        return MANIFEST, reading.read_bytes(directory / MANIFEST, MAX_JSON)
    except OSError as e:
        raise CheckpointError(directory, MANIFEST, _os_reason(e)) from None


def weights_bytes(manifest: dict) -> int:
    """The size the manifest lists for the weights file: what the model its config describes can hold at most."""
    return int(manifest["files"][WEIGHTS]["size"])


def weights_file(directory: Path) -> Path:
    """weights.safetensors, checked a regular file of its listed size, for a streaming reader; else CheckpointError."""
    return _opened(Path(directory))[0] / WEIGHTS


def file_hashes(manifest: dict) -> dict[str, str | None]:
    """{"weights", "optim", "extra", "data": sha256} of the files a manifest (verified or as written) lists readably."""
    files = manifest["files"] if isinstance(manifest.get("files"), dict) else {}
    roles = {WEIGHTS: "weights", OPTIM: "optim", EXTRA: "extra", DATA: "data"}
    return {roles[n]: e.get("sha256") for n, e in files.items() if n in roles and isinstance(e, dict)}


def copy_list(directory: Path, manifest: dict) -> list[tuple[str, Path, dict | None]]:
    """(name, path, listed entry) of every file in copying order, manifest.json last (entry None); the directory
    must hold exactly those and still have the verified `manifest`; CheckpointError otherwise."""
    directory, _, listed = _opened(Path(directory), manifest)
    return [*((n, directory / n, e) for n, e in sorted(listed.items())), (MANIFEST, directory / MANIFEST, None)]


def _os_reason(e: BaseException) -> str:
    if not isinstance(e, OSError):
        return str(e)
    return LINKED if e.errno == errno.ELOOP else e.strerror or type(e).__name__


def _check_listing(directory: Path, manifest: dict) -> dict[str, dict]:
    """Every listed file present as a regular file of its listed size, and nothing unlisted."""
    listed = manifest["files"]
    for name, entry in listed.items():
        if name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointError(directory, MANIFEST, f"lists an invalid file name {name!r:.80}")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str) and mf.SHA256.match(entry["sha256"])):
            raise CheckpointError(directory, MANIFEST, f"entry for {name} needs an integer size and a sha256 hex digest")
    for name in REQUIRED_BY[manifest["schema_version"]]:
        if name not in listed:
            raise CheckpointError(directory, MANIFEST, f"does not list {name}")
    present = {}
    with os.scandir(directory) as it:  # the first stranger ends the scan: a million planted files cost nothing
        for e in it:
            if e.name != MANIFEST and e.name not in listed:
                raise CheckpointError(directory, f"{e.name:.100}", "present but not listed in manifest.json")
            present[e.name] = e
    for name, entry in sorted(listed.items()):
        if name not in present:
            raise CheckpointError(directory, name, "listed in manifest.json but missing")
        st = present[name].stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(directory, name, LINKED)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(directory, name, f"is {reading.kind_of(st)}, not a regular file")
        if st.st_size != entry["size"]:
            raise CheckpointError(directory, name, f"size {st.st_size} bytes, manifest says {entry['size']}")
    return listed


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
    if not (isinstance(vocab, list) and all(isinstance(t, str) for t in vocab)) or len(set(vocab)) != len(vocab):
        return "vocab must be a list of distinct tokens"
    if len(vocab) != size:
        return f"vocab holds {len(vocab)} tokens, but the manifest's data_spec says vocab_size {size!r:.20}"
    if longest := max((t for t in vocab if len(t) > MAX_TOKEN), key=len, default=None):
        return f"a token of {len(longest)} characters: tokens are at most {MAX_TOKEN}"
    if not isinstance(join, str) or len(join) > MAX_JOIN:
        return f"decode_join must be a string of at most {MAX_JOIN} characters (a text's is '' or ' ')"
    if not (isinstance(specials, dict) and len(specials) <= MAX_SPECIALS
            and all(isinstance(r, str) and len(r) <= MAX_TOKEN and isinstance(t, str) and t in vocab
                    for r, t in specials.items())):
        return f"specials must map at most {MAX_SPECIALS} roles to tokens of vocab"
    return None


def _listed_json(directory: Path, name: str, listed: dict):
    """A listed JSON file, bounded, hashed against its listing, parsed strictly; CheckpointError naming it."""
    try:
        raw = reading.read_bytes(directory / name, MAX_JSON)
    except OSError as e:
        raise CheckpointError(directory, name, _os_reason(e)) from None
    if hashlib.sha256(raw).hexdigest() != listed[name]["sha256"]:
        raise CheckpointError(directory, name, CORRUPTED)
    try:
        return jsonio.loads(raw)
    except jsonio.JSONError as e:
        raise CheckpointError(directory, name, str(e)) from None


def _read_data(directory: Path, manifest: dict, listed: dict) -> dict | None:
    """data.json, checked against the manifest's data_spec; None for a schema 2.0 checkpoint."""
    if DATA not in REQUIRED_BY[manifest["schema_version"]]:
        return None
    data = _listed_json(directory, DATA, listed)
    if problem := _data_problem(data, manifest["data_spec"]):
        raise CheckpointError(directory, DATA, problem)
    return data


def data_facts(directory: Path, manifest: dict | None = None) -> dict | None:
    """A checkpoint's data.json, verified, without reading the tensors (None: schema 2.0); given a `manifest` a
    caller verified before, the checkpoint must still have it."""
    return _read_data(*_opened(Path(directory), manifest))


def json_state(directory: Path) -> tuple[dict, dict]:
    """(manifest, extra.json) of a checkpoint, each verified, without reading the tensors; else CheckpointError."""
    directory, manifest, listed = _opened(Path(directory))
    return manifest, _read_extra(directory, listed)


def _opened(given: Path, expected: dict | None = None) -> tuple[Path, dict, dict]:
    """(directory, manifest, listing) of the checkpoint `given` stands for, its listing checked (and its
    manifest still the `expected` one a caller read before)."""
    directory = checkpoint_dir(given)  # read from where the links lead; errors name that directory
    if not directory.is_dir():
        raise CheckpointError(given, "", "not a directory")
    manifest = read_manifest(directory)
    listed = _check_listing(directory, manifest)
    if expected is not None and manifest != expected:
        raise CheckpointError(directory, MANIFEST, "changed while it was read")
    return directory, manifest, listed


def _read_extra(directory: Path, listed: dict) -> dict:
    extra = _listed_json(directory, EXTRA, listed)
    if not isinstance(extra, dict):
        raise CheckpointError(directory, EXTRA, "not a JSON object")
    return extra


def _read_tensor_file(directory: Path, name: str, entry: dict, expect: dict | None) -> dict[str, np.ndarray]:
    try:
        arrays, _ = read_tensors(directory / name, expected_sha256=entry["sha256"], expect=expect)
    except DigestMismatch:
        raise CheckpointError(directory, name, CORRUPTED) from None
    except LayoutMisfit as e:
        raise MisfitError(directory, name, str(e)) from None
    except (ValueError, OSError) as e:
        raise CheckpointError(directory, name, _os_reason(e)) from None
    return arrays


_ABSENT = object()


def _at(tree, keys: tuple):
    for k in keys:
        if not (isinstance(k, int) and isinstance(tree, list) and 0 <= k < len(tree)
                or isinstance(k, str) and isinstance(tree, dict) and k in tree):
            return _ABSENT
        tree = tree[k]
    return tree


def _holders(part: str, value) -> set[str]:
    if part == "model" or isinstance(value, np.ndarray):
        return {WEIGHTS if part == "model" else OPTIM}
    if isinstance(value, dict) and value:
        return set().union(*(_holders(part, v) for v in value.values()))
    return {EXTRA}


def files_of(e: StateMismatch, saved: dict, live: dict) -> str:
    """The file(s) holding a StateMismatch's value: where the saved one was read from, the live one would be."""
    files = set()
    for tree in (saved, live):
        value = _at(tree, (e.part, *e.path))
        if value is not _ABSENT:
            files |= _holders(e.part, value)
    return " and ".join(f for f in (WEIGHTS, OPTIM, EXTRA) if f in files) or EXTRA


def _step_witnesses(directory: Path, manifest_step: int, saved_step) -> tuple[str, str] | None:
    """(file(s), reason) if manifest.json's step, extra.json's progress.step and the directory's name (if it has
    one) disagree: the odd one out is the file that lies."""
    m = STEP_DIR.match(directory.name)
    named = int(m.group(1)) if m else None
    if saved_step == manifest_step:
        if named is None or named == manifest_step:
            return None
        return "", (f"its name says step {named}, but manifest.json and extra.json say step {manifest_step} "
                    "(renamed or copied in from another step)")
    if named == manifest_step:
        return EXTRA, (f"progress.step {saved_step!r:.40} differs from step {manifest_step} of manifest.json and "
                       "the directory's name")
    if named is not None and named == saved_step:
        return MANIFEST, (f"step {manifest_step} differs from progress.step {saved_step} of extra.json and the "
                          "directory's name")
    neither = "" if named is None else f" (and the directory's name says {named})"
    return f"{MANIFEST} and {EXTRA}", (f"the manifest's step {manifest_step} and progress.step {saved_step!r:.40} "
                                       f"differ{neither}")


def load(directory: Path, parts: Mapping | None = None) -> Checkpoint:
    """Read and fully verify a checkpoint, else CheckpointError naming the file; given the live `parts` (or a
    config's), the tensor files must hold their layout (checked before anything is allocated) and every
    part's state must fit (pipeline.stateful.check): a verified checkpoint is one the run can restore."""
    given = Path(directory)
    directory, manifest, listed = _opened(given)
    extra = _read_extra(directory, listed)
    data = _read_data(directory, manifest, listed)
    live = capture(parts) if parts is not None else None
    weights_layout, optim_layout = (None, None) if live is None else [layout(t) for t in _by_file(live)[:2]]
    with ThreadPoolExecutor(1, thread_name_prefix="load-weights") as pool:  # side by side, as in write()
        weights_read = pool.submit(_read_tensor_file, directory, WEIGHTS, listed[WEIGHTS], weights_layout)
        try:
            other = _read_tensor_file(directory, OPTIM, listed[OPTIM], optim_layout)
        finally:
            weights = weights_read.result()  # weights.safetensors' own error first, as the files are listed
    for path in other:
        part = path.split(SEP, 1)[0]
        if part not in PARTS or part == "model" or SEP not in path:
            raise CheckpointError(directory, OPTIM, f"tensor {path!r:.80} belongs to no state machine")
    try:
        tree = merge(other, extra)
    except ValueError as e:
        raise CheckpointError(directory, OPTIM, str(e)) from None
    tree["model"] = weights
    missing = [p for p in PARTS if p not in tree]
    if missing:
        raise CheckpointError(directory, EXTRA, f"lacks the state of {missing}")
    progress = tree["progress"]
    saved_step = progress.get("step") if isinstance(progress, dict) else None
    if lie := _step_witnesses(directory, manifest["step"], saved_step):
        raise CheckpointError(directory, *lie)
    if parts is not None:
        try:
            check(parts, tree)
        except StateMismatch as e:
            raise MisfitError(directory, files_of(e, tree, live), f"{e.part} does not fit the live run: "
                                                                    f"{e.reason}") from None
    return Checkpoint(given, manifest, tree, data)


def verify(directory: Path, parts: Mapping | None = None) -> dict:
    """load() for its verdict: the manifest, or CheckpointError."""
    return load(directory, parts).manifest


# --- a run's checkpoints -------------------------------------------------------------------------------

class CheckpointStore:
    """`<run>/checkpoints/`: step directories, the links stages declare, and retention after every save."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._records: dict[int, Record] | None = None

    # listing
    def scan(self) -> tuple[list[tuple[int, Path]], dict[str, str]]:
        """(step, directory) of every step directory, oldest first, and {link name: target name}; temporaries
        ignored, anything else (a stray link or file) an UnsafePathError naming it."""
        if not os.path.lexists(self.root):
            return [], {}
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(errno.ELOOP, f"{self.root} is not a directory (a symlink or a file); "
                                               "remove it")
        steps, links = [], {}
        with os.scandir(self.root) as it:
            for e in it:
                if e.name.startswith(TMP_PREFIX):
                    continue
                m = STEP_DIR.match(e.name)
                if e.is_symlink():
                    target = os.readlink(e.path)
                    if problem := link_problem(e.name, target):
                        raise UnsafePathError(errno.ELOOP, f"{e.path} is a symlink to {_shown(target)}: {problem}; "
                                                           "remove it")
                    links[e.name] = target
                elif m and e.is_dir(follow_symlinks=False):
                    steps.append((int(m.group(1)), Path(e.path)))
                else:
                    raise UnsafePathError(errno.EEXIST, f"{e.path} is not a checkpoint step directory; "
                                                        "checkpoints/ holds step directories and links only: remove it")
        return sorted(steps), links

    def steps(self) -> list[tuple[int, Path]]:
        return self.scan()[0]

    def links(self) -> dict[str, str]:
        return self.scan()[1]

    def records(self) -> list[Record]:
        """Each step directory's record, read from its manifest once (unreadable ones have none)."""
        if self._records is None:
            self._records = {}
            for step, directory in self.steps():
                with contextlib.suppress(CheckpointError):
                    self._records[step] = record_of(read_manifest(directory))
        return [self._records[s] for s in sorted(self._records)]

    def newest_valid(self, parts: Mapping | None = None) -> tuple[Checkpoint | None, list[tuple[Path, str, str]]]:
        """The newest checkpoint that verifies (and fits `parts`), and (directory, what it is, the error) for each
        newer one skipped: damaged, or verified but made by a config whose state does not fit the live run."""
        skipped = []
        for _, directory in reversed(self.steps()):
            try:
                return load(directory, parts), skipped
            except MisfitError as e:
                skipped.append((directory, "a checkpoint that verifies but does not fit this config", str(e)))
            except CheckpointError as e:
                skipped.append((directory, "a damaged checkpoint", str(e)))
        return None, skipped

    def newest_manifest(self) -> tuple[Path, dict] | None:
        """The newest step directory and its manifest, the rest unread (None: no step, or its manifest is bad)."""
        steps = self.steps()
        try:
            return (steps[-1][1], read_manifest(steps[-1][1])) if steps else None
        except CheckpointError:
            return None

    # writing
    def save(self, step: int, tree: dict, fields: dict) -> Checkpoint:
        """Write and record this step's checkpoint, replacing whatever (another run's, a damaged one) is there."""
        ensure_dirs(self.root.parent, self.root.name)
        directory = self.root / step_dir_name(step)
        manifest = write(directory, tree, fields, replace=True)
        self.records()
        self._records[step] = record_of(manifest)
        return Checkpoint(directory, manifest, tree, fields[mf.DATA_FACTS])

    def retain(self, policy: Policy, links: dict[str, Policy], upto: int, lineage: str,
               named: tuple[Named, ...] = ()) -> None:
        """Point each link at what its policy selects, then delete the step directories no policy keeps.

        Only checkpoints of the history being run (`lineage`, up to the current step `upto`) are ever linked or
        deleted; any other step directory (another history's, an unreadable one) is left where it is. A link
        no stage declares any more (a stage removed by override) keeps its target. `named`: second names of
        kept steps; a name one of them gave a step it no longer keeps goes before that step may."""
        present_steps, present_links = self.scan()  # once: linking changes no step directory
        records = [r for r in self.records() if r.step <= upto and r.lineage == lineage]
        by_step = {r.step: r for r in records}
        wanted = {name: step for n in named for name, step in n.links(records).items() if name not in links}
        retired = {name for name, t in present_links.items() if name not in links and name not in wanted
                   and (r := by_step.get(int(STEP_DIR.match(t).group(1)))) and any(n.owns(name, r) for n in named)}
        orphan_targets = {int(STEP_DIR.match(t).group(1)) for name, t in present_links.items()
                          if name not in links and name not in retired}
        keep = AnyOf((policy, Steps(frozenset(orphan_targets)), *links.values())).keep(records)
        for name, link_policy in links.items():
            target = select_one(link_policy, records)
            if target is not None and present_links.get(name) != step_dir_name(target):
                killpoint.point("save", f"before {name} link")
                replace_link(self.root / name, step_dir_name(target))
        for name, step in wanted.items():
            if present_links.get(name) != step_dir_name(step):
                killpoint.point("save", "before a named link")
                replace_link(self.root / name, step_dir_name(step))
        for name in retired:  # before its step directory: a link never names a missing step
            killpoint.point("save", "before a name is retired")
            os.unlink(self.root / name)
        if retired:
            fsync_dir(self.root)
        for step, directory in present_steps:
            if step not in keep and step in {r.step for r in records}:
                killpoint.point("save", "before delete")
                discard_dir(directory)
                self._records.pop(step, None)

    def keep_into(self, dest: Path, step_dirs: list[Path], snapshot: bool) -> None:
        """Move these step directories into `dest` (a new store beside nothing); with `snapshot`, give every
        other step directory's files and every link a second name there too (hard links: no byte copied; a
        checkpoint's files are never rewritten in place, so each name keeps what it holds now)."""
        if not (step_dirs or snapshot):
            return
        os.mkdir(dest)
        for d in step_dirs:
            os.rename(d, dest / d.name)
        if snapshot:
            steps, links = self.scan()
            for _, d in steps:
                os.mkdir(dest / d.name)
                with os.scandir(d) as it:
                    for e in it:
                        if e.is_file(follow_symlinks=False):
                            second_name(Path(e.path), dest / d.name / e.name)
                fsync_dir(dest / d.name)
            for name, target in links.items():
                os.symlink(target, dest / name)
        fsync_dir(dest)
        fsync_dir(self.root)
        self._records = None

    def link_dir(self, name: str) -> Path | None:
        """The step directory a link points at, if the link exists and names one here."""
        target = self.links().get(name)
        return self.root / target if target and (self.root / target).is_dir() else None

    def link_step(self, name: str) -> int | None:
        target = self.links().get(name)
        return int(STEP_DIR.match(target).group(1)) if target else None
