"""The fill in vLLM in bfloat16 against the reference fill, on prose and code prompts (figure "vllm_agreement").

    .venv/bin/python bench/vllm_agreement.py RELEASE [--model builtin:qwen2.5-coder-1.5b] [--prompts 20]
        [--length 4096] [--new 16] [--engine-dtype bfloat16] [--reference-dtype float32] [--tp 1]
        [--threads 0] [--out FILE]

Needs the vLLM environment (scripts/setup-engines.sh vllm, which installs the plugin). On `--prompts` prompts of
`--length` tokens, half prose (evaluate.texts.prose_prompts) and half Python source (the first `--length` tokens of
the standard library's long modules that the calibration corpus leaves out):

1. the references, in ridgefill's runtime with the model in `--reference-dtype`: the release's fill of the whole
   prompt (its arm and options, as the release describes it) and the exact model, each with its greedy answer of
   `--new` tokens and its own top-2 log-probability margin at every position (tests/engine_refs.py, the engine
   tests' code);
2. vLLM's offline engine (ridgefill.engines.vllm.plugin_runner) in `--engine-dtype` with `--tp` ranks, chunked
   prefill, the prompts one after another: with RIDGEFILL_RELEASE (the fill) and without it (stock);
3. the distances (engine_refs.distance): first token and greedy answer equal, the first-token margin's and every
   step's margin's absolute difference (mean, max; the steps up to each answer's first difference); for the fill
   against the reference fill, stock against the exact reference, and the fill against the exact reference (for
   scale).

The rule (the engine tests' bfloat16 rule): the fill is no further from its reference than stock is from its own,
on greedy answers (as many equal, less one: a near-tie may part either way) and on the mean margin difference over
every generated token (at most 1.5x stock's). With `--engine-dtype float32` (same dtype both sides) the rule is the
float32 one instead: every first token equal and its margin within 1e-3 nats, every greedy answer equal except at
near-ties (the reference's own margin below 0.05 nats). Value: the rule's verdict and the figures it reads.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Bench, Parser, engine_model, env_threads, positive, release  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from engine_refs import agreement, distance, reference  # noqa: E402

VLLM = REPO / ".engines" / "vllm"
RUNNER = "ridgefill.engines.vllm.plugin_runner"
MARGIN_TOL = 1e-3  # nats, float32 on both sides (the engine tests' tolerance)


def arguments():
    ap = Parser(__doc__)
    ap.add_argument("release", type=release)
    ap.add_argument("--model", default="builtin:qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=positive, default=20)
    ap.add_argument("--length", type=positive, default=4096)
    ap.add_argument("--new", type=positive, default=16)
    ap.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reference-dtype", default="float32", choices=("bfloat16", "float32"))
    ap.add_argument("--tp", type=positive, default=1, help="vLLM's tensor_parallel_size")
    ap.add_argument("--chunk", type=positive, default=2048, help="vLLM's max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--store", type=Path, default=None, help="ridgefill store (default: a fresh temporary one)")
    ap.add_argument("--out", type=Path, default=None)
    ap.set_defaults(threads=0)
    args = ap.parse_args()
    if not (VLLM / ".done").is_file():
        ap.error("the vLLM environment is not built: run scripts/setup-engines.sh vllm")
    return args


def prompts_of(tok, n: int, length: int, calibration) -> dict[str, list[int]]:
    """n // 2 prose prompts (p0, p1, ...) and n - n // 2 code prompts (c0, ...) of `length` token ids."""
    from ridgefill.evaluate import texts

    prose = texts.prose_prompts(tok, length, n // 2)
    code = texts.long_documents(tok, length, kind="code", limit=n - n // 2)
    if len(code) < n - n // 2:
        raise SystemExit(f"vllm_agreement: only {len(code)} standard-library modules have {length} tokens")
    reused = texts.reused([(d.name, d.text) for d in code], calibration)
    if reused:
        raise SystemExit(f"vllm_agreement: used for calibration: {', '.join(reused)}")
    return {**{f"p{i}": list(p) for i, p in enumerate(prose)}, **{f"c{i}": d.ids[:length] for i, d in enumerate(code)}}


def run_engine(bench, name: str, folder: Path, prompts: dict, args, release_dir: Path | None) -> dict:
    spec, out = bench.scratch / f"jobs-{name}.json", bench.scratch / f"results-{name}.json"
    engine = {"dtype": args.engine_dtype, "max_model_len": args.length + args.new + 16, "max_num_seqs": 1,
              "enable_prefix_caching": False, "enable_chunked_prefill": True,
              "max_num_batched_tokens": args.chunk, "tensor_parallel_size": args.tp}
    run = {"name": name, "engine": engine, "prompts": list(prompts), "max_new": args.new, "submit": "alone"}
    spec.write_text(json.dumps({"model": str(folder), "prompts": prompts, "runs": [run]}))
    env = {k: v for k, v in env_threads(args.threads).items() if k != "RIDGEFILL_RELEASE"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if release_dir is not None:
        env["RIDGEFILL_RELEASE"] = str(release_dir)
    t = time.perf_counter()
    r = subprocess.run([VLLM / "bin" / "python", "-m", RUNNER, spec, out], capture_output=True, text=True, cwd=REPO,
                       env=env)  # fmt: skip
    if r.returncode:
        raise SystemExit(f"vllm_agreement: the {name} engine failed:\n{r.stderr[-4000:]}")
    got = json.loads(out.read_text())["runs"][name]
    got["wall_s"] = round(time.perf_counter() - t, 1)
    return got


def main() -> None:
    args = arguments()
    with Bench("vllm_agreement", args, args.model) as bench:
        from harness import load
        from ridgefill.evaluate.source import load_source
        from ridgefill.artifacts import Store
        from ridgefill.runtime import load_release_maps

        start = time.perf_counter()
        walls = {}
        _, lm = load(args.model, bench.store, dtype=args.reference_dtype)
        rel = load_release_maps(lm, args.release)
        calibration = load_source(Store(bench.store), str(args.release)).calibration
        prompts = prompts_of(lm.tokenizer, args.prompts, args.length, calibration)
        t = time.perf_counter()
        refs = {}
        for name, ids in prompts.items():
            refs[name] = {"fill": reference(lm, ids, rel.arm, args.new, **rel.options()),
                          "exact": reference(lm, ids, "exact", args.new, split=0, tail=args.length)}
            print(f"reference {name}: {time.perf_counter() - t:.0f} s", flush=True)
        walls["references"] = round(time.perf_counter() - t, 1)
        del lm, rel
        gc.collect()
        folder = engine_model(bench, args.model, args.engine_dtype)
        fill = run_engine(bench, "fill", folder, prompts, args, args.release)
        stock = run_engine(bench, "stock", folder, prompts, args, None)
        walls |= {"engine_fill": fill["wall_s"], "engine_stock": stock["wall_s"]}
        fill_refs = {n: r["fill"] for n, r in refs.items()}
        exact_refs = {n: r["exact"] for n, r in refs.items()}
        fig = {"fill_vs_reference_fill": distance(fill["outputs"], fill_refs),
               "stock_vs_reference_exact": distance(stock["outputs"], exact_refs),
               "fill_vs_reference_exact": distance(fill["outputs"], exact_refs),
               "fill_agreement": agreement(fill["outputs"], fill_refs)}
        ours, theirs = fig["fill_vs_reference_fill"], fig["stock_vs_reference_exact"]
        if args.engine_dtype == args.reference_dtype == "float32":
            a = fig["fill_agreement"]
            rule = "float32: every first token equal, its margin within 1e-3 nats; greedy equal but at near-ties"
            ok = a["first_token_equal"] == a["prompts"] and a["first_margin_max_diff"] < MARGIN_TOL and not a["misses"]
        else:
            rule = ("bfloat16: greedy answers equal to the reference fill's as often as stock's equal the exact "
                    "reference's, less one; mean margin difference at most 1.5x stock's")
            ok = (ours["greedy_equal"] >= theirs["greedy_equal"] - 1
                  and ours["margin_mean_diff"] <= 1.5 * theirs["margin_mean_diff"])
        by_kind = {k: {"fill_vs_reference_fill": distance([o for o in fill["outputs"] if o["prompt"][0] == k],
                                                          fill_refs),
                       "stock_vs_reference_exact": distance([o for o in stock["outputs"] if o["prompt"][0] == k],
                                                            exact_refs)} for k in ("p", "c")}
        details = {"settings": {k: v for k, v in vars(args).items() if k not in ("release", "out", "store")},
                   "release": str(args.release), "prompts": {"prose": args.prompts // 2,
                                                             "code": args.prompts - args.prompts // 2},
                   "rule": rule, "figures": fig, "by_kind": {"prose": by_kind["p"], "code": by_kind["c"]},
                   "engine_stats": fill["stats"], "rank_stats": fill.get("rank_stats"),
                   "walls_s": walls, "wall_s": round(time.perf_counter() - start, 1)}
        value = {"rule_holds": ok, "fill_greedy_equal": ours["greedy_equal"], "stock_greedy_equal":
                 theirs["greedy_equal"], "fill_first_margin_max_diff": round(ours["first_margin_max_diff"], 4),
                 "fill_margin_mean_diff": round(ours["margin_mean_diff"], 4),
                 "stock_margin_mean_diff": round(theirs["margin_mean_diff"], 4)}
        bench.finish(value, details=details, checks={"the rule holds": ok,
                                                     "the fill filled rows": bool((fill["stats"] or {}).get(
                                                         "filled_rows"))})


if __name__ == "__main__":
    main()
