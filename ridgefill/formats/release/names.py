"""Every name of the release format `ridgefill-maps/2` (docs/format.md): files, tensors, manifest keys, metadata
keys, and the facts that maps.safetensors records, and the rules on the facts that say how a release is applied
(`applied_problem`, `tail_problem`, `maps_problem`, `width_problem`, `protected_problem`: phrases for one-line
refusals, shared by the writer, the reader, export and the runtimes). The writer, the verifier and the loader
import them from here; nothing else in the package repeats these literals. The writer writes `/2`; the reader
reads `/1` too (every map of a `/1` release is an input map).

A release folder holds exactly:

    ridgefill.json      the manifest (JSON object, keys sorted, indent 2): `format` ("ridgefill-maps/2"), the
                        facts the exporter gives (`model` {name, revision, architecture, num_layers, hidden_size,
                        num_kv_heads, head_dim, fingerprint}, `split`, `tail_default`, `layers` [{index, kind, map}]
                        for l = split..num_layers-1, map "input" (x_hat, d_out = hidden_size) or "kv" ([k; v]_hat,
                        d_out = 2 num_kv_heads head_dim; never on a linear_attention layer), `fit`, `heldout`, and
                        any other field), `projector` {dtype: int8|bf16|f32, group_size: int (int8) or null,
                        files: ["maps.safetensors"]}, `files` {name: sha256 hex} and, once `ridgefill eval` has
                        run on the folder, `eval` (its summary)
    maps.safetensors    tensors `layer.<l>.codes` I8 [d_out, d_in], `layer.<l>.scales` BF16
                        [d_out, ceil(d_in/group_size)], `layer.<l>.bias` BF16 [d_out]; or, unquantized,
                        `layer.<l>.weight` BF16|F32 [d_out, d_in] and `layer.<l>.bias` (same dtype);
                        `__metadata__` {"format": "ridgefill-maps/2", "ridgefill.facts": <facts JSON>}
    corrections.safetensors   only in a release of a hybrid fitted with terminal-state offsets (`solve
                        --state-data`): `layer.<l>.state_offset` F32 [value heads, key dim, value dim] for every
                        `linear_attention` layer of `layers`; the manifest's `corrections` {"state": {file, layers,
                        chunk, states_per_layer, data_sha256}} describes it (a fact, like every other field)
    protected.safetensors   the protected-token table (`protected_token_ids` I32, ascending), when the solve
                        made one; the manifest's `protected_tokens` {file, share, types, eligible_types, ...}
                        describes it
    (no file)           the manifest's optional `configuration` {arm, sweep[, row_share]}: the quality
                        configuration the release is applied with (`CONFIGURATIONS`; absent: the plain fill)
    (no file)           the manifest's `fit.exact_norm` (required): the split-state norm above which a runtime runs a
                        prefix row exactly (`exact_norm_problem`)
    README.md           model card; optional, never hashed, because the Hub may rewrite it

What is protected, and how. `files` holds the sha256 of maps.safetensors, and maps.safetensors records the
facts: `ridgefill.facts` is the manifest without `files` and `eval`, as compact JSON (keys sorted, separators
"," and ":", ASCII only). So the one hash in `files` covers every field a runtime or `eval` relies on (model and
its fingerprint, split, tail_default, layers with their kinds, projector dtype and group_size) and the fit and
held-out figures too. Only `files` (it cannot hash the file that holds it) and `eval` (added after the release is
written) are outside the hash; README.md is regenerated from the manifest and never trusted.
"""

from __future__ import annotations

import json
import re

