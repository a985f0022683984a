"""safetensors files, written deterministically and read back by one strict reader (no torch).

The format: 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}` padded with spaces to a multiple of 8, then the tensor bytes. We write it ourselves so the bytes
depend only on the arrays and metadata: tensors laid out as the safetensors library lays them out (wider dtype
first, then name), compact JSON with sorted keys, metadata sorted (the library keeps insertion order, so its bytes
depend on dict order). The library reads these files, and writes the same bytes but for the order of the metadata
keys. bfloat16, which numpy lacks, travels as a `BF16` wrapper around its uint16 bit patterns.

Every safetensors file ridgefill reads goes through `decode` (or `read_header`, which reads the header alone):
artifacts, checkpoints, release folders and caches. It refuses, each with its own message naming the file, a
header that is not a JSON object of entries, a duplicate name, an unknown dtype, a shape that is not a list of
non-negative integers, byte ranges that do not match their shape or do not tile the data exactly (no gaps, no
overlaps, nothing past the end), and `__metadata__` that is not an object of strings.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ridgefill.errors import BadInput

_DTYPES = {
    np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("int8"): "I8",
    np.dtype("uint64"): "U64", np.dtype("uint32"): "U32", np.dtype("uint16"): "U16", np.dtype("uint8"): "U8",
    np.dtype("bool"): "BOOL",
}  # fmt: skip
_NP = {v: k for k, v in _DTYPES.items()}
_SIZE = {name: dt.itemsize for name, dt in _NP.items()} | {"BF16": 2}
# safetensors' Dtype enum order; the library writes larger dtypes first so every tensor stays aligned
_RANK = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]
MAX_HEADER = 100 << 20  # a header larger than this is refused unread (the library's own limit)
METADATA = "__metadata__"


@dataclass(frozen=True)
class BF16:
    """bfloat16 tensor as its uint16 bit patterns."""

    bits: np.ndarray


def dtype_of(a: np.ndarray | BF16) -> str:
    """The safetensors dtype name of an array as `decode` returns it ("BF16" for a `BF16`)."""
    return "BF16" if isinstance(a, BF16) else _DTYPES[np.asarray(a).dtype]


# ------------------------------------------------------------------------------------------------ writing


def _layout(arrays: dict[str, np.ndarray | BF16], metadata: dict[str, str] | None) -> tuple[bytes, list[np.ndarray]]:
    """The file's head (length + header JSON, padded) and its tensors' data in file order (no copies made)."""
    typed = {}
    for name, a in arrays.items():
        if isinstance(a, BF16):
            typed[name] = ("BF16", np.ascontiguousarray(a.bits, dtype="<u2"))
        else:
            data = np.ascontiguousarray(a)
            typed[name] = (_DTYPES[data.dtype], data.astype(data.dtype.newbyteorder("<"), copy=False))
    # header: metadata first, then the tensors in layout order, as the library writes it
    header: dict = {METADATA: {str(k): str(v) for k, v in sorted(metadata.items())}} if metadata else {}
    body, offset = [], 0
    for name in sorted(typed, key=lambda n: (-_RANK.index(typed[n][0]), n)):
        dtype, data = typed[name]
        header[name] = {"dtype": dtype, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        body.append(data)
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, body


def encode(arrays: dict[str, np.ndarray | BF16], metadata: dict[str, str] | None = None) -> bytes:
    head, body = _layout(arrays, metadata)
    return head + b"".join(data.tobytes() for data in body)


def save(path: Path, arrays: dict[str, np.ndarray | BF16], metadata: dict[str, str] | None = None) -> None:
    """Write via a temp file and rename, so a crash never leaves a half-written file under `path`.

    The tensors are written straight from their arrays: a capture checkpoint (hundreds of MB of float64 totals)
    costs no second copy in memory."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    head, body = _layout(arrays, metadata)
    with open(tmp, "wb") as f:
        f.write(head)
        for data in body:
            if data.size:
                f.write(memoryview(data.reshape(-1)).cast("B"))
    os.replace(tmp, path)


def save_zst(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None, level: int = 3) -> None:
    """zstd-compressed safetensors (single-threaded, fixed level: deterministic bytes)."""
    import zstandard

    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_bytes(zstandard.ZstdCompressor(level=level).compress(encode(arrays, metadata)))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Entry:
    """One tensor of a header: its dtype name, shape and byte range in the data that follows the header."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class DuplicateKey(ValueError):
    """A JSON object names a key twice (its args[0]); Python's json would keep the last silently."""


