"""The KV-cache format `ridgefill-cache/1` (docs/cache.md): what `ridgefill compact` and `ridgefill fold` store in
`cache.safetensors`, one entry per decoder layer `l`:

    layer.<l>.keys        [kv_heads, r, head_dim]  post-RoPE, in the cache dtype (bf16 as BF16)
    layer.<l>.values      [kv_heads, r, head_dim]  in the cache dtype
    layer.<l>.positions   I32 [kv_heads, r]        the original positions of the kept rows
    layer.<l>.beta        F32 [kv_heads, r]        the logit biases (a compacted cache only)
    layer.<l>.u           F32 [kv_heads, head_dim] the fold direction (a folded cache only)
    __metadata__          {"format": "ridgefill-cache/1", "dtype": "bfloat16" | "float16" | "float32"}

Uncompacted layers (sliding-window ones) hold their full keys and values (r = the context's length). numpy only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.formats import safetensors
from ridgefill.numerics import CACHE_DTYPES, bf16_bits_to_f32, f32_to_bf16_bits, round_to

FORMAT = "ridgefill-cache/1"
FILE = "cache.safetensors"
KV = ("keys", "values")  # stored in the cache dtype; the other fields have fixed dtypes
FIELDS = ("keys", "values", "positions", "beta", "u")


def tensor_name(layer: int, field: str) -> str:
    if field not in FIELDS:
        raise ValueError(f"unknown cache field {field!r}")
    return f"layer.{int(layer)}.{field}"


def to_dtype(x: np.ndarray, dtype: str):
    """A float array as the cache dtype's tensor for safetensors (bfloat16 as its bit patterns)."""
    x32 = round_to(x, dtype)
    if dtype == "bfloat16":
        return safetensors.BF16(f32_to_bf16_bits(x32))
    return x32.astype(np.float16 if dtype == "float16" else np.float32)


def from_dtype(t) -> np.ndarray:
    """A cache tensor read back as float32."""
    if isinstance(t, safetensors.BF16):
        return bf16_bits_to_f32(t.bits).reshape(t.bits.shape)
    return np.asarray(t, dtype=np.float32)


def encode_layer(layer: int, fields: dict[str, np.ndarray], dtype: str) -> dict:
    """One layer's {field: array} as named safetensors entries: keys and values in the cache dtype."""
    return {tensor_name(layer, name): to_dtype(a, dtype) if name in KV else np.ascontiguousarray(a)
            for name, a in fields.items()}  # fmt: skip


def write_cache(path: Path, layers: dict[int, dict[str, np.ndarray]], dtype: str) -> None:
    """cache.safetensors from {layer: {field: array}} (see the module docstring)."""
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of {', '.join(CACHE_DTYPES)}, got {dtype!r}")
    arrays = {}
    for l, fields in layers.items():
        arrays |= encode_layer(l, fields, dtype)
    safetensors.save(path, arrays, {"format": FORMAT, "dtype": dtype})


def read_cache(path: Path) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {"keys", "values" (float32), "positions" (int32), "beta" / "u" (float32, where present)}}, layers
    in order; BadInput for a file of another format or a tensor name outside it."""
    arrays, meta = safetensors.load(path)
    if meta.get("format") != FORMAT:
        raise BadInput(f"{Path(path).name}: not a {FORMAT} file (format {meta.get('format')!r})")
    layers: dict[int, dict] = {}
    for name, t in arrays.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layer" or not parts[1].isdigit() or parts[2] not in FIELDS:
            raise BadInput(f"{Path(path).name}: unexpected tensor {name!r} (expected layer.<l>.<field>)")
        l, field = int(parts[1]), parts[2]
        layers.setdefault(l, {})[field] = from_dtype(t) if field in KV else np.asarray(t)
    return dict(sorted(layers.items()))
