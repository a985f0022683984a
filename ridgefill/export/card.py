"""The model card (README.md) of a map release: Hub metadata (YAML front matter), then a short human text.

`model_card(manifest)` is a pure function of the release manifest (docs/format.md), deterministic (no dates, no
versions, sorted keys), so the same release always gets the same card. The card is documentation: the manifest
never hashes it, and the Hub may rewrite it. It is built with huggingface_hub's `ModelCardData` / `ModelCard`
(imported when a card is made), so it parses back as the Hub reads it.

Metadata, following the Hub's model card conventions:

    library_name          ridgefill
    base_model            model.base_model (the upstream Hub repo; the built-ins record theirs), else model.name
                          when it is a Hub id; absent for local models (a path is not a Hub id)
    base_model_relation   adapter: the maps are extra weights used next to the unchanged base model (the Hub's
                          other relations, finetune / merge / quantized, all describe a changed copy of it)
    license               the manifest's `license` (the base model's license); absent when the manifest has none
                          (a Hub model's license lives in its own card, which ridgefill never downloads)
    tags                  ridgefill, kv-cache, prefill

Manifest keys read (all optional except `model.name`): model.{name, revision, architecture, base_model, source,
spec}, license, split, tail_default, layers (and their `map` kinds), projector.{dtype, group_size}, format, configuration.{arm, sweep,
row_share}, protected_tokens.types, fit.{alpha, lambda, rows, documents}, heldout.{fitted, identity}.{k_cosine,
v_cosine, input_cosine, ...any other numbers}, heldout.{rows, float_score, int8_score}, eval (scalars, flattened).

The card says what the maps predict: each late layer's input (`map` "input", every map of a `ridgefill-maps/1`
release), or its keys and values directly (`map` "kv"), with how many of each. It states the release's configuration (the plain fill when the manifest has none) and the one runtime call
that applies the release as made: `prefill(lm, ids, rel.arm, **rel.options())`, which its usage snippet runs.
"""

from __future__ import annotations

import re

from ridgefill.formats.release.names import (INPUT_MAP, KSCALE_CONFIGURATION, KV_MAP, PLAIN,
                                             PROTECTED_CONFIGURATION, ROWS_CONFIGURATION)

