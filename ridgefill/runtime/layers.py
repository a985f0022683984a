"""Calling the model's own decoder layers on chosen rows against explicit key/value slots.

The fill runtime never reimplements attention: each decoder layer is the model's own module, called with the
model's own rotary embeddings, a mask built here from explicit query and key positions (causal, plus the window on
sliding-window layers), and a stand-in cache (`Slots`) whose `update` writes the rows being run into their own
slots and hands the whole buffer back. So the stock attention code (sdpa or eager) runs unchanged, whatever rows
are run and whatever the other slots hold. `fill.py` and `cache.py` build on this.

A Gated DeltaNet layer (the hybrids' `linear_attention`) has no slots: it carries a recurrent state and a short
convolution state from row to row, in order. `run_linear` calls such a layer on consecutive rows with a
transformers cache that holds those states (they are updated in place); `mix` runs only its token mixer (input
norm, then the Gated DeltaNet) on rows that need nothing else, and `finish` completes the layer for the rows that
do (residual, post-mixer norm, MLP or MoE block, residual), as the layer's own forward does after its mixer.
"""

from __future__ import annotations

import torch

from ridgefill.errors import BadInput
from ridgefill.models.kinds import SLIDING



class Slots:
    """Stand-in for a transformers Cache for one layer call: N key/value slots in position order.

    The attention module calls `update(k, v, layer_idx)` with the keys/values of the rows it is running;
    they are written into `slots` (their positions) and the full buffers are returned for attention."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
        self.keys, self.values, self.slots = keys, values, slots  # [1, kv_heads, N, head_dim] x2, [Q]

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.keys[:, :, self.slots] = key_states.to(self.keys.device, self.keys.dtype)
        self.values[:, :, self.slots] = value_states.to(self.values.device, self.values.dtype)
        # (a no-op unless the attention computes on another device than the layer's slots live on)
        return self.keys.to(key_states.device), self.values.to(value_states.device)


def attention_mask(q_pos, kv_valid, window, impl: str, dtype):
    """[1, 1, Q, N] attention mask: key j visible to query at q iff valid, j <= q and (window) q - j < window."""
    n = kv_valid.shape[0]
    kv = torch.arange(n, device=q_pos.device)[None, :]
    q = q_pos[:, None]
    allowed = (kv <= q) & kv_valid[None, :]
    if window:
        allowed = allowed & (q - kv < window)
    allowed = allowed[None, None]
    if impl == "sdpa":
        return allowed
    # eager (and anything else that adds the mask to the scores)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device))


def final_logits(lm, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own final norm, head and (Gemma) soft-capping on hidden [rows, d] -> [rows, vocab] float32,
    on the head's device."""
    model, ad = lm.model, lm.adapter
    normed = ad.base.norm(hidden.to(ad.module_device(ad.base.norm)))
    logits = model.lm_head(normed.to(ad.module_device(model.lm_head)))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def holds_state(cache_layer) -> bool:
    """Whether a transformers cache layer holds a Gated DeltaNet layer's conv / recurrent states (no rows)."""
    return hasattr(cache_layer, "recurrent_states")


def mlp_output(out):
    """The hidden state of an MLP or MoE block's output (MoE blocks may return (hidden, router logits))."""
    return out[0] if isinstance(out, tuple) else out


class Layers:
    """Calls the model's own decoder layers on chosen query rows against explicit key/value slot buffers."""

    def __init__(self, lm):
        ad = lm.adapter
        self.lm, self.ad = lm, ad
        self.impl = getattr(ad.config, "_attn_implementation", None) or "eager"
        if self.impl not in ("sdpa", "eager"):
            raise BadInput(f"the fill runtime supports sdpa and eager attention, not '{self.impl}'")
        self.window = getattr(ad.config, "sliding_window", None)

    def rope(self, hidden, pos) -> dict:
        """{layer kind: (cos, sin) [1, len(pos), head_dim]} at positions `pos` (on the rotary module's device)."""
        dev = self.ad.module_device(self.ad.base.rotary_emb)
        hidden, pos = hidden.to(dev), pos.to(dev)
        return {kind: self.ad._rope_module_call(hidden, pos[None], kind) for kind in set(self.ad.layer_kinds)}

    def run(self, l, h, q_pos, rope, keys, values, kv_valid=None, every_row=False, mask=None, slots=None):
        """Layer `l` on rows h [1, Q, d] at positions q_pos [Q] ((cos, sin) of those rows in `rope`); the rows'
        keys/values land in `slots` (default: their positions) of keys/values [1, kv_heads, n, head_dim];
        kv_valid [n] marks the slots attention may read (or pass a ready additive `mask`).

        keys/values live on the layer's device (`Adapter.layer_device`); everything else is moved there, and
        the layer's output [1, Q, d] stays there."""
        kind = self.ad.layer_kinds[l]
        dev = keys.device
        q_pos = q_pos.to(dev)
        if mask is not None:
            mask = mask.to(dev)
        elif every_row and self.impl == "sdpa" and kind != SLIDING:
            mask = None  # all rows, in order: sdpa's own is_causal path, as the stock prefill takes
        else:
            mask = attention_mask(q_pos, kv_valid.to(dev), self.window if kind == SLIDING else None, self.impl,
                                  self.ad.dtype)  # fmt: skip
        cos, sin = rope[kind]
        slots = q_pos if slots is None else slots.to(dev)
        return self.ad.layers[l](h.to(dev), attention_mask=mask, position_embeddings=(cos.to(dev), sin.to(dev)),
                                 position_ids=q_pos[None], cache=Slots(keys, values, slots))  # fmt: skip

    def run_linear(self, l, h, states):
        """Gated DeltaNet layer `l` on consecutive rows h [1, Q, d] that follow the rows `states` (a transformers
        cache holding layer l's conv and recurrent states; empty: h starts the sequence) has seen; updates them."""
        layer = self.ad.layers[l]
        dev = self.ad.layer_device(l)
        return layer(h.to(dev), position_embeddings=None, attention_mask=None, cache=states)

    def mix(self, l, h, states):
        """Layer l's token mixer alone (input norm -> Gated DeltaNet) on consecutive rows h [1, Q, d]; updates
        `states` as `run_linear` does. Returns the mixer's output [1, Q, d] (what `finish` adds to the residual)."""
        layer = self.ad.layers[l]
        dev = self.ad.layer_device(l)
        return layer.linear_attn(layer.input_layernorm(h.to(dev)), cache=states, attention_mask=None)

    def finish(self, l, h, mixed):
        """The rest of layer l for rows h [1, Q, d] (its input) whose mixer output is `mixed` [1, Q, d]."""
        layer = self.ad.layers[l]
        h = h.to(mixed.device) + mixed
        return h + mlp_output(layer.mlp(layer.post_attention_layernorm(h)))
