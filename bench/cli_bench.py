"""CLI start-up and a cached recipe re-run (figure "cli").

    .venv/bin/python bench/cli_bench.py [--model builtin:smollm2-135m] [--repeat 7] [--rerun 3] [--out FILE]

1. `ridgefill --help`: wall of the child process, one warm-up run then `--repeat` runs, median (value `help`; its
   target: bench/harness.py's FIGURES).
2. A recipe re-run with nothing changed: a small recipe of our own in a temporary folder (the model, a data
   folder of 4 documents of 256 tokens, chunk 128, held_out 1, two alphas, quantize on, `[eval] enabled = false`)
   and a fresh store (the dequantized model cache linked in). `ridgefill release RECIPE --store S --json` runs
   once to build everything, then `--rerun` more times; value `rerun` is the median wall of the re-runs, each of
   which must report every stage as cached (a check: so no model is loaded). One thread (`--threads`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, corpus_for, env_threads, exe, med, parser, positive, run_measured  # noqa: E402

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
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m", help="the recipe's model")
    ap.add_argument("--repeat", type=positive, default=7, help="--help runs (after one warm-up)")
    ap.add_argument("--rerun", type=positive, default=3, help="re-runs of the unchanged recipe")
    args = ap.parse_args()

    with Bench("cli", args, args.model) as bench:
        env = env_threads(args.threads)
        helps = [run_measured([exe(), "--help"], env=env)["wall_s"] for _ in range(args.repeat + 1)][1:]

        work = bench.scratch / "recipe"
        shutil.copytree(corpus_for(args.model, 1024, 256), work / "data", ignore=shutil.ignore_patterns(".*"))
        recipe = work / "recipe.toml"
        recipe.write_text(RECIPE.format(model=args.model))
        cmd = [exe(), "release", str(recipe), "--store", str(bench.fresh_store("release")), "--json"]
        first = run_measured(cmd, env=env)
        reruns = []
        for _ in range(args.rerun):
            r = run_measured(cmd, env=env)
            s = json.loads(r["stdout"])
            reruns.append({"wall_s": round(r["wall_s"], 3), "peak_rss_mib": round(r["peak_rss_mib"], 1),
                           "all_cached": all(v.get("cached") for v in s["stages"].values()), "stages": s["stages"]})
        details = {"help_runs_s": [round(x, 3) for x in helps], "recipe": RECIPE.format(model=args.model),
                   "first_wall_s": round(first["wall_s"], 2), "first_stages": json.loads(first["stdout"])["stages"],
                   "reruns": reruns}
        value = {"help": round(med(helps), 3), "rerun": round(med([x["wall_s"] for x in reruns]), 3)}
        bench.finish(value, details=details,
                     checks={"every stage cached on a re-run": all(x["all_cached"] for x in reruns)})


if __name__ == "__main__":
    main()
