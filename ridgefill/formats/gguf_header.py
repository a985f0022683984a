"""The few facts ridgefill reads from a model's GGUF file before loading it: architecture, layer count, width and
context length.

gguf-py's GGUFReader parses every array into numpy views, which takes ~3 s on SmolLM2's 49K-token vocabulary
(and longer on Gemma's 262K). `model_keys` walks the same key/value table with gguf-py's constants, skips array
bodies, and stops as soon as the four keys are known, so it costs milliseconds (tests/test_models.py checks it
against GGUFReader). Big-endian files are detected as gguf-py does (by the byte order of the version).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from ridgefill.errors import BadInput


def model_keys(path: Path) -> dict[str, object]:
    """{key: value} of `general.architecture` and, for that architecture, `<arch>.block_count`,
    `<arch>.embedding_length` and `<arch>.context_length`, as far as the file has them. BadInput for a file that is not GGUF, a version below
    2, a truncated table or an unknown value type."""
    from gguf.constants import GGUF_MAGIC, GGUFValueType, Keys

    scalar = {
        GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
        GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
        GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
    }  # fmt: skip
    wanted: dict[str, object] = {}
    with open(path, "rb") as f:
        head = f.read(24)  # magic u32, version u32, tensor_count u64, kv_count u64
        if len(head) < 24 or struct.unpack("<I", head[:4])[0] != GGUF_MAGIC:
            raise BadInput(f"'{path}' is not a GGUF file (bad magic)")
        # A big-endian file has its version bytes swapped (gguf-py detects it the same way).
        order = "<" if struct.unpack("<I", head[4:8])[0] & 0xFFFF else ">"
        version, _, kv_count = struct.unpack(order + "IQQ", head[4:])
        if version < 2:
            raise BadInput(f"'{path}': GGUF version {version} is not supported")

        def read(fmt: str):
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise BadInput(f"'{path}': GGUF header is truncated")
            return struct.unpack(order + fmt, data)[0]

        def read_str() -> str:
            n = read("Q")
            return f.read(n).decode("utf-8", errors="replace")

        def skip_value(vtype: int) -> None:
            if vtype == GGUFValueType.STRING:
                f.seek(read("Q"), os.SEEK_CUR)
            elif vtype == GGUFValueType.ARRAY:
                item_type, count = read("I"), read("Q")
                if item_type in scalar:
                    f.seek(count * struct.calcsize(scalar[item_type]), os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip_value(item_type)
            elif vtype in scalar:
                f.seek(struct.calcsize(scalar[vtype]), os.SEEK_CUR)
            else:
                raise BadInput(f"'{path}': unknown GGUF value type {vtype}")

        for _ in range(kv_count):
            key, vtype = read_str(), read("I")
            arch = wanted.get(Keys.General.ARCHITECTURE)
            per_arch = (Keys.LLM.BLOCK_COUNT, Keys.LLM.EMBEDDING_LENGTH, Keys.LLM.CONTEXT_LENGTH)
            keep = key == Keys.General.ARCHITECTURE or (arch and key in [k.format(arch=arch) for k in per_arch])
            if keep and vtype == GGUFValueType.STRING:
                wanted[key] = read_str()
            elif keep and vtype in scalar:
                wanted[key] = read(scalar[vtype])
            else:
                skip_value(vtype)
            if len(wanted) == 4:
                break
    return wanted
