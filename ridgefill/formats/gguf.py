"""The ridgefill maps GGUF `ridgefill-maps-gguf/2` (and `/3`, below): the maps of a release as one GGUF file (Q8_0 weights, F32
biases, the release's facts as metadata). This is the file format alone: encoding, writing and reading, with
gguf-py (imported inside functions, so `import ridgefill` stays light). `ridgefill.export.gguf` is the stage that
builds such a file from the store or from a release folder.

File layout (this module owns every name below):

    tensors, in layer order, for each late layer l:
      blk.<l>.ridgefill.weight   Q8_0, GGML ne = [d_in, d_out] (numpy / torch [d_out, d_in], as every GGUF
                                 linear weight: ggml_mul_mat(W, h) gives W h)
      blk.<l>.ridgefill.bias     F32 [d_out]
    and, when the release has them (`load_gguf_extras` reads them back):
      blk.<l>.ridgefill.state_offset   F32 [value heads, key dim, value dim]: a hybrid's terminal-state offsets
      ridgefill.protected_token_ids    I32 [n]: the protected-token table
    metadata (general.architecture first, then sorted keys):
      general.architecture = "ridgefill", general.type = "adapter", general.name,
      general.base_model.count / .0.name / .0.version, general.file_type = 7 (MOSTLY_Q8_0),
      general.quantization_version, general.license (if the manifest has one)
      ridgefill.gguf.format = "ridgefill-maps-gguf/2"; ridgefill.gguf.source_artifact / .release_artifact
      (store ids, when made from the store); ridgefill.gguf.float_maps_artifact ("solve/<id>", when the
      weights were quantized from the store's float maps with the bias correction)
      ridgefill.<path> for every fact of the release manifest (ridgefill.json), flattened with dots:
      str -> STRING, bool -> BOOL, int -> INT64, float -> FLOAT64, list of one scalar type -> ARRAY;
      null and [] are left out. Two exceptions: `layers` [{index, kind, map}] becomes ridgefill.layers (INT64
      array) + ridgefill.layer_kinds (STRING array) + ridgefill.layer_maps (STRING array: "input" | "kv"; absent
      for a `ridgefill-maps/1` release, whose layers have no `map`); `files` {name: sha256} becomes
      ridgefill.files + ridgefill.files_sha256 (STRING arrays, sorted by name). `load_gguf` inverts this exactly.
    A kv map's weight is [2 * num_kv_heads * head_dim, d_in] (keys, then values) and its bias as long; an input
    map's [hidden_size, d_in]. `load_gguf` reads `ridgefill-maps-gguf/1` files too (layout 1: no layer_maps).
    A `ridgefill-maps/3` release's maps read earlier states beside h_S: the layout is then `ridgefill-maps-gguf/3`,
    with ridgefill.states (INT64 array: the split, then the earlier layers, in the order the maps read them) and
    d_in = hidden_size x len(states).

Q8_0 (GGML): blocks of 32 consecutive input columns; in float32 d = absmax / 127, code = roundf(w * (1 / d))
(half away from zero), stored as f16(d) and 32 int8 (gguf-py's encoder matches ggml-quants.c bit for bit). The
codes are computed against d, not f16(d), so |w - code * f16(d)| <= d / 2 + 127 |f16(d) - d| (plus float32
rounding). d_in must be a multiple of 32 (a padded map would need a padded split state, so it is refused), and
no block's scale may overflow f16 (|w| above 127 * 65504).

With a calibration mean (`encode_tensors(maps, mean_x)`), each bias takes the rounding error along it, as int8
does (`ridgefill.formats.int8.bias_correction`): b_q = b + (W - W_q) mean_x, so W_q mean_x + b_q = W mean_x + b.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.formats.gguf_header import check_whole
from ridgefill.formats.int8 import bias_correction

LAYOUT = "ridgefill-maps-gguf/2"  # 2: ridgefill.layer_maps (a release's map kinds)
# 3: a ridgefill-maps/3 release's maps, which read earlier states (ridgefill.states): a reader of /2 that would apply
# them to h_S alone refuses the layout instead
LAYOUT_STATES = "ridgefill-maps-gguf/3"
LAYOUTS = ("ridgefill-maps-gguf/1", LAYOUT, LAYOUT_STATES)  # what load_gguf reads
ARCH = "ridgefill"
MAGIC = b"GGUF"
QK8_0 = 32  # Q8_0 block: 32 weights share one f16 scale
PREFIX = f"{ARCH}."
OWN = "ridgefill.gguf."  # keys about this file, not facts of the release manifest
K_FORMAT, K_SOURCE, K_RELEASE = OWN + "format", OWN + "source_artifact", OWN + "release_artifact"
K_FLOAT = OWN + "float_maps_artifact"
K_LAYERS, K_KINDS, K_MAPS = "ridgefill.layers", "ridgefill.layer_kinds", "ridgefill.layer_maps"  # `layers`
K_FILES, K_SHA = "ridgefill.files", "ridgefill.files_sha256"  # manifest `files`
_SPECIAL = (K_LAYERS, K_KINDS, K_MAPS, K_FILES, K_SHA)
_RESERVED = {"gguf", "layer_kinds", "layer_maps", "files_sha256"}  # top-level manifest keys that would collide
_TENSOR_RE = re.compile(r"^blk\.(0|[1-9][0-9]*)\.ridgefill\.(weight|bias)$")
_OFFSET_RE = re.compile(r"^blk\.(0|[1-9][0-9]*)\.ridgefill\.state_offset$")
PROTECTED_TENSOR = "ridgefill.protected_token_ids"


def tensor_name(layer: int, kind: str) -> str:
    """`blk.<l>.ridgefill.weight|bias`."""
    if kind not in ("weight", "bias"):
        raise ValueError(f"unknown tensor kind {kind!r}")
    return f"blk.{int(layer)}.ridgefill.{kind}"


# -------------------------------------------------------------------------------------------- metadata


def manifest_metadata(manifest: dict) -> dict[str, tuple[str, object]]:
    """Release manifest -> {gguf key: (type, value)}, type in str|bool|i64|f64 or `array:<type>`.

    Pure: no gguf import. Raises ValueError for a structure it cannot represent (so nothing is silently lost).
    """
    out: dict[str, tuple[str, object]] = {}
    for key in sorted(manifest):
        value = manifest[key]
        if key in _RESERVED:
            raise ValueError(f"manifest key {key!r} is reserved in GGUF metadata")
        if key == "layers":
            shapes = {frozenset(x) if isinstance(x, dict) else None for x in value} if isinstance(value, list) else {}
            if not isinstance(value, list) or len(shapes) > 1 or not shapes <= {frozenset({"index", "kind"}),
                                                                                 frozenset({"index", "kind", "map"})}:
                raise ValueError("manifest 'layers' must be a list of {index, kind} or of {index, kind, map}")
            if value:
                out[K_LAYERS] = ("array:i64", [_scalar(f"layers[{i}].index", x["index"], "i64")
                                               for i, x in enumerate(value)])
                out[K_KINDS] = ("array:str", [_scalar(f"layers[{i}].kind", x["kind"], "str")
                                              for i, x in enumerate(value)])
                if "map" in value[0]:
                    out[K_MAPS] = ("array:str", [_scalar(f"layers[{i}].map", x["map"], "str")
                                                 for i, x in enumerate(value)])
        elif key == "files":
            if not isinstance(value, dict):
                raise ValueError("manifest 'files' must be an object of file name -> sha256")
            if value:
                out[K_FILES] = ("array:str", [_scalar("files", n, "str") for n in sorted(value)])
                out[K_SHA] = ("array:str", [_scalar(f"files.{n}", value[n], "str") for n in sorted(value)])
        else:
            _flatten(key, value, out)
    return out


def _type_of(v: object) -> str | None:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "i64"
    if isinstance(v, float):
        return "f64"
    if isinstance(v, str):
        return "str"
    return None


def _scalar(path: str, v: object, want: str) -> object:
    if _type_of(v) != want:
        raise ValueError(f"manifest {path}: expected {want}, got {v!r}")
    return v


def _flatten(path: str, value: object, out: dict) -> None:
    if value is None:
        return
    if isinstance(value, dict):
        for k in sorted(value):
            if not isinstance(k, str) or not k or "." in k:
                raise ValueError(f"manifest {path}: key {k!r} cannot be a GGUF key part")
            _flatten(f"{path}.{k}", value[k], out)
        return
    if isinstance(value, list):
        types = {_type_of(v) for v in value}
        if not value:
            return
        if len(types) != 1 or None in types:
            raise ValueError(f"manifest {path}: only lists of one scalar type can be GGUF arrays")
        out[PREFIX + path] = (f"array:{types.pop()}", list(value))
        return
    t = _type_of(value)
    if t is None:
        raise ValueError(f"manifest {path}: {type(value).__name__} cannot be GGUF metadata")
    if t == "f64" and not np.isfinite(value):
        raise ValueError(f"manifest {path}: {value} is not finite")
    out[PREFIX + path] = (t, value)


def metadata_manifest(kv: dict[str, object]) -> dict:
    """The inverse of `manifest_metadata`: {gguf key: value} -> the manifest (without its nulls and [])."""
    manifest: dict = {}
    for key, value in kv.items():
        if not key.startswith(PREFIX) or key.startswith(OWN) or key in _SPECIAL:
            continue
        node = manifest
        *parents, leaf = key[len(PREFIX):].split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if K_LAYERS in kv:
        pairs = zip(kv[K_LAYERS], kv.get(K_KINDS, []), strict=True)
        manifest["layers"] = [{"index": i, "kind": k} for i, k in pairs]
        if K_MAPS in kv:
            for x, m in zip(manifest["layers"], kv[K_MAPS], strict=True):
                x["map"] = m
    if K_FILES in kv:
        manifest["files"] = dict(zip(kv[K_FILES], kv.get(K_SHA, []), strict=True))
    return manifest


def general_metadata(manifest: dict, provenance: dict[str, str] | None = None) -> dict[str, tuple[str, object]]:
    """The `general.*` keys (GGUF conventions) and our own `ridgefill.gguf.*` keys."""
    model = manifest.get("model") or {}
    name = str(model.get("name") or "unknown model")
    out: dict[str, tuple[str, object]] = {
        "general.type": ("str", "adapter"),  # auxiliary weights for the base model named below
        "general.name": ("str", f"{name} ridgefill maps, split {manifest.get('split')}"),
        "general.base_model.count": ("u32", 1),
        "general.base_model.0.name": ("str", name),
        "general.file_type": ("u32", 7),  # LlamaFileType.MOSTLY_Q8_0: Q8_0 except 1-D tensors
        "general.quantization_version": ("u32", 2),  # GGML_QUANT_VERSION
        K_FORMAT: ("str", LAYOUT_STATES if "states" in manifest else LAYOUT),
    }
    if model.get("revision"):
        out["general.base_model.0.version"] = ("str", str(model["revision"]))
    if isinstance(manifest.get("license"), str) and manifest["license"]:
        out["general.license"] = ("str", manifest["license"])
    for key, k in (("source_artifact", K_SOURCE), ("release_artifact", K_RELEASE), ("float_maps_artifact", K_FLOAT)):
        if (provenance or {}).get(key):
            out[k] = ("str", provenance[key])
    return out


# ----------------------------------------------------------------------------------------------- Q8_0


def q8_0(layer: int, weight: np.ndarray) -> np.ndarray:
    """float32 [d_out, d_in] -> Q8_0 blocks as uint8 [d_out, d_in / 32 * 34] (gguf-py's byte layout).

    BadInput when d_in is not a multiple of 32 or a block's f16 scale would overflow; ValueError for NaN/inf.
    """
    from gguf import GGMLQuantizationType, quants

    w = np.asarray(weight)
    if w.dtype != np.float32 or w.ndim != 2:
        raise ValueError(f"layer {layer}: weight must be a 2-D float32 array, got {w.dtype} {tuple(w.shape)}")
    check_row_length(layer, w.shape[1])
    if not np.isfinite(w).all():
        raise ValueError(f"layer {layer}: weight contains NaN/inf")
    with np.errstate(over="ignore"):  # an f16 overflow is refused just below, by name
        q = quants.quantize(w, GGMLQuantizationType.Q8_0)  # [d_out, nb * 34]
    d_out, nb = w.shape[0], w.shape[1] // QK8_0
    scales = np.ascontiguousarray(q.reshape(d_out, nb, 2 + QK8_0)[:, :, :2]).view(np.float16)  # [d_out, nb, 1]
    if not np.isfinite(scales).all():
        raise BadInput(f"layer {layer}: |w| up to {float(np.abs(w).max()):.4g} overflows Q8_0's f16 scale "
                       f"(limit {127 * 65504:.4g}); this map cannot be written as GGUF Q8_0")
    return q


def check_row_length(layer: int, d_in: int) -> None:
    if d_in % QK8_0:
        raise BadInput(f"layer {layer}: d_in = {d_in} is not a multiple of {QK8_0}, which GGUF Q8_0 needs "
                       f"(whole blocks of {QK8_0}); export this map as a release instead")


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 Q8_0 blocks [d_out, nb * 34] -> float32 [d_out, nb * 32] (gguf-py's decoder)."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(blocks, GGMLQuantizationType.Q8_0)


# ---------------------------------------------------------------------------------------- write, read


def encode_tensors(maps: dict[int, dict[str, np.ndarray]], mean_x: np.ndarray | None = None) -> tuple[list, dict]:
    """{layer: {weight f32, bias f32}} -> ([(name, array, ggml type name)] in layer order, error figures).

    With `mean_x` [d_in] (the calibration mean) each bias takes the rounding error along it:
    b_q = b + (W - W_q) mean_x, computed in float64 and stored as float32. Error figures per layer, against
    the given float weights: max_abs and max_rel (max |W_q - W| / max |W|)."""
    tensors, errors = [], {}
    for layer in sorted(maps):
        w, b = maps[layer]["weight"], np.asarray(maps[layer]["bias"])
        q = q8_0(layer, w)
        if b.dtype != np.float32 or b.shape != (w.shape[0],):
            raise ValueError(f"layer {layer}: bias must be float32 [{w.shape[0]}], got {b.dtype} {tuple(b.shape)}")
        deq = dequantize_q8_0(q)  # [d_out, d_in]
        if mean_x is not None:
            mean_x = np.asarray(mean_x, dtype=np.float64)
            if mean_x.shape != (w.shape[1],):
                raise ValueError(f"layer {layer}: calibration mean has shape {mean_x.shape}, expected ({w.shape[1]},)")
            b = bias_correction(b, w, deq, mean_x)
        err = np.abs(deq - w).max(initial=0.0)
        errors[str(layer)] = {"max_abs": float(err), "max_rel": float(err / max(np.abs(w).max(initial=0.0), 1e-30))}
        tensors += [(tensor_name(layer, "weight"), q, "Q8_0"), (tensor_name(layer, "bias"), b, "F32")]
    return tensors, errors


def write_gguf(path: Path, manifest: dict, tensors: list, provenance: dict[str, str] | None = None) -> None:
    """Write the GGUF file (temp sibling, then rename). Same inputs -> same bytes: gguf-py writes no timestamps,
    the keys go in sorted order after general.architecture and the tensors in layer order."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    vt = {"str": GGUFValueType.STRING, "bool": GGUFValueType.BOOL, "i64": GGUFValueType.INT64,
          "f64": GGUFValueType.FLOAT64, "u32": GGUFValueType.UINT32}
    kv = {**manifest_metadata(manifest), **general_metadata(manifest, provenance)}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = GGUFWriter(tmp, ARCH)  # adds general.architecture first
    try:
        for key in sorted(kv):
            t, value = kv[key]
            if t.startswith("array:"):
                writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=vt[t[6:]])
            else:
                writer.add_key_value(key, value, vt[t])
        for name, arr, ggml_type in tensors:
            writer.add_tensor(name, arr, raw_dtype=GGMLQuantizationType[ggml_type])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def load_gguf(path: Path) -> tuple[dict, dict[int, dict[str, np.ndarray]]]:
    """Read a ridgefill GGUF: (manifest facts, {layer: {"weight": float32 [d_out, d_in], "bias": float32}})."""
    from gguf import GGMLQuantizationType, GGUFReader

    check_whole(path)  # a file cut short is "truncated GGUF", not a numpy reshape error
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, OSError) as e:
        raise BadInput(f"{path}: not a readable GGUF file ({e})") from None
    kv = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    if kv.get("general.architecture") != ARCH or kv.get(K_FORMAT) not in LAYOUTS:
        raise BadInput(f"{path}: not a ridgefill maps GGUF (architecture {kv.get('general.architecture')!r}, "
                       f"{K_FORMAT} {kv.get(K_FORMAT)!r})")
    parts: dict[int, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        if _is_extra(t):
            continue
        m = _TENSOR_RE.match(t.name)
        want = GGMLQuantizationType.Q8_0 if m and m.group(2) == "weight" else GGMLQuantizationType.F32
        if m is None or t.tensor_type != want:
            raise BadInput(f"{path}: unexpected tensor {t.name!r} ({t.tensor_type.name})")
        data = dequantize_q8_0(np.asarray(t.data)) if want == GGMLQuantizationType.Q8_0 else np.array(t.data)
        parts.setdefault(int(m.group(1)), {})[m.group(2)] = data.astype(np.float32, copy=False)
    manifest = metadata_manifest(kv)
    for layer, p in sorted(parts.items()):
        if set(p) != {"weight", "bias"} or p["bias"].shape != (p["weight"].shape[0],):
            raise BadInput(f"{path}: layer {layer} needs a weight and a bias of matching size")
    if [x["index"] for x in manifest.get("layers", [])] != sorted(parts):
        raise BadInput(f"{path}: {K_LAYERS} does not match the tensors' layers {sorted(parts)}")
    return manifest, dict(sorted(parts.items()))


def extra_tensors(offsets: dict | None, protected) -> list:
    """The release's terminal-state offsets and protected-token table as GGUF tensors (after the maps)."""
    out = [(f"blk.{l}.ridgefill.state_offset", np.asarray(offsets[l], dtype=np.float32), "F32")
           for l in sorted(offsets or {})]  # fmt: skip
    if protected is not None:
        out.append((PROTECTED_TENSOR, np.asarray(protected, dtype=np.int32), "I32"))
    return out


def _is_extra(t) -> bool:
    from gguf import GGMLQuantizationType

    if _OFFSET_RE.match(t.name):
        return t.tensor_type == GGMLQuantizationType.F32
    return t.name == PROTECTED_TENSOR and t.tensor_type == GGMLQuantizationType.I32


def load_gguf_extras(path: Path) -> tuple[dict | None, np.ndarray | None]:
    """A ridgefill GGUF's terminal-state offsets {layer: float32 [value heads, key dim, value dim]} and protected-
    token table (int32 ids), each None when absent."""
    from gguf import GGUFReader

    check_whole(path)
    offsets, protected = {}, None
    for t in GGUFReader(path).tensors:
        if not _is_extra(t):
            continue
        data = np.array(t.data)
        if t.name == PROTECTED_TENSOR:
            protected = data.astype(np.int32).reshape(-1)
        else:
            offsets[int(_OFFSET_RE.match(t.name).group(1))] = data.astype(np.float32)
    return offsets or None, protected
