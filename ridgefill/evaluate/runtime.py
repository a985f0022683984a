"""The reference fill runtime: a prefill that skips the late layers for most prompt rows (DESIGN.md section 1).

    from ridgefill.evaluate.runtime import prefill
    res = prefill(lm, input_ids, "ridgefill", split=S, tail=T, maps={l: (W, b), ...})
    res.logits      # [T, vocab] float32, for the last T rows
    res.cache       # a transformers DynamicCache: model(next_ids, cache=res.cache) continues at position N
    res.seconds     # wall time of the prefill

Arms (N rows, L layers, split S, tail T, prefix P = N - T):

- "exact": the stock model's own forward over all N rows.
- "ridgefill": layers 0..S-1 run every row. In each late layer l >= S the prefix rows (minus `exact_rows`) only
  get keys/values, computed from x_hat_l = W_l h_S + b_l through the layer's own input norm, k_proj / v_proj,
  k_norm and RoPE at their own positions (`Adapter.kv` + `Adapter.apply_rope`); nothing else of that layer runs
  for them. The tail rows and the exact rows run every layer exactly, attending causally to the filled cache.
- "identity": the same with x_hat_l = h_S.
- "nofill": late layers write nothing for the filled rows; the tail attends only to itself (and to exact rows)
  in late layers, at its original positions. Its cache has holes, which the stock model cannot continue from:
  `cache` is a `SlotCache`, which `greedy` (and `SlotCache.step`) decode from layer by layer.
- "ridgefill+rows": "ridgefill" plus attention-selected exact rows (seed 000, section 2.4): the `row_share`
  (default 10 %) of prompt rows that receive the most attention from the `probe` rows (default: the last 64
  prompt rows), summed over the heads of every layer below the split, run every layer exactly. The selection
  happens inside the prefill, after the early layers, and its cost is part of the measured time.

How it runs. The layers are the model's own decoder-layer modules, called one at a time with the model's own
embeddings, rotary embeddings and final norm / head. Masks are built here from explicit query and key positions
(causal, plus Gemma's window on sliding layers), so the stock attention code runs unchanged: each layer gets a
stand-in cache (`_Slots`) that holds all N key/value slots in position order, with the filled prefix already in
place, and writes the rows being run into their own slots when the attention calls `cache.update`. At the end the
slots become an ordinary `DynamicCache(config=...)` (sliding layers keep their last window - 1 rows, as the stock
cache does), so decoding continues with the stock model at positions N, N+1, ...

In sliding-window late layers only the prefix rows that some query (or the final cache) can see are filled:
rows more than a window behind the first query row get no keys at all.

Devices. The same code runs on a CPU, a GPU, and a model that accelerate spread over several devices and disk
(`load_model(device_map=...)`): the inputs go to the embeddings' device, each layer's key/value slots are made on
that layer's device (`Adapter.layer_device`) and everything a layer reads is moved there first. Logits come back
on the head's device, in float32; `seconds` waits for queued GPU work before it stops the clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ridgefill.errors import BadInput

ARMS = ("exact", "ridgefill", "identity", "nofill", "ridgefill+rows")
ROW_SHARE, PROBE_ROWS = 0.1, 64  # "+rows": 10 % of the prompt, by attention from its last 64 rows
SLIDING = "sliding_attention"


def ceiling(N: int, T: int, S: int, L: int) -> float:
    """Fraction of the exact prefill's layer-rows the fill still runs: (S*(N-T) + L*T) / (L*N).

    The speed-up ceiling is its inverse (filled rows' K/V projections counted as free)."""
    if not (L > 0 and N > 0 and 0 <= T <= N and 0 <= S <= L):
        raise BadInput(f"ceiling needs L > 0, N > 0, 0 <= T <= N, 0 <= S <= L (got N={N}, T={T}, S={S}, L={L})")
    return (S * (N - T) + L * T) / (L * N)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [T, vocab] float32: the last T rows
    cache: Any  # transformers DynamicCache continuing at position N, or a SlotCache (arm "nofill")
    seconds: float
    arm: str = ""
    split: int = 0
    tail: int = 0
    num_rows: int = 0
    exact_rows: list[int] = field(default_factory=list)


class _Slots:
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


def _mask(q_pos, kv_valid, window, impl: str, dtype):
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


def _check(lm, n: int, arm: str, split: int, tail: int, maps, exact_rows) -> list[int]:
    L = lm.adapter.num_layers
    if arm not in ARMS:
        raise BadInput(f"unknown arm '{arm}' (choose one of: {', '.join(ARMS)})")
    if n < 1:
        raise BadInput("prefill needs at least one input row")
    if not 1 <= tail <= n:
        raise BadInput(f"tail must be in 1..{n} (the number of input rows), got {tail}")
    if not 0 <= split <= L:
        raise BadInput(f"split must be in 0..{L} (the number of layers), got {split}")
    if arm.startswith("ridgefill"):
        if maps is None:
            raise BadInput(f"arm '{arm}' needs maps {{layer: (W, b)}}")
        missing = [l for l in range(split, L) if l not in maps]
        if missing:
            raise BadInput(f"maps lack late layers {missing} (split {split}, {L} layers)")
    rows = sorted({int(r) for r in (exact_rows if exact_rows is not None else [])})
    prefix = n - tail
    if rows and not (0 <= rows[0] and rows[-1] < prefix):
        raise BadInput(f"exact_rows must be prefix positions in 0..{prefix - 1}")
    if getattr(lm.adapter.config, "use_bidirectional_attention", False):
        raise BadInput("the fill runtime needs causal attention (this model uses bidirectional attention)")
    kinds = set(lm.adapter.layer_kinds)
    if not kinds <= {"full_attention", SLIDING}:
        raise BadInput(f"the fill runtime supports attention layers only (this model has {sorted(kinds)})")
    return rows


def _logits(lm, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own final norm, head and (Gemma) soft-capping on hidden [rows, d] -> [rows, vocab] float32,
    on the head's device."""
    model, ad = lm.model, lm.adapter
    normed = ad.base.norm(hidden.to(ad.module_device(ad.base.norm)))
    logits = model.lm_head(normed.to(ad.module_device(model.lm_head)))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def prefill(
    lm,
    input_ids: torch.Tensor,
    arm: str,
    *,
    split: int,
    tail: int,
    maps: dict | None = None,
    exact_rows=None,
    row_share: float = ROW_SHARE,
    probe=None,
) -> PrefillResult:
    """Prefill `input_ids` [N] (one sequence) with `arm`; see the module docstring.

    `row_share` and `probe` (prompt positions; default the last 64) only matter for "ridgefill+rows"."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = int(ids.shape[0])
    rows = _check(lm, n, arm, split, tail, maps, exact_rows)
    select = None
    if arm == "ridgefill+rows":
        if not 0 < row_share < 1:
            raise BadInput(f"row_share must be in (0, 1), got {row_share}")
        probe = list(range(max(0, n - PROBE_ROWS), n)) if probe is None else sorted({int(p) for p in probe})
        if not probe or probe[0] < 0 or probe[-1] >= n:
            raise BadInput(f"probe rows must be prompt positions in 0..{n - 1}")
        select = (round(row_share * n), probe)
    ids = ids.to(lm.adapter.device)
    if arm.startswith("ridgefill"):
        maps = maps_on_devices(lm, maps, range(split, lm.adapter.num_layers))  # before the clock starts
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        if arm == "exact":
            out = lm.model(input_ids=ids[None], use_cache=True, logits_to_keep=tail)
            logits = out.logits[0, -tail:].float()
            cache = getattr(out, "cache", None)  # 5.x name; `past_key_values` is a deprecated alias
        else:
            logits, cache, rows = _fill(lm, ids, arm, split, tail, maps, rows, select)
    _sync()  # a GPU runs asynchronously: the clock stops when its work is done
    seconds = time.perf_counter() - start
    return PrefillResult(logits=logits, cache=cache, seconds=seconds, arm=arm, split=split, tail=tail,
                         num_rows=n, exact_rows=rows)  # fmt: skip


def _sync() -> None:
    """Wait for queued GPU work (a no-op without CUDA), so that wall time measures the computation."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def maps_on_devices(lm, maps: dict, layers) -> dict:
    """{layer: (W, b)} as float32 tensors on each late layer's device (numpy arrays or tensors anywhere in).

    `prefill` calls it before its clock starts; a caller running many prefills with the same maps can call it
    once (tensors already in place are not copied again)."""
    ad = lm.adapter
    out = dict(maps)
    for l in layers:
        dev = ad.layer_device(l)
        W, b = maps[l]
        out[l] = (torch.as_tensor(W, dtype=torch.float32).to(dev), torch.as_tensor(b, dtype=torch.float32).to(dev))
    return out


class _Layers:
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
            mask = _mask(q_pos, kv_valid.to(dev), self.window if kind == SLIDING else None, self.impl, self.ad.dtype)
        cos, sin = rope[kind]
        slots = q_pos if slots is None else slots.to(dev)
        return self.ad.layers[l](h.to(dev), attention_mask=mask, position_embeddings=(cos.to(dev), sin.to(dev)),
                                 position_ids=q_pos[None], cache=_Slots(keys, values, slots))  # fmt: skip


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
        layers, p = _Layers(self.lm), self.next_position
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
        return _logits(self.lm, h[0, -1:])[0]


def greedy(lm, res: PrefillResult, max_new: int) -> list[int]:
    """Greedy tokens continuing from a prefill's cache (stops at the tokenizer's end-of-sequence token)."""
    eos = lm.tokenizer.eos_token_id
    cache, nxt, toks = res.cache, int(res.logits[-1].argmax()), []
    with torch.inference_mode():
        while len(toks) < max_new and nxt != eos:
            toks.append(nxt)
            if isinstance(cache, SlotCache):
                nxt = int(cache.step(nxt).argmax())
            else:
                o = lm.model(input_ids=torch.tensor([[nxt]], device=lm.adapter.device), cache=cache, use_cache=True)
                cache, nxt = o.cache, int(o.logits[0, -1].argmax())
    return toks


def _attention_received(ad, l, x, pos, keys, window) -> torch.Tensor:
    """Attention each key slot receives from the rows x [P, d] at positions pos [P] in layer l, summed over
    heads and rows: [n] float32. keys [1, kv_heads, n, head_dim] hold the layer's post-RoPE keys."""
    kind = ad.layer_kinds[l]
    q = ad.q(l, x)  # on the layer's device, like keys
    pos = pos.to(q.device)
    cos, sin = ad._rope_module_call(x.to(q.device), pos[None], kind)
    q = ad.apply_rope(q, cos[0], sin[0]).float()  # [P, heads, hd]
    k = keys[0].to(q.device).float().repeat_interleave(ad.num_heads // ad.num_kv_heads, dim=0)  # [heads, n, hd]
    scores = ad.attention_scaling(l) * torch.einsum("phd,hnd->hpn", q, k)  # [heads, P, n]
    kv = torch.arange(k.shape[1], device=k.device)[None, :]
    allowed = kv <= pos[:, None]
    if kind == SLIDING and window:
        allowed &= pos[:, None] - kv < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1).sum(dim=(0, 1))


def _fill(lm, ids, arm, split, tail, maps, rows, select):
    from transformers import DynamicCache

    model, ad = lm.model, lm.adapter
    layers = _Layers(lm)
    # Positions, masks and row indices live on the input device and move to each layer's device (with a device
    # map every layer may sit on another one); each layer's key/value slots are made on its own device.
    device, dtype = ad.device, ad.dtype
    n, L = int(ids.shape[0]), ad.num_layers
    prefix = n - tail
    all_pos = torch.arange(n, device=device)
    kv_shape = (1, ad.num_kv_heads, n, ad.head_dim)

    def new_slots(l):
        return torch.zeros(kv_shape, dtype=dtype, device=ad.layer_device(l))

    hidden = base_hidden = ad.base.embed_tokens(ids[None].to(device))  # [1, N, d]; Gemma's embedding scales
    rope = layers.rope(base_hidden, all_pos)  # [1, N, hd] per layer kind
    received = torch.zeros(n, device=device) if select else None

    kv_store: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Early layers: every row, exactly.
    every = torch.ones(n, dtype=torch.bool, device=device)
    for l in range(split):
        keys, values = new_slots(l), new_slots(l)
        layer_in = hidden
        hidden = layers.run(l, hidden, all_pos, rope, keys, values, every, every_row=True)
        kv_store.append((keys, values))
        if select:
            probe = torch.tensor(select[1], device=layer_in.device)
            received += _attention_received(ad, l, layer_in[0, probe], probe, keys, layers.window).to(device)
    h_split = hidden[0]  # [N, d]: the split state
    if select:  # "+rows": the most-attended prefix rows become exact rows
        order = torch.argsort(-received[:prefix], stable=True)  # ties: earlier position first
        rows = sorted(set(rows) | set(order[: min(select[0], prefix)].tolist()))

    # Late layers: the query rows (exact rows + tail) run; the filled rows only write keys/values.
    q_pos = torch.tensor(rows + list(range(prefix, n)), dtype=torch.long, device=device)
    q_rope = {kind: (cos[:, q_pos.to(cos.device)], sin[:, q_pos.to(sin.device)]) for kind, (cos, sin) in rope.items()}
    is_fill = torch.zeros(n, dtype=torch.bool, device=device)
    is_fill[:prefix] = True
    if rows:
        is_fill[torch.tensor(rows, device=device)] = False
    fill_pos = all_pos[is_fill] if arm != "nofill" else all_pos[:0]
    first_query = int(q_pos[0])
    hq = hidden[:, q_pos.to(hidden.device)]  # [1, Q, d]
    x_split = h_split.float()
    valid_store = [every] * split
    for l in range(split, L):
        dev = ad.layer_device(l)
        keys, values = new_slots(l), new_slots(l)
        kv_valid = torch.zeros(n, dtype=torch.bool, device=device)
        kv_valid[q_pos] = True
        kind = ad.layer_kinds[l]
        pos = fill_pos
        if kind == SLIDING and layers.window:
            pos = pos[pos > first_query - layers.window]  # older rows are outside every query's window
        if pos.numel():
            x = x_split[pos.to(x_split.device)].to(dev)  # [F, d] float32, on the layer's device
            if arm.startswith("ridgefill"):
                W, b = maps[l]
                W = torch.as_tensor(W, dtype=torch.float32, device=dev)  # in place already (maps_on_devices)
                b = torch.as_tensor(b, dtype=torch.float32, device=dev)
                x = x @ W.T + b
            k, v = ad.kv(l, x)  # [F, kv_heads, head_dim], before RoPE, on the layer's device
            cos, sin = rope[kind]
            at = pos.to(cos.device)
            k = ad.apply_rope(k, cos[0, at], sin[0, at])
            at = pos.to(dev)
            keys[0, :, at] = k.transpose(0, 1).to(dev, dtype)
            values[0, :, at] = v.transpose(0, 1).to(dev, dtype)
            kv_valid[pos] = True
        hq = layers.run(l, hq, q_pos, q_rope, keys, values, kv_valid)
        kv_store.append((keys, values))
        valid_store.append(kv_valid)

    logits = _logits(lm, hq[0, -tail:])
    if arm == "nofill":
        slots = [{"keys": k[0], "values": v[0], "positions": torch.where(ok, all_pos, -1).expand(ad.num_kv_heads, n)}
                 for (k, v), ok in zip(kv_store, valid_store)]  # fmt: skip
        return logits, SlotCache(lm, slots, n), rows
    cache = DynamicCache(config=model.config)
    for l, (keys, values) in enumerate(kv_store):
        cache.update(keys, values, l)  # sliding layers keep their last window - 1 rows, as in a stock prefill
    return logits, cache, rows
