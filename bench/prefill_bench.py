"""Prefill wall time per fill arm against exact and the ceiling r (issue 3's speed figure), written as JSON.

    .venv/bin/python bench/prefill_bench.py MODEL RELEASE_DIR [--lengths 2048 4096] [--tail 512] [--repeat 3]
        [--arms exact ridgefill identity nofill ridgefill+rows] [--out bench/out/prefill.json]

The prompt is real text (the eval's long documents, never used for calibration), cut to each length. Arms run
interleaved (exact, ridgefill, ..., then again), so slow spells of a shared machine hit every arm alike; each
figure is the median of `--repeat` runs after one warm-up round. Speed-up = exact median / arm median; the
ceiling is 1 / r with r = (S(N-T) + LT) / (LN).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("release", type=Path)
    ap.add_argument("--store", type=Path, default=Path("ridgefill-artifacts"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=["exact", "ridgefill", "identity", "nofill", "ridgefill+rows"])
    ap.add_argument("--out", type=Path, default=Path("bench/out/prefill.json"))
    args = ap.parse_args()

    import torch

    from ridgefill.artifacts import Store
    from ridgefill.evaluate import texts
    from ridgefill.evaluate.source import load_source
    from ridgefill.runtime import ceiling, prefill
    from ridgefill.models import load_model, resolve_model

    store = Store(args.store)
    src = load_source(store, str(args.release))
    ref = resolve_model(args.model, store_root=store.root)
    lm = load_model(ref, store_root=store.root)
    doc = texts.long_documents(lm.tokenizer, max(args.lengths), limit=1)[0]
    result = {"model": args.model, "split": src.split, "layers": ref.num_layers, "tail": args.tail,
              "threads": torch.get_num_threads(), "document": doc.name, "lengths": {}}
    for n in args.lengths:
        ids = torch.tensor(doc.ids[:n])
        times: dict[str, list[float]] = {a: [] for a in args.arms}
        for rep in range(args.repeat + 1):  # round 0 warms up
            for arm in args.arms:
                s = prefill(lm, ids, arm, split=src.split, tail=args.tail, maps=src.maps if "ridgefill" in arm else None).seconds
                if rep:
                    times[arm].append(s)
        med = {a: statistics.median(t) for a, t in times.items()}
        r = ceiling(n, args.tail, src.split, ref.num_layers)
        result["lengths"][str(n)] = {
            "ceiling_speedup": round(1 / r, 3),
            "median_s": {a: round(v, 3) for a, v in med.items()},
            "speedup": {a: round(med["exact"] / v, 3) for a, v in med.items() if a != "exact"} if "exact" in med else {},
            "runs_s": {a: [round(x, 3) for x in t] for a, t in times.items()},
        }
        print(json.dumps({n: result["lengths"][str(n)]["speedup"]}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
