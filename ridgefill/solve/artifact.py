"""The solve artifact (docs/store.md): its file names, how its files are written and read, and the calibration mean
of its maps. Later stages read a solve only through this module.

    maps.safetensors        `layer.<l>.weight` float32 [d_out, d_in], `layer.<l>.bias` float32 [d_out] for every
                            late layer; metadata {split, alpha} (or {split, alpha_per_layer: "l:alpha,..."}) and
                            exact_norm (repr of a float: the exact-row norm, `runtime.rows.fit_exact_norm` of the
                            capture's held-out rows at the split; since format 5); map_kinds ("l:kind,...", kind
                            input (d_out = d) or kv (d_out = 2 * num_kv_heads * head_dim)), num_kv_heads and
                            head_dim (since format 6; before it every map is an input map); states ("S,l1,...":
                            maps from earlier states read the inputs of these layers side by side, d_in = d x their
                            count; absent: h_S alone)
    protected.safetensors   `token_ids` int32, ascending: the protected-token table (solve/protected.py);
                            metadata {share}
    state.safetensors       on a hybrid solved with --state-data: `layer.<l>.state_offset` float32 [value heads,
                            key dim, value dim] (solve/state.py); metadata {split, chunk}
    report.json             the held-out scores per alpha and per layer, the fitted and identity figures, timings
"""

from __future__ import annotations

import json

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.errors import BadInput
from ridgefill.formats import safetensors

MAPS = "maps.safetensors"
REPORT = "report.json"
PROTECTED = "protected.safetensors"
STATE = "state.safetensors"


def offset_name(layer: int) -> str:
    return f"layer.{layer}.state_offset"


def write_maps(path, layers: list[int], w: np.ndarray, b: np.ndarray, meta: dict[str, str]) -> None:
    """maps.safetensors from stacked maps w [layers, d_out, d_in], b [layers, d_out] (float64 or float32)."""
    arrays = {}
    for i, l in enumerate(layers):
        arrays[f"layer.{l}.weight"] = w[i].astype(np.float32)  # [d_out, d_in]
        arrays[f"layer.{l}.bias"] = b[i].astype(np.float32)  # [d_out]
    safetensors.save(path / MAPS, arrays, meta)


def kinds_metadata(kinds: dict[int, str], num_kv_heads: int, head_dim: int) -> dict[str, str]:
    """The maps' metadata that says what each predicts: {map_kinds: "l:kind,...", num_kv_heads, head_dim}."""
    return {"map_kinds": ",".join(f"{l}:{k}" for l, k in sorted(kinds.items())), "num_kv_heads": str(num_kv_heads),
            "head_dim": str(head_dim)}


def states_metadata(states: list[int]) -> dict[str, str]:
    """{states: "S,l1,..."}: the layers whose inputs maps from earlier states read side by side ({} for h_S alone)."""
    return {"states": ",".join(map(str, states))} if len(states) > 1 else {}


def load_states(art: Artifact) -> list[int]:
    """The layers whose inputs a solve's maps read, side by side: [split] alone, or the split then earlier layers
    (from its recipe, which its id covers: the split and the offsets of `--earlier`)."""
    split = int(art.recipe["split"])
    return [split, *(split - int(k) for k in art.recipe.get("earlier", ()))]


def load_map_kinds(art: Artifact) -> dict[int, str]:
    """{layer: "input" | "kv"}: what each of a solve's maps predicts (a solve made before format 6: every map an input
    map)."""
    meta = safetensors.read_header(art.file(MAPS))[1]
    if "map_kinds" not in meta:
        return {l: "input" for l in load_maps(art)}
    return {int(l): k for l, k in (x.split(":") for x in meta["map_kinds"].split(","))}


def load_kv_shape(art: Artifact) -> tuple[int, int] | None:
    """(KV heads, head_dim) of the solve's model, from its maps' metadata; None for a solve made before format 6."""
    meta = safetensors.read_header(art.file(MAPS))[1]
    return (int(meta["num_kv_heads"]), int(meta["head_dim"])) if "num_kv_heads" in meta else None


def write_protected(path, table: np.ndarray, share: float) -> None:
    safetensors.save(path / PROTECTED, {"token_ids": table}, {"share": repr(share)})


def write_offsets(path, offsets: dict[int, np.ndarray], split: int, chunk: int) -> None:
    safetensors.save(path / STATE, {offset_name(l): o for l, o in offsets.items()},
                     {"split": str(split), "chunk": str(chunk)})


def load_maps(art: Artifact) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{layer: (W float32 [d_out, d_in], b float32 [d_out])}."""
    arrays, _ = safetensors.load(art.file(MAPS))
    layers = sorted({int(k.split(".")[1]) for k in arrays})
    return {l: (arrays[f"layer.{l}.weight"], arrays[f"layer.{l}.bias"]) for l in layers}


def load_exact_norm(art: Artifact) -> float:
    """The exact-row norm a solve artifact fixed (its maps.safetensors' `exact_norm`): prefix rows whose split state's
    norm exceeds it run exactly. BadInput for a solve made before format 5, which has none."""
    value = safetensors.read_header(art.file(MAPS))[1].get("exact_norm")
    if value is None:
        raise BadInput(f"solve {art.id} has no exact-row norm (made before solve format 5): solve its capture again")
    return float(value)


def load_extras(art: Artifact) -> tuple[dict | None, np.ndarray | None]:
    """A solve artifact's terminal-state offsets {layer: float32 [value heads, key dim, value dim]} and protected-
    token table (token ids), each None when it has none."""
    names = art.manifest.get("files") or {}
    offsets = None
    if STATE in names:
        offsets = {int(n.split(".")[1]): a for n, a in safetensors.load(art.file(STATE))[0].items()}
    table = safetensors.load(art.file(PROTECTED))[0]["token_ids"] if PROTECTED in names else None
    return offsets, table


def load_report(art: Artifact) -> dict:
    return json.loads(art.file(REPORT).read_text())


def calibration_mean(store: Store, sol: Artifact) -> np.ndarray:
    """mean_x [d_in] float64: the mean state the maps read (h_S, or h_S with the earlier states) of the solve's
    calibration rows (its capture's statistics at its split, raw and chat mixed by its chat_share), the direction a quantizer's bias correction folds the rounding
    error along (ridgefill.formats.int8.bias_correction)."""
    from ridgefill.capture.artifact import load_stats

    cap = store.upstream(sol, "capture")
    return load_stats(cap, sol.recipe["split"], sol.recipe["chat_share"], earlier=sol.recipe.get("earlier", ())).mean_x
