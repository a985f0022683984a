"""Wall and CPU time of `ridgefill sweep` over 8 splits against one default `ridgefill eval` at one split (figure
"sweep").

    .venv/bin/python bench/sweep_bench.py MODEL RELEASE_DIR --capture ID --store DIR [--splits 8-24:2] [--quick]
        [--threads 1] [--out FILE]

Both run in this process, each in a fresh store (nothing is a cache hit) whose models/ links to the bench's model
cache: first `evaluate` with the default settings on RELEASE_DIR, then `sweep` with the default settings (8 splits,
40 needle prompts and 4 documents of 4,096 tokens) given capture ID (hard-linked from the store DIR, which must
hold it with every split swept; the one capture pass is left out, as a release's own capture is). The sweep's time
includes solving and quantizing every split. Value: sweep / eval, wall and CPU. `--splits` sweeps other splits
than the default ones (`ridgefill sweep --splits` syntax); `--quick`: a tiny sweep and eval (one 1024-token length,
two needles, one document), which checks that the bench runs; its ratios mean little.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_bench import QUICK  # noqa: E402
from harness import Bench, parser  # noqa: E402

QUICK_SWEEP = {"length": 1024, "tail": 256, "scored": 128, "samples": 2, "documents": 1, "bootstrap": 200}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("release", type=Path)
    ap.add_argument("--capture", required=True, help="a capture id in --store with every split swept")
    ap.add_argument("--splits", default=None, help="default: the sweep's own (8 over the middle half of the layers)")
    ap.add_argument("--quick", action="store_true", help="a tiny sweep and eval: checks that the bench runs")
    args = ap.parse_args()
    if args.store is None:
        ap.error("--capture needs --store, the store that holds it")

    with Bench("sweep", args, args.model) as bench:
        from dataclasses import asdict, replace

        from ridgefill.artifacts import Store
        from ridgefill.evaluate import EvalConfig, evaluate
        from ridgefill.output import Output
        from ridgefill.sweep.run import SweepConfig, parse_splits, sweep

        eval_cfg = replace(EvalConfig(), **QUICK) if args.quick else EvalConfig()
        sweep_cfg = replace(SweepConfig(), **QUICK_SWEEP) if args.quick else SweepConfig()
        if args.splits:
            sweep_cfg = replace(sweep_cfg, splits=parse_splits(args.splits))
        src = Store(bench.store).get(args.capture, stage="capture").path
        out = Output(json_mode=False, quiet=True)
        runs = {}

        st = Store(bench.fresh_store("eval"))
        t, c = time.perf_counter(), time.process_time()
        evaluate(st, args.model, str(args.release), eval_cfg, out)
        runs["eval"] = {"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2)}
        print(f"eval: {runs['eval']}", flush=True)

        root = bench.fresh_store("sweep")
        shutil.copytree(src, root / "capture" / src.name, copy_function=link_or_copy)
        st = Store(root)
        t, c = time.perf_counter(), time.process_time()
        art, cached = sweep(st, args.model, sweep_cfg, out, capture_ref=args.capture)
        assert not cached
        s = art.manifest["summary"]
        runs["sweep"] = {"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2),
                         "splits": s["splits"], "recommended": s["recommended"]}
        print(f"sweep: {runs['sweep']}", flush=True)
        details = {"release": str(args.release), "capture": args.capture, "eval_config": asdict(eval_cfg),
                   "sweep_config": asdict(sweep_cfg), "runs": runs}
        value = {"wall": round(runs["sweep"]["wall_s"] / runs["eval"]["wall_s"], 3),
                 "cpu": round(runs["sweep"]["cpu_s"] / runs["eval"]["cpu_s"], 3)}
        bench.finish(value, details=details)


def link_or_copy(src, dst) -> None:
    """A hard link (no copy) where the two folders share a file system, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


if __name__ == "__main__":
    main()
