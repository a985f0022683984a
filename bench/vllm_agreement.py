"""The fill in vLLM in bfloat16 against the reference fill, on prose and code prompts (figure "vllm_agreement").

    .venv/bin/python bench/vllm_agreement.py RELEASE [--model builtin:qwen2.5-coder-1.5b] [--prompts 20]
        [--length 4096] [--new 16] [--engine-dtype bfloat16] [--reference-dtype float32] [--tp 1 [2 ...]]
        [--work FILE] [--threads 0] [--out FILE]

Needs the vLLM environment (scripts/setup-engines.sh vllm, which installs the plugin). On `--prompts` prompts of
`--length` tokens, half prose (evaluate.texts.prose_prompts) and half Python source (the first `--length` tokens of
the standard library's long modules that the calibration corpus leaves out):

1. the references, in ridgefill's runtime with the model in `--reference-dtype`: the release's fill of the whole
   prompt (its arm and options, as the release describes it) and the exact model, each with its greedy answer of
   `--new` tokens and its own top-2 log-probability margin at every position (tests/engine_refs.py, the engine
   tests' code), kept per prompt in `--work` (default bench/out/vllm_agreement-<model>.work.json, keyed by the
   prompt's tokens, begun again when the release or the settings differ): a stopped run resumes;
2. vLLM's offline engine (tests/vllm_plugin_runner.py) in `--engine-dtype` with each `--tp` number of
   ranks, chunked prefill, the prompts one after another: with RIDGEFILL_RELEASE (the fill) and without it (stock);
3. the distances (engine_refs.distance): first token and greedy answer equal, the first-token margin's and every
   step's margin's absolute difference (mean, max; the steps up to each answer's first difference); for the fill
   against the reference fill, stock against the exact reference, and the fill against the exact reference (for
   scale).

The rule (the engine tests' bfloat16 rule): the fill is no further from its reference than stock is from its own,
on greedy answers (as many equal, less one: a near-tie may part either way) and on the mean margin difference over
every generated token (at most 1.5x stock's). With `--engine-dtype float32` (same dtype both sides) the rule is the
float32 one instead: every first token equal and its margin within 1e-3 nats, every greedy answer equal except at
near-ties (the reference's own margin below 0.05 nats). Every `--tp` is held to the rule. Value: the rule's
verdict and the figures it reads (the first `--tp`'s; the others' in the details).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    OUT, REPO, Bench, Parser, Work, digest, engine_model, env_threads, positive, release, short, vllm_ranks_env)

sys.path.insert(0, str(REPO / "tests"))
from engine_refs import agreement, distance, reference  # noqa: E402

VLLM = REPO / ".engines" / "vllm"
RUNNER = REPO / "tests" / "vllm_plugin_runner.py"
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
    ap.add_argument("--tp", type=positive, nargs="+", default=[1], help="vLLM's tensor_parallel_size (each in turn)")
    ap.add_argument("--chunk", type=positive, default=2048, help="vLLM's max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--store", type=Path, default=None, help="ridgefill store (default: a fresh temporary one)")
    ap.add_argument("--work", type=Path, default=None, help="per-prompt references (default under bench/out)")
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


def run_engine(bench, name: str, folder: Path, prompts: dict, args, tp: int, release_dir: Path | None) -> dict:
    spec, out = bench.scratch / f"jobs-{name}.json", bench.scratch / f"results-{name}.json"
    engine = {"dtype": args.engine_dtype, "max_model_len": args.length + args.new + 16, "max_num_seqs": 1,
              "enable_prefix_caching": False, "enable_chunked_prefill": True,
              "max_num_batched_tokens": args.chunk, "tensor_parallel_size": tp}
    run = {"name": name, "engine": engine, "prompts": list(prompts), "max_new": args.new, "submit": "alone"}
    spec.write_text(json.dumps({"model": str(folder), "prompts": prompts, "runs": [run]}))
    env = {k: v for k, v in env_threads(args.threads).items() if k != "RIDGEFILL_RELEASE"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env |= vllm_ranks_env(tp, runner=True)
    if release_dir is not None:
        env["RIDGEFILL_RELEASE"] = str(release_dir)
    t = time.perf_counter()
    r = subprocess.run([VLLM / "bin" / "python", RUNNER, spec, out], capture_output=True, text=True, cwd=REPO,
                       env=env)  # fmt: skip
    if r.returncode:
        raise SystemExit(f"vllm_agreement: the {name} engine failed:\n{r.stderr[-4000:]}")
    got = json.loads(out.read_text())["runs"][name]
    got["wall_s"] = round(time.perf_counter() - t, 1)
    return got


def as_reference(outputs: list) -> dict:
    """An engine's outputs in the shape of references (another engine held against them)."""
    return {o["prompt"]: {"top1": [t for (t, _), _ in o["top2"]], "margin": [a - b for (_, a), (_, b) in o["top2"]]}
            for o in outputs}  # fmt: skip


