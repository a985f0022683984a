"""Decoding after a prefill: `greedy`, and `SlotCache`, a cache the stock model cannot hold.

A prefill that leaves holes (the "nofill" arm) or a compacted cache with a per-key logit bias (`ridgefill
compact`) cannot be put into transformers' `DynamicCache`: the keys are not one contiguous run of positions and
the stock attention has no bias input. `SlotCache` keeps, per layer and KV head, key/value slots with their own
positions (and an optional additive bias), and `step` decodes one token through the model's own layers against
them (`layers.Layers`). `greedy` continues from either kind of cache.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

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
        self.start = self.next_position  # rows before it are the prefill's: `truncate` keeps them

        def t(x, dtype, dev):  # torch tensors (any device) or numpy arrays
            x = x if isinstance(x, torch.Tensor) else torch.tensor(np.asarray(x))
            return x.to(device=dev, dtype=dtype)

        self.layers = []
        for l, d in enumerate(layers):
            dev = ad.layer_device(l)
            layer = {"keys": t(d["keys"], ad.dtype, dev)[None], "values": t(d["values"], ad.dtype, dev)[None],
                     "positions": t(d["positions"], torch.long, dev),
                     "bias": None if d.get("bias") is None else t(d["bias"], torch.float32, dev)}
            used = (layer["positions"] >= 0).any(0)  # a slot empty in every KV head is never attended: drop it
            if not bool(used.all()):
                at = used.nonzero()[:, 0]
                layer["keys"], layer["values"] = layer["keys"][:, :, at], layer["values"][:, :, at]
                layer["positions"] = layer["positions"][:, at]
                layer["bias"] = None if layer["bias"] is None else layer["bias"][:, at]
            self.layers.append(layer)

    def _mask(self, l: int, q: torch.Tensor) -> torch.Tensor:
        """[1, heads, m, n] additive mask of m queries at positions q [m] (their own new slots last)."""
        ad, d = self.lm.adapter, self.layers[l]
        pos = d["positions"][:, None, :]  # [kv, 1, n]
        q = q.to(pos.device)[None, :, None]  # [1, m, 1]
        allowed = (pos >= 0) & (pos <= q)
        window = getattr(ad.config, "sliding_window", None)
        if ad.layer_kinds[l] == SLIDING and window:
            allowed &= q - pos < window
        bias = torch.zeros(pos.shape, device=pos.device) if d["bias"] is None else d["bias"][:, None, :]
        m = torch.where(allowed, bias, torch.tensor(torch.finfo(torch.float32).min, device=pos.device))
        m = m.repeat_interleave(ad.num_heads // ad.num_kv_heads, dim=0)  # KV head -> its query heads
        return m[None].to(ad.dtype)

    def step(self, token: int) -> torch.Tensor:
        """Append `token` at the next position; return its next-token logits [vocab] float32."""
        return self.extend([token])[0]

    def extend(self, tokens) -> torch.Tensor:
        """Append `tokens` at the next positions, in one forward; return the next-token logits after each of them
        [len(tokens), vocab] float32."""
        ad = self.lm.adapter
        toks = [int(t) for t in tokens]
        layers, p, m = Layers(self.lm), self.next_position, len(toks)
        q_pos = torch.arange(p, p + m, device=ad.device)
        with torch.no_grad():
            h = ad.base.embed_tokens(torch.tensor([toks], device=ad.device))
            rope = layers.rope(h, q_pos)
            for l, d in enumerate(self.layers):
                kv, n = d["positions"].shape
                d["keys"] = torch.cat([d["keys"], d["keys"].new_zeros(1, kv, m, ad.head_dim)], dim=2)
                d["values"] = torch.cat([d["values"], d["values"].new_zeros(1, kv, m, ad.head_dim)], dim=2)
                d["positions"] = torch.cat([d["positions"], q_pos.to(d["positions"].device).expand(kv, m)], dim=1)
                if d["bias"] is not None:
                    d["bias"] = torch.cat([d["bias"], d["bias"].new_zeros(kv, m)], dim=1)
                h = layers.run(l, h, q_pos, rope, d["keys"], d["values"], mask=self._mask(l, q_pos),
                               slots=torch.arange(n, n + m))  # fmt: skip
        self.next_position += m
        return final_logits(self.lm, h[0])

    def truncate(self, next_position: int) -> None:
        """Forget the rows `step` / `extend` appended at positions >= next_position: decoding goes on from there."""
        drop = self.next_position - int(next_position)
        if not self.start <= next_position <= self.next_position:
            raise ValueError(f"cannot truncate to position {next_position}: decoding added positions {self.start}.."
                             f"{self.next_position - 1}")
        if drop:
            for d in self.layers:
                d["keys"], d["values"] = d["keys"][:, :, :-drop], d["values"][:, :, :-drop]
                d["positions"] = d["positions"][:, :-drop]
                d["bias"] = None if d["bias"] is None else d["bias"][:, :-drop]
        self.next_position = int(next_position)


def greedy(lm, res, max_new: int, stop=None, draft=None) -> list[int]:
    """Greedy tokens continuing from a prefill's cache (`res`: a `PrefillResult`): at most `max_new`, stopping
    before the tokenizer's end-of-sequence token. The first token is the argmax of the prefill's last logits
    row; the next ones come from the stock model on a copy of the prefill's `DynamicCache` with room for the new
    rows (`decoding_cache`; the prefill's own is left as it was), or from `SlotCache.extend` / `step`, whose cache
    grows in place (decode from a fresh prefill to start again). `stop(tokens) -> bool`, if given, is asked after
    each token whether the tokens so far are enough (e.g. an answer is complete), and ends decoding when it says so.
    `draft`: tokens this decoding is likely to produce (see `greedy_batch`); the result is the same without it."""
    if not isinstance(res.cache, SlotCache):
        return greedy_batch(lm, [res], max_new, stop=stop, draft=draft)[0]
    eos, cache = lm.tokenizer.eos_token_id, res.cache
    draft = [int(t) for t in (draft or [])][:max_new]
    start = cache.next_position
    pred = cache.extend(draft).argmax(-1).tolist() if draft else []
    toks, cut = _follow(int(res.logits[-1].argmax()), pred, draft, max_new, stop, eos)
    if cut is None:
        return toks
    cache.truncate(start + cut)  # it holds the draft's first `cut` tokens: this prefill's own up to its last
    with torch.inference_mode():
        while True:
            nxt = int(cache.step(toks[-1]).argmax())
            if nxt == eos:
                return toks
            toks.append(nxt)
            if len(toks) >= max_new or (stop is not None and stop(toks)):
                return toks


def _follow(first: int, pred: list[int], draft: list[int], max_new: int, stop, eos) -> tuple[list[int], int | None]:
    """One prefill's greedy tokens as far as a draft decides them. first: the prefill's own first token; pred[j]:
    its argmax after the draft's tokens 0..j. Returns (tokens, None) when its decoding has ended there, or (tokens,
    cut) when it leaves the draft: its first `cut` tokens are the draft's, its last one is its own and the next
    comes from a forward of that last token after them."""
    toks, nxt = [], first
    while nxt != eos and len(toks) < max_new:
        toks.append(nxt)
        if len(toks) >= max_new or (stop is not None and stop(toks)):
            return toks, None
        k = len(toks)
        if k > len(draft) or toks[-1] != draft[k - 1] or k > len(pred):
            return toks, k - 1
        nxt = pred[k - 1]
    return toks, None


def greedy_batch(lm, results: list, max_new: int, stop=None, draft=None) -> list[list[int]]:
    """`greedy` for several prefills of one prompt length at once: one batched forward of the stock model per
    step instead of one per prefill (the caches are stacked along the batch; a prefill whose decoding has ended
    leaves the batch). The same tokens as `greedy` on each, up to float round-off in the batched products.

    results: PrefillResults whose caches are DynamicCaches of the same shapes (any arm but "nofill", whose
    SlotCache `greedy` decodes); each cache is left as it was. stop: as in `greedy`, asked per prefill.

    draft: tokens most of the prefills are likely to produce, e.g. the exact arm's greedy answer when they are fill
    arms of the same prompt (speculative decoding, with the draft as every prefill's proposal). One batched forward
    over the draft gives each prefill its argmax after every draft token: a prefill whose greedy tokens are the
    draft's up to where it stops needs no step of its own, and one that leaves the draft continues from its first
    token of its own, in one batch with those that leave it at the same token. The tokens are the same as without
    a draft (up to float round-off): only the number of forwards changes."""
    if not results:
        return []
    if any(isinstance(r.cache, SlotCache) for r in results):
        raise ValueError("greedy_batch decodes DynamicCaches; decode a SlotCache with greedy")
    eos = lm.tokenizer.eos_token_id
    draft = [int(t) for t in (draft or [])][:max_new]
    pred = _draft_argmax(lm, [r.cache for r in results], draft) if draft else [[] for _ in results]
    toks, groups = [], {}
    for i, r in enumerate(results):
        t, cut = _follow(int(r.logits[-1].argmax()), pred[i], draft, max_new, stop, eos)
        toks.append(t)
        if cut is not None:
            groups.setdefault(cut, []).append(i)
    for cut, live in sorted(groups.items()):  # those that leave the draft at the same token decode together
        cache = decoding_cache(lm, [results[i].cache for i in live], cut + max_new)
        ids = torch.tensor([draft[:cut] + toks[i][-1:] for i in live], device=lm.adapter.device)
        _decode(lm, cache, ids, live, toks, max_new, stop, eos)
    return toks


DRAFT_LOGITS_BYTES = 1 << 28  # the draft check's logits are computed for this many bytes of prefills at a time


def _draft_argmax(lm, caches: list, draft: list[int]) -> list[list[int]]:
    """Per cache: the argmax after each draft token, [len(draft)] (batched forwards over the draft, each on a
    stacked copy of some of the caches, so that their logits stay under DRAFT_LOGITS_BYTES)."""
    m, vocab = len(draft), lm.model.config.get_text_config().vocab_size
    per = max(1, DRAFT_LOGITS_BYTES // (4 * m * vocab))
    out = []
    with torch.inference_mode():
        for at in range(0, len(caches), per):
            part = caches[at : at + per]
            ids = torch.tensor([draft] * len(part), device=lm.adapter.device)
            o = lm.model(input_ids=ids, cache=decoding_cache(lm, part, m), use_cache=True)
            out += o.logits.argmax(-1).tolist()
    return out


def _decode(lm, cache, ids, live: list[int], toks: list[list[int]], max_new: int, stop, eos) -> None:
    """Greedy steps for the prefills `live` (the batch rows of `cache`, in order) until each ends: each step feeds
    `ids` [len(live), k] (the first may feed several tokens) and appends the argmax after them to toks[i]."""
    with torch.inference_mode():
        while True:
            o = lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            cache, keep = o.cache, []
            for j, i in enumerate(live):
                nxt = int(o.logits[j, -1].argmax())
                if nxt == eos:
                    continue
                toks[i].append(nxt)
                if len(toks[i]) < max_new and not (stop is not None and stop(toks[i])):
                    keep.append(i)
            if not keep:
                return
            if keep != live:
                rows = torch.tensor([live.index(i) for i in keep], device=lm.adapter.device)
                for layer in cache.layers:
                    layer.batch_select_indices(rows.to(layer.keys.device))
                live = keep
            ids = torch.tensor([[toks[i][-1]] for i in live], device=lm.adapter.device)


def decoding_cache(lm, caches: list, room: int):
    """One DynamicCache to decode from, the given prefill caches (same shapes) stacked along the batch. Full-attention
    layers get room for `room` more rows and write each new row in place: a DynamicLayer concatenates, copying the
    whole cache at every step, which costs more than the step's attention on long prompts. Sliding layers (at most
    a window of rows) are stacked as they are. The given caches are not modified."""
    cache = DynamicCache(config=lm.model.config)
    for l, layer in enumerate(caches[0].layers):
        keys, values = _stack([c.layers[l].keys for c in caches]), _stack([c.layers[l].values for c in caches])
        if type(layer) is DynamicLayer:
            cache.layers[l] = _Roomy(keys, values, room)
        else:
            merged = copy.copy(layer)
            merged.keys, merged.values = keys, values
            cache.layers[l] = merged
    return cache


def _stack(xs: list) -> torch.Tensor:
    """Tensors stacked along the batch; one is passed as it is (nothing writes into it: _Roomy copies it, a
    sliding layer replaces its tensors when it updates)."""
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=0)


class _Roomy(DynamicLayer):
    """A DynamicLayer over a buffer with room for more rows: `update` writes them in place (no copy of the rows before),
    and `keys` / `values` are views of the rows written so far."""

    def __init__(self, keys, values, room: int):
        super().__init__()
        b, h, n, d = keys.shape
        self._k = keys.new_empty((b, h, n + room, d))
        self._v = values.new_empty((b, h, n + room, values.shape[-1]))
        self._k[:, :, :n], self._v[:, :, :n] = keys, values
        self._n, self.device, self.is_initialized = n, keys.device, True
        self._views()

    def _views(self):
        self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

    def update(self, key_states, value_states, *args, **kwargs):
        m = key_states.shape[-2]
        if self._n + m > self._k.shape[-2]:  # out of room: double it
            more = max(m, self._k.shape[-2])
            self._k = torch.cat([self._k, self._k.new_empty((*self._k.shape[:2], more, self._k.shape[-1]))], -2)
            self._v = torch.cat([self._v, self._v.new_empty((*self._v.shape[:2], more, self._v.shape[-1]))], -2)
        self._k[:, :, self._n : self._n + m] = key_states
        self._v[:, :, self._n : self._n + m] = value_states
        self._n += m
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices):
        self._k, self._v = self._k[indices], self._v[indices]
        self._views()
