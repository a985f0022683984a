"""The whole bench suite in one command: every figure for both built-in models, bench/out/summary.json and a
markdown table on stdout.

    .venv/bin/python bench/run_all.py                      # the default figures (below)
    .venv/bin/python bench/run_all.py --quick              # tiny sizes: checks that everything runs
    .venv/bin/python bench/run_all.py --models builtin:smollm2-135m --only capture rss
    .venv/bin/python bench/run_all.py --only anchor eval sweep        # the long ones, only when asked for
    .venv/bin/python bench/run_all.py --table-only         # summary.json and the table from bench/out as it is

Every figure of bench/harness.py's FIGURES (which holds their targets) is one script, run here as its own process
(so one model's memory never meets another's) writing bench/out/<figure>-<model>.json in the one schema:

    capture   capture_bench.py   capture tok/s / decoder-stack forward tok/s, same chunks (+ a profile)
    rss       rss_bench.py       peak RSS of capture at 5x the tokens / 1x (+ where the memory goes)
    torchrun  torchrun_bench.py  torchrun 2 processes / 1 process wall, one thread each; byte-identity
    naive     naive_bench.py     dump-everything + lstsq peer vs capture + solve; the maps' agreement
    cli       cli_bench.py       `ridgefill --help` wall; an unchanged recipe re-run (once, the first model)
    chunk     chunk_check.py     one long document in chunks vs one forward: the statistics' error
    solve     solve_bench.py     whole alpha grid vs one direct solve
    prefill   prefill_bench.py   prefill speed-up per fill arm, and the ceiling
    anchor    anchor_check.py    the sink row filled vs run exactly                  (only with --only)
    eval      eval_bench.py      default eval / exact-only eval                      (only with --only)
    sweep     sweep_bench.py     adaptive and exhaustive sweep / one default eval      (only with --only)

engine_ttft and vllm_fill (bench/engine_ttft.py, bench/vllm_serve_bench.py: vLLM's time to first token with injected
caches, and with the fill inside vLLM) need the engine environment and are run by themselves; so is map_kinds
(bench/map_kinds.py: key/value against input maps, with its own captures).

solve, prefill, anchor, eval and sweep need a capture or a release: for each model one is built first with the CLI
(`ridgefill capture` of the bench corpus with one held-out document, then solve, quantize, export) in a temporary
store, outside every timing; with sweep the capture also has the splits it sweeps. Their quality figures (anchor)
are those of that small release: measure a real release with the script itself. Sizes (defaults): 8192 tokens in
documents of 2048 tokens, chunk 1024, the RSS figure at 8192 vs 40960 tokens, the torchrun figure at 16384 tokens,
the chunk figure at 16384 tokens (cut to the model's context); one compute thread per process unless --threads
(see bench/harness.py's set_threads). The dequantized model caches are built first into bench/out/store. --keep
keeps the temporary folder with the fixtures.

Exit code 1 when a script failed, or (without --quick, whose sizes measure nothing) when a figure missed its target.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (BENCH, FIGURES, MODEL_CACHE, MODELS, OUT, Parser, command, corpus_for, env_threads,  # noqa: E402
                     exe, fmt, fresh_store, machine, model_cache, positive, run_measured, short)

DEFAULT = ("capture", "rss", "torchrun", "naive", "cli", "chunk", "solve", "prefill")
NAMES = {"builtin:smollm2-135m": "SmolLM2-135M", "builtin:gemma3-270m": "Gemma-3-270M"}
# run by itself: an engine's environment, a GPU machine, its own captures of a built-in (map_kinds, map_designs,
# capture_dtype), or releases of the 1.5B built-in (long_context, map_ab)
STANDALONE = {"engine_ttft", "vllm_fill", "vllm_agreement", "vllm_fill_profile", "gpu", "map_kinds", "map_designs",
              "capture_dtype", "long_context", "map_ab", "model_load"}
NEEDS_CAPTURE, NEEDS_RELEASE = {"solve", "sweep"}, {"prefill", "anchor", "eval", "sweep"}


def arguments(fig: str, model: str, args, fix: dict) -> list[str]:
    """The script's arguments for `fig` on `model` (`fix`: the model's capture and release, when it needs them)."""
    q = args.quick
    size = ["--tokens", "1024", "--doc-tokens", "512", "--chunk", "256"] if q else [
        "--tokens", str(args.tokens), "--doc-tokens", str(args.doc_tokens), "--chunk", str(args.chunk)]
    release = [model, fix.get("release", ""), "--store", fix.get("store", "")]
    return {
        "capture": ["--model", model, *size, "--repeat", "1" if q else str(args.repeat),
                    "--profile-docs", "1" if q else "2"],
        "rss": ["--model", model, *size, "--factor", "2" if q else "5",
                "--long-doc-tokens", "1024" if q else str(4 * args.doc_tokens), "--old-tokens", "0" if q else "20000"],
        "torchrun": ["--model", model, *size, *([] if q else ["--tokens", str(args.torchrun_tokens)])],
        "naive": ["--model", model, *size, "--alpha", str(args.alpha)],
        "cli": ["--model", model, *(["--repeat", "3", "--rerun", "1"] if q else [])],
        "chunk": ["--model", model, "--tokens", "2048" if q else "16384", "--chunk", "512" if q else str(args.chunk)],
        "solve": [fix.get("capture", ""), "--store", fix.get("store", ""), *(["--repeat", "1"] if q else [])],
        "prefill": [*release, *(["--lengths", "1024", "--tail", "256", "--repeat", "1"] if q else [])],
        "anchor": [*release, *(["--documents", "1", "--doc-tokens", "1024", "--needles", "1", "--length", "1024"]
                               if q else [])],
        "eval": [*release, *(["--quick"] if q else [])],
        "sweep": [*release, "--capture", fix.get("capture", ""), "--splits", ",".join(map(str, fix.get("sweep", []))),
                  *(["--quick"] if q else [])],
    }[fig]


def sweep_splits(model: str, quick: bool) -> list[int]:
    """The splits the sweep figure sweeps: the sweep's own default ones (two of them with --quick)."""
    from ridgefill.sweep.config import default_splits

    splits = list(default_splits(model_cache(MODEL_CACHE, model).num_layers))
    return splits[:2] if quick else splits


