"""Wall and CPU time of `ridgefill sweep` over 8 splits against one default `ridgefill eval` at one split, as JSON.

    .venv/bin/python bench/sweep_bench.py MODEL RELEASE_DIR --capture-store STORE --capture ID
        [--store bench/out/store] [--threads 1] [--out bench/out/sweep.json]

Both run in this process, each in a fresh store (nothing is a cache hit) whose models/ links to the bench store's
model cache: first `evaluate` with the default settings on RELEASE_DIR, then `sweep` with the default settings (8
splits, 40 needle prompts and 4 documents of 4,096 tokens) given capture ID (hard-linked from --capture-store,
which must hold it with every default split; the one capture pass is left out, as a release's own capture is). The
sweep's time includes solving and quantizing every split. Ratio: sweep / eval.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_STORE, OUT, fresh_store, machine, model_cache, set_threads, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("release", type=Path)
    ap.add_argument("--capture-store", type=Path, required=True)
    ap.add_argument("--capture", required=True)
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE, help="bench store holding the model cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT / "sweep.json")
    args = ap.parse_args()
    set_threads(args.threads)

    from ridgefill.artifacts import Store
    from ridgefill.evaluate.run import EvalConfig, evaluate
    from ridgefill.sweep.run import SweepConfig, sweep
    from ridgefill.output import Output

    model_cache(args.store, args.model)
    out = Output(json_mode=False, quiet=True)
    result = {"model": args.model, "release": str(args.release), "capture": args.capture, "machine": machine(),
              "runs": {}}
    with tempfile.TemporaryDirectory(prefix="rf-sweepbench-") as tmp:
        st = Store(fresh_store(Path(tmp) / "eval", args.store))
        t, c = time.perf_counter(), time.process_time()
        evaluate(st, args.model, str(args.release), EvalConfig(), out)
        result["runs"]["eval"] = {"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2)}
        print(f"eval: {result['runs']['eval']}", flush=True)
        write_json(args.out, result)

        root = fresh_store(Path(tmp) / "sweep", args.store)
        src = Store(args.capture_store).get(args.capture, stage="capture").path
        shutil.copytree(src, root / "capture" / src.name, copy_function=os.link)  # hard links: no copy
        st = Store(root)
        t, c = time.perf_counter(), time.process_time()
        art, cached = sweep(st, args.model, SweepConfig(), out, capture_ref=args.capture)
        assert not cached
        s = art.manifest["summary"]
        result["runs"]["sweep"] = {"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2),
                                   "splits": s["splits"], "recommended": s["recommended"]}
        print(f"sweep: {result['runs']['sweep']}", flush=True)
    runs = result["runs"]
    result["ratio_sweep_over_eval"] = round(runs["sweep"]["wall_s"] / runs["eval"]["wall_s"], 3)
    result["cpu_ratio_sweep_over_eval"] = round(runs["sweep"]["cpu_s"] / runs["eval"]["cpu_s"], 3)
    result["machine_after"] = machine()
    write_json(args.out, result)
    print(f"sweep / eval: {result['ratio_sweep_over_eval']} wall, {result['cpu_ratio_sweep_over_eval']} CPU")


if __name__ == "__main__":
    main()
