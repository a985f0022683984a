"""What ridgefill hands a serving engine (docs/engines.md): an engine cache and the prompt that goes with it.

An engine cache is a `ridgefill-cache/2` file (docs/cache.md) whose every layer holds only keys and values, the
same number P of entries, presented as prompt positions 0..P-1, with keys rotated as the engine's RoPE expects
there; it records the fingerprint of the model it was made with. The engine is sent `ids` (P cached positions
first, then the rows it must still compute) and loads the first P positions' keys and values instead of computing
them.

- `prefix_cache`: a prompt's first P = N - T rows, from the exact model ("exact") or filled ("ridgefill" with a
  release's maps, "identity"), exactly as the reference runtime fills them (its anchor and the rows above its
  exact-row norm run every layer, attending to the filled rows before them). The engine computes the T tail rows
  itself, as the reference runtime does.
- `present_fold`: a folded cache of r entries per KV head as r placeholder positions. Each key carries RoPE at its
  original position p, and the continuation must see it as after a context of N tokens; the engine instead places
  the next token at r. Rotating every key by -(N - r) keeps each (query, key) pair's relative rotation, which is
  all RoPE attention sees: R(r + j) q . R(p - N + r) k = R(N + j) q . R(p) k.

This module runs with ridgefill (torch, transformers); the engine-side modules (`layout`, `vllm`, `llamacpp`)
never import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.formats import cache as cache_format
from ridgefill.formats import safetensors
from ridgefill.models.kinds import FULL

from ridgefill.engines.request import PROMPT


@dataclass
class EngineCache:
    """Per layer keys/values [kv_heads, P, head_dim] (float32), the ids to send, how they were made, and the model
    they were made with (its fingerprint, which the cache file records)."""

    layers: dict[int, dict[str, np.ndarray]]
    ids: np.ndarray  # int64 [n]: the first `cached` are the cached positions' ids (placeholders for a fold)
    cached: int
    kind: str  # "exact" | "ridgefill" | "identity" | "fold"
    model_fingerprint: str  # 64 hex (ridgefill.models.fingerprint)
    seconds: float = 0.0  # ridgefill's own compute for the prefix (0 for a fold: it was computed before)

    def save(self, out: Path, dtype: str = "float32") -> tuple[Path, Path]:
        """cache.safetensors and prompt.safetensors in `out` (created)."""
        out.mkdir(parents=True, exist_ok=True)
        cache_format.write_cache(out / cache_format.FILE, self.layers, dtype, self.model_fingerprint)
        safetensors.save(out / PROMPT, {"ids": self.ids.astype(np.int32)},
                         {"cached": str(self.cached), "kind": self.kind})  # fmt: skip
        return out / cache_format.FILE, out / PROMPT


def _engine_ready(lm) -> None:
    """Engines hold one position range for every layer: refuse models with sliding-window or recurrent layers."""
    kinds = set(lm.adapter.layer_kinds)
    if kinds != {FULL}:
        raise BadInput(f"engine caches need full attention in every layer (this model has {sorted(kinds)}): an "
                       f"engine keeps one position range for all layers")  # fmt: skip


def prefix_cache(lm, ids, arm: str, **options) -> EngineCache:
    """The first N - tail rows of `ids` [N] as an engine cache, computed by `arm` ("exact", "ridgefill",
    "identity") with the fill options (`tail` required; `split`, `maps`, `anchor`, `exact_norm`): the rows a prefill
    of all N rows writes there (`runtime.prefix_prefill`). `seconds` is that computation's wall time."""
    import torch

    from ridgefill.runtime import prefix_prefill

    _engine_ready(lm)
    if arm not in ("exact", "ridgefill", "identity"):
        raise BadInput(f"an engine prefix is 'exact', 'ridgefill' or 'identity', not '{arm}'")
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long).reshape(-1)
    res = prefix_prefill(lm, ids, arm, **({"split": 0} | options))
    cache, p = res.cache, res.num_rows - res.tail
    layers = {l: {"keys": cache.layers[l].keys[0].float().cpu().numpy(),
                  "values": cache.layers[l].values[0].float().cpu().numpy()} for l in range(lm.adapter.num_layers)}  # fmt: skip
    return EngineCache(layers, ids.numpy(), p, arm, lm.ref.fingerprint, res.seconds)


def present_fold(lm, folded: dict[int, dict[str, np.ndarray]], context_tokens: int, question, *,
                 placeholder: int = 0) -> EngineCache:
    """A folded cache (docs/cache.md, every layer compacted to r entries per head) of a context of
    `context_tokens` tokens, as r placeholder positions followed by `question` (token ids)."""
    import torch

    _engine_ready(lm)
    rs = {l: d["keys"].shape[1] for l, d in folded.items()}
    r = rs[0]
    if sorted(folded) != list(range(lm.adapter.num_layers)) or set(rs.values()) != {r}:
        raise BadInput(f"an engine needs the same number of entries in every layer; this cache holds {sorted(set(rs.values()))}")
    if getattr(lm.adapter.base.rotary_emb, "attention_scaling", 1.0) != 1.0:
        raise BadInput("this model's RoPE scales its cos/sin (attention_scaling != 1): re-rotating keys would scale them again")
    from ridgefill.runtime.layers import Layers

    shift = r - int(context_tokens)  # every key turns by -(N - r)
    cos, sin = Layers(lm).rope(torch.zeros(1, 1, lm.adapter.hidden_size), torch.tensor([shift]))[FULL]
    layers = {}
    for l, d in sorted(folded.items()):
        k = torch.as_tensor(d["keys"], dtype=torch.float32).transpose(0, 1)  # [r, kv_heads, hd]
        k = lm.adapter.apply_rope(k, cos[0].float().expand(r, -1), sin[0].float().expand(r, -1))
        layers[l] = {"keys": k.transpose(0, 1).numpy(), "values": np.asarray(d["values"], np.float32)}
    ids = np.concatenate([np.full(r, placeholder, np.int64), np.asarray(question, np.int64)])
    return EngineCache(layers, ids, r, "fold", lm.ref.fingerprint)
