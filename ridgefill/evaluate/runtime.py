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
  in late layers, at its original positions. Its cache has holes, so it cannot be continued by the stock model:
  `cache` is None for this arm.

How it runs. The layers are the model's own decoder-layer modules, called one at a time with the model's own
embeddings, rotary embeddings and final norm / head. Masks are built here from explicit query and key positions
(causal, plus Gemma's window on sliding layers), so the stock attention code runs unchanged: each layer gets a
stand-in cache (`_Slots`) that holds all N key/value slots in position order, with the filled prefix already in
place, and writes the rows being run into their own slots when the attention calls `cache.update`. At the end the
slots become an ordinary `DynamicCache(config=...)` (sliding layers keep their last window - 1 rows, as the stock
cache does), so decoding continues with the stock model at positions N, N+1, ...

In sliding-window late layers only the prefix rows that some query (or the final cache) can see are filled:
rows more than a window behind the first query row get no keys at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ridgefill.errors import BadInput

ARMS = ("exact", "ridgefill", "identity", "nofill")
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
    cache: Any  # transformers DynamicCache continuing at position N, or None (arm "nofill")
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
        self.keys[:, :, self.slots] = key_states.to(self.keys.dtype)
        self.values[:, :, self.slots] = value_states.to(self.values.dtype)
        return self.keys, self.values


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
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))


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
    if arm == "ridgefill":
        if maps is None:
            raise BadInput("arm 'ridgefill' needs maps {layer: (W, b)}")
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
    """The model's own final norm, head and (Gemma) soft-capping on hidden [rows, d] -> [rows, vocab] float32."""
    model, base = lm.model, lm.adapter.base
    logits = model.lm_head(base.norm(hidden))
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
) -> PrefillResult:
    """Prefill `input_ids` [N] (one sequence) with `arm`; see the module docstring."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = int(ids.shape[0])
    rows = _check(lm, n, arm, split, tail, maps, exact_rows)
    model, ad = lm.model, lm.adapter
    device = ad.device
    ids = ids.to(device)
    start = time.perf_counter()
    with torch.no_grad():
        if arm == "exact":
            out = model(input_ids=ids[None], use_cache=True, logits_to_keep=tail)
            logits = out.logits[0, -tail:].float()
            cache = getattr(out, "cache", None)  # 5.x name; `past_key_values` is a deprecated alias
        else:
            logits, cache = _fill(lm, ids, arm, split, tail, maps, rows)
    seconds = time.perf_counter() - start
    return PrefillResult(logits=logits, cache=cache, seconds=seconds, arm=arm, split=split, tail=tail,
                         num_rows=n, exact_rows=rows)  # fmt: skip


def _fill(lm, ids, arm, split, tail, maps, rows):
    from transformers import DynamicCache

    model, ad = lm.model, lm.adapter
    base, cfg = ad.base, ad.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise BadInput(f"the fill runtime supports sdpa and eager attention, not '{impl}'")
    device, dtype = ad.device, ad.dtype
    n, L = int(ids.shape[0]), ad.num_layers
    prefix = n - tail
    window = getattr(cfg, "sliding_window", None)
    all_pos = torch.arange(n, device=device)
    kv_shape = (1, ad.num_kv_heads, n, ad.head_dim)

    def new_slots():
        return torch.zeros(kv_shape, dtype=dtype, device=device)

    hidden = base.embed_tokens(ids[None])  # [1, N, d]; Gemma's embedding module applies its own scale
    rope = {kind: ad._rope_module_call(hidden, all_pos[None], kind) for kind in set(ad.layer_kinds)}  # [1, N, hd]

    def run_layer(l, h, q_pos, keys, values, kv_valid, every_row=False):
        kind = ad.layer_kinds[l]
        cos, sin = rope[kind]
        if every_row and impl == "sdpa" and kind != SLIDING:
            mask = None  # all rows, in order: sdpa's own is_causal path, as the stock prefill takes
        else:
            mask = _mask(q_pos, kv_valid, window if kind == SLIDING else None, impl, dtype)
        return ad.layers[l](
            h,
            attention_mask=mask,
            position_embeddings=(cos[:, q_pos], sin[:, q_pos]),
            position_ids=q_pos[None],
            cache=_Slots(keys, values, q_pos),
        )

    kv_store: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Early layers: every row, exactly.
    every = torch.ones(n, dtype=torch.bool, device=device)
    for l in range(split):
        keys, values = new_slots(), new_slots()
        hidden = run_layer(l, hidden, all_pos, keys, values, every, every_row=True)
        kv_store.append((keys, values))
    h_split = hidden[0]  # [N, d]: the split state

    # Late layers: the query rows (exact rows + tail) run; the filled rows only write keys/values.
    q_pos = torch.tensor(rows + list(range(prefix, n)), dtype=torch.long, device=device)
    is_fill = torch.zeros(n, dtype=torch.bool, device=device)
    is_fill[:prefix] = True
    if rows:
        is_fill[torch.tensor(rows, device=device)] = False
    fill_pos = all_pos[is_fill] if arm != "nofill" else all_pos[:0]
    first_query = int(q_pos[0])
    hq = hidden[:, q_pos]  # [1, Q, d]
    x_split = h_split.float()
    for l in range(split, L):
        keys, values = new_slots(), new_slots()
        kv_valid = torch.zeros(n, dtype=torch.bool, device=device)
        kv_valid[q_pos] = True
        kind = ad.layer_kinds[l]
        pos = fill_pos
        if kind == SLIDING and window:
            pos = pos[pos > first_query - window]  # older rows are outside every query's window
        if pos.numel():
            x = x_split[pos]  # [F, d]
            if arm == "ridgefill":
                W, b = maps[l]
                W = torch.as_tensor(W, dtype=torch.float32, device=device)
                b = torch.as_tensor(b, dtype=torch.float32, device=device)
                x = x @ W.T + b
            k, v = ad.kv(l, x)  # [F, kv_heads, head_dim], before RoPE
            cos, sin = rope[kind]
            k = ad.apply_rope(k, cos[0, pos], sin[0, pos])
            keys[0, :, pos] = k.transpose(0, 1).to(dtype)
            values[0, :, pos] = v.transpose(0, 1).to(dtype)
            kv_valid[pos] = True
        hq = run_layer(l, hq, q_pos, keys, values, kv_valid)
        kv_store.append((keys, values))

    logits = _logits(lm, hq[0, -tail:])
    if arm == "nofill":
        return logits, None
    cache = DynamicCache(config=model.config)
    for l, (keys, values) in enumerate(kv_store):
        cache.update(keys, values, l)  # sliding layers keep their last window - 1 rows, as in a stock prefill
    return logits, cache
