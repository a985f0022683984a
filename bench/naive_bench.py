"""The naive peer at equal tokens (figure "naive"): dump every late layer's inputs to disk, then lstsq per layer.

    .venv/bin/python bench/naive_bench.py --model builtin:smollm2-135m --tokens 8192 [--alpha 1e-3] \
        [--doc-tokens 2048] [--chunk 1024] [--store DIR] [--out FILE]

ridgefill: `ridgefill capture MODEL --data CORPUS --chunk C --held-out 1` then `ridgefill solve ID --alpha A`
(one alpha; solve still scores it on the held-out rows), each a child process with a fresh store.

The naive peer, what reference studies do, two child processes of this script:
- dump (`--child-dump`): the capture's calibration documents (its documents.json says which), tokenized by capture's
  own code and cut to the same length, each fed whole in one forward of the decoder stack (every layer, no KV
  cache; `--naive-chunk N`: N tokens at a time through a DynamicCache instead, to tell the forward's float32
  rounding apart from the statistics'), the package's forward pre-hooks (`layer_inputs`) taking the input of every
  layer l >= S (the split state h_S is layer S's input); each document's first row is dropped; rows go to one
  float32 .npy memmap per layer. So that both fit the same rows, a mask marks the rows capture fits: capture also
  leaves out a row whose split state is an outlier by norm among the rows of its chunk
  (`ridgefill.runtime.rows.outlier_rows`, with the capture's chunk and ratio from its recipe);
- solve (`--child-solve`): per late layer, float64, the masked rows, centred X and Y_l (intercept from the means)
  and `numpy.linalg.lstsq` on the augmented system [X_c; sqrt(lambda) I] W^T = [Y_c; 0], with the lambda that
  ridgefill's solve reports for A; maps saved as .npy.

Value: naive / ridgefill wall (sum of the children), peak RSS (largest child, os.wait4's ru_maxrss) and disk bytes
(capture + solve artifacts against the dump + maps), and the agreement, max over layers of
||W_naive - W_ridgefill||_F / ||W_naive||_F (its target: bench/harness.py's FIGURES); the same for the biases in
the details. Check: both fitted the same number of rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (Bench, corpus_for, dir_bytes, env_threads, exe, load, model_cache, parser,  # noqa: E402
                     positive, run_measured, set_threads)


def fitted_rows(h, chunk: int, ratio: float):
    """Which dumped rows of one document capture fits: h [n - 1, d] are its split states from row 1 on (row 0, the
    sink, is never dumped); capture's chunks are positions [start, start + chunk), and within each it leaves out the
    rows that `outlier_rows` marks among that chunk's rows. Returns [n - 1] bool."""
    import numpy as np
    import torch

    from ridgefill.capture.units import SKIP_FIRST
    from ridgefill.runtime.rows import outlier_rows

    n = len(h) + SKIP_FIRST
    keep = np.ones(len(h), dtype=bool)
    for start in range(0, n, chunk):
        a, b = max(start, SKIP_FIRST) - SKIP_FIRST, min(start + chunk, n) - SKIP_FIRST
        keep[a:b] = ~outlier_rows(torch.from_numpy(np.asarray(h[a:b])), ratio).numpy()
    return keep


def child_dump(args) -> None:
    import numpy as np
    import torch
    from numpy.lib.format import open_memmap

    from ridgefill.artifacts import Store
    from ridgefill.capture.artifact import documents, tokenize
    from ridgefill.capture.corpus import read_corpus
    from ridgefill.capture.units import SKIP_FIRST, make_units
    from ridgefill.models.hooks import layer_inputs

    t0 = time.perf_counter()
    ref, lm = load(args.model, args.store)
    load_s = time.perf_counter() - t0
    cap = Store(args.store).get(args.capture, stage="capture")
    corpus = read_corpus([str(args.data)])
    calib = [i for i, d in enumerate(documents(cap)) if d["role"] == "calibration"]
    tokens = tokenize(lm.tokenizer, corpus, False, cap.recipe["max_length"] or lm.context_length())
    ids = [tokens["raw"][u.doc].astype(np.int64) for u in make_units(tokens, calib, [], 0)]  # capture's documents
    rows = sum(len(x) - SKIP_FIRST for x in ids)
    split = cap.recipe["splits"][0]
    layers = list(range(split, ref.num_layers))
    d = ref.hidden_size
    args.dump.mkdir(parents=True, exist_ok=True)
    out = {l: open_memmap(args.dump / f"h{l}.npy", mode="w+", dtype=np.float32, shape=(rows, d)) for l in layers}
    keep = np.ones(rows, dtype=bool)
    at = 0
    t1 = time.perf_counter()
    with torch.inference_mode(), layer_inputs(lm.adapter.layers, layers, stop=False) as seen:  # every layer runs
        for x in ids:
            first = at
            step = args.naive_chunk or len(x)  # one shot: no cache
            cache = None
            if args.naive_chunk:
                from transformers import DynamicCache

                cache = DynamicCache(config=lm.model.config)
            for start in range(0, len(x), step):
                lm.adapter.base(input_ids=torch.from_numpy(x[start : start + step])[None], cache=cache,
                                use_cache=cache is not None)
                skip = SKIP_FIRST if start == 0 else 0
                n = seen[layers[0]].shape[1] - skip
                for l in layers:
                    out[l][at : at + n] = seen[l][0, skip:].float().numpy()
                at += n
            keep[first:at] = fitted_rows(out[split][first:at], cap.recipe["chunk"], cap.recipe["outlier_ratio"])
    assert at == rows, (at, rows)
    for m in out.values():
        m.flush()
    np.save(args.dump / "fitted.npy", keep)
    print(json.dumps({"rows_dumped": rows, "rows": int(keep.sum()), "documents": len(ids), "layers": layers,
                      "load_s": round(load_s, 2), "forward_s": round(time.perf_counter() - t1, 2)}))


