"""Wall time of a default `ridgefill eval` against an eval of the exact arm alone, written as JSON.

    .venv/bin/python bench/eval_bench.py MODEL RELEASE_DIR [--store bench/out/store] [--threads 1]
        [--out bench/out/eval.json]

Both evals run in this process, one after the other, each in a fresh store (so nothing is a cache hit) whose
models/ links to the bench store's model cache, with the same settings but for the arms: the default arms, and
`exact` alone. The ratio default / exact-only says what the fill arms add on top of the exact work every eval has
to do (the exact forwards, the tail-only forwards that find key tokens, decoding, the timed prefills), in wall time
and in the process's CPU time. At one thread the CPU ratio is the one to read when other jobs share the machine:
it hardly moves when their load changes between the two runs, and the wall ratio does. Each run keeps its per-arm
summary (the figures a gate reads). Run it with another checkout on PYTHONPATH to measure that checkout's eval with
the same script.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE, help="bench store holding the model cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT / "eval.json")
    args = ap.parse_args()
    set_threads(args.threads)

    import ridgefill
    from ridgefill.artifacts import Store
    from ridgefill.evaluate.run import DEFAULT_ARMS, EvalConfig, evaluate
    from ridgefill.output import Output

    model_cache(args.store, args.model)
    result = {"model": args.model, "release": str(args.release), "ridgefill": str(Path(ridgefill.__file__).parent),
              "machine": machine(), "runs": {}}
    out = Output(json_mode=False, quiet=True)
    for name, arms in (("exact_only", ("exact",)), ("default", DEFAULT_ARMS)):
        with tempfile.TemporaryDirectory(prefix="rf-evalbench-") as tmp:
            store = Store(fresh_store(Path(tmp) / "store", args.store))
            t, c = time.perf_counter(), time.process_time()
            art, cached = evaluate(store, args.model, str(args.release), EvalConfig(arms=arms), out)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            assert not cached
            result["runs"][name] = {"arms": list(arms), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                                    "needles": art.manifest["summary"]["samples"],
                                    "documents": art.manifest["summary"]["documents"],
                                    "arms_summary": art.manifest["summary"]["arms"]}
            print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
            write_json(args.out, result)  # partial results survive an interrupted run
    runs = result["runs"]
    result["ratio_default_over_exact_only"] = round(runs["default"]["wall_s"] / runs["exact_only"]["wall_s"], 3)
    result["cpu_ratio_default_over_exact_only"] = round(runs["default"]["cpu_s"] / runs["exact_only"]["cpu_s"], 3)
    result["machine_after"] = machine()
    write_json(args.out, result)
    print(f"default / exact-only: {result['ratio_default_over_exact_only']} wall, "
          f"{result['cpu_ratio_default_over_exact_only']} CPU")


if __name__ == "__main__":
    main()
