"""Chunked prefill against one-shot: statistics of one long document fed in chunks through the KV cache vs in one
forward, on a real model.

    .venv/bin/python bench/chunk_check.py --model builtin:gemma3-270m --tokens 16384 --chunk 1024

The document is the built-in corpus' Python sources joined until `--tokens` tokens (Gemma 3 270M's context is
32K; SmolLM2's 8K, so give it `--tokens 8192`). Both passes use capture's own code (`document_chunks`,
`chunk_moments`), first-row skip included; the products run in float64 here so that the figure measures the
forward alone (`--product-dtype float32` measures both together). Writes the relative Frobenius error of each
statistic, per split, to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:gemma3-270m")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--split", type=int, default=None, help="default: the model's default split")
    ap.add_argument("--product-dtype", default="float64", choices=("float32", "float64"))
    ap.add_argument("--store", default="ridgefill-artifacts")
    ap.add_argument("--out", default="bench/out/chunk_check.json")
    args = ap.parse_args()

    import torch

    from ridgefill.capture.corpus import builtin_sources
    from ridgefill.capture.forward import chunk_moments, document_chunks, exact_float32
    from ridgefill.capture.stats import Moments, merge_into
    from ridgefill.models import load_model, resolve_model

    ref = resolve_model(args.model, store_root=Path(args.store))
    lm = load_model(ref, store_root=Path(args.store))
    split = args.split or ref.default_split
    code = [p for p in builtin_sources() if p.suffix == ".py"]
    ids: list[int] = []
    for p in code:
        ids += lm.tokenizer(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=not ids)["input_ids"]
        if len(ids) >= args.tokens:
            break
    ids = np.asarray(ids[: args.tokens], dtype=np.int32)
    layers = list(range(split, ref.num_layers))

    def stats(chunk: int) -> tuple[Moments, float]:
        total = Moments.empty(ref.num_layers - split, ref.hidden_size, ref.hidden_size)
        t = time.perf_counter()
        with exact_float32():
            for start, hs in document_chunks(lm, ids, layers, chunk, "cpu"):
                skip = 1 if start == 0 else 0
                m = chunk_moments(hs[split][skip:], [hs[l][skip:] for l in layers], args.product_dtype)
                total = merge_into(total, m)
        return total, time.perf_counter() - t

    one, t_one = stats(len(ids))
    chunked, t_chunked = stats(args.chunk)
    fields = ("mean_x", "cxx", "mean_y", "cxy", "yy")
    rel = {f: float(np.linalg.norm(getattr(chunked, f) - getattr(one, f)) / np.linalg.norm(getattr(one, f)))
           for f in fields}
    result = {
        "model": args.model, "tokens": int(len(ids)), "chunk": args.chunk, "split": split,
        "product_dtype": args.product_dtype, "model_dtype": str(lm.adapter.dtype).removeprefix("torch."),
        "rows": int(one.n), "relative_error": rel, "max_relative_error": max(rel.values()),
        "one_shot_s": round(t_one, 2), "chunked_s": round(t_chunked, 2), "threads": torch.get_num_threads(),
        "load": os.getloadavg()[0],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    json.dump(result, sys.stdout, indent=2, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
