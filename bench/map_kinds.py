"""Key/value maps against input maps on the built-ins, and which kind new releases default to (figure "map_kinds").

    .venv/bin/python bench/map_kinds.py [--models builtin:smollm2-135m builtin:gemma3-270m]
        [--splits smollm2-135m=20,18,16 --splits gemma3-270m=11,10,9] [--speed-length 8192] [--repeat 3]
        [--eval-lengths 4096] [--eval-depths 0.25 0.5] [--eval-tasks single multikey multivalue] [--eval-samples 1]
        [--eval-documents 4] [--eval-doc-tokens 2048] [--bootstrap 10000] [--quick] [--store DIR] [--out FILE]

An input map predicts a late layer's input (d x d; the layer's norm, k_proj and v_proj then run for every filled
row); a key/value map predicts its keys (before RoPE and QK-norm) and values directly (2 kv_heads head_dim x d).
Per model, with the CLI in one store (`--store`, else a temporary one):

1. one `ridgefill capture` of the built-in's default data (builtin:default) with its default held-out documents, at
   every split measured (default: the shipped split and two shallower ones, where the sweep finds the budget's
   edge: SmolLM2 20, 18, 16; Gemma 3 11, 10, 9);
2. per split, `solve --maps input` and `solve --maps kv` of that capture, `quantize` (int8) and `export` of each:
   the held-out key / value cosines of the float maps (the solve report's `fitted.mean`) and of the int8 maps (the
   quantize report's `heldout_int8`), the release's maps.safetensors bytes and each late layer's parameters;
3. `ridgefill eval` (the library's `evaluate`) of both quantize artifacts with one EvalConfig, so both see the same
   prompts: arms exact and ridgefill, ΔNLL on all / novel / key tokens, KL, top-1, needles, with eval's bootstrap
   intervals, and the paired kv - input difference per document and per needle from the two evals' rows; beside
   them, the lengths of the keys and values each kind writes against the true ones on the held-out rows (cosines
   are blind to length);
4. the runtime's prefill speed at `--speed-length` (the longest of 4096 and 8192 the model's context allows), at
   the first split (the shipped one) or every split (`--speed-splits all`): rounds of exact, input and kv,
   interleaved (the order rotating from round to round), medians of `--repeat` rounds after one untimed exact
   prefill, and each round's own exact / arm ratio;
   `logits_rows=1` as eval and sweep time it; each speed-up also as a share of the compute ceiling
   (`ridgefill.runtime.ceiling_speedup`);
5. the map multiply-accumulates per filled row and layer counted on the code path, by
   torch.utils.flop_counter.FlopCounterMode (FLOPs / 2): around `ridgefill.runtime.fill._filled_kv` of one late
   layer and F rows, and as the difference of a whole `prefill` with F filled rows ("ridgefill") and with none
   ("nofill", the same exact rows and attention shapes), divided by F x late layers. Beside the formulas (input:
   d^2 + d 2kv, the map then k_proj / v_proj; kv: d 2kv), for SmolLM2's and Gemma's shapes and for random-weight
   models of Llama-3.1-8B's and 70B's attention shape (2 layers, MLP and vocabulary shrunk: neither runs for a
   filled row); and evaluate/macs.py's cost model of the same prefill (given the map kinds), per filled row.

The rule: key/value maps become the default for new releases when, at every measured split where the input maps are
within the release budget, the key/value maps are within it too. The budget of a model: its release gate
(examples/gates/<model>.toml, every threshold) and the sweep's budget (`SweepConfig`: needle drop and key-token
ΔNLL), both checked on the eval summary by `ridgefill.evaluate.gate.check_gate`. A model without a gate file gets the
sweep's budget alone. Value: the verdict; the details have every figure, every stage's wall time, what the protocol
shrank from eval's defaults, and the table. `--quick` runs tiny sizes to check that the bench runs (its numbers mean
nothing).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (MODEL_CACHE, MODELS, OUT, REPO, Bench, env_threads, exe,  # noqa: E402
                     model_cache, parser, positive, run_measured, short)

SPLITS = {"builtin:smollm2-135m": (20, 18, 16), "builtin:gemma3-270m": (11, 10, 9)}
KINDS = ("input", "kv")
SPEED_LENGTHS = (4096, 8192)  # the longest the model's context allows is timed
# Attention shapes of larger models, for the MAC count on random weights: (hidden, heads, kv_heads, head_dim)
BIG_SHAPES = {"llama-3.1-8b": (4096, 32, 8, 128), "llama-3.1-70b": (8192, 64, 8, 128)}
MAC_ROWS = 16  # F, filled rows in the MAC counts
QUICK_EVAL = {"lengths": (1024,), "tail": 256, "scored": 128, "depths": (0.5,), "tasks": ("single",), "samples": 1,
              "documents": 1, "doc_tokens": 1024, "bootstrap": 200}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--splits", action="append", default=[], metavar="MODEL=S,S,...",
                    help="splits of one model (its short name or spec), e.g. smollm2-135m=20,18,16")
    ap.add_argument("--tail", type=positive, default=512)
    ap.add_argument("--speed-length", type=positive, default=None, help="default: the longest of 4096 and 8192 "
                    "within the model's context")
    ap.add_argument("--repeat", type=positive, default=3, help="timed prefill rounds (after one untimed exact "
                    "prefill)")
    ap.add_argument("--speed-splits", choices=("first", "all"), default="first",
                    help="time the first split given (the shipped one by default) or every split")
    ap.add_argument("--eval-lengths", type=positive, nargs="+", default=None)
    ap.add_argument("--eval-depths", type=float, nargs="+", default=None)
    ap.add_argument("--eval-tasks", nargs="+", default=None)
    ap.add_argument("--eval-samples", type=positive, default=None)
    ap.add_argument("--eval-documents", type=positive, default=None)
    ap.add_argument("--eval-doc-tokens", type=positive, default=None)
    ap.add_argument("--bootstrap", type=positive, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the bench runs")
    args = ap.parse_args()
    splits = {m: SPLITS.get(m, ()) for m in args.models}
    for text in args.splits:
        name, _, rest = text.partition("=")
        match = [m for m in args.models if name in (m, short(m))]
        if not match or not rest:
            ap.error(f"--splits {text!r}: expected MODEL=S,S,... for one of {', '.join(args.models)}")
        splits[match[0]] = tuple(int(s) for s in rest.split(","))
    if args.quick:
        splits = {m: s[:1] for m, s in splits.items()}
    missing = [m for m, s in splits.items() if not s]
    if missing:
        ap.error(f"no splits for {', '.join(missing)}: give --splits MODEL=S,S,...")

    bench = Bench("map_kinds", args, None)
    for m in args.models:
        model_cache(MODEL_CACHE, m)  # outside every timing
    with bench:
        start = time.perf_counter()
        cfg, shrunk = eval_config(args)
        models = {m: measure_model(bench, args, m, splits[m], cfg) for m in args.models}
        big = {name: big_macs(*shape) for name, shape in BIG_SHAPES.items()} if not args.quick else {}
        verdict = decide(models)
        checks = {
            "both kinds' evals measured the same prompts": all(
                s["paired"]["same_prompts"] for r in models.values() for s in r["splits"].values()),
            "the exact arm measured alike in both evals": all(
                s["paired"]["same_exact"] for r in models.values() for s in r["splits"].values()),
            "the shared-exact eval equals evaluate() (tiny configuration)": all(
                r["eval_check"]["agree"] for r in models.values()),
            "code-path map MACs per filled row equal the formula": all(
                c["matches"] for r in [*models.values(), *({"macs": b} for b in big.values())]
                for c in r["macs"].values()),
            "evaluate/macs.py counts the filled rows as the code path does": all(
                c["evaluate_macs_py_matches"] for r in models.values() for c in r["macs"].values()),
        }
        from dataclasses import asdict

        details = {"rule": RULE, "verdict": verdict, "eval_config": asdict(cfg), "shrunk_from_eval_defaults": shrunk,
                   "protocol_notes": NOTES + [f"speed: {args.speed_splits} split(s) timed at the speed length"],
                   "tail": args.tail, "repeat": args.repeat, "models": models, "macs_larger_shapes": big,
                   "wall_s": round(time.perf_counter() - start, 1)}
        details["table"] = table(models, big)
        print(details["table"], flush=True)
        value = {"kv_default": verdict["kv_default"], "kv_within_where_input_within": verdict["kv_within"],
                 "input_within": verdict["input_within"]}
        bench.args.out = bench.args.out or OUT / "map_kinds.json"
        bench.finish(value, details=details, checks=checks)


NOTES = [
    "eval: arms exact and ridgefill only (eval's default also measures identity and nofill, which do not depend on the "
    "map kind)",
    "eval: one exact run per prompt shared by every (split, kind), as the sweep measures its splits "
    "(evaluate/measure.py), instead of one evaluate() per artifact; eval_check holds the two equal on a tiny config",
    "eval: its own timed prefills are not run; the speed section times the prefills at the speed length instead",
    "speed: logits_rows=1 (as eval and sweep time prefills); one untimed exact prefill before the rounds",
    "capture: a cached capture (made earlier with the same command in the same store) is reused; its cost when made "
    "is capture.built_total_s",
]

RULE = ("kv becomes the default for new releases if, at every measured split where the input maps are within the "
        "release budget (the model's gate in examples/gates/ and the sweep's budget: needle drop and key-token ΔNLL), "
        "the kv maps are within it too")


def eval_config(args):
    """The EvalConfig both kinds are measured with (arms exact and ridgefill), and what it shrank from eval's defaults
    ({setting: {"default", "used"}})."""
    from dataclasses import asdict, replace

    from ridgefill.evaluate import EvalConfig

    default = EvalConfig()
    cfg = replace(default, arms=("exact", "ridgefill"), tail=args.tail)
    if args.quick:
        cfg = replace(cfg, **QUICK_EVAL)
    # the --eval-* options a script has (capture_dtype.py has some of them)
    names = ("lengths", "depths", "tasks", "samples", "documents", "doc_tokens")
    given = {k: getattr(args, f"eval_{k}", None) for k in names} | {"bootstrap": getattr(args, "bootstrap", None)}
    cfg = replace(cfg, **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None})
    a, b = asdict(default), asdict(cfg)
    shrunk = {k: {"default": a[k], "used": b[k]} for k in a if a[k] != b[k]}
    return cfg, shrunk


# ------------------------------------------------------------------------------------------------ one model


def cli(stage: str, argv: list, store: Path, threads: int) -> tuple[dict, float]:
    """`ridgefill STAGE ARGV --store STORE --json --quiet`: its JSON result and wall seconds."""
    res = run_measured([exe(), stage, *map(str, argv), "--store", str(store), "--json", "--quiet"],
                       env=env_threads(threads))
    return json.loads(res["stdout"]), round(res["wall_s"], 2)


def measure_model(bench, args, model: str, splits, cfg) -> dict:
    from ridgefill.artifacts import Store
    from ridgefill.formats.release import read_release

    store = Store(bench.store)
    walls: dict = {}
    cap_args = [model, *[a for s in splits for a in ("--split", s)]]
    if args.quick:
        cap_args += ["--max-length", 512, "--held-out", 1]
    print(f"== {model}: capture at splits {', '.join(map(str, splits))}", flush=True)
    cap, walls["capture"] = cli("capture", cap_args, bench.store, args.threads)
    out = {"capture": {"id": cap["id"], "cached": cap["cached"], "splits": list(splits),
                       "data": "builtin:default (the default)", "held_out": "capture's defaults" if not args.quick
                       else "1 document, documents cut to 512 tokens (--quick)"}, "splits": {}, "walls_s": walls}
    art = store.get(cap["id"])
    made = art.manifest  # what the capture cost when it was computed (this run, or an earlier one)
    out["capture"].update({k: made["summary"].get(k) for k in ("calibration_documents", "calibration_tokens",
                                                               "held_out_documents", "held_out_rows")},
                          built_total_s=made["timings"]["total_s"], built_tokens_per_s=made["summary"].get(
                              "forward_tokens_per_s"), built_at=time.strftime(
                              "%Y-%m-%dT%H:%M:%S%z", time.localtime(art.file("artifact.json").stat().st_mtime)))
    for s in splits:
        row: dict = {}
        for kind in KINDS:
            print(f"== {model} split {s}: solve / quantize / export --maps {kind}", flush=True)
            sol, w1 = cli("solve", [cap["id"], "--split", s, "--maps", kind], bench.store, args.threads)
            qnt, w2 = cli("quantize", [sol["id"]], bench.store, args.threads)
            folder = bench.scratch / "releases" / f"{short(model)}-s{s}-{kind}"
            _, w3 = cli("export", [qnt["id"], "--out", folder], bench.store, args.threads)
            walls[f"{s}/{kind}/solve+quantize+export"] = round(w1 + w2 + w3, 2)
            report = json.loads(store.get(sol["id"]).file("report.json").read_text())
            qreport = json.loads(store.get(qnt["id"]).file("report.json").read_text())
            rel = read_release(folder)
            shapes = {tuple(m["weight"].shape) + tuple(m["bias"].shape) for m in rel.maps.values()}
            row[kind] = {
                "solve": sol["id"], "quantize": qnt["id"], "alpha": report["alpha"],
                "float": pick(report["fitted"]["mean"], ("k_cosine", "v_cosine")) | {"score": sol["summary"]["score"]},
                "int8": pick(qreport["heldout_int8"], ("k_cosine", "v_cosine", "score")),
                "identity": pick(report["identity"]["mean"], ("k_cosine", "v_cosine")),
                "map_kinds": sorted(set(rel.map_kinds.values())),
                "maps_safetensors_bytes": (folder / "maps.safetensors").stat().st_size,
                "layers": len(rel.maps), "params_per_layer": sorted(r * c + b for r, c, b in shapes),
                "weight_shape": sorted([r, c] for r, c, _ in shapes),
            }
        out["splits"][str(s)] = row
    from harness import load

    _, lm = load(model, bench.store)  # once: the evals, the timed prefills and the MAC counts
    quantized = {(s, k): out["splits"][str(s)][k]["quantize"] for s in splits for k in KINDS}
    print(f"== {model}: eval of {len(quantized)} int8 maps (one exact run per prompt)", flush=True)
    t = time.perf_counter()
    evals = shared_eval(lm, store, quantized, cfg)
    walls["eval"] = round(time.perf_counter() - t, 1)
    for (s, kind), (fig, _) in evals.items():
        out["splits"][str(s)][kind]["eval"] = fig
    for s in splits:
        out["splits"][str(s)]["paired"] = paired(evals[(s, "input")][1], evals[(s, "kv")][1], cfg)
    t = time.perf_counter()
    for (s, kind), figures in lengths(lm, store, quantized).items():
        out["splits"][str(s)][kind]["lengths"] = figures
    walls["lengths"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    out["eval_check"] = eval_check(lm, store, model, {k: quantized[(splits[0], k)] for k in KINDS}, cfg)
    walls["eval_check"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    out["speed"] = speed(lm, bench, args, model, splits)
    walls["speed"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    out["macs"] = model_macs(lm, bench, model, splits[0])
    walls["macs"] = round(time.perf_counter() - t, 1)
    del lm
    budget_check(model, out)
    return out


def pick(d: dict, keys) -> dict:
    return {k: d.get(k) for k in keys}


SUMMARY_KEYS = ("needle", "needle_minus_exact", "dnll", "dnll_ci", "dnll_novel", "dnll_novel_ci", "dnll_key",
                "dnll_key_ci", "kl", "top1")


def shared_eval(lm, store, quantized: dict, cfg) -> dict:
    """`ridgefill eval`'s measurements and figures for several int8 maps at once, {key: quantize id} -> {key: (the
    ridgefill arm's figures with their intervals and exact's needle accuracy, eval's per-prompt rows)}.

    Driven as the sweep drives them (evaluate/measure.py with one MapsSource per key): every document and needle
    prompt gets one exact run, which keeps the state entering every split, and each key's fill runs only its late
    layers on it; the needle answers of every key are decoded in one batch. Each key's rows are then eval's rows and
    `evaluate.summary.summarize` gives eval's figures. Not measured: eval's own timed prefills (`speed` times them
    at the speed length). `eval_check` holds this equal to `evaluate()` on a tiny configuration."""
    from dataclasses import replace

    from ridgefill.evaluate.arms import plan
    from ridgefill.evaluate.measure import eval_documents, fills, measure_documents, measure_needles
    from ridgefill.evaluate.run import needle_suite
    from ridgefill.evaluate.source import load_source
    from ridgefill.evaluate.summary import summarize
    from ridgefill.output import Output
    from ridgefill.runtime import maps_on_devices

    out = Output(json_mode=False, quiet=True)
    L = lm.adapter.num_layers
    srcs = {}
    for key, qid in quantized.items():
        src = load_source(store, qid)
        srcs[key] = replace(src, maps=maps_on_devices(lm, src.maps, range(src.split, L)))
    arms = plan(cfg.arms)
    fill_arms = [a for a in arms if a.base != "exact"]
    calibration = frozenset().union(*(src.calibration for src in srcs.values()))
    docs = eval_documents(lm, cfg.doc_tokens, cfg.documents, calibration)
    doc_rows = measure_documents(lm, docs, cfg.doc_tokens, srcs, fill_arms, cfg.tail, cfg.scored, out, seed=cfg.seed,
                                 row=lambda name, n, per: {"name": name, "tokens": n,
                                                           "per": {k: v[0] for k, v in per.items()}})
    first = next(iter(srcs))

    def jobs(run):  # exact once (with the first key), every key's fill arms
        todo = []
        for key, src in srcs.items():
            res, _ = fills(lm, run, src, arms if key == first else fill_arms, cfg.tail, logits_rows=1, seed=cfg.seed)
            todo += [(key, arm, r) for arm, r in res.items()]
        return todo, None

    def needle_row(smp, correct, _):
        return {"task": smp.task, "length": smp.context_tokens, "depth": smp.depth, "seed": smp.seed,
                "answers": smp.answers, "correct": correct}

    suite = needle_suite(lm, cfg)
    needle_rows = measure_needles(lm, suite, sorted({src.split for src in srcs.values()}), jobs, out, row=needle_row)
    res = {}
    for key, src in srcs.items():
        results = {"split": src.split, "num_layers": L, "tail": cfg.tail, "timing": [],
                   "documents": [{"name": d["name"], "tokens": d["tokens"], **d["per"][key]} for d in doc_rows],
                   "needles": [{**{k: v for k, v in n.items() if k != "correct"},
                                "correct": {"exact": n["correct"][first]["exact"], **n["correct"][key]}}
                               for n in needle_rows]}
        s = summarize(results, cfg)
        fig = {"samples": s["samples"], "documents": s["documents"], "exact_needle": s["arms"]["exact"].get("needle"),
               "ridgefill": {k: s["arms"]["ridgefill"].get(k) for k in SUMMARY_KEYS}, "summary": s}
        res[key] = (fig, results)
    return res


def lengths(lm, store, quantized: dict) -> dict:
    """Per key {key: quantize id}, on its capture's held-out rows with the int8 maps: the mean over rows, KV heads and
    late layers of |k_hat| / |k| (the keys written: after the key norm where the model has one; RoPE keeps lengths)
    and of |v_hat| / |v| (and the latter's 99th percentile and maximum over rows and heads), and the values'
    relative squared error. The held-out cosines are blind to a prediction's
    length; attention is not: a value's length scales what its row adds to the output, a key's (without QK-norm) the
    sharpness of its softmax."""
    import numpy as np

    from ridgefill.capture.artifact import load_heldout
    from ridgefill.quantize.artifact import float_maps
    from ridgefill.solve.artifact import load_map_kinds
    from ridgefill.solve.score import Scorer

    L = lm.adapter.num_layers
    held, res = {}, {}
    for (s, kind), qid in quantized.items():
        art = store.get(qid)
        cap, sol = store.upstream(art, "capture"), store.upstream(art, "solve")
        if cap.id not in held:
            held[cap.id] = load_heldout(cap)
        kinds = load_map_kinds(sol)
        sc = Scorer(lm.adapter, held[cap.id], s, L, kinds)
        maps = float_maps(art)
        k_ratio, v_ratio, v_err, v_ref = [], [], 0.0, 0.0
        for l in sc.layers:
            W, b = maps[l]
            y_hat = sc.x @ W.T.astype(np.float64) + b  # [R, d_out]
            k, v = sc._kv_of_prediction(l, y_hat) if kinds[l] == "kv" else sc._kv(l, y_hat)  # [R, kv_heads, hd]
            kt, vt = sc.true_kv[l]
            k_ratio.append(np.linalg.norm(k, axis=-1) / np.maximum(np.linalg.norm(kt, axis=-1), 1e-30))
            v_ratio.append(np.linalg.norm(v, axis=-1) / np.maximum(np.linalg.norm(vt, axis=-1), 1e-30))
            v_err += float(((v - vt) ** 2).sum())
            v_ref += float((vt**2).sum())
        v_all = np.concatenate([r.ravel() for r in v_ratio])
        res[(s, kind)] = {"k_length_ratio": float(np.mean(k_ratio)), "v_length_ratio": float(np.mean(v_ratio)),
                          "v_length_ratio_p99": float(np.quantile(v_all, 0.99)),
                          "v_length_ratio_max": float(v_all.max()),
                          "v_rel_se": v_err / v_ref, "rows": int(sc.x.shape[0])}
    return res


def eval_check(lm, store, model: str, quantized: dict, cfg) -> dict:
    """`shared_eval` against `ridgefill.evaluate.evaluate` (one eval per kind) on a tiny configuration (QUICK_EVAL):
    the ridgefill arm's figures and exact's needle accuracy, per kind, and whether they agree (to 1e-9)."""
    from dataclasses import replace

    from ridgefill.evaluate import evaluate
    from ridgefill.output import Output

    tiny = replace(cfg, **QUICK_EVAL)
    shared = shared_eval(lm, store, quantized, tiny)
    res = {"config": {k: v for k, v in QUICK_EVAL.items()}, "kinds": {}}
    for key, qid in quantized.items():
        art, cached = evaluate(store, model, qid, tiny, Output(json_mode=False, quiet=True))
        s = art.manifest["summary"]
        figures = ("needle", "dnll", "dnll_novel", "dnll_key", "kl", "top1")
        want = {"exact_needle": s["arms"]["exact"].get("needle"), **{k: s["arms"]["ridgefill"].get(k) for k in figures}}
        got = {"exact_needle": shared[key][0]["exact_needle"], **{k: shared[key][0]["ridgefill"][k] for k in want
                                                                  if k != "exact_needle"}}
        same = all((a is None and b is None) or (a is not None and b is not None
                                                  and abs(a - b) <= 1e-9 * max(1, abs(b)))
                   for a, b in ((got[k], want[k]) for k in want))
        res["kinds"][key] = {"evaluate": want, "shared": got, "eval_id": art.id, "eval_cached": cached,
                             "agree": same}
    res["agree"] = all(v["agree"] for v in res["kinds"].values())
    return res


def paired(a: dict, b: dict, cfg) -> dict:
    """kv minus input, paired by prompt: ΔNLL (all, key tokens; token-weighted per document) and needle points per
    sample, with eval's paired bootstrap; and whether both evals measured the same prompts and the same exact arm."""
    import numpy as np

    from ridgefill.numerics import paired_bootstrap

    def boot(x, y, w=None):
        x, y = np.asarray(x, float), np.asarray(y, float)
        if w is not None and not np.sum(w):
            return None
        return paired_bootstrap(x, y, samples=cfg.bootstrap, seed=cfg.seed, weights=w)

    da, db = a["documents"], b["documents"]
    na, nb = a["needles"], b["needles"]
    same = ([d["name"] for d in da] == [d["name"] for d in db]
            and [(n["task"], n["length"], n["depth"], n["seed"]) for n in na]
            == [(n["task"], n["length"], n["depth"], n["seed"]) for n in nb])
    same_exact = [n["correct"]["exact"] for n in na] == [n["correct"]["exact"] for n in nb]
    out = {"same_prompts": same, "same_exact": same_exact}
    if not same:
        return out
    nan = lambda v: np.nan if v is None else v  # noqa: E731
    out["dnll"] = boot([d["ridgefill"]["dnll"] for d in db], [d["ridgefill"]["dnll"] for d in da],
                       [d["ridgefill"]["tokens"] for d in da])
    kw = [d["ridgefill"]["key_tokens"] for d in da]
    out["dnll_key"] = boot([nan(d["ridgefill"]["dnll_key"]) for d in db], [nan(d["ridgefill"]["dnll_key"]) for d in da],
                           kw) if [d["ridgefill"]["key_tokens"] for d in db] == kw else "key tokens differ"
    out["kl"] = boot([d["ridgefill"]["kl"] for d in db], [d["ridgefill"]["kl"] for d in da])
    out["needle"] = boot([100.0 * n["correct"]["ridgefill"] for n in nb],
                         [100.0 * n["correct"]["ridgefill"] for n in na])
    return out


def budget_check(model: str, out: dict) -> None:
    """Each (split, kind): the failed thresholds of the model's gate and of the sweep's budget, and `within`."""
    from ridgefill.evaluate.gate import check_gate, load_gate
    from ridgefill.sweep.config import SweepConfig

    path = REPO / "examples" / "gates" / f"{short(model)}.toml"
    gate = load_gate(path) if path.is_file() else None
    sweep = SweepConfig()
    sweep_gate = {"thresholds": {"needle_drop_max": sweep.max_needle_drop, "dnll_key_max": sweep.max_key_dnll}}
    out["budget"] = {"gate": str(path.relative_to(REPO)) if gate else None,
                     "gate_thresholds": gate["thresholds"] if gate else None,
                     "sweep": sweep_gate["thresholds"]}
    for row in out["splits"].values():
        for kind in KINDS:
            s = row[kind]["eval"]["summary"]
            failed = [f"gate {x}" for x in (check_gate(s, gate) if gate else [])]
            failed += [f"sweep {x}" for x in check_gate(s, sweep_gate)]
            row[kind]["budget"] = {"within": not failed, "failed": failed}


def decide(models: dict) -> dict:
    """The rule, over every (model, split) measured."""
    cases = [(m, s, r["input"]["budget"]["within"], r["kv"]["budget"]["within"])
             for m, res in models.items() for s, r in res["splits"].items()]
    gate = [(m, s, kv) for m, s, inp, kv in cases if inp]
    kv_default = bool(gate) and all(kv for _, _, kv in gate)
    why = (f"input within the budget at {len(gate)} of {len(cases)} measured splits "
           f"({', '.join(f'{short(m)} {s}' for m, s, _ in gate) or 'none'}); kv within at "
           f"{sum(kv for _, _, kv in gate)} of those")
    lost = [f"{short(m)} {s}" for m, s, kv in gate if not kv]
    if lost:
        why += f"; kv over where input is within: {', '.join(lost)}"
    if not gate:
        why += "; with no split where input is within, the rule has nothing to judge: input stays the default"
    return {"kv_default": kv_default, "default": "kv" if kv_default else "input", "why": why,
            "input_within": len(gate), "kv_within": sum(kv for _, _, kv in gate),
            "cases": [{"model": m, "split": int(s), "input_within": i, "kv_within": k} for m, s, i, k in cases]}


# ------------------------------------------------------------------------------------------------ speed


def speed(lm, bench, args, model: str, splits) -> dict:
    """Timed prefills at the speed length: per round exact, then input and kv at each split timed (the first, or
    all with --speed-splits all), after one untimed exact prefill."""
    import torch

    from ridgefill.evaluate import texts
    from ridgefill.runtime import ceiling_speedup, load_release_maps, prefill

    context = lm.context_length() or max(SPEED_LENGTHS)
    n = args.speed_length or max(x for x in SPEED_LENGTHS if x <= context)
    if args.quick:
        n = 1024
    tail = min(args.tail, n // 2)
    doc = texts.long_documents(lm.tokenizer, n, limit=1)[0]
    ids = torch.tensor(doc.ids[:n])
    if args.speed_splits == "first":
        splits = splits[:1]
    rels = {(s, k): load_release_maps(lm, bench.scratch / "releases" / f"{short(model)}-s{s}-{k}")
            for s in splits for k in KINDS}
    arms = [("exact", None), *[(f"{k}@{s}", (s, k)) for s in splits for k in KINDS]]
    times: dict = {a: [] for a, _ in arms}

    def run(key) -> float:
        if key is None:
            return prefill(lm, ids, "exact", split=0, tail=tail, logits_rows=1).seconds
        return prefill(lm, ids, "ridgefill", **{**rels[key].options(), "tail": tail, "logits_rows": 1}).seconds

    warm = round(run(None), 3)  # untimed: the fill code paths ran in the evals of this process already
    print(f"   speed warm-up: exact {warm}s", flush=True)
    loads = []
    for rep in range(args.repeat):
        # The order rotates from round to round (exact first, then second, ...): on a machine whose load drifts
        # within a round, no arm is always the one timed last.
        for name, key in arms[rep % len(arms):] + arms[:rep % len(arms)]:
            times[name].append(run(key))
        loads.append(round(os.getloadavg()[0], 2))
        print(f"   speed round {rep + 1}/{args.repeat} (load {loads[-1]}): "
              + ", ".join(f"{a} {t[-1]:.2f}s" for a, t in times.items()), flush=True)
    med = {a: statistics.median(t) for a, t in times.items()}
    res = {"length": n, "tail": tail, "document": doc.name, "threads": torch.get_num_threads(), "warm_up_s": warm,
           "median_s": {a: round(v, 3) for a, v in med.items()}, "loadavg_after_round": loads,
           "runs_s": {a: [round(x, 3) for x in t] for a, t in times.items()}, "splits": {}}
    for s in splits:
        ceil = ceiling_speedup(n, tail, s, lm.adapter.num_layers)
        at = res["splits"][str(s)] = {"ceiling_speedup": round(ceil, 4)}
        for k in KINDS:
            per_round = [e / x for e, x in zip(times["exact"], times[f"{k}@{s}"])]  # paired within a round
            at[k] = {"speedup": round(med["exact"] / med[f"{k}@{s}"], 3),
                     "share_of_ceiling": round(med["exact"] / med[f"{k}@{s}"] / ceil, 3),
                     "per_round": [round(x, 3) for x in per_round],
                     "per_round_median": round(statistics.median(per_round), 3)}
        at["input_over_kv"] = round(med[f"input@{s}"] / med[f"kv@{s}"], 3)  # how much faster the kv fill ran
    return res


# ------------------------------------------------------------------------------------------------ MACs


def formula(d: int, kv_width: int) -> dict:
    return {"input": d * d + d * kv_width, "kv": d * kv_width}


def count_macs(fn) -> int:
    """Multiply-accumulates of fn() by FlopCounterMode (its FLOPs count 2 per multiply-add)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops() // 2


def filled_kv_macs(lm, l: int, kind: str, maps: dict, rows: int) -> int:
    """MACs per filled row of `_filled_kv` (what late layer l writes for `rows` filled rows), for maps of `kind`."""
    import torch

    from ridgefill.runtime.fill import Fill, _filled_kv

    ad = lm.adapter
    f = Fill(arm="ridgefill", split=l, tail=1, rows=[], keep=1, maps=maps, map_kinds={l: kind})
    x = torch.randn(rows + 1, ad.hidden_size)
    pos = torch.arange(rows)
    return count_macs(lambda: _filled_kv(ad, f, l, x, pos, ad.layer_device(l))) // rows


def model_macs(lm, bench, model: str, s: int) -> dict:
    """Per kind, at the first split: MACs per filled row per layer from `_filled_kv` and from a whole prefill's
    ridgefill - nofill difference (N = 96 rows, tail 16: every prefix row is filled in every late layer), beside the
    formula."""
    import torch

    from ridgefill.evaluate.macs import model_shape, prefill_macs
    from ridgefill.runtime import load_release_maps, prefill

    ad = lm.adapter
    shape = model_shape(ad)
    n, tail = 96, 16
    ids = torch.tensor(lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 20)["input_ids"][:n])
    res = {}
    for kind in KINDS:
        rel = load_release_maps(lm, bench.scratch / "releases" / f"{short(model)}-s{s}-{kind}")
        opts = {**rel.options(), "tail": tail, "logits_rows": 1}
        per_layer = filled_kv_macs(lm, s, kind, rel.maps, MAC_ROWS)
        exact_rows = prefill(lm, ids, "ridgefill", **opts).exact_rows
        filled = n - tail - len(exact_rows)
        with_fill = count_macs(lambda: prefill(lm, ids, "ridgefill", **opts))
        without = count_macs(lambda: prefill(lm, ids, "nofill", **{**opts, "maps": None}))
        whole = (with_fill - without) / (filled * (ad.num_layers - s))
        want = formula(ad.hidden_size, ad.kv_width)[kind]
        # evaluate/macs.py's cost model of the same prefill (the sweep's "MACs / exact"): its maps plus what the
        # filled rows run in the layers (k_proj / v_proj for an input map; its "layers" beyond nofill's, whose query
        # rows are the same), per filled row
        fill_m, none_m = (prefill_macs(shape, n, tail, s, arm, exact_rows=exact_rows, map_kinds=rel.map_kinds)
                          for arm in ("ridgefill", "nofill"))
        cost_model = (fill_m["maps"] + fill_m["layers"] - none_m["layers"]) / (filled * (ad.num_layers - s))
        res[kind] = {"filled_kv": per_layer, "prefill_difference": whole, "formula": want, "d": ad.hidden_size,
                     "kv_width": ad.kv_width, "split": s, "filled_rows": filled, "late_layers": ad.num_layers - s,
                     "matches": per_layer == want and whole == want, "evaluate_macs_py": cost_model,
                     "evaluate_macs_py_matches": cost_model == want}
    return res


def big_macs(hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """MACs per filled row of `_filled_kv` on a random-weight Llama of this attention shape (2 layers, MLP 64,
    vocabulary 256: neither runs for a filled row), per kind, beside the formula."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ridgefill.models.adapters import adapter_for
    from ridgefill.models.load import LoadedModel

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    lm = LoadedModel(ref=None, model=model, tokenizer=None, adapter=adapter_for(model))
    kv_width = 2 * kv_heads * head_dim
    res = {}
    for kind, rows in (("input", hidden), ("kv", kv_width)):
        maps = {1: (torch.randn(rows, hidden) / hidden**0.5, torch.zeros(rows))}
        got = filled_kv_macs(lm, 1, kind, maps, MAC_ROWS)
        want = formula(hidden, kv_width)[kind]
        res[kind] = {"filled_kv": got, "formula": want, "d": hidden, "kv_width": kv_width, "matches": got == want}
    del model, lm
    return res


# ------------------------------------------------------------------------------------------------ the table


def table(models: dict, big: dict) -> str:
    """Markdown: one row per (model, split, kind)."""
    def ci(x):
        return "–" if not isinstance(x, dict) else f"[{x['low']:+.3f}, {x['high']:+.3f}]"

    def timed(spd, at):
        return "not timed" if spd is None else \
            f"{spd['speedup']:.2f} ({spd['share_of_ceiling']:.2f} of {at['ceiling_speedup']:.2f})"

    def num(x, f="{:.3f}"):
        return "–" if x is None else f.format(x)

    lines = ["| model | split | kind | K/V cos float | K/V cos int8 | K/V length | ΔNLL all | ΔNLL key [CI] | KL | "
             "top-1 | needle (exact) [drop CI] | speed-up (share) | int8 bytes | params/layer | "
             "MACs/row code (formula) | budget |",
             "|---|---:|---|---|---|---|---:|---|---:|---:|---|---|---:|---:|---|---|"]
    for m, res in models.items():
        sp = res["speed"]
        for s, row in res["splits"].items():
            for kind in KINDS:
                r, e = row[kind], row[kind]["eval"]["ridgefill"]
                mac = res["macs"].get(kind, {})
                spd = sp["splits"].get(s, {}).get(kind)
                lines.append(
                    f"| {short(m)} | {s} | {kind} | {r['float']['k_cosine']:.4f}/{r['float']['v_cosine']:.4f} | "
                    f"{r['int8']['k_cosine']:.4f}/{r['int8']['v_cosine']:.4f} | "
                    f"{r['lengths']['k_length_ratio']:.3f}/{r['lengths']['v_length_ratio']:.3f} (v max "
                    f"{r['lengths']['v_length_ratio_max']:.1f}) | {num(e['dnll'])} | "
                    f"{num(e['dnll_key'])} {ci(e.get('dnll_key_ci'))} | {num(e['kl'])} | {num(e['top1'])} | "
                    f"{num(e['needle'], '{:.1f}')} ({num(row[kind]['eval']['exact_needle'], '{:.1f}')}) "
                    f"{ci(e.get('needle_minus_exact'))} | {timed(spd, sp['splits'].get(s))} | "
                    f"{r['maps_safetensors_bytes']:,} | "
                    f"{r['params_per_layer'][0]:,} | {mac.get('filled_kv', 0):,} ({mac.get('formula', 0):,}) | "
                    f"{'within' if r['budget']['within'] else 'over: ' + '; '.join(r['budget']['failed'])} |")
            p = row["paired"]
            lines.append(f"| {short(m)} | {s} | kv − input | | | | {ci(p.get('dnll'))} | {ci(p.get('dnll_key'))} | "
                         f"{ci(p.get('kl'))} | | {ci(p.get('needle'))} | | | | | |")
    for name, res in big.items():
        lines.append(f"| {name} (random) | | input / kv | | | | | | | | | | | | "
                     f"{res['input']['filled_kv']:,} ({res['input']['formula']:,}) / "
                     f"{res['kv']['filled_kv']:,} ({res['kv']['formula']:,}) | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