LIBRARY = "ridgefill"
TAGS = ("ridgefill", "kv-cache", "prefill")
RELATION = "adapter"
FRONT_MATTER_ORDER = ["library_name", "base_model", "base_model_relation", "license", "tags"]
HUB = "https://huggingface.co"
# held-out metrics shown first, with their labels; any other numeric key is shown after them under its own name
HELDOUT_METRICS = (
    ("k_cosine", "K cosine"),
    ("v_cosine", "V cosine"),
    ("input_cosine", "input cosine"),
    ("rel_se", "relative squared error"),
    ("explained_var", "explained variance"),
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def _num(x: object, spec: str = ".4g") -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _scalars(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Flatten nested dicts to (dotted key, scalar) pairs, sorted; lists are skipped (too long for a card)."""
    out = []
    for k in sorted(d, key=str):
        v = d[k]
        if isinstance(v, dict):
            out += _scalars(v, f"{prefix}{k}.")
        elif isinstance(v, (str, int, float, bool)) or v is None:
            out.append((f"{prefix}{k}", v))
    return out


def _hub_id(x) -> str | None:
    return x if isinstance(x, str) and _HUB_ID.match(x) else None


def base_model(manifest: dict) -> str | None:
    """The Hub repo the maps adapt: model.base_model, else model.name when that is a Hub id; None otherwise."""
    model = manifest["model"]
    return _hub_id(model.get("base_model")) or _hub_id(str(model["name"]))


def license_id(manifest: dict) -> str | None:
    lic = manifest.get("license")
    return lic if isinstance(lic, str) and lic else None


def card_data(manifest: dict):
    """The card's Hub metadata as a huggingface_hub `ModelCardData`."""
    from huggingface_hub import ModelCardData

    base = base_model(manifest)
    return ModelCardData(library_name=LIBRARY, base_model=base, base_model_relation=RELATION if base else None,
                         license=license_id(manifest), tags=list(TAGS))


def _heldout_table(heldout: dict) -> list[str]:
    fitted, identity = heldout.get("fitted") or {}, heldout.get("identity") or {}
    rows = [(key, label) for key, label in HELDOUT_METRICS if key in fitted or key in identity]
    known = {key for key, _ in HELDOUT_METRICS}
    others = sorted(
        k for k in set(fitted) | set(identity)
        if k not in known and all(isinstance(d.get(k, 0.0), (int, float)) for d in (fitted, identity))
    )
    rows += [(k, k.replace("_", " ")) for k in others]
    if not rows:
        return []
    out = ["| held-out metric | fitted | identity |", "|---|---:|---:|"]
    for key, label in rows:
        f = _num(fitted[key], ".4f") if key in fitted else "–"
        i = _num(identity[key], ".4f") if key in identity else "–"
        out.append(f"| {label} | {f} | {i} |")
    return out


def _link(repo: str) -> str:
    return f"[{repo}]({HUB}/{repo})"


def _model_lines(manifest: dict) -> list[str]:
    """Which model the maps were fitted on, where it comes from, and its license."""
    model = manifest["model"]
    name = str(model["name"])
    bits = [f"{key} `{model[key]}`" for key in ("revision", "architecture") if model.get(key) is not None]
    line = f"- Base model: `{name}`" + (f" ({', '.join(bits)})" if bits else "")
    base, source = base_model(manifest), _hub_id(model.get("source"))
    if base and base != name:
        line += f": from {_link(source)}, a conversion of {_link(base)}" if source else f", from {_link(base)}"
    lines = [line, "- The maps fit exactly this model (its fingerprint is in `ridgefill.json`); loading them onto "
                   "another model is refused."]
    lic = license_id(manifest)
    if lic:
        lines.append(f"- License: `{lic}`, the base model's license (the maps are computed from its activations)")
    elif base:
        lines.append(f"- License: not recorded here (ridgefill downloads only what loading a model needs, not its "
                     f"card): the base model's license applies, see {_link(base)}")
    else:
        lines.append("- License: not recorded (a local model): the base model's license applies")
    return lines


RUNTIME_CALL = "prefill(lm, ids, rel.arm, **rel.options())"


def _configuration_line(manifest: dict) -> str:
    """The configuration the release is applied with (docs/format.md), what it does, and the call that applies it."""
    conf = manifest.get("configuration")
    conf = conf if isinstance(conf, dict) else {}
    arm = conf.get("arm") if isinstance(conf.get("arm"), str) else PLAIN
    share = conf.get("row_share")
    pct = f"{100 * share:.3g} %" if isinstance(share, (int, float)) and not isinstance(share, bool) else "10 %"
    types = (manifest.get("protected_tokens") or {}).get("types")
    table = f" ({types} token types)" if isinstance(types, int) and not isinstance(types, bool) else ""
    what = {
        PLAIN: ("the plain fill", ""),
        ROWS_CONFIGURATION: (f"the fill, and the {pct} of the prompt's rows that its last 64 rows attend to most (in "
                           "the layers below the split) run every layer exactly", f", plus `row_share={share!r}`"),
        KSCALE_CONFIGURATION: ("the fill with a per-request key rescale: per KV head, the filled keys are scaled to "
                             "the norms of the keys of the first tail rows", ', plus `corrections=("kscale",)`'),
        PROTECTED_CONFIGURATION: (f"the fill, and the prefix rows whose token is in the release's protected-token "
                                f"table{table} run every layer exactly", ", plus `protected`: the table's token ids"),
    }
    text, adds = what.get(arm, (f"`{arm}`", ""))
    sweep = conf.get("sweep")
    by = f", recommended by sweep `{sweep}`" if isinstance(sweep, str) and sweep else ""
    runtime_arm = ROWS_CONFIGURATION if arm == ROWS_CONFIGURATION else PLAIN
    return (f"- Configuration: `{arm}`{by}: {text}. Applied as made by `{RUNTIME_CALL}` (`rel.arm` is "
            f"`\"{runtime_arm}\"`; the options are the release's split, tail, maps and exact rows{adds})")


def _commented(pairs: list[tuple[str, str]]) -> list[str]:
    width = max(len(cmd) for cmd, _ in pairs)
    return [f"{cmd.ljust(width)}  # {note}" for cmd, note in pairs]


def _usage(manifest: dict) -> list[str]:
    """How to get, check and use the release: command line and Python."""
    model = manifest["model"]
    spec = model.get("spec") if isinstance(model.get("spec"), str) and model.get("spec") else "MODEL"
    where = "" if spec != "MODEL" else f" MODEL is the model the maps were made for (`{model['name']}`)."
    return [
        "", "## Usage", "",
        f"With `ridgefill` installed; OWNER/NAME is this repository, DIR a local folder.{where}", "",
        "```", *_commented([("ridgefill pull OWNER/NAME --out DIR", "downloads and verifies before DIR appears"),
                            ("ridgefill verify DIR", "every file against ridgefill.json"),
                            (f"ridgefill eval {spec} DIR", "needles, ΔNLL and speed-up against the exact prefill")]),
        "```", "",
        "Prefill a long prompt with the maps from Python, then decode:", "",
        "```python",
        "from pathlib import Path",
        "",
        "from ridgefill.models import load_model, resolve_model",
        "from ridgefill.runtime import greedy, load_release_maps, prefill",
        "",
        'store = Path("ridgefill-artifacts")',
        f'lm = load_model(resolve_model("{spec}", store_root=store), store_root=store)',
        'rel = load_release_maps(lm, "DIR")  # verified; refuses maps made for another model',
        'ids = lm.tokenizer(Path("prompt.txt").read_text(), return_tensors="pt").input_ids[0]',
        "opts = rel.options()  # its split, exact tail, maps and configuration; rows its fit left out run exactly",
        'if len(ids) <= opts["tail"]:  # no prefix before the exact tail: nothing to fill, the prompt runs exactly',
        '    print(f"{len(ids)} tokens, not more than the exact tail ({opts[\'tail\']}): nothing is filled")',
        '    opts["tail"] = len(ids)',
        "res = prefill(lm, ids, rel.arm, **opts)  # the release as made",
        "print(lm.tokenizer.decode(greedy(lm, res, max_new=40)))",
        "```",
    ]


def _map_kinds(layers: list) -> dict:
    """{layer: "input" | "kv"} of the manifest's layers (no `map`: a /1 release, every map an input map)."""
    return {x.get("index"): x.get("map", INPUT_MAP) for x in layers if isinstance(x, dict)}


def _kinds_text(kinds: dict) -> str:
    """What the maps predict, for the card's Maps line."""
    n_kv = sum(k == KV_MAP for k in kinds.values())
    n_input = len(kinds) - n_kv
    if not kinds:
        return ""
    if not n_kv:
        return ", input maps (each predicts its layer's input)"
    if not n_input:
        return ", kv maps (each predicts its layer's keys, before RoPE and QK-norm, and values)"
    return (f", {n_kv} kv map{'s' * (n_kv > 1)} (keys, before RoPE and QK-norm, and values) and {n_input} input "
            f"map{'s' * (n_input > 1)} (the layer's input)")


def model_card(manifest: dict) -> str:
    """Markdown model card for a release manifest (the one `release.write_release` writes)."""
    from huggingface_hub import ModelCard

    model = manifest["model"]
    name = str(model["name"])
    split, tail = manifest.get("split"), manifest.get("tail_default")
    layers = manifest.get("layers") or []
    proj = manifest.get("projector") or {}
    fit = manifest.get("fit") or {}

    kinds = _map_kinds(layers)
    lines = [f"# RidgeFill maps for {name}", ""]
    if KV_MAP not in kinds.values():
        lines.append(
            f"RidgeFill maps for `{name}`: closed-form ridge-regression maps `x_hat_l = W_l h_S + b_l` that predict "
            "the input of each late layer `l` from the hidden state entering the split layer `S`. During a long "
            "prefill, prefix rows run layers `0..S-1` exactly and the late layers only write their cache from the "
            "predicted input; the last tail tokens run every layer exactly. Nothing was trained."
        )
    else:
        lines.append(
            f"RidgeFill maps for `{name}`: closed-form ridge-regression maps from the hidden state entering the split "
            "layer `S` that predict, for each late attention layer `l`, its keys (before RoPE and QK-norm) and "
            "values directly, `[k; v]_hat_l = M_l h_S + c_l` (kv maps), and for any other late layer its input, "
            "`x_hat_l = W_l h_S + b_l` (input maps). During a long prefill, prefix rows run layers `0..S-1` exactly "
            "and the late layers only write their cache from the predictions; the last tail tokens run every layer "
            "exactly. Nothing was trained."
        )
    lines.append("")
    lines += _model_lines(manifest)
    lines.append(f"- Split layer: {_num(split)}")
    lines.append(f"- Exact tail (default): {_num(tail)} tokens")
    idx = [x["index"] for x in layers if isinstance(x, dict) and "index" in x]
    span = f" (layers {min(idx)}–{max(idx)})" if idx else ""
    lines.append(f"- Maps: {len(layers)}{span}{_kinds_text(kinds)}")
    dtype = proj.get("dtype", "?")
    detail = ""
    if dtype == "int8" and proj.get("group_size"):
        detail = f", groups of {proj['group_size']} input columns with bf16 scales"
    lines.append(f"- Projector: {dtype}{detail}; format `{manifest.get('format', '?')}`")
    lines.append(_configuration_line(manifest))
    fit_bits = [f"{label} {_num(fit[key])}" for key, label in
                (("alpha", "alpha"), ("lambda", "lambda"), ("rows", "rows"), ("documents", "documents")) if key in fit]
    per = fit.get("alpha_per_layer")
    if isinstance(per, dict) and per:
        fit_bits.insert(0, f"alpha per layer {_num(min(per.values()))} .. {_num(max(per.values()))}")
    if fit_bits:
        lines.append(f"- Fit: {', '.join(fit_bits)}")

    heldout = manifest.get("heldout") or {}
    table = _heldout_table(heldout)
    if table:
        rows = f" ({_num(heldout['rows'])} rows)" if "rows" in heldout else ""
        lines += ["", "## Held-out scores", "",
                  f"On documents not used for the fit{rows}. K and V cosine: keys and values the late layers "
                  "write from the predicted input against those from the true input; input cosine: predicted "
                  "against true layer input. *identity* fills with `h_S` itself.", ""]
        lines += table
        if "float_score" in heldout and "int8_score" in heldout:
            lines += ["", f"Selection score of the float maps {_num(heldout['float_score'], '.4f')}, "
                          f"of the decoded int8 maps {_num(heldout['int8_score'], '.4f')}."]
    ev = manifest.get("eval")
    if isinstance(ev, dict) and ev:
        lines += ["", "## Evaluation", ""]
        lines += [f"- {k}: {_num(v)}" for k, v in _scalars(ev)]

    lines += _usage(manifest)
    lines += [
        "", "## Verify", "",
        "`ridgefill.json` lists the sha256 of every file except this README (the Hub may rewrite it). Check a "
        "downloaded copy with:", "", "```", "ridgefill verify DIR", "```", "",
    ]
    meta = card_data(manifest).to_yaml(original_order=FRONT_MATTER_ORDER)
    return str(ModelCard(f"---\n{meta}\n---\n\n" + "\n".join(lines)))
