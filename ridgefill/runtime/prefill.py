"""The reference fill runtime: a prefill that skips the late layers for most prompt rows (docs/runtime.md).

    from ridgefill.runtime import prefill
    res = prefill(lm, input_ids, "ridgefill", split=S, tail=T, maps={l: (W, b), ...})
    res.logits      # [T, vocab] float32, for the last T rows
    res.cache       # a transformers DynamicCache: model(next_ids, cache=res.cache) continues at position N
    res.seconds     # wall time of the prefill

Arms (N rows, L layers, split S, tail T, prefix P = N - T):

- "exact": the stock model's own forward over all N rows.
- "ridgefill": layers 0..S-1 run every row. In each late layer l >= S the prefix rows (minus the exact rows) only
  get keys/values, computed from x_hat_l = W_l h_S + b_l through the layer's own input norm, k_proj / v_proj,
  k_norm and RoPE at their own positions (`Adapter.kv` + `Adapter.apply_rope`); nothing else of that layer runs
  for them. The tail rows and the exact rows run every layer exactly, attending causally to the filled cache.
- "identity": the same with x_hat_l = h_S.
- "nofill": late layers write nothing for the filled rows; the tail attends only to itself (and to exact rows)
  in late layers, at its original positions. Its cache has holes, which the stock model cannot continue from:
  `cache` is a `SlotCache`, which `greedy` (and `SlotCache.step`) decode from layer by layer.
- Exact rows, in every arm but "exact": the first `anchor` prompt rows (default 1) and `exact_rows`. Row 0 is the
  attention sink: its split state is an outlier the fit leaves out (capture skips each document's first row), so a
  map's prediction for it is an extrapolation, and a filled sink can cost more than the whole fill saves.
- "ridgefill+rows": "ridgefill" plus attention-selected exact rows: the `row_share`
  (default 10 %) of prompt rows that receive the most attention from the `probe` rows (default: the last 64
  prompt rows), summed over the heads of every layer below the split, run every layer exactly. The selection
  happens inside the prefill, after the early layers, and its cost is part of the measured time.

How it runs. The layers are the model's own decoder-layer modules, called one at a time with the model's own
embeddings, rotary embeddings and final norm / head. Masks are built here from explicit query and key positions
(causal, plus Gemma's window on sliding layers), so the stock attention code runs unchanged: each layer gets a
stand-in cache (`layers.Slots`) that holds all N key/value slots in position order, with the filled prefix already in
place, and writes the rows being run into their own slots when the attention calls `cache.update`. At the end the
slots become an ordinary `DynamicCache(config=...)` (sliding layers keep their last window - 1 rows, as the stock
cache does), so decoding continues with the stock model at positions N, N+1, ...

In sliding-window late layers only the prefix rows that some query row (an exact row or the tail) sees are
filled: a row more than a window behind the next query row gets no keys at all. The final cache keeps only the
last window - 1 rows, which the tail's queries see.

Devices. The same code runs on a CPU, a GPU, and a model that accelerate spread over several devices and disk
(`load_model(device_map=...)`): the inputs go to the embeddings' device, each layer's key/value slots are made on
that layer's device (`Adapter.layer_device`) and everything a layer reads is moved there first. Logits come back
on the head's device, in float32; `seconds` waits for queued GPU work before it stops the clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ridgefill.errors import BadInput
from ridgefill.runtime.cache import SlotCache
from ridgefill.runtime.layers import SLIDING, Layers, final_logits
from ridgefill.runtime.maps import maps_on_devices

ARMS = ("exact", "ridgefill", "identity", "nofill", "ridgefill+rows")
ROW_SHARE, PROBE_ROWS = 0.1, 64  # "+rows": 10 % of the prompt, by attention from its last 64 rows
ANCHOR_ROWS = 1  # the first prompt row (the attention sink) runs every layer in every fill arm


def ceiling(N: int, T: int, S: int, L: int) -> float:
    """Fraction of the exact prefill's layer-rows the fill still runs: (S*(N-T) + L*T) / (L*N).

    The speed-up ceiling is its inverse (filled rows' K/V projections counted as free)."""
    if not (L > 0 and N > 0 and 0 <= T <= N and 0 <= S <= L):
        raise BadInput(f"ceiling needs L > 0, N > 0, 0 <= T <= N, 0 <= S <= L (got N={N}, T={T}, S={S}, L={L})")
    return (S * (N - T) + L * T) / (L * N)


@dataclass
class PrefillResult:
    """What `prefill` returns: the last `tail` rows' logits, a cache to decode from, and the measured time."""

    logits: torch.Tensor  # [T, vocab] float32: the last T rows
    cache: Any  # transformers DynamicCache continuing at position N, or a SlotCache (arm "nofill")
    seconds: float
    arm: str = ""
    split: int = 0
    tail: int = 0
    num_rows: int = 0
    exact_rows: list[int] = field(default_factory=list)


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
    anchor: int = ANCHOR_ROWS,
) -> PrefillResult:
    """Prefill `input_ids` [N] (one sequence) with `arm`; see the module docstring.

    `row_share` and `probe` (prompt positions; default the last 64) only matter for "ridgefill+rows". `anchor`:
    how many first prompt rows run every layer in the fill arms (0 fills the sink too, for comparison only)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = int(ids.shape[0])
    if not (isinstance(anchor, int) and anchor >= 0):
        raise BadInput(f"anchor must be a non-negative number of rows, got {anchor!r}")
    rows = _check(lm, n, arm, split, tail, maps, exact_rows)
    if arm != "exact":
        rows = sorted(set(rows) | set(range(min(anchor, n - tail))))
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
    layers = Layers(lm)
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
    if layers.window:  # sliding layers fill only the rows some query row sees: the next query at or after them
        nxt = torch.searchsorted(q_pos, fill_pos)  # q_pos is sorted; fill rows are never query rows
        ahead = torch.cat([q_pos, q_pos.new_tensor([n + layers.window])])[nxt]
        fill_pos_sliding = fill_pos[ahead - fill_pos < layers.window]
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
            pos = fill_pos_sliding  # the other rows are outside every query's window
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

    logits = final_logits(lm, hq[0, -tail:])
    if arm == "nofill":
        slots = [{"keys": k[0], "values": v[0], "positions": torch.where(ok, all_pos, -1).expand(ad.num_kv_heads, n)}
                 for (k, v), ok in zip(kv_store, valid_store)]  # fmt: skip
        return logits, SlotCache(lm, slots, n), rows
    cache = DynamicCache(config=model.config)
    for l, (keys, values) in enumerate(kv_store):
        cache.update(keys, values, l)  # sliding layers keep their last window - 1 rows, as in a stock prefill
    return logits, cache, rows
