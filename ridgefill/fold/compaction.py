"""`ridgefill compact`: an Attention-Matching-style biased compacted cache of one context (docs/method.md#am-style-compaction,
docs/cache.md).

Per full-attention layer and KV head the same number `r = floor(budget * N)` of keys is kept: the ones with the
highest RMS attention over the reference queries; weights `w` in [e^-3, e^3] are fitted so the kept keys carry each
query's full attention mass (`math.fit_log_weights`), `beta = log w` stays float32, and the values are refit by
float64 least squares against the full cache's output on the same queries. Keys and values are rounded to the
cache dtype (values refit against the rounded keys). Sliding-window layers are left uncompacted: their full
keys/values are stored.

Two dtypes: the cache dtype (`--cache-dtype`, the recipe's `dtype`, bfloat16 by default) is what the stored cache is
rounded to; the model dtype (`--dtype`, the recipe's `model_dtype`, recorded with `device` unless the run is
cpu / float32) is what the model computes the context's keys, values and reference queries in.

The artifact holds `cache.safetensors` (docs/cache.md), `context.safetensors` (the context's token ids, so `fold` and
its check need no input file) and `report.json` (per head: weight-fit residuals, output error on fit and
held-out queries).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture.corpus import decode_text
from ridgefill.errors import BadInput
from ridgefill.fold import artifact
from ridgefill.fold.artifact import MODEL_DTYPE
from ridgefill.models.kinds import FULL
from ridgefill.output import Output

FORMAT_VERSION = 2  # 2: the cache records its model's fingerprint (ridgefill-cache/2)


@dataclass(frozen=True)
class CompactConfig:
    budget: float = 0.1  # share of the context's keys kept per (layer, KV head)
    source: str = "repeat"  # reference queries: "repeat" or "context"
    holdout: float = 0.2  # held-out share of query tokens (scored, never fitted)
    cap: int = 4096  # at most this many query tokens
    seed: int = 0
    dtype: str = "bfloat16"  # cache dtype (`--cache-dtype`; the field keeps its name, so recipes and ids do too)
    box: float = 3.0  # |beta| <= box


def budget_rows(budget: float, n: int) -> int:
    """Kept keys per (layer, KV head) for a context of n tokens, or BadInput."""
    if not 0 < budget < 1:
        raise BadInput(f"--budget must be a share strictly between 0 and 1, got {budget}")
    r = math.floor(budget * n)
    if r < 1:
        raise BadInput(f"the context has {n} tokens: a budget of {budget} keeps no key (needs at least "
                       f"{math.ceil(1 / budget)} tokens)")  # fmt: skip
    return r


def read_context(path: Path, warn=None) -> tuple[str, str]:
    """(text, sha256 of the file's bytes), or BadInput. Bytes that are not UTF-8 are replaced with U+FFFD, and
    `warn` is told, as capture tells of its corpus."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"context file '{path}' does not exist")
    raw = p.read_bytes()
    text, replaced = decode_text(raw)
    if replaced and warn is not None:
        warn(f"context file '{path}' had non-UTF-8 bytes; {replaced} replaced with U+FFFD")
    if not text.strip():
        raise BadInput(f"context file '{path}' is empty")
    return text, hashlib.sha256(raw).hexdigest()


def compact(store: Store, model: str, context: Path, cfg: CompactConfig, out: Output,
            trust_remote_code: bool = False, *, place=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the compaction. `place` (a ridgefill.models.device.Where; default `where()`) is where the
    model runs; its dtype (cfg.dtype is the cache's) and device kind go into the recipe as `model_dtype` / `device`
    (nothing for cpu / float32)."""
    from ridgefill.fold.queries import SOURCES
    from ridgefill.numerics import CACHE_DTYPES
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where

    place = place or where()
    if cfg.source not in SOURCES:
        raise BadInput(f"unknown query source '{cfg.source}' (choose one of: {', '.join(SOURCES)})")
    if cfg.dtype not in CACHE_DTYPES:
        raise BadInput(f"unknown cache dtype '{cfg.dtype}' (choose one of: {', '.join(CACHE_DTYPES)})")
    if not 0 < cfg.budget < 1:
        budget_rows(cfg.budget, 1)
    if not 0 < cfg.holdout < 1:
        raise BadInput(f"--holdout must be strictly between 0 and 1 (the held-out share of queries), got {cfg.holdout}")
    if cfg.cap < 2:
        raise BadInput(f"--cap must be at least 2 query tokens, got {cfg.cap}")
    text, sha = read_context(context, out.warn)
    ref = resolve_model(model, store_root=store.root)
    recipe = {"stage": "compact", "version": FORMAT_VERSION, "model": ref.fingerprint, "context_sha256": sha,
              **asdict(cfg), **place.recipe(MODEL_DTYPE), **({"trust_remote_code": True} if trust_remote_code else {})}
    hit = store.cached("compact", recipe)
    if hit is not None:
        return hit, True

    import torch

    from ridgefill.models import load_model

    lm = load_model(ref, store_root=store.root, trust_remote_code=trust_remote_code, **place.load_args())
    out.info(f"model on {place.describe()}")
    ids = torch.tensor(lm.tokenizer(text)["input_ids"], dtype=torch.long)
    r = budget_rows(cfg.budget, len(ids))
    kinds = lm.adapter.layer_kinds
    if FULL not in kinds:
        raise BadInput(f"'{model}' has no full-attention layer to compact (layers: {sorted(set(kinds))})")
    cc, rq = prepare(lm, ids, cfg, out)
    layers, heads = {}, []
    with out.progress("compact", total=len(kinds)) as bar:
        for l, kind in enumerate(kinds):
            if kind == FULL:
                layers[l], rows = compact_layer(l, cc, rq, lm.adapter.attention_scaling(l), r, cfg)
                heads += rows
            else:  # sliding-window layers keep their whole cache
                n = cc.keys[l].shape[1]
                layers[l] = {"keys": cc.keys[l].cpu().numpy(), "values": cc.values[l].cpu().numpy(),
                             "positions": np.broadcast_to(np.arange(n, dtype=np.int32), cc.keys[l].shape[:2])}
            bar.update(l + 1, None, f"layer {l + 1}/{len(kinds)}")
    report = {"kept_per_head": r, "context_tokens": len(ids), "queries": rq.counts(), "heads": heads,
              "median": {k: float(np.median([h[k] for h in heads])) for k in ("am_fit", "am_held", "residual")}}
    summary = {"context_tokens": len(ids), "kept_per_head": r, "budget": cfg.budget,
               "compacted_layers": sorted({h["layer"] for h in heads}), "am_held_median": report["median"]["am_held"],
               "queries": rq.counts()}
    with store.build("compact", recipe) as build:
        artifact.write(build.path, layers, cfg.dtype, ids.numpy(), ref.fingerprint)
        write_json(build.path / artifact.REPORT, report)
        art = build.commit(info={"model_spec": model, "model": {"name": ref.name, "revision": ref.revision, "fingerprint": ref.fingerprint},
                                 "context": {"path": str(context), "sha256": sha, "tokens": len(ids)},
                                 "placement": lm.placement()},
                           summary=summary)  # fmt: skip
    return art, False


def prepare(lm, ids, cfg, out: Output):
    """The context's keys/values and the reference queries (fit / held-out) for `cfg`."""
    from ridgefill.fold.queries import context_cache, reference_queries

    out.info(f"prefill of the context ({len(ids)} tokens) and of the '{cfg.source}' reference queries")
    cc = context_cache(lm, ids)
    rq = reference_queries(lm, ids, source=cfg.source, holdout=cfg.holdout, cap=cfg.cap, seed=cfg.seed)
    return cc, rq


def compact_layer(l: int, cc, rq, s: float, r: int, cfg: CompactConfig) -> tuple[dict, list[dict]]:
    """One full-attention layer: kept keys, their beta and refit values per KV head, and per-head figures."""
    from ridgefill.fold.math import (attention_output, fit_log_weights, refit_values, relative_error, round_to,
                                     select_keys)  # fmt: skip

    fit_q, held_q = rq.layers[l]
    keys, values, positions, betas, rows = [], [], [], [], []
    for h in range(cc.keys[l].shape[0]):
        K, V = cc.keys[l][h].cpu().numpy(), cc.values[l][h].cpu().numpy()  # [N, hd] float32
        Q, Qh = fit_q[h].cpu().numpy(), held_q[h].cpu().numpy()
        keep = select_keys(Q, K, s, r)
        fit = fit_log_weights(Q, K, keep, s, box=cfg.box)
        k = round_to(K[keep], cfg.dtype)
        v = round_to(refit_values(Q, k, s, attention_output(Q, K, V, s), fit.beta), cfg.dtype)
        keys.append(k), values.append(v), positions.append(keep.astype(np.int32)), betas.append(fit.beta)
        rows.append({"layer": l, "head": h, "start_residual": fit.start_residual, "residual": fit.residual,
                     "iterations": fit.iterations,
                     "am_fit": relative_error(attention_output(Q, k, v, s, fit.beta), attention_output(Q, K, V, s)),
                     "am_held": relative_error(attention_output(Qh, k, v, s, fit.beta), attention_output(Qh, K, V, s))})
    layer = {"keys": np.stack(keys), "values": np.stack(values), "positions": np.stack(positions),
             "beta": np.stack(betas).astype(np.float32)}  # fmt: skip
    return layer, rows
