"""The release format `ridgefill-maps/1`: write, verify and load a map release folder.

This module owns every fact of the format (file names, tensor names, manifest keys, metadata keys); nothing
else in the package should repeat them. A release folder holds exactly:

    ridgefill.json      the manifest (JSON object, keys sorted, indent 2): `format` ("ridgefill-maps/1"), the
                        facts the caller gives (`model` {name, revision, architecture, num_layers, hidden_size,
                        fingerprint}, `split`, `tail_default`, `layers` [{index, kind}], `fit`, `heldout`, and
                        any other field), `projector` {dtype: int8|bf16|f32, group_size: int (int8) or null,
                        files: ["maps.safetensors"]}, `files` {name: sha256 hex} and, once `ridgefill eval` has
                        run on the folder, `eval` (its summary)
    maps.safetensors    tensors `layer.<l>.codes` I8 [d_out, d_in], `layer.<l>.scales` BF16
                        [d_out, ceil(d_in/group_size)], `layer.<l>.bias` BF16 [d_out]; or, unquantized,
                        `layer.<l>.weight` BF16|F32 [d_out, d_in] and `layer.<l>.bias` (same dtype);
                        `__metadata__` {"format": "ridgefill-maps/1", "ridgefill.facts": <facts JSON>}
    corrections.safetensors   only in a release of a hybrid fitted with terminal-state offsets (`solve
                        --state-data`): `layer.<l>.state_offset` F32 [value heads, key dim, value dim] for every
                        `linear_attention` layer of `layers`; the manifest's `corrections` {"state": {file, layers,
                        chunk, states_per_layer, data_sha256}} describes it (a fact, like every other field)
    protected.safetensors   the protected-token table (`protected_token_ids` I32, ascending), when the solve
                        made one; the manifest's `protected_tokens` {file, share, types, eligible_types, ...}
                        describes it
    README.md           model card; optional, never hashed, because the Hub may rewrite it

What is protected, and how. `files` holds the sha256 of maps.safetensors, and maps.safetensors records the
facts: `ridgefill.facts` is the manifest without `files` and `eval`, as compact JSON (keys sorted, separators
"," and ":", ASCII only). So the one hash in `files` covers every field a runtime or `eval` relies on (model
and its fingerprint, split, tail_default, layers with their kinds, projector dtype and group_size) and the fit
and held-out figures too. `verify_release` refuses a manifest whose fields differ from the recorded facts,
naming the first field that differs, and a field the facts do not record. Only `files` (it cannot hash the
file that holds it) and `eval` (added after the release is written, by `set_eval`) are outside the hash;
README.md is regenerated from the manifest and never trusted. A maps.safetensors without `ridgefill.facts`
(written before the facts were recorded) is refused: accepting it would leave its manifest open to silent
edits; export such a release again.

A folder fetched with `hf download` holds two more entries, which verify accepts and nothing reads:
`.gitattributes` (a regular file; the Hub adds one to every repo) and `.cache/` holding exactly one folder,
`huggingface/` (the client's download metadata). Any other entry not listed in `files` is refused.

The safetensors file is encoded by ridgefill.artifacts.tensors rather than the library, so the bytes are a pure
function of the tensors and facts: tensors ordered as safetensors orders them (wider dtype first, then name),
`__metadata__` sorted, header padded with spaces to 8 bytes. The library reads it back (and writes the same
bytes but for the order of the metadata keys, which it takes from a hash map). Verifying reads the header by hand
(no torch); loading uses safetensors + torch, imported inside `load_release` only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.export import int8

FORMAT = "ridgefill-maps/1"
MANIFEST = "ridgefill.json"
CARD = "README.md"
MAPS_FILE = "maps.safetensors"
CORRECTIONS_FILE = "corrections.safetensors"
PROTECTED_FILE = "protected.safetensors"
PROTECTED_IDS = "protected_token_ids"
STATE_OFFSET = "state_offset"
_OFFSET_RE = re.compile(r"^layer\.(0|[1-9][0-9]*)\.state_offset$")
DOC_FILES = frozenset({CARD})  # documentation: present in the folder, never hashed
UNHASHED = frozenset({CARD, MANIFEST})  # the manifest cannot list itself
GITATTRIBUTES, DOWNLOAD_CACHE, HF_DIR = ".gitattributes", ".cache", "huggingface"  # left by `hf download`
HUB_LEFTOVERS = frozenset({GITATTRIBUTES, DOWNLOAD_CACHE})
META_FORMAT, META_FACTS = "format", "ridgefill.facts"  # maps.safetensors `__metadata__` keys
NOT_FACTS = frozenset({"files", "eval"})  # the manifest fields outside the hash (see the module docstring)
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is refused unread

CODES, SCALES, BIAS, WEIGHT = "codes", "scales", "bias", "weight"
PROJECTOR_DTYPES = ("int8", "bf16", "f32")
_TENSOR_RE = re.compile(r"^layer\.(0|[1-9][0-9]*)\.(codes|scales|bias|weight)$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def tensor_name(layer: int, kind: str) -> str:
    """`layer.<l>.<kind>` for kind in codes|scales|bias|weight."""
    if kind not in (CODES, SCALES, BIAS, WEIGHT):
        raise ValueError(f"unknown tensor kind {kind!r}")
    return f"layer.{int(layer)}.{kind}"


def parse_tensor_name(name: str) -> tuple[int, str] | None:
    """`layer.<l>.<kind>` -> (l, kind), or None for any other name."""
    m = _TENSOR_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_bare_name(name: object) -> bool:
    """True for a plain file name that stays inside the folder: no separators, not '.', '..' or empty."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\:\0")
        and name == name.strip()
    )


