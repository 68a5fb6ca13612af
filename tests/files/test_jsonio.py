"""Standard JSON in and out (pipeline/files/jsonio.py): non-finite floats, bounded size and depth."""

from __future__ import annotations

import json
import math
import os

import pytest

from pipeline.files import jsonio, reading
from pipeline.files.limits import MAX_JSON_DEPTH
from pipeline.files.reading import UnreadableFile


def test_non_finite_floats_are_strings_and_read_back():
    data = jsonio.dumps({"a": [math.nan, math.inf, -math.inf, 1.0]})
    assert b'NaN"' in data and b'Infinity"' in data
    json.loads(data, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    back = [jsonio.number(v) for v in jsonio.loads(data)["a"]]
    assert math.isnan(back[0]) and back[1:] == [math.inf, -math.inf, 1.0]
    with pytest.raises(jsonio.JSONError):
        jsonio.number("1.0")
    with pytest.raises(jsonio.JSONError):
        jsonio.number(True)


def test_bare_nan_and_deep_nesting_are_refused():
    with pytest.raises(jsonio.JSONError, match="NaN"):
        jsonio.loads('{"a": NaN}')
    with pytest.raises(jsonio.JSONError, match="nested deeper"):
        jsonio.loads("[" * 100000 + "]" * 100000)
    with pytest.raises(jsonio.JSONError, match="nested deeper"):
        jsonio.loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    assert jsonio.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)


def test_read_bytes_refuses_a_big_file_before_reading_it(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte that costs nothing
    with pytest.raises(UnreadableFile, match="over the 1024-byte limit"):
        reading.read_bytes(big, 1024)
    os.symlink(big, tmp_path / "link.json")
    with pytest.raises(UnreadableFile, match="is a symlink, not a regular file"):
        reading.read_bytes(tmp_path / "link.json", 1 << 31)
    with pytest.raises(UnreadableFile, match="is a directory, not a regular file"):
        reading.read_bytes(tmp_path, 1024)
