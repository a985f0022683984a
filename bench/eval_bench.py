"""Wall and CPU time of a default `ridgefill eval` against an eval of the exact arm alone (figure "eval").

    .venv/bin/python bench/eval_bench.py MODEL RELEASE_DIR [--quick] [--store DIR] [--threads 1] [--out FILE]

Both evals run in this process, one after the other, each in a fresh store (so nothing is a cache hit) whose
models/ links to the bench's model cache, with the same settings but for the arms: the default arms, and `exact`
alone. The ratio default / exact-only says what the fill arms add on top of the exact work every eval has to do
(the exact forwards, the tail-only forwards that find key tokens, decoding, the timed prefills), in wall time and
in the process's CPU time. At one thread the CPU ratio is the one to read when other jobs share the machine: it
hardly moves when their load changes between the two runs, and the wall ratio does. Each run keeps its per-arm
summary (the figures a gate reads). `--quick`: a tiny eval (one 1024-token length, one needle, one document),
which checks that the bench runs; its ratios mean little. Run it with another checkout on PYTHONPATH to measure
that checkout's eval with the same script.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, parser, release  # noqa: E402

QUICK = {"lengths": (1024,), "tail": 256, "scored": 128, "depths": (0.5,), "tasks": ("single",), "samples": 1,
         "documents": 1, "doc_tokens": 1024, "bootstrap": 200}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("release", type=release)
    ap.add_argument("--quick", action="store_true", help="a tiny eval: checks that the bench runs")
    args = ap.parse_args()

    with Bench("eval", args, args.model) as bench:
        from dataclasses import asdict, replace

        from ridgefill.artifacts import Store
        from ridgefill.evaluate import DEFAULT_ARMS, EvalConfig, evaluate
        from ridgefill.output import Output

        base = replace(EvalConfig(), **QUICK) if args.quick else EvalConfig()
        runs = {}
        out = Output(json_mode=False, quiet=True)
        for name, arms in (("exact_only", ("exact",)), ("default", DEFAULT_ARMS)):
            store = Store(bench.fresh_store(name))
            t, c = time.perf_counter(), time.process_time()
            art, cached = evaluate(store, args.model, str(args.release), replace(base, arms=arms), out)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            assert not cached
            runs[name] = {"arms": list(arms), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                          "needles": art.manifest["summary"]["samples"],
                          "documents": art.manifest["summary"]["documents"],
                          "arms_summary": art.manifest["summary"]["arms"]}
            print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        details = {"release": str(args.release), "config": asdict(base), "runs": runs}
        value = {"wall": round(runs["default"]["wall_s"] / runs["exact_only"]["wall_s"], 3),
                 "cpu": round(runs["default"]["cpu_s"] / runs["exact_only"]["cpu_s"], 3)}
        bench.finish(value, details=details)


if __name__ == "__main__":
    main()
