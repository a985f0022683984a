"""Time of the whole alpha grid against one solve (issue 2's figure), written as JSON.

    .venv/bin/python bench/solve_bench.py CAPTURE_ID [--store DIR] [--split S] [--out bench/out/solve.json]

The grid uses one eigendecomposition of Cxx for every alpha (ridgefill.solve.ridge); "one solve" is a plain
linear solve of (Cxx + lambda I) W^T = Cxy for a single alpha, all late layers at once; "direct per alpha" is
that solve repeated for every alpha of the grid. Scoring on held-out
rows is timed separately (it needs the model's K/V projections). The comparison lives here only: `ridgefill solve`
runs the eigen path and no direct solve.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("--store", type=Path, default=Path("ridgefill-artifacts"))
    ap.add_argument("--split", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/out/solve.json"))
    args = ap.parse_args()

    from ridgefill.artifacts import Store
    from ridgefill.capture.artifact import load_stats
    from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose, direct_solve, maps_at
    from ridgefill.capture.artifact import pick_split

    cap = Store(args.store).get(args.capture, stage="capture")
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
    result = {"capture": cap.id, "split": split, "late_layers": k, "d_in": d_in, "d_out": d_out,
              "alphas": len(DEFAULT_ALPHAS), "grid_s": round(grid_s, 4), "one_direct_solve_s": round(one_s, 4),
              "grid_over_one_solve": round(grid_s / one_s, 3), "direct_solve_per_alpha_s": round(all_direct_s, 4),
              "grid_over_direct_per_alpha": round(grid_s / all_direct_s, 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
