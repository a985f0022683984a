"""torchrun with 2 processes against 1 process, one thread each, same tokens (figure 3), and byte-identity.

    .venv/bin/python bench/torchrun_bench.py --model builtin:smollm2-135m --tokens 8192 [--doc-tokens 2048] \
        [--chunk 1024] [--repeat 1] [--out bench/out/torchrun-smollm2-135m.json]

Both arms are the same command line through the same launcher, with OMP_NUM_THREADS=1 (and MKL/OpenBLAS) for
every process and a fresh store each (the dequantized model cache linked in):

    python -m torch.distributed.run --standalone --nproc-per-node N -m ridgefill capture MODEL --data CORPUS \
        --chunk 1024 --held-out 1 --held-out-rows 256 --store S --json

N = 1 and N = 2, alternating for `--repeat` rounds; the corpus has equal-length documents so the blocks balance
(bench/common.py). The figure is median wall(N=2) / median wall(N=1), process start and model load included
(target <= 0.60); the manifests' model_load_s / forward_s (rank 0's) are recorded next to it. The two artifacts
must be the same bytes: the ids, and the sha256 of stats.safetensors, heldout.safetensors.zst,
token_counts.safetensors and documents.json are compared and the result recorded (on a mismatch, the largest
difference per statistic; with --repeat 2 or more, whether every run of either arm gave the same bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_STORE, OUT, corpus_for, env_threads, fresh_store, machine, med,  # noqa: E402
                    model_cache, run_measured, sha256_of, short, write_json)

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--procs", type=int, default=2, help="the many-process arm (the other is 1)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE)
    ap.add_argument("--out", type=Path, default=None, help="default bench/out/torchrun-<model>.json")
    args = ap.parse_args()
    out_path = args.out or OUT / f"torchrun-{short(args.model)}.json"

    before = machine()
    model_cache(args.store, args.model)
    corpus = corpus_for(args.model, args.tokens, args.doc_tokens, OUT / "corpora")
    tmp = Path(tempfile.mkdtemp(prefix="rf-torchrun-"))
    env = env_threads(1)
    runs: dict[int, list] = {1: [], args.procs: []}
    hashes: dict[int, dict] = {}  # first run of each arm
    all_hashes: list[dict] = []
    for r in range(args.repeat):
        for n in ((1, args.procs) if r % 2 == 0 else (args.procs, 1)):
            st = fresh_store(tmp / f"store-{n}-{r}", args.store)
            res = run_measured([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                str(n), "-m", "ridgefill", "capture", args.model, "--data", str(corpus), "--chunk",
                                str(args.chunk), "--held-out", "1", "--held-out-rows", "256", "--store", str(st),
                                "--json"], env=env)
            doc = json.loads(res["stdout"][res["stdout"].index("{"):])
            art = st / "capture" / doc["id"]
            man = json.loads((art / "artifact.json").read_text())
            runs[n].append({"wall_s": round(res["wall_s"], 2), "id": doc["id"],
                            "peak_rss_mib": round(res["peak_rss_mib"], 1),
                            "timings": man.get("timings"), "processes": man.get("summary", {}).get("processes"),
                            "blocks": man.get("summary", {}).get("blocks"),
                            "tokens": man.get("summary", {}).get("calibration_tokens")})
            h = {"id": doc["id"], **{f: sha256_of(art / f) for f in FILES if (art / f).is_file()}}
            hashes.setdefault(n, h)
            all_hashes.append(h)
            runs[n][-1]["stats_sha256"] = h.get("stats.safetensors", "")[:16]
            print(f"{n} process(es): {runs[n][-1]}", flush=True)
    wall = {n: med([x["wall_s"] for x in v]) for n, v in runs.items()}
    same = hashes[1] == hashes[args.procs]
    differences = None if same else stats_differences(tmp / "store-1-0" / "capture" / hashes[1]["id"],
                                                      tmp / f"store-{args.procs}-0" / "capture" / hashes[args.procs]["id"])
    result = {
        "figure": f"wall of torchrun --nproc-per-node {args.procs} / --nproc-per-node 1 (one thread a process)",
        "model": args.model, "corpus": str(corpus), "doc_tokens": args.doc_tokens, "chunk": args.chunk,
        "procs": args.procs, "runs": {str(k): v for k, v in runs.items()},
        "median_wall_s": {str(k): v for k, v in wall.items()},
        "ratio": round(wall[args.procs] / wall[1], 4), "target": "<= 0.60",
        "artifacts_identical": same, "hashes": {str(k): v for k, v in hashes.items()}, "differences": differences,
        "all_runs_hashes_equal": len({json.dumps(h, sort_keys=True) for h in all_hashes}) == 1,
        "machine_before": before, "machine_after": machine(),
    }
    write_json(out_path, result)
    print(f"{args.model}: {args.procs} procs / 1 proc wall = {result['ratio']}; identical: {same}; {out_path}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
