"""Strict JSON wherever a checkpoint or a run file is read: one meaning for every reader (pipeline/files/jsonio.py
`loads`), and each refusal naming the file -- manifest.json, extra.json, a safetensors header, run.json,
metrics.jsonl, a sweep's job records."""

from __future__ import annotations

import json
import logging
import math
import struct
import sys

import pytest
from conftest import KERNODECK, relist

from pipeline.checkpoint import manifest as mf
from pipeline.checkpoint.directory import EXTRA, MANIFEST, WEIGHTS, CheckpointDir, step_dir_name
from pipeline.checkpoint.errors import CheckpointError, RunFileError
from pipeline.cli.roundtrip import Fresh
from pipeline.config.compose import compose, to_plain
from pipeline.files import jsonio
from pipeline.run.directory import RunDir
from pipeline.sweep.summary import read_jobs

# -- loads ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"files": {"a": 1}, "files": {"b": 2}}', "duplicate key 'files'"),
        (
            '{"x": [{"k": 1, "y": 0, "k": 1}]}',
            "duplicate key 'k'",
        ),  # same value twice is still two keys
        ('{"loss": 1e999}', "number 1e999 is out of range"),
        ("[-1e999]", "number -1e999 is out of range"),
        ("[1.7976931348623159E308]", "number 1.7976931348623159E308 is out of range"),
        ("[" + "9" * 5000 + "]", "integer 99999999999999999999... of 5000 digits is out of range"),
        ('{"a": NaN}', "contains NaN"),
        ("[Infinity]", "contains Infinity"),
        ("[-Infinity]", "contains -Infinity"),
    ],
    ids=[
        "duplicate-top",
        "duplicate-nested",
        "1e999",
        "-1e999",
        "just-over-max",
        "long-int",
        "nan",
        "inf",
        "-inf",
    ],
)
def test_loads_refuses_what_readers_read_differently(text, words):
    with pytest.raises(jsonio.JSONError) as info:
        jsonio.loads(text)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_loads_keeps_what_is_standard_and_exact():
    assert jsonio.loads('{"a": 1, "b": {"a": 2}}') == {"a": 1, "b": {"a": 2}}  # one key per object
    assert jsonio.loads("[1.7976931348623157e308, 5e-324, 1e-999]") == [
        sys.float_info.max,
        5e-324,
        0.0,
    ]
    assert jsonio.loads("[" + "9" * 4000 + "]") == [int("9" * 4000)]
    back = [
        jsonio.number(v) for v in jsonio.loads(jsonio.dumps([math.inf, -math.inf, math.nan, 2]))
    ]
    assert back[:2] == [math.inf, -math.inf] and math.isnan(back[2]) and back[3] == 2.0


def test_number_refuses_what_is_not_a_finite_or_named_float():
    for bad in (10**400, "1e999", None, True, [1.0]):
        with pytest.raises(jsonio.JSONError):
            jsonio.number(bad)


def test_read_names_the_file(tmp_path):
    p = tmp_path / "sweep.json"
    p.write_text('{"id": "a", "id": "b"}')
    with pytest.raises(jsonio.JSONError, match=rf"^{p}: duplicate key 'id'"):
        jsonio.read(p, 1 << 10)
    p.write_text("{}" + " " * 2000)
    with pytest.raises(
        OSError, match=rf"^{p}: .*over the 1024-byte limit"
    ):  # refused unread (pipeline.files.reading)
        jsonio.read(p, 1 << 10)


# -- a checkpoint ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict")
    run = Fresh(to_plain(compose([*KERNODECK, f"paths.output_dir={root / 'out'}"])))
    run.train(4)
    directory = root / "checkpoints" / step_dir_name(4)
    run.save(directory)
    return directory


@pytest.fixture
def ckpt(saved, tmp_path):
    directory = tmp_path / "checkpoints" / saved.name
    directory.mkdir(parents=True)
    for p in saved.iterdir():
        (directory / p.name).write_bytes(p.read_bytes())
    return directory


def refused(directory, file, words):
    """CheckpointDir.load refuses (CheckpointDir.manifest too, for manifest.json) in one line naming the directory
    and the file."""
    readers = (
        (CheckpointDir.manifest, CheckpointDir.load) if file == MANIFEST else (CheckpointDir.load,)
    )
    for read in readers:
        with pytest.raises(CheckpointError) as info:
            read(CheckpointDir(directory))
        message = str(info.value)
        assert message.startswith(f"checkpoint {directory}: {file}: ") and words in message, message
        assert "\n" not in message
    return info.value


def test_a_manifest_with_a_lying_first_files_table_is_refused(ckpt):
    text = (ckpt / MANIFEST).read_text()
    lie = json.dumps({n: {"size": 1, "sha256": "0" * 64} for n in json.loads(text)["files"]})
    (ckpt / MANIFEST).write_text('{"files": ' + lie + ", " + text.lstrip()[1:])
    assert (
        json.loads((ckpt / MANIFEST).read_text())["files"] == json.loads(text)["files"]
    )  # Python: the last
    refused(ckpt, MANIFEST, "duplicate key 'files'")