def build_fixture(model: str, root: Path, args, with_sweep: bool) -> dict:
    """A capture, its solve at the default split, the quantized maps and their release folder, through the CLI, in
    a fresh store under `root`: {"store", "capture", "release", "sweep"}, or {"error": ...}."""
    ref = model_cache(MODEL_CACHE, model)
    tokens, doc_tokens = (1024, 512) if args.quick else (args.tokens, args.doc_tokens)
    store = fresh_store(root / f"fixture-{short(model)}")
    sweep = sweep_splits(model, args.quick) if with_sweep else []
    splits = sorted({ref.default_split, *sweep})
    env = env_threads(args.threads)
    common = ["--store", str(store), "--json", "--quiet"]
    steps = [("capture", [model, "--data", str(corpus_for(model, tokens, doc_tokens)), "--held-out", "1",
                          "--chunk", str(256 if args.quick else args.chunk),
                          *[a for s in splits for a in ("--split", str(s))]]),
             ("solve", ["{capture}", "--split", str(ref.default_split)]), ("quantize", ["{solve}"]),
             ("export", ["{quantize}", "--out", str(root / f"release-{short(model)}")])]
    ids: dict = {"store": str(store), "sweep": sweep}
    for stage, argv in steps:
        cmd = [exe(), stage, *[a.format(**ids) for a in argv], *common]
        print(f"== fixture {model}: ridgefill {' '.join(cmd[1:])}", flush=True)
        res = run_measured(cmd, env=env, check=False)
        if res["rc"] != 0:
            return {"error": f"ridgefill {stage} failed ({res['rc']}): {res['stderr_tail'][-500:]}"}
        ids[stage] = json.loads(res["stdout"])["id"] if stage != "export" else None
    return {**ids, "release": str(root / f"release-{short(model)}")}


def table(results: list[dict], models: list[str]) -> str:
    """Markdown: a row per figure, a column per model, then the target. ✗ marks a missed target; a failed check is
    named."""
    def cell(r: dict | None) -> str:
        if r is None:
            return "—"
        text = fmt(r["value"]) + (" ✗" if r["passed"] is False else "")
        failed = [k for k, ok in r["checks"].items() if not ok]
        return text + (f" (NOT {', '.join(failed)})" if failed else "")

    by = {(r["figure"], r["model"]): r for r in results}
    lines = ["| figure | " + " | ".join(NAMES.get(m, m) for m in models) + " | target |",
             "|---|" + "---|" * len(models) + "---|"]
    for name, fig in FIGURES.items():
        if any((name, m) in by for m in models):
            cells = " | ".join(cell(by.get((name, m))) for m in models)
            lines.append(f"| {name}: {fig.title} ({fig.unit}) | {cells} | {fig.target or '—'} |")
    return "\n".join(lines)


