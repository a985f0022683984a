"""`ridgefill fold COMPACT`: fold a biased compacted cache into a plain one (docs/cache.md, docs/method.md).

Per compacted (layer, KV head): `u = fold_direction(fit queries)`, keys `k' = k + (beta / s) u` rounded to the cache
dtype, values refit (float64 least squares) against the full cache's output on the fit queries. The reference
queries and the context's full keys/values are recomputed from the model with the compact artifact's own
settings (same context ids, source, hold-out, cap and seed), so the compact artifact stays small.

Report per head, on fit and held-out queries: mean and spread of `q.u`, and the attention-output relative error
against the full cache of four r-key caches: **am** (the compact cache, biased), **fold** (plain), **drop** (beta
removed, values refit) and **keep** (the kept keys with their original values). Per head a paired bootstrap over
held-out queries says whether fold is within noise of AM (the 95 % interval of the per-query squared-error
difference includes 0) or better, and whether it beats drop. `check.py` then runs the plain-cache check; when the
folded cache answers differently through the stock attention path than through the reference computation, the
fold fails (exit 1) and nothing is written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.fold import artifact
from ridgefill.fold import compaction as cmp
from ridgefill.numerics import paired_bootstrap
from ridgefill.output import Output

FORMAT_VERSION = 2  # 2: the cache records its model's fingerprint (ridgefill-cache/2)
ARMS = ("am", "fold", "drop", "keep")


@dataclass(frozen=True)
class FoldConfig:
    rho: float = 1e-3  # ridge on the query covariance, times trace(Sigma) / head_dim
    ridge: float = 1e-6  # value refit ridge, times the mean eigenvalue of A^T A
    question: str = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"
    answer_tokens: int = 24
    bootstrap: int = 2000


def fold(store: Store, compact_ref: str, cfg: FoldConfig, out: Output, model: str | None = None, *,
         place=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the fold. The model recomputes the compact's reference queries: a warning says so when
    it runs on another device kind or dtype than the compact did. Device kind and model dtype go into the recipe
    (nothing for cpu / float32)."""
    from ridgefill.models import load_model, resolve_model
    from ridgefill.models.spec import pinned_spec
    from ridgefill.models.device import recorded, warn_mixed, where

    place = place or where()
    comp = store.get(compact_ref, stage="compact")
    if not cfg.rho > 0 or cfg.ridge < 0:
        raise BadInput(f"--rho must be > 0 and --ridge >= 0 (got {cfg.rho}, {cfg.ridge})")
    if cfg.answer_tokens < 1:
        raise BadInput(f"--answer-tokens must be at least 1, got {cfg.answer_tokens}")
    recipe = {"stage": "fold", "version": FORMAT_VERSION, "compact": comp.id, **asdict(cfg), **place.recipe()}
    warn_mixed(out, f"compact {comp.id}", recorded(comp.recipe, artifact.MODEL_DTYPE), place)
    hit = store.cached("fold", recipe)
    if hit is not None:
        return hit, True
    store.verify(comp)
    spec = model or pinned_spec(comp.info["model_spec"], comp.info["model"].get("revision"))
    ref = resolve_model(spec, store_root=store.root, expect=comp.recipe["model"])
    if ref.fingerprint != comp.recipe["model"]:
        raise BadInput(f"compact {comp.id} was made with a different model (fingerprint {comp.recipe['model'][:12]}) "
                       f"than '{spec}' ({ref.fingerprint[:12]})")  # fmt: skip

    import torch

    lm = load_model(ref, store_root=store.root, trust_remote_code=comp.recipe.get("trust_remote_code", False),
                    **place.load_args())
    out.info(f"model on {place.describe()}")
    ccfg = cmp.CompactConfig(**{k: comp.recipe[k] for k in asdict(cmp.CompactConfig())})
    ids = torch.tensor(artifact.load_context(comp))
    cc, rq = cmp.prepare(lm, ids, ccfg, out)
    biased = artifact.load_cache(comp)
    folded, drop, heads = {}, {}, []
    with out.progress("fold", total=len(biased)) as bar:
        for i, (l, layer) in enumerate(biased.items()):
            if "beta" in layer:
                folded[l], drop[l], rows = fold_layer(l, layer, cc, rq, lm.adapter.attention_scaling(l), ccfg.dtype, cfg)
                heads += rows
            else:
                folded[l] = drop[l] = layer
            bar.update(i + 1, None, f"layer {i + 1}/{len(biased)}")
    report = {"heads": heads, "summary": summarize(heads)}
    from ridgefill.fold.check import plain_cache_check

    check = plain_cache_check(lm, ids, cc, biased, folded, drop, cfg, out)
    summary = {**report["summary"], "check": {arm: {k: c[k] for k in ("kl", "answer_matches_full") if k in c}
                                              for arm, c in check["arms"].items()},
               "fold_stock_equals_reference": check["fold_stock_equals_reference"]}
    with store.build("fold", recipe) as build:
        artifact.write(build.path, folded, ccfg.dtype, ids.numpy(), comp.recipe["model"])
        write_json(build.path / artifact.REPORT, report)
        write_json(build.path / artifact.CHECK, check)
        art = build.commit(info={"compact": comp.id, "model_spec": spec, "model": comp.info["model"],
                                 "context": comp.info["context"], "placement": lm.placement()},
                           summary=summary)  # fmt: skip
    return art, False


