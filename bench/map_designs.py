"""Map designs against today's key/value maps at one split (figure "map_designs"): the held-out key and value
cosines of each candidate fill of the late layers, at its own best ridge penalty, and its cost per filled row. A
screen, before any design is built into solve and the runtime: a design that cannot beat today's maps here, on the
rows they were fitted for, has nothing to offer eval's needles.

    .venv/bin/python bench/map_designs.py --model builtin:qwen2.5-coder-1.5b --split 14 [--dtype bfloat16]
        [--offsets 1 2 4 7] [--stacks 7,13 ...] [--compare 15 17 21] [--max-tokens 65536] [--held-out 4]
        [--held-rows 4096] [--exact-share 0.1] [--chunk 1024] [--threads 2]

One pass of the model over the built-in calibration text (builtin:default; its held-out documents as capture picks
them: `--held-out`, seed 0), document by document through the KV cache in `--chunk`-token chunks as capture feeds
it, documents taken in order until `--max-tokens`. On the rows a capture fits (a document's first row and the rows
whose split state is a norm outlier left out) it accumulates, as capture does (float32 products, float64 totals),
the moments of each design's state against every late attention layer's keys (before RoPE and the key norm) and
values; on `--held-rows` rows of the held-out documents, evenly spaced, it keeps each state and the late layers'
true inputs. Every design is a key/value map per late layer, `kv_hat_l = W_l x + b_l`, fitted in closed form from
those moments (solve/ridge.py), and scored on the held-out rows as solve scores a fit (solve/score.py: per KV head,
the cosine of what the layer writes from the prediction and from its true input; score = (K cos + V cos) / 2):

- `base`: x = h_S, today's maps: one alpha for every layer (solve's grid and open-edge search), and `base/layer`,
  one per layer (`--alpha-per-layer`).
- `base/head`: one alpha per late layer and per KV head of its keys and of its values, each chosen on that head's
  own cosine (ridge decouples over output columns: a per-head fit is a per-head penalty).
- `two-state k`: x = [h_S; c h_{S-k}] for each offset k, the early layers' earlier state beside the split's (free:
  the early layers run exactly), c scaling it to h_S's mean square so that one penalty means the same to both;
  one alpha, and one per layer. `--stacks 7,13` adds more states: x = [h_S; c_7 h_{S-7}; c_13 h_{S-13}].
- `normalized`: x = h_S / rms(h_S), the split state at unit root mean square per row (every late layer reads its
  input through an RMS norm, so what it writes depends on its input's direction more than on its size; cost: one
  norm per row).
- `split C` for each `--compare` split C: today's maps at C (the yardstick: a design at S as good as today's at C
  buys the layers between them).
- `anchor C-1 (bound)`: a second anchor's upper bound. The second anchor runs one late layer R exactly on every row,
  on its predicted input, and predicts the layers after R from its output; were that output exact, the layers from
  C = R + 1 would score as today's maps at split C: the bound is the base maps' scores on layers S..R beside split C's
  on the rest. Its cost is one whole layer per row, as split S + 1's.
- `exact by predicted error`: the base maps; per held-out row its error, 1 - its score over the late layers; a ridge
  predictor of that error from [h_S, log |h_S|], fitted on half the held-out documents, picks `--exact-share` of the
  other half's rows to run exactly (their cosine 1); against as many rows drawn at random (the mean of 200 draws)
  and against the rows with the largest true error (the oracle).

Means are over the late layers of S and also over the layers from the deepest compared split (the same layers for
every design: a shallower split's mean includes its first late layers, which are easy). Costs per filled row and
late attention layer, in multiply-accumulates: a key/value map d * 2kv; two states 2d * 2kv; beside them one whole
layer's projections (what a row that runs a layer exactly costs, attention left out). Value: the figures per
design; details: per layer, the alphas, the row counts and timings.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import MODEL_CACHE, Bench, load, parser, positive  # noqa: E402

ROUND = 6


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="builtin:qwen2.5-coder-1.5b")
    ap.add_argument("--split", type=positive, default=14)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--offsets", type=positive, nargs="*", default=[1, 2, 4, 7])
    ap.add_argument("--stacks", nargs="*", default=[], metavar="K,K,...",
                    help="more than two states: x = [h_S; h_{S-k} for each k], e.g. 7,13")
    ap.add_argument("--compare", type=positive, nargs="*", default=[15, 17, 21])
    ap.add_argument("--max-tokens", type=positive, default=65536, help="calibration tokens at most")
    ap.add_argument("--held-out", type=positive, default=4)
    ap.add_argument("--held-rows", type=positive, default=4096)
    ap.add_argument("--exact-share", type=float, default=0.1)
    ap.add_argument("--chunk", type=positive, default=1024)
    args = ap.parse_args()
    with Bench("map_designs", args, args.model) as bench:
        t0 = time.perf_counter()
        ref, lm = load(args.model, MODEL_CACHE, args.dtype)
        S, L = args.split, ref.num_layers
        args.stacks = [tuple(int(k) for k in spec.split(",")) for spec in args.stacks]
        offsets = {k for ks in args.stacks for k in ks} | set(args.offsets)
        if not 0 < S < L or any(not 0 < S - k for k in offsets) or any(not S < c < L for c in args.compare):
            raise SystemExit(f"map_designs: split {S}, offsets {args.offsets} and compared splits {args.compare} "
                             f"must fit the model's {L} layers")
        load_s = time.perf_counter() - t0
        pass_ = feed(lm, args)
        value, details = designs(lm, pass_, args)
        details |= {"load_s": load_s, "dtype": args.dtype, "split": S, "layers": L}
        bench.finish(value, details=details)


# ---------------------------------------------------------------------------------------------- the pass


class Pass:
    """What the pass over the text keeps: moments per state {name: Moments of x against the late layers' keys and
    values} and the held-out rows {name: [R, d] per state, "y.<l>": the late layers' true inputs, "doc": [R]}."""

    def __init__(self):
        self.moments: dict = {}
        self.held: dict[str, list] = {}
        self.tokens = self.rows = self.held_docs = 0
        self.seconds = 0.0


def stacked(args) -> dict[str, tuple[int, ...]]:
    """The designs of several states by name: each offset alone ("two-state k"), then each --stacks entry."""
    return {f"two-state {k}": (k,) for k in args.offsets} | {f"states {'+'.join(map(str, ks))}": ks
                                                             for ks in args.stacks}


def states(hs: dict, S: int, args) -> dict:
    """Each design's state for one chunk's rows: {name: tensor [rows, dx]}, its scale applied later."""
    import torch

    out = {"base": hs[S]}
    out["normalized"] = hs[S] / hs[S].float().square().mean(-1, keepdim=True).sqrt().to(hs[S].dtype)
    for name, ks in stacked(args).items():
        out[name] = torch.cat([hs[S], *(hs[S - k] for k in ks)], dim=1)
    for c in args.compare:
        out[f"split {c}"] = hs[c]
    return out


def feed(lm, args) -> Pass:
    import numpy as np
    import torch

    from ridgefill.capture import forward
    from ridgefill.capture.artifact import tokenize
    from ridgefill.capture.corpus import BUILTIN, read_corpus, split_held_out
    from ridgefill.capture.stats import merge_into
    from ridgefill.capture.units import SKIP_FIRST
    from ridgefill.runtime.rows import OUTLIER_RATIO, outlier_rows

    ad, S, L = lm.adapter, args.split, lm.adapter.num_layers
    attn = [l for l in range(S, L) if not ad.is_linear(l)]
    layers = sorted({*range(S, L), *(S - k for ks in stacked(args).values() for k in ks), *args.compare})
    corpus = read_corpus([BUILTIN])
    calib, held = split_held_out(corpus.documents, args.held_out, 0)
    ids = tokenize(lm.tokenizer, corpus, chat=False, max_length=None)["raw"]
    held_total = sum(len(ids[i]) - SKIP_FIRST for i in held)
    stride = max(1, -(-held_total // args.held_rows))
    p = Pass()
    t0 = time.perf_counter()
    with forward.exact_float32():
        for doc in [*held, *calib]:
            is_held = doc in held
            if not is_held and p.tokens >= args.max_tokens:
                continue
            for start, hs in forward.document_chunks(lm, ids[doc], layers, args.chunk, ad.device):
                skip = SKIP_FIRST if start == 0 else 0
                hs = {l: h[skip:] for l, h in hs.items()}
                keep = ~outlier_rows(hs[S], OUTLIER_RATIO)
                if is_held:
                    pos = torch.arange(start + skip, start + skip + hs[S].shape[0])
                    keep &= pos % stride == 0
                    for name, x in states(hs, S, args).items():
                        p.held.setdefault(name, []).append(x[keep].float().numpy())
                    for l in range(S, L):
                        p.held.setdefault(f"y.{l}", []).append(hs[l][keep].float().numpy())
                    p.held.setdefault("doc", []).append(np.full(int(keep.sum()), doc, dtype=np.int32))
                    continue
                targets = {l: ad.kv_target(l, hs[l][keep]) for l in attn}
                for name, x in states(hs, S, args).items():
                    first = int(name.split()[1]) if name.startswith("split") else S
                    got = forward.grouped_moments(x[keep], [[targets[l] for l in attn if l >= first]])[0]
                    p.moments[name] = got if name not in p.moments else merge_into(p.moments[name], got)
                p.tokens += hs[S].shape[0] + skip
                p.rows += int(keep.sum())
            p.held_docs += is_held
            print(f"map_designs: document {doc} ({len(ids[doc])} tokens), {p.tokens} calibration tokens, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    forward.release_workspace()
    p.held = {k: np.concatenate(v) for k, v in p.held.items()}
    p.seconds = time.perf_counter() - t0
    return p


# ---------------------------------------------------------------------------------------------- the designs


def designs(lm, p: Pass, args) -> tuple[dict, dict]:
    import numpy as np

    from ridgefill.capture.stats import KV
    from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose, maps_at, maps_per_layer, search
    from ridgefill.solve.score import Scorer, layer_objective

    ad, S, L = lm.adapter, args.split, lm.adapter.num_layers
    common = max([S, *args.compare])
    out, details = {}, {"tokens": p.tokens, "rows": p.rows, "held_rows": int(len(p.held["doc"])),
                        "held_docs": p.held_docs, "pass_s": p.seconds, "designs": {}}

    def scorer(first: int, x) -> Scorer:
        held = {f"hidden.{l}": p.held[f"y.{l}"] for l in range(first, L)}  # hidden.<first>: its state, x's first part
        sc = Scorer(ad, held, first, L, {l: KV for l in range(first, L)})
        sc.x = x.astype(np.float64)
        return sc

    def summary(scores: dict) -> dict:
        layers = {int(l): v for l, v in scores["layers"].items()}
        def mean(ls):
            return {m: round(float(np.mean([layers[l][m] for l in ls])), ROUND) for m in ("k_cosine", "v_cosine")}
        late, deep = mean(sorted(layers)), mean([l for l in layers if l >= common])
        return {"late": late | {"score": round((late["k_cosine"] + late["v_cosine"]) / 2, ROUND)},
                f"from {common}": deep | {"score": round((deep["k_cosine"] + deep["v_cosine"]) / 2, ROUND)},
                "layers": {l: {m: round(v[m], ROUND) for m in ("k_cosine", "v_cosine")} for l, v in layers.items()}}

    def fit(name: str, first: int, scale=None) -> tuple:
        m, x = p.moments[name], p.held[name]
        if scale is not None:  # x -> D x: Cxx -> D Cxx D, Cxy -> D Cxy, means scaled
            m.cxx *= scale[:, None] * scale[None, :]
            m.cxy *= scale[None, :, None]
            m.mean_x = m.mean_x * scale
            x = x * scale
        t0 = time.perf_counter()
        e = decompose(m)
        sc = scorer(first, x)
        grid_scores = {}

        def score_of(a: float) -> dict:
            w, b = maps_at(e, a)
            s = sc.score(list(w), list(b))
            grid_scores[a] = [layer_objective(v, "kv") for v in s["layers"].values()]
            return {"score": layer_objective(s["mean"], "kv"), "scores": s}

        grid, best, _ = search(DEFAULT_ALPHAS, score_of)
        one = summary(best["scores"]) | {"alpha": best["alpha"]}
        # per layer: each layer's best of the alphas scored (the shared search's grid, its extensions included)
        alphas = [max(grid_scores, key=lambda a, i=i: (grid_scores[a][i], -a)) for i in range(L - first)]
        w, b = maps_per_layer(e, alphas)
        per = summary(sc.score(list(w), list(b))) | {"alpha": dict(zip(range(first, L), alphas))}
        return e, sc, one, per, best, time.perf_counter() - t0

    e, sc, one, per, best, secs = fit("base", S)
    out["base"], out["base/layer"] = one["late"]["score"], per["late"]["score"]
    details["designs"]["base"] = {"one_alpha": one, "per_layer": per, "solve_s": secs}
    details["designs"]["base/head"] = per_head(ad, e, sc, summary)
    out["base/head"] = details["designs"]["base/head"]["late"]["score"]
    w, b = maps_at(e, best["alpha"])
    details["designs"]["exact by predicted error"] = exact_by_error(sc, list(w), list(b), p, args)
    _, _, one, per, _, secs = fit("normalized", S)
    out["normalized"], out["normalized/layer"] = one["late"]["score"], per["late"]["score"]
    details["designs"]["normalized"] = {"one_alpha": one, "per_layer": per, "solve_s": secs}
    d = ad.hidden_size
    for name, ks in stacked(args).items():  # each earlier state scaled to h_S's mean square
        trace = np.diagonal(p.moments[name].cxx).reshape(len(ks) + 1, d).sum(1)
        scale = (trace[0] / trace) ** 0.5
        _, _, one, per, _, secs = fit(name, S, np.repeat(scale, d))
        out[name], out[f"{name}/layer"] = one["late"]["score"], per["late"]["score"]
        details["designs"][name] = {"one_alpha": one, "per_layer": per, "scale": scale[1:].tolist(), "solve_s": secs}
    for c in args.compare:
        _, _, one, per, _, secs = fit(f"split {c}", c)
        out[f"split {c}"], out[f"split {c}/layer"] = one["late"]["score"], per["late"]["score"]
        details["designs"][f"split {c}"] = {"one_alpha": one, "per_layer": per, "solve_s": secs}
    details[f"score from {common}"] = {
        f"{name}{suffix}": d[key][f"from {common}"]["score"] for name, d in details["designs"].items()
        for key, suffix in (("one_alpha", ""), ("per_layer", "/layer")) if key in d}
    details[f"score from {common}"]["base/head"] = details["designs"]["base/head"][f"from {common}"]["score"]
    for c in args.compare:  # the second anchor's upper bound: layer c - 1 run on a perfect input, c.. from its output
        if c - 1 > S:
            base_l, after = details["designs"]["base"]["one_alpha"]["layers"], details["designs"][f"split {c}"]
            layers = {l: base_l[l] for l in base_l if l < c} | after["one_alpha"]["layers"]
            score = float(np.mean([(v["k_cosine"] + v["v_cosine"]) / 2 for v in layers.values()]))
            out[f"anchor {c - 1} (bound)"] = round(score, ROUND)
    d, kv = ad.hidden_size, ad.kv_width
    layer = 2 * d * ad.num_heads * ad.head_dim + d * kv + 3 * d * int(ad.config.intermediate_size)
    details["macs_per_filled_row_and_layer"] = {"kv map": d * kv, "two-state map": 2 * d * kv, "whole layer": layer}
    return out, details


def per_head(ad, e, sc, summary) -> dict:
    """One alpha per late layer and per KV head of its keys and of its values, each the best of the grid on its
    own cosine (ridge decouples over output columns, so each group's map is its columns of that alpha's map)."""
    import numpy as np

    from ridgefill.solve.ridge import DEFAULT_ALPHAS, maps_at
    from ridgefill.solve.score import _cos as cosine

    heads, hd = ad.num_kv_heads, ad.head_dim
    best: dict = {}  # (i, part, h) -> (score, alpha, w rows, b rows)
    for a in DEFAULT_ALPHAS:
        w, b = maps_at(e, a)
        for i, l in enumerate(sc.layers):
            k, v = sc._kv_of_prediction(l, sc.x @ w[i].T + b[i])
            kt, vt = sc.true_kv[l]
            for part, got, true in (("k", k, kt), ("v", v, vt)):
                for h in range(heads):
                    cos = float(np.mean(cosine(got[:, h], true[:, h])))
                    cols = slice((part == "v") * heads * hd + h * hd, (part == "v") * heads * hd + (h + 1) * hd)
                    key = (i, part, h)
                    if key not in best or cos > best[key][0]:
                        best[key] = (cos, a, w[i][cols], b[i][cols])
    ws, bs = [], []
    for i in range(len(sc.layers)):
        groups = [best[(i, part, h)] for part in ("k", "v") for h in range(heads)]
        ws.append(np.concatenate([g[2] for g in groups]))
        bs.append(np.concatenate([g[3] for g in groups]))
    out = summary(sc.score(ws, bs))
    out["alpha"] = {f"{sc.layers[i]}.{part}{h}": a for (i, part, h), (_, a, _, _) in sorted(best.items())}
    return out


def exact_by_error(sc, w, b, p: Pass, args) -> dict:
    """Exact rows chosen by a predicted map error, against random rows and the oracle, at one share of the rows."""
    import numpy as np

    from ridgefill.solve.score import _cos as cosine

    rows = []
    for i, l in enumerate(sc.layers):
        k, v = sc._kv_of_prediction(l, sc.x @ w[i].T + b[i])
        kt, vt = sc.true_kv[l]
        rows.append((cosine(k, kt).mean(-1) + cosine(v, vt).mean(-1)) / 2)  # [R]
    score = np.mean(rows, axis=0)  # [R]: the row's score over the late layers
    err = 1.0 - score
    docs = p.held["doc"]
    order = sorted(set(docs.tolist()))
    fit_on = np.isin(docs, order[: len(order) // 2])
    test = ~fit_on
    h = p.held["base"].astype(np.float64)
    feats = np.concatenate([h, np.log(np.linalg.norm(h, axis=1, keepdims=True))], axis=1)
    mu, sd = feats[fit_on].mean(0), feats[fit_on].std(0) + 1e-12
    z = (feats - mu) / sd
    best = None
    for alpha in (1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0):  # chosen on the fit half by leave-nothing-out: report all
        a = z[fit_on].T @ z[fit_on] + alpha * fit_on.sum() * np.eye(z.shape[1])
        coef = np.linalg.solve(a, z[fit_on].T @ (err[fit_on] - err[fit_on].mean()))
        pred = z[test] @ coef
        corr = float(np.corrcoef(pred, err[test])[0, 1])
        if best is None or corr > best["corr"]:
            best = {"alpha": alpha, "corr": corr, "pred": pred}
    n = max(1, int(round(args.exact_share * test.sum())))
    s_test = score[test]

    def with_exact(idx) -> float:
        s = s_test.copy()
        s[idx] = 1.0
        return float(s.mean())

    rng = np.random.default_rng(0)
    random = float(np.mean([with_exact(rng.choice(len(s_test), n, replace=False)) for _ in range(200)]))
    return {"share": args.exact_share, "test_rows": int(test.sum()), "exact_rows": n,
            "predictor": {"alpha": best["alpha"], "corr_with_error": round(best["corr"], 4)},
            "score_none": round(float(s_test.mean()), ROUND),
            "score_predicted": round(with_exact(np.argsort(-best["pred"])[:n]), ROUND),
            "score_random": round(random, ROUND),
            "score_oracle": round(with_exact(np.argsort(-(1.0 - s_test))[:n]), ROUND)}


if __name__ == "__main__":
    main()
