"""Deterministic safetensors files from numpy arrays, and a reader that mirrors the writer.

The safetensors format: 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}` padded with spaces to a multiple of 8,
then the tensor bytes. We write it ourselves so the bytes depend only on the arrays and metadata: tensors
laid out as the safetensors library lays them out (wider dtype first, then name), compact JSON with sorted
keys, metadata sorted (the library keeps insertion order, so its bytes depend on dict order). bfloat16, which numpy lacks, is passed as a
`BF16` wrapper around its uint16 bit patterns. Files are readable by the safetensors library.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ridgefill.errors import BadInput

_DTYPES = {
    np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8", np.dtype("uint16"): "U16", np.dtype("bool"): "BOOL",
}
_NP = {v: k for k, v in _DTYPES.items()}
# safetensors' Dtype enum order; the library writes larger dtypes first so every tensor stays aligned
_RANK = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]


@dataclass(frozen=True)
class BF16:
    """bfloat16 tensor as its uint16 bit patterns."""

    bits: np.ndarray


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
    header: dict = {"__metadata__": {str(k): str(v) for k, v in sorted(metadata.items())}} if metadata else {}
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


def decode(buf: bytes, name: str = "tensors") -> tuple[dict[str, np.ndarray | BF16], dict[str, str]]:
    if len(buf) < 8:
        raise BadInput(f"{name}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > len(buf) - 8:
        raise BadInput(f"{name}: not a safetensors file (header length {n} past the end)")
    try:
        header = json.loads(buf[8 : 8 + n])
    except ValueError:
        raise BadInput(f"{name}: not a safetensors file (bad header JSON)") from None
    meta = header.pop("__metadata__", {}) or {}
    base, out = 8 + n, {}
    for key, h in header.items():
        start, end = h["data_offsets"]
        if base + end > len(buf):
            raise BadInput(f"{name}: tensor '{key}' runs past the end of the file")
        raw = buf[base + start : base + end]
        if h["dtype"] == "BF16":
            out[key] = BF16(np.frombuffer(raw, dtype="<u2").reshape(h["shape"]).copy())
        elif h["dtype"] in _NP:
            out[key] = np.frombuffer(raw, dtype=_NP[h["dtype"]].newbyteorder("<")).reshape(h["shape"]).copy()
        else:
            raise BadInput(f"{name}: tensor '{key}' has unsupported dtype {h['dtype']}")
    return out, meta


def load(path: Path) -> tuple[dict[str, np.ndarray | BF16], dict[str, str]]:
    return decode(Path(path).read_bytes(), Path(path).name)


def save_zst(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None, level: int = 3) -> None:
    """zstd-compressed safetensors (single-threaded, fixed level: deterministic bytes)."""
    import zstandard

    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_bytes(zstandard.ZstdCompressor(level=level).compress(encode(arrays, metadata)))
    os.replace(tmp, path)


def load_zst(path: Path) -> tuple[dict[str, np.ndarray | BF16], dict[str, str]]:
    import zstandard

    return decode(zstandard.ZstdDecompressor().decompress(Path(path).read_bytes()), Path(path).name)