FORMAT = "ridgefill-maps/2"  # what the writer writes for maps that read h_S alone
FORMAT_V1 = "ridgefill-maps/1"  # still read: no `map` in `layers`, every map an input map
FORMAT_STATES = "ridgefill-maps/3"  # /2 with `states`: maps that read earlier states besides h_S
FORMATS = (FORMAT_V1, FORMAT, FORMAT_STATES)
MANIFEST = "ridgefill.json"
CARD = "README.md"
MAPS_FILE = "maps.safetensors"
CORRECTIONS_FILE = "corrections.safetensors"
PROTECTED_FILE = "protected.safetensors"
PROTECTED_IDS = "protected_token_ids"
STATE_OFFSET = "state_offset"
OFFSET_RE = re.compile(r"^layer\.(0|[1-9][0-9]*)\.state_offset$")
DOC_FILES = frozenset({CARD})  # documentation: present in the folder, never hashed
UNHASHED = frozenset({CARD, MANIFEST})  # the manifest cannot list itself
GITATTRIBUTES, DOWNLOAD_CACHE, HF_DIR = ".gitattributes", ".cache", "huggingface"  # left by `hf download`
HUB_LEFTOVERS = frozenset({GITATTRIBUTES, DOWNLOAD_CACHE})
META_FORMAT, META_FACTS = "format", "ridgefill.facts"  # maps.safetensors `__metadata__` keys
NOT_FACTS = frozenset({"files", "eval"})  # the manifest fields outside the hash (see the module docstring)

# The quality configurations a release may record (`configuration.arm`): the fill arm a runtime applies it with,
# named as `ridgefill eval` names its arms (ridgefill.evaluate.arms). Absent: PLAIN.
CONFIGURATIONS = ("ridgefill", "ridgefill+rows", "ridgefill+kscale", "ridgefill+protected")
PLAIN, ROWS_CONFIGURATION, KSCALE_CONFIGURATION, PROTECTED_CONFIGURATION = CONFIGURATIONS

LINEAR_KIND = "linear_attention"  # `layers[].kind` of a Gated DeltaNet layer (transformers' layer type name)

# `layers[].map` (/2): what a layer's map predicts. "input": the layer's input x_hat [hidden_size]; "kv": the layer's
# keys (before RoPE and QK-norm) and values [k; v]_hat [2 * num_kv_heads * head_dim], rows in k_proj's then
# v_proj's output order. A linear_attention layer has no such keys: its map is always "input".
INPUT_MAP, KV_MAP = "input", "kv"
MAP_KINDS = (INPUT_MAP, KV_MAP)
LAYER_KEYS = ("index", "kind", "map")  # exactly the keys of a /2 `layers` entry
MAX_TAIL = 2**31 - 1  # `tail_default` fits an int32: a runtime's row counts never overflow
SKIP_FIRST_ROWS, DEFAULT_SKIP_FIRST_ROWS = "skip_first_rows", 1  # `fit.skip_first_rows`; absent in an old /1: 1

# `states` (/3 only, required there): the layers whose inputs a map reads, side by side, x = [h_S; h_l1; ...]: the
# split first, then one or more distinct earlier layers 0 <= l < split. Every map's d_in is
# hidden_size x len(states), and `fit.exact_norm` bounds the norm of that whole x. /1 and /2: x = h_S.
STATES = "states"

# `fit.exact_norm`: a prefix row whose split state's L2 norm (float32) is above it runs every layer exactly (a later
# attention sink). Required since the rule replaced the prefix-median one; a release without it predates the field.
FIT, EXACT_NORM = "fit", "exact_norm"

# Rule 13: the largest value a map may write. A runtime fills a prefix row only when its split state's norm is at most
# `fit.exact_norm`, so a map writes at most |W_i h + b_i| <= ||W_i|| exact_norm + |b_i| in output i (`map_bound`).
# The keys, values and inputs a fitted map predicts are of the size of the model's own (SmolLM2's shipped release:
# 6.4e3 at its exact-row norm of 862, 2,600 times below the limit). At the limit, a value and the attention outputs
# and residuals an exact row builds on it stay finite in float32 and bfloat16 with orders of magnitude to spare. A
# forged map with huge finite weights would write infinities into a server's cache, where they reach other requests
# through reused blocks; it is refused instead.
MAX_MAP_OUTPUT = 2.0**24
DTYPE_LIMITS = {"float16": 65504.0}  # a compute dtype whose own range is narrower: its largest finite value

