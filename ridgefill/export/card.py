"""The model card (README.md) of a map release: YAML front matter for the Hub, then a short human text.

`model_card(manifest)` is a pure function of the release manifest (DESIGN.md §5), deterministic (no dates,
sorted keys), so the same release always gets the same card. The card is documentation: the manifest never
hashes it, and the Hub may rewrite it.

Manifest keys read (all optional except `model.name`): model.{name, revision, architecture}, split,
tail_default, layers, projector.{dtype, group_size}, fit.{alpha, lambda, rows, documents}, heldout.{fitted,
identity}.{k_cosine, v_cosine, input_cosine, ...any other numbers}, eval (scalars, flattened), license.
"""

from __future__ import annotations

import json
import re

TAGS = ("ridgefill", "kv-cache", "prefill")
DEFAULT_LICENSE = "apache-2.0"
# held-out metrics shown first, with their labels; any other numeric key is shown after them under its own name
HELDOUT_METRICS = (
    ("k_cosine", "K cosine"),
    ("v_cosine", "V cosine"),
    ("input_cosine", "input cosine"),
    ("rel_se", "relative squared error"),
    ("explained_var", "explained variance"),
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_PLAIN_YAML = re.compile(r"^[A-Za-z0-9][\w./-]*$")


def _yaml_str(s: str) -> str:
    """A YAML scalar: plain when obviously safe, else double-quoted (JSON strings are valid YAML)."""
    plain = _PLAIN_YAML.match(s) and s.lower() not in ("true", "false", "null", "yes", "no", "on", "off")
    return s if plain else json.dumps(s)


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


def _front_matter(manifest: dict) -> list[str]:
    name = str(manifest["model"]["name"])
    lines = ["---", "library_name: ridgefill"]
    if _HUB_ID.match(name):  # a local path or a .gguf file name is not a Hub model id; the Hub would reject it
        lines.append(f"base_model: {_yaml_str(name)}")
    lines.append(f"license: {_yaml_str(str(manifest.get('license', DEFAULT_LICENSE)))}")
    lines.append("tags:")
    lines += [f"- {t}" for t in TAGS]
    lines.append("---")
    return lines


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


def model_card(manifest: dict) -> str:
    """Markdown model card for a release manifest (the one `release.write_release` writes)."""
    model = manifest["model"]
    name = str(model["name"])
    split, tail = manifest.get("split"), manifest.get("tail_default")
    layers = manifest.get("layers") or []
    proj = manifest.get("projector") or {}
    fit = manifest.get("fit") or {}

    lines = _front_matter(manifest)
    lines += ["", f"# RidgeFill maps for {name}", ""]
    lines.append(
        f"RidgeFill maps for `{name}`: closed-form ridge-regression maps `x_hat_l = W_l h_S + b_l` that predict "
        "the input of each late layer `l` from the hidden state entering the split layer `S`. During a long "
        "prefill, prefix rows run layers `0..S-1` exactly and the late layers only write their cache from the "
        "predicted input; the last tail tokens run every layer exactly. Nothing was trained."
    )
    lines.append("")
    bits = [f"{key} `{model[key]}`" for key in ("revision", "architecture") if model.get(key) is not None]
    if bits:
        lines.append(f"- Base model: `{name}` ({', '.join(bits)})")
    lines.append(f"- Split layer: {_num(split)}")
    lines.append(f"- Exact tail (default): {_num(tail)} tokens")
    idx = [x["index"] for x in layers if isinstance(x, dict) and "index" in x]
    span = f" (layers {min(idx)}–{max(idx)})" if idx else ""
    lines.append(f"- Maps: {len(layers)}{span}")
    dtype = proj.get("dtype", "?")
    detail = ""
    if dtype == "int8" and proj.get("group_size"):
        detail = f", groups of {proj['group_size']} input columns with bf16 scales"
    lines.append(f"- Projector: {dtype}{detail}; format `{manifest.get('format', '?')}`")
    fit_bits = [f"{label} {_num(fit[key])}" for key, label in
                (("alpha", "alpha"), ("lambda", "lambda"), ("rows", "rows"), ("documents", "documents")) if key in fit]
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

    lines += [
        "", "## Verify", "",
        "`ridgefill.json` lists the sha256 of every file except this README (the Hub may rewrite it). Check a "
        "downloaded copy with:", "", "```", "ridgefill verify DIR", "```", "",
    ]
    return "\n".join(lines)