def verdict(fill: dict, stock: dict, fill_refs: dict, exact_refs: dict, args) -> tuple[bool, dict]:
    """The figures of one engine pair against the references, and whether the rule holds."""
    fig = {"fill_vs_reference_fill": distance(fill["outputs"], fill_refs),
           "stock_vs_reference_exact": distance(stock["outputs"], exact_refs),
           "fill_vs_reference_exact": distance(fill["outputs"], exact_refs),
           "fill_agreement": agreement(fill["outputs"], fill_refs)}  # fmt: skip
    ours, theirs = fig["fill_vs_reference_fill"], fig["stock_vs_reference_exact"]
    if args.engine_dtype == args.reference_dtype == "float32":
        a = fig["fill_agreement"]
        ok = a["first_token_equal"] == a["prompts"] and a["first_margin_max_diff"] < MARGIN_TOL and not a["misses"]
    else:
        ok = (ours["greedy_equal"] >= theirs["greedy_equal"] - 1
              and ours["margin_mean_diff"] <= 1.5 * theirs["margin_mean_diff"])  # fmt: skip
    fig["by_kind"] = {kind: {"fill_vs_reference_fill": distance([o for o in fill["outputs"] if o["prompt"][0] == k],
                                                               fill_refs),
                             "stock_vs_reference_exact": distance([o for o in stock["outputs"]
                                                                   if o["prompt"][0] == k], exact_refs)}
                      for kind, k in (("prose", "p"), ("code", "c"))}  # fmt: skip
    return ok, fig


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
        settings = {"release": (args.release / "ridgefill.json").read_text(), "model": args.model,
                    "dtype": args.reference_dtype, "new": args.new}  # fmt: skip
        work = Work(args.work or OUT / f"vllm_agreement-{short(args.model)}.work.json", settings)
        t = time.perf_counter()
        refs = {}
        for name, ids in prompts.items():
            refs[name] = work.get(digest(ids))
            if refs[name] is None:
                refs[name] = {"fill": reference(lm, ids, rel.arm, args.new, **rel.options()),
                              "exact": reference(lm, ids, "exact", args.new, split=0, tail=args.length)}
                work.put(digest(ids), refs[name])
            print(f"reference {name}: {time.perf_counter() - t:.0f} s", flush=True)
        walls["references"] = round(time.perf_counter() - t, 1)
        del lm, rel
        gc.collect()
        folder = engine_model(bench, args.model, args.engine_dtype)
        fill_refs = {n: r["fill"] for n, r in refs.items()}
        exact_refs = {n: r["exact"] for n, r in refs.items()}
        rule = ("float32: every first token equal, its margin within 1e-3 nats; greedy equal but at near-ties"
                if args.engine_dtype == args.reference_dtype == "float32" else
                "bfloat16: greedy answers equal to the reference fill's as often as stock's equal the exact "
                "reference's, less one; mean margin difference at most 1.5x stock's")  # fmt: skip
        ranks, verdicts, engines = {}, {}, {}
        for tp in args.tp:
            fill = run_engine(bench, f"fill-tp{tp}", folder, prompts, args, tp, args.release)
            stock = run_engine(bench, f"stock-tp{tp}", folder, prompts, args, tp, None)
            engines[tp] = fill, stock
            walls |= {f"engine_fill_tp{tp}": fill["wall_s"], f"engine_stock_tp{tp}": stock["wall_s"]}
            verdicts[tp], ranks[tp] = verdict(fill, stock, fill_refs, exact_refs, args)
            ranks[tp] |= {"rule_holds": verdicts[tp], "engine_stats": fill["stats"],
                          "rank_stats": fill.get("rank_stats")}  # fmt: skip
            if tp != args.tp[0]:
                fill1, stock1 = engines[args.tp[0]]
                ranks[tp][f"against_tp{args.tp[0]}"] = {
                    "fill": distance(fill["outputs"], as_reference(fill1["outputs"])),
                    "stock": distance(stock["outputs"], as_reference(stock1["outputs"]))}
        first = ranks[args.tp[0]]
        ours, theirs = first["fill_vs_reference_fill"], first["stock_vs_reference_exact"]
        details = {"settings": {k: v for k, v in vars(args).items() if k not in ("release", "out", "store", "work")},
                   "release": str(args.release), "prompts": {"prose": args.prompts // 2,
                                                             "code": args.prompts - args.prompts // 2},
                   "rule": rule, "ranks": {str(tp): fig for tp, fig in ranks.items()},
                   "walls_s": walls, "wall_s": round(time.perf_counter() - start, 1)}  # fmt: skip
        value = {"rule_holds": all(verdicts.values()), "fill_greedy_equal": ours["greedy_equal"],
                 "stock_greedy_equal": theirs["greedy_equal"],
                 "fill_first_margin_max_diff": round(ours["first_margin_max_diff"], 4),
                 "fill_margin_mean_diff": round(ours["margin_mean_diff"], 4),
                 "stock_margin_mean_diff": round(theirs["margin_mean_diff"], 4)}  # fmt: skip
        checks = {f"the rule holds with {tp} rank{'s' * (tp > 1)}": ok for tp, ok in verdicts.items()}
        checks |= {f"the fill filled rows with {tp} rank{'s' * (tp > 1)}": bool((ranks[tp]["engine_stats"] or {})
                                                                               .get("filled_rows"))
                   for tp in args.tp}  # fmt: skip
        bench.finish(value, details=details, checks=checks)


if __name__ == "__main__":
    main()
