"""Maps fitted from a bfloat16 capture against maps fitted from a float32 capture (figure "capture_dtype").

    .venv/bin/python bench/capture_dtype.py [--model builtin:smollm2-135m] [--split 20] [--eval-lengths 2048 4096]
        [--eval-documents 4] [--bootstrap 10000] [--quick] [--store DIR] [--out FILE]

On a GPU, and on a CPU with AMX, the model runs in bfloat16; capture keeps its statistics in float64 whatever the
model's dtype (products in float32, docs/capture.md). What the bfloat16 forward costs the maps, measured on one
model at one split, with the CLI in one store (`--store`, else a temporary one):

1. per dtype D (float32, bfloat16): `ridgefill capture MODEL --split S --dtype D` of the built-in corpus with the
   default held-out documents, then `solve --dtype D` (default maps and metric) and `quantize --dtype D`, as a
   recipe with `dtype = D` runs them: each solve's own report (alpha, held-out K/V cosines on its own capture's
   rows, scored in its own dtype);
2. with the model loaded once in float32: both float maps scored on both captures' held-out rows (solve's
   `Scorer`, keys and values computed in float32), so the two kinds of maps are compared on the same rows; and
   per late layer the relative difference of the two maps, ‖W_bf16 - W_f32‖_F / ‖W_f32‖_F (and of the biases);
3. `ridgefill eval` of both int8 maps with the model in float32 (the same exact model judges both), arms exact
   and ridgefill, one exact run per prompt shared by both (bench/map_kinds.py's `shared_eval`, the sweep's way),
   with eval's intervals, and the paired bf16 - f32 differences per document and per needle prompt.

Value: the bf16 - f32 difference of the mean K/V cosine on the float32 capture's held-out rows, and of ΔNLL (all
tokens). Details: every figure, each stage's wall time, what eval's protocol shrank. `--quick` runs tiny sizes to
check that the bench runs (its numbers mean nothing).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, parser, positive  # noqa: E402
from map_kinds import cli, eval_config, paired, pick, shared_eval  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--split", type=positive, default=None, help="default: the built-in's shipped split")
    ap.add_argument("--tail", type=positive, default=512)
    ap.add_argument("--eval-lengths", type=positive, nargs="+", default=None)
    ap.add_argument("--eval-documents", type=positive, default=None)
    ap.add_argument("--bootstrap", type=positive, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the bench runs")
    args = ap.parse_args()

    with Bench("capture_dtype", args, args.model) as bench:
        from ridgefill.models import resolve_model

        split = args.split or resolve_model(args.model, store_root=bench.store).builtin_split
        if split is None:
            raise SystemExit(f"{args.model} has no shipped split: give --split")
        start = time.perf_counter()
        cfg, shrunk = eval_config(args)
        runs = {d: chain(bench, args, split, d) for d in DTYPES}
        compare = cross_score(bench, args, split, runs)
        t = time.perf_counter()
        evals = shared_eval(compare.pop("lm"), _store(bench), {d: runs[d]["quantize"] for d in DTYPES}, cfg)
        walls = {"eval_both_float32": round(time.perf_counter() - t, 1)}
        for d in DTYPES:
            runs[d]["eval"] = evals[d][0]
        diff = paired(evals["float32"][1], evals["bfloat16"][1], cfg)  # bfloat16 minus float32, paired
        f32_rows = compare["scores"]["float32_rows"]
        value = {"kv_cosine_bf16_minus_f32": round(f32_rows["bfloat16"]["kv"] - f32_rows["float32"]["kv"], 5),
                 "dnll_bf16_minus_f32": round(evals["bfloat16"][0]["ridgefill"]["dnll"]
                                              - evals["float32"][0]["ridgefill"]["dnll"], 5)}
        from dataclasses import asdict

        details = {"split": split, "tail": args.tail, "eval_config": asdict(cfg), "shrunk_from_eval_defaults": shrunk,
                   "runs": runs, "same_rows": compare["scores"], "map_difference": compare["maps"],
                   "paired_bf16_minus_f32": diff, "walls_s": {**walls, "cross_score": compare["wall_s"]},
                   "wall_s": round(time.perf_counter() - start, 1)}
        details["table"] = table(runs, compare, diff)
        print(details["table"], flush=True)
        checks = {"both evals measured the same prompts": diff["same_prompts"],
                  "the exact arm measured alike in both evals": diff["same_exact"]}
        bench.finish(value, details=details, checks=checks)


def _store(bench):
    from ridgefill.artifacts import Store

    return Store(bench.store)


def chain(bench, args, split: int, dtype: str) -> dict:
    """capture -> solve -> quantize with the model in `dtype`: ids, each stage's wall, the solve's own figures."""
    import json

    store = _store(bench)
    place = ["--dtype", dtype]
    cap_args = [args.model, "--split", split, *place]
    if args.quick:
        cap_args += ["--max-length", 512, "--held-out", 1]
    print(f"== {dtype}: capture, solve, quantize at split {split}", flush=True)
    cap, w_cap = cli("capture", cap_args, bench.store, args.threads)
    sol, w_sol = cli("solve", [cap["id"], *place], bench.store, args.threads)
    qnt, w_qnt = cli("quantize", [sol["id"], *place], bench.store, args.threads)
    made = store.get(cap["id"]).manifest
    report = json.loads(store.get(sol["id"]).file("report.json").read_text())
    qreport = json.loads(store.get(qnt["id"]).file("report.json").read_text())
    return {"capture": cap["id"], "solve": sol["id"], "quantize": qnt["id"],
            "walls_s": {"capture": w_cap, "solve": w_sol, "quantize": w_qnt},
            "capture_tokens_per_s": made["summary"].get("forward_tokens_per_s"),
            "capture_total_s": made["timings"]["total_s"], "cached": cap["cached"],
            "held_out_rows": made["summary"].get("held_out_rows"), "alpha": report["alpha"],
            "own_rows": {"float": pick(report["fitted"]["mean"], ("k_cosine", "v_cosine")),
                         "int8": pick(qreport["heldout_int8"], ("k_cosine", "v_cosine")),
                         "identity": pick(report["identity"]["mean"], ("k_cosine", "v_cosine"))}}


def cross_score(bench, args, split: int, runs: dict) -> dict:
    """Both float maps on both captures' held-out rows, scored with the model in float32; the maps' relative
    difference per layer. Returns the figures, the wall time, and the loaded model (for the evals)."""
    import numpy as np

    from harness import load
    from ridgefill.capture.artifact import load_heldout
    from ridgefill.solve.artifact import load_maps
    from ridgefill.solve.score import Scorer, layer_objective

    t = time.perf_counter()
    store = _store(bench)
    _, lm = load(args.model, bench.store)  # float32
    L = lm.adapter.num_layers
    maps = {d: load_maps(store.get(runs[d]["solve"])) for d in DTYPES}
    scores = {}
    for rows in DTYPES:
        scorer = Scorer(lm.adapter, load_heldout(store.get(runs[rows]["capture"])), split, L)
        per = {}
        for d in DTYPES:
            layers = scorer.layers
            s = scorer.score([maps[d][l][0] for l in layers], [maps[d][l][1] for l in layers])
            per[d] = {**pick(s["mean"], ("k_cosine", "v_cosine")), "kv": layer_objective(s["mean"], "kv")}
        s = scorer.score(None, None)
        per["identity"] = {**pick(s["mean"], ("k_cosine", "v_cosine")), "kv": layer_objective(s["mean"], "kv")}
        scores[f"{rows}_rows"] = per
    rel = {}
    for l in sorted(maps["float32"]):
        (w32, b32), (w16, b16) = maps["float32"][l], maps["bfloat16"][l]
        rel[str(l)] = {"w": float(np.linalg.norm(w16 - w32) / np.linalg.norm(w32)),
                       "b": float(np.linalg.norm(b16 - b32) / max(np.linalg.norm(b32), 1e-30))}
    w = [r["w"] for r in rel.values()]
    maps_diff = {"per_layer": rel, "w_median": float(np.median(w)), "w_max": float(np.max(w))}
    return {"scores": scores, "maps": maps_diff, "lm": lm, "wall_s": round(time.perf_counter() - t, 1)}


def table(runs: dict, compare: dict, diff: dict) -> str:
    """The comparison as a markdown table (docs/bench.md quotes it)."""
    def ci(v) -> str:
        return f"[{v['low']:.4f}, {v['high']:.4f}]" if isinstance(v, dict) else "–"

    f32, b16 = compare["scores"]["float32_rows"], compare["scores"]["bfloat16_rows"]
    lines = ["| capture dtype | alpha | K / V cos, own rows | K / V cos, float32 rows | K / V cos, bfloat16 rows | "
             "ΔNLL [CI] | novel | key | KL | top-1 | needle % (exact) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in DTYPES:
        r, e = runs[d], runs[d]["eval"]["ridgefill"]
        own = r["own_rows"]["float"]
        lines.append(
            f"| {d} | {r['alpha']:g} | {own['k_cosine']:.4f} / {own['v_cosine']:.4f} | "
            f"{f32[d]['k_cosine']:.4f} / {f32[d]['v_cosine']:.4f} | {b16[d]['k_cosine']:.4f} / {b16[d]['v_cosine']:.4f}"
            f" | {e['dnll']:.4f} {ci(e.get('dnll_ci'))} | {e['dnll_novel']:.4f} | "
            f"{'–' if e['dnll_key'] is None else format(e['dnll_key'], '.3f')} | {e['kl']:.4f} | {e['top1']:.3f} | "
            f"{e['needle']:.1f} ({runs[d]['eval']['exact_needle']:.1f}) |")
    i = f32["identity"]
    lines.append(f"| identity fill | | | {i['k_cosine']:.4f} / {i['v_cosine']:.4f} | | | | | | | |")

    def pair(key):
        v = diff.get(key)
        return "–" if not isinstance(v, dict) else f"{v['mean']:+.4f} [{v['low']:+.4f}, {v['high']:+.4f}]"

    m = compare["maps"]
    lines += ["", f"bfloat16 - float32, paired: ΔNLL {pair('dnll')}, key-token ΔNLL {pair('dnll_key')}, KL "
                  f"{pair('kl')}, needle points {pair('needle')}; ‖W_bf16 - W_f32‖ / ‖W_f32‖ per late layer: median "
                  f"{m['w_median']:.4f}, max {m['w_max']:.4f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
