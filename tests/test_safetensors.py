"""ridgefill.formats.safetensors: deterministic bytes the safetensors library reads, and the one strict reader every
safetensors file ridgefill reads goes through (artifacts, checkpoints, releases, caches): each malformed header
refused by its message."""

import json
import struct

import numpy as np
import pytest

from ridgefill.errors import BadInput
from ridgefill.formats import safetensors


def raw(header: dict, data: bytes = b"", pad: bool = True) -> bytes:
    """A safetensors file written by hand: header JSON (as given), padded to 8 bytes, then `data`."""
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def refused(buf: bytes, message: str) -> None:
    with pytest.raises(BadInput) as e:
        safetensors.decode(buf, "t.safetensors")
    assert str(e.value) == message


def test_reads_what_it_writes_and_what_the_library_writes(tmp_path):
    from safetensors.numpy import save_file

    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.array([3, 1], dtype=np.int32),
         "u": np.array([7], dtype=np.uint32)}
    got, meta = safetensors.decode(safetensors.encode(a, {"k": "v"}))
    assert meta == {"k": "v"} and all(np.array_equal(got[n], a[n]) and got[n].dtype == a[n].dtype for n in a)
    save_file(a, str(tmp_path / "lib.safetensors"), metadata={"k": "v"})
    lib, lmeta = safetensors.load(tmp_path / "lib.safetensors")
    assert lmeta == {"k": "v"} and all(np.array_equal(lib[n], a[n]) for n in a)
    entries, hmeta = safetensors.read_header(tmp_path / "lib.safetensors")
    assert hmeta == {"k": "v"} and {n: (e.dtype, e.shape) for n, e in entries.items()} == {
        "w": ("F32", (2, 3)), "ids": ("I32", (2,)), "u": ("U32", (1,))}


def test_refusals_name_the_problem():
    four = np.zeros(1, dtype=np.float32).tobytes()
    ok = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    pre = "t.safetensors: not a readable safetensors file"
    refused(b"\0\0", f"{pre} (shorter than its 8-byte header length)")
    refused(struct.pack("<Q", 99) + b"{}", f"{pre} (header length 99 does not fit the file)")
    refused(raw([1, 2]), f"{pre} (header is not a JSON object)")
    refused(struct.pack("<Q", 8) + b'{"a":1, ' + four, f"{pre} (header is not JSON: Expecting property name enclosed "
                                                        "in double quotes: line 1 column 9 (char 8))")
    text = ('{"a":' + json.dumps(ok) + ',"a":' + json.dumps(ok) + "}").encode()  # one name twice (json.dumps cannot)
    dup = struct.pack("<Q", len(text)) + text + four
    refused(dup, f"{pre} (the header names 'a' twice)")
    refused(raw({"a": {**ok, "dtype": "F8_E4M3"}}, four), "t.safetensors: tensor 'a' has unsupported dtype F8_E4M3")
    refused(raw({"a": {**ok, "shape": [-1]}}, four), f"{pre} (tensor 'a' has shape [-1], not a list of sizes)")
    refused(raw({"a": {**ok, "shape": [2]}}, four), f"{pre} (tensor 'a': 4 bytes for F32 [2])")
    refused(raw({"a": {"dtype": "F32", "shape": [1]}}, four),
            f"{pre} (tensor 'a' is not an object of dtype, shape and data_offsets)")
    two = {"a": ok, "b": {**ok, "data_offsets": [2, 6]}}
    refused(raw(two, four * 2), f"{pre} (tensor 'b' overlaps the tensor before it)")
    gap = {"a": ok, "b": {**ok, "data_offsets": [6, 10]}}
    refused(raw(gap, four * 3), f"{pre} (tensor 'b' leaves a gap at byte 4)")
    refused(raw({"a": ok}, four * 2), f"{pre} (the tensors end at byte 4 of 8 data bytes)")
    refused(raw({"a": ok}, four[:2]), f"{pre} (the tensors end at byte 4 of 2 data bytes)")
    refused(raw({"__metadata__": {"k": 1}, "a": ok}, four), f"{pre} (__metadata__ is not an object of strings)")


def test_read_header_refuses_what_decode_refuses(tmp_path):
    """verify reads a release's maps.safetensors header alone: a file whose data does not match it is refused there
    too, not only when the loader decodes it."""
    p = tmp_path / "t.safetensors"
    p.write_bytes(safetensors.encode({"a": np.zeros(3, np.float32)})[:-4])  # one tensor element short
    with pytest.raises(BadInput, match=r"^t.safetensors: not a readable safetensors file \(the tensors end at byte "
                                       r"12 of 8 data bytes\)$"):
        safetensors.read_header(p)


def test_streamed_writing_and_lazy_reading_are_the_plain_format(tmp_path):
    """save_streamed writes the bytes `save` writes (tensors fetched one at a time); LazyFile reads each back."""
    import numpy as np

    from ridgefill.formats import safetensors as st

    rng = np.random.default_rng(0)
    arrays = {"b.f32": rng.standard_normal((3, 5)).astype(np.float32), "a.i8": np.arange(7, dtype=np.int8),
              "c.bf16": st.BF16(np.arange(6, dtype=np.uint16).reshape(2, 3)), "d.f64": np.zeros(0)}
    meta = {"z": "1", "a": "2"}
    st.save(tmp_path / "plain.safetensors", arrays, meta)
    fetched = []
    lazy = {n: st.Lazy(l.dtype, l.shape, l.nbytes, lambda n=n, l=l: (fetched.append(n), l.fetch())[1])
            for n, l in ((n, st.lazy_array(a)) for n, a in arrays.items())}
    st.save_streamed(tmp_path / "streamed.safetensors", lazy, meta)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert sorted(fetched) == sorted(arrays)  # each fetched once
    f = st.LazyFile(tmp_path / "streamed.safetensors")
    assert f.metadata == meta and sorted(f.names) == sorted(arrays)
    for n, a in arrays.items():
        got = f[n]
        if isinstance(a, st.BF16):
            assert isinstance(got, st.BF16) and np.array_equal(got.bits, a.bits)
        else:
            assert got.dtype == a.dtype and np.array_equal(got, a)