# --------------------------------------------------------------------------------------------- writing


def _encode_safetensors(tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str]) -> bytes:
    """{name: (safetensors dtype, array)} -> the file's bytes (bf16 given as uint16 bit patterns)."""
    from ridgefill.artifacts.tensors import BF16, encode

    return encode({n: BF16(a) if dt == "BF16" else a for n, (dt, a) in tensors.items()}, metadata)


def _f32(a: np.ndarray, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"{what} must be float32, got {a.dtype}")
    if not np.isfinite(a).all():
        raise ValueError(f"{what} contains NaN/inf")
    return a


def _release_tensors(
    maps: dict[int, dict[str, np.ndarray]], weight_dtype: str | None, group_size: int
) -> tuple[dict[str, tuple[str, np.ndarray]], str]:
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
    out: dict[str, tuple[str, np.ndarray]] = {}
    for layer, m in maps.items():
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"layer keys must be non-negative ints, got {layer!r}")
        bias = _f32(m["bias"], f"layer {layer} bias")
        if dtype == "int8":
            codes, bits = np.asarray(m["codes"]), np.asarray(m["scale_bits"])
            int8.dequantize(codes, bits, group_size)  # validates dtypes, shapes, code range and scales
            d_out = codes.shape[0]
            out[tensor_name(layer, CODES)] = ("I8", codes)
            out[tensor_name(layer, SCALES)] = ("BF16", bits)
            out[tensor_name(layer, BIAS)] = ("BF16", int8.f32_to_bf16_bits(bias))
        else:
            weight = _f32(m["weight"], f"layer {layer} weight")
            if weight.ndim != 2:
                raise ValueError(f"layer {layer} weight must be 2-D, got shape {tuple(weight.shape)}")
            d_out = weight.shape[0]
            if dtype == "bf16":
                out[tensor_name(layer, WEIGHT)] = ("BF16", int8.f32_to_bf16_bits(weight))
                out[tensor_name(layer, BIAS)] = ("BF16", int8.f32_to_bf16_bits(bias))
            else:
                out[tensor_name(layer, WEIGHT)] = ("F32", weight)
                out[tensor_name(layer, BIAS)] = ("F32", bias)
        if bias.shape != (d_out,):
            raise ValueError(f"layer {layer} bias has shape {tuple(bias.shape)}, expected ({d_out},)")
    return out, dtype


def facts_of(manifest: dict) -> dict:
    """The manifest's facts: every field but `files` and `eval`, as maps.safetensors records them."""
    return {k: v for k, v in manifest.items() if k not in NOT_FACTS}