def no_duplicates(pairs):
    """json's `object_pairs_hook` that refuses a key named twice in one object (DuplicateKey)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKey(key)
        obj[key] = value
    return obj


def parse_header(raw: bytes, data_size: int, name: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """The header JSON `raw` of a file whose data (after the header) is `data_size` bytes -> ({tensor name: Entry}
    in file order, metadata). BadInput names the first problem."""

    def bad(why: str) -> BadInput:
        return BadInput(f"{name}: not a readable safetensors file ({why})")

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except DuplicateKey as e:
        raise bad(f"the header names {e.args[0]!r} twice") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop(METADATA, {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ is not an object of strings")
    entries = {}
    for key, h in header.items():
        if not isinstance(h, dict) or set(h) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {key!r} is not an object of dtype, shape and data_offsets")
        dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
        if dtype not in _SIZE:
            raise BadInput(f"{name}: tensor {key!r} has unsupported dtype {dtype}")
        if not (isinstance(shape, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                for x in shape)):
            raise bad(f"tensor {key!r} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in offsets)):
            raise bad(f"tensor {key!r} has data_offsets {offsets!r}, not [start, end]")
        start, end = offsets
        if end - start != math.prod(shape) * _SIZE[dtype]:
            raise bad(f"tensor {key!r}: {end - start} bytes for {dtype} {shape}")
        entries[key] = Entry(dtype, tuple(shape), start, end)
    at = 0  # the byte ranges must tile the data exactly, in some order, as the library requires
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != at:
            what = "overlaps the tensor before it" if e.start < at else f"leaves a gap at byte {at}"
            raise bad(f"tensor {key!r} {what}")
        at = e.end
    if at != data_size:
        raise bad(f"the tensors end at byte {at} of {data_size} data bytes")
    return entries, meta


def read_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors' entries and the metadata of a safetensors file, from its header alone (the data is not read)."""
    path, name = Path(path), Path(path).name
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadInput(f"{name}: not a readable safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            raise BadInput(f"{name}: not a readable safetensors file (header length {n} does not fit the file)")
        raw = f.read(n)
    return parse_header(raw, size - 8 - n, name)


def decode(buf: bytes, name: str = "tensors") -> tuple[dict[str, np.ndarray | BF16], dict[str, str]]:
    """A safetensors file's bytes -> ({name: array, bf16 as `BF16`}, metadata), in file order."""
    if len(buf) < 8:
        raise BadInput(f"{name}: not a readable safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > min(len(buf) - 8, MAX_HEADER):
        raise BadInput(f"{name}: not a readable safetensors file (header length {n} does not fit the file)")
    entries, meta = parse_header(buf[8 : 8 + n], len(buf) - 8 - n, name)
    base, out = 8 + n, {}
    for key, e in entries.items():
        raw = buf[base + e.start : base + e.end]
        if e.dtype == "BF16":
            out[key] = BF16(np.frombuffer(raw, dtype="<u2").reshape(e.shape).copy())
        else:
            out[key] = np.frombuffer(raw, dtype=_NP[e.dtype].newbyteorder("<")).reshape(e.shape).copy()
    return out, meta


def load(path: Path) -> tuple[dict[str, np.ndarray | BF16], dict[str, str]]:
    return decode(Path(path).read_bytes(), Path(path).name)


def load_zst(path: Path) -> tuple[dict[str, np.ndarray | BF16], dict[str, str]]:
    import zstandard

    return decode(zstandard.ZstdDecompressor().decompress(Path(path).read_bytes()), Path(path).name)


# ------------------------------------------------------------------------------------ tensor by tensor


@dataclass(frozen=True)
class Lazy:
    """One tensor to write or read on demand: its safetensors dtype and shape, its size in bytes, and `fetch()`,
    which returns it as a host array (a `BF16` for bfloat16)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    fetch: Callable[[], object]


def save_streamed(path: Path, tensors: dict[str, Lazy], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor (each fetched only when its turn comes, then dropped: a file of
    device tensors never holds more than one on the host), to a temporary file renamed into place. The layout is
    `save`'s: wider dtypes first, then by name."""
    order = sorted(tensors, key=lambda n: (-_SIZE[tensors[n].dtype], n))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    at = 0
    for name in order:
        e = tensors[name]
        header[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            e = tensors[name]
            a = e.fetch()
            data = np.ascontiguousarray(a.bits if isinstance(a, BF16) else a)
            data = data.astype(data.dtype.newbyteorder("<"), copy=False)
            if data.nbytes != e.nbytes or tuple(data.shape) != tuple(e.shape):
                raise RuntimeError(f"{Path(path).name}: tensor {name} changed while it was written")
            if data.size:
                f.write(memoryview(data.reshape(-1)).cast("B"))
            del a, data
    os.replace(tmp, path)


def lazy_array(a: np.ndarray | BF16) -> Lazy:
    """A host array as a Lazy (nothing to fetch)."""
    a = a if isinstance(a, BF16) else np.ascontiguousarray(a)
    raw = a.bits if isinstance(a, BF16) else a
    return Lazy(dtype_of(a), tuple(raw.shape), raw.nbytes, lambda: a)


class LazyFile:
    """The tensors of a safetensors file (header checked by `read_header`), each read from its byte range only when
    asked for: `f[name]` (an array, `BF16` for bfloat16), `f.lazy(name)`, `f.names`, `f.metadata`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries, self.metadata = read_header(self.path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        self.base = 8 + n
        self.names = list(self.entries)

    def __getitem__(self, name: str):
        e = self.entries[name]
        dt = np.dtype(np.uint16 if e.dtype == "BF16" else _NP[e.dtype]).newbyteorder("<")
        a = np.fromfile(self.path, dtype=dt, count=int(np.prod(e.shape)), offset=self.base + e.start)
        a = a.reshape(e.shape)
        return BF16(a) if e.dtype == "BF16" else a

    def lazy(self, name: str) -> Lazy:
        e = self.entries[name]
        return Lazy(e.dtype, tuple(e.shape), e.end - e.start, lambda: self[name])
