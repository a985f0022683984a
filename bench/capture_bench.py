"""Capture throughput and memory (issue 2's figures), written as JSON.

    .venv/bin/python bench/capture_bench.py --model builtin:smollm2-135m --tokens 20000 --out bench/out/capture.json

1. Throughput, in one process and one run: a plain forward (the full causal LM, logits included) over the
   calibration windows, the same forward without the LM head (the decoder stack only), then `capture` over
   the same corpus; reports capture tokens/s divided by each (model load excluded). On a large-vocabulary
   model the LM head dominates the plain forward (Gemma 3: 262K x 640, 1 GB of float32 logits a window).
2. Peak RSS of `ridgefill capture` (a subprocess, fresh store) at two corpus sizes 5x apart, and their
   ratio. Statistics memory does not grow with tokens, so the ratio should stay near 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def corpus_of(tokens_wanted: int, tok, dest: Path) -> int:
    """Write the first documents of builtin:default to dest until about `tokens_wanted` tokens."""
    from ridgefill.capture.corpus import read_corpus

    dest.mkdir(parents=True)
    docs = read_corpus(["builtin:default"]).documents
    # interleave prose and code so both sizes hold both kinds
    order = [d for pair in zip(docs[: len(docs) // 2], docs[len(docs) // 2 :]) for d in pair]
    total = 0
    for i, d in enumerate(order):
        n = len(tok(d.text)["input_ids"])
        text = d.text
        if total + n > tokens_wanted:
            keep = tokens_wanted - total
            text = tok.decode(tok(d.text)["input_ids"][:keep])
            n = keep
        (dest / f"{i:03d}.txt").write_text(text)
        total += n
        if total >= tokens_wanted:
            break
    return total


def peak_rss_of(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of a child process."""
    t = time.perf_counter()
    pid = os.spawnv(os.P_NOWAIT, cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return usage.ru_maxrss / 1024, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=int, default=20000, help="small corpus size; the large one is 5x")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("bench/out/capture.json"))
    ap.add_argument("--skip-rss", action="store_true", help="only the throughput part")
    ap.add_argument("--store", type=Path, default=Path("ridgefill-artifacts"), help="for the cached model only")
    args = ap.parse_args()

    import torch

    from ridgefill.artifacts import Store
    from ridgefill.capture.run import CaptureConfig, capture
    from ridgefill.models import load_model, resolve_model
    from ridgefill.output import Output

    ref = resolve_model(args.model, store_root=args.store)
    lm = load_model(ref, store_root=args.store)
    tmp = Path(tempfile.mkdtemp(prefix="rf-bench-"))
    sizes = {"small": args.tokens, "large": 5 * args.tokens}
    got = {k: corpus_of(v, lm.tokenizer, tmp / k) for k, v in sizes.items()}

    # 1. throughput on the small corpus: plain forward vs capture, same process, same windows
    from ridgefill.capture.corpus import read_corpus

    docs = read_corpus([str(tmp / "small")]).documents
    windows = []
    for d in docs:
        ids = lm.tokenizer(d.text)["input_ids"]
        windows += [ids[i : i + args.max_tokens] for i in range(0, len(ids), args.max_tokens)]
    t = time.perf_counter()
    with torch.inference_mode():
        for w in windows:
            lm.model(torch.tensor([w]))
    plain_s = time.perf_counter() - t
    t = time.perf_counter()
    with torch.inference_mode():
        for w in windows:
            lm.adapter.base(input_ids=torch.tensor([w]), use_cache=False)
    stack_s = time.perf_counter() - t
    n_tok = sum(map(len, windows))
    store = Store(tmp / "store-throughput")
    # link the cached model into this store so capture does not load from the gguf again
    (store.root / "models").mkdir(parents=True)
    for p in (args.store / "models").iterdir():
        os.symlink(p.resolve(), store.root / "models" / p.name)
    t = time.perf_counter()
    art, _ = capture(store, args.model, [str(tmp / "small")],
                     CaptureConfig(max_tokens=args.max_tokens, held_out=0, held_out_rows=0), Output(quiet=True))
    cap_s = time.perf_counter() - t - art.manifest["timings"]["model_load_s"]
    plain_tps, cap_tps, stack_tps = n_tok / plain_s, n_tok / cap_s, n_tok / stack_s

    # 2. peak RSS at two sizes, each in a fresh process with the model cache linked in
    rss = {}
    exe = str(Path(sys.executable).with_name("ridgefill"))
    for k in ([] if args.skip_rss else sizes):
        st = tmp / f"store-{k}"
        (st / "models").mkdir(parents=True)
        for p in (args.store / "models").iterdir():
            os.symlink(p.resolve(), st / "models" / p.name)
        mib, wall = peak_rss_of([exe, "capture", args.model, "--data", str(tmp / k), "--held-out", "0",
                                 "--held-out-rows", "0", "--store", str(st)])
        rss[k] = {"tokens": got[k], "peak_rss_mib": round(mib, 1), "wall_s": round(wall, 1)}
    result = {
        "model": args.model,
        "tokens": n_tok,
        "plain_forward_tok_s": round(plain_tps, 1),
        "capture_tok_s": round(cap_tps, 1),
        "capture_over_plain": round(cap_tps / plain_tps, 3),
        "decoder_stack_tok_s": round(stack_tps, 1),
        "capture_over_decoder_stack": round(cap_tps / stack_tps, 3),
    }
    if rss:
        result["peak_rss"] = rss
        result["peak_rss_large_over_small"] = round(rss["large"]["peak_rss_mib"] / rss["small"]["peak_rss_mib"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
