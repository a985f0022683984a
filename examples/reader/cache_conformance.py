"""The conformance corpus of the cache format `ridgefill-cache/2` (docs/cache.md): cache files a reader must accept
and files it must refuse, at least one per rule of "Reading a cache", each with its expected verdict.

    python examples/reader/cache_conformance.py OUT     # writes OUT/<case>.safetensors and OUT/expected.json

`expected.json` maps each case to {"rule": ..., "names": [...], "model": {...}, "verdicts": {reader: rule}}: `rule`
is the number of the rule the file breaks (0 for a valid file); a refusal's one-line message must start with the
file's path followed by ": ", contain every string of `names` (the tensor or key it is about, quoted as the message
quotes it) and end with "(rule N)". A reader sees only some rules, so `verdicts` gives, per kind of reader, the rule
it must refuse with (0: it must accept): `header` (`read_header`: rules 1-9), `cache` (`read_cache`: 1-11), and the
engine readers, which also apply rule 12 against `model` (the model the cache is served with):
`engine_header` (`read_header(path, model, engine=True)`) and `engine_cache` (`read_cache(path, model,
engine=True)`, which is what llama.cpp's loader runs).

The valid files are written by ridgefill's own writer from seeded arrays (`original(base)` gives them back); the
invalid ones are those files edited tensor by tensor or byte by byte, so that each breaks one rule and no earlier
one. tests/test_cache_format.py runs every reader over the corpus.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ridgefill.formats.cache import write_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the release corpus beside it edits safetensors the same way
from conformance import Tensor, encode_st, read_st  # noqa: E402

FP, OTHER_FP = "ab" * 32, "cd" * 32  # the fingerprint of the model the caches are made for, and another model's
H, HD, N, R, P = 2, 4, 10, 3, 6  # KV heads, head_dim, context length, kept per compacted layer, engine positions
SIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
NUMPY = {"F64": "<f8", "I64": "<i8", "F32": "<f4", "I32": "<i4", "F16": "<f2"}


# ------------------------------------------------------------------------------------------ the valid caches


def _engine(layers: int, seed: int, p: int = P) -> dict:
    g = np.random.default_rng(seed)
    return {l: {"keys": g.standard_normal((H, p, HD)), "values": g.standard_normal((H, p, HD))} for l in range(layers)}


def _compacted(kinds: str, extra: str, seed: int) -> dict:
    """Layers of kind "c" (compacted: r kept entries, positions ascending, and `extra`: beta or u) or "p"
    (uncompacted: the whole context, positions 0..N-1)."""
    g = np.random.default_rng(seed)
    out = {}
    for l, kind in enumerate(kinds):
        n = R if kind == "c" else N
        d = {"keys": g.standard_normal((H, n, HD)), "values": g.standard_normal((H, n, HD))}
        if kind == "c":
            d["positions"] = np.stack([np.sort(g.choice(N, R, replace=False)) for _ in range(H)]).astype(np.int32)
            d[extra] = (g.uniform(-3, 3, (H, R)) if extra == "beta" else g.standard_normal((H, HD))).astype(np.float32)
        else:
            d["positions"] = np.broadcast_to(np.arange(N, dtype=np.int32), (H, N))
        out[l] = d
    return out


@dataclass(frozen=True)
class Base:
    """A valid cache: its layers (seeded), cache dtype, kind and the fingerprint it records."""

    layers: Callable[[], dict]
    dtype: str
    kind: str
    fingerprint: str = FP


BASES = {
    "engine-f32": Base(lambda: _engine(3, 0), "float32", "engine"),
    "engine-bf16": Base(lambda: _engine(3, 1), "bfloat16", "engine"),
    "engine-f16": Base(lambda: _engine(3, 2), "float16", "engine"),
    "engine-11-layers": Base(lambda: _engine(11, 3, p=2), "float32", "engine"),  # "layer.10" sorts before "layer.2"
    "compact-bf16": Base(lambda: _compacted("ccc", "beta", 4), "bfloat16", "compact"),  # a llama: every layer compacted
    "compact-sliding": Base(lambda: _compacted("cpcp", "beta", 5), "bfloat16", "compact"),  # gemma-like
    "fold-f16": Base(lambda: _compacted("ccc", "u", 6), "float16", "fold"),
    "fold-sliding-f32": Base(lambda: _compacted("pcpc", "u", 7), "float32", "fold"),
    "engine-other-model": Base(lambda: _engine(3, 8), "float32", "engine", OTHER_FP),
}


def original(base: str) -> dict:
    return BASES[base].layers()


def write_base(base: str, path: Path) -> None:
    b = BASES[base]
    write_cache(path, b.layers(), b.dtype, b.fingerprint)


# ---------------------------------------------------------------------------------------------- raw editing


def tensors(fn: Callable[[dict[str, Tensor], dict[str, str]], None]) -> Callable[[Path], None]:
    """An edit of the file's tensors or metadata (the file re-encoded, byte ranges made to agree)."""
    def run(path: Path) -> None:
        ts, meta = read_st(path)
        fn(ts, meta)
        path.write_bytes(encode_st(ts, meta))
    return run


