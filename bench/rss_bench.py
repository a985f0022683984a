"""Peak RSS of `ridgefill capture` at 5x the tokens against 1x (figure "rss"), and where capture's memory goes.

    .venv/bin/python bench/rss_bench.py --model builtin:gemma3-270m --tokens 8192 [--factor 5] \
        [--doc-tokens 2048] [--chunk 1024] [--long-doc-tokens 8192] [--store DIR] [--out FILE]

1. The figure: `ridgefill capture MODEL --data CORPUS --held-out 0 --held-out-rows 0` as a child process with a
   fresh store (the dequantized model cache linked in), peak RSS from os.wait4's ru_maxrss, on two corpora of
   equal-length documents (`--doc-tokens`), `--tokens` and `--factor` x that (the small corpus' documents are the
   first of the large one's). Ratio large / small (its target: bench/harness.py's FIGURES). Runs alternate
   (small, large, then large, small with --repeat 2); medians.
2. Diagnosis (unless --no-diagnose): the same capture in an instrumented child (`--child`, below) that records
   VmRSS / VmHWM / RssAnon / RssFile and glibc's mallinfo2 (heap bytes in use, free bytes kept in the heap,
   mmapped bytes) after imports, after the model load, after tokenizing and after every document; on both
   corpora and on one of the same tokens in documents of `--long-doc-tokens` tokens. The peak of each phase and
   the growth per document tell what grows with tokens (token ids, held-out rows, the heap) and what grows with
   the length of the longest document (its KV cache, which capture keeps until the document ends, and the
   attention of each chunk over it); the KV-cache bytes per token of the layers that run are computed from the
   loaded model's adapter (heads, head size, layer kinds) for comparison. Also the embedding probe
   (`--child-embed`): in a fresh process per corpus, only the embedding lookups of every token, and how much of
   the embedding matrix is then mapped in (/proc/self/pagemap): the model's weights are mmapped from the
   dequantized cache's safetensors, so RSS counts the pages a run touches, and a larger corpus touches more
   embedding rows (more distinct token ids, each mapping the 64 KiB around it). `--old-tokens N` adds two
   corpora of whole builtin:default documents (N and 5N tokens; mixed lengths, so the larger one also has longer
   documents: the corpora the first version of this bench measured, reported as old_bench_small / _large).
3. With --malloc-probe BYTES, both sizes once more with glibc's mmap threshold fixed at BYTES
   (MALLOC_MMAP_THRESHOLD_), to tell heap retention apart from memory capture holds; with --trim-probe, the
   instrumented capture on both sizes calling malloc_trim(0) after every document.

`--child` runs one instrumented capture in this process, in the store `--store` (a fresh one from the parent), with
`--config` (CaptureConfig fields as JSON), and writes its trace as JSON (used by part 2). It measures the real
capture: the trace is taken at capture's own observation points (`after_load`, `after_plan`, `after_unit`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (OUT, Bench, corpus_for, count, env_threads, exe, load, med, parser, positive,  # noqa: E402
                     run_measured, set_threads, short, tokenizer)


def status_kib(field: str = "VmRSS") -> int:
    """This process's /proc/self/status field (VmRSS, VmHWM, RssAnon, RssFile) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> dict:
    """glibc heap figures in MiB: in_use (uordblks), free_kept (fordblks: freed but not returned), mmapped
    (hblkhd), heap (arena: all arenas' size). Empty when glibc has no mallinfo2."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    return {"heap": mib(m.arena), "in_use": mib(m.uordblks), "free_kept": mib(m.fordblks), "mmapped": mib(m.hblkhd)}


def resident_bytes(start: int, nbytes: int) -> int:
    """Bytes of [start, start + nbytes) mapped into this process right now (/proc/self/pagemap's present bit)."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    first, last = start // page, (start + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


def mapping_rss_mib(suffix: str) -> float:
    """Rss of this process' mappings of files whose name ends with `suffix` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and head[-1].endswith(suffix)
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return round(total / 1024, 1)


class AnonPeak:
    """Largest RssAnon seen by a thread that reads /proc/self/status every `every` seconds (the kernel keeps a
    high-water mark for the whole RSS only, file pages included)."""

    def __init__(self, every: float = 0.02):
        import threading

        self.peak, self.every, self._stop = 0, every, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib("RssAnon"))
            time.sleep(self.every)

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, status_kib("RssAnon"))
        return round(self.peak / 1024, 1)


def snapshot(what: str, embedding: dict | None = None, **extra) -> dict:
    """This process's memory now: RSS and its high-water mark, anonymous and file pages, the model file's mapped
    pages, glibc's heap; with `embedding` (the matrix's address and size), how much of it is mapped in."""
    mib = lambda f: round(status_kib(f) / 1024, 1)  # noqa: E731
    s = {"at": what, "rss": mib("VmRSS"), "hwm": mib("VmHWM"), "anon": mib("RssAnon"), "file": mib("RssFile"),
         "model_file": mapping_rss_mib(".safetensors"), "malloc": mallinfo(), "t": round(time.perf_counter(), 2)}
    if embedding:
        s["embedding_resident"] = round(resident_bytes(embedding["ptr"], embedding["bytes"]) / 2**20, 1)
    return s | extra


class Trace:
    """The instrumented capture's trace: a snapshot at the start, after the imports, and at capture's observation
    points (its `after_load`, `after_plan` and `after_unit` hooks), with what the run had reached there."""

    def __init__(self, malloc_trim: bool = False):
        self.snapshots = [snapshot("start")]
        self.embedding: dict = {}  # the embedding matrix's address and size, once the model is loaded
        self.ids: dict = {}  # the run's token ids ({variant: [ids per document]}) and units, once planned
        self.units: list = []
        self.tokens_done = 0
        self.seen: set[int] = set()  # distinct token ids fed so far
        # glibc: give the heap's free pages back to the kernel after every document
        self.trim = ctypes.CDLL("libc.so.6").malloc_trim if malloc_trim else None

    def add(self, what: str, **extra) -> None:
        self.snapshots.append(snapshot(what, self.embedding, **extra))

    def after_load(self, lm) -> None:
        w = lm.model.get_input_embeddings().weight
        self.embedding = {"ptr": w.data_ptr(), "bytes": w.numel() * w.element_size()}
        ad = lm.adapter
        attention = {"kv_heads": ad.num_kv_heads, "head_dim": ad.head_dim, "attention_heads": ad.num_heads,
                     "layer_kinds": list(ad.layer_kinds), "dtype_bytes": ad.dtype.itemsize,
                     "sliding_window": getattr(ad.config, "sliding_window", None)}
        self.add("model loaded", embedding_mib=round(self.embedding["bytes"] / 2**20, 1), vocab_rows=w.shape[0],
                 attention=attention)

    def after_plan(self, ids: dict, units: list) -> None:
        self.ids, self.units = ids, units
        raw = ids["raw"]
        self.add("tokenized", documents=len(raw), tokens=int(sum(len(x) for x in raw)),
                 longest=int(max(len(x) for x in raw)))

    def after_unit(self, i: int) -> None:
        if self.trim is not None:
            self.trim(0)
        u = self.units[i]
        self.tokens_done += u.tokens
        self.seen.update(int(t) for t in self.ids[u.variant][u.doc])
        self.add("unit", unit=i, doc=u.doc, unit_tokens=int(u.tokens), tokens_done=self.tokens_done,
                 distinct_ids=len(self.seen))


def child(args) -> None:
    """One instrumented capture in this process (through capture's observation points); the trace goes to
    args.trace."""
    trace = Trace(args.malloc_trim)
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import ridgefill
    from ridgefill.artifacts import Store
    from ridgefill.capture import CaptureConfig, capture
    from ridgefill.output import Output

    trace.add("imports", ridgefill=str(Path(ridgefill.__file__).parent))
    cfg = CaptureConfig(held_out=0, held_out_rows=0, **json.loads(args.config))
    anon = AnonPeak()
    art, _ = capture(Store(args.store), args.model, [str(args.data)], cfg, Output(quiet=True),
                     after_unit=trace.after_unit, after_load=trace.after_load, after_plan=trace.after_plan)
    import resource

    trace.add("end", ru_maxrss=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              anon_peak=anon.stop(), distinct_ids=len(trace.seen))
    Path(args.trace).write_text(json.dumps({"trace": trace.snapshots, "summary": art.manifest["summary"],
                                            "model": args.model, "config": asdict(cfg)}))


def child_embed(args) -> None:
    """Load the model, look up the embedding of every token of args.data (tokenized as capture does), and report
    how much of the embedding matrix is then mapped into this process; JSON on stdout."""
    import torch

    from ridgefill.capture.artifact import tokenize
    from ridgefill.capture.corpus import read_corpus

    _, lm = load(args.model, args.store)
    w = lm.model.get_input_embeddings().weight
    ptr, nbytes = w.data_ptr(), w.numel() * w.element_size()
    before = resident_bytes(ptr, nbytes)
    ids = tokenize(lm.tokenizer, read_corpus([str(args.data)]), False, lm.context_length())["raw"]
    with torch.inference_mode():
        for x in ids:
            lm.model.get_input_embeddings()(torch.from_numpy(x.astype("int64")))
    distinct = len({int(t) for x in ids for t in x})
    print(json.dumps({"tokens": int(sum(len(x) for x in ids)), "documents": len(ids), "distinct_ids": distinct,
                      "longest_document": int(max(len(x) for x in ids)), "embedding_mib": round(nbytes / 2**20, 1),
                      "row_bytes": int(w.shape[1] * w.element_size()),
                      "resident_before_mib": round(before / 2**20, 1),
                      "resident_after_lookups_mib": round(resident_bytes(ptr, nbytes) / 2**20, 1)}))


def old_bench_corpus(tok, tokens_wanted: int, dest: Path) -> Path:
    """builtin:default's documents, prose and code interleaved, the first ones until about `tokens_wanted` tokens
    (the last one cut), into `dest`: the corpora the first version of this bench measured (mixed lengths, so the
    larger one has longer documents too)."""
    from ridgefill.capture.corpus import read_corpus

    if (dest / ".done").is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    docs = read_corpus(["builtin:default"]).documents
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
    (dest / ".done").write_text("")
    return dest


def kv_bytes_per_token(attention: dict) -> dict:
    """KV-cache bytes per token of the layers capture runs (0..L-2), full-attention and sliding apart, from what
    the instrumented child read off the loaded model's adapter."""
    from ridgefill.models.kinds import FULL

    run = attention["layer_kinds"][:-1]
    per = 2 * attention["kv_heads"] * attention["head_dim"] * attention["dtype_bytes"]
    return {"per_layer_per_token": per, "full_layers_run": run.count(FULL),
            "sliding_layers_run": len(run) - run.count(FULL), "full_bytes_per_token": per * run.count(FULL),
            **{k: attention[k] for k in ("kv_heads", "head_dim", "attention_heads", "sliding_window")}}


def summarize(trace: dict) -> dict:
    """Phase peaks and per-document growth from a child's trace."""
    t = trace["trace"]
    at = {s["at"]: s for s in t if s["at"] != "unit"}
    units = [s for s in t if s["at"] == "unit"]
    first, last = units[0], units[-1]
    n = max(1, len(units) - 1)
    out = {
        "hwm_after_load": at["model loaded"]["hwm"], "rss_after_load": at["model loaded"]["rss"],
        "hwm_after_tokenize": at["tokenized"]["hwm"], "hwm_after_first_document": first["hwm"],
        "hwm_end": at["end"]["hwm"], "ru_maxrss": at["end"]["ru_maxrss"],
        "rss_after_first_document": first["rss"], "rss_after_last_document": last["rss"],
        "rss_growth_per_document_after_first": round((last["rss"] - first["rss"]) / n, 2),
        "hwm_growth_after_first_document": round(last["hwm"] - first["hwm"], 1),
        "peak_over_load": round(at["end"]["hwm"] - at["model loaded"]["rss"], 1),
        "malloc_after_first_document": first["malloc"], "malloc_after_last_document": last["malloc"],
        "documents": len(units), "tokens": last["tokens_done"], "longest_document": at["tokenized"]["longest"],
        "anon_peak": at["end"]["anon_peak"], "distinct_ids": at["end"]["distinct_ids"],
        "embedding_mib": at["model loaded"]["embedding_mib"],
        "embedding_resident_after_load": at["model loaded"]["embedding_resident"],
        "embedding_resident_end": last["embedding_resident"],  # after the last document (at "end" the model is gone)
        "model_file_rss_after_first_document": first["model_file"], "model_file_rss_end": last["model_file"],
        "anon_max_after_a_document": max(s["anon"] for s in units),
        "heap_max_after_a_document": max(s["malloc"].get("heap", 0) for s in units),
        "heap_in_use_max_after_a_document": max(s["malloc"].get("in_use", 0) for s in units),
    }
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=positive, default=8192, help="small corpus (1x) in tokens")
    ap.add_argument("--factor", type=positive, default=5, help="the large corpus is this many times the small one")
    ap.add_argument("--doc-tokens", type=positive, default=2048, help="tokens per document, both corpora")
    ap.add_argument("--long-doc-tokens", type=count, default=8192,
                    help="document length of the diagnosis' long-document corpus (0: skip)")
    ap.add_argument("--chunk", type=positive, default=1024)
    ap.add_argument("--repeat", type=positive, default=1, help="CLI runs per size (alternating)")
    ap.add_argument("--no-diagnose", action="store_true")
    ap.add_argument("--trim-probe", action="store_true",
                    help="also run the instrumented capture on both sizes calling glibc's malloc_trim(0) after every "
                         "document (what a fix inside capture could do)")
    ap.add_argument("--malloc-trim", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--malloc-probe", type=count, default=0, metavar="BYTES",
                    help="also run both sizes with MALLOC_MMAP_THRESHOLD_=BYTES (glibc: a fixed mmap threshold, so "
                         "large temporaries are unmapped when freed instead of fragmenting the heap)")
    ap.add_argument("--old-tokens", type=count, default=20000,
                    help="embedding probe: also corpora of whole builtin:default documents, this many tokens and 5x "
                         "(0: skip)")
    # --child: one instrumented capture (used by the diagnosis); --child-embed: the embedding probe
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--child-embed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or args.child_embed:
        set_threads(args.threads)
        return child(args) if args.child else child_embed(args)

    with Bench("rss", args, args.model) as bench:
        sizes = {"small": args.tokens, "large": args.factor * args.tokens}
        corpora = {k: corpus_for(args.model, v, args.doc_tokens) for k, v in sizes.items()}
        env = env_threads(args.threads)

        def cli_capture(k: str, store: Path, extra_env: dict | None = None) -> dict:
            return run_measured([exe(), "capture", args.model, "--data", str(corpora[k]), "--held-out", "0",
                                 "--held-out-rows", "0", "--chunk", str(args.chunk), "--store", str(store), "--json"],
                                env=env | (extra_env or {}))

        def instrumented(k: str, data: Path, *extra: str) -> tuple[dict, dict]:
            """The capture of `data` in an instrumented child (a fresh store): its measurement and its trace."""
            name = f"trace-{k}{'-trim' if extra else ''}"
            trace_path = bench.scratch / f"{name}.json"
            res = run_measured([sys.executable, __file__, "--child", *extra, "--model", args.model, "--data",
                                str(data), "--trace", str(trace_path), "--config", json.dumps({"chunk": args.chunk}),
                                "--store", str(bench.fresh_store(name)), "--threads", str(args.threads)], env=env)
            return res, json.loads(trace_path.read_text())

        runs: dict[str, list] = {"small": [], "large": []}
        for r in range(args.repeat):
            for k in (("small", "large") if r % 2 == 0 else ("large", "small")):
                res = cli_capture(k, bench.fresh_store(f"store-{k}-{r}"))
                summary = json.loads(res["stdout"])["summary"]
                runs[k].append({"peak_rss_mib": round(res["peak_rss_mib"], 1), "wall_s": round(res["wall_s"], 1),
                                "tokens": summary["calibration_tokens"], "documents": summary["calibration_documents"],
                                "longest_document": summary["longest_document"]})
                print(f"{k}: {runs[k][-1]}", flush=True)
        peak = {k: med([x["peak_rss_mib"] for x in v]) for k, v in runs.items()}
        details = {"factor": args.factor, "doc_tokens": args.doc_tokens, "chunk": args.chunk, "runs": runs,
                   "peak_rss_mib": {k: round(v, 1) for k, v in peak.items()}, "threads": args.threads or None}
        if args.malloc_probe:  # the same runs with glibc's mmap threshold fixed
            probe_runs = {}
            for k in ("small", "large"):
                res = cli_capture(k, bench.fresh_store(f"store-{k}-malloc"),
                                  {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_probe)})
                probe_runs[k] = {"peak_rss_mib": round(res["peak_rss_mib"], 1), "wall_s": round(res["wall_s"], 1)}
                print(f"{k} with MALLOC_MMAP_THRESHOLD_={args.malloc_probe}: {probe_runs[k]}", flush=True)
            details["malloc_probe"] = {"MALLOC_MMAP_THRESHOLD_": args.malloc_probe, "runs": probe_runs,
                                       "large_over_small": round(probe_runs["large"]["peak_rss_mib"]
                                                                 / probe_runs["small"]["peak_rss_mib"], 4)}
        if args.trim_probe:
            trimmed = {}
            for k in ("small", "large"):
                res, trace = instrumented(k, corpora[k], "--malloc-trim")
                tr = summarize(trace)
                trimmed[k] = {"peak_rss_mib": round(res["peak_rss_mib"], 1), "wall_s": round(res["wall_s"], 1),
                              "anon_peak": tr["anon_peak"], "embedding_resident_end": tr["embedding_resident_end"]}
                print(f"{k} with malloc_trim(0) after every document: {trimmed[k]}", flush=True)
            details["trim_probe"] = {"runs": trimmed, "large_over_small": round(
                trimmed["large"]["peak_rss_mib"] / trimmed["small"]["peak_rss_mib"], 4)}
        if not args.no_diagnose:
            details |= diagnose(args, bench, corpora, instrumented, env)
        bench.finish(round(peak["large"] / peak["small"], 4), details=details)


