"""Chunked prefill against one-shot (figure "chunk"): the statistics of one long document fed in chunks through the
KV cache vs in one forward, on a real model.

    .venv/bin/python bench/chunk_check.py --model builtin:gemma3-270m --tokens 16384 --chunk 1024 [--store DIR]
        [--out FILE]

The document is the built-in corpus' Python sources joined until `--tokens` tokens, cut to the model's context
(Gemma 3 270M's is 32K, SmolLM2's 8K). Both passes are capture's own per-chunk step (`document_chunks`, then
`fitted_moments`, which leaves out the first row and the outlier rows, then `merge_into`); the products run in
float64 here so that the figure measures the forward alone (`--product-dtype float32` measures both together).
Value: the largest relative Frobenius error over the statistics; the details have each one. Check: both passes
fitted the same rows (the outlier rule looks at each chunk's rows, so a chunk could in principle decide otherwise
than the whole document).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, load, parser, positive  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:gemma3-270m")
    ap.add_argument("--tokens", type=positive, default=16384)
    ap.add_argument("--chunk", type=positive, default=1024)
    ap.add_argument("--split", type=positive, default=None, help="default: the model's default split")
    ap.add_argument("--product-dtype", default="float64", choices=("float32", "float64"))
    args = ap.parse_args()

    with Bench("chunk", args, args.model) as bench:
        import numpy as np
        import torch

        from ridgefill.capture import CaptureConfig
        from ridgefill.capture.corpus import builtin_sources
        from ridgefill.capture.forward import document_chunks, exact_float32, fitted_moments
        from ridgefill.capture.stats import Moments, merge_into

        ref, lm = load(args.model, bench.store)
        split = args.split or ref.default_split
        if split >= ref.num_layers:
            ap.error(f"--split {split} is out of range: the model has {ref.num_layers} layers")
        tokens = min(args.tokens, lm.context_length() or args.tokens)
        ids: list[int] = []
        for p in (p for p in builtin_sources() if p.suffix == ".py"):
            text = p.read_text(encoding="utf-8", errors="replace")
            ids += lm.tokenizer(text, add_special_tokens=not ids)["input_ids"]  # one BOS, at the start
            if len(ids) >= tokens:
                break
        ids = np.asarray(ids[:tokens], dtype=np.int32)
        layers = list(range(split, ref.num_layers))
        ratio = CaptureConfig().outlier_ratio  # capture's default rule

        def stats(chunk: int) -> tuple[Moments, float]:
            total = Moments.empty(ref.num_layers - split, ref.hidden_size, ref.hidden_size)
            t = time.perf_counter()
            with exact_float32():
                for start, hs in document_chunks(lm, ids, layers, chunk, lm.adapter.device):
                    for m in fitted_moments(hs, start, [split], ref.num_layers, ratio, args.product_dtype).values():
                        total = merge_into(total, m)
            return total, time.perf_counter() - t

        one, t_one = stats(len(ids))
        chunked, t_chunked = stats(args.chunk)
        fields = ("mean_x", "cxx", "mean_y", "cxy", "yy")
        rel = {f: float(np.linalg.norm(getattr(chunked, f) - getattr(one, f)) / np.linalg.norm(getattr(one, f)))
               for f in fields}
        details = {"tokens": len(ids), "chunk": args.chunk, "split": split, "product_dtype": args.product_dtype,
                   "model_dtype": str(lm.adapter.dtype).removeprefix("torch."), "outlier_ratio": ratio,
                   "rows": {"one_shot": int(one.n), "chunked": int(chunked.n)}, "relative_error": rel,
                   "one_shot_s": round(t_one, 2), "chunked_s": round(t_chunked, 2), "threads": torch.get_num_threads()}
        bench.finish(float(f"{max(rel.values()):.3g}"), details=details,
                     checks={"same rows fitted": one.n == chunked.n})


if __name__ == "__main__":
    main()
