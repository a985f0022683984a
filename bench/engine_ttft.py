"""Time to first token in vLLM on this CPU (figure "engine_ttft"): full prefill, the exact prefix injected, the
RidgeFill prefix injected, side by side in one run.

    .venv/bin/python bench/engine_ttft.py [RELEASE_DIR] [--length 2048] [--tail 512] [--repeat 3] [--out FILE]

Needs the vLLM environment (scripts/setup-engines.sh vllm) and a SmolLM2 release (scripts/main.sh writes
release/smollm2-135m, the default). The prompt is real text (the eval's long documents, never used for
calibration). Per repeat, interleaved: ridgefill computes the exact prefix (the float32 forward over the first
N - T tokens) and the RidgeFill prefix (`engines.prepare.prefix_cache`, the release's fill) in its own process and
times each; then one vLLM process (float32, one sequence, prefix caching off) times a one-token request per arm,
in the same interleaved order, after one warm-up round. Each arm's time to first token is the engine's time plus,
for the injected arms, ridgefill's prefix time: the injected arms only move the prefix's work out of the engine,
so they show what computing it elsewhere costs, not the fill's speed-up inside an engine (docs/engines.md). Value:
median seconds per arm (min and max of the repeats in the details) and each arm's speed-up over full prefill.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Bench, load, vllm_arguments  # noqa: E402

MODEL = "builtin:smollm2-135m"
ARMS = ("full", "exact", "ridgefill")


def main() -> None:
    args, py = vllm_arguments(__doc__)

    with Bench("engine_ttft", args, MODEL) as bench:
        from ridgefill.engines.prepare import prefix_cache
        from ridgefill.evaluate import texts
        from ridgefill.runtime import load_release_maps

        _, lm = load(MODEL, bench.store)
        rel = load_release_maps(lm, args.release)
        opts = {**rel.options(), "tail": args.tail}
        doc = texts.long_documents(lm.tokenizer, args.length, limit=1)[0]
        ids = [int(i) for i in doc.ids[: args.length]]
        prefix_s: dict[str, list[float]] = {"exact": [], "ridgefill": []}
        jobs = []
        for rep in range(args.repeat + 1):  # round 0 warms up
            for arm in ARMS:
                job = {"name": f"{arm}{rep}", "ids": ids, "cache": None, "measure_only": True}
                if arm != "full":
                    ec = prefix_cache(lm, ids, arm, **(opts if arm == "ridgefill" else {"tail": args.tail}))
                    if rep:
                        prefix_s[arm].append(ec.seconds)
                    job |= {"cache": str(ec.save(bench.scratch / f"{arm}{rep}")[0]), "cached": ec.cached}
                jobs.append(job)
        hf = bench.scratch / "model"
        lm.model.save_pretrained(hf)
        spec, out = bench.scratch / "jobs.json", bench.scratch / "results.json"
        spec.write_text(json.dumps({"model": str(hf), "jobs": jobs}))
        r = subprocess.run([py, REPO / "tests" / "vllm_runner.py", spec, out], capture_output=True, text=True,
                           cwd=REPO)  # fmt: skip
        if r.returncode:
            raise SystemExit(f"engine_ttft: the vLLM runner failed:\n{r.stderr[-3000:]}")
        got = {x["name"]: x["seconds"] for x in json.loads(out.read_text())["results"]}
        engine_s = {a: [got[f"{a}{rep}"] for rep in range(1, args.repeat + 1)] for a in ARMS}
        total = {a: [e + (prefix_s[a][i] if a != "full" else 0.0) for i, e in enumerate(engine_s[a])] for a in ARMS}
        med = {a: statistics.median(t) for a, t in total.items()}
        rows = {a: {"ttft_median_s": round(med[a], 3), "ttft_min_s": round(min(total[a]), 3),
                    "ttft_max_s": round(max(total[a]), 3),
                    "engine_median_s": round(statistics.median(engine_s[a]), 3),
                    "prefix_median_s": round(statistics.median(prefix_s[a]), 3) if a != "full" else 0.0,
                    "speedup_vs_full": round(med["full"] / med[a], 3)} for a in ARMS}  # fmt: skip
        for a, row in rows.items():
            print(f"{a:10} ttft {row['ttft_median_s']:.3f} s [{row['ttft_min_s']:.3f}, {row['ttft_max_s']:.3f}] "
                  f"(engine {row['engine_median_s']:.3f} + prefix {row['prefix_median_s']:.3f})", flush=True)
        details = {"release": str(args.release), "split": rel.split, "length": args.length, "tail": args.tail,
                   "cached_positions": args.length - args.tail, "repeat": args.repeat, "document": doc.name,
                   "arms": rows, "runs_engine_s": engine_s, "runs_prefix_s": prefix_s}  # fmt: skip
        bench.finish({a: rows[a]["ttft_median_s"] for a in ARMS}, details=details)


if __name__ == "__main__":
    main()
