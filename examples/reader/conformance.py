"""The conformance corpus of the release format `ridgefill-maps/2`, of `ridgefill-maps/1`, which readers still read,
and of `ridgefill-maps/3`, maps that read earlier states besides the split's (docs/format.md): release folders that a
reader must accept and folders it must refuse, one or more per rule of the spec, each with its expected verdict.

    python examples/reader/conformance.py OUT        # writes OUT/<case>/ and OUT/expected.json

`expected.json` maps each case to {"verdict": "ok" | "refused", "file": ..., "names": [...], "rule": ...}: a
refusal's one-line message must start with `file` followed by ": " (the file or folder entry at fault) and contain
every string of `names` (the field, tensor or file it is about, quoted as the message quotes it). `rule` is the
number of the rule in the spec's "Verifying" list (0 for a valid folder).

The valid `/2` releases are written by ridgefill's own writer; the valid `/1` releases as that writer wrote them
before `/2` (the same deterministic safetensors encoder, `write_v1`): layers 2, 12, 13 of 14 and 96-row maps of a
160-wide model, which `/1` allows (it never tied `layers` to `split` nor the widths to the model). The valid `/3`
releases are `/2` ones whose maps read two or three states (`states`), 160 columns each. The invalid cases
are those folders edited byte by byte, re-sealed where a case needs the hashes to agree, so that each case breaks one
rule and no earlier one.
tests/test_conformance.py runs `ridgefill verify`, the loader and the independent reader beside this file
(ridgefill_reader.py) over the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ridgefill.formats import int8
from ridgefill.formats.release import write_release
from ridgefill.formats.release.names import facts_json, manifest_text
from ridgefill.formats.safetensors import BF16, encode
from ridgefill.numerics import f32_to_bf16_bits

LAYERS = (2, 12, 13)  # /1: "layer.12" sorts before "layer.2": a reader must not rely on name order
D_IN, D_OUT = 160, 96  # /1: the last scale group of a row is 32 columns wide
V1 = "ridgefill-maps/1"
# /2: a 12-layer model split at 9 ("layer.10" sorts before "layer.9"), hidden size 160, 2 KV heads of 24 dims
LAYERS2, SPLIT2, NUM_LAYERS2, KV_HEADS, HEAD_DIM = (9, 10, 11), 9, 12, 2, 24
KV = 2 * KV_HEADS * HEAD_DIM  # a kv map's d_out: keys then values, 96 rows
V2, V3 = "ridgefill-maps/2", "ridgefill-maps/3"
# /3: the layers whose entering states the maps read, side by side (the split first; the rest in any order, 0 the
# embeddings): d_in = D_IN * len(states)
STATES_TWO, STATES_THREE = [SPLIT2, 4], [SPLIT2, 7, 0]
MANIFEST, MAPS, PROTECTED, CORRECTIONS = "ridgefill.json", "maps.safetensors", "protected.safetensors", \
    "corrections.safetensors"
ITEMSIZE = {"I8": 1, "I32": 4, "BF16": 2, "F16": 2, "F32": 4}


# -------------------------------------------------------------------------------------------- valid releases


def _manifest(kinds: dict[int, str] | None = None) -> dict:
    """A /1 manifest (the writer sets `format`, `projector` and `files`)."""
    kinds = kinds or {}
    return {
        "model": {"name": "example/model-1", "revision": "0" * 40, "architecture": "llama", "num_layers": 14,
                  "hidden_size": D_IN, "fingerprint": "ab" * 32},
        "license": "apache-2.0",
        "split": 2,
        "tail_default": 512,
        "layers": [{"index": i, "kind": kinds.get(i, "full_attention")} for i in LAYERS],
        "fit": {"alpha": 0.001, "lambda": 0.03, "rows": 4096, "documents": 12, "tokens": 4108, "chat": False,
                "chat_share": None, "skip_first_rows": 1, "outlier_ratio": 20.0, "exact_norm": 812.5,
                "calibration_sha256": ["cd" * 32]},
        "heldout": {"fitted": {"k_cosine": 0.95, "v_cosine": 0.81}, "identity": {"k_cosine": 0.85, "v_cosine": 0.5},
                    "rows": 512, "metric": "kv"},
    }


def _maps(quantized: bool, seed: int = 0, shapes: dict[int, tuple[int, int]] | None = None) -> dict:
    """{layer: map} as the writer takes them; `shapes` {layer: (d_out, d_in)}, by default the /1 ones."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer, shape in (shapes or {l: (D_OUT, D_IN) for l in LAYERS}).items():
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        b = rng.standard_normal(shape[0]).astype(np.float32)
        if quantized:
            codes, bits = int8.quantize(w)
            out[layer] = {"codes": codes, "scale_bits": bits, "bias": b}
        else:
            out[layer] = {"weight": w, "bias": b}
    return out


def _extras(protected: bool, linear: tuple[int, ...], seed: int) -> dict:
    """The writer's keyword arguments for a protected-token table and the `linear` layers' state offsets."""
    kw: dict = {}
    if protected:
        kw.update(protected=np.array([3, 7, 40 + seed], dtype=np.int32),
                  protected_facts={"share": 0.25, "types": 3, "max_count": 17})
    if linear:
        rng = np.random.default_rng(seed + 100)
        kw.update(state_offsets={l: rng.standard_normal((2, 4, 4)).astype(np.float32) for l in linear},
                  state_facts={"chunk": 64, "states_per_layer": 8, "data_sha256": "ef" * 32})
    return kw


def _write(d: Path, dtype: str = "int8", protected: bool = False, hybrid: bool = False, seed: int = 0) -> None:
    """A /1 release: layers 2, 12 and 13 (12 and 13 Gated DeltaNet in a hybrid), 96 x 160 input maps."""
    kinds = {12: "linear_attention", 13: "linear_attention"} if hybrid else None
    write_v1(d, _maps(dtype == "int8", seed), _manifest(kinds), dtype, **_extras(protected, (12, 13) if hybrid
                                                                                  else (), seed))


