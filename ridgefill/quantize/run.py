"""`ridgefill quantize`: int8 maps (group-wise, ridgefill.formats.int8) with their error and held-out score.

Bias correction: the weight error W - W_q costs (W - W_q) x on every row. Its part along the calibration mean,
(W - W_q) mean_x, is the same on every row, so it is folded into the bias (`int8.bias_correction`).

The quantize artifact stores the maps already in the release tensor layout (codes, bf16 scales, bf16
bias), so export only copies them; the group size is in its recipe and its quant.safetensors metadata
(`group_size`), and every reader takes it from there (export/artifact.py: `group_size`, `decoded_maps`).
"""

from __future__ import annotations

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture import artifact as captured
from ridgefill.quantize.artifact import QUANT, REPORT
from ridgefill.formats import int8, safetensors
from ridgefill.formats.release import BIAS, CODES, SCALES, tensor_name
from ridgefill.numerics import bf16_bits_to_f32, f32_to_bf16_bits
from ridgefill.output import Output
from ridgefill.solve import artifact as solved

FORMAT_VERSION = 1


def quantize(store: Store, maps_ref: str, out: Output, group: int = int8.GROUP_SIZE, *,
             place=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the quantization. `place` (a ridgefill.models.device.Where; default `where()`) is where
    the model that re-scores the maps runs; its device kind and dtype go into the recipe as `device` /
    `model_dtype` (`dtype` there is int8; nothing is added for cpu / float32)."""
    from ridgefill.models.device import where

    place = place or where()
    sol = store.get(maps_ref, stage="solve")
    recipe = {"stage": "quantize", "version": FORMAT_VERSION, "solve": sol.id, "dtype": "int8", "group_size": group,
              "bias_correction": True, **place.recipe("model_dtype")}
    hit = store.cached("quantize", recipe)
    if hit is not None:
        return hit, True
    store.verify(sol)
    maps = solved.load_maps(sol)
    cap = store.upstream(sol, "capture")
    captured.warn_if_mixed(cap, place, out)
    mean_x = solved.calibration_mean(store, sol)
    arrays, qmaps, errors = {}, {}, {}
    for l, (w, b) in maps.items():
        codes, scale_bits, bias_bits = quantize_map(w, b, mean_x, group)
        deq = int8.dequantize(codes, scale_bits, group)
        errors[str(l)] = float(np.abs(deq - w).max() / max(np.abs(w).max(), 1e-30))
        qmaps[l] = (deq, bf16_bits_to_f32(bias_bits))
        arrays[tensor_name(l, CODES)] = codes
        arrays[tensor_name(l, SCALES)] = safetensors.BF16(scale_bits)
        arrays[tensor_name(l, BIAS)] = safetensors.BF16(bias_bits)
    before, after = _scores(store, cap, sol, maps, qmaps, place, out)
    report = {"group_size": group, "max_rel_error": errors, "max_rel_error_worst": max(errors.values()),
              "heldout_float": before, "heldout_int8": after}
    with store.build("quantize", recipe) as build:
        safetensors.save(build.path / QUANT, arrays, {"group_size": str(group)})
        write_json(build.path / REPORT, report)
        summary = {"max_rel_error_worst": report["max_rel_error_worst"], "score_float": before["score"],
                   "score_int8": after["score"], "split": sol.manifest["summary"]["split"]}
        art = build.commit(info={"solve": sol.id, **{k: sol.info[k] for k in ("capture", "model", "model_spec")}},
                           summary=summary)
    return art, False


def quantize_map(w: np.ndarray, b: np.ndarray, mean_x: np.ndarray, group: int = int8.GROUP_SIZE):
    """int8 codes, bf16 scale bits and bias-corrected bf16 bias bits for one map (w [d_out, d_in], b [d_out])."""
    codes, scale_bits = int8.quantize(w, group)
    bias = int8.bias_correction(b, w, int8.dequantize(codes, scale_bits, group), mean_x)  # [d_out] float32
    return codes, scale_bits, f32_to_bf16_bits(bias)


def _scores(store: Store, cap: Artifact, sol: Artifact, maps: dict, qmaps: dict, place, out: Output) -> tuple[dict, dict]:
    """Held-out score of the float maps and of the decoded int8 maps, on the capture's held-out rows."""
    from ridgefill.solve.score import Scorer, objective

    ref = captured.captured_model(cap, store)
    lm = captured.open_model(cap, store, ref, place)
    out.info(f"scoring on {place.describe()}")
    split = sol.manifest["summary"]["split"]
    scorer = Scorer(lm.adapter, captured.load_heldout(cap), split, ref.num_layers, solved.load_map_kinds(sol),
                    states=solved.load_states(sol))
    metric = sol.recipe["metric"]
    out = []
    for m in (maps, qmaps):
        layers = sorted(m)
        s = scorer.score([m[l][0] for l in layers], [m[l][1] for l in layers])
        out.append({"score": objective(s, metric), **s["mean"]})
    return out[0], out[1]
