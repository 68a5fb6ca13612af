"""Named arrays to and from safetensors (pipeline/checkpoint/tensors.py): the library's own layout, read
back by it and from it; aliases; and a header or layout that lies is refused before its data is read."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pipeline.checkpoint.tensors import MAX_HEADER, TO_NUMPY, layout, read_tensors, write_tensors


def _views(w: np.ndarray) -> dict[str, np.ndarray]:
    """Arrays equal to `w` that are not C-contiguous."""
    big = np.zeros((w.shape[0], 2 * w.shape[1]), dtype=w.dtype)
    big[:, ::2] = w
    return {
        "fortran": np.asfortranarray(w),
        "transposed": np.ascontiguousarray(w.T).T,
        "strided": big[:, ::2],
        "reversed": np.ascontiguousarray(w[::-1])[::-1],
    }


@pytest.mark.parametrize("kind", ["fortran", "transposed", "strided", "reversed"])
def test_non_contiguous_arrays_are_written_by_value(kind, tmp_path):
    """The safetensors trap (non-contiguous arrays written wrong, silently) cannot happen here."""
    values = np.random.default_rng(0).standard_normal((4, 6))
    view = _views(values)[kind]
    assert not view.flags.c_contiguous and np.array_equal(view, values)
    write_tensors(tmp_path / "x.safetensors", {"w": view})
    assert np.array_equal(
        load_file(str(tmp_path / "x.safetensors"))["w"], values
    )  # per the library
    got, _ = read_tensors(tmp_path / "x.safetensors")
    assert np.array_equal(got["w"], values) and got["w"].dtype == values.dtype


def test_writer_matches_the_library_and_reads_its_files(tmp_path):
    g = np.random.default_rng(0)
    arrays = {
        "a": g.standard_normal((3, 4)).astype(np.float32),
        "b": np.arange(5, dtype=np.int64),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 2)),
        "mask": np.array([True, False]),
        "half": g.standard_normal(3).astype(np.float16),
    }
    ours, lib = tmp_path / "ours.safetensors", tmp_path / "lib.safetensors"
    entry = write_tensors(ours, {**arrays, "tied": arrays["a"]}, {"x": "1"})
    save_file(arrays, str(lib), metadata={"format": "np", "x": "1", "tied": "ALIAS(a)"})
    a, b = ours.read_bytes(), lib.read_bytes()
    assert (
        entry["size"] == len(a) and entry["sha256"] == __import__("hashlib").sha256(a).hexdigest()
    )
    n = struct.unpack("<Q", a[:8])[0]
    assert len(a) == len(b) and a[:8] == b[:8] and a[8 + n :] == b[8 + n :]  # same layout and data
    assert json.loads(a[8 : 8 + n]) == json.loads(
        b[8 : 8 + n]
    )  # same header (the library's metadata order varies)
    assert list(json.loads(a[8 : 8 + n])["__metadata__"]) == [
        "format",
        "tied",
        "x",
    ]  # ours is sorted
    for path in (ours, lib):
        got, meta = read_tensors(path)
        assert meta["tied"] == "ALIAS(a)" and got["tied"] is got["a"]
        for k, v in arrays.items():
            assert (
                got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v)
            ), (path.name, k)
    back = load_file(str(ours))
    for k, v in arrays.items():
        assert (
            back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v)
        ), k


def _one_of_each_dtype() -> dict[str, np.ndarray]:
    """An array of every dtype our writer stores, named by its code, with values that tell signed from unsigned,
    one width from another and one byte order from the other."""
    out = {}
    for code, dtype in TO_NUMPY.items():
        if dtype.kind == "b":
            values = [True, False, False, True]
        elif dtype.kind in "iu":
            values = [np.iinfo(dtype).min, np.iinfo(dtype).max, 1, 2]
        else:
            values = [1.5, -2.0, np.inf, np.finfo(dtype).tiny]
        out[code] = np.array(values, dtype.newbyteorder("="))
    return out


@pytest.mark.parametrize("order", ["=", ">"], ids=["native", "big-endian"])
def test_every_dtype_agrees_with_the_library_both_ways(tmp_path, order):
    """Ours written, the library's read, and the library's written, ours read, for every dtype in our table, from
    arrays in either byte order: each file holds the same bytes and every array comes back with its dtype and
    value (a big-endian array is stored little-endian, as the format says)."""
    want = _one_of_each_dtype()
    given = {k: a.astype(a.dtype.newbyteorder(order)) for k, a in want.items()}
    ours, lib = tmp_path / "ours.safetensors", tmp_path / "lib.safetensors"
    write_tensors(ours, given)
    save_file(given, str(lib), metadata={"format": "np"})
    a, b = ours.read_bytes(), lib.read_bytes()
    n = struct.unpack("<Q", a[:8])[0]
    assert json.loads(a[8 : 8 + n]) == json.loads(
        b[8 : 8 + n]
    )  # the same dtype codes, shapes and offsets
    assert a[8 + n :] == b[8 + n :]  # the same data bytes
    for reader, arrays in (
        ("the library reading ours", load_file(str(ours))),
        ("ours reading the library's", read_tensors(lib)[0]),
    ):
        for k, v in want.items():
            got = arrays[k]
            assert (got.dtype, got.shape, got.tobytes()) == (v.dtype, v.shape, v.tobytes()), (
                reader,
                k,
                got,
            )


def test_an_oversized_header_is_refused_with_its_size_before_it_is_read(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER + 8) + b" " * 64)
    with pytest.raises(
        ValueError, match=f"header of {MAX_HEADER + 8} bytes is over the {MAX_HEADER}-byte limit"
    ):
        read_tensors(path)


@pytest.mark.parametrize(
    "header, words",
    [
        ({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, "dtype"),
        ({"a": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, "bad shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, "data_offsets span"),
        ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, "no numpy equivalent"),
        ({"a": 1}, "needs dtype"),
        ({"__metadata__": {"k": 1}}, "str -> str"),
    ],
    ids=["dtype-list", "shape-str", "offsets", "complex", "not-an-object", "metadata"],
)
def test_a_malformed_header_is_a_value_error(tmp_path, header, words):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(ValueError, match=words):
        read_tensors(path)


def test_deeply_nested_header_json_is_refused_not_a_recursion_error(tmp_path):
    raw = b"[" * 100000 + b"]" * 100000
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ValueError, match="nested deeper"):
        read_tensors(path)


def test_an_unexpected_layout_is_refused_before_allocating(tmp_path):
    """With the layout the config builds, a file of other tensors (a huge one, say) is never read in."""
    expect = [layout({"w": np.zeros((2, 3), np.float32)})]
    write_tensors(
        tmp_path / "big.safetensors", {"w": np.zeros((2_000_000, 3), np.float32)}, fsync=False
    )
    with pytest.raises(ValueError, match="more than a checkpoint of this config can hold"):
        read_tensors(tmp_path / "big.safetensors", expect=expect)
    write_tensors(tmp_path / "other.safetensors", {"w": np.zeros((3, 2), np.float32)})
    with pytest.raises(
        ValueError, match=r"does not fit: w is F32\[3, 2\], the config builds F32\[2, 3\]"
    ):
        read_tensors(tmp_path / "other.safetensors", expect=expect)
    write_tensors(tmp_path / "ok.safetensors", {"w": np.ones((2, 3), np.float32)})
    assert read_tensors(tmp_path / "ok.safetensors", expect=expect)[0]["w"].sum() == 6


def test_a_symlinked_file_is_not_followed(tmp_path):
    write_tensors(tmp_path / "real.safetensors", {"w": np.zeros(2)})
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "real.safetensors")
    with pytest.raises(OSError, match="is a symlink, not a regular file"):
        read_tensors(tmp_path / "link.safetensors")
