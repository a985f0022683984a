"""Writing a `ridgefill-maps/2` release folder (`write_release`), and recording an eval summary in one
(`write_eval`). A release the reader would refuse is never written: the writer checks the facts with the reader's own
rules (names.py), so a manifest without map kinds or KV shape, or with a split, tail or layers out of range, or maps
of the wrong width, fails here and not in a runtime.

The safetensors files are encoded by `ridgefill.formats.safetensors`, so their bytes are a pure function of the
tensors and facts. Everything is written into a temporary sibling folder and swapped into place
(`folder.move_into_place`), so a folder under the release's name is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from ridgefill.artifacts.lock import pid_alive
from ridgefill.errors import BadInput
from ridgefill.formats import int8
from ridgefill.formats.release import folder
from ridgefill.formats.release.names import (BIAS, CARD, CODES, CORRECTIONS_FILE, LINEAR_KIND, MANIFEST, MAPS_FILE,
                                             META_FACTS, META_FORMAT, PROTECTED_FILE, PROTECTED_IDS, SCALES, WEIGHT,
                                             applied_problem, configuration_problem, exact_norm_problem, facts_json,
                                             format_for, layer_indices, manifest_text, maps_problem, offset_name,
                                             states_problem, tensor_name, width_problem)
from ridgefill.formats.safetensors import BF16, encode
from ridgefill.numerics import f32_to_bf16_bits


def _f32(a: np.ndarray, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"{what} must be float32, got {a.dtype}")
    if not np.isfinite(a).all():
        raise ValueError(f"{what} contains NaN/inf")
    return a


def _release_tensors(maps: dict[int, dict[str, np.ndarray]], weight_dtype: str | None,
                     group_size: int) -> tuple[dict[str, np.ndarray | BF16], str]:
    """Check the caller's maps and turn them into named safetensors entries; returns (tensors, projector dtype)."""
    if not maps:
        raise ValueError("no maps to write")
    kinds = {frozenset(m) for m in maps.values()}
    if kinds == {frozenset({"codes", "scale_bits", "bias"})}:
        if weight_dtype not in (None, "int8"):
            raise ValueError(f"weight_dtype {weight_dtype!r} given for quantized maps")
        dtype = "int8"
    elif kinds == {frozenset({"weight", "bias"})}:
        dtype = weight_dtype or "f32"
        if dtype not in ("f32", "bf16"):
            raise ValueError(f"weight_dtype must be 'f32' or 'bf16', got {weight_dtype!r}")
    else:
        raise ValueError(
            "every layer needs {codes, scale_bits, bias} (quantized) or {weight, bias} (unquantized), "
            f"all the same; got {sorted(sorted(k) for k in kinds)}"
        )
    out: dict[str, np.ndarray | BF16] = {}
    for layer, m in maps.items():
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"layer keys must be non-negative ints, got {layer!r}")
        bias = _f32(m["bias"], f"layer {layer} bias")
        if dtype == "int8":
            codes, bits = np.asarray(m["codes"]), np.asarray(m["scale_bits"])
            int8.dequantize(codes, bits, group_size)  # validates dtypes, shapes, code range and scales
            d_out = codes.shape[0]
            out[tensor_name(layer, CODES)] = codes
            out[tensor_name(layer, SCALES)] = BF16(bits)
            out[tensor_name(layer, BIAS)] = BF16(f32_to_bf16_bits(bias))
        else:
            weight = _f32(m["weight"], f"layer {layer} weight")
            if weight.ndim != 2:
                raise ValueError(f"layer {layer} weight must be 2-D, got shape {tuple(weight.shape)}")
            d_out = weight.shape[0]
            if dtype == "bf16":
                out[tensor_name(layer, WEIGHT)] = BF16(f32_to_bf16_bits(weight))
                out[tensor_name(layer, BIAS)] = BF16(f32_to_bf16_bits(bias))
            else:
                out[tensor_name(layer, WEIGHT)] = weight
                out[tensor_name(layer, BIAS)] = bias
        if bias.shape != (d_out,):
            raise ValueError(f"layer {layer} bias has shape {tuple(bias.shape)}, expected ({d_out},)")
    return out, dtype


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_release(
    out_dir: Path,
    maps: dict[int, dict[str, np.ndarray]],
    manifest: dict,
    card: str | Callable[[dict], str],
    *,
    weight_dtype: str | None = None,
    group_size: int = int8.GROUP_SIZE,
    overwrite: bool = False,
    state_offsets: dict[int, np.ndarray] | None = None,
    state_facts: dict | None = None,
    protected: np.ndarray | None = None,
    protected_facts: dict | None = None,
) -> dict:
    """Write a release folder atomically and return the manifest written.

    `maps[l]` is {"codes": int8, "scale_bits": uint16, "bias": float32} (quantized, from `int8.quantize`;
    bias stored bf16) or {"weight": float32, "bias": float32} (unquantized; `weight_dtype` "f32" (default)
    or "bf16", bias stored in the same dtype). `manifest` holds the caller's fields; `format`, `projector`
    and `files` are set here (the caller's `projector` keys are kept, ours win). If the manifest has
    `layers: [{index, kind, map}]`, its indices must be exactly the keys of `maps`, and with `model` (num_layers,
    hidden_size, num_kv_heads, head_dim), `split`, `tail_default` and `fit.skip_first_rows` it must pass the
    reader's rules 11 and 12 (`names.applied_problem`, `maps_problem`, `width_problem`: layers split..num_layers-1,
    each map of its kind's width). The facts (the manifest written,
    less `files` and `eval`) go into maps.safetensors' metadata, so its hash covers them. `card` is the model
    card's text, or a function of the manifest written that returns it. `state_offsets` {layer: float32 [value
    heads, key dim, value dim]} (with `state_facts`, what was measured) go into corrections.safetensors, the
    `protected` token ids (with `protected_facts`) into protected.safetensors; the facts record each of these
    files' sha256, so that maps.safetensors' hash ties them to the release. A `configuration` in the manifest must
    be one the reader accepts (`names.configuration_problem`: ridgefill+protected needs `protected`), and so must
    its `fit.exact_norm`, which every release has (`names.exact_norm_problem`).

    An existing non-empty `out_dir` is refused (BadInput) unless `overwrite=True`, and even then only if it is a
    release folder (holds ridgefill.json), so a mistyped path never deletes unrelated files.
    Raises ValueError for malformed maps, a manifest that is not plain JSON, or a configuration, exact-row norm, map
    kind, width or applied fact the reader refuses.
    """
    out_dir = Path(out_dir)
    tensors, dtype = _release_tensors(maps, weight_dtype, group_size)
    want = layer_indices(manifest)
    if want is not None and want != {int(k) for k in maps}:
        raise ValueError(f"manifest layers {sorted(want)} do not match the maps' layers {sorted(maps)}")

    written = dict(manifest)
    written.pop("files", None)
    written["format"] = fmt = format_for(manifest)
    written["projector"] = {
        **(manifest.get("projector") or {}),
        "dtype": dtype,
        "group_size": group_size if dtype == "int8" else None,
        "files": [MAPS_FILE],
    }
    extra = {}
    if state_offsets:
        layers = sorted(int(l) for l in state_offsets)
        kinds = {int(x["index"]): x.get("kind") for x in manifest.get("layers") or []}
        if any(kinds.get(l) != LINEAR_KIND for l in layers):
            raise ValueError(f"state offsets for layers {layers}, which are not all linear_attention layers")
        offs = {offset_name(l): _f32(state_offsets[l], f"layer {l} state offset") for l in layers}
        extra[CORRECTIONS_FILE] = encode(offs, {META_FORMAT: fmt})
        written["corrections"] = {"state": {**(state_facts or {}), "file": CORRECTIONS_FILE, "layers": layers,
                                            "sha256": hashlib.sha256(extra[CORRECTIONS_FILE]).hexdigest()}}
    if protected is not None:
        ids = np.asarray(protected)
        if ids.dtype != np.int32 or ids.ndim != 1 or np.any(np.diff(ids) <= 0) or (len(ids) and ids[0] < 0):
            raise ValueError("protected token ids must be a strictly ascending 1-D int32 array of ids >= 0")
        extra[PROTECTED_FILE] = encode({PROTECTED_IDS: ids}, {META_FORMAT: fmt})
        written["protected_tokens"] = {**(protected_facts or {}), "file": PROTECTED_FILE,
                                       "sha256": hashlib.sha256(extra[PROTECTED_FILE]).hexdigest()}
    if "configuration" in written:  # a release the reader would refuse is never written
        problem = configuration_problem(written["configuration"], "protected_tokens" in written)
        if problem is not None:
            raise ValueError(problem)
    for problem in (exact_norm_problem(written), applied_problem(written), maps_problem(written),
                    states_problem(written)):
        if problem is not None:
            raise ValueError(problem)
    for layer, m in sorted(maps.items()):
        problem = width_problem(written, int(layer), np.shape(m["codes"] if "codes" in m else m["weight"]))
        if problem is not None:
            raise ValueError(f"layer {layer} map {problem}")
    blob = encode(tensors, {META_FORMAT: fmt, META_FACTS: facts_json(written)})
    written["files"] = {MAPS_FILE: hashlib.sha256(blob).hexdigest()}
    written["files"].update({name: hashlib.sha256(data).hexdigest() for name, data in extra.items()})
    text = manifest_text(written)
    card_text = card(json.loads(text)) if callable(card) else card

    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise BadInput(f"{out_dir}: exists and is not a directory")
        if any(out_dir.iterdir()):
            if not overwrite:
                raise BadInput(f"{out_dir}: exists and is not empty (pass overwrite to replace it)")
            if not (out_dir / MANIFEST).is_file():
                raise BadInput(f"{out_dir}: not empty and not a ridgefill release; refusing to replace it")
    tmp = folder.staging_dir(out_dir)
    try:
        _write_file(tmp / MAPS_FILE, blob)
        for name, data in extra.items():
            _write_file(tmp / name, data)
        _write_file(tmp / MANIFEST, text.encode())
        _write_file(tmp / CARD, card_text.encode("utf-8"))
        folder.move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return json.loads(text)


