"""Decoding after a prefill: `greedy`, and `SlotCache`, a cache the stock model cannot hold.

A prefill that leaves holes (the "nofill" arm) or a compacted cache with a per-key logit bias (`ridgefill
compact`) cannot be put into transformers' `DynamicCache`: the keys are not one contiguous run of positions and
the stock attention has no bias input. `SlotCache` keeps, per layer and KV head, key/value slots with their own
positions (and an optional additive bias), and `step` decodes one token through the model's own layers against
them (`layers.Layers`). `greedy` continues from either kind of cache.
"""

from __future__ import annotations

import numpy as np
import torch

from ridgefill.runtime.layers import SLIDING, Layers, final_logits


class SlotCache:
    """A cache the stock model cannot hold: per layer, key/value slots with their own position per KV head and
    an optional additive logit bias per slot. `step` decodes one token at a time through the model's own layers.

    layers: per decoder layer a dict with "keys", "values" [kv_heads, n, head_dim] (post-RoPE), "positions"
    [kv_heads, n] int (-1: an empty slot, never attended) and optionally "bias" [kv_heads, n] float32 (added to
    s q.k, as an attention-biased compacted cache has). The "nofill" arm's cache is one (holes are empty slots);
    so are the compacted caches of `ridgefill.fold`. Each layer's tensors are kept on that layer's device."""

    def __init__(self, lm, layers: list[dict], next_position: int):
        ad = lm.adapter
        self.lm, self.next_position = lm, int(next_position)

        def t(x, dtype, dev):  # torch tensors (any device) or numpy arrays
            x = x if isinstance(x, torch.Tensor) else torch.tensor(np.asarray(x))
            return x.to(device=dev, dtype=dtype)

        self.layers = []
        for l, d in enumerate(layers):
            dev = ad.layer_device(l)
            self.layers.append({"keys": t(d["keys"], ad.dtype, dev)[None], "values": t(d["values"], ad.dtype, dev)[None],
                                "positions": t(d["positions"], torch.long, dev),
                                "bias": None if d.get("bias") is None else t(d["bias"], torch.float32, dev)})

    def _mask(self, l: int, p: int) -> torch.Tensor:
        """[1, heads, 1, n] additive mask of one query at position p (its own new slot last)."""
        ad, d = self.lm.adapter, self.layers[l]
        pos = d["positions"]
        allowed = (pos >= 0) & (pos <= p)
        window = getattr(ad.config, "sliding_window", None)
        if ad.layer_kinds[l] == SLIDING and window:
            allowed &= p - pos < window
        bias = torch.zeros(pos.shape, device=pos.device) if d["bias"] is None else d["bias"]
        m = torch.where(allowed, bias, torch.tensor(torch.finfo(torch.float32).min, device=pos.device))
        m = m.repeat_interleave(ad.num_heads // ad.num_kv_heads, dim=0)  # KV head -> its query heads
        return m[None, :, None, :].to(ad.dtype)

    def step(self, token: int) -> torch.Tensor:
        """Append `token` at the next position; return its next-token logits [vocab] float32."""
        ad = self.lm.adapter
        layers, p = Layers(self.lm), self.next_position
        q_pos = torch.tensor([p], device=ad.device)
        with torch.no_grad():
            h = ad.base.embed_tokens(torch.tensor([[token]], device=ad.device))
            rope = layers.rope(h, q_pos)
            for l, d in enumerate(self.layers):
                kv, n = d["positions"].shape
                d["keys"] = torch.cat([d["keys"], d["keys"].new_zeros(1, kv, 1, ad.head_dim)], dim=2)
                d["values"] = torch.cat([d["values"], d["values"].new_zeros(1, kv, 1, ad.head_dim)], dim=2)
                d["positions"] = torch.cat([d["positions"], d["positions"].new_full((kv, 1), p)], dim=1)
                if d["bias"] is not None:
                    d["bias"] = torch.cat([d["bias"], d["bias"].new_zeros(kv, 1)], dim=1)
                h = layers.run(l, h, q_pos, rope, d["keys"], d["values"], mask=self._mask(l, p),
                               slots=torch.tensor([n]))  # fmt: skip
        self.next_position += 1
        return final_logits(self.lm, h[0, -1:])[0]


def greedy(lm, res, max_new: int, stop=None) -> list[int]:
    """Greedy tokens continuing from a prefill's cache (`res`: a `PrefillResult`): at most `max_new`, stopping
    before the tokenizer's end-of-sequence token. The first token is the argmax of the prefill's last logits
    row; the next ones come from the stock model on a `DynamicCache`, or from `SlotCache.step`. The cache grows
    in place: decode from a fresh prefill to start again. `stop(tokens) -> bool`, if given, is asked after each
    token whether the tokens so far are enough (e.g. an answer is complete), and ends decoding when it says so."""
    eos = lm.tokenizer.eos_token_id
    cache, nxt, toks = res.cache, int(res.logits[-1].argmax()), []
    with torch.inference_mode():
        while len(toks) < max_new and nxt != eos:
            toks.append(nxt)
            if stop is not None and stop(toks):
                break
            if isinstance(cache, SlotCache):
                nxt = int(cache.step(nxt).argmax())
            else:
                o = lm.model(input_ids=torch.tensor([[nxt]], device=lm.adapter.device), cache=cache, use_cache=True)
                cache, nxt = o.cache, int(o.logits[0, -1].argmax())
    return toks
