"""Reading a release folder: one reader, so that a folder verifies if and only if it loads (docs/format.md,
"Verifying"). numpy only.

`read_release(dir)` checks, in this order, and refuses the first problem in one line naming the file or field
(the first five, rules 1-9, are manifest.py's `verified_manifest`): the manifest (JSON without duplicate keys, NaN
or infinity, format), `files` (bare names, hashes, the files the facts name), the folder's entries (nothing unlisted,
no symbolic link), every file's sha256, the facts maps.safetensors records against the manifest (compared by
value), the hashes the facts record for the other tensor files, and then the release's `configuration`, its
`fit.exact_norm` and every tensor of every file, decoded as a runtime would use it, then the facts it is applied
with (split, tail, the rows the fit left out, the layers, the model's name and data), in a `ridgefill-maps/2`
release the map kinds and the maps' widths, and last the largest value a map writes (rule 13, `map_bound`).
`verify_release` and `load_release` are it; `release_configuration` is the configuration a verified manifest records.

A `Release` is the one place a runtime takes "the release as applied" from: `split`, `tail`, `anchor`,
`exact_norm`, `configuration`, `map_kinds`, `kv_width`, `output_bound`, computed and checked once when it is read;
`fill_options()`, the one mapping of those facts to the options every runtime fills with; and `check_model(...)`,
the one-line refusal of a model it was not made for, which the reference runtime, eval and the vLLM plugin all make.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.formats import int8, safetensors
from ridgefill.formats.release.names import (BIAS, CODES, CORRECTIONS_FILE, DEFAULT_SKIP_FIRST_ROWS, DTYPE_LIMITS,
                                             EXACT_NORM, FIT, KSCALE_CONFIGURATION, KV_MAP, LINEAR_KIND, MANIFEST,
                                             MAPS_FILE, MAX_MAP_OUTPUT, OFFSET_RE, PLAIN, PROJECTOR_DTYPES,
                                             PROTECTED_CONFIGURATION, PROTECTED_FILE, PROTECTED_IDS,
                                             ROWS_CONFIGURATION, SCALES, SKIP_FIRST_ROWS, STATE_OFFSET, WEIGHT,
                                             applied_problem, configuration_problem, exact_norm_problem, integer,
                                             kv_width, layer_indices, map_kinds, maps_problem, parse_tensor_name,
                                             protected_problem, states_of, states_problem, tensor_name,
                                             width_problem)
from ridgefill.formats.release.manifest import ABSENT, check_format, verified_manifest
from ridgefill.numerics import bf16_bits_to_f32

_READ_DTYPES = ("I8", "I32", "BF16", "F32")  # what a release's tensor files may hold


@dataclass(frozen=True)
class Release:
    """A verified release, decoded, with the facts a runtime applies it with (read and checked once, by
    `read_release`; a runtime takes them from here, never from the manifest)."""

    manifest: dict
    maps: dict[int, dict[str, np.ndarray]]  # {layer: {"weight": float32 [d_out, d_in], "bias": float32 [d_out]}}
    protected: np.ndarray | None  # int32 token ids, ascending
    state_offsets: dict[int, np.ndarray] | None  # {layer: float32 [value heads, key dim, value dim]}
    format: str  # "ridgefill-maps/1", "/2" or "/3" (maps that read earlier states too)
    split: int  # S: the maps take h_S; layers split..num_layers-1 are filled
    tail: int  # `tail_default`: the exact tail the release was exported for, 1..2**31-1
    anchor: int  # `fit.skip_first_rows` (1 when an old release lacks it): leading rows that run exactly
    exact_norm: float  # `fit.exact_norm`: prefix rows whose split-state norm is above it run exactly
    configuration: Mapping  # `release_configuration`: {"arm", "sweep"[, "row_share"]}, read-only
    map_kinds: Mapping[int, str]  # {layer: "input" | "kv"} for every layer of `layers` (all "input" in a /1), read-only
    kv_width: int | None  # a kv map's d_out, 2 * model.num_kv_heads * model.head_dim; None in a /1 release
    output_bound: float  # the largest value any map writes for a split state it fills (`map_bound`), <= MAX_MAP_OUTPUT
    map_shapes: Mapping[int, tuple[int, int]]  # {layer: (d_out, d_in)}: kept by `without_maps`, for `check_model`
    states: tuple[int, ...]  # the layers whose inputs the maps read side by side: (split,), or /3's `states`

    def without_maps(self) -> "Release":
        """The same release with its decoded maps let go (a process that only checks and plans keeps the facts, not
        the weights); `check_model` still checks the maps' widths."""
        return replace(self, maps={})

    @property
    def arm(self) -> str:
        """The fill arm that applies the release as made: "ridgefill+rows" for that configuration, else "ridgefill"
        (the other configurations are options of it: `fill_options`)."""
        return ROWS_CONFIGURATION if self.configuration["arm"] == ROWS_CONFIGURATION else PLAIN

    def fill_options(self) -> dict:
        """The fill options the release prescribes, the one mapping every runtime applies it with (the reference
        runtime's `prefill(lm, ids, rel.arm, maps=..., **rel.fill_options())`, eval, the vLLM plugin): its split,
        default tail, map kinds, the layers whose inputs the maps read (`states`, /3 only), the first `anchor` rows and
        the prefix rows above `exact_norm` run exactly, and its
        configuration: `row_share` for ridgefill+rows, `corrections=("kscale",)` for ridgefill+kscale, `protected`
        (the table, int64, ascending) for ridgefill+protected. The maps are not in it: where they live (devices,
        dtype, a rank's rows) is each runtime's own."""
        opts = {"split": self.split, "tail": self.tail, "anchor": self.anchor, "exact_norm": self.exact_norm,
                "map_kinds": dict(self.map_kinds)}
        if len(self.states) > 1:
            opts["states"] = self.states  # the maps read the split's and these earlier layers' inputs, side by side
        arm = self.configuration["arm"]
        if arm == ROWS_CONFIGURATION:
            opts["row_share"] = float(self.configuration["row_share"])
        elif arm == KSCALE_CONFIGURATION:
            opts["corrections"] = ("kscale",)
        elif arm == PROTECTED_CONFIGURATION:
            opts["protected"] = self.protected.astype(np.int64)
        return opts

    def check_model(self, *, fingerprint: str | None, num_layers: int, hidden_size: int, num_kv_heads: int | None,
                    head_dim: int | None, vocab_size: int | None, name: str, where: str,
                    dtype: str | None = None) -> None:
        """Refuse, with one line starting `where: `, a model (called `name`) the release was not made for: another
        fingerprint (None: not known, not compared), another layer count or hidden size than the release records,
        maps that do not cover its late layers split..num_layers-1 or whose widths are not the model's (an input
        map [hidden_size, hidden_size], a kv map [2 * num_kv_heads * head_dim, hidden_size]), in a /2 release
        other KV heads or head size than it records, a protected-token table with an id past the model's
        `vocab_size` tokens (None: not known, not compared), or maps that write past the largest finite value of the
        dtype the model computes in (`dtype`, torch's name without "torch.": float16's 65504; None: not known)."""
        refusal = model_problem(self, fingerprint=fingerprint, num_layers=num_layers, hidden_size=hidden_size,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size, name=name,
                                dtype=dtype)
        if refusal is not None:
            raise BadInput(f"{where}: {refusal}")


