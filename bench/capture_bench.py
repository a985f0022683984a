"""Capture throughput against the decoder stack's own forward (figure "capture"), with a profile of capture's extra
time.

    .venv/bin/python bench/capture_bench.py --model builtin:smollm2-135m --tokens 8192 --repeat 3 \
        [--doc-tokens 2048] [--chunk 1024] [--profile-docs 2] [--dtype float32] [--store DIR] [--out FILE]

`--dtype bfloat16` runs the model (both arms) in bfloat16, as capture does on a GPU; its statistics stay float64.

One process, one loaded model, the same documents (a corpus of equal-length documents, bench/harness.py), fed
the same way: each document chunk by chunk (`--chunk`) through a DynamicCache, stopped before the last decoder
layer (layers 0..L-2 run, no LM head). Two arms, interleaved for `--repeat` rounds (the order alternates) after
a warm-up document each:

- stack: `ridgefill.capture.forward.document_chunks` over every document, the recorded states discarded;
- capture: `ridgefill.capture.run.capture` itself (a fresh store each round, no held-out documents), with model
  loading patched to hand it the already loaded model. Its per-unit time is the manifest's `forward_s` (the
  forward plus the statistics of every chunk); its end-to-end time is the call's wall (tokenizing, blocks,
  checkpoints, writing the artifact), model load excluded either way.

The figure is capture tok/s / stack tok/s = median stack seconds / median capture seconds (also given per
round, paired). Its target is in bench/harness.py's FIGURES. One compute thread by default (`--threads`).

Then (`--profile-docs N`; 0 skips it) a profile: N documents, each taken four ways in rotating order with a timer
around every step: the forward alone (as the stack arm), the forward with a hook on the stop layer only (the price
of the hooks on every late layer), the forward followed after each chunk by capture's own per-chunk step
(`fitted_moments`, which leaves out the sink and outlier rows, then `merge_into`; the forward's own time there
shows any slow-down the statistics cause it), and that step under torch.profiler (the operators it spends its time
in, from the real function; these seconds are not used for the shares). Seconds and shares of the lone forward.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, corpus_for, count, load, med, parser, positive  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=positive, default=8192, help="corpus size in tokens")
    ap.add_argument("--doc-tokens", type=positive, default=2048, help="tokens per document")
    ap.add_argument("--chunk", type=positive, default=1024)
    ap.add_argument("--repeat", type=positive, default=3, help="interleaved rounds of both arms")
    ap.add_argument("--profile-docs", type=count, default=2, help="documents in the profile pass (0: none)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    args = ap.parse_args()

    with Bench("capture", args, args.model) as bench:
        import torch

        import ridgefill.models
        from ridgefill.artifacts import Store
        from ridgefill.capture import CaptureConfig, capture
        from ridgefill.capture.artifact import tokenize
        from ridgefill.capture.corpus import read_corpus
        from ridgefill.capture.forward import document_chunks, exact_float32
        from ridgefill.capture.units import make_units
        from ridgefill.models.device import where
        from ridgefill.output import Output

        ref, lm = load(args.model, bench.store, args.dtype)
        corpus_dir = corpus_for(args.model, args.tokens, args.doc_tokens, tok=lm.tokenizer)
        corpus = read_corpus([str(corpus_dir)])
        cfg = CaptureConfig(chunk=args.chunk, held_out=0, held_out_rows=0)
        ids = tokenize(lm.tokenizer, corpus, False, lm.context_length())
        docs = [ids["raw"][u.doc] for u in make_units(ids, list(range(len(corpus.documents))), [], 0)]  # capture's
        n_tok = int(sum(len(d) for d in docs))
        split, L = ref.default_split, ref.num_layers
        layers = list(range(split, L))

        # capture() loads its model through ridgefill.models.load_model: hand it the one already in memory
        ridgefill.models.load_model = lambda *a, **k: lm

        def stack(ids_list) -> float:
            t = time.perf_counter()
            with exact_float32():
                for x in ids_list:
                    for _ in document_chunks(lm, x, layers, args.chunk, lm.adapter.device):
                        pass
            return time.perf_counter() - t

        runs = 0

        def cap(data_dir) -> tuple[float, float, dict]:
            nonlocal runs
            runs += 1
            st = Store(bench.fresh_store(f"store-{runs}"))
            t = time.perf_counter()
            art, cached = capture(st, args.model, [str(data_dir)], cfg, Output(quiet=True),
                                  place=where(device="cpu", dtype=args.dtype))
            wall = time.perf_counter() - t
            assert not cached
            tm = art.manifest["timings"]
            return tm["forward_s"], wall - tm["model_load_s"], art.manifest["summary"]

        warm = bench.scratch / "warm"  # warm-up: one document through each arm
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
        details = {
            "tokens": n_tok, "documents": len(docs), "doc_tokens": args.doc_tokens, "chunk": args.chunk,
            "split": split, "layers_run": f"0..{L - 2} of {L}", "late_layers": len(layers),
            "hidden_size": ref.hidden_size, "repeat": args.repeat, "rounds": rounds,
            "stack_tok_s": round(n_tok / stack_s, 1), "capture_tok_s": round(n_tok / unit_s, 1),
            "capture_end_to_end_tok_s": round(n_tok / wall_s, 1),
            "capture_over_stack_paired_median": round(med([x["ratio_unit"] for x in rounds]), 4),
            "capture_end_to_end_over_stack": round(stack_s / wall_s, 4),
            "threads": torch.get_num_threads(), "dtype": args.dtype,
        }
        if args.profile_docs:
            details["profile"] = profile(lm, docs[: args.profile_docs], layers, cfg)
        bench.finish(round(stack_s / unit_s, 4), details=details)


def profile(lm, docs, layers, cfg) -> dict:
    """Capture's per-chunk work with a timer around each step, each document taken four ways in rotating order:
    `alone` (the stack arm: hooks on every late layer, states discarded), `stop_only` (one hook, on the layer
    the forward stops at), `with_stats` (`fitted_moments` + `merge_into` after each chunk, as capture calls them)
    and `ops` (the same under torch.profiler, for the operators `fitted_moments` spends its time in)."""
    import torch
    from torch.profiler import ProfilerActivity, record_function

    from ridgefill.capture.forward import document_chunks, exact_float32, fitted_moments
    from ridgefill.capture.stats import Moments, merge_into

    split, L = layers[0], lm.adapter.num_layers
    d = lm.adapter.hidden_size
    acc: dict[str, float] = {}
    ops: dict[str, float] = {}

    def add(k, t):
        acc[k] = acc.get(k, 0.0) + t

    def forward_only(ids, hooked, name):
        it = document_chunks(lm, ids, hooked, cfg.chunk, lm.adapter.device)
        while True:
            t = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            add(name, time.perf_counter() - t)

    chunks = 0

    def with_stats(ids, profiled: bool):
        nonlocal chunks
        part = {split: Moments.empty(L - split, d, d)}  # capture starts every block from empty: one document a block
        it = document_chunks(lm, ids, layers, cfg.chunk, lm.adapter.device)
        while True:
            t = time.perf_counter()
            try:
                start, hs = next(it)
            except StopIteration:
                break
            if profiled:  # inside the profiler session of this document (below)
                with record_function("fitted_moments"):
                    fitted_moments(hs, start, [split], L, cfg.outlier_ratio, cfg.product_dtype)
                continue
            add("forward_with_stats", time.perf_counter() - t)
            chunks += 1
            t = time.perf_counter()
            fitted = fitted_moments(hs, start, [split], L, cfg.outlier_ratio, cfg.product_dtype)
            add("fitted_moments", time.perf_counter() - t)
            t = time.perf_counter()
            for s, m in fitted.items():
                part[s] = merge_into(part[s], m)
            add("merge_into", time.perf_counter() - t)

    def operators(ids):
        """Self CPU seconds per operator run inside fitted_moments, over one document."""
        with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            with_stats(ids, True)
        for e in prof.events():
            p = e.cpu_parent
            while p is not None and p.name != "fitted_moments":
                p = p.cpu_parent
            if p is not None:
                ops[e.name] = ops.get(e.name, 0.0) + e.self_cpu_time_total / 1e6

    ways = [lambda ids: forward_only(ids, layers, "forward_alone"),
            lambda ids: forward_only(ids, [L - 1], "forward_stop_hook_only"),
            lambda ids: with_stats(ids, False), operators]
    with exact_float32():
        for i, ids in enumerate(docs):
            for j in range(len(ways)):
                ways[(i + j) % len(ways)](ids)
    alone, fws = acc["forward_alone"], acc["forward_with_stats"]
    stats = acc["fitted_moments"] + acc["merge_into"]
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    return {
        "documents": len(docs),
        "chunks": chunks,
        "seconds": {k: round(v, 4) for k, v in sorted(acc.items())},
        "share_of_forward_alone": {k: round(v / alone, 4) for k, v in sorted(acc.items())},
        "predicted_capture_over_stack": round(alone / (fws + stats), 4),
        "stats_share": round(stats / (fws + stats), 4),
        "forward_with_stats_over_alone": round(fws / alone, 4),
        "hooks_all_late_over_stop_only": round(alone / acc["forward_stop_hook_only"], 4),
        "fitted_moments_top_ops_self_s": {k: round(v, 4) for k, v in top},
        "note": "forward_* are the forward's seconds only; predicted = forward_alone / (forward_with_stats + "
                "fitted_moments + merge_into); fitted_moments_top_ops_self_s: torch.profiler's self CPU seconds "
                "per operator inside fitted_moments over the same documents (profiled separately)",
    }


if __name__ == "__main__":
    main()