CODES, SCALES, BIAS, WEIGHT = "codes", "scales", "bias", "weight"
PROJECTOR_DTYPES = ("int8", "bf16", "f32")
_TENSOR_RE = re.compile(r"^layer\.(0|[1-9][0-9]*)\.(codes|scales|bias|weight)$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def tensor_name(layer: int, kind: str) -> str:
    """`layer.<l>.<kind>` for kind in codes|scales|bias|weight."""
    if kind not in (CODES, SCALES, BIAS, WEIGHT):
        raise ValueError(f"unknown tensor kind {kind!r}")
    return f"layer.{int(layer)}.{kind}"


def parse_tensor_name(name: str) -> tuple[int, str] | None:
    """`layer.<l>.<kind>` -> (l, kind), or None for any other name."""
    m = _TENSOR_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def offset_name(layer: int) -> str:
    """`layer.<l>.state_offset`: a terminal-state offset in corrections.safetensors."""
    return f"layer.{int(layer)}.{STATE_OFFSET}"


def is_bare_name(name: object) -> bool:
    """True for a plain file name that stays inside the folder: no separators, not '.', '..' or empty."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\:\0")
        and name == name.strip()
    )


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


def manifest_text(manifest: dict, what: str = "manifest") -> str:
    """ridgefill.json's text: keys sorted, indent 2, a final newline; ValueError for what is not plain JSON."""
    try:
        return json.dumps(manifest, sort_keys=True, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not plain JSON: {e}") from None


def layer_indices(manifest: dict) -> set[int] | None:
    """The indices of the manifest's `layers` [{index, ...}], or None when it has no such list (or an index that is
    not an integer: `layers_problem` refuses it)."""
    layers = manifest.get("layers")
    if isinstance(layers, list) and all(isinstance(x, dict) and integer(x.get("index")) is not None for x in layers):
        return {integer(x["index"]) for x in layers}
    return None


def configuration_problem(value: object, protected: bool) -> str | None:
    """What is wrong with a manifest's `configuration` (`value`; `protected`: whether the release has a protected-
    token table), as a phrase for a one-line refusal; None when it is valid. Valid: an object with exactly `arm` (one
    of CONFIGURATIONS), `sweep` (the id of the sweep that recommended it, a non-empty string, or null) and, for
    ridgefill+rows only, `row_share` (a number in (0, 1)); ridgefill+protected only in a release with a
    protected-token table."""

    def show(v) -> str:
        text = json.dumps(v, sort_keys=True)
        return text if len(text) <= 60 else text[:57] + "..."

    if not isinstance(value, dict):
        return f"'configuration' is {show(value)}, expected an object {{\"arm\": ..., \"sweep\": ...}}"
    arm = value.get("arm")
    if arm not in CONFIGURATIONS:
        return (f"'configuration.arm' is {show(arm) if 'arm' in value else 'missing'}, expected one of "
                f"{', '.join(CONFIGURATIONS)}")
    keys = {"arm", "sweep", "row_share"} if arm == ROWS_CONFIGURATION else {"arm", "sweep"}
    if set(value) != keys:
        return (f"'configuration' has the keys {', '.join(sorted(value))}, expected exactly {', '.join(sorted(keys))} "
                f"for {arm}")
    sweep = value["sweep"]
    if sweep is not None and not (isinstance(sweep, str) and sweep.strip()):
        return f"'configuration.sweep' is {show(sweep)}, expected a sweep artifact id (a string) or null"
    share = value.get("row_share", 0.5)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        return f"'configuration.row_share' is {show(share)}, expected a number between 0 and 1 (exclusive)"
    if arm == PROTECTED_CONFIGURATION and not protected:
        return ("'configuration.arm' is \"ridgefill+protected\", but the release has no protected-token table "
                "('protected_tokens')")
    return None


def exact_norm_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest's `fit.exact_norm`, as a phrase for a one-line refusal; None when it is valid:
    a positive, finite number (a JSON number, not a boolean). A manifest without it was exported before the field
    existed: the phrase says to export it again."""
    fit = manifest.get(FIT)
    if not isinstance(fit, dict) or EXACT_NORM not in fit:
        return (f"'{FIT}.{EXACT_NORM}' is missing (a release exported before the exact-row norm existed: export it "
                "again)")
    value = fit[EXACT_NORM]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return (f"'{FIT}.{EXACT_NORM}' is {json.dumps(value)[:60]}, expected a positive number (the split-state norm "
                "above which a prefix row runs exactly)")
    return None


# ------------------------------------------------------------------------ the facts a release is applied with


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(value) -> int | None:
    """A JSON integer as a JavaScript reader sees one (12 and 12.0 alike), else None (booleans included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _model_int(manifest: dict, key: str) -> tuple[int | None, str | None]:
    """(`model.<key>` as a positive int, None) or (None, the phrase refusing it)."""
    model = manifest.get("model")
    value = model.get(key, "missing") if isinstance(model, dict) else "missing"
    n = integer(value)
    if n is None or n < 1:
        shown = "missing" if value == "missing" else _show(value)
        return None, f"'model.{key}' is {shown}, expected a positive integer"
    return n, None


def tail_problem(value, context: int | None = None) -> str | None:
    """What is wrong with a tail (a release's `tail_default`, `export --tail`, a recipe's [export] tail), as the
    phrase that follows its name in a one-line refusal ("is 0, expected an integer from 1 to ..."); None when it is
    an integer from 1 to MAX_TAIL and, where the model's context length is known (`context` positions), below it: a
    tail that long leaves no prompt a prefix row to fill. One rule, so the reader, export and a recipe say the same."""
    top = MAX_TAIL if context is None else min(MAX_TAIL, context - 1)
    tail = integer(value)
    if tail is not None and 1 <= tail <= top:
        return None
    why = "" if top == MAX_TAIL else f" (below the model's context of {context} positions)"
    return f"is {_show(value)}, expected an integer from 1 to {top}{why}"


def protected_problem(largest: int, vocab_size: int, model: str) -> str | None:
    """What is wrong with a protected-token table whose largest id is `largest` for a model (`model`: how the
    phrase names it) of `vocab_size` tokens, as a phrase for a one-line refusal; None when every id is within the
    vocabulary (a table of another tokenizer names tokens the model is never given)."""
    if largest < vocab_size:
        return None
    return (f"the protected-token table holds token id {largest}, past the vocabulary of {model} ({vocab_size} "
            f"tokens: ids 0..{vocab_size - 1})")


def applied_problem(manifest: dict) -> str | None:
    """What is wrong with the facts that say where and how a release is applied (docs/format.md, Verifying, rule 11),
    as a phrase for a one-line refusal; None when they are valid: `model.num_layers` a positive integer, `split` an
    integer in [1, num_layers) (at split 0 the maps would read the embeddings and fill every layer: no fit makes
    such maps), `tail_default` a tail (`tail_problem`), `fit.skip_first_rows` an integer >= 0 (absent in a /1
    release: DEFAULT_SKIP_FIRST_ROWS), the model's name and data as `_identity_problem` wants them, and `layers`
    indexed exactly split..num_layers-1 in that order in /2 (in /1, which was never held to it, each index an integer
    >= 0). Integers as a JavaScript reader sees them (2.0 is 2). Nothing is allocated by a number the manifest
    gives."""
    num_layers, problem = _model_int(manifest, "num_layers")
    if problem is not None:
        return problem
    split = integer(manifest.get("split"))
    if split is None or not 1 <= split < num_layers:
        return (f"'split' is {_show(manifest.get('split'))}, expected an integer from 1 to {num_layers - 1} "
                f"(model.num_layers is {num_layers})")
    problem = tail_problem(manifest.get("tail_default"))
    if problem is not None:
        return f"'tail_default' {problem}"
    fit = manifest.get(FIT) if isinstance(manifest.get(FIT), dict) else {}
    if SKIP_FIRST_ROWS not in fit and manifest.get("format") != FORMAT_V1:
        return f"'{FIT}.{SKIP_FIRST_ROWS}' is missing, expected the number of leading rows the fit left out"
    skip = integer(fit.get(SKIP_FIRST_ROWS, DEFAULT_SKIP_FIRST_ROWS))
    if skip is None or skip < 0:
        return f"'{FIT}.{SKIP_FIRST_ROWS}' is {_show(fit[SKIP_FIRST_ROWS])}, expected an integer >= 0"
    problem = _identity_problem(manifest)
    if problem is not None:
        return problem
    layers = manifest.get("layers")
    got = [x.get("index") if isinstance(x, dict) else None for x in layers] if isinstance(layers, list) else None
    if manifest.get("format") == FORMAT_V1:  # any layers, but each an object with an integer index
        for i, index in enumerate(got or []):
            if integer(index) is None or integer(index) < 0:
                return f"'layers[{i}].index' is {_show(index)}, expected a layer index (an integer >= 0)"
        return None
    # compared without a list sized by num_layers: a forged 10**12 costs nothing
    if got is None or len(got) != num_layers - split or any(integer(g) != split + i for i, g in enumerate(got)):
        return (f"'layers' has the indices {_show(got)}, expected {split}..{num_layers - 1} ascending (every layer "
                f"from 'split' to model.num_layers - 1)")
    return None


def _identity_problem(manifest: dict) -> str | None:
    """What is wrong with the facts that name the release's model and data where a runtime shows or compares them:
    `model.name` a non-empty string, `model.fingerprint` a string, `fit.calibration_sha256` (when present) a list of
    strings; None when they are valid."""
    model = manifest["model"]  # an object: `_model_int` found num_layers in it
    for key in ("name", "fingerprint"):
        if not isinstance(model.get(key), str) or not model[key]:
            return f"'model.{key}' is {_show(model[key]) if key in model else 'missing'}, expected a non-empty string"
    calibration = manifest[FIT].get("calibration_sha256", []) if isinstance(manifest.get(FIT), dict) else []
    if not isinstance(calibration, list) or not all(isinstance(x, str) for x in calibration):
        return f"'{FIT}.calibration_sha256' is {_show(calibration)}, expected a list of sha256 strings"
    return None


def format_for(manifest: dict) -> str:
    """The format a writer gives a release with these facts: /3 when its maps read earlier states, else /2."""
    return FORMAT_STATES if STATES in manifest else FORMAT


def states_problem(manifest: dict) -> str | None:
    """What is wrong with the manifest's `states`, as a phrase for a one-line refusal; None when valid. /1 and /2:
    absent. /3: a list of integers [split, l1, ...], two at least, the rest distinct and each 0 <= l < split. Checked
    after `applied_problem` (the split is valid); a forged list longer than split + 1 is refused by its length."""
    states = manifest.get(STATES)
    if manifest.get("format") != FORMAT_STATES:
        return None if STATES not in manifest else (
            f"'{STATES}' is in a {manifest.get('format')} release (maps that read earlier states are {FORMAT_STATES})")
    split = integer(manifest["split"])
    want = f"expected [split, earlier layers...]: {split} first, then distinct layers below it"
    if STATES not in manifest:
        return f"'{STATES}' is missing, {want} (a {FORMAT_STATES} release's maps read them)"
    if not isinstance(states, list) or not 2 <= len(states) <= split + 1:
        return f"'{STATES}' is {_show(states)}, {want}"
    got = [integer(x) for x in states]
    if got[0] != split or any(l is None or not 0 <= l < split for l in got[1:]) or len(set(got)) != len(got):
        return f"'{STATES}' is {_show(states)}, {want}"
    return None


def states_of(manifest: dict) -> list[int]:
    """The layers whose inputs the maps read, side by side, of a manifest that passed `states_problem`: /3's
    `states`, else [split]."""
    if manifest.get("format") == FORMAT_STATES:
        return [integer(x) for x in manifest[STATES]]
    return [integer(manifest["split"])]


def maps_problem(manifest: dict) -> str | None:
    """What is wrong with the manifest's map kinds (Verifying, rule 12, before the widths), as a phrase for a
    one-line refusal; None when valid. /1: no `layers` entry carries `map`. /2: `model.hidden_size`,
    `model.num_kv_heads` and `model.head_dim` are positive integers, and every `layers[i]` is exactly
    {index, kind, map} with `kind` a string and `map` one of MAP_KINDS, never "kv" on a linear_attention layer."""
    layers = manifest.get("layers")
    entries = list(enumerate(layers)) if isinstance(layers, list) else []
    if manifest.get("format") == FORMAT_V1:
        for i, x in entries:
            if isinstance(x, dict) and "map" in x:
                return (f"'layers[{i}].map' is in a {FORMAT_V1} release, whose maps are all input maps (map kinds "
                        f"are {FORMAT})")
        return None
    for key in ("hidden_size", "num_kv_heads", "head_dim"):
        problem = _model_int(manifest, key)[1]
        if problem is not None:
            return problem
    if not entries:
        return f"'layers' is {_show(layers)}, expected a list of {{\"index\", \"kind\", \"map\"}}"
    for i, x in entries:
        if not isinstance(x, dict) or set(x) != set(LAYER_KEYS):
            keys = sorted(x) if isinstance(x, dict) else _show(x)
            if isinstance(x, dict) and set(x) == {"index", "kind"}:
                return f"'layers[{i}].map' is missing, expected one of {', '.join(map(repr, MAP_KINDS))}"
            return f"'layers[{i}]' has the keys {keys}, expected exactly {', '.join(LAYER_KEYS)}"
        if not isinstance(x["kind"], str) or not x["kind"]:
            return f"'layers[{i}].kind' is {_show(x['kind'])}, expected the layer type (a string)"
        if x["map"] not in MAP_KINDS:
            return f"'layers[{i}].map' is {_show(x['map'])}, expected one of {', '.join(map(repr, MAP_KINDS))}"
        if x["map"] == KV_MAP and x["kind"] == LINEAR_KIND:
            return (f"'layers[{i}].map' is \"kv\" on a {LINEAR_KIND} layer (layer {x['index']}), which has no keys "
                    "and values to predict: its map is \"input\"")
    return None


def map_kinds(manifest: dict) -> dict[int, str]:
    """{layer: "input" | "kv"} of a manifest that passed `maps_problem` (a /1 release: every map "input")."""
    return {int(x["index"]): x.get("map", INPUT_MAP) for x in manifest.get("layers") or []}


def kv_width(manifest: dict) -> int | None:
    """A kv map's d_out, 2 * num_kv_heads * head_dim, of a /2 manifest that passed `maps_problem`; None for /1."""
    if manifest.get("format") == FORMAT_V1:
        return None
    model = manifest["model"]
    return 2 * integer(model["num_kv_heads"]) * integer(model["head_dim"])


def width_problem(manifest: dict, layer: int, shape: tuple[int, ...]) -> str | None:
    """What is wrong with a layer's map weight shape [d_out, d_in] in a /2 or /3 release (rule 12), as a phrase; None
    when d_in is model.hidden_size (times the count of `states` in /3) and d_out is hidden_size (an input map) or 2 *
    num_kv_heads * head_dim (a kv map). /1
    widths are not the reader's to check (a runtime checks them against its model: `Release.check_model`)."""
    if manifest.get("format") == FORMAT_V1:
        return None
    d = integer(manifest["model"]["hidden_size"])
    kind = map_kinds(manifest)[layer]
    n = len(states_of(manifest))
    want = (kv_width(manifest) if kind == KV_MAP else d, d * n)
    if tuple(shape) == want:
        return None
    why = ("2 x model.num_kv_heads x model.head_dim rows" if kind == KV_MAP else "model.hidden_size rows") + \
        (" and model.hidden_size columns" if n == 1 else f" and model.hidden_size x {n} columns (one per state)")
    return f"has shape {list(shape)}, expected {list(want)} ({_a_map(kind)}: {why})"


def _a_map(kind: str) -> str:
    return "an input map" if kind == INPUT_MAP else "a kv map"