def model_problem(rel: Release, *, fingerprint: str | None, num_layers: int, hidden_size: int,
                  num_kv_heads: int | None, head_dim: int | None, vocab_size: int | None, name: str,
                  dtype: str | None = None) -> str | None:
    """`Release.check_model`'s refusal, as a phrase; None when the model is the release's."""
    model = rel.manifest["model"]
    theirs = model.get("fingerprint")
    if fingerprint is not None and theirs != fingerprint:
        return (f"the maps were made for another model (fingerprint {str(theirs)[:12]}) than '{name}' "
                f"({fingerprint[:12]})")
    for key, ours in (("num_layers", num_layers), ("hidden_size", hidden_size), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
        recorded = model.get(key)
        if ours is not None and (recorded is not None or key in ("num_layers", "hidden_size")) and \
                integer(recorded) != ours:
            return f"the release is for a model with {key} {recorded!r}, but '{name}' has {ours}"
    missing = [l for l in range(rel.split, num_layers) if l not in rel.map_shapes]
    if missing:
        return f"the release has no maps for late layers {missing} (split {rel.split}, {num_layers} layers)"
    for l in sorted(rel.map_shapes):
        kv = rel.map_kinds.get(l) == KV_MAP
        if kv and (num_kv_heads is None or head_dim is None):
            continue  # the kv shape is not known here: the widths were checked against the release's own facts
        want = (2 * num_kv_heads * head_dim if kv else hidden_size, hidden_size * len(rel.states))
        got = rel.map_shapes[l]
        if tuple(got) != want:
            return (f"layer {l}'s {'kv' if kv else 'input'} map is {list(got)}, expected {list(want)} for "
                    f"'{name}'")
    if vocab_size is not None and rel.protected is not None and len(rel.protected):
        problem = protected_problem(int(rel.protected[-1]), vocab_size, f"'{name}'")  # ascending: the last is largest
        if problem is not None:
            return problem
    limit = DTYPE_LIMITS.get(str(dtype).removeprefix("torch."))
    if limit is not None and rel.output_bound > limit:
        return (f"the maps write values up to {rel.output_bound:.3g}, past {str(dtype).removeprefix('torch.')}'s "
                f"largest finite value {limit:g}: run '{name}' in bfloat16 or float32")
    return None


def read_release(dir: Path) -> Release:
    """Verify a release folder and decode every tensor it holds; BadInput names the first problem."""
    dir = Path(dir)
    manifest = verified_manifest(dir)
    configuration = release_configuration(manifest)
    problem = exact_norm_problem(manifest)
    if problem is not None:
        raise BadInput(f"{MANIFEST}: {problem}")
    maps = _maps(dir, manifest)
    protected, offsets = _protected(dir, manifest), _state_offsets(dir, manifest)
    for problem in (applied_problem(manifest), maps_problem(manifest), states_problem(manifest)):  # rules 11, 12
        if problem is not None:
            raise BadInput(f"{MANIFEST}: {problem}")
    _check_widths(manifest, maps)
    fit = manifest[FIT]
    bound = _check_bounds(maps, float(fit[EXACT_NORM]))
    return Release(manifest, maps, protected, offsets, format=manifest["format"], split=integer(manifest["split"]),
                   tail=integer(manifest["tail_default"]),
                   anchor=integer(fit.get(SKIP_FIRST_ROWS, DEFAULT_SKIP_FIRST_ROWS)),
                   exact_norm=float(fit[EXACT_NORM]), configuration=MappingProxyType(configuration),
                   map_kinds=MappingProxyType(map_kinds(manifest)), kv_width=kv_width(manifest), output_bound=bound,
                   map_shapes=MappingProxyType({l: tuple(m["weight"].shape) for l, m in maps.items()}),
                   states=tuple(states_of(manifest)))


def map_bound(weight: np.ndarray, bias: np.ndarray, norm: float) -> float:
    """The largest |(W h + b)_i| over every output i and every h with ||h|| <= norm: max_i ||W_i|| norm + |b_i|
    (Cauchy-Schwarz; attained by h along W_i). weight float32 [d_out, d_in], bias float32 [d_out]. Summed in float32
    without a copy of the weight: a sum that overflows gives infinity, which every limit refuses."""
    with np.errstate(over="ignore", invalid="ignore"):
        rows = np.sqrt(np.einsum("ij,ij->i", weight, weight))  # [d_out] row norms
        return float(np.max(rows * np.float32(norm) + np.abs(bias), initial=0.0))


def _check_bounds(maps: dict[int, dict[str, np.ndarray]], exact_norm: float) -> float:
    """Rule 13: every map's `map_bound` at the exact-row norm is at most MAX_MAP_OUTPUT; the largest of them."""
    largest = 0.0
    for layer, m in sorted(maps.items()):
        bound = map_bound(m["weight"], m["bias"], exact_norm)
        if not bound <= MAX_MAP_OUTPUT:
            raise BadInput(f"{MAPS_FILE}: layer {layer}'s map writes values up to {bound:.3g} for the split states it "
                           f"fills (norm up to 'fit.exact_norm' {exact_norm:.6g}), past {MAX_MAP_OUTPUT:.3g}: not the "
                           "maps of a fit, and a runtime's keys and values would overflow")
        largest = max(largest, bound)
    return largest


def _check_widths(manifest: dict, maps: dict[int, dict[str, np.ndarray]]) -> None:
    """Rule 12's widths (/2): every map [d_out, d_in] as `width_problem` wants, named by its weight tensor."""
    codes = manifest["projector"]["dtype"] == "int8"
    for layer, m in sorted(maps.items()):
        problem = width_problem(manifest, layer, m["weight"].shape)
        if problem is not None:
            raise BadInput(f"{MAPS_FILE}: tensor {tensor_name(layer, CODES if codes else WEIGHT)!r} {problem}")


def verify_release(dir: Path) -> dict:
    """The manifest of a release folder that reads (`read_release`): what `ridgefill verify` checks."""
    return read_release(dir).manifest


def load_release(dir: Path) -> tuple[dict, dict[int, dict[str, np.ndarray]]]:
    """(manifest, {layer: {"weight": float32 [d_out, d_in], "bias": float32}}) of a release that reads."""
    rel = read_release(dir)
    return rel.manifest, rel.maps


# ------------------------------------------------------------------------------------------------- the tensors


def read_tensors(path: Path, format: str | None = None) -> dict[str, tuple[str, np.ndarray]]:
    """A release tensor file: {name: (safetensors dtype, numpy array)}, bf16 as uint16 bit patterns; BadInput for
    an unreadable file, a format other than the release's (`format`, the manifest's; None: either release format),
    or a dtype a release never holds."""
    fname = Path(path).name
    arrays, meta = safetensors.load(path)
    check_format(fname, meta, format)
    out = {}
    for name, a in arrays.items():
        dtype = safetensors.dtype_of(a)
        if dtype not in _READ_DTYPES:
            raise BadInput(f"{fname}: tensor {name!r} has dtype {dtype}, expected {', '.join(_READ_DTYPES)}")
        out[name] = (dtype, a.bits if isinstance(a, safetensors.BF16) else a)
    return out


def _maps(dir: Path, manifest: dict) -> dict[int, dict[str, np.ndarray]]:
    proj = manifest["projector"]
    if proj.get("dtype") not in PROJECTOR_DTYPES:
        raise BadInput(f"{MANIFEST}: 'projector.dtype' is {proj.get('dtype')!r}, expected one of "
                       f"{', '.join(PROJECTOR_DTYPES)}")
    dtype, group = proj["dtype"], integer(proj.get("group_size"))  # 128.0 is 128, as a JavaScript reader sees it
    if dtype == "int8" and (group is None or group < 1):
        raise BadInput(f"{MANIFEST}: 'projector.group_size' must be a positive integer, got {proj.get('group_size')!r}")
    raw: dict[int, dict[str, tuple[str, np.ndarray]]] = {}
    where: dict[str, str] = {}
    for fname in proj["files"]:
        for tname, (st_dtype, arr) in read_tensors(dir / fname, manifest["format"]).items():
            parsed = parse_tensor_name(tname)
            if parsed is None:
                raise BadInput(f"{fname}: unexpected tensor {tname!r} (expected layer.<l>.codes|scales|bias|weight)")
            if tname in where:
                raise BadInput(f"{fname}: tensor {tname!r} already read from {where[tname]}")
            where[tname] = fname
            raw.setdefault(parsed[0], {})[parsed[1]] = (st_dtype, arr)
    want = layer_indices(manifest)
    if want is not None and want != set(raw):
        raise BadInput(f"{', '.join(proj['files'])}: the tensors are of layers {sorted(raw)}, but 'layers' lists "
                       f"{sorted(want)}")
    if not raw:
        raise BadInput(f"{MANIFEST}: the projector files hold no tensors")
    return {layer: _decode_layer(layer, raw[layer], dtype, group, where, ", ".join(proj["files"]))
            for layer in sorted(raw)}  # fmt: skip


def _decode_layer(layer: int, parts: dict, dtype: str, group: int | None, where: dict,
                  files: str) -> dict[str, np.ndarray]:
    """One layer's tensors -> {"weight", "bias"} float32, refusing missing, extra or mistyped tensors."""

    def get(kind: str, allowed: tuple[str, ...]) -> np.ndarray:
        name = tensor_name(layer, kind)
        if kind not in parts:
            raise BadInput(f"{files}: tensor {name!r} is missing (needed in {_a(dtype)} release)")
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
        raise BadInput(f"{where[name]}: tensor {name!r} does not belong in {_a(dtype)} release")
    bias = f32(get(BIAS, ("BF16", "F32")))
    if dtype == "int8":
        codes, bits = get(CODES, ("I8",)), get(SCALES, ("BF16",))
        try:
            weight = int8.dequantize(codes, bits, group)
        except ValueError as e:  # its message starts with the tensor at fault
            name = tensor_name(layer, CODES if str(e).startswith("codes") else SCALES)
            raise BadInput(f"{where[name]}: tensor {name!r}: {e}") from None
    else:
        weight = f32(get(WEIGHT, ("BF16",) if dtype == "bf16" else ("F32",)))
        if weight.ndim != 2:
            raise BadInput(f"{where[tensor_name(layer, WEIGHT)]}: layer {layer} weight is not 2-D")
    name = tensor_name(layer, BIAS)
    if bias.shape != (weight.shape[0],):
        raise BadInput(f"{where[name]}: tensor {name!r} has shape {list(bias.shape)}, expected [{weight.shape[0]}]")
    for kind, arr in ((WEIGHT if dtype != "int8" else SCALES, weight), (BIAS, bias)):
        if not np.isfinite(arr).all():
            name = tensor_name(layer, kind)
            raise BadInput(f"{where[name]}: tensor {name!r} holds NaN or infinity")
    return {"weight": weight, "bias": bias}


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _protected(dir: Path, manifest: dict) -> np.ndarray | None:
    if manifest.get("protected_tokens") is None:
        return None
    got = read_tensors(Path(dir) / PROTECTED_FILE, manifest["format"])
    if set(got) != {PROTECTED_IDS} or got[PROTECTED_IDS][0] != "I32" or got[PROTECTED_IDS][1].ndim != 1:
        raise BadInput(f"{PROTECTED_FILE}: expected one I32 vector {PROTECTED_IDS!r}, got {sorted(got)}")
    ids = got[PROTECTED_IDS][1]
    if len(ids) and (ids[0] < 0 or np.any(np.diff(ids) <= 0)):
        raise BadInput(f"{PROTECTED_FILE}: {PROTECTED_IDS} must be strictly ascending token ids >= 0")
    return ids


def _state_offsets(dir: Path, manifest: dict) -> dict[int, np.ndarray] | None:
    state = (manifest.get("corrections") or {}).get("state")
    if state is None:
        return None
    offsets = {}
    for tname, (st_dtype, arr) in read_tensors(Path(dir) / CORRECTIONS_FILE, manifest["format"]).items():
        m = OFFSET_RE.match(tname)
        if m is None:
            raise BadInput(f"{CORRECTIONS_FILE}: unexpected tensor {tname!r} (expected layer.<l>.{STATE_OFFSET})")
        if st_dtype != "F32" or arr.ndim != 3:
            raise BadInput(f"{CORRECTIONS_FILE}: {tname} must be F32 [value heads, key dim, value dim], got "
                           f"{st_dtype} {list(arr.shape)}")
        if not np.isfinite(arr).all():
            raise BadInput(f"{CORRECTIONS_FILE}: {tname} holds NaN/inf")
        offsets[int(m.group(1))] = np.asarray(arr, dtype=np.float32)
    linear = sorted(int(x["index"]) for x in manifest.get("layers") or [] if x.get("kind") == LINEAR_KIND)
    if sorted(offsets) != linear or state.get("layers") != linear:
        raise BadInput(f"{CORRECTIONS_FILE}: state offsets for layers {sorted(offsets)} (manifest: "
                       f"{state.get('layers')}), but the release's Gated DeltaNet layers are {linear}")
    return offsets


def release_configuration(manifest: dict) -> dict:
    """The manifest's `configuration` ({"arm", "sweep"} and, for ridgefill+rows, "row_share"), or the plain fill's
    {"arm": "ridgefill", "sweep": None} for a release without one. BadInput (one line naming the field) for a
    configuration that is not such an object, an unknown arm, a bad row share or sweep id, or ridgefill+protected in
    a release without a protected-token table."""
    value = manifest.get("configuration", ABSENT)
    if value is ABSENT:
        return {"arm": PLAIN, "sweep": None}
    problem = configuration_problem(value, manifest.get("protected_tokens") is not None)
    if problem is not None:
        raise BadInput(f"{MANIFEST}: {problem}")
    return dict(value)


def load_protected(dir: Path, manifest: dict) -> np.ndarray | None:
    """The protected-token table of a verified release (int32 token ids, ascending), or None when it has none."""
    return _protected(Path(dir), manifest)


def load_state_offsets(dir: Path, manifest: dict) -> dict[int, np.ndarray] | None:
    """The terminal-state offsets of a verified release ({layer: float32 [value heads, key dim, value dim]}), or
    None when it has none; BadInput when they do not match its layers."""
    return _state_offsets(Path(dir), manifest)