def write_eval(dir: Path, summary: dict, card: Callable[[dict], str]) -> dict:
    """Put an eval summary into a verified release's manifest (`eval`) and regenerate its model card with `card`
    (a function of the manifest). Only ridgefill.json and README.md change, and neither is hashed, so the release
    still verifies. Each is written to a temporary of this process's own (`.<name>.tmp-<pid>-<random>`, so two
    evals never write one file) and renamed over the old one, keeping its mode; a temporary that a killed eval
    left is one `is_writer_leftover` names, which a reader passes over and the next write_eval removes. Returns
    the manifest written."""
    from ridgefill.formats.release.read import verify_release

    dir = Path(dir)
    remove_writer_leftovers(dir)
    manifest = verify_release(dir)
    manifest["eval"] = summary
    text = manifest_text(manifest, "eval summary")
    for name, data in ((MANIFEST, text), (CARD, card(manifest))):
        _replace_file(dir / name, data.encode("utf-8"))
    return manifest


# `.ridgefill.json.tmp-<pid>-<random>` / `.README.md.tmp-<pid>-<random>`: write_eval's temporaries; the bare
# `.<name>.tmp` is the one name older versions used for every eval, left in releases whose eval was killed.
_LEFTOVER = re.compile(rf"\.({re.escape(MANIFEST)}|{re.escape(CARD)})\.tmp(?:-([0-9]+)-[A-Za-z0-9_]+)?\Z")


def is_writer_leftover(path: Path) -> bool:
    """Whether `path`, an entry of a release folder, is a temporary that `write_eval` leaves when it is killed
    between writing and renaming (a regular file named `_LEFTOVER`): the release is whole without it, so a reader
    passes over it as it does over README.md."""
    path = Path(path)
    return _LEFTOVER.match(path.name) is not None and path.is_file() and not path.is_symlink()


def remove_writer_leftovers(dir: Path) -> None:
    """Remove the `is_writer_leftover` temporaries of processes that no longer run (a live eval's are its own)."""
    for path in Path(dir).iterdir():
        m = _LEFTOVER.match(path.name)
        if m and is_writer_leftover(path) and (m[2] is None or not pid_alive(int(m[2]))):
            path.unlink(missing_ok=True)


def _replace_file(path: Path, data: bytes) -> None:
    """Write `data` to a temporary of this process's own beside `path`, then rename it over `path`, which keeps its
    mode (mkstemp's is 0600; a new file gets the umask's)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