@pytest.mark.parametrize(
    "metric, words",
    [
        ("1e999", "number 1e999 is out of range"),
        ("1" + "0" * 400, "is out of range for a float"),
        ('"low"', "metric 'val/loss': 'low' is not a number"),
    ],
    ids=["1e999", "huge-int", "string"],
)
def test_a_manifest_metric_must_be_a_number_in_range(ckpt, metric, words):
    m = json.loads((ckpt / MANIFEST).read_text())
    m["metrics"]["val/loss"] = "PLACEHOLDER"
    (ckpt / MANIFEST).write_text(json.dumps(m).replace('"PLACEHOLDER"', metric))
    error = refused(ckpt, MANIFEST, words)
    assert len(str(error)) < 400


def test_manifest_check_refuses_a_metric_no_float_holds():
    with pytest.raises(mf.ManifestError, match="out of range for a float"):
        mf.check(
            {"schema_version": mf.SCHEMA_VERSION, "step": 1, "epoch": 0, "metrics": {"x": 10**400}}
        )


def test_extra_json_with_a_duplicate_key_is_refused(ckpt):
    text = (ckpt / EXTRA).read_text()
    (ckpt / EXTRA).write_text('{"progress": {"step": 4}, ' + text.lstrip()[1:])
    relist(ckpt, EXTRA)
    refused(ckpt, EXTRA, "duplicate key 'progress'")


def test_a_safetensors_header_with_a_duplicate_tensor_is_refused(ckpt):
    data = (ckpt / WEIGHTS).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + n].decode()
    name, entry = next((k, v) for k, v in json.loads(header).items() if k != "__metadata__")
    doubled = ("{" + json.dumps(name) + ": " + json.dumps(entry) + ", " + header[1:]).encode()
    doubled += b" " * (-len(doubled) % 8)
    (ckpt / WEIGHTS).write_bytes(struct.pack("<Q", len(doubled)) + doubled + data[8 + n :])
    relist(ckpt, WEIGHTS)
    refused(ckpt, WEIGHTS, f"duplicate key {name!r}")


# -- run files ------------------------------------------------------------------------------------------

LINES = [
    {"step": 1, "train/loss": 2.0},
    {"step": 2, "train/loss": 1.5},
    {"step": 3, "train/loss": 1.2},
]


def write_metrics(tmp_path, lines: list[str], end: str = "\n"):
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + end)
    return RunDir(tmp_path)


def test_a_torn_last_metrics_line_is_dropped(tmp_path):
    good = [json.dumps(x) for x in LINES]
    assert write_metrics(tmp_path, good).read_metrics() == LINES
    assert (
        write_metrics(tmp_path, [*good[:2], good[2][:7]], end="").read_metrics() == LINES[:2]
    )  # killed mid-line
    assert (
        write_metrics(tmp_path, [*good[:2], '{"step": 3, "x": 1e999'], end="").read_metrics()
        == LINES[:2]
    )


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"step": 2, "step": 9, "train/loss": 1.5}', "line 2: duplicate key 'step'"),
        ('{"step": 2, "train/loss": 1e999}', "line 2: number 1e999 is out of range"),
        ('{"step": 2, "train/loss": NaN}', "line 2: contains NaN"),
        ('{"step": 2.5}', "line 2: not an object with an integer step"),
        (
            '{"step": 2',
            "line 2: not valid JSON",
        ),  # torn, yet followed by more lines: not a killed writer's
        ("", "line 2: not valid JSON"),
    ],
    ids=["duplicate", "1e999", "nan", "float-step", "torn-middle", "blank"],
)
def test_damage_before_the_last_metrics_line_is_refused_naming_the_line(tmp_path, line, words):
    rundir = write_metrics(tmp_path, [json.dumps(LINES[0]), line, json.dumps(LINES[2])])
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(RunFileError) as info:
        rundir.read_metrics()
    assert str(info.value).startswith(f"run {tmp_path}: metrics.jsonl: {words}"), info.value
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"status": "complete", "status": "running"}', "duplicate key 'status'"),
        ('{"step": 1e999}', "1e999 is out of range"),
        ("[]", "not a JSON object"),
        ("{", "not valid JSON"),
    ],
    ids=["duplicate", "1e999", "list", "torn"],
)
def test_a_damaged_run_json_is_refused(tmp_path, text, words):
    (tmp_path / "run.json").write_text(text)
    with pytest.raises(RunFileError) as info:
        RunDir(tmp_path).read_status()
    assert (
        str(info.value) == f"run {tmp_path}: run.json: " + str(info.value).split("run.json: ", 1)[1]
    )
    assert words in str(info.value) and isinstance(
        info.value, CheckpointError
    )  # refused where checkpoints are
    assert RunDir(tmp_path / "none").read_status() == {}


def test_a_damaged_sweep_job_record_is_left_out_with_a_warning(tmp_path, caplog):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "0.json").write_text('{"num": 0, "objective": 1.0}')
    (tmp_path / "jobs" / "1.json").write_text('{"num": 1, "objective": 1.0, "objective": 0.1}')
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert list(read_jobs(tmp_path)) == [0]
    assert (
        f"sweep job record {tmp_path / 'jobs' / '1.json'} left out: duplicate key 'objective'"
        in caplog.text
    )