def facts_json(manifest: dict) -> str:
    """The `ridgefill.facts` metadata value: the facts as compact JSON, keys sorted, ASCII only.
    ValueError for anything that is not plain JSON (NaN, inf, objects)."""
    try:
        return json.dumps(facts_of(manifest), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest is not plain JSON: {e}") from None


def _manifest_layer_indices(manifest: dict) -> set[int] | None:
    layers = manifest.get("layers")
    if isinstance(layers, list) and all(isinstance(x, dict) and "index" in x for x in layers):
        return {x["index"] for x in layers}
    return None


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
    `layers: [{index, ...}]`, its indices must be exactly the keys of `maps`. The facts (the manifest written,
    less `files` and `eval`) go into maps.safetensors' metadata, so its hash covers them. `card` is the model
    card's text, or a function of the manifest written that returns it. `state_offsets` {layer: float32 [value
    heads, key dim, value dim]} (with `state_facts`, what was measured) go into corrections.safetensors, the
    `protected` token ids (with `protected_facts`) into protected.safetensors.

    Everything is written into a temporary sibling folder and renamed into place. An existing non-empty
    `out_dir` is refused (BadInput) unless `overwrite=True`, and even then only if it is a release folder
    (holds ridgefill.json), so a mistyped path never deletes unrelated files.
    Raises ValueError for malformed maps or a manifest that is not plain JSON.
    """
    out_dir = Path(out_dir)
    tensors, dtype = _release_tensors(maps, weight_dtype, group_size)
    want = _manifest_layer_indices(manifest)
    if want is not None and want != {int(k) for k in maps}:
        raise ValueError(f"manifest layers {sorted(want)} do not match the maps' layers {sorted(maps)}")

    written = dict(manifest)
    written.pop("files", None)
    written["format"] = FORMAT
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
        if any(kinds.get(l) != "linear_attention" for l in layers):
            raise ValueError(f"state offsets for layers {layers}, which are not all linear_attention layers")
        offs = {f"layer.{l}.{STATE_OFFSET}": ("F32", _f32(state_offsets[l], f"layer {l} state offset")) for l in layers}
        extra[CORRECTIONS_FILE] = _encode_safetensors(offs, {META_FORMAT: FORMAT})
        written["corrections"] = {"state": {**(state_facts or {}), "file": CORRECTIONS_FILE, "layers": layers}}
    if protected is not None:
        ids = np.asarray(protected)
        if ids.dtype != np.int32 or ids.ndim != 1 or np.any(np.diff(ids) <= 0) or (len(ids) and ids[0] < 0):
            raise ValueError("protected token ids must be a strictly ascending 1-D int32 array of ids >= 0")
        extra[PROTECTED_FILE] = _encode_safetensors({PROTECTED_IDS: ("I32", ids)}, {META_FORMAT: FORMAT})
        written["protected_tokens"] = {**(protected_facts or {}), "file": PROTECTED_FILE}
    blob = _encode_safetensors(tensors, {META_FORMAT: FORMAT, META_FACTS: facts_json(written)})
    written["files"] = {MAPS_FILE: hashlib.sha256(blob).hexdigest()}
    written["files"].update({name: hashlib.sha256(data).hexdigest() for name, data in extra.items()})
    try:
        text = json.dumps(written, sort_keys=True, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest is not plain JSON: {e}") from None
    card_text = card(json.loads(text)) if callable(card) else card

    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise BadInput(f"{out_dir}: exists and is not a directory")
        if any(out_dir.iterdir()):
            if not overwrite:
                raise BadInput(f"{out_dir}: exists and is not empty (pass overwrite to replace it)")
            if not (out_dir / MANIFEST).is_file():
                raise BadInput(f"{out_dir}: not empty and not a ridgefill release; refusing to replace it")
    tmp = staging_dir(out_dir)
    try:
        _write_file(tmp / MAPS_FILE, blob)
        for name, data in extra.items():
            _write_file(tmp / name, data)
        _write_file(tmp / MANIFEST, text.encode())
        _write_file(tmp / CARD, card_text.encode("utf-8"))
        move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return json.loads(text)


def check_out_dir(out_dir: Path) -> None:
    """Refuse an --out that a release may not go to: a file, or a non-empty folder that is not a release (even
    --force only ever replaces a release folder, so a mistyped --out never deletes other files)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise BadInput(f"--out {out_dir} exists, is not empty and is not a release folder")


