"""The whole bench suite in one command: every figure for both built-in models, a summary JSON, a markdown table.

    .venv/bin/python bench/run_all.py                      # about 25 minutes on 2 shared CPU cores
    .venv/bin/python bench/run_all.py --quick              # tiny sizes: checks that everything runs (~10 min)
    .venv/bin/python bench/run_all.py --models builtin:smollm2-135m --only capture rss

Runs, each as its own process (so one model's memory never meets another's), writing bench/out/<figure>-<model>.json:

    capture_bench.py   capture tok/s / decoder-stack forward tok/s, same chunks (+ a profile)    target >= 0.90
    rss_bench.py       peak RSS of capture at 5x the tokens / 1x (+ where the memory goes)     target <= 1.05
    torchrun_bench.py  torchrun 2 processes / 1 process wall, one thread each; byte-identity  target <= 0.60
    naive_bench.py     dump-everything + lstsq peer vs capture + solve; maps' agreement        target <= 1e-4
    cli_bench.py       `ridgefill --help` wall; an unchanged recipe re-run (once, SmolLM2)      target <= 0.3 s

then bench/out/summary.json (figures, targets, pass/fail, each script's wall, the load average before and after)
and the markdown table on stdout. Sizes (defaults): 8192 tokens in documents of 2048 tokens, chunk 1024, the RSS
figure at 8192 vs 40960 tokens, the torchrun figure at 16384 tokens; every ratio is measured side by side in one run, one compute thread per process
(a 2-core machine shared with other work: two OpenMP threads are slower than one under load, see common.py).
The dequantized model caches are built first into bench/out/store (outside every timing).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH, DEFAULT_STORE, MODELS, OUT, machine, model_cache, short, write_json  # noqa: E402

FIGURES = ("capture", "rss", "torchrun", "naive", "cli")
NAMES = {"builtin:smollm2-135m": "SmolLM2-135M", "builtin:gemma3-270m": "Gemma-3-270M"}


def plan(args) -> list[tuple[str, str | None, list[str]]]:
    """(figure, model, command) in run order."""
    q = args.quick
    size = ["--tokens", str(args.tokens), "--doc-tokens", str(args.doc_tokens), "--chunk", str(args.chunk)]
    if q:
        size = ["--tokens", "1024", "--doc-tokens", "512", "--chunk", "256"]
    py = [sys.executable]
    steps = []
    for m in args.models:
        out = lambda fig: ["--out", str(OUT / f"{fig}-{short(m)}.json")]  # noqa: E731
        per = {
            "capture": [str(BENCH / "capture_bench.py"), "--model", m, *size, "--repeat", "1" if q else str(args.repeat),
                        "--profile-docs", "1" if q else "2", *out("capture")],
            "rss": [str(BENCH / "rss_bench.py"), "--model", m, *size, "--factor", "2" if q else "5",
                    "--long-doc-tokens", "1024" if q else str(4 * args.doc_tokens),
                    "--old-tokens", "0" if q else "20000", *out("rss")],
            "torchrun": [str(BENCH / "torchrun_bench.py"), "--model", m, *size, *out("torchrun"),
                         *([] if q else ["--tokens", str(args.torchrun_tokens)])],
            "naive": [str(BENCH / "naive_bench.py"), "--model", m, *size, "--alpha", str(args.alpha), *out("naive")],
        }
        steps += [(fig, m, py + cmd) for fig, cmd in per.items() if fig in args.only]
    if "cli" in args.only:
        steps.append(("cli", None, py + [str(BENCH / "cli_bench.py"), "--out", str(OUT / "cli.json")]
                      + (["--repeat", "3", "--rerun", "1"] if q else [])))
    return steps


def read(fig: str, model: str | None) -> dict | None:
    p = OUT / ("cli.json" if fig == "cli" else f"{fig}-{short(model)}.json")
    return json.loads(p.read_text()) if p.is_file() else None


def figures(models: list[str]) -> dict:
    """The headline numbers of every JSON there is, per model."""
    out: dict = {}
    for m in models:
        f: dict = {}
        c = read("capture", m)
        if c:
            f["capture_over_stack"] = {"value": c["capture_over_stack"], "capture_tok_s": c["capture_tok_s"],
                                       "stack_tok_s": c["stack_tok_s"], "paired": c["capture_over_stack_paired_median"],
                                       "end_to_end": c["capture_end_to_end_over_stack"],
                                       "profile_stats_share": c.get("profile", {}).get("stats_share"),
                                       "passed": c["capture_over_stack"] >= 0.90}
        r = read("rss", m)
        if r:
            d = r.get("diagnosis_notes", {})
            f["rss_large_over_small"] = {"value": r["large_over_small"], "factor": r["factor"], "small_mib": r["peak_rss_mib"]["small"],
                                         "large_mib": r["peak_rss_mib"]["large"],
                                         "tokens": [r["runs"]["small"][0]["tokens"], r["runs"]["large"][0]["tokens"]],
                                         "anon_peak_large_over_small": d.get("anon_peak_large_over_small"),
                                         "embedding_resident_growth_mib": d.get("embedding_resident_large_minus_small"),
                                         "passed": r["large_over_small"] <= 1.05}
        t = read("torchrun", m)
        if t:
            f["torchrun_ratio"] = {"value": t["ratio"], "walls_s": t["median_wall_s"],
                                   "identical": t["artifacts_identical"],
                                   "passed": t["ratio"] <= 0.60 and t["artifacts_identical"]}
        n = read("naive", m)
        if n:
            f["naive"] = {"wall": n["naive_over_ridgefill"]["wall"], "peak_rss": n["naive_over_ridgefill"]["peak_rss"],
                          "disk": n["naive_over_ridgefill"]["disk"], "ridgefill": n["ridgefill"],
                          "naive_wall_s": n["naive"]["wall_s"], "naive_peak_rss_mib": n["naive"]["peak_rss_mib"],
                          "naive_disk_bytes": n["naive"]["disk_bytes"], "rows_equal": n["rows"]["equal"],
                          "max_w_rel_fro": n["agreement"]["max_w_rel_fro"], "alpha": n["alpha"],
                          "passed": n["agreement"]["passed"] and n["rows"]["equal"]}
        out[m] = f
    c = read("cli", None)
    if c:
        out["cli"] = {"help_median_s": c["help"]["median_s"], "rerun_median_s": c["recipe"]["rerun_median_s"],
                      "first_run_s": c["recipe"]["first_wall_s"], "all_cached": c["recipe"]["all_cached"],
                      "passed": c["help"]["median_s"] <= 0.3 and c["recipe"]["all_cached"]}
    return out


def table(figs: dict, models: list[str]) -> str:
    def cell(m, fn):
        f = figs.get(m, {})
        try:
            return fn(f)
        except (KeyError, TypeError):
            return "—"

    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    rows = [
        ("capture / decoder-stack forward tok/s (same chunks through the KV cache, layers 0..L-2, 1 thread)",
         lambda f: (f"**{f['capture_over_stack']['value']:.2f}** ({f['capture_over_stack']['capture_tok_s']:.0f} vs "
                    f"{f['capture_over_stack']['stack_tok_s']:.0f} tok/s)"), ">= 0.90"),
        ("peak RSS of `ridgefill capture`, 5x vs 1x tokens (equal-length documents, fresh stores, ru_maxrss)",
         lambda f: (f"**x{f['rss_large_over_small']['value']:.3f}** ({f['rss_large_over_small']['small_mib']:.0f} vs "
                    f"{f['rss_large_over_small']['large_mib']:.0f} MiB at {f['rss_large_over_small']['tokens'][0] // 1000}K vs "
                    f"{f['rss_large_over_small']['tokens'][1] // 1000}K tokens; embedding rows mapped in from the model "
                    f"file: {f['rss_large_over_small']['embedding_resident_growth_mib']:+.0f} MiB)"), "<= 1.05"),
        ("torchrun 2 processes / 1 process wall (1 thread each, same tokens)",
         lambda f: (f"**{f['torchrun_ratio']['value']:.2f}** ({f['torchrun_ratio']['walls_s']['2']:.0f} vs "
                    f"{f['torchrun_ratio']['walls_s']['1']:.0f} s); stats "
                    f"{'byte-identical' if f['torchrun_ratio']['identical'] else 'DIFFER'}"), "<= 0.60"),
        ("naive dump + lstsq vs capture + solve: wall / peak RSS / disk",
         lambda f: (f"{f['naive']['naive_wall_s']:.0f} vs {f['naive']['ridgefill']['wall_s']:.0f} s / "
                    f"{f['naive']['naive_peak_rss_mib']:.0f} vs {f['naive']['ridgefill']['peak_rss_mib']:.0f} MiB / "
                    f"{mib(f['naive']['naive_disk_bytes'])} vs {mib(f['naive']['ridgefill']['disk_bytes'])}"), "—"),
        ("maps' agreement, max_l ‖W_naive − W_ridgefill‖_F / ‖W_naive‖_F (same rows, same lambda)",
         lambda f: f"**{f['naive']['max_w_rel_fro']:.1e}**", "<= 1e-4"),
    ]
    head = "| figure | " + " | ".join(NAMES.get(m, m) for m in models) + " | target |"
    lines = [head, "|---|" + "---|" * len(models) + "---|"]
    for name, fn, target in rows:
        lines.append(f"| {name} | " + " | ".join(cell(m, fn) for m in models) + f" | {target} |")
    c = figs.get("cli")
    if c:
        pad = " | ".join(["(model-independent)"] * (len(models) - 1))
        lines.append(f"| `ridgefill --help` wall (median) | **{c['help_median_s']:.2f} s** | {pad} | <= 0.3 s |")
        lines.append(f"| recipe re-run, nothing changed (SmolLM2, every stage a cache hit: "
                     f"{'yes' if c['all_cached'] else 'NO'}) | **{c['rerun_median_s']:.1f} s** "
                     f"(first run {c['first_run_s']:.0f} s) | {pad} | cache hits only |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--only", nargs="+", default=list(FIGURES), choices=FIGURES)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--torchrun-tokens", type=int, default=16384,
                    help="the torchrun figure's corpus (process start and model load are a fixed cost in its wall)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds of the throughput figure")
    ap.add_argument("--alpha", type=float, default=1e-3, help="the naive comparison's single alpha")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke test of the suite")
    ap.add_argument("--table-only", action="store_true", help="only rebuild summary.json and the table from bench/out")
    args = ap.parse_args()

    start = machine()
    runs = []
    if not args.table_only:
        t = time.perf_counter()
        for m in args.models:
            model_cache(DEFAULT_STORE, m)
        runs.append({"step": "model caches", "wall_s": round(time.perf_counter() - t, 1)})
        for fig, m, cmd in plan(args):
            print(f"== {fig} {m or ''}: {' '.join(cmd[1:])}", flush=True)
            stale = Path(cmd[cmd.index("--out") + 1])
            stale.unlink(missing_ok=True)  # a script that fails must not leave an older run's figures in the table
            t = time.perf_counter()
            p = subprocess.run(cmd)
            runs.append({"figure": fig, "model": m, "command": " ".join(cmd[1:]), "rc": p.returncode,
                         "wall_s": round(time.perf_counter() - t, 1)})
            print(f"== {fig} {m or ''}: rc {p.returncode}, {runs[-1]['wall_s']} s", flush=True)
    figs = figures(args.models)
    md = table(figs, args.models)
    summary = {"figures": figs, "runs": runs, "machine_start": start, "machine_end": machine(), "table": md,
               "quick": args.quick, "sizes": {"tokens": args.tokens, "doc_tokens": args.doc_tokens, "chunk": args.chunk,
                                              "rss_factor": 5, "torchrun_tokens": args.torchrun_tokens,
                                              "repeat": args.repeat, "alpha": args.alpha},
               "command": " ".join([Path(sys.executable).name, *sys.argv])}
    write_json(OUT / "summary.json", summary)
    print()
    print(md)
    failed = [r for r in runs if r.get("rc")]
    if failed:
        print(f"\n{len(failed)} script(s) failed: " + ", ".join(f"{r['figure']} {r['model'] or ''}" for r in failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
