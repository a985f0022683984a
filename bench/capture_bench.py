"""Capture throughput against the decoder stack's own forward (figure 1), with a profile of capture's extra time.

    .venv/bin/python bench/capture_bench.py --model builtin:smollm2-135m --tokens 8192 --repeat 3 \
        [--doc-tokens 2048] [--chunk 1024] [--out bench/out/capture-smollm2-135m.json]

One process, one loaded model, the same documents (a corpus of equal-length documents, bench/common.py), fed
the same way: each document chunk by chunk (`--chunk`) through a DynamicCache, stopped before the last decoder
layer (layers 0..L-2 run, no LM head). Two arms, interleaved for `--repeat` rounds (the order alternates) after
a warm-up document each:

- stack: `ridgefill.capture.forward.document_chunks` over every document, the recorded states discarded;
- capture: `ridgefill.capture.run.capture` itself (fresh store, no held-out documents), with model loading
  patched to hand it the already loaded model. Its per-unit time is the manifest's `forward_s` (the forward plus
  chunk_moments and merge_into of every chunk); its end-to-end time is the call's wall (tokenizing, blocks,
  checkpoints, writing the artifact), model load excluded either way.

The figure is capture tok/s / stack tok/s = median stack seconds / median capture seconds (also given per
round, paired). Target >= 0.90. One compute thread by default (`--threads`; see bench/common.py: on a shared
2-core machine two OpenMP threads are slower and far noisier than one).

Then (`--profile-docs N`, default 2; 0 skips it) a profile: N documents, each taken four ways in rotating order
with a timer around every step: the forward alone (as the stack arm), the forward with a hook on the stop layer
only (the price of the hooks on every late layer), the forward followed by `chunk_moments` and `merge_into`
after each chunk exactly as capture calls them (the forward's own time there shows any slow-down the statistics
cause it), and a step-by-step mirror of those two functions (centring, concatenation into the reused buffer, the cxx and cxy
matmuls, the yy norm, the float64 host copies; the cxx / cxy adds and the rank-one corrections).
Seconds and shares of the lone forward.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_STORE, OUT, corpus_for, fresh_store, load, machine, med, set_threads, short,  # noqa: E402
                    write_json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192, help="corpus size in tokens")
    ap.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds of both arms")
    ap.add_argument("--threads", type=int, default=1, help="compute threads (0: torch's default)")
    ap.add_argument("--profile-docs", type=int, default=2, help="documents in the profile pass (0: none)")
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE, help="bench store holding the model cache")
    ap.add_argument("--out", type=Path, default=None, help="default bench/out/capture-<model>.json")
    args = ap.parse_args()
    out_path = args.out or OUT / f"capture-{short(args.model)}.json"
    set_threads(args.threads)

    import numpy as np
    import torch

    import ridgefill.models
    from ridgefill.artifacts import Store
    from ridgefill.capture.corpus import read_corpus
    from ridgefill.capture.forward import document_chunks, exact_float32
    from ridgefill.capture.artifact import tokenize as _tokenize
    from ridgefill.capture.run import CaptureConfig, capture
    from ridgefill.capture.units import SKIP_FIRST
    from ridgefill.output import Output

    before = machine()
    ref, lm = load(args.model, args.store)
    corpus_dir = corpus_for(args.model, args.tokens, args.doc_tokens, OUT / "corpora", tok=lm.tokenizer)
    corpus = read_corpus([str(corpus_dir)])
    context = int(getattr(lm.model.config.get_text_config(), "max_position_embeddings", 0) or 0) or None
    docs = [d for d in _tokenize(lm.tokenizer, corpus, False, context)["raw"] if len(d) > SKIP_FIRST]
    n_tok = int(sum(len(d) for d in docs))
    split, L = ref.default_split, ref.num_layers
    layers = list(range(split, L))

    # capture() loads its model through ridgefill.models.load_model: hand it the one already in memory
    ridgefill.models.load_model = lambda *a, **k: lm
    tmp = Path(tempfile.mkdtemp(prefix="rf-capbench-"))
    cfg = CaptureConfig(chunk=args.chunk, held_out=0, held_out_rows=0)

    def stack(ids_list) -> float:
        t = time.perf_counter()
        with exact_float32():
            for ids in ids_list:
                for _ in document_chunks(lm, ids, layers, args.chunk, "cpu"):
                    pass
        return time.perf_counter() - t

    runs = 0

    def cap(data_dir) -> tuple[float, float, dict]:
        nonlocal runs
        runs += 1
        st = Store(fresh_store(tmp / f"store-{runs}", args.store))
        t = time.perf_counter()
        art, cached = capture(st, args.model, [str(data_dir)], cfg, Output(quiet=True))
        wall = time.perf_counter() - t
        assert not cached
        tm = art.manifest["timings"]
        return tm["forward_s"], wall - tm["model_load_s"], art.manifest["summary"]

    # warm-up: one document through each arm
    warm = tmp / "warm"
    warm.mkdir()
    (warm / "0.txt").write_text(corpus.documents[0].text)
    stack(docs[:1])
    cap(warm)

    rounds = []
    for r in range(args.repeat):
        row = {}
        for arm in (("stack", "capture") if r % 2 == 0 else ("capture", "stack")):
            if arm == "stack":
                row["stack_s"] = stack(docs)
            else:
                row["capture_unit_s"], row["capture_wall_s"], summary = cap(corpus_dir)
                assert summary["calibration_tokens"] == n_tok, (summary["calibration_tokens"], n_tok)
        row["ratio_unit"] = row["stack_s"] / row["capture_unit_s"]
        row["ratio_end_to_end"] = row["stack_s"] / row["capture_wall_s"]
        rounds.append({k: round(v, 4) for k, v in row.items()})
        print(f"round {r}: {rounds[-1]}", flush=True)

    stack_s = med([x["stack_s"] for x in rounds])
    unit_s = med([x["capture_unit_s"] for x in rounds])
    wall_s = med([x["capture_wall_s"] for x in rounds])
    result = {
        "figure": "capture tok/s / decoder-stack forward tok/s (same chunks, same KV-cache path, load excluded)",
        "model": args.model, "tokens": n_tok, "documents": len(docs), "doc_tokens": args.doc_tokens,
        "chunk": args.chunk, "split": split, "layers_run": f"0..{L - 2} of {L}", "late_layers": len(layers),
        "hidden_size": ref.hidden_size, "repeat": args.repeat, "rounds": rounds,
        "stack_tok_s": round(n_tok / stack_s, 1),
        "capture_tok_s": round(n_tok / unit_s, 1),
        "capture_end_to_end_tok_s": round(n_tok / wall_s, 1),
        "capture_over_stack": round(stack_s / unit_s, 4),
        "capture_over_stack_paired_median": round(med([x["ratio_unit"] for x in rounds]), 4),
        "capture_end_to_end_over_stack": round(stack_s / wall_s, 4),
        "target": ">= 0.90",
        "threads": torch.get_num_threads(),
        "machine_before": before,
    }
    if args.profile_docs:
        result["profile"] = profile(lm, docs[: args.profile_docs], layers, L, args.chunk, np, torch)
    result["machine_after"] = machine()
    write_json(out_path, result)
    print(f"{args.model}: capture / stack = {result['capture_over_stack']} "
          f"(paired {result['capture_over_stack_paired_median']}); {out_path}")


def profile(lm, docs, layers, L, chunk, np, torch) -> dict:
    """Capture's per-chunk work with a timer around each step, each document taken four ways in rotating order:
    `alone` (the stack arm: hooks on every late layer, states discarded), `stop_only` (one hook, on the layer
    the forward stops at), `with_stats` (chunk_moments + merge_into after each chunk, as capture does) and
    `mirror` (the same two on a step-by-step copy of their code, timed per step; its forward is not used)."""
    from ridgefill.capture.forward import chunk_moments, document_chunks, exact_float32
    from ridgefill.capture.units import SKIP_FIRST
    from ridgefill.capture.stats import Moments, merge_into

    split = layers[0]
    d = lm.model.config.get_text_config().hidden_size
    acc: dict[str, float] = {}

    def add(k, t):
        acc[k] = acc.get(k, 0.0) + t

    def forward_only(ids, hooked, name):
        it = document_chunks(lm, ids, hooked, chunk, "cpu")
        while True:
            t = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            add(name, time.perf_counter() - t)

    chunks = 0

    def with_stats(ids, mirrored: bool):
        nonlocal chunks
        part = Moments.empty(L - split, d, d)  # capture starts every block from empty: one document a block here
        it = document_chunks(lm, ids, layers, chunk, "cpu")
        while True:
            t = time.perf_counter()
            try:
                start, hs = next(it)
            except StopIteration:
                break
            add("forward_with_mirror" if mirrored else "forward_with_stats", time.perf_counter() - t)
            skip = SKIP_FIRST if start == 0 else 0
            x, ys = hs[split][skip:], [hs[l][skip:] for l in layers]
            if mirrored:
                part = _merge_steps(part, _moments_steps(x, ys, torch, np, add), np, add)
                continue
            chunks += 1
            t = time.perf_counter()
            m = chunk_moments(x, ys, "float32")
            add("chunk_moments", time.perf_counter() - t)
            t = time.perf_counter()
            part = merge_into(part, m)
            add("merge_into", time.perf_counter() - t)

    ways = [("alone", lambda ids: forward_only(ids, layers, "forward_alone")),
            ("stop_only", lambda ids: forward_only(ids, [L - 1], "forward_stop_hook_only")),
            ("with_stats", lambda ids: with_stats(ids, False)), ("mirror", lambda ids: with_stats(ids, True))]
    with exact_float32():
        for i, ids in enumerate(docs):
            for j in range(len(ways)):
                ways[(i + j) % len(ways)][1](ids)
    alone, fws = acc["forward_alone"], acc["forward_with_stats"]
    stats = acc["chunk_moments"] + acc["merge_into"]
    steps = {k: round(v, 4) for k, v in sorted(acc.items())}
    return {
        "documents": len(docs),
        "chunks": chunks,
        "seconds": steps,
        "share_of_forward_alone": {k: round(v / alone, 4) for k, v in sorted(acc.items())},
        "predicted_capture_over_stack": round(alone / (fws + stats), 4),
        "stats_share": round(stats / (fws + stats), 4),
        "forward_with_stats_over_alone": round(fws / alone, 4),
        "hooks_all_late_over_stop_only": round(alone / acc["forward_stop_hook_only"], 4),
        "note": "forward_* are the forward's seconds only; m.* / g.* are a step-by-step mirror of chunk_moments / "
                "merge_into over the same documents (their sums should be near the real calls' seconds); "
                "predicted = forward_alone / (forward_with_stats + chunk_moments + merge_into)",
    }


def _moments_steps(x, ys, torch, np, add):
    """chunk_moments (capture/forward.py as of the reused-buffer version), one timer per step. Keep it in step with
    that function: the profile's note compares the sum of these steps with the real call's seconds."""
    from ridgefill.capture.forward import _buffer, _center_
    from ridgefill.capture.stats import Moments

    def step(name, fn):
        t = time.perf_counter()
        r = fn()
        add(name, time.perf_counter() - t)
        return r

    wd = torch.float32
    n, dx = x.shape
    k, dy = len(ys), ys[0].shape[-1]
    mean_x = step("m.mean_x", lambda: x.sum(0, dtype=torch.float64) / n)
    xc = step("m.centre_x", lambda: x.to(wd) - mean_x.to(wd))
    yc = step("m.cat_y", lambda: torch.cat([y.to(device=x.device, dtype=wd) for y in ys], dim=1,
                                           out=_buffer("y", n, k * dy, wd, x.device)))
    mean_y = step("m.centre_y", lambda: _center_(yc))
    cxy = step("m.cxy_matmul", lambda: torch.matmul(xc.T, yc, out=_buffer("cxy", dx, k * dy, wd, x.device)))
    yy = step("m.yy_norm", lambda: torch.linalg.vector_norm(yc.view(n, k, dy), dim=(0, 2)).double() ** 2)
    cxx = step("m.cxx_matmul", lambda: xc.T @ xc)
    host = lambda t: t.to("cpu", torch.float64).numpy()  # noqa: E731
    hx, hcxx, hmy, hyy = step("m.host_small", lambda: (host(mean_x), host(cxx), host(mean_y), host(yy)))
    hcxy = step("m.host_cxy_float64", lambda: host(cxy).reshape(dx, k, dy).transpose(1, 0, 2))
    return Moments(n, hx, hcxx, hmy.reshape(k, dy), hcxy, hyy)


def _merge_steps(a, b, np, add):
    """merge_into (capture/stats.py), one timer per step."""
    from ridgefill.capture.stats import Moments

    t = time.perf_counter()
    if a.n == 0:
        r = Moments(b.n, b.mean_x.copy(), b.cxx.copy(), b.mean_y.copy(), b.cxy.copy(), b.yy.copy())
        add("g.first_copy", time.perf_counter() - t)
        return r
    n = a.n + b.n
    dx = b.mean_x - a.mean_x
    dy = b.mean_y - a.mean_y
    f = a.n * b.n / n
    t0 = time.perf_counter()
    a.cxx += b.cxx
    a.cxx += f * np.outer(dx, dx)
    t1 = time.perf_counter()
    a.cxy += b.cxy
    t2 = time.perf_counter()
    a.cxy += f * dx[None, :, None] * dy[:, None, :]
    t3 = time.perf_counter()
    a.yy += b.yy
    a.yy += f * np.einsum("kd,kd->k", dy, dy)
    r = Moments(n, a.mean_x + dx * (b.n / n), a.cxx, a.mean_y + dy * (b.n / n), a.cxy, a.yy)
    t4 = time.perf_counter()
    add("g.cxx", t1 - t0)
    add("g.cxy_add", t2 - t1)
    add("g.cxy_rank_one", t3 - t2)
    add("g.rest", (t0 - t) + (t4 - t3))
    return r


if __name__ == "__main__":
    main()
