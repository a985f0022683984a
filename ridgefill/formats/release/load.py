"""Loading a release folder: verified first, then its maps decoded to float32, its protected-token table and its
terminal-state offsets, each refused in one line when it does not match the manifest. numpy only, no torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.formats import int8, safetensors
from ridgefill.formats.release.names import (BIAS, CODES, CORRECTIONS_FILE, LINEAR_KIND, MANIFEST, OFFSET_RE, PROJECTOR_DTYPES,
                                             PROTECTED_FILE, PROTECTED_IDS, SCALES, STATE_OFFSET, WEIGHT,
                                             layer_indices, parse_tensor_name, tensor_name)
from ridgefill.formats.release.verify import verify_release
from ridgefill.numerics import bf16_bits_to_f32

_READ_DTYPES = ("I8", "I32", "BF16", "F32")  # what a release's tensor files may hold


def load_release(dir: Path) -> tuple[dict, dict[int, dict[str, np.ndarray]]]:
    """Verify, then read a release: (manifest, {layer: {"weight": float32 [d_out, d_in], "bias": float32}})."""
    dir = Path(dir)
    manifest = verify_release(dir)
    proj = manifest.get("projector")
    if not isinstance(proj, dict) or proj.get("dtype") not in PROJECTOR_DTYPES or not proj.get("files"):
        raise BadInput(f"{MANIFEST}: 'projector' needs dtype in {PROJECTOR_DTYPES} and a list of files")
    dtype, group = proj["dtype"], proj.get("group_size")
    if dtype == "int8" and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
        raise BadInput(f"{MANIFEST}: 'projector.group_size' must be a positive integer, got {group!r}")

    raw: dict[int, dict[str, tuple[str, np.ndarray]]] = {}
    where: dict[str, str] = {}
    for fname in proj["files"]:
        for tname, (st_dtype, arr) in read_tensors(dir / fname).items():
            parsed = parse_tensor_name(tname)
            if parsed is None:
                raise BadInput(f"{fname}: unexpected tensor {tname!r} (expected layer.<l>.codes|scales|bias|weight)")
            if tname in where:
                raise BadInput(f"{fname}: tensor {tname!r} already read from {where[tname]}")
            where[tname] = fname
            raw.setdefault(parsed[0], {})[parsed[1]] = (st_dtype, arr)

    want = layer_indices(manifest)
    if want is not None and want != set(raw):
        raise BadInput(f"{MANIFEST}: layers {sorted(want)} do not match the tensors' layers {sorted(raw)}")
    if not raw:
        raise BadInput(f"{MANIFEST}: the projector files hold no tensors")
    maps = {}
    for layer in sorted(raw):
        maps[layer] = _decode_layer(layer, raw[layer], dtype, group, where, ", ".join(proj["files"]))
    return manifest, maps


def load_protected(dir: Path, manifest: dict) -> np.ndarray | None:
    """The protected-token table of a verified release (int32 token ids, ascending), or None when it has none."""
    info = manifest.get("protected_tokens")
    if info is None:
        return None
    fname = info.get("file") if isinstance(info, dict) else None
    if fname != PROTECTED_FILE or fname not in (manifest.get("files") or {}):
        raise BadInput(f"{MANIFEST}: 'protected_tokens.file' must be {PROTECTED_FILE}, listed in 'files'")
    got = read_tensors(Path(dir) / fname)
    if set(got) != {PROTECTED_IDS} or got[PROTECTED_IDS][0] != "I32" or got[PROTECTED_IDS][1].ndim != 1:
        raise BadInput(f"{fname}: expected one I32 vector {PROTECTED_IDS!r}, got {sorted(got)}")
    ids = got[PROTECTED_IDS][1]
    if len(ids) and (ids[0] < 0 or np.any(np.diff(ids) <= 0)):
        raise BadInput(f"{fname}: {PROTECTED_IDS} must be ascending token ids")
    return ids


def load_state_offsets(dir: Path, manifest: dict) -> dict[int, np.ndarray] | None:
    """The terminal-state offsets of a verified release ({layer: float32 [value heads, key dim, value dim]}), or
    None when it has none; BadInput when they do not match its layers: a tensor other than
    layer.<l>.state_offset, not float32 rank 3, or layers other than exactly its linear_attention layers."""
    state = (manifest.get("corrections") or {}).get("state")
    if state is None:
        return None
    fname = state.get("file") if isinstance(state, dict) else None
    if fname != CORRECTIONS_FILE or fname not in (manifest.get("files") or {}):
        raise BadInput(f"{MANIFEST}: 'corrections.state.file' must be {CORRECTIONS_FILE}, listed in 'files'")
    offsets = {}
    for tname, (st_dtype, arr) in read_tensors(Path(dir) / fname).items():
        m = OFFSET_RE.match(tname)
        if m is None:
            raise BadInput(f"{fname}: unexpected tensor {tname!r} (expected layer.<l>.{STATE_OFFSET})")
        if st_dtype != "F32" or arr.ndim != 3:
            raise BadInput(f"{fname}: {tname} must be F32 [value heads, key dim, value dim], got {st_dtype} "
                           f"{list(arr.shape)}")
        offsets[int(m.group(1))] = np.asarray(arr, dtype=np.float32)
    linear = sorted(int(x["index"]) for x in manifest.get("layers") or [] if x.get("kind") == LINEAR_KIND)
    if sorted(offsets) != linear or state.get("layers") != linear:
        raise BadInput(f"{fname}: state offsets for layers {sorted(offsets)} (manifest: {state.get('layers')}), "
                       f"but the release's Gated DeltaNet layers are {linear}")
    return offsets


def read_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """A release tensor file: {name: (safetensors dtype, numpy array)}, bf16 as uint16 bit patterns; BadInput for
    an unreadable file or a dtype a release never holds."""
    fname = Path(path).name
    out = {}
    for name, a in safetensors.load(path)[0].items():
        dtype = safetensors.dtype_of(a)
        if dtype not in _READ_DTYPES:
            raise BadInput(f"{fname}: tensor {name!r} has dtype {dtype}, expected {', '.join(_READ_DTYPES)}")
        out[name] = (dtype, a.bits if isinstance(a, safetensors.BF16) else a)
    return out


def _decode_layer(layer: int, parts: dict, dtype: str, group: int | None, where: dict,
                  files: str) -> dict[str, np.ndarray]:
    """One layer's tensors -> {"weight", "bias"} float32, refusing missing, extra or mistyped tensors."""

    def get(kind: str, allowed: tuple[str, ...]) -> np.ndarray:
        name = tensor_name(layer, kind)
        if kind not in parts:
            raise BadInput(f"{files}: tensor {name!r} is missing (needed in a {dtype} release)")
        st_dtype, arr = parts[kind]
        if st_dtype not in allowed:
            raise BadInput(f"{where[name]}: tensor {name!r} is {st_dtype}, expected {' or '.join(allowed)}")
        return arr

    def f32(arr: np.ndarray) -> np.ndarray:
        return bf16_bits_to_f32(arr) if arr.dtype == np.uint16 else arr.astype(np.float32)

    expected = {CODES, SCALES, BIAS} if dtype == "int8" else {WEIGHT, BIAS}
    extra = sorted(set(parts) - expected)
    if extra:
        name = tensor_name(layer, extra[0])
        raise BadInput(f"{where[name]}: tensor {name!r} does not belong in a {dtype} release")
    bias = f32(get(BIAS, ("BF16", "F32")))
    if dtype == "int8":
        codes, bits = get(CODES, ("I8",)), get(SCALES, ("BF16",))
        try:
            weight = int8.dequantize(codes, bits, group)
        except ValueError as e:
            raise BadInput(f"{where[tensor_name(layer, CODES)]}: layer {layer}: {e}") from None
    else:
        weight = f32(get(WEIGHT, ("BF16",) if dtype == "bf16" else ("F32",)))
        if weight.ndim != 2:
            raise BadInput(f"{where[tensor_name(layer, WEIGHT)]}: layer {layer} weight is not 2-D")
    bias_file = where[tensor_name(layer, BIAS)]
    if bias.shape != (weight.shape[0],):
        raise BadInput(f"{bias_file}: layer {layer} bias has shape {bias.shape}, expected ({weight.shape[0]},)")
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise BadInput(f"{bias_file}: layer {layer} holds NaN/inf")
    return {"weight": weight, "bias": bias}
