"""Prefill wall time per fill arm against exact and the ceiling (figure "prefill").

    .venv/bin/python bench/prefill_bench.py MODEL RELEASE_DIR [--lengths 2048 4096] [--tail 512] [--repeat 3]
        [--arms exact ridgefill identity nofill ridgefill+rows] [--store DIR] [--out FILE]

The prompt is real text (the eval's long documents, never used for calibration), cut to each length. Arms run
interleaved (exact, ridgefill, ..., then again), so slow spells of a shared machine hit every arm alike; each
time is the median of `--repeat` runs after one warm-up round. Speed-up = exact median / arm median; the ceiling
is 1 / r with r = (S(N-T) + LT) / (LN) (`ridgefill.runtime.ceiling`). Value: each arm's speed-up and the ceiling
at the longest length; the details have every length.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, load, parser, positive, release  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("release", type=release)
    ap.add_argument("--lengths", type=positive, nargs="+", default=[2048, 4096])
    ap.add_argument("--tail", type=positive, default=512)
    ap.add_argument("--repeat", type=positive, default=3)
    ap.add_argument("--arms", nargs="+", default=["exact", "ridgefill", "identity", "nofill", "ridgefill+rows"])
    args = ap.parse_args()
    if "exact" not in args.arms:
        ap.error("--arms must include exact: every speed-up is measured against it")
    if args.tail >= min(args.lengths):
        ap.error(f"--tail ({args.tail}) must be shorter than every length")

    with Bench("prefill", args, args.model) as bench:
        import torch

        from ridgefill.artifacts import Store
        from ridgefill.evaluate import texts
        from ridgefill.evaluate.source import load_source
        from ridgefill.runtime import ceiling, prefill

        src = load_source(Store(bench.store), str(args.release))
        ref, lm = load(args.model, bench.store)
        doc = texts.long_documents(lm.tokenizer, max(args.lengths), limit=1)[0]
        lengths = {}
        for n in args.lengths:
            ids = torch.tensor(doc.ids[:n])
            times: dict[str, list[float]] = {a: [] for a in args.arms}
            for rep in range(args.repeat + 1):  # round 0 warms up
                for arm in args.arms:
                    s = prefill(lm, ids, arm, split=src.split, tail=args.tail,
                                maps=src.maps if arm.startswith("ridgefill") else None).seconds
                    if rep:
                        times[arm].append(s)
            med = {a: statistics.median(t) for a, t in times.items()}
            lengths[str(n)] = {
                "ceiling_speedup": round(1 / ceiling(n, args.tail, src.split, ref.num_layers), 3),
                "median_s": {a: round(v, 3) for a, v in med.items()},
                "speedup": {a: round(med["exact"] / v, 3) for a, v in med.items() if a != "exact"},
                "runs_s": {a: [round(x, 3) for x in t] for a, t in times.items()},
            }
            print(f"{n}: {lengths[str(n)]['speedup']}", flush=True)
        longest = lengths[str(max(args.lengths))]
        details = {"release": str(args.release), "split": src.split, "layers": ref.num_layers, "tail": args.tail,
                   "repeat": args.repeat, "threads": torch.get_num_threads(), "document": doc.name, "lengths": lengths}
        bench.finish({**longest["speedup"], "ceiling": longest["ceiling_speedup"]}, details=details)


if __name__ == "__main__":
    main()