def staging_dir(out_dir: Path) -> Path:
    """A new empty sibling folder of out_dir to fill and then `move_into_place`, with a plain folder's mode."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a release folder should look like any other
    return tmp


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder tmp to out_dir, swapping out an old one (restored if the rename fails)."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------- verifying


def verify_release(dir: Path) -> dict:
    """Check a release folder against its manifest and return the manifest; BadInput on the first problem.

    Refuses: a missing or unparsable ridgefill.json, a wrong `format`, a `files` entry that is not a bare
    file name inside the folder (or names README.md, ridgefill.json, .gitattributes or .cache), `files` without
    maps.safetensors, a listed file that is missing or whose sha256 differs, a projector tensor file not listed in
    `files`, any entry of the folder that `files` does not list, a maps.safetensors that records no facts, and a
    manifest whose fields (all but `files` and `eval`) differ from the facts maps.safetensors records (the first
    differing field is named). Exempt entries: README.md (documentation, may be rewritten by the Hub),
    ridgefill.json itself, and what `hf download` leaves: a regular file `.gitattributes` and a folder `.cache`
    holding only `huggingface/`. No other dotfile or subfolder is ignored.
    """
    dir = Path(dir)
    if not dir.is_dir():
        raise BadInput(f"{dir}: not a directory")
    mpath = dir / MANIFEST
    if not mpath.is_file():
        raise BadInput(f"{MANIFEST}: missing in {dir} (not a ridgefill release folder)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise BadInput(f"{MANIFEST}: invalid JSON (not UTF-8: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{MANIFEST}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(manifest, dict):
        raise BadInput(f"{MANIFEST}: invalid manifest (top level is not a JSON object)")
    if manifest.get("format") != FORMAT:
        raise BadInput(f"{MANIFEST}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise BadInput(f"{MANIFEST}: 'files' must be a non-empty object of file name -> sha256")
    for name in sorted(files):
        if not is_bare_name(name):
            raise BadInput(f"{MANIFEST}: files entry {name!r} is not a bare file name inside the release folder")
        if name in UNHASHED or name in HUB_LEFTOVERS:
            raise BadInput(f"{MANIFEST}: files entry {name!r} must not be listed (it is never hashed)")
        if not isinstance(files[name], str) or not _SHA256_RE.match(files[name]):
            raise BadInput(f"{MANIFEST}: files entry {name!r} has no valid sha256 (64 lowercase hex digits)")
    if MAPS_FILE not in files:
        raise BadInput(f"{MANIFEST}: 'files' does not list {MAPS_FILE} (the file that records the release facts)")
    for name in _projector_files(manifest):
        if name not in files:
            raise BadInput(f"{MANIFEST}: projector file {name!r} is not listed in 'files'")
    for name in sorted(files):
        if not (dir / name).exists():
            raise BadInput(f"{name}: listed in {MANIFEST} but missing from {dir}")
        if not (dir / name).is_file():
            raise BadInput(f"{name}: listed in {MANIFEST} but not a regular file")
    for name in sorted(os.listdir(dir)):
        if name not in files and name not in UNHASHED and not _hub_leftover(dir / name):
            raise BadInput(f"{name}: in the release folder but not listed in {MANIFEST}")
    for name in sorted(files):
        got = sha256_file(dir / name)
        if got != files[name]:
            raise BadInput(f"{name}: sha256 mismatch (expected {files[name]}, got {got})")
    _check_facts(manifest, read_metadata(dir / MAPS_FILE))
    return manifest


def _hub_leftover(path: Path) -> bool:
    """True for what `hf download --local-dir` adds to a folder: the regular file `.gitattributes`, and a
    folder `.cache` whose only entry is the folder `huggingface` (symbolic links are never accepted)."""
    if path.is_symlink():
        return False
    if path.name == GITATTRIBUTES:
        return path.is_file()
    if path.name == DOWNLOAD_CACHE and path.is_dir():
        hf = path / HF_DIR
        return os.listdir(path) == [HF_DIR] and hf.is_dir() and not hf.is_symlink()
    return False


def read_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header by hand (no torch); BadInput if the
    header cannot be read."""
    name = Path(path).name

    def bad(why: str) -> BadInput:
        return BadInput(f"{name}: not a readable safetensors file ({why})")

    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"header length {n} does not fit the file")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ is not an object of strings")
    return meta


def _check_facts(manifest: dict, meta: dict[str, str]) -> None:
    """Refuse a manifest whose facts differ from those maps.safetensors records, naming the first field."""
    raw = meta.get(META_FACTS)
    if raw is None:
        raise BadInput(f"{MAPS_FILE}: records no release facts (no '{META_FACTS}' metadata; written by an older "
                       "ridgefill): export the release again")
    try:
        recorded = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadInput(f"{MAPS_FILE}: '{META_FACTS}' metadata is not JSON ({e.msg})") from None
    if not isinstance(recorded, dict):
        raise BadInput(f"{MAPS_FILE}: '{META_FACTS}' metadata is not a JSON object")
    diff = _difference(facts_of(manifest), recorded, "")
    if diff is not None:
        raise BadInput(f"{MANIFEST}: {diff} (the manifest was edited)")