def write_v1(d: Path, maps: dict, manifest: dict, dtype: str, protected=None, protected_facts=None,
             state_offsets=None, state_facts=None) -> None:
    """A `ridgefill-maps/1` folder, byte for byte as ridgefill's writer wrote it before `/2` (which it now writes):
    the same tensors, facts and deterministic encoder, `format` "ridgefill-maps/1"."""
    tensors: dict = {}
    for layer, m in maps.items():
        bias = BF16(f32_to_bf16_bits(m["bias"])) if dtype != "f32" else m["bias"]
        if dtype == "int8":
            tensors.update({f"layer.{layer}.codes": m["codes"], f"layer.{layer}.scales": BF16(m["scale_bits"])})
        else:
            tensors[f"layer.{layer}.weight"] = BF16(f32_to_bf16_bits(m["weight"])) if dtype == "bf16" else m["weight"]
        tensors[f"layer.{layer}.bias"] = bias
    m = {**manifest, "format": V1, "projector": {"dtype": dtype, "group_size": int8.GROUP_SIZE if dtype == "int8"
                                                 else None, "files": [MAPS]}}
    extra = {}
    if state_offsets:
        extra[CORRECTIONS] = encode({f"layer.{l}.state_offset": o for l, o in state_offsets.items()}, {"format": V1})
        m["corrections"] = {"state": {**state_facts, "file": CORRECTIONS, "layers": sorted(state_offsets),
                                      "sha256": hashlib.sha256(extra[CORRECTIONS]).hexdigest()}}
    if protected is not None:
        extra[PROTECTED] = encode({"protected_token_ids": protected}, {"format": V1})
        m["protected_tokens"] = {**protected_facts, "file": PROTECTED,
                                 "sha256": hashlib.sha256(extra[PROTECTED]).hexdigest()}
    blob = encode(tensors, {"format": V1, "ridgefill.facts": facts_json(m)})
    m["files"] = {MAPS: hashlib.sha256(blob).hexdigest(),
                  **{name: hashlib.sha256(data).hexdigest() for name, data in extra.items()}}
    d.mkdir(parents=True)
    for name, data in {MAPS: blob, **extra, MANIFEST: manifest_text(m).encode(),
                       "README.md": b"# example release\n"}.items():
        (d / name).write_bytes(data)


def _manifest2(kinds: dict[int, str], maps: dict[int, str]) -> dict:
    """A /2 manifest: layers 9..11 of 12 with their kinds and map kinds."""
    m = _manifest()
    m["model"].update(num_layers=NUM_LAYERS2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      architecture="qwen3_5" if "linear_attention" in kinds.values() else "qwen3")
    m.update(split=SPLIT2, layers=[{"index": l, "kind": kinds[l], "map": maps[l]} for l in LAYERS2])
    return m


def _write2(d: Path, dtype: str, kinds: dict[int, str], maps: dict[int, str], corrections: bool = False,
            protected: bool = False, seed: int = 0) -> None:
    """A /2 release written by ridgefill's writer: kv maps [96, 160], input maps [160, 160]."""
    shapes = {l: (KV if maps[l] == "kv" else D_IN, D_IN) for l in LAYERS2}
    linear = tuple(l for l in LAYERS2 if kinds[l] == "linear_attention") if corrections else ()
    write_release(d, _maps(dtype == "int8", seed, shapes), _manifest2(kinds, maps), "# example release\n",
                  weight_dtype=None if dtype == "int8" else dtype, **_extras(protected, linear, seed))


def _write3(d: Path, dtype: str, kinds: dict[int, str], maps: dict[int, str], states: list[int], seed: int = 0) -> None:
    """A /3 release written by ridgefill's writer (a manifest with `states`): maps [d_out, 160 * len(states)]."""
    shapes = {l: (KV if maps[l] == "kv" else D_IN, D_IN * len(states)) for l in LAYERS2}
    write_release(d, _maps(dtype == "int8", seed, shapes), {**_manifest2(kinds, maps), "states": states},
                  "# example release\n", weight_dtype=None if dtype == "int8" else dtype)


ATTENTION = {l: "full_attention" for l in LAYERS2}
HYBRID = {9: "linear_attention", 10: "full_attention", 11: "linear_attention"}  # Qwen3.5's pattern, in part
ALL_KV = {l: "kv" for l in LAYERS2}
MIXED = {9: "input", 10: "kv", 11: "input"}  # Gated DeltaNet layers keep input maps


# ---------------------------------------------------------------------------------------- editing a folder


def read_json(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())


def write_json(d: Path, m, **kw) -> None:
    (d / MANIFEST).write_text(json.dumps(m, sort_keys=True, indent=2, **kw) + "\n")


