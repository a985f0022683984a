"""How long one load of a GGUF model takes in bfloat16 from its own bfloat16 cache, against the load every stage of a
bfloat16 chain paid before that cache existed (the float32 cache read and cast), and in float32 (figure
"model_load").

    .venv/bin/python bench/model_load.py [--model builtin:qwen2.5-coder-1.5b] [--rounds 3] [--cold] [--threads 2]
        [--out FILE]

The model's two dequantized caches live in the bench's model cache (bench/out/store/models/; the bfloat16 one is
built here, outside every timing, if missing). Each round loads the model three ways, interleaved: bfloat16 from the
bfloat16 cache (what `load_model` does now), bfloat16 from the float32 cache (what it did before), float32 from the
float32 cache. A load is timed until every weight has been read: transformers maps safetensors files lazily, so each
load then touches one element per memory page of every tensor. `--cold` empties the operating system's page cache
before each load (Linux, as root: what a process meets on a machine that has not read the folder since it booted);
without it, a round reads each folder after the others. Value: the bfloat16 load from its own cache / from the
float32 cache (median wall). Check: both bfloat16 loads hold the same weights, tensor for tensor.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import MODEL_CACHE, Bench, dir_bytes, model_cache, parser, positive  # noqa: E402

WAYS = ("bfloat16 cache", "float32 cache as bfloat16", "float32 cache")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:qwen2.5-coder-1.5b")
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--cold", action="store_true", help="empty the page cache before each load (Linux, root)")
    args = ap.parse_args()
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        raise SystemExit("--cold empties the page cache through /proc/sys/vm/drop_caches: Linux, as root")
    with Bench("model_load", args, args.model) as bench:
        import torch

        from ridgefill.models.load import _from_pretrained, gguf_cache_dir

        ref = model_cache(MODEL_CACHE, args.model)
        if not ref.is_gguf:
            raise SystemExit(f"{args.model} is not a GGUF model: it has no dequantized cache")
        full = gguf_cache_dir(ref, store_root=MODEL_CACHE)[0]
        t = time.perf_counter()
        half, built = gguf_cache_dir(ref, store_root=MODEL_CACHE, dtype="bfloat16")
        build_s = time.perf_counter() - t if built else None
        folders = {WAYS[0]: (half, torch.bfloat16), WAYS[1]: (full, torch.bfloat16), WAYS[2]: (full, torch.float32)}
        seconds: dict = {way: [] for way in WAYS}
        equal = None
        for r in range(args.rounds):
            for way in WAYS:
                source, dtype = folders[way]
                gc.collect()
                if args.cold:
                    os.sync()
                    Path("/proc/sys/vm/drop_caches").write_text("1\n")
                t = time.perf_counter()
                model, _ = _from_pretrained(source, dtype=dtype)
                touch(model)
                seconds[way].append(time.perf_counter() - t)
                if r == 0 and way == WAYS[0]:
                    kept = model.state_dict()
                elif r == 0 and way == WAYS[1]:
                    theirs = model.state_dict()
                    equal = kept.keys() == theirs.keys() and all(torch.equal(kept[k], theirs[k]) for k in theirs)
                    del kept, theirs
                del model
                print(f"round {r + 1}/{args.rounds} {way}: {seconds[way][-1]:.1f} s", file=sys.stderr)
        median = {way: sorted(xs)[len(xs) // 2] for way, xs in seconds.items()}
        value = round(median[WAYS[0]] / median[WAYS[1]], 3)
        details = {
            "rounds": args.rounds,
            "page_cache": "emptied before each load" if args.cold else "as it is",
            "seconds": {way: {"median": round(median[way], 2), "min": round(min(xs), 2), "max": round(max(xs), 2),
                              "all": [round(x, 2) for x in xs]} for way, xs in seconds.items()},
            "cache_bytes": {"bfloat16": dir_bytes(half), "float32": dir_bytes(full)},
            "bfloat16_cache_build_s": None if build_s is None else round(build_s, 1),
        }
        bench.finish(value, details=details, checks={"bfloat16 weights identical": bool(equal)})


def touch(model) -> None:
    """Read one element per 4 KiB page of every weight, so that a lazily mapped file is read whole."""
    for t in [*model.parameters(), *model.buffers()]:
        t.detach().reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()


if __name__ == "__main__":
    main()