def diagnose(args, bench, corpora: dict, instrumented, env) -> dict:
    """Part 2 of the docstring: the instrumented captures, their notes, the embedding probe."""
    diag = {}
    cases = {"small": corpora["small"], "large": corpora["large"]}
    if args.long_doc_tokens:
        cases["small_long_documents"] = corpus_for(args.model, args.tokens, args.long_doc_tokens)
    for k, data in cases.items():
        res, trace = instrumented(k, data)
        diag[k] = {"summary": summarize(trace) | {"child_peak_rss_mib": round(res["peak_rss_mib"], 1)},
                   "trace": trace["trace"]}
        print(f"diagnose {k}: {diag[k]['summary']}", flush=True)
    loaded = next(s for s in diag["small"]["trace"] if s["at"] == "model loaded")
    kvb = kv_bytes_per_token(loaded["attention"])
    sm, lg = diag["small"]["summary"], diag["large"]["summary"]
    notes = {
        "child_peak_large_over_small": round(lg["child_peak_rss_mib"] / sm["child_peak_rss_mib"], 4),
        "hwm_large_minus_small": round(lg["hwm_end"] - sm["hwm_end"], 1),
        "embedding_resident_large_minus_small": round(lg["embedding_resident_end"] - sm["embedding_resident_end"], 1),
        "anon_peak_large_over_small": round(lg["anon_peak"] / sm["anon_peak"], 4),
        "hwm_minus_embedding_resident_large_over_small": round(
            (lg["hwm_end"] - lg["embedding_resident_end"]) / (sm["hwm_end"] - sm["embedding_resident_end"]), 4),
        "kv_cache_full_layers_mib_at_doc_tokens": round(kvb["full_bytes_per_token"] * args.doc_tokens / 2**20, 1),
    }
    if "small_long_documents" in diag:
        lo = diag["small_long_documents"]["summary"]
        notes |= {
            "kv_cache_full_layers_mib_at_long_doc_tokens": round(kvb["full_bytes_per_token"] * args.long_doc_tokens
                                                                 / 2**20, 1),
            "hwm_long_documents_minus_small": round(lo["hwm_end"] - sm["hwm_end"], 1),
            "anon_peak_long_documents_minus_small": round(lo["anon_peak"] - sm["anon_peak"], 1),
        }
    # the embedding alone: how much of it a corpus' token ids map in, in a fresh process each
    probe_cases = {"small": corpora["small"], "large": corpora["large"]}
    if args.old_tokens:
        tok = tokenizer(args.model)
        for k, n in (("old_bench_small", args.old_tokens), ("old_bench_large", 5 * args.old_tokens)):
            probe_cases[k] = old_bench_corpus(tok, n, OUT / "corpora" / f"oldbench-{short(args.model)}-{n}")
    probe = {}
    for k, data in probe_cases.items():
        res = run_measured([sys.executable, __file__, "--child-embed", "--model", args.model, "--data", str(data),
                            "--store", str(bench.store), "--threads", str(args.threads)], env=env)
        probe[k] = json.loads(res["stdout"].strip().splitlines()[-1])
        print(f"embedding probe {k}: {probe[k]}", flush=True)
    return {"kv_cache": kvb, "diagnosis": diag, "diagnosis_notes": notes, "embedding_probe": probe}


if __name__ == "__main__":
    main()