def meta(**changes) -> Callable[[Path], None]:
    """Metadata keys set (None: removed)."""
    def fn(ts, m):
        for k, v in changes.items():
            m.pop(k, None) if v is None else m.__setitem__(k, v)
    return tensors(fn)


def _values(t: Tensor) -> np.ndarray:
    """A float or int tensor's values as float64 (BF16 from its bit patterns)."""
    if t.dtype == "BF16":
        return (np.frombuffer(t.data, "<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(t.data, NUMPY[t.dtype]).astype(np.float64)


def retype(name: str, dtype: str) -> Callable[[Path], None]:
    """A tensor stored as `dtype` with the same values (what a careless writer does)."""
    def fn(ts, m):
        t = ts[name]
        v = _values(t)
        if dtype == "BF16":
            data = (v.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            data = v.astype(NUMPY[dtype]).tobytes()
        ts[name] = Tensor(dtype, t.shape, data)
    return tensors(fn)


def reshape(name: str, shape: list[int]) -> Callable[[Path], None]:
    """A tensor cut (or padded with zeros) to `shape`, its values in order."""
    def fn(ts, m):
        t = ts[name]
        size = int(np.prod(shape)) * SIZE[t.dtype]
        ts[name] = Tensor(t.dtype, list(shape), (t.data + b"\0" * size)[:size])
    return tensors(fn)


def cut_layer(l: int, n: int, fields=("keys", "values", "positions", "beta")) -> Callable[[Path], None]:
    """Layer l's entries cut to the first n of every head (keys, values, positions, beta where present)."""
    def fn(ts, m):
        for f in fields:
            name = f"layer.{l}.{f}"
            if name in ts:
                t = ts[name]
                h, old = t.shape[0], t.shape[1]
                row = int(np.prod(t.shape[2:])) * SIZE[t.dtype]
                data = b"".join(t.data[(i * old) * row : (i * old + n) * row] for i in range(h))
                ts[name] = Tensor(t.dtype, [h, n, *t.shape[2:]], data)
    return tensors(fn)


def drop(*names: str) -> Callable[[Path], None]:
    return tensors(lambda ts, m: [ts.pop(n) for n in names])


def rename(old: str, new: str) -> Callable[[Path], None]:
    return tensors(lambda ts, m: ts.__setitem__(new, ts.pop(old)))


def copy(old: str, new: str) -> Callable[[Path], None]:
    return tensors(lambda ts, m: ts.__setitem__(new, Tensor(ts[old].dtype, list(ts[old].shape), ts[old].data)))


def put(name: str, index: int, value: float) -> Callable[[Path], None]:
    """Element `index` (flat) of a tensor set to `value`, in the tensor's own dtype."""
    def fn(ts, m):
        t = ts[name]
        v = _values(t)
        v[index] = value
        if t.dtype == "BF16":
            data = (v.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            data = v.astype(NUMPY[t.dtype]).tobytes()
        ts[name] = Tensor(t.dtype, t.shape, data)
    return tensors(fn)


def add(name: str, dtype: str, shape: list[int]) -> Callable[[Path], None]:
    zeros = b"\0" * (int(np.prod(shape)) * SIZE[dtype])
    return tensors(lambda ts, m: ts.__setitem__(name, Tensor(dtype, shape, zeros)))


def both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def run(path: Path) -> None:
        for e in edits:
            e(path)
    return run


def _raw_header(fn: Callable[[str], str]) -> Callable[[Path], None]:
    """An edit of the JSON header's text (the data left as it is)."""
    def run(path: Path) -> None:
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        text = fn(raw[8 : 8 + n].decode().rstrip(" ")).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    return run


def _duplicate(text: str) -> str:
    h = json.loads(text)
    entry = json.dumps({"layer.0.keys": h["layer.0.keys"]}, separators=(",", ":"))[1:-1]
    return text[:-1] + "," + entry + "}"


def _reordered(path: Path) -> None:
    """The same tensors and metadata with the header's entries (and the data) in reverse order."""
    ts, m = read_st(path)
    path.write_bytes(encode_st(dict(reversed(list(ts.items()))), dict(reversed(list(m.items())))))


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _swap_positions(name: str) -> Callable[[Path], None]:
    def fn(ts, m):
        t = ts[name]
        a = bytearray(t.data)
        a[0:4], a[4:8] = t.data[4:8], t.data[0:4]
        t.data = bytes(a)
    return tensors(fn)


def _repeat_position(name: str) -> Callable[[Path], None]:
    """Head 0's second position set equal to its first."""
    def fn(ts, m):
        t = ts[name]
        t.data = t.data[0:4] + t.data[0:4] + t.data[8:]
    return tensors(fn)


def _shift_positions(name: str) -> Callable[[Path], None]:
    def fn(ts, m):
        t = ts[name]
        t.data = (np.frombuffer(t.data, "<i4") + 1).astype("<i4").tobytes()
    return tensors(fn)


# ----------------------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    name: str
    base: str
    change: Callable[[Path], None] | None
    rule: int  # the rule of docs/cache.md "Reading a cache" it breaks; 0: valid
    names: tuple[str, ...] = ()  # the message contains them
    model: dict = field(default_factory=lambda: {"num_layers": 3, "kv_heads": H, "head_dim": HD, "fingerprint": FP})

    @property
    def verdicts(self) -> dict[str, int]:
        """Per reader, the rule it refuses with (0: it accepts). A header reader cannot see rules 10-11; an engine
        reader refuses a compact or fold cache with rule 12 once rules 1-9 hold, before it reads the data."""
        r, engine_kind = self.rule, BASES[self.base].kind == "engine"
        if 1 <= r <= 9:
            return {"header": r, "cache": r, "engine_header": r, "engine_cache": r}
        if not engine_kind:
            return {"header": 0, "cache": r if r <= 11 else 0, "engine_header": 12, "engine_cache": 12}
        return {"header": 0, "cache": r if r <= 11 else 0, "engine_header": 12 if r == 12 else 0, "engine_cache": r}


L4 = {"num_layers": 4, "kv_heads": H, "head_dim": HD, "fingerprint": FP}
L11 = {"num_layers": 11, "kv_heads": H, "head_dim": HD, "fingerprint": FP}

CASES = [
    # valid caches
    Case("valid-engine-f32", "engine-f32", None, 0),
    Case("valid-engine-bf16", "engine-bf16", None, 0),
    Case("valid-engine-f16", "engine-f16", None, 0),
    Case("valid-engine-11-layers", "engine-11-layers", None, 0, model=L11),
    Case("valid-compact", "compact-bf16", None, 0),
    Case("valid-compact-sliding", "compact-sliding", None, 0, model=L4),
    Case("valid-fold", "fold-f16", None, 0),
    Case("valid-fold-sliding", "fold-sliding-f32", None, 0, model=L4),
    Case("valid-header-reordered", "engine-bf16", _reordered, 0),
    Case("valid-compact-reordered", "compact-sliding", _reordered, 0, model=L4),
    # 1: a readable safetensors file
    Case("file-missing", "engine-f32", lambda p: p.unlink(), 1, ("missing",)),
    Case("file-is-folder", "engine-f32", _folder, 1, ("not a regular file",)),
    Case("file-empty", "engine-f32", lambda p: p.write_bytes(b""), 1, ("8-byte header length",)),
    Case("file-truncated", "engine-f32", lambda p: p.write_bytes(p.read_bytes()[:-4]), 1, ("tensors end at",)),
    Case("file-not-json", "engine-f32", lambda p: p.write_bytes(b"\x10" + b"\0" * 7 + b"not json" * 2), 1,
         ("not JSON",)),
    Case("file-duplicate-tensor", "engine-f32", _raw_header(_duplicate), 1, ("'layer.0.keys'", "twice")),
    Case("file-metadata-not-strings", "engine-f32", _raw_header(lambda t: t.replace('"dtype":"float32"', '"dtype":4')),
         1, ("__metadata__",)),
    # 2: metadata
    Case("format-1", "engine-f32", meta(format="ridgefill-cache/1", model_fingerprint=None), 2,
         ("'ridgefill-cache/1'", "make the cache again")),
    Case("format-other", "engine-f32", meta(format="ridgefill-maps/1"), 2, ("'ridgefill-maps/1'",)),
    Case("format-missing", "engine-f32", meta(format=None), 2, ("format None",)),
    Case("metadata-extra-key", "engine-f32", meta(note="hello"), 2, ("'note'",)),
    Case("dtype-missing", "engine-f32", meta(dtype=None), 2, ("'dtype'",)),
    Case("dtype-unknown", "engine-f32", meta(dtype="int8"), 2, ("'dtype'", "'int8'")),
    Case("fingerprint-missing", "engine-f32", meta(model_fingerprint=None), 2, ("'model_fingerprint'",)),
    Case("fingerprint-uppercase", "engine-f32", meta(model_fingerprint="AB" * 32), 2, ("'model_fingerprint'",)),
    Case("fingerprint-short", "engine-f32", meta(model_fingerprint="ab" * 8), 2, ("'model_fingerprint'",)),
    # 3: names
    Case("no-tensors", "engine-f32", tensors(lambda ts, m: ts.clear()), 3, ("no tensors",)),
    Case("name-leading-zero", "engine-f32", rename("layer.1.keys", "layer.01.keys"), 3, ("'layer.01.keys'",)),
    Case("name-both-spellings", "engine-f32", copy("layer.1.keys", "layer.01.keys"), 3, ("'layer.01.keys'",)),
    Case("name-plus-sign", "engine-f32", rename("layer.1.keys", "layer.+1.keys"), 3, ("'layer.+1.keys'",)),
    Case("name-unknown-field", "engine-f32", copy("layer.0.keys", "layer.0.bias"), 3, ("'layer.0.bias'",)),
    Case("name-other", "engine-f32", rename("layer.2.values", "model.layers.2.values"), 3,
         ("'model.layers.2.values'",)),
    # 4: dtypes
    Case("keys-f64-in-bf16", "engine-bf16", retype("layer.0.keys", "F64"), 4, ("'layer.0.keys'", "F64", "BF16")),
    Case("keys-i32-in-bf16", "engine-bf16", retype("layer.1.keys", "I32"), 4, ("'layer.1.keys'", "I32")),
    Case("keys-f16-in-bf16", "engine-bf16", retype("layer.2.keys", "F16"), 4, ("'layer.2.keys'", "F16")),
    Case("keys-f32-in-bf16", "compact-bf16", retype("layer.0.keys", "F32"), 4, ("'layer.0.keys'", "F32")),
    Case("keys-bf16-in-f32", "engine-f32", retype("layer.0.keys", "BF16"), 4, ("'layer.0.keys'", "BF16")),
    Case("values-f32-in-f16", "fold-f16", retype("layer.1.values", "F32"), 4, ("'layer.1.values'",)),
    Case("positions-i64", "compact-bf16", retype("layer.0.positions", "I64"), 4, ("'layer.0.positions'", "I32")),
    Case("beta-bf16", "compact-bf16", retype("layer.2.beta", "BF16"), 4, ("'layer.2.beta'", "F32")),
    Case("u-f16", "fold-f16", retype("layer.0.u", "F16"), 4, ("'layer.0.u'",)),
    # 5: layers
    Case("layer-missing", "engine-f32", drop("layer.1.keys", "layer.1.values"), 5, ("'layer.1.keys'",)),
    Case("layer-extra-with-gap", "engine-f32", both(copy("layer.0.keys", "layer.4.keys"),
                                                    copy("layer.0.values", "layer.4.values")), 5, ("'layer.3.keys'",)),
    Case("layer-index-huge", "engine-f32", both(copy("layer.0.keys", "layer.99999999999999.keys"),
                                                copy("layer.0.values", "layer.99999999999999.values")), 5,
         ("'layer.3.keys'",)),
    Case("values-missing", "engine-f32", drop("layer.2.values"), 5, ("'layer.2.values'",)),
    Case("keys-missing", "compact-bf16", drop("layer.0.keys"), 5, ("'layer.0.keys'",)),
    # 6: shapes within a layer
    Case("keys-1d", "engine-f32", reshape("layer.0.keys", [H * P * HD]), 6, ("'layer.0.keys'",)),
    Case("keys-2d", "engine-f32", reshape("layer.1.keys", [H * P, HD]), 6, ("'layer.1.keys'",)),
    Case("keys-no-heads", "engine-f32", both(reshape("layer.0.keys", [0, P, HD]),
                                             reshape("layer.0.values", [0, P, HD])), 6, ("'layer.0.keys'",)),
    Case("values-fewer-positions", "engine-f32", reshape("layer.1.values", [H, P - 1, HD]), 6, ("'layer.1.values'",)),
    Case("values-other-heads", "engine-f32", reshape("layer.1.values", [H + 1, P, HD]), 6, ("'layer.1.values'",)),
    Case("values-other-head-dim", "engine-f32", reshape("layer.0.values", [H, P, HD + 2]), 6, ("'layer.0.values'",)),
    Case("positions-shape", "compact-bf16", reshape("layer.1.positions", [H, R - 1]), 6, ("'layer.1.positions'",)),
    Case("beta-shape", "compact-bf16", reshape("layer.0.beta", [H, R, 1]), 6, ("'layer.0.beta'",)),
    Case("u-shape", "fold-f16", reshape("layer.2.u", [H, R]), 6, ("'layer.2.u'",)),
    # 7: the same heads and head_dim in every layer
    Case("layer-other-head-dim", "engine-f32", both(reshape("layer.2.keys", [H, P, HD // 2]),
                                                    reshape("layer.2.values", [H, P, HD // 2])), 7,
         ("'layer.2.keys'",)),
    Case("layer-other-heads", "engine-f32", both(reshape("layer.1.keys", [1, P, HD]),
                                                 reshape("layer.1.values", [1, P, HD])), 7, ("'layer.1.keys'",)),
    # 8: the fields
    Case("positions-missing-in-a-layer", "compact-sliding", drop("layer.1.positions"), 8, ("'layer.1.positions'",)),
    Case("positions-in-an-engine-layer", "engine-f32", add("layer.1.positions", "I32", [H, P]), 8,
         ("'layer.0.positions'",)),
    Case("beta-in-engine-cache", "engine-f32", add("layer.0.beta", "F32", [H, P]), 8, ("'layer.0.beta'",)),
    Case("beta-and-u", "compact-bf16", add("layer.1.u", "F32", [H, HD]), 8, ("'layer.0.beta'", "'layer.1.u'")),
    Case("positions-without-beta", "compact-bf16", drop("layer.0.beta", "layer.1.beta", "layer.2.beta"), 8,
         ("'layer.0.positions'",)),
    # 9: entries per layer
    Case("engine-layers-differ", "engine-f32", cut_layer(2, P - 1), 9, ("'layer.2.keys'", "5 positions",
                                                                         "'layer.0.keys' 6")),
    Case("compacted-layers-differ", "compact-bf16", cut_layer(2, R - 1), 9, ("'layer.2.keys'", "'layer.0.keys' 3")),
    Case("uncompacted-layers-differ", "compact-sliding", cut_layer(3, N - 1), 9, ("'layer.3.keys'",
                                                                                   "'layer.1.keys' 10")),
    Case("compacted-not-below-context", "fold-sliding-f32", both(cut_layer(0, R), cut_layer(2, R)), 9,
         ("'layer.1.keys'",)),
    # 10: no NaN or infinity
    Case("nan-in-keys-bf16", "engine-bf16", put("layer.1.keys", 7, float("nan")), 10, ("'layer.1.keys'", "nan")),
    Case("inf-in-values-f16", "engine-f16", put("layer.0.values", 3, float("inf")), 10, ("'layer.0.values'", "inf")),
    Case("minus-inf-in-keys-f32", "engine-f32", put("layer.2.keys", 0, float("-inf")), 10, ("'layer.2.keys'",)),
    Case("nan-in-beta", "compact-bf16", put("layer.1.beta", 2, float("nan")), 10, ("'layer.1.beta'",)),
    Case("inf-in-u", "fold-f16", put("layer.0.u", 1, float("inf")), 10, ("'layer.0.u'",)),
    # 11: positions
    Case("position-negative", "compact-bf16", put("layer.0.positions", 0, -1), 11, ("'layer.0.positions'",)),
    Case("positions-not-ascending", "compact-bf16", _swap_positions("layer.1.positions"), 11,
         ("'layer.1.positions'",)),
    Case("positions-repeated", "fold-f16", _repeat_position("layer.2.positions"), 11, ("'layer.2.positions'",)),
    Case("uncompacted-positions-shifted", "compact-sliding", _shift_positions("layer.1.positions"), 11,
         ("'layer.1.positions'",)),
    Case("position-past-context", "fold-sliding-f32", put("layer.1.positions", R - 1, N), 11,
         ("'layer.1.positions'",)),
    # 12: against the model an engine serves
    Case("engine-other-fingerprint", "engine-other-model", None, 12, ("'model_fingerprint'",)),
    Case("engine-more-layers", "engine-11-layers", None, 12, ("11 layers",)),
    Case("engine-other-heads", "engine-f32", None, 12, ("KV heads",),
         model={"num_layers": 3, "kv_heads": 4, "head_dim": HD, "fingerprint": FP}),
    Case("engine-other-head-dim", "engine-f32", None, 12, ("head_dim",),
         model={"num_layers": 3, "kv_heads": H, "head_dim": 8, "fingerprint": FP}),
]


def generate(out: Path) -> dict[str, dict]:
    """Write every case as out/<name>.safetensors and out/expected.json; returns the expectations."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for case in CASES:
        path = out / f"{case.name}.safetensors"
        if path.is_dir():
            path.rmdir()
        write_base(case.base, path)
        if case.change is not None:
            case.change(path)
        expected[case.name] = {"rule": case.rule, "base": case.base, "names": list(case.names), "model": case.model,
                               "verdicts": case.verdicts}  # fmt: skip
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return expected


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/reader/cache_conformance.py OUT")
    cases = generate(Path(sys.argv[1]))
    print(f"{len(cases)} cases ({sum(c['rule'] == 0 for c in cases.values())} valid) in {sys.argv[1]}")
