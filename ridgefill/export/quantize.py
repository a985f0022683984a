"""`ridgefill quantize`: int8 maps (group-wise, see ridgefill.export.int8) with their error and held-out score.

Bias correction: the weight error W - W_q costs (W - W_q) x on every row. Its part along the calibration mean,
(W - W_q) mean_x, is the same on every row, so it is folded into the bias: b_q = b + (W - W_q) mean_x. This
matters on models with massive activations (Gemma 3: one split-state dimension reaches 4.5e4 against a median
of 50), where the small weights of that column round coarsely in their group (128 columns by default) and the
error is multiplied by the huge, nearly constant input.

The quantize artifact stores the maps already in the release tensor layout (codes, bf16 scales, bf16
bias), so export only copies them; the group size is in its recipe and its quant.safetensors metadata
(`group_size`), and every reader takes it from there (`group_size`, `decoded_maps`).
"""

from __future__ import annotations

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts import tensors
from ridgefill.artifacts.store import write_json
from ridgefill.export import int8
from ridgefill.export.release import BIAS, CODES, SCALES, tensor_name
from ridgefill.output import Output

FORMAT_VERSION = 1
QUANT = "quant.safetensors"
REPORT = "report.json"


def quantize(store: Store, maps_ref: str, out: Output, group: int = int8.GROUP_SIZE, *, device: str = "auto",
             dtype: str = "auto", device_map=None, max_memory=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the quantization. device / dtype / device_map / max_memory place the model that
    re-scores the maps; its device kind and dtype go into the recipe as `device` / `model_dtype` (`dtype` there
    is int8; nothing is added for cpu / float32)."""
    from ridgefill.models.device import where
    from ridgefill.solve.run import load_maps, warn_if_mixed

    place = where(device, dtype, device_map, max_memory)
    sol = store.get(maps_ref, stage="solve")
    recipe = {"stage": "quantize", "version": FORMAT_VERSION, "solve": sol.id, "dtype": "int8", "group_size": group,
              "bias_correction": True, **place.recipe("model_dtype")}
    hit = store.cached("quantize", recipe)
    if hit is not None:
        return hit, True
    store.verify(sol)
    maps = load_maps(sol)
    cap = store.upstream(sol, "capture")
    warn_if_mixed(cap, place, out)
    mean_x = calibration_mean(store, sol)
    arrays, qmaps, errors = {}, {}, {}
    for l, (w, b) in maps.items():
        codes, scale_bits, bias_bits = quantize_map(w, b, mean_x, group)
        deq = int8.dequantize(codes, scale_bits, group)
        errors[str(l)] = float(np.abs(deq - w).max() / max(np.abs(w).max(), 1e-30))
        qmaps[l] = (deq, int8.bf16_bits_to_f32(bias_bits))
        arrays[tensor_name(l, CODES)] = codes
        arrays[tensor_name(l, SCALES)] = tensors.BF16(scale_bits)
        arrays[tensor_name(l, BIAS)] = tensors.BF16(bias_bits)
    before, after = _scores(store, cap, sol, maps, qmaps, place, out)
    report = {"group_size": group, "max_rel_error": errors, "max_rel_error_worst": max(errors.values()),
              "heldout_float": before, "heldout_int8": after}
    with store.build("quantize", recipe) as build:
        tensors.save(build.path / QUANT, arrays, {"group_size": str(group)})
        write_json(build.path / REPORT, report)
        summary = {"max_rel_error_worst": report["max_rel_error_worst"], "score_float": before["score"],
                   "score_int8": after["score"], "split": sol.manifest["summary"]["split"]}
        art = build.commit(info={"solve": sol.id, **{k: sol.info[k] for k in ("capture", "model", "model_spec")}},
                           summary=summary)
    return art, False


def calibration_mean(store: Store, sol: Artifact) -> np.ndarray:
    """mean_x [d_in] float64: the mean split state of the solve's calibration rows (its capture's statistics at its
    split, raw and chat mixed by its chat_share), the direction the bias correction folds the rounding error along."""
    from ridgefill.capture.run import load_stats

    cap = store.upstream(sol, "capture")
    return load_stats(cap, sol.recipe["split"], sol.recipe["chat_share"]).mean_x


def quantize_map(w: np.ndarray, b: np.ndarray, mean_x: np.ndarray, group: int = int8.GROUP_SIZE):
    """int8 codes, bf16 scale bits and bias-corrected bf16 bias bits for one map (w [d_out, d_in], b [d_out])."""
    codes, scale_bits = int8.quantize(w, group)
    err = w.astype(np.float64) - int8.dequantize(codes, scale_bits, group)  # [d_out, d_in]
    bias = (b.astype(np.float64) + err @ mean_x).astype(np.float32)  # [d_out]
    return codes, scale_bits, int8.f32_to_bf16_bits(bias)


def _scores(store: Store, cap: Artifact, sol: Artifact, maps: dict, qmaps: dict, place, out: Output) -> tuple[dict, dict]:
    """Held-out score of the float maps and of the decoded int8 maps, on the capture's held-out rows."""
    from ridgefill.capture.run import load_heldout
    from ridgefill.solve.run import check_model, open_model
    from ridgefill.solve.score import Scorer, objective

    ref = check_model(cap, store, None)
    lm = open_model(cap, store, ref, place)
    out.info(f"scoring on {place.describe()}")
    split = sol.manifest["summary"]["split"]
    scorer = Scorer(lm.adapter, load_heldout(cap), split, ref.num_layers)
    metric = sol.recipe["metric"]
    out = []
    for m in (maps, qmaps):
        layers = sorted(m)
        s = scorer.score(np.stack([m[l][0] for l in layers]), np.stack([m[l][1] for l in layers]))
        out.append({"score": objective(s, metric), **s["mean"]})
    return out[0], out[1]


def group_size(art: Artifact) -> int:
    """The group size a quantize artifact was quantized with. Its recipe's `group_size` and the `group_size`
    metadata of its quant.safetensors must agree where both are present (RidgefillError otherwise)."""
    from ridgefill.errors import RidgefillError
    from ridgefill.export.release import read_metadata

    recorded = read_metadata(art.file(QUANT)).get("group_size")
    group = art.recipe.get("group_size", recorded)
    if recorded is not None and str(group) != recorded:
        raise RidgefillError(f"quantize artifact {art.id}: {QUANT} records group size {recorded}, its recipe {group}")
    if isinstance(group, str) and group.isdigit():
        group = int(group)
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise RidgefillError(f"quantize artifact {art.id} records no valid group size ({group!r})")
    return group


def load_quant(art: Artifact) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {"codes", "scale_bits", "bias" (float32)}} as `release.write_release` takes them, with
    `group_size(art)`."""
    arrays, _ = tensors.load(art.file(QUANT))
    layers = sorted({int(k.split(".")[1]) for k in arrays})
    return {l: {"codes": arrays[tensor_name(l, CODES)],
                "scale_bits": arrays[tensor_name(l, SCALES)].bits,
                "bias": int8.bf16_bits_to_f32(arrays[tensor_name(l, BIAS)].bits)} for l in layers}


def decoded_maps(art: Artifact) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{layer: (W float32 [d_out, d_in], b float32 [d_out])}: the int8 maps decoded with the artifact's group size."""
    group = group_size(art)
    return {l: (int8.dequantize(q["codes"], q["scale_bits"], group), q["bias"]) for l, q in load_quant(art).items()}