_ABSENT = object()


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _difference(given, recorded, path: str) -> str | None:
    """The first field (in sorted order) where the manifest's value differs from the recorded one, as a phrase;
    None if they are the same JSON. Values are compared as JSON text, so 16 and 16.0 or 1 and true differ."""
    if isinstance(given, dict) and isinstance(recorded, dict):
        for key in sorted(set(given) | set(recorded), key=str):
            d = _difference(given.get(key, _ABSENT), recorded.get(key, _ABSENT), f"{path}.{key}" if path else key)
            if d is not None:
                return d
        return None
    if isinstance(given, list) and isinstance(recorded, list) and len(given) == len(recorded):
        for i, (g, r) in enumerate(zip(given, recorded)):
            d = _difference(g, r, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if given is _ABSENT:
        return f"{path!r} is missing but {MAPS_FILE} records {_show(recorded)}"
    if recorded is _ABSENT:
        return f"{path!r} is {_show(given)} but {MAPS_FILE} records no such field"
    if json.dumps(given, sort_keys=True) == json.dumps(recorded, sort_keys=True):
        return None
    return f"{path!r} is {_show(given)} but {MAPS_FILE} records {_show(recorded)}"


def _projector_files(manifest: dict) -> list[str]:
    proj = manifest.get("projector")
    if proj is None:
        return []
    names = proj.get("files") if isinstance(proj, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadInput(f"{MANIFEST}: 'projector.files' must be a list of file names")
    return names


# ---------------------------------------------------------------------------------------------- loading


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
        for tname, (st_dtype, arr) in _read_safetensors(dir / fname, fname).items():
            parsed = parse_tensor_name(tname)
            if parsed is None:
                raise BadInput(f"{fname}: unexpected tensor {tname!r} (expected layer.<l>.codes|scales|bias|weight)")
            if tname in where:
                raise BadInput(f"{fname}: tensor {tname!r} already read from {where[tname]}")
            where[tname] = fname
            raw.setdefault(parsed[0], {})[parsed[1]] = (st_dtype, arr)

    want = _manifest_layer_indices(manifest)
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
    got = _read_safetensors(Path(dir) / fname, fname)
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
    for tname, (st_dtype, arr) in _read_safetensors(Path(dir) / fname, fname).items():
        m = _OFFSET_RE.match(tname)
        if m is None:
            raise BadInput(f"{fname}: unexpected tensor {tname!r} (expected layer.<l>.{STATE_OFFSET})")
        if st_dtype != "F32" or arr.ndim != 3:
            raise BadInput(f"{fname}: {tname} must be F32 [value heads, key dim, value dim], got {st_dtype} "
                           f"{list(arr.shape)}")
        offsets[int(m.group(1))] = np.asarray(arr, dtype=np.float32)
    linear = sorted(int(x["index"]) for x in manifest.get("layers") or [] if x.get("kind") == "linear_attention")
    if sorted(offsets) != linear or state.get("layers") != linear:
        raise BadInput(f"{fname}: state offsets for layers {sorted(offsets)} (manifest: {state.get('layers')}), "
                       f"but the release's Gated DeltaNet layers are {linear}")
    return offsets


def _read_safetensors(path: Path, fname: str) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, numpy array)}; bf16 comes back as uint16 bit patterns."""
    import torch
    from safetensors import safe_open

    as_np = {torch.int8: "I8", torch.int32: "I32", torch.bfloat16: "BF16", torch.float32: "F32"}
    out = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dtype not in as_np:
                    raise BadInput(f"{fname}: tensor {name!r} has dtype {t.dtype}, expected int8, int32, bf16 or f32")
                arr = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
                out[name] = (as_np[t.dtype], arr.copy())
    except BadInput:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError and OSError-likes
        why = str(e).splitlines()[0] if str(e) else repr(e)
        raise BadInput(f"{fname}: not a readable safetensors file ({why})") from None
    return out


def _decode_layer(
    layer: int, parts: dict, dtype: str, group: int | None, where: dict, files: str
) -> dict[str, np.ndarray]:
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
        return int8.bf16_bits_to_f32(arr) if arr.dtype == np.uint16 else arr.astype(np.float32)

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


# ------------------------------------------------------------------------------------------- eval summary


def set_eval(dir: Path, summary: dict) -> dict:
    """Put an eval summary into a verified release's manifest (`eval`) and regenerate its model card.

    Only ridgefill.json and README.md change, and neither is hashed, so the release still verifies."""
    from ridgefill.export.card import model_card

    dir = Path(dir)
    manifest = verify_release(dir)
    manifest["eval"] = summary
    try:
        text = json.dumps(manifest, sort_keys=True, indent=2, allow_nan=False) + "\n"
    except ValueError as e:
        raise ValueError(f"eval summary is not plain JSON: {e}") from None
    for name, data in ((MANIFEST, text), (CARD, model_card(manifest))):
        tmp = dir / f".{name}.tmp"
        tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, dir / name)
    return manifest
