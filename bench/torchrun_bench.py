"""torchrun with 2 processes against 1 process, one thread each, same tokens (figure "torchrun"), and byte-identity.

    .venv/bin/python bench/torchrun_bench.py --model builtin:smollm2-135m --tokens 8192 [--doc-tokens 2048] \
        [--chunk 1024] [--repeat 1] [--store DIR] [--out FILE]

Both arms are the same command line through the same launcher, with OMP_NUM_THREADS (and MKL/OpenBLAS) set to
`--threads` (default 1) for every process and a fresh store each (the dequantized model cache linked in):

    python -m torch.distributed.run --standalone --nproc-per-node N -m ridgefill capture MODEL --data CORPUS \
        --chunk 1024 --held-out 1 --held-out-rows 256 --store S --json

N = 1 and N = 2, alternating for `--repeat` rounds; the corpus has equal-length documents so the blocks balance
(bench/harness.py). The figure is median wall(N=2) / median wall(N=1), process start and model load included (its
target: bench/harness.py's FIGURES); the manifests' model_load_s / forward_s (rank 0's) are recorded next to it.
The two artifacts must be the same bytes (a check: the script exits 1 when they are not): the ids, and the sha256
of stats.safetensors, heldout.safetensors.zst, token_counts.safetensors and documents.json are compared and the
result recorded (on a mismatch, the largest difference per statistic; with --repeat 2 or more, whether every run
of either arm gave the same bytes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, corpus_for, env_threads, med, parser, positive, run_measured  # noqa: E402

FILES = ("stats.safetensors", "heldout.safetensors.zst", "token_counts.safetensors", "documents.json")


def stats_differences(a: Path, b: Path) -> dict:
    """Per array of stats.safetensors: equal, or the largest absolute and relative difference."""
    import numpy as np

    from ridgefill.formats import safetensors

    x, _ = safetensors.load(a / "stats.safetensors")
    y, _ = safetensors.load(b / "stats.safetensors")
    out = {}
    for k in sorted(set(x) | set(y)):
        if k not in x or k not in y or x[k].shape != y[k].shape:
            out[k] = "missing or shape differs"
        elif np.array_equal(x[k], y[k]):
            out[k] = "equal"
        else:
            d = float(np.abs(x[k].astype(np.float64) - y[k]).max())
            out[k] = {"max_abs": d, "max_rel": d / float(np.abs(x[k]).max())}
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=positive, default=8192)
    ap.add_argument("--doc-tokens", type=positive, default=2048)
    ap.add_argument("--chunk", type=positive, default=1024)
    ap.add_argument("--procs", type=positive, default=2, help="the many-process arm (the other is 1)")
    ap.add_argument("--repeat", type=positive, default=1)
    args = ap.parse_args()
    if args.procs < 2:
        ap.error(f"--procs must be at least 2 (the other arm is 1), got {args.procs}")

    with Bench("torchrun", args, args.model) as bench:
        from ridgefill.artifacts import Store, sha256_file

        corpus = corpus_for(args.model, args.tokens, args.doc_tokens)
        env = env_threads(args.threads)
        runs: dict[int, list] = {1: [], args.procs: []}
        first: dict[int, Path] = {}  # each arm's first artifact
        hashes: dict[int, dict] = {}
        all_hashes: list[dict] = []
        for r in range(args.repeat):
            for n in ((1, args.procs) if r % 2 == 0 else (args.procs, 1)):
                st = bench.fresh_store(f"store-{n}-{r}")
                res = run_measured([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                    str(n), "-m", "ridgefill", "capture", args.model, "--data", str(corpus), "--chunk",
                                    str(args.chunk), "--held-out", "1", "--held-out-rows", "256", "--store", str(st),
                                    "--json"], env=env)
                doc = json.loads(res["stdout"][res["stdout"].index("{"):])
                found = Store(st).get(doc["id"], stage="capture")
                art, man = found.path, found.manifest
                runs[n].append({"wall_s": round(res["wall_s"], 2), "id": doc["id"],
                                "peak_rss_mib": round(res["peak_rss_mib"], 1),
                                "timings": man.get("timings"), "processes": man.get("summary", {}).get("processes"),
                                "blocks": man.get("summary", {}).get("blocks"),
                                "tokens": man.get("summary", {}).get("calibration_tokens")})
                h = {"id": doc["id"], **{f: sha256_file(art / f) for f in FILES if (art / f).is_file()}}
                first.setdefault(n, art)
                hashes.setdefault(n, h)
                all_hashes.append(h)
                runs[n][-1]["stats_sha256"] = h.get("stats.safetensors", "")[:16]
                print(f"{n} process(es): {runs[n][-1]}", flush=True)
        wall = {n: med([x["wall_s"] for x in v]) for n, v in runs.items()}
        same = hashes[1] == hashes[args.procs]
        details = {
            "corpus": str(corpus), "doc_tokens": args.doc_tokens, "chunk": args.chunk, "procs": args.procs,
            "runs": {str(k): v for k, v in runs.items()}, "median_wall_s": {str(k): v for k, v in wall.items()},
            "hashes": {str(k): v for k, v in hashes.items()},
            "differences": None if same else stats_differences(first[1], first[args.procs]),
            "all_runs_hashes_equal": len({json.dumps(h, sort_keys=True) for h in all_hashes}) == 1,
        }
        bench.finish(round(wall[args.procs] / wall[1], 4), details=details,
                     checks={"statistics byte-identical": same})


if __name__ == "__main__":
    main()