def edit(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    """An edit of ridgefill.json alone (the hashes are left as they are)."""
    def run(d: Path) -> None:
        m = read_json(d)
        fn(m)
        write_json(d, m)
    return run


@dataclass
class Tensor:
    dtype: str
    shape: list[int]
    data: bytes


def read_st(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = raw[8 + n:]
    return {k: Tensor(v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}, meta


def encode_st(tensors: dict[str, Tensor], meta: dict[str, str], header_text: str | None = None) -> bytes:
    """safetensors bytes; `header_text` replaces the JSON header the tensors would give (for malformed headers)."""
    header, body, at = {"__metadata__": meta}, b"", 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [at, at + len(t.data)]}
        body += t.data
        at += len(t.data)
    text = (header_text if header_text is not None else json.dumps(header, separators=(",", ":"))).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reseal(d: Path) -> None:
    """Make every hash agree again after a tensor edit: the facts' sha256 of the other tensor files, the facts
    maps.safetensors records (from the manifest), then `files`."""
    m = read_json(d)
    if PROTECTED in m["files"] and "protected_tokens" in m:
        m["protected_tokens"]["sha256"] = sha(d / PROTECTED)
    if CORRECTIONS in m["files"] and "corrections" in m:
        m["corrections"]["state"]["sha256"] = sha(d / CORRECTIONS)
    tensors, meta = read_st(d / MAPS)
    facts = {k: v for k, v in m.items() if k not in ("files", "eval")}
    meta["ridgefill.facts"] = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    (d / MAPS).write_bytes(encode_st(tensors, meta))
    m["files"] = {name: sha(d / name) for name in m["files"]}
    write_json(d, m)


def tensors(file: str, fn: Callable[[dict[str, Tensor], dict[str, str]], None],
            resealed: bool = True) -> Callable[[Path], None]:
    """An edit of one tensor file's tensors or metadata, then (by default) every hash made to agree."""
    def run(d: Path) -> None:
        ts, meta = read_st(d / file)
        fn(ts, meta)
        (d / file).write_bytes(encode_st(ts, meta))
        if resealed:
            reseal(d)
    return run


def facts(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    """An edit of the facts in both places (manifest and maps.safetensors), hashes resealed: what a forger who
    edits consistently makes; the tensors must then catch it."""
    def run(d: Path) -> None:
        m = read_json(d)
        fn(m)
        write_json(d, m)
        reseal(d)
    return run


def header(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    """An edit of maps.safetensors' raw JSON header (byte ranges, names), sha256 resealed."""
    def run(d: Path) -> None:
        raw = (d / MAPS).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        h = json.loads(raw[8:8 + n])
        body = raw[8 + n:]
        text = fn(h) or json.dumps(h, separators=(",", ":"))
        text = text.encode() + b" " * (-len(text.encode()) % 8)
        (d / MAPS).write_bytes(struct.pack("<Q", len(text)) + text + body)
        m = read_json(d)
        m["files"][MAPS] = sha(d / MAPS)
        write_json(d, m)
    return run


def _set(t: Tensor, index: int, value: bytes) -> None:
    t.data = t.data[:index * len(value)] + value + t.data[(index + 1) * len(value):]


def _copy_from(other: Callable[[Path], None], file: str) -> Callable[[Path], None]:
    """Replace `file` by the same file of another valid release, and fix `files` (not the facts)."""
    def run(d: Path) -> None:
        tmp = d.parent / (d.name + ".other")
        other(tmp)
        shutil.copyfile(tmp / file, d / file)
        shutil.rmtree(tmp)
        m = read_json(d)
        m["files"][file] = sha(d / file)
        write_json(d, m)
    return run


def _symlink(name: str) -> Callable[[Path], None]:
    def run(d: Path) -> None:
        os.rename(d / name, d / (name + ".real"))
        os.symlink(name + ".real", d / name)
    return run


def _rename_tensor(ts: dict, meta: dict) -> None:
    ts["layer.2.code"] = ts.pop("layer.2.codes")


def _dup_key(m_text: str) -> str:
    return m_text.replace('"split": 2,', '"split": 2,\n  "split": 3,', 1)


def _fix_maps_sha(d: Path) -> None:
    m = read_json(d)
    m["files"][MAPS] = sha(d / MAPS)
    write_json(d, m)


def _replace(d: Path, name: str, data: bytes) -> None:
    (d / name).write_bytes(data)
    _fix_maps_sha(d) if name == MAPS else None


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _truncate(t: Tensor, shape: list[int]) -> None:
    t.shape = shape
    t.data = t.data[:int(np.prod(shape)) * ITEMSIZE[t.dtype]]


def _entries(h: dict) -> list[tuple[str, dict]]:
    return sorted(((k, v) for k, v in h.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])


def _overlap(h: dict) -> None:
    (_, a), (_, b) = _entries(h)[:2]
    b["data_offsets"] = [b["data_offsets"][0] - 1, b["data_offsets"][1] - 1]


def _gap(h: dict) -> None:
    (_, last) = _entries(h)[-1]  # one row shorter, starting one row later: a gap before it
    row = ITEMSIZE[last["dtype"]] * int(np.prod(last["shape"][1:]))
    last["data_offsets"] = [last["data_offsets"][0] + row, last["data_offsets"][1]]
    last["shape"] = [last["shape"][0] - 1, *last["shape"][1:]]


def _duplicate_tensor(h: dict) -> str:
    text = json.dumps(h, separators=(",", ":"))
    entry = json.dumps({"layer.2.bias": h["layer.2.bias"]}, separators=(",", ":"))[1:-1]
    return text[:-1] + "," + entry + "}"


# ----------------------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    name: str
    base: Callable[[Path], None]
    change: Callable[[Path], None] | None
    rule: int  # the rule of docs/format.md "Verifying" it breaks; 0: valid
    file: str = ""  # the message starts with it
    names: tuple[str, ...] = ()  # the message contains them

    @property
    def verdict(self) -> str:
        return "ok" if self.rule == 0 else "refused"


def int8_release(d): _write(d)
def f32_release(d): _write(d, "f32")
def bf16_release(d): _write(d, "bf16")
def protected_release(d): _write(d, protected=True)
def hybrid_release(d): _write(d, hybrid=True)
def other_protected(d): _write(d, protected=True, seed=1)
def other_hybrid(d): _write(d, hybrid=True, seed=1)
def kv_int8(d): _write2(d, "int8", ATTENTION, ALL_KV)
def kv_f32(d): _write2(d, "f32", ATTENTION, ALL_KV)
def mixed_int8(d): _write2(d, "int8", HYBRID, MIXED, corrections=True, protected=True)
def mixed_plain(d): _write2(d, "int8", HYBRID, MIXED)
def input_bf16(d): _write2(d, "bf16", ATTENTION, {l: "input" for l in LAYERS2})
def states_int8(d): _write3(d, "int8", ATTENTION, MIXED, STATES_TWO)
def states_kv_f32(d): _write3(d, "f32", ATTENTION, ALL_KV, STATES_THREE)


def _text(fn: Callable[[str], str]) -> Callable[[Path], None]:
    def run(d: Path) -> None:
        (d / MANIFEST).write_text(fn((d / MANIFEST).read_text()))
    return run


def _hf_download(d: Path) -> None:
    (d / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (d / ".cache" / "huggingface" / "download").mkdir(parents=True)


def _split_float(d: Path) -> None:
    (d / MANIFEST).write_text((d / MANIFEST).read_text().replace('"split": 2,', '"split": 2.0,'))


def _unsorted_facts(ts, meta) -> None:
    f = json.loads(meta["ridgefill.facts"])
    meta["ridgefill.facts"] = json.dumps(dict(reversed(list(f.items()))), indent=1)


def _listed_notes(d: Path) -> None:
    """A file listed in `files` with its right sha256, but named by no fact: not tied to the release."""
    (d / "notes.txt").write_text("x")
    m = read_json(d)
    m["files"]["notes.txt"] = sha(d / "notes.txt")
    write_json(d, m)


def _split_tensor_files(d: Path) -> None:
    """The tensors spread over two files, every hash resealed: the second file's hash is in no fact."""
    ts, meta = read_st(d / MAPS)
    moved = {k: ts.pop(k) for k in [k for k in ts if k.startswith("layer.13.")]}
    (d / "maps-2.safetensors").write_bytes(encode_st(moved, {"format": meta["format"]}))
    (d / MAPS).write_bytes(encode_st(ts, meta))
    m = read_json(d)
    m["projector"]["files"] = [MAPS, "maps-2.safetensors"]
    m["files"]["maps-2.safetensors"] = "0" * 64
    write_json(d, m)
    reseal(d)


def _bad_layers(m: dict) -> None:
    m["layers"] = m["layers"][:2]


CASES = [
    # valid releases
    Case("valid-int8", int8_release, None, 0),
    Case("valid-f32", f32_release, None, 0),
    Case("valid-bf16", bf16_release, None, 0),
    Case("valid-protected", protected_release, None, 0),
    Case("valid-hybrid-corrections", hybrid_release, None, 0),
    Case("valid-hf-download-leftovers", int8_release, _hf_download, 0),
    Case("valid-no-readme", int8_release, lambda d: (d / "README.md").unlink(), 0),
    Case("valid-readme-rewritten", int8_release, lambda d: (d / "README.md").write_text("---\ntags: [x]\n---\n"), 0),
    Case("valid-manifest-reformatted", int8_release, _text(lambda t: json.dumps(json.loads(t), indent=4)), 0),
    Case("valid-number-by-value", int8_release, _split_float, 0),
    Case("valid-eval-added", int8_release, edit(lambda m: m.update(eval={"samples": 12, "arms": {}})), 0),
    Case("valid-configured-rows", int8_release, facts(lambda m: m.update(configuration={
        "arm": "ridgefill+rows", "sweep": "0123456789abcdef", "row_share": 0.2})), 0),
    Case("valid-configured-protected", protected_release, facts(lambda m: m.update(configuration={
        "arm": "ridgefill+protected", "sweep": None})), 0),
    Case("valid-configured-plain", int8_release, facts(lambda m: m.update(configuration={
        "arm": "ridgefill", "sweep": None})), 0),
    Case("valid-exact-norm-integer", int8_release, facts(lambda m: m["fit"].update(exact_norm=812)), 0),
    Case("valid-facts-not-canonical", int8_release, lambda d: (tensors(MAPS, _unsorted_facts, resealed=False)(d),
                                                               _fix_maps_sha(d)), 0),
    Case("valid-v1-no-skip-first-rows", int8_release, facts(lambda m: m["fit"].pop("skip_first_rows")), 0),
    Case("valid-v1-split-at-last-layer", int8_release, facts(lambda m: m.update(split=13)), 0),
    Case("valid-v2-kv-int8", kv_int8, None, 0),
    Case("valid-v2-kv-f32", kv_f32, None, 0),
    Case("valid-v2-mixed-hybrid", mixed_int8, None, 0),
    Case("valid-v2-input-bf16", input_bf16, None, 0),
    Case("valid-v2-configured-kscale", kv_int8, facts(lambda m: m.update(configuration={
        "arm": "ridgefill+kscale", "sweep": None})), 0),
    Case("valid-v2-largest-tail", kv_f32, facts(lambda m: m.update(tail_default=2**31 - 1)), 0),
    Case("valid-v3-int8", states_int8, None, 0),
    Case("valid-v3-kv-f32", states_kv_f32, None, 0),
    Case("valid-v3-states-by-value", states_int8, facts(lambda m: m.update(states=[9.0, 4.0])), 0),
    Case("manifest-missing", int8_release, lambda d: (d / MANIFEST).unlink(), 1, MANIFEST),
    Case("manifest-not-json", int8_release, _text(lambda t: t[:-3]), 1, MANIFEST, ("invalid JSON",)),
    Case("manifest-not-utf8", int8_release, lambda d: (d / MANIFEST).write_bytes(b'{"format": "\xff"}'), 1,
         MANIFEST),
    Case("manifest-array", int8_release, _text(lambda t: f"[{t}]"), 1, MANIFEST),
    Case("manifest-duplicate-key", int8_release, _text(_dup_key), 1, MANIFEST, ("'split'",)),
    Case("manifest-nan", int8_release, _text(lambda t: t.replace('"split": 2,', '"split": NaN,')), 1, MANIFEST,
         ("NaN",)),
    Case("manifest-infinity-in-eval", int8_release, _text(lambda t: t.replace("{", '{"eval": {"x": Infinity},', 1)),
         1, MANIFEST, ("Infinity",)),
    Case("manifest-overflowing-number", int8_release, _text(lambda t: t.replace('"alpha": 0.001', '"alpha": 1e999')),
         1, MANIFEST, ("1e999",)),
    Case("manifest-format", int8_release, edit(lambda m: m.update(format="ridgefill-maps/4")), 1, MANIFEST,
         ("ridgefill-maps/4",)),
    Case("manifest-symlink", int8_release, _symlink(MANIFEST), 1, MANIFEST, ("symbolic link",)),
    # 2: files
    Case("files-missing", int8_release, edit(lambda m: m.pop("files")), 2, MANIFEST, ("'files'",)),
    Case("files-empty", int8_release, edit(lambda m: m.update(files={})), 2, MANIFEST, ("'files'",)),
    Case("files-path-name", int8_release, edit(lambda m: m["files"].update({"../x.safetensors": "0" * 64})), 2,
         MANIFEST, ("'../x.safetensors'",)),
    Case("files-lists-readme", int8_release, edit(lambda m: m["files"].update({"README.md": "0" * 64})), 2,
         MANIFEST, ("'README.md'",)),
    Case("files-lists-gitattributes", int8_release, edit(lambda m: m["files"].update({".gitattributes": "0" * 64})),
         2, MANIFEST, ("'.gitattributes'",)),
    Case("files-uppercase-sha", int8_release, edit(lambda m: m["files"].update({MAPS: m["files"][MAPS].upper()})),
         2, MANIFEST, (f"'{MAPS}'",)),
    Case("files-without-maps", int8_release, edit(lambda m: m["files"].update({"x.safetensors": m["files"].pop(MAPS)})),
         2, MANIFEST, (MAPS,)),
    # 3: the files the facts name
    Case("projector-files-empty", int8_release, edit(lambda m: m["projector"].update(files=[])), 3, MANIFEST,
         ("'projector.files'",)),
    Case("projector-two-files", int8_release, _split_tensor_files, 3, MANIFEST, ("'projector.files'",)),
    Case("files-lists-unnamed-file", int8_release, _listed_notes, 3, MANIFEST, ("'notes.txt'",)),
    Case("protected-file-unlisted", protected_release, edit(lambda m: m["files"].pop(PROTECTED)), 3, MANIFEST,
         (f"'{PROTECTED}'",)),
    Case("corrections-file-renamed", hybrid_release,
         edit(lambda m: m["corrections"]["state"].update(file="offsets.safetensors")), 3, MANIFEST,
         ("'corrections.state.file'",)),
    # 4: listed files
    Case("maps-missing", int8_release, lambda d: (d / MAPS).unlink(), 4, MAPS, ("missing",)),
    Case("protected-missing", protected_release, lambda d: (d / PROTECTED).unlink(), 4, PROTECTED, ("missing",)),
    Case("maps-is-folder", int8_release, lambda d: ((d / MAPS).unlink(), (d / MAPS).mkdir()), 4, MAPS,
         ("not a regular file",)),
    Case("maps-symlink", int8_release, _symlink(MAPS), 4, MAPS, ("symbolic link",)),
    Case("readme-symlink", int8_release, _symlink("README.md"), 4, "README.md", ("symbolic link",)),
    Case("readme-is-folder", int8_release, lambda d: ((d / "README.md").unlink(), (d / "README.md").mkdir()), 4,
         "README.md", ("not a regular file",)),
    # 5: nothing unlisted
    Case("extra-file", int8_release, lambda d: (d / "notes.txt").write_text("x"), 5, "notes.txt"),
    Case("extra-dotfile", int8_release, lambda d: (d / ".DS_Store").write_bytes(b"\0"), 5, ".DS_Store"),
    Case("extra-folder", int8_release, lambda d: (d / "old").mkdir(), 5, "old"),
    Case("cache-with-other-content", int8_release,
         lambda d: (_hf_download(d), (d / ".cache" / "notes").write_text("x")), 5, ".cache"),
    Case("gitattributes-folder", int8_release, lambda d: (d / ".gitattributes").mkdir(), 5, ".gitattributes"),
    # 6: hashes
    Case("maps-sha-mismatch", int8_release, lambda d: _flip_last_byte(d / MAPS), 6, MAPS, ("sha256",)),
    # 7: maps.safetensors' header and metadata
    Case("maps-not-safetensors", int8_release, lambda d: _replace(d, MAPS, b"\x10" + b"\0" * 7 + b"not json" * 2), 7,
         MAPS),
    Case("maps-overlapping-ranges", int8_release, header(_overlap), 7, MAPS),
    Case("maps-gap-in-ranges", int8_release, header(_gap), 7, MAPS),
    Case("maps-duplicate-tensor", int8_release, header(_duplicate_tensor), 7, MAPS, ("'layer.2.bias'",)),
    Case("maps-format-metadata", int8_release, tensors(MAPS, lambda ts, meta: meta.update(format="ridgefill-maps/X")),
         7, MAPS, ("ridgefill-maps/X",)),
    Case("v2-maps-format-metadata-v1", kv_int8, tensors(MAPS, lambda ts, meta: meta.update(format=V1)), 7, MAPS,
         (V1,)),
    Case("v3-maps-format-metadata-v2", states_int8, tensors(MAPS, lambda ts, meta: meta.update(format=V2)), 7,
         MAPS, (V2,)),
    Case("maps-no-facts", int8_release, lambda d: (tensors(MAPS, lambda ts, meta: meta.pop("ridgefill.facts"),
                                                           resealed=False)(d), _fix_maps_sha(d)), 7, MAPS),
    Case("facts-not-object", int8_release, lambda d: (tensors(MAPS, lambda ts, meta: meta.update(
        {"ridgefill.facts": "[1]"}), resealed=False)(d), _fix_maps_sha(d)), 7, MAPS),
    # 8: facts against the manifest
    Case("fact-edited", int8_release, edit(lambda m: m.update(split=3)), 8, MANIFEST, ("'split'",)),
    Case("fact-nested-edited", int8_release, edit(lambda m: m["model"].update(name="evil/model")), 8, MANIFEST,
         ("'model.name'",)),
    Case("fact-retyped", int8_release, edit(lambda m: m.update(tail_default="512")), 8, MANIFEST,
         ("'tail_default'",)),
    Case("fact-bool-for-number", int8_release, edit(lambda m: m["fit"].update(skip_first_rows=True)), 8, MANIFEST,
         ("'fit.skip_first_rows'",)),
    Case("fact-added", int8_release, edit(lambda m: m.update(zz_extra=1)), 8, MANIFEST, ("'zz_extra'",)),
    Case("fact-removed", int8_release, edit(lambda m: m["fit"].pop("rows")), 8, MANIFEST, ("'fit.rows'",)),
    Case("fact-layer-kind", hybrid_release, edit(lambda m: m["layers"][1].update(kind="full_attention")), 8,
         MANIFEST, ("'layers",)),  # 'layers' or a path into it ('layers[1].kind')
    # 9: the other tensor files belong to this release
    Case("protected-from-another-release", protected_release, _copy_from(other_protected, PROTECTED), 9, PROTECTED,
         ("'protected_tokens.sha256'",)),
    Case("corrections-from-another-release", hybrid_release, _copy_from(other_hybrid, CORRECTIONS), 9, CORRECTIONS,
         ("'corrections.state.sha256'",)),
    # 10: the tensors
    Case("code-minus-128", int8_release, tensors(MAPS, lambda ts, m: _set(ts["layer.12.codes"], 5, b"\x80")), 10,
         MAPS, ("'layer.12.codes'", "-128")),
    Case("negative-scale", int8_release, tensors(MAPS, lambda ts, m: _set(ts["layer.2.scales"], 0, b"\x80\xbf")),
         10, MAPS, ("'layer.2.scales'",)),
    Case("nan-bias", f32_release, tensors(MAPS, lambda ts, m: _set(ts["layer.13.bias"], 1,
                                                                     struct.pack("<f", float("nan")))), 10, MAPS,
         ("'layer.13.bias'",)),
    Case("tensor-missing", int8_release, tensors(MAPS, lambda ts, m: ts.pop("layer.13.scales")), 10, MAPS,
         ("'layer.13.scales'",)),
    Case("tensor-extra", int8_release, tensors(MAPS, lambda ts, m: ts.update(
        {"layer.2.weight": Tensor("F32", [D_OUT, D_IN], b"\0" * (4 * D_OUT * D_IN))})), 10, MAPS,
        ("'layer.2.weight'",)),
    Case("tensor-renamed", int8_release, tensors(MAPS, _rename_tensor), 10, MAPS, ("'layer.2.code'",)),
    Case("tensor-retyped", f32_release, tensors(MAPS, lambda ts, m: ts["layer.2.weight"].__setattr__("dtype", "I32")),
         10, MAPS, ("'layer.2.weight'",)),
    Case("tensor-f16", bf16_release, tensors(MAPS, lambda ts, m: ts["layer.2.bias"].__setattr__("dtype", "F16")),
         10, MAPS, ("'layer.2.bias'",)),
    Case("scales-wrong-shape", int8_release, tensors(MAPS, lambda ts, m: _truncate(ts["layer.2.scales"], [D_OUT, 1])),
         10, MAPS, ("'layer.2.scales'",)),
    Case("bias-wrong-length", f32_release, tensors(MAPS, lambda ts, m: _truncate(ts["layer.2.bias"], [D_OUT - 1])),
         10, MAPS, ("'layer.2.bias'",)),
    Case("layers-do-not-match", int8_release, facts(_bad_layers), 10, MAPS, ("'layers'",)),
    Case("projector-dtype", int8_release, facts(lambda m: m["projector"].update(dtype="int4")), 10, MANIFEST,
         ("'projector.dtype'",)),
    Case("group-size-zero", int8_release, facts(lambda m: m["projector"].update(group_size=0)), 10, MANIFEST,
         ("'projector.group_size'",)),
    Case("configuration-not-object", int8_release, facts(lambda m: m.update(configuration="ridgefill+rows")), 10,
         MANIFEST, ("'configuration'",)),
    Case("configuration-unknown-arm", int8_release, facts(lambda m: m.update(configuration={
        "arm": "ridgefill+vscale", "sweep": None})), 10, MANIFEST, ("'configuration.arm'",)),
    Case("configuration-row-share", int8_release, facts(lambda m: m.update(configuration={
        "arm": "ridgefill+rows", "sweep": None, "row_share": 1.5})), 10, MANIFEST, ("'configuration.row_share'",)),
    Case("configuration-row-share-elsewhere", int8_release, facts(lambda m: m.update(configuration={
        "arm": "ridgefill+kscale", "sweep": None, "row_share": 0.1})), 10, MANIFEST, ("'configuration'",)),
    Case("configuration-protected-without-table", int8_release, facts(lambda m: m.update(configuration={
        "arm": "ridgefill+protected", "sweep": None})), 10, MANIFEST, ("'configuration.arm'",)),
    Case("exact-norm-missing", int8_release, facts(lambda m: m["fit"].pop("exact_norm")), 10, MANIFEST,
         ("'fit.exact_norm'",)),
    Case("exact-norm-zero", int8_release, facts(lambda m: m["fit"].update(exact_norm=0)), 10, MANIFEST,
         ("'fit.exact_norm'",)),
    Case("exact-norm-negative", int8_release, facts(lambda m: m["fit"].update(exact_norm=-812.5)), 10, MANIFEST,
         ("'fit.exact_norm'",)),
    Case("exact-norm-string", int8_release, facts(lambda m: m["fit"].update(exact_norm="812.5")), 10, MANIFEST,
         ("'fit.exact_norm'",)),
    Case("exact-norm-bool", int8_release, facts(lambda m: m["fit"].update(exact_norm=True)), 10, MANIFEST,
         ("'fit.exact_norm'",)),
    Case("exact-norm-null", int8_release, facts(lambda m: m["fit"].update(exact_norm=None)), 10, MANIFEST,
         ("'fit.exact_norm'",)),
    Case("protected-not-ascending", protected_release, tensors(PROTECTED, lambda ts, m: _set(
        ts["protected_token_ids"], 0, struct.pack("<i", 9))), 10, PROTECTED),
    Case("protected-wrong-dtype", protected_release, tensors(PROTECTED, lambda ts, m: ts[
        "protected_token_ids"].__setattr__("dtype", "F32")), 10, PROTECTED),
    Case("offsets-wrong-shape", hybrid_release, tensors(CORRECTIONS, lambda ts, m: ts[
        "layer.12.state_offset"].__setattr__("shape", [2, 16])), 10, CORRECTIONS, ("layer.12.state_offset",)),
    Case("offsets-layer-missing", hybrid_release, tensors(CORRECTIONS, lambda ts, m: ts.pop("layer.13.state_offset")),
         10, CORRECTIONS),
    Case("v2-protected-format-metadata-v1", mixed_int8, tensors(PROTECTED, lambda ts, meta: meta.update(format=V1)),
         10, PROTECTED, (V1,)),
    # 11: the facts the release is applied with
    Case("split-is-num-layers", int8_release, facts(lambda m: m.update(split=14)), 11, MANIFEST, ("'split'",)),
    Case("split-zero", int8_release, facts(lambda m: m.update(split=0)), 11, MANIFEST, ("'split'",)),
    Case("split-negative", kv_int8, facts(lambda m: m.update(split=-1)), 11, MANIFEST, ("'split'",)),
    Case("split-fraction", kv_int8, facts(lambda m: m.update(split=9.5)), 11, MANIFEST, ("'split'",)),
    Case("split-string", int8_release, facts(lambda m: m.update(split="2")), 11, MANIFEST, ("'split'",)),
    Case("num-layers-missing", int8_release, facts(lambda m: m["model"].pop("num_layers")), 11, MANIFEST,
         ("'model.num_layers'",)),
    Case("tail-zero", int8_release, facts(lambda m: m.update(tail_default=0)), 11, MANIFEST, ("'tail_default'",)),
    Case("tail-overflows", kv_int8, facts(lambda m: m.update(tail_default=10**30)), 11, MANIFEST,
         ("'tail_default'",)),
    Case("tail-past-int32", int8_release, facts(lambda m: m.update(tail_default=2**31)), 11, MANIFEST,
         ("'tail_default'",)),
    Case("tail-bool", kv_int8, facts(lambda m: m.update(tail_default=True)), 11, MANIFEST, ("'tail_default'",)),
    Case("skip-first-rows-negative", int8_release, facts(lambda m: m["fit"].update(skip_first_rows=-1)), 11,
         MANIFEST, ("'fit.skip_first_rows'",)),
    Case("skip-first-rows-string", kv_int8, facts(lambda m: m["fit"].update(skip_first_rows="1")), 11, MANIFEST,
         ("'fit.skip_first_rows'",)),
    Case("v2-skip-first-rows-missing", kv_int8, facts(lambda m: m["fit"].pop("skip_first_rows")), 11, MANIFEST,
         ("'fit.skip_first_rows'",)),
    Case("v2-layers-start-below-split", kv_int8, facts(lambda m: m.update(split=10)), 11, MANIFEST, ("'layers'",)),
    Case("v2-layers-stop-short", kv_int8, facts(lambda m: m["model"].update(num_layers=13)), 11, MANIFEST,
         ("'layers'",)),
    Case("v2-layers-descending", kv_int8, facts(lambda m: m["layers"].reverse()), 11, MANIFEST, ("'layers'",)),
    Case("v1-layer-index-list", int8_release, facts(lambda m: m["layers"][0].update(index=[2])), 11, MANIFEST,
         ("'layers",)),
    Case("v2-layer-index-list", kv_int8, facts(lambda m: m["layers"][0].update(index=[9])), 11, MANIFEST,
         ("'layers'",)),
    Case("v2-num-layers-huge", kv_int8, facts(lambda m: m["model"].update(num_layers=10**12)), 11, MANIFEST,
         ("'layers'",)),  # a reader that lists 9..10**12 to compare never answers
    Case("model-name-list", int8_release, facts(lambda m: m["model"].update(name=["a"])), 11, MANIFEST,
         ("'model.name'",)),
    Case("v2-fingerprint-missing", kv_int8, facts(lambda m: m["model"].pop("fingerprint")), 11, MANIFEST,
         ("'model.fingerprint'",)),
    Case("calibration-nested", int8_release, facts(lambda m: m["fit"].update(calibration_sha256=[["cd"]])), 11,
         MANIFEST, ("'fit.calibration_sha256'",)),
    Case("v3-layers-start-below-split", states_int8, facts(lambda m: m.update(split=10, states=[10, 4])), 11,
         MANIFEST, ("'layers'",)),
    # 12: map kinds and widths
    Case("v1-layer-with-map", int8_release, facts(lambda m: m["layers"][0].update(map="input")), 12, MANIFEST,
         ("'layers[0].map'",)),
    Case("v2-map-missing", kv_int8, facts(lambda m: m["layers"][1].pop("map")), 12, MANIFEST, ("'layers[1].map'",)),
    Case("v2-map-unknown", kv_int8, facts(lambda m: m["layers"][2].update(map="keys")), 12, MANIFEST,
         ("'layers[2].map'",)),
    Case("v2-map-null", mixed_int8, facts(lambda m: m["layers"][0].update(map=None)), 12, MANIFEST,
         ("'layers[0].map'",)),
    Case("v2-layer-extra-key", kv_int8, facts(lambda m: m["layers"][0].update(rope=True)), 12, MANIFEST,
         ("'layers[0]'",)),
    Case("v2-kv-on-linear-attention", mixed_plain, facts(lambda m: m["layers"][1].update(kind="linear_attention")),
         12, MANIFEST, ("'layers[1].map'",)),
    Case("v2-num-kv-heads-missing", kv_int8, facts(lambda m: m["model"].pop("num_kv_heads")), 12, MANIFEST,
         ("'model.num_kv_heads'",)),
    Case("v2-head-dim-zero", kv_f32, facts(lambda m: m["model"].update(head_dim=0)), 12, MANIFEST,
         ("'model.head_dim'",)),
    Case("v2-hidden-size-string", mixed_int8, facts(lambda m: m["model"].update(hidden_size="160")), 12, MANIFEST,
         ("'model.hidden_size'",)),
    Case("v2-kv-width", mixed_int8, facts(lambda m: m["model"].update(head_dim=16)), 12, MAPS,
         ("'layer.10.codes'", "[64, 160]")),
    Case("v2-kv-map-said-input", mixed_int8, facts(lambda m: m["layers"][1].update(map="input")), 12, MAPS,
         ("'layer.10.codes'", "[160, 160]")),
    Case("v2-input-map-said-kv", input_bf16, facts(lambda m: m["layers"][1].update(map="kv")), 12, MAPS,
         ("'layer.10.weight'", "[96, 160]")),
    Case("v2-hidden-size", kv_f32, facts(lambda m: m["model"].update(hidden_size=128)), 12, MAPS,
         ("[96, 128]",)),  # every layer is too wide: any may be named
    Case("v1-states", int8_release, facts(lambda m: m.update(states=[2, 0])), 12, MANIFEST, ("'states'",)),
    Case("v2-states", kv_int8, facts(lambda m: m.update(states=STATES_TWO)), 12, MANIFEST, ("'states'",)),
    Case("v3-states-missing", states_int8, facts(lambda m: m.pop("states")), 12, MANIFEST, ("'states'",)),
    Case("v3-states-not-list", states_int8, facts(lambda m: m.update(states=9)), 12, MANIFEST, ("'states'",)),
    Case("v3-states-split-alone", states_int8, facts(lambda m: m.update(states=[9])), 12, MANIFEST, ("'states'",)),
    Case("v3-states-repeated-layer", states_kv_f32, facts(lambda m: m.update(states=[9, 7, 7])), 12, MANIFEST,
         ("'states'",)),
    Case("v3-states-split-not-first", states_int8, facts(lambda m: m.update(states=[4, 9])), 12, MANIFEST,
         ("'states'",)),
    Case("v3-states-split-twice", states_int8, facts(lambda m: m.update(states=[9, 9])), 12, MANIFEST,
         ("'states'",)),
    Case("v3-states-layer-above-split", states_int8, facts(lambda m: m.update(states=[9, 10])), 12, MANIFEST,
         ("'states'",)),
    Case("v3-states-layer-negative", states_kv_f32, facts(lambda m: m.update(states=[9, 7, -1])), 12, MANIFEST,
         ("'states'",)),
    Case("v3-states-layer-string", states_int8, facts(lambda m: m.update(states=[9, "4"])), 12, MANIFEST,
         ("'states'",)),
    Case("v3-states-layer-bool", states_int8, facts(lambda m: m.update(states=[9, True])), 12, MANIFEST,
         ("'states'",)),
    Case("v3-states-too-long", states_int8, facts(lambda m: m.update(states=[9] + [4] * (10**6 - 1))), 12,
         MANIFEST, ("'states'",)),  # refused by its length, before any entry is read
    Case("v3-width-of-three-states", states_int8, facts(lambda m: m.update(states=[9, 4, 0])), 12, MAPS,
         ("'layer.9.codes'", "[160, 480]")),
    Case("v3-width-of-two-states", states_kv_f32, facts(lambda m: m.update(states=[9, 7])), 12, MAPS,
         ("'layer.9.weight'", "[96, 320]")),
    Case("v3-kv-on-linear-attention", states_kv_f32, facts(lambda m: m["layers"][0].update(kind="linear_attention")),
         12, MANIFEST, ("'layers[0].map'",)),
    # 13: what a map writes
    Case("map-writes-past-the-bound", f32_release, tensors(MAPS, lambda ts, m: ts.__setitem__(
        "layer.13.weight", Tensor("F32", [D_OUT, D_IN], struct.pack("<f", 3e38) * (D_OUT * D_IN)))), 13, MAPS,
         ("layer 13's map",)),
    Case("v2-exact-norm-past-the-bound", kv_f32, facts(lambda m: m["fit"].update(exact_norm=1e30)), 13, MAPS,
         ("layer 9's map",)),
    Case("v3-exact-norm-past-the-bound", states_int8, facts(lambda m: m["fit"].update(exact_norm=1e30)), 13, MAPS,
         ("layer 9's map",)),
]


def generate(out: Path) -> dict[str, dict]:
    """Write every case into out/<name>/ and out/expected.json; returns the expectations."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for case in CASES:
        d = out / case.name
        if d.exists():
            shutil.rmtree(d)
        case.base(d)
        if case.change is not None:
            case.change(d)
        expected[case.name] = {"verdict": case.verdict, "rule": case.rule, "file": case.file,
                               "names": list(case.names)}
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return expected


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/reader/conformance.py OUT")
    cases = generate(Path(sys.argv[1]))
    print(f"{len(cases)} cases ({sum(c['verdict'] == 'ok' for c in cases.values())} valid) in {sys.argv[1]}")
