"""Wall and CPU time of the adaptive `ridgefill sweep` and of the exhaustive one (`--exhaustive`), each against one
default `ridgefill eval` at one split, and whether the two recommend the same (split, configuration) (figure
"sweep").

    .venv/bin/python bench/sweep_bench.py MODEL RELEASE_DIR --capture ID --store DIR [--splits 8-24:2]
        [--no-exhaustive] [--quick] [--threads 1] [--out FILE]

All run in this process, each in a fresh store (nothing is a cache hit) whose models/ links to the bench's model
cache: first `evaluate` with the default settings on RELEASE_DIR, then the adaptive `sweep` with the default
settings (8 splits, at most 48 needle prompts in rounds of eval's kinds, and 4 documents of 4,096 tokens), then the
exhaustive one, each given capture ID (hard-linked from the store DIR, which must hold it with every split swept;
the one capture pass is left out, as a release's own capture is). A sweep's time includes solving and quantizing
every split. Value: adaptive / eval and exhaustive / eval, wall and CPU, with `agree` (the same recommended split,
configuration and tail). `--splits` sweeps other splits than the default ones (`ridgefill sweep --splits` syntax);
`--no-exhaustive` skips the exhaustive sweep (hours on one CPU thread); `--quick`: a tiny sweep and eval (one
1024-token length, a few needles, one document), which checks that the bench runs; its ratios mean little.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_bench import QUICK  # noqa: E402
from harness import Bench, parser, release  # noqa: E402

QUICK_SWEEP = {"length": 1024, "long_length": 0, "tail": 256, "scored": 128, "needles": 8, "documents": 1,
               "bootstrap": 200}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("release", type=release)
    ap.add_argument("--capture", required=True, help="a capture id in --store with every split swept")
    ap.add_argument("--splits", default=None, help="default: the sweep's own (8 over the middle half of the layers)")
    ap.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive sweep")
    ap.add_argument("--quick", action="store_true", help="a tiny sweep and eval: checks that the bench runs")
    args = ap.parse_args()
    if args.store is None:
        ap.error("--capture needs --store, the store that holds it")

    with Bench("sweep", args, args.model) as bench:
        from dataclasses import asdict, replace

        from ridgefill.artifacts import Store
        from ridgefill.evaluate import EvalConfig, evaluate
        from ridgefill.output import Output
        from ridgefill.sweep import SweepConfig, sweep

        eval_cfg = replace(EvalConfig(), **QUICK) if args.quick else EvalConfig()
        sweep_cfg = replace(SweepConfig(), **QUICK_SWEEP) if args.quick else SweepConfig()
        if args.splits:
            sweep_cfg = replace(sweep_cfg, splits=args.splits)
        src = Store(bench.store).get(args.capture, stage="capture").path
        out = Output(json_mode=False, quiet=True)
        runs = {}

        st = Store(bench.fresh_store("eval"))
        t, c = time.perf_counter(), time.process_time()
        evaluate(st, args.model, str(args.release), eval_cfg, out)
        runs["eval"] = {"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2)}
        print(f"eval: {runs['eval']}", flush=True)

        modes = ("adaptive",) if args.no_exhaustive else ("adaptive", "exhaustive")
        for mode in modes:
            root = bench.fresh_store(f"sweep-{mode}")
            shutil.copytree(src, root / "capture" / src.name, copy_function=link_or_copy)
            st = Store(root)
            t, c = time.perf_counter(), time.process_time()
            art, cached = sweep(st, args.model, replace(sweep_cfg, exhaustive=mode == "exhaustive"), out,
                                capture_ref=args.capture)
            assert not cached
            s = art.manifest["summary"]
            runs[mode] = {"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2),
                          "id": art.id, "splits": s["splits"], "recommended": s["recommended"],
                          "configuration": s["configuration"], "tail": s["tail"], "reason": s["reason"],
                          "identity_edge": s["identity_edge"], "advantage": s["advantage"],
                          "needle_prompts": sum(s["needle_prompts"].values())}
            print(f"{mode} sweep: {runs[mode]}", flush=True)
        details = {"release": str(args.release), "capture": args.capture, "eval_config": asdict(eval_cfg),
                   "sweep_config": asdict(sweep_cfg), "runs": runs}
        value = {f"{m}_{k}": round(runs[m][f"{k}_s"] / runs["eval"][f"{k}_s"], 3) for m in modes for k in ("wall", "cpu")}
        if "exhaustive" in runs:
            value["agree"] = all(runs["adaptive"][k] == runs["exhaustive"][k]
                                 for k in ("recommended", "configuration", "tail"))
        bench.finish(value, details=details)


def link_or_copy(src, dst) -> None:
    """A hard link (no copy) where the two folders share a file system, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


if __name__ == "__main__":
    main()
