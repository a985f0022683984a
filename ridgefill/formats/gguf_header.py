"""The few facts ridgefill reads from a model's GGUF file before loading it: architecture, layer count, width and
context length; and whether the file is whole.

gguf-py's GGUFReader parses every array into numpy views, which takes ~3 s on SmolLM2's 49K-token vocabulary
(and longer on Gemma's 262K). `model_keys` walks the same key/value table with gguf-py's constants over a memory
map, stepping over array bodies, then the tensor table, so it costs milliseconds (tests/test_models.py checks it
against GGUFReader). From the tensor table it knows where the last tensor's data ends, so a file cut short (a
download or copy stopped early) is refused here as a truncated GGUF, before transformers or llama.cpp read it and
fail with a numpy or struct error. Big-endian files are detected as gguf-py does (by the byte order of the version).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from ridgefill.errors import BadInput


def model_keys(path: Path) -> dict[str, object]:
    """{key: value} of `general.architecture` and, for that architecture, `<arch>.block_count`,
    `<arch>.embedding_length` and `<arch>.context_length`, as far as the file has them. BadInput for a file that is
    not GGUF, a version below 2, an unknown value or tensor type, or a truncated file (its tables, or the tensor
    data they place, run past its end)."""
    try:
        return _read(path)
    except _Unreadable as e:
        if e.args[0] == _BAD_MAGIC:
            raise BadInput(f"'{path}' is not a GGUF file (bad magic)") from None
        raise BadInput(f"'{path}': {e.args[0]}") from None


def check_whole(path: Path) -> None:
    """BadInput unless `path` is a whole GGUF file (`model_keys`' checks: magic, version, tables, tensor data)."""
    try:
        _read(path)
    except _Unreadable as e:
        raise BadInput(f"{path}: not a readable GGUF file ({e.args[0]})") from None


_BAD_MAGIC = "bad magic"


class _Unreadable(Exception):
    """Why a file is not a whole GGUF file (a phrase without the path)."""


def _read(path: Path) -> dict[str, object]:
    from gguf.constants import GGUF_MAGIC

    with open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or struct.unpack("<I", head)[0] != GGUF_MAGIC:
            raise _Unreadable(_BAD_MAGIC)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(data)


def _walk(data) -> dict[str, object]:
    from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType, Keys

    scalar = {
        GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
        GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
        GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
    }  # fmt: skip
    size = len(data)
    part = "header"  # the part being read, for the truncation message

    def truncated() -> _Unreadable:
        return _Unreadable(f"truncated GGUF: the file ends at byte {size}, inside its {part}")

    # A big-endian file has its version bytes swapped (gguf-py detects it the same way).
    if size < 24:
        raise truncated()
    order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
    version, tensor_count, kv_count = struct.unpack_from(order + "IQQ", data, 4)
    if version < 2:
        raise _Unreadable(f"GGUF version {version} is not supported")
    pos = 24
    u64 = struct.Struct(order + "Q")

    def read(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise truncated()
        pos += n
        return struct.unpack_from(order + fmt, data, pos - n)[0]

    def read_str() -> str:
        nonlocal pos
        n = read("Q")
        if pos + n > size:
            raise truncated()
        pos += n
        return bytes(data[pos - n:pos]).decode("utf-8", errors="replace")

    def skip(vtype: int, count: int = 1, depth: int = 0) -> None:
        nonlocal pos
        if vtype in scalar:
            pos += count * struct.calcsize(scalar[vtype])
        elif vtype == GGUFValueType.STRING:
            for _ in range(count):  # the tight loop a 262K-token vocabulary runs: a few ms
                if pos + 8 > size:
                    raise truncated()
                pos += 8 + u64.unpack_from(data, pos)[0]
        elif vtype == GGUFValueType.ARRAY:
            if depth == 8:  # a forged file could nest until Python's stack runs out
                raise _Unreadable("arrays nested more than 8 deep")
            for _ in range(count):
                item_type, n = read("I"), read("Q")
                skip(item_type, n, depth + 1)
        else:
            raise _Unreadable(f"unknown GGUF value type {vtype}")
        if pos > size:
            raise truncated()

    wanted: dict[str, object] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    per_arch = (Keys.LLM.BLOCK_COUNT, Keys.LLM.EMBEDDING_LENGTH, Keys.LLM.CONTEXT_LENGTH)
    part = "key/value table"
    for _ in range(kv_count):
        key, vtype = read_str(), read("I")
        arch = wanted.get(Keys.General.ARCHITECTURE)
        keep = key == Keys.General.ARCHITECTURE or (arch and key in [k.format(arch=arch) for k in per_arch])
        if keep and vtype == GGUFValueType.STRING:
            wanted[key] = read_str()
        elif keep and vtype in scalar:
            wanted[key] = read(scalar[vtype])
        elif key == Keys.General.ALIGNMENT and vtype == GGUFValueType.UINT32:
            alignment = read("I") or GGUF_DEFAULT_ALIGNMENT
        else:
            skip(vtype)

    part = "tensor table"
    end = 0  # where the last tensor's data ends, counted from the start of the data section
    for _ in range(tensor_count):
        name = read_str()
        dims = [read("Q") for _ in range(read("I"))]
        ggml_type, offset = read("I"), read("Q")
        if ggml_type not in GGML_QUANT_SIZES:
            raise _Unreadable(f"tensor {name!r} has an unknown GGML type {ggml_type}")
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        count = 1
        for n in dims:
            count *= n
        end = max(end, offset + count // block * type_size)
    start = -(-pos // alignment) * alignment  # the data section begins at the next multiple of the alignment
    if start + end > size:
        raise _Unreadable(f"truncated GGUF: the file ends at byte {size}, its tensor data at byte {start + end}")
    return wanted

