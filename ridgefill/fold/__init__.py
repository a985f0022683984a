"""Fold: turn an attention-biased compacted KV cache into a plain one (docs/method.md#compaction-and-the-fold,
docs/cache.md).

Attention-Matching-style compaction keeps `r` keys per (layer, KV head), fits a per-key logit bias `beta`
and refits the values; the fold moves each kept key along one direction `u` per head,
`k' = k + (beta / s) u`, so that a stock kernel without a bias input reproduces the biased logits whenever
`q.u = 1`, then refits the values on the rounded folded keys. `fold.math` holds the per-head numpy math.

    from ridgefill.fold import CompactConfig, FoldConfig, compact, fold   # the stages (compaction.py, run.py)
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"CompactConfig": "compaction", "compact": "compaction", "ARMS": "run",
                                          "FoldConfig": "run", "fold": "run"})