def main() -> None:
    ap = Parser(__doc__)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    runnable = [f for f in FIGURES if f not in STANDALONE]
    ap.add_argument("--only", nargs="+", default=list(DEFAULT), choices=runnable, metavar="FIGURE",
                    help=f"figures to run, of: {', '.join(runnable)} (default: {' '.join(DEFAULT)})")
    ap.add_argument("--tokens", type=positive, default=8192)
    ap.add_argument("--doc-tokens", type=positive, default=2048)
    ap.add_argument("--chunk", type=positive, default=1024)
    ap.add_argument("--torchrun-tokens", type=positive, default=16384,
                    help="the torchrun figure's corpus (process start and model load are a fixed cost in its wall)")
    ap.add_argument("--repeat", type=positive, default=3, help="interleaved rounds of the throughput figure")
    ap.add_argument("--alpha", type=float, default=1e-3, help="the naive comparison's single alpha")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke test of the suite")
    ap.add_argument("--table-only", action="store_true", help="only rebuild summary.json and the table from bench/out")
    args = ap.parse_args()

    only = [f for f in FIGURES if f in args.only]
    plan = [(f, m) for m in args.models for f in only if f != "cli" or m == args.models[0]]
    start = machine()
    runs, fixtures = [], {}
    root = Path(tempfile.mkdtemp(prefix="rf-bench-all-"))
    try:
        if not args.table_only:
            t = time.perf_counter()
            for m in args.models:
                model_cache(MODEL_CACHE, m)
            runs.append({"step": "model caches", "wall_s": round(time.perf_counter() - t, 1)})
            for fig, m in plan:
                if fig in NEEDS_CAPTURE | NEEDS_RELEASE and m not in fixtures:
                    t = time.perf_counter()
                    fixtures[m] = build_fixture(m, root, args, "sweep" in only)
                    runs.append({"step": f"fixture {m}", "wall_s": round(time.perf_counter() - t, 1),
                                 **({"error": fixtures[m]["error"]} if "error" in fixtures[m] else {})})
                runs.append(run_figure(fig, m, args, fixtures.get(m, {})))
    finally:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    results = [r for r in (read(f, m) for f, m in plan) if r is not None]
    md = table(results, args.models)
    summary = {"command": command(), "quick": args.quick, "machine": start, "machine_after": machine(),
               "runs": runs, "results": results, "table": md}
    from ridgefill.artifacts.store import write_json

    OUT.mkdir(parents=True, exist_ok=True)
    write_json(OUT / "summary.json", summary)
    print()
    print(md)
    failed = [f"{r['figure']} {r['model']}" for r in runs if r.get("rc") or "error" in r]
    missed = [] if args.quick else [f"{r['figure']} {r['model']}" for r in results if r["passed"] is False]
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    if missed:
        print(f"\nmissed the target: {', '.join(missed)}")
    sys.exit(1 if failed or missed else 0)


def out_path(fig: str, model: str) -> Path:
    return OUT / f"{fig}-{short(model)}.json"


def read(fig: str, model: str) -> dict | None:
    p = out_path(fig, model)
    return json.loads(p.read_text()) if p.is_file() else None


def run_figure(fig: str, model: str, args, fix: dict) -> dict:
    """Run one figure's script (its output file removed first, so a failure cannot leave an older result)."""
    if "error" in fix:
        return {"figure": fig, "model": model, "rc": None, "error": "no fixture: " + fix["error"]}
    out = out_path(fig, model)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(BENCH / FIGURES[fig].script), *arguments(fig, model, args, fix), "--out", str(out),
           "--threads", str(args.threads)]
    print(f"== {fig} {model}: {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    rc = subprocess.run(cmd, env=env_threads(args.threads)).returncode
    wall = round(time.perf_counter() - t, 1)
    print(f"== {fig} {model}: rc {rc}, {wall} s", flush=True)
    return {"figure": fig, "model": model, "command": cmd[1:], "rc": rc, "wall_s": wall}


if __name__ == "__main__":
    main()