def _per_query_sq(out, ref) -> np.ndarray:
    """Per-query squared error over the mean squared norm of ref: its mean is the squared relative error."""
    return np.sum((out - ref) ** 2, axis=1) / np.mean(np.sum(ref**2, axis=1))


def fold_layer(l: int, layer: dict, cc, rq, s: float, dtype: str, cfg: FoldConfig):
    """Folded and dropped caches of one compacted layer, and the per-head report rows."""
    from ridgefill.fold.math import (attention_output, fold_direction, fold_keys, refit_values, relative_error,
                                     round_to)  # fmt: skip

    fit_q, held_q = rq.layers[l]
    fk, fv, us, dv, rows = [], [], [], [], []
    for h in range(layer["keys"].shape[0]):
        K, V = cc.keys[l][h].cpu().numpy(), cc.values[l][h].cpu().numpy()  # the full cache [N, hd] float32
        Q, Qh = fit_q[h].cpu().numpy(), held_q[h].cpu().numpy()
        k, v, beta, pos = layer["keys"][h], layer["values"][h], layer["beta"][h], layer["positions"][h]
        target = attention_output(Q, K, V, s)
        u = fold_direction(Q, cfg.rho)
        k_fold = round_to(fold_keys(k, beta, u, s), dtype)
        v_fold = round_to(refit_values(Q, k_fold, s, target, None, cfg.ridge), dtype)
        v_drop = round_to(refit_values(Q, k, s, target, None, cfg.ridge), dtype)
        caches = {"am": (k, v, beta), "fold": (k_fold, v_fold, None), "drop": (k, v_drop, None),
                  "keep": (k, round_to(V[pos], dtype), None)}
        row = {"layer": l, "head": h}
        per_query = {}
        for part, q in (("fit", Q), ("held", Qh)):
            qu = q.astype(np.float64) @ u
            row[f"qu_mean_{part}"], row[f"qu_std_{part}"] = float(qu.mean()), float(qu.std())
            ref = attention_output(q, K, V, s)
            for arm, (kk, vv, bb) in caches.items():
                o = attention_output(q, kk, vv, s, bb)
                row[f"{arm}_{part}"] = relative_error(o, ref)
                if part == "held":
                    per_query[arm] = _per_query_sq(o, ref)
        d_am = paired_bootstrap(per_query["fold"], per_query["am"], samples=cfg.bootstrap, seed=l * 1000 + h)
        row["fold_minus_am_held"] = d_am
        row["fold_within_noise_of_am"] = bool(d_am["low"] <= 0)  # not worse beyond noise (includes better)
        row["fold_better_than_drop"] = bool(row["fold_held"] < row["drop_held"])
        rows.append(row)
        fk.append(k_fold), fv.append(v_fold), us.append(u.astype(np.float32)), dv.append(v_drop)
    base = {"positions": layer["positions"]}
    folded = {**base, "keys": np.stack(fk), "values": np.stack(fv), "u": np.stack(us)}
    dropped = {**base, "keys": layer["keys"], "values": np.stack(dv)}
    return folded, dropped, rows


def summarize(heads: list[dict]) -> dict:
    """Medians and worst heads per arm (held-out error), and how often fold matches AM / beats drop."""
    if not heads:
        return {"heads": 0}
    out: dict = {"heads": len(heads), "median": {}, "worst": {}}
    for arm in ARMS:
        for part in ("fit", "held"):
            out["median"][f"{arm}_{part}"] = float(np.median([h[f"{arm}_{part}"] for h in heads]))
        worst = max(heads, key=lambda h: h[f"{arm}_held"])
        out["worst"][arm] = {"layer": worst["layer"], "head": worst["head"], "error": worst[f"{arm}_held"]}
    for part in ("fit", "held"):
        out["median"][f"qu_std_{part}"] = float(np.median([h[f"qu_std_{part}"] for h in heads]))
        out["median"][f"qu_mean_{part}"] = float(np.median([h[f"qu_mean_{part}"] for h in heads]))
    out["fold_within_noise_of_am"] = sum(h["fold_within_noise_of_am"] for h in heads)
    out["fold_better_than_drop"] = sum(h["fold_better_than_drop"] for h in heads)
    return out
