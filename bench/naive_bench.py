"""The naive peer at equal tokens (figure 4): dump every late layer's inputs to disk, then lstsq per layer.

    .venv/bin/python bench/naive_bench.py --model builtin:smollm2-135m --tokens 8192 [--alpha 1e-3] \
        [--doc-tokens 2048] [--chunk 1024] [--out bench/out/naive-smollm2-135m.json]

ridgefill: `ridgefill capture MODEL --data CORPUS --chunk C --held-out 1` then `ridgefill solve ID --alpha A`
(one alpha; solve still scores it on the held-out rows), each a child process with a fresh store.

The naive peer, what reference studies do, two child processes of this script:
- dump (`--child-dump`): the same documents (the capture's documents.json says which are calibration),
  tokenized as capture does (BOS included, truncated to the model's context), each fed whole in one forward of
  the decoder stack (every layer, no KV cache; `--naive-chunk N`: N tokens at a time through a DynamicCache
  instead, to tell the forward's float32 rounding apart from the statistics'), forward pre-hooks taking the
  input of every layer l >= S (the
  split state h_S is layer S's input); each document's first row is dropped, as ridgefill does; rows go to one
  float32 .npy memmap per layer;
- solve (`--child-solve`): per late layer, float64, centred X and Y_l (intercept from the means) and
  `numpy.linalg.lstsq` on the augmented system [X_c; sqrt(lambda) I] W^T = [Y_c; 0], with the lambda that
  ridgefill's solve reports for A; maps saved as .npy.

Figures: wall (sum of the children), peak RSS (largest child, os.wait4's ru_maxrss), disk bytes (capture + solve
artifacts against the dump + maps), the rows each fitted, and agreement max over layers of
||W_naive - W_ridgefill||_F / ||W_naive||_F (and the same for the biases); target <= 1e-4.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_STORE, OUT, corpus_for, dir_bytes, env_threads, exe, fresh_store, machine,  # noqa: E402
                    model_cache, run_measured, set_threads, short, write_json)


def child_dump(args) -> None:
    import numpy as np
    import torch
    from numpy.lib.format import open_memmap

    from ridgefill.capture.corpus import read_corpus
    from ridgefill.models import load_model, resolve_model

    t0 = time.perf_counter()
    ref = resolve_model(args.model, store_root=args.store)
    lm = load_model(ref, store_root=args.store)
    load_s = time.perf_counter() - t0
    roles = [d["role"] for d in json.loads((args.capture_dir / "documents.json").read_text())]
    docs = read_corpus([str(args.data)]).documents
    assert len(docs) == len(roles)
    context = int(getattr(lm.model.config.get_text_config(), "max_position_embeddings", 0) or 0) or None
    ids = [np.asarray(lm.tokenizer(d.text, add_special_tokens=True)["input_ids"][:context], dtype=np.int64)
           for d, r in zip(docs, roles) if r == "calibration"]
    rows = sum(len(x) - 1 for x in ids)
    layers = list(range(args.split, ref.num_layers))
    d = ref.hidden_size
    args.dump.mkdir(parents=True, exist_ok=True)
    out = {l: open_memmap(args.dump / f"h{l}.npy", mode="w+", dtype=np.float32, shape=(rows, d)) for l in layers}
    seen: dict = {}
    hooks = [lm.adapter.layers[l].register_forward_pre_hook(
        (lambda l: lambda mod, a, kw: seen.__setitem__(l, (a[0] if a else kw["hidden_states"])[0]))(l),
        with_kwargs=True) for l in layers]
    at = 0
    t1 = time.perf_counter()
    with torch.inference_mode():
        for x in ids:
            if not args.naive_chunk:
                lm.adapter.base(input_ids=torch.from_numpy(x)[None], use_cache=False)  # every layer, one shot
                n = len(x) - 1
                for l in layers:
                    out[l][at : at + n] = seen[l][1:].float().numpy()
                at += n
                seen.clear()
                continue
            from transformers import DynamicCache

            cache = DynamicCache(config=lm.model.config)
            for start in range(0, len(x), args.naive_chunk):
                lm.adapter.base(input_ids=torch.from_numpy(x[start : start + args.naive_chunk])[None], cache=cache,
                                use_cache=True)
                skip = 1 if start == 0 else 0
                n = len(seen[layers[0]]) - skip
                for l in layers:
                    out[l][at : at + n] = seen[l][skip:].float().numpy()
                at += n
                seen.clear()
    assert at == rows, (at, rows)
    for h in hooks:
        h.remove()
    for m in out.values():
        m.flush()
    print(json.dumps({"rows": rows, "documents": len(ids), "layers": layers, "load_s": round(load_s, 2),
                      "forward_s": round(time.perf_counter() - t1, 2)}))


def child_solve(args) -> None:
    import numpy as np

    layers = sorted(int(p.stem[1:]) for p in args.dump.glob("h*.npy"))
    split = layers[0]
    t = time.perf_counter()
    x = np.load(args.dump / f"h{split}.npy", mmap_mode="r").astype(np.float64)
    n, d = x.shape
    mean_x = x.mean(axis=0)
    a = np.vstack([x - mean_x, math.sqrt(args.lam) * np.eye(d)])  # [n + d, d]
    del x
    args.maps.mkdir(parents=True, exist_ok=True)
    for l in layers:
        y = np.load(args.dump / f"h{l}.npy", mmap_mode="r").astype(np.float64)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=1e-3, help="ridgefill solve --alpha; the naive peer uses its lambda")
    ap.add_argument("--product-dtype", default="float32", help="ridgefill capture --product-dtype")
    ap.add_argument("--naive-chunk", type=int, default=0,
                    help="the naive dump's forward: 0 = each document in one shot; N = N tokens at a time through a KV cache")
    ap.add_argument("--threads", type=int, default=1, help="compute threads (0: torch's default)")
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE)
    ap.add_argument("--out", type=Path, default=None, help="default bench/out/naive-<model>.json")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (dump, stores)")
    ap.add_argument("--child-dump", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-solve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--capture-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--maps", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--split", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lam", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    set_threads(args.threads)
    if args.child_dump:
        return child_dump(args)
    if args.child_solve:
        return child_solve(args)
    out_path = args.out or OUT / f"naive-{short(args.model)}.json"

    before = machine()
    ref = model_cache(args.store, args.model)
    corpus = corpus_for(args.model, args.tokens, args.doc_tokens, OUT / "corpora")
    tmp = Path(tempfile.mkdtemp(prefix="rf-naive-", dir=OUT))  # on the same disk as the store
    env = env_threads(args.threads)

    # ridgefill: capture + solve with one alpha
    st = fresh_store(tmp / "store", args.store)
    cap = run_measured([exe(), "capture", args.model, "--data", str(corpus), "--chunk", str(args.chunk),
                        "--held-out", "1", "--product-dtype", args.product_dtype, "--store", str(st), "--json"], env=env)
    cap_id = json.loads(cap["stdout"])["id"]
    sol = run_measured([exe(), "solve", cap_id, "--alpha", repr(args.alpha), "--store", str(st), "--json"], env=env)
    sol_id = json.loads(sol["stdout"])["id"]
    cap_dir, sol_dir = st / "capture" / cap_id, st / "solve" / sol_id
    report = json.loads((sol_dir / "report.json").read_text())
    split, lam = report["split"], report["lambda"]
    print(f"ridgefill: capture {cap['wall_s']:.1f} s, solve {sol['wall_s']:.1f} s, lambda {lam:.6g}", flush=True)

    # naive: dump, then lstsq
    dump, maps = tmp / "dump", tmp / "maps"
    me = [sys.executable, __file__, "--model", args.model, "--store", str(args.store), "--threads", str(args.threads)]
    dmp = run_measured(me + ["--child-dump", "--data", str(corpus), "--capture-dir", str(cap_dir), "--dump", str(dump),
                             "--split", str(split), "--naive-chunk", str(args.naive_chunk)], env=env)
    slv = run_measured(me + ["--child-solve", "--dump", str(dump), "--maps", str(maps), "--lam", repr(lam)], env=env)
    dinfo, sinfo = json.loads(dmp["stdout"].strip().splitlines()[-1]), json.loads(slv["stdout"].strip().splitlines()[-1])
    print(f"naive: dump {dmp['wall_s']:.1f} s, lstsq {slv['wall_s']:.1f} s", flush=True)

    # agreement
    import numpy as np

    from ridgefill.formats import safetensors

    arrays, _ = safetensors.load(sol_dir / "maps.safetensors")
    per_layer = {}
    for l in sinfo["layers"]:
        wn, bn = np.load(maps / f"w{l}.npy"), np.load(maps / f"b{l}.npy")
        wr, br = arrays[f"layer.{l}.weight"].astype(np.float64), arrays[f"layer.{l}.bias"].astype(np.float64)
        per_layer[str(l)] = {"w_rel_fro": float(np.linalg.norm(wn - wr) / np.linalg.norm(wn)),
                             "b_rel": float(np.linalg.norm(bn - br) / np.linalg.norm(bn))}
    worst_w = max(v["w_rel_fro"] for v in per_layer.values())
    worst_b = max(v["b_rel"] for v in per_layer.values())
    rf_wall, nv_wall = cap["wall_s"] + sol["wall_s"], dmp["wall_s"] + slv["wall_s"]
    rf_rss, nv_rss = max(cap["peak_rss_mib"], sol["peak_rss_mib"]), max(dmp["peak_rss_mib"], slv["peak_rss_mib"])
    rf_disk = dir_bytes(cap_dir) + dir_bytes(sol_dir)
    nv_disk = dir_bytes(dump) + dir_bytes(maps)
    result = {
        "figure": "naive dump + lstsq against ridgefill capture + solve at equal tokens, and the maps' agreement",
        "model": args.model, "corpus": str(corpus), "doc_tokens": args.doc_tokens, "chunk": args.chunk,
        "alpha": args.alpha, "lambda": lam, "split": split, "late_layers": len(sinfo["layers"]),
        "product_dtype": args.product_dtype, "threads": args.threads or None,
        "naive_forward": f"chunks of {args.naive_chunk} through a KV cache" if args.naive_chunk else "one shot per document",
        "rows": {"ridgefill": report["rows"], "naive": sinfo["rows"], "equal": report["rows"] == sinfo["rows"]},
        "ridgefill": {"capture_wall_s": round(cap["wall_s"], 2), "solve_wall_s": round(sol["wall_s"], 2),
                      "wall_s": round(rf_wall, 2), "capture_peak_rss_mib": round(cap["peak_rss_mib"], 1),
                      "solve_peak_rss_mib": round(sol["peak_rss_mib"], 1), "peak_rss_mib": round(rf_rss, 1),
                      "disk_bytes": rf_disk, "capture_bytes": dir_bytes(cap_dir), "solve_bytes": dir_bytes(sol_dir)},
        "naive": {"dump_wall_s": round(dmp["wall_s"], 2), "lstsq_wall_s": round(slv["wall_s"], 2),
                  "wall_s": round(nv_wall, 2), "dump_peak_rss_mib": round(dmp["peak_rss_mib"], 1),
                  "lstsq_peak_rss_mib": round(slv["peak_rss_mib"], 1), "peak_rss_mib": round(nv_rss, 1),
                  "disk_bytes": nv_disk, "dump_bytes": dir_bytes(dump), "maps_bytes": dir_bytes(maps),
                  "dump": dinfo, "solve": sinfo},
        "naive_over_ridgefill": {"wall": round(nv_wall / rf_wall, 3), "peak_rss": round(nv_rss / rf_rss, 3),
                                 "disk": round(nv_disk / rf_disk, 3)},
        "scaling": {"naive_dump_bytes_per_row": dir_bytes(dump) // max(1, sinfo["rows"]),
                    "naive_lstsq_float64_bytes_per_row": 8 * 3 * ref.hidden_size,  # X, [X_c; sqrt(lambda) I], one Y
                    "ridgefill_capture_bytes_fixed": "stats: (k + 1) d^2 float64 per split; held-out rows fixed by "
                                                     "--held-out-rows; neither grows with the calibration tokens",
                    "rows": sinfo["rows"]},
        "agreement": {"max_w_rel_fro": worst_w, "max_b_rel": worst_b, "per_layer": per_layer, "target": "<= 1e-4",
                      "passed": worst_w <= 1e-4},
        "machine_before": before, "machine_after": machine(),
    }
    write_json(out_path, result)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.model}: max ||W_naive - W_rf||_F / ||W_naive||_F = {worst_w:.2e}; wall naive/rf "
          f"{result['naive_over_ridgefill']['wall']}, RSS {result['naive_over_ridgefill']['peak_rss']}, disk "
          f"{result['naive_over_ridgefill']['disk']}; {out_path}")


if __name__ == "__main__":
    main()
