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

from ridgefill.runtime.layers import SLIDING, Layers, final_logits, holds_state


class SlotCache:
    """A cache the stock model cannot hold: per layer, key/value slots with their own position per KV head and
    an optional additive logit bias per slot. `step` decodes one token at a time through the model's own layers.

    layers: per decoder layer a dict with "keys", "values" [kv_heads, n, head_dim] (post-RoPE), "positions"
    [kv_heads, n] int (-1: an empty slot, never attended) and optionally "bias" [kv_heads, n] float32 (added to
    s q.k, as an attention-biased compacted cache has). The "nofill" arm's cache is one (holes are empty slots);
    so are the compacted caches of `ridgefill.fold`. Each layer's tensors are kept on that layer's device.
    A Gated DeltaNet layer's entry is None: its conv and recurrent states are in `states`, a transformers cache
    (updated in place as `step` runs)."""

    def __init__(self, lm, layers: list, next_position: int, states=None):
        ad = lm.adapter
        self.lm, self.next_position, self.states = lm, int(next_position), states
        if any(d is None for d in layers) and states is None:
            raise ValueError("a SlotCache with Gated DeltaNet layers needs their states")

        def t(x, dtype, dev):  # torch tensors (any device) or numpy arrays
            x = x if isinstance(x, torch.Tensor) else torch.tensor(np.asarray(x))
            return x.to(device=dev, dtype=dtype)

        self.layers = []
        for l, d in enumerate(layers):
            if d is None:
                self.layers.append(None)
                continue
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
                if d is None:
                    h = layers.run_linear(l, h, self.states)
                    continue
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
    row; the next ones come from the stock model on a copy of the prefill's `DynamicCache` with room for the new
    rows (`decoding_cache`; the prefill's own is left as it was), or from `SlotCache.step`, whose cache grows in
    place (decode from a fresh prefill to start again). `stop(tokens) -> bool`, if given, is asked after each
    token whether the tokens so far are enough (e.g. an answer is complete), and ends decoding when it says so."""
    eos = lm.tokenizer.eos_token_id
    cache, nxt, toks = res.cache, int(res.logits[-1].argmax()), []
    if not isinstance(cache, SlotCache):
        cache = decoding_cache(lm, [cache], max_new)
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


def greedy_batch(lm, results: list, max_new: int, stop=None) -> list[list[int]]:
    """`greedy` for several prefills of one prompt length at once: one batched forward of the stock model per
    step instead of one per prefill (the caches are stacked along the batch; a prefill whose decoding has ended
    leaves the batch). The same tokens as `greedy` on each, up to float round-off in the batched products.

    results: PrefillResults whose caches are DynamicCaches of the same shapes (any arm but "nofill", whose
    SlotCache `greedy` decodes); each cache is left as it was. stop: as in `greedy`, asked per prefill."""
    if not results:
        return []
    if any(isinstance(r.cache, SlotCache) for r in results):
        raise ValueError("greedy_batch decodes DynamicCaches; decode a SlotCache with greedy")
    eos = lm.tokenizer.eos_token_id
    toks: list[list[int]] = [[] for _ in results]
    nxt = [int(r.logits[-1].argmax()) for r in results]
    cache = decoding_cache(lm, [r.cache for r in results], max_new)
    live = list(range(len(results)))  # the prefills still decoding, in batch order
    with torch.inference_mode():
        while True:
            keep = []
            for i in live:
                if len(toks[i]) < max_new and nxt[i] != eos:
                    toks[i].append(nxt[i])
                    if not (stop is not None and stop(toks[i])) and len(toks[i]) < max_new:
                        keep.append(i)
            if not keep:
                return toks
            if keep != live:
                rows = torch.tensor([live.index(i) for i in keep], device=lm.adapter.device)
                for layer in cache.layers:
                    if holds_state(layer):
                        layer.reorder_cache(rows)
                    else:
                        layer.batch_select_indices(rows.to(layer.keys.device))
                live = keep
            ids = torch.tensor([[nxt[i]] for i in live], device=lm.adapter.device)
            o = lm.model(input_ids=ids, cache=cache, use_cache=True)
            cache = o.cache
            for j, i in enumerate(live):
                nxt[i] = int(o.logits[j, -1].argmax())


def decoding_cache(lm, caches: list, room: int):
    """One DynamicCache to decode from, the given prefill caches (same shapes) stacked along the batch. Full-attention
    layers get room for `room` more rows and write each new row in place: a DynamicLayer concatenates, copying the
    whole cache at every step, which costs more than the step's attention on long prompts. Sliding layers (at most
    a window of rows) are stacked as they are; Gated DeltaNet layers' states are stacked into new tensors (decoding
    updates them in place). The given caches are not modified."""
    cache = DynamicCache(config=lm.model.config)
    for l, layer in enumerate(caches[0].layers):
        if holds_state(layer):
            cache.layers[l] = _stacked_states([c.layers[l] for c in caches])
            continue
        keys, values = [c.layers[l].keys for c in caches], [c.layers[l].values for c in caches]
        if type(layer) is DynamicLayer:
            cache.layers[l] = _Roomy(keys, values, room)
        else:
            merged = copy.copy(layer)
            merged.keys, merged.values = _stack(keys), _stack(values)
            cache.layers[l] = merged
    return cache


def _stacked_states(layers: list):
    """One linear-attention cache layer holding the given layers' conv / recurrent states stacked along the batch
    (new tensors, even for one layer)."""
    merged = copy.copy(layers[0])
    for name in ("conv_states", "recurrent_states"):
        first = getattr(layers[0], name)
        setattr(merged, name, {i: None if t is None else torch.cat([getattr(x, name)[i] for x in layers], dim=0)
                               for i, t in first.items()})  # fmt: skip
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                 "conv_kernel_size"):
        setattr(merged, name, dict(getattr(layers[0], name)))
    _own_count(merged)
    return merged


def _own_count(layer) -> None:
    """Give a copied linear-attention cache layer its own row count: transformers 5.25+ keeps the rows seen in a
    tensor (`cumulative_length_linear`, which the positions of the next rows read) and adds to it in place while
    decoding, so a shallow copy would advance the count of the layer it was copied from."""
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, torch.Tensor):
        layer.cumulative_length_linear = count.clone()


def _stack(xs: list) -> torch.Tensor:
    """Tensors stacked along the batch; one is passed as it is (nothing writes into it: a sliding layer replaces its
    tensors when it updates)."""
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=0)


class _Roomy(DynamicLayer):
    """A DynamicLayer over a buffer with room for more rows: `update` writes them in place (no copy of the rows before),
    and `keys` / `values` are views of the rows written so far."""

    def __init__(self, keys: list, values: list, room: int):
        """keys, values: the prefills' tensors (batch, heads, rows, dim), written once into one buffer stacked along
        the batch (a fresh buffer costs its first write; a stack then a copy would pay it twice)."""
        super().__init__()
        _, h, n, d = keys[0].shape
        b = sum(k.shape[0] for k in keys)
        self._k = keys[0].new_empty((b, h, n + room, d))
        self._v = values[0].new_empty((b, h, n + room, values[0].shape[-1]))
        at = 0
        for k, v in zip(keys, values):
            self._k[at : at + k.shape[0], :, :n], self._v[at : at + k.shape[0], :, :n] = k, v
            at += k.shape[0]
        self._n, self.device, self.is_initialized = n, self._k.device, True
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


def cache_copy(cache, layers: int, config=None):
    """A cache whose first `layers` layers are copies of `cache`'s: the rest are `cache`'s own layers, or, given
    the model `config`, fresh empty ones. Decoding replaces an attention layer's tensors (it concatenates), so the
    tensors shared with `cache` are never written; a Gated DeltaNet layer's states are updated in place, so they
    are cloned (they are small: no rows)."""
    if config is None:
        new = copy.copy(cache)
        new.layers = list(cache.layers)
    else:
        new = DynamicCache(config=config)
    for l in range(layers):
        new.layers[l] = copy_layer(cache.layers[l])
    return new


def copy_layer(layer):
    """A copy of one cache layer that decoding from it cannot change: attention layers share their tensors (they
    are replaced, never written), a linear-attention layer's conv / recurrent states are cloned."""
    new = copy.copy(layer)
    if holds_state(layer):
        for name in ("conv_states", "recurrent_states", "is_conv_states_initialized",
                     "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size"):
            states = getattr(layer, name)
            setattr(new, name, {i: t.clone() if isinstance(t, torch.Tensor) else t for i, t in states.items()})
        _own_count(new)
    return new
