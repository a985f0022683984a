"""The KV-cache format `ridgefill-cache/2` (docs/cache.md): what `ridgefill compact` and `ridgefill fold` store in
`cache.safetensors`, and what `ridgefill engine prefix` / `engine fold` hand a serving engine. One entry set per
decoder layer `l`:

    layer.<l>.keys        [kv_heads, n_l, head_dim]  post-RoPE, in the cache dtype (bf16 as BF16)
    layer.<l>.values      [kv_heads, n_l, head_dim]  in the cache dtype
    layer.<l>.positions   I32 [kv_heads, n_l]        the original positions of the kept rows (compact, fold)
    layer.<l>.beta        F32 [kv_heads, n_l]        the logit biases (a compacted layer of a compact cache)
    layer.<l>.u           F32 [kv_heads, head_dim]   the fold direction (a compacted layer of a fold cache)
    __metadata__          {"format": "ridgefill-cache/2", "dtype": "bfloat16" | "float16" | "float32",
                           "model_fingerprint": <64 hex: the model the cache was made from>}

One reader, one rule list (docs/cache.md "Reading a cache", rules 1-12): `read_header` checks what the header
shows (rules 1-9) without reading the data; `read_cache` adds the data rules (10, 11); `check_model` is what an
engine reader adds (rule 12: an engine cache, for this model). Every refusal is one BadInput line that starts with
the file's path, names the tensor or field, and ends with the rule's number. `write_cache` runs the same rules on
what it is about to write. numpy only.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.formats import safetensors
from ridgefill.numerics import CACHE_DTYPES, bf16_bits_to_f32, f32_to_bf16_bits, round_to

FORMAT = "ridgefill-cache/2"
OLD_FORMATS = ("ridgefill-cache/1",)  # no model fingerprint: refused, the cache is made again
FILE = "cache.safetensors"
META = ("format", "dtype", "model_fingerprint")
KV = ("keys", "values")  # stored in the cache dtype; the other fields have fixed dtypes
FIELDS = ("keys", "values", "positions", "beta", "u")
STORED = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # cache dtype -> safetensors dtype of keys/values
FIXED = {"positions": "I32", "beta": "F32", "u": "F32"}
NAME = re.compile(r"layer\.(0|[1-9][0-9]*)\.(keys|values|positions|beta|u)")  # canonical decimal layer index
FINGERPRINT = re.compile(r"[0-9a-f]{64}")
ENGINE, COMPACT, FOLD = "engine", "compact", "fold"  # the kinds of cache (rule 8)


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


# ------------------------------------------------------------------------------------------------ the header


@dataclass(frozen=True)
class CacheHeader:
    """What a cache file's header shows, once rules 1-9 hold. `entries[l]` is how many positions (keys) layer l
    holds; `cached` is that number when it is the same in every layer (an engine cache's P), else None."""

    path: Path
    dtype: str  # the cache dtype: "bfloat16" | "float16" | "float32"
    model_fingerprint: str  # 64 hex
    kind: str  # "engine" (keys and values only) | "compact" (beta) | "fold" (u)
    kv_heads: int
    head_dim: int
    entries: tuple[int, ...]  # per layer 0..L-1
    fields: tuple[tuple[str, ...], ...]  # per layer, the fields it holds (in FIELDS order)
    shapes: dict[str, tuple[int, ...]] = field(repr=False)  # tensor name -> shape
    tensors: dict[str, safetensors.Entry] = field(repr=False)  # tensor name -> dtype, shape, byte range
    data_start: int = field(repr=False, default=0)  # where the data begins in the file (8 + header length)
    format: str = FORMAT

    @property
    def num_layers(self) -> int:
        return len(self.entries)

    @property
    def cached(self) -> int | None:
        return self.entries[0] if len(set(self.entries)) == 1 else None

    @property
    def compacted(self) -> tuple[int, ...]:
        """The layers that hold beta or u (none in an engine cache)."""
        return tuple(l for l, f in enumerate(self.fields) if "beta" in f or "u" in f)


@dataclass(frozen=True)
class ModelShape:
    """The model a reader serves, for `check_model` (rule 12); a None field is not checked."""

    num_layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    fingerprint: str | None = None


def _refuse(path, what: str, rule: int) -> BadInput:
    return BadInput(f"{path}: {what} (rule {rule})")


def _q(name: str) -> str:
    return repr(name)


def _shape(s) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


def check_header(path, tensors: dict[str, tuple[str, tuple[int, ...]]], meta: dict[str, str]) -> CacheHeader:
    """Rules 2-9 on a parsed header ({tensor name: (safetensors dtype, shape)} and the metadata); BadInput names the
    first rule broken, in the rules' order."""
    # 2: the metadata
    fmt = meta.get("format")
    if fmt in OLD_FORMATS:
        raise _refuse(path, f"format {fmt!r} records no model fingerprint, so it cannot be bound to its model: make "
                            f"the cache again (ridgefill compact / fold / engine prefix / engine fold)", 2)
    if fmt != FORMAT:
        raise _refuse(path, f"not a {FORMAT} file (format {fmt!r})", 2)
    extra = sorted(set(meta) - set(META))
    if extra:
        raise _refuse(path, f"metadata {_q(extra[0])} is not part of {FORMAT} (it holds {', '.join(META)})", 2)
    dtype = meta.get("dtype")
    if dtype not in CACHE_DTYPES:
        raise _refuse(path, f"metadata 'dtype' is {dtype!r}, not one of {', '.join(CACHE_DTYPES)}", 2)
    fp = meta.get("model_fingerprint")
    if not isinstance(fp, str) or not FINGERPRINT.fullmatch(fp):
        raise _refuse(path, f"metadata 'model_fingerprint' is {fp!r}, not 64 lowercase hex digits", 2)
    # 3: the names
    if not tensors:
        raise _refuse(path, "holds no tensors", 3)
    layers: dict[int, dict[str, str]] = {}
    for name in tensors:
        m = NAME.fullmatch(name)
        if m is None:
            raise _refuse(path, f"tensor {_q(name)} is not named layer.<l>.<field> (l in decimal without leading "
                                f"zeros, field one of {', '.join(FIELDS)})", 3)
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = name
    order = sorted(layers)
    named = [(l, f, layers[l][f]) for l in order for f in FIELDS if f in layers[l]]
    # 4: the dtypes
    for _, f, name in named:
        want = STORED[dtype] if f in KV else FIXED[f]
        got = tensors[name][0]
        if got != want:
            why = f"the cache dtype {dtype}" if f in KV else f"{f} is always {want}"
            raise _refuse(path, f"tensor {_q(name)} is {got}, not {want} ({why})", 4)
    # 5: layers 0..L-1, keys and values in each
    if order != list(range(len(order))):  # the first gap (never a range up to a forged huge index)
        gap = next(i for i, l in enumerate(order) if i != l)
        raise _refuse(path, f"layer {gap} is missing ('layer.{gap}.keys'): layers run 0..L-1 without a gap (this "
                            f"file has {len(order)} layers up to {order[-1]})", 5)
    for l in order:
        for f in KV:
            if f not in layers[l]:
                raise _refuse(path, f"tensor {_q(tensor_name(l, f))} is missing: every layer holds keys and values", 5)
    # 6: the shapes within a layer
    shape = {name: tuple(int(x) for x in tensors[name][1]) for _, _, name in named}
    for l in order:
        k = shape[layers[l]["keys"]]
        if len(k) != 3 or min(k) < 1:
            raise _refuse(path, f"tensor {_q(layers[l]['keys'])} has shape {_shape(k)}, not [kv_heads, entries, "
                                f"head_dim] with every size at least 1", 6)
        h, n, hd = k
        want = {"values": (h, n, hd), "positions": (h, n), "beta": (h, n), "u": (h, hd)}
        for f, w in want.items():
            if f in layers[l] and shape[layers[l][f]] != w:
                raise _refuse(path, f"tensor {_q(layers[l][f])} has shape {_shape(shape[layers[l][f]])}, not "
                                    f"{_shape(w)} (its layer's keys are {_shape(k)})", 6)
    # 7: the same heads and head_dim in every layer
    h0, _, hd0 = shape[layers[0]["keys"]]
    for l in order:
        h, _, hd = shape[layers[l]["keys"]]
        if (h, hd) != (h0, hd0):
            raise _refuse(path, f"tensor {_q(layers[l]['keys'])} has {h} KV heads of head_dim {hd}, 'layer.0.keys' "
                                f"{h0} of {hd0}: every layer has the same KV heads and head_dim", 7)
    # 8: the fields: an engine cache (keys, values), or a compact / fold cache (positions everywhere, beta or u)
    with_pos = [l for l in order if "positions" in layers[l]]
    if with_pos and len(with_pos) != len(order):
        l = next(l for l in order if "positions" not in layers[l])
        raise _refuse(path, f"tensor {_q(tensor_name(l, 'positions'))} is missing: a compact or fold cache holds "
                            f"positions in every layer", 8)
    beta = [l for l in order if "beta" in layers[l]]
    u = [l for l in order if "u" in layers[l]]
    if not with_pos and (beta or u):
        l = (beta or u)[0]
        f = "beta" if beta else "u"
        raise _refuse(path, f"tensor {_q(tensor_name(l, f))} in a cache without positions: an engine cache holds "
                            f"keys and values only, a compact or fold cache positions in every layer", 8)
    if with_pos and beta and u:
        raise _refuse(path, f"tensors {_q(tensor_name(beta[0], 'beta'))} and {_q(tensor_name(u[0], 'u'))} in one "
                            f"cache: a compact cache holds beta, a fold cache u, never both", 8)
    if with_pos and not (beta or u):
        raise _refuse(path, "tensor 'layer.0.positions' in a cache where no layer holds beta or u: a compact or "
                            "fold cache has compacted layers, an engine cache no positions", 8)
    kind = ENGINE if not with_pos else COMPACT if beta else FOLD
    # 9: how many entries each layer holds
    n = {l: shape[layers[l]["keys"]][1] for l in order}
    if kind == ENGINE:
        for l in order:
            if n[l] != n[0]:
                raise _refuse(path, f"tensor {_q(layers[l]['keys'])} holds {n[l]} positions and 'layer.0.keys' "
                                    f"{n[0]}: an engine cache holds the same number in every layer", 9)
    else:
        comp = beta or u
        plain = [l for l in order if l not in comp]
        for group, what in ((comp, "compacted layer keeps"), (plain, "uncompacted layer holds")):
            for l in group:
                if n[l] != n[group[0]]:
                    raise _refuse(path, f"tensor {_q(layers[l]['keys'])} holds {n[l]} entries and "
                                        f"{_q(layers[group[0]]['keys'])} {n[group[0]]}: every {what} as many", 9)
        if plain and n[comp[0]] >= n[plain[0]]:
            raise _refuse(path, f"tensor {_q(layers[comp[0]]['keys'])} keeps {n[comp[0]]} entries of a context of "
                                f"{n[plain[0]]} ({_q(layers[plain[0]]['keys'])}): a compacted layer keeps fewer", 9)
    return CacheHeader(path=Path(path), dtype=dtype, model_fingerprint=fp, kind=kind, kv_heads=h0, head_dim=hd0,
                       entries=tuple(n[l] for l in order),
                       fields=tuple(tuple(f for f in FIELDS if f in layers[l]) for l in order), shapes=shape,
                       tensors={})  # fmt: skip


def _unreadable(path, e: BadInput) -> BadInput:
    """safetensors' own refusal (which names the file by its bare name) as rule 1, naming the path."""
    msg, name = str(e), Path(path).name
    return _refuse(path, msg[len(name) + 2 :] if msg.startswith(name + ": ") else msg, 1)


def _file(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise _refuse(path, "missing", 1)
    if not p.is_file():
        raise _refuse(path, "not a regular file", 1)
    return p


def read_header(path, model: ModelShape | None = None, *, engine: bool = False) -> CacheHeader:
    """The header of a cache file, checked by rules 1-9 (and 12 with `model` or `engine`), the data left unread."""
    p = _file(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _refuse(path, "not a readable safetensors file (shorter than its 8-byte header length)", 1)
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, safetensors.MAX_HEADER):
            raise _refuse(path, f"not a readable safetensors file (header length {n} does not fit the file)", 1)
        raw = f.read(n)
    try:
        entries, meta = safetensors.parse_header(raw, size - 8 - n, p.name)
    except BadInput as e:
        raise _unreadable(path, e) from None
    header = check_header(path, {k: (e.dtype, e.shape) for k, e in entries.items()}, meta)
    header = replace(header, tensors=entries, data_start=8 + n)
    check_model(header, model, engine=engine)
    return header


# -------------------------------------------------------------------------------------------------- the data


def check_layer(header: CacheHeader, l: int, fields: dict[str, np.ndarray]) -> None:
    """Rules 10 and 11 on one layer's arrays as `read_cache` returns them (floats as float32, positions int32)."""
    path = header.path
    for f in ("keys", "values", "beta", "u"):
        if f in fields:
            bad = ~np.isfinite(fields[f])
            if bad.any():
                at = tuple(int(i) for i in np.argwhere(bad)[0])
                raise _refuse(path, f"tensor {_q(tensor_name(l, f))} holds {fields[f][at]} at {list(at)}: NaN and "
                                    f"infinity are refused", 10)
    if "positions" not in fields:
        return
    pos, name = fields["positions"].astype(np.int64), _q(tensor_name(l, "positions"))
    if pos.size and pos.min() < 0:
        raise _refuse(path, f"tensor {name} holds a negative position ({int(pos.min())})", 11)
    if (np.diff(pos, axis=1) <= 0).any():
        h = int(np.argwhere((np.diff(pos, axis=1) <= 0).any(axis=1))[0][0])
        raise _refuse(path, f"tensor {name}: head {h}'s positions do not rise strictly", 11)
    plain = [i for i in range(header.num_layers) if i not in header.compacted]
    if l in plain and (pos != np.arange(pos.shape[1])).any():
        raise _refuse(path, f"tensor {name}: an uncompacted layer holds positions 0..{pos.shape[1] - 1} in every head",
                      11)
    if l not in plain and plain and pos.size and pos.max() >= header.entries[plain[0]]:
        raise _refuse(path, f"tensor {name} holds position {int(pos.max())}, past the context of "
                            f"{header.entries[plain[0]]} its uncompacted layers hold", 11)


def _decoded(f: str, t) -> np.ndarray:
    return from_dtype(t) if f in KV else np.asarray(t)


def read_cache(path, model: ModelShape | None = None, *, engine: bool = False) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {"keys", "values" (float32), "positions" (int32), "beta" / "u" (float32, where present)}}, layers
    0..L-1 in order, after every rule of docs/cache.md (1-11, and 12 with `model` or `engine`)."""
    p = _file(path)
    try:
        arrays, meta = safetensors.decode(p.read_bytes(), p.name)
    except BadInput as e:
        raise _unreadable(path, e) from None
    shapes = {k: (safetensors.dtype_of(a), a.bits.shape if isinstance(a, safetensors.BF16) else a.shape)
              for k, a in arrays.items()}  # fmt: skip
    header = check_header(path, shapes, meta)
    check_model(header, model, engine=engine)
    layers = {l: {f: _decoded(f, arrays[tensor_name(l, f)]) for f in fs} for l, fs in enumerate(header.fields)}
    for l, fields in layers.items():
        check_layer(header, l, fields)
    return layers


def read_layer(header: CacheHeader, l: int) -> dict[str, np.ndarray]:
    """One layer's fields (as `read_cache` returns them), read from their byte ranges alone and checked by rules 10
    and 11: for a reader that loads layer by layer after `read_header`."""
    if not 0 <= l < header.num_layers:
        raise ValueError(f"{header.path}: no layer {l} (the cache has {header.num_layers})")
    out = {}
    for f in header.fields[l]:
        e = header.tensors[tensor_name(l, f)]
        dt = np.dtype("<u2" if e.dtype == "BF16" else {"F16": "<f2", "F32": "<f4", "I32": "<i4"}[e.dtype])
        a = np.fromfile(header.path, dtype=dt, count=int(np.prod(e.shape)), offset=header.data_start + e.start)
        if a.size != int(np.prod(e.shape)):
            raise _refuse(header.path, f"tensor {_q(tensor_name(l, f))} ends past the end of the file", 1)
        a = a.reshape(e.shape)
        out[f] = _decoded(f, safetensors.BF16(a) if e.dtype == "BF16" else a)
    check_layer(header, l, out)
    return out


# ----------------------------------------------------------------------------------------- rule 12: the model


def check_model(header: CacheHeader, model: ModelShape | None = None, *, engine: bool = False) -> None:
    """Rule 12: with `engine`, an engine cache (keys and values only, the same P in every layer); with `model`, a
    cache made for that model (its fingerprint, layer count, KV heads and head_dim, each where given)."""
    path = header.path
    if engine and header.kind != ENGINE:
        field_ = "beta" if header.kind == COMPACT else "u"
        raise _refuse(path, f"a {header.kind} artifact's cache (positions and {field_}), which an engine cannot "
                            f"load as it is: `ridgefill engine fold` presents a fold artifact's cache for one", 12)
    if model is None:
        return
    if model.fingerprint is not None and header.model_fingerprint != model.fingerprint:
        raise _refuse(path, f"metadata 'model_fingerprint' says the cache was made for model "
                            f"{header.model_fingerprint[:12]}, not this one ({model.fingerprint[:12]})", 12)
    keys = _q("layer.0.keys")
    if model.num_layers is not None and header.num_layers != model.num_layers:
        raise _refuse(path, f"the cache holds {header.num_layers} layers ('layer.{header.num_layers - 1}.keys' the "
                            f"last); the model has {model.num_layers}", 12)
    if model.kv_heads is not None and header.kv_heads != model.kv_heads:
        raise _refuse(path, f"tensor {keys} has {header.kv_heads} KV heads; the model has {model.kv_heads}", 12)
    if model.head_dim is not None and header.head_dim != model.head_dim:
        raise _refuse(path, f"tensor {keys} has head_dim {header.head_dim}; the model has {model.head_dim}", 12)


# --------------------------------------------------------------------------------------------------- writing


def encode_layer(layer: int, fields: dict[str, np.ndarray], dtype: str) -> dict:
    """One layer's {field: array} as named safetensors entries: keys and values in the cache dtype."""
    return {tensor_name(layer, name): to_dtype(a, dtype) if name in KV else np.ascontiguousarray(a)
            for name, a in fields.items()}  # fmt: skip


def write_cache(path: Path, layers: dict[int, dict[str, np.ndarray]], dtype: str, model_fingerprint: str) -> None:
    """cache.safetensors from {layer: {field: array}} and the fingerprint of the model it was made from, after the
    rules a reader applies (1-11): nothing is written that `read_cache` would refuse."""
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of {', '.join(CACHE_DTYPES)}, got {dtype!r}")
    arrays = {}
    for l, fields in layers.items():
        arrays |= encode_layer(l, fields, dtype)
    meta = {"format": FORMAT, "dtype": dtype, "model_fingerprint": model_fingerprint}
    shapes = {k: (safetensors.dtype_of(a), a.bits.shape if isinstance(a, safetensors.BF16) else a.shape)
              for k, a in arrays.items()}  # fmt: skip
    header = check_header(path, shapes, meta)
    for l, fs in enumerate(header.fields):
        check_layer(header, l, {f: _decoded(f, arrays[tensor_name(l, f)]) for f in fs})
    safetensors.save(path, arrays, meta)
