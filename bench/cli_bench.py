"""CLI start-up and a cached recipe re-run (figure 5).

    .venv/bin/python bench/cli_bench.py [--model builtin:smollm2-135m] [--repeat 7] [--out bench/out/cli.json]

1. `ridgefill --help`: wall of the child process, one warm-up run then `--repeat` runs, median (target <= 0.3 s).
2. A recipe re-run with nothing changed: a small recipe of our own in a temporary folder (the model, a data
   folder of 4 documents of 256 tokens, chunk 128, held_out 1, two alphas, quantize on, `[eval] enabled = false`)
   and a fresh store (the dequantized model cache linked in). `ridgefill release RECIPE --store S --json` runs
   once to build everything, then `--rerun` more times; the figure is the median wall of the re-runs, each of
   which must report every stage as cached (so no model is loaded). One thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_STORE, OUT, corpus_for, env_threads, exe, fresh_store, machine, med,  # noqa: E402
                    model_cache, run_measured, write_json)

RECIPE = """\
model = "{model}"
out = "release"

[capture]
data = ["data"]
chunk = 128
held_out = 1
held_out_rows = 64

[solve]
alphas = [0.001, 0.01]

[quantize]
enabled = true

[eval]
enabled = false
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m", help="the recipe's model")
    ap.add_argument("--repeat", type=int, default=7, help="--help runs (after one warm-up)")
    ap.add_argument("--rerun", type=int, default=3, help="re-runs of the unchanged recipe")
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE)
    ap.add_argument("--out", type=Path, default=OUT / "cli.json")
    args = ap.parse_args()

    before = machine()
    env = env_threads(1)
    helps = [run_measured([exe(), "--help"], env=env)["wall_s"] for _ in range(args.repeat + 1)][1:]

    model_cache(args.store, args.model)
    tmp = Path(tempfile.mkdtemp(prefix="rf-cli-"))
    data = corpus_for(args.model, 1024, 256, OUT / "corpora")
    (tmp / "data").mkdir()
    for p in sorted(data.glob("*.txt")):
        (tmp / "data" / p.name).write_text(p.read_text())
    recipe = tmp / "recipe.toml"
    recipe.write_text(RECIPE.format(model=args.model))
    st = fresh_store(tmp / "store", args.store)
    cmd = [exe(), "release", str(recipe), "--store", str(st), "--json"]
    first = run_measured(cmd, env=env)
    first_summary = json.loads(first["stdout"])
    reruns = []
    for _ in range(args.rerun):
        r = run_measured(cmd, env=env)
        s = json.loads(r["stdout"])
        reruns.append({"wall_s": round(r["wall_s"], 3), "peak_rss_mib": round(r["peak_rss_mib"], 1),
                       "all_cached": all(v.get("cached") for v in s["stages"].values()),
                       "stages": s["stages"]})
    result = {
        "model": args.model,
        "help": {"runs_s": [round(x, 3) for x in helps], "median_s": round(med(helps), 3), "target": "<= 0.3 s"},
        "recipe": {"recipe": RECIPE.format(model=args.model), "first_wall_s": round(first["wall_s"], 2),
                   "first_stages": first_summary["stages"], "reruns": reruns,
                   "rerun_median_s": round(med([x["wall_s"] for x in reruns]), 3),
                   "all_cached": all(x["all_cached"] for x in reruns)},
        "machine_before": before, "machine_after": machine(),
    }
    write_json(args.out, result)
    print(f"--help median {result['help']['median_s']} s; recipe re-run median {result['recipe']['rerun_median_s']} s "
          f"(first run {result['recipe']['first_wall_s']} s, all cached: {result['recipe']['all_cached']}); {args.out}")


if __name__ == "__main__":
    main()
