"""Time of the whole alpha grid against one solve (figure "solve").

    .venv/bin/python bench/solve_bench.py CAPTURE_ID --store DIR [--split S] [--repeat 3] [--out FILE]

CAPTURE_ID names a capture in the store DIR (make one with `ridgefill capture MODEL --data ... --store DIR`;
bench/run_all.py makes one from the bench corpus). The grid uses one eigendecomposition of Cxx for every alpha
(ridgefill.solve.ridge); "one solve" is a plain linear solve of (Cxx + lambda I) W^T = Cxy for a single alpha, all
late layers at once; "direct per alpha" is that solve repeated for every alpha of the grid; each the best of
`--repeat`. Scoring on held-out rows is not timed (it needs the model's K/V projections). The comparison lives
here only: `ridgefill solve` runs the eigen path and no direct solve.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, parser, positive  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("capture", help="a capture id in --store")
    ap.add_argument("--split", type=positive, default=None)
    ap.add_argument("--repeat", type=positive, default=3)
    args = ap.parse_args()
    if args.store is None:
        ap.error("CAPTURE_ID needs --store, the store that holds it")

    with Bench("solve", args, None) as bench:
        from ridgefill.artifacts import Store
        from ridgefill.capture.artifact import load_stats, pick_split
        from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose, direct_solve, maps_at

        cap = Store(bench.store).get(args.capture, stage="capture")
        bench.model = cap.info["model_spec"]
        split = pick_split(cap, args.split)
        m = load_stats(cap, split)

        def best_of(fn):
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        def grid():
            e = decompose(m)
            for a in DEFAULT_ALPHAS:
                maps_at(e, a)

        grid_s = best_of(grid)
        one_s = best_of(lambda: direct_solve(m, 1e-3))
        all_direct_s = best_of(lambda: [direct_solve(m, a) for a in DEFAULT_ALPHAS])
        k, d_in, d_out = m.cxy.shape
        details = {"capture": cap.id, "split": split, "late_layers": k, "d_in": d_in, "d_out": d_out,
                   "alphas": len(DEFAULT_ALPHAS), "repeat": args.repeat,
                   "direct_solve_per_alpha_s": round(all_direct_s, 4),
                   "grid_over_one_solve": round(grid_s / one_s, 3),
                   "grid_over_direct_per_alpha": round(grid_s / all_direct_s, 3)}
        bench.finish({"grid": round(grid_s, 4), "one_solve": round(one_s, 4)}, details=details)


if __name__ == "__main__":
    main()