def child_solve(args) -> None:
    import numpy as np

    layers = sorted(int(p.stem[1:]) for p in args.dump.glob("h*.npy"))
    split = layers[0]
    keep = np.load(args.dump / "fitted.npy")
    t = time.perf_counter()
    x = np.load(args.dump / f"h{split}.npy", mmap_mode="r")[keep].astype(np.float64)
    n, d = x.shape
    mean_x = x.mean(axis=0)
    a = np.vstack([x - mean_x, math.sqrt(args.lam) * np.eye(d)])  # [n + d, d]
    del x
    args.maps.mkdir(parents=True, exist_ok=True)
    for l in layers:
        y = np.load(args.dump / f"h{l}.npy", mmap_mode="r")[keep].astype(np.float64)
        mean_y = y.mean(axis=0)
        b = np.vstack([y - mean_y, np.zeros((d, y.shape[1]))])
        del y
        wt = np.linalg.lstsq(a, b, rcond=None)[0]  # [d_in, d_out]
        w = np.ascontiguousarray(wt.T)
        np.save(args.maps / f"w{l}.npy", w)
        np.save(args.maps / f"b{l}.npy", mean_y - w @ mean_x)
        del b
    print(json.dumps({"rows": n, "layers": layers, "lambda": args.lam, "solve_s": round(time.perf_counter() - t, 2)}))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=positive, default=8192)
    ap.add_argument("--doc-tokens", type=positive, default=2048)
    ap.add_argument("--chunk", type=positive, default=1024)
    ap.add_argument("--alpha", type=float, default=1e-3, help="ridgefill solve --alpha; the naive peer uses its lambda")
    ap.add_argument("--product-dtype", default="float32", choices=("float32", "float64"),
                    help="ridgefill capture --product-dtype")
    ap.add_argument("--naive-chunk", type=int, default=0,
                    help="the naive dump's forward: 0 = each document in one shot; N = N tokens at a time through a "
                         "KV cache")
    ap.add_argument("--child-dump", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-solve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--capture", help=argparse.SUPPRESS)
    ap.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--maps", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--lam", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_dump or args.child_solve:
        set_threads(args.threads)
        return child_dump(args) if args.child_dump else child_solve(args)

    with Bench("naive", args, args.model) as bench:
        from ridgefill.artifacts import Store
        from ridgefill.solve.artifact import REPORT, load_maps

        ref = model_cache(bench.store, args.model)
        corpus = corpus_for(args.model, args.tokens, args.doc_tokens)
        env = env_threads(args.threads)

        # ridgefill: capture + solve with one alpha
        st = bench.fresh_store("ridgefill")
        cap = run_measured([exe(), "capture", args.model, "--data", str(corpus), "--chunk", str(args.chunk),
                            "--held-out", "1", "--product-dtype", args.product_dtype, "--store", str(st), "--json"],
                           env=env)
        cap_id = json.loads(cap["stdout"])["id"]
        sol = run_measured([exe(), "solve", cap_id, "--alpha", repr(args.alpha), "--store", str(st), "--json"], env=env)
        cap_art = Store(st).get(cap_id, stage="capture")
        sol_art = Store(st).get(json.loads(sol["stdout"])["id"], stage="solve")
        report = json.loads(sol_art.file(REPORT).read_text())
        split, lam = report["split"], report["lambda"]
        print(f"ridgefill: capture {cap['wall_s']:.1f} s, solve {sol['wall_s']:.1f} s, lambda {lam:.6g}", flush=True)

        # naive: dump, then lstsq (the dump reads the model and the capture's record from the same store)
        dump, maps = bench.scratch / "dump", bench.scratch / "maps"
        me = [sys.executable, __file__, "--model", args.model, "--threads", str(args.threads)]
        dmp = run_measured(me + ["--child-dump", "--store", str(st), "--capture", cap_id, "--data", str(corpus),
                                 "--dump", str(dump), "--naive-chunk", str(args.naive_chunk)], env=env)
        slv = run_measured(me + ["--child-solve", "--dump", str(dump), "--maps", str(maps), "--lam", repr(lam)],
                           env=env)
        dinfo = json.loads(dmp["stdout"].strip().splitlines()[-1])
        sinfo = json.loads(slv["stdout"].strip().splitlines()[-1])
        print(f"naive: dump {dmp['wall_s']:.1f} s, lstsq {slv['wall_s']:.1f} s", flush=True)

        # agreement
        import numpy as np

        fitted = load_maps(sol_art)
        per_layer = {}
        for l in sinfo["layers"]:
            wn, bn = np.load(maps / f"w{l}.npy"), np.load(maps / f"b{l}.npy")
            wr, br = (a.astype(np.float64) for a in fitted[l])
            per_layer[str(l)] = {"w_rel_fro": float(np.linalg.norm(wn - wr) / np.linalg.norm(wn)),
                                 "b_rel": float(np.linalg.norm(bn - br) / np.linalg.norm(bn))}
        worst_w = max(v["w_rel_fro"] for v in per_layer.values())
        worst_b = max(v["b_rel"] for v in per_layer.values())
        rf_wall, nv_wall = cap["wall_s"] + sol["wall_s"], dmp["wall_s"] + slv["wall_s"]
        rf_rss, nv_rss = max(cap["peak_rss_mib"], sol["peak_rss_mib"]), max(dmp["peak_rss_mib"], slv["peak_rss_mib"])
        rf_disk = dir_bytes(cap_art.path) + dir_bytes(sol_art.path)
        nv_disk = dir_bytes(dump) + dir_bytes(maps)
        details = {
            "corpus": str(corpus), "doc_tokens": args.doc_tokens, "chunk": args.chunk, "alpha": args.alpha,
            "lambda": lam, "split": split, "late_layers": len(sinfo["layers"]), "product_dtype": args.product_dtype,
            "threads": args.threads or None,
            "naive_forward": (f"chunks of {args.naive_chunk} through a KV cache" if args.naive_chunk
                              else "one shot per document"),
            "rows": {"ridgefill": report["rows"], "naive": sinfo["rows"]},
            "ridgefill": {"capture_wall_s": round(cap["wall_s"], 2), "solve_wall_s": round(sol["wall_s"], 2),
                          "wall_s": round(rf_wall, 2), "capture_peak_rss_mib": round(cap["peak_rss_mib"], 1),
                          "solve_peak_rss_mib": round(sol["peak_rss_mib"], 1), "peak_rss_mib": round(rf_rss, 1),
                          "disk_bytes": rf_disk, "capture_bytes": dir_bytes(cap_art.path),
                          "solve_bytes": dir_bytes(sol_art.path)},
            "naive": {"dump_wall_s": round(dmp["wall_s"], 2), "lstsq_wall_s": round(slv["wall_s"], 2),
                      "wall_s": round(nv_wall, 2), "dump_peak_rss_mib": round(dmp["peak_rss_mib"], 1),
                      "lstsq_peak_rss_mib": round(slv["peak_rss_mib"], 1), "peak_rss_mib": round(nv_rss, 1),
                      "disk_bytes": nv_disk, "dump_bytes": dir_bytes(dump), "maps_bytes": dir_bytes(maps),
                      "dump": dinfo, "solve": sinfo},
            "agreement": {"max_w_rel_fro": worst_w, "max_b_rel": worst_b, "per_layer": per_layer},
            "scaling": {"naive_dump_bytes_per_row": dir_bytes(dump) // max(1, dinfo["rows_dumped"]),
                        "naive_lstsq_float64_bytes_per_row": 8 * 3 * ref.hidden_size,  # X, [X_c; sqrt(lambda) I], one Y
                        "ridgefill_capture_bytes_fixed": "stats: (k + 1) d^2 float64 per split; held-out rows "
                                                         "fixed by --held-out-rows; neither grows with the "
                                                         "calibration tokens",
                        "rows": sinfo["rows"]},
        }
        value = {"wall": round(nv_wall / rf_wall, 3), "peak_rss": round(nv_rss / rf_rss, 3),
                 "disk": round(nv_disk / rf_disk, 3), "agreement": float(f"{worst_w:.3g}")}
        bench.finish(value, details=details, checks={"same rows fitted": report["rows"] == sinfo["rows"]})


if __name__ == "__main__":
    main()
