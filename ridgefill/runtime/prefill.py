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
  map's prediction for it is an extrapolation, and a filled sink can cost more than the whole fill saves. Prefix
  rows whose split state is an outlier by norm (`outlier_rows`: more than `outliers` x the prefix's median, default
  20) are later sinks, and run exactly for the same reason (`outliers=0` turns this off).
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

Hybrids (docs/hybrid.md). A Gated DeltaNet layer has a recurrent state instead of key/value slots: early ones run
every row in order; in a late one the state runs over the prefix with the filled rows' predicted inputs and the
exact rows' true ones, then over the tail, and only the query rows get the rest of the layer. The states land in
the final cache beside the attention layers' keys and values.

Corrections (`corrections=`, ridgefill.runtime.corrections): per-request value / key rescales and key-mean shift
of the filled keys and values, measured on the first tail rows, and the terminal-state correction of a hybrid's
filled Gated DeltaNet states.

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
from ridgefill.runtime import corrections as fixes
from ridgefill.runtime.cache import SlotCache
from ridgefill.runtime.layers import LINEAR, SLIDING, Layers, final_logits, holds_state
from ridgefill.runtime.maps import maps_on_devices

ARMS = ("exact", "ridgefill", "identity", "nofill", "ridgefill+rows")
ROW_SHARE, PROBE_ROWS = 0.1, 64  # "+rows": 10 % of the prompt, by attention from its last 64 rows
ANCHOR_ROWS = 1  # the first prompt row (the attention sink) runs every layer in every fill arm
OUTLIER_RATIO = 20.0  # a prefix row whose split state is 20x the median norm (another sink) runs every layer


def outlier_rows(h, ratio: float = OUTLIER_RATIO):
    """Rows of h [n, d] whose norm exceeds `ratio` x the median row norm: [n] bool (all False when ratio is 0).

    Some prompts grow a second attention sink after row 0: a row whose hidden state is two orders of magnitude
    larger than the rest (SmolLM2 at layers 12+: 40-170x the median, while ordinary rows stay under 13x on both
    built-ins). A map's prediction for such a row is an extrapolation, so capture leaves these rows out of the
    fit and the fill runs them exactly, by this one rule."""
    norms = h.float().norm(dim=-1)
    if not ratio or norms.numel() == 0:
        return torch.zeros(norms.shape, dtype=torch.bool, device=norms.device)
    return norms > ratio * norms.median()


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
    if not kinds <= {"full_attention", SLIDING, LINEAR}:
        raise BadInput(f"the fill runtime supports attention and Gated DeltaNet layers only (this model has "
                       f"{sorted(kinds)})")
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
    logits_rows: int | None = None,
    outliers: float = OUTLIER_RATIO,
    corrections=(),
    state_offsets: dict | None = None,
    correction_rows: int = fixes.CORRECTION_ROWS,
) -> PrefillResult:
    """Prefill `input_ids` [N] (one sequence) with `arm`; see the module docstring.

    `row_share` and `probe` (prompt positions; default the last 64) only matter for "ridgefill+rows". `anchor`:
    how many first prompt rows run every layer in the fill arms (0 fills the sink too, for comparison only).
    `outliers`: prefix rows whose split state exceeds this many times the prefix's median norm run every layer
    too (0: none). `logits_rows`: how many last rows get logits (default `tail`; 1 is enough to decode).
    `corrections`: any of "vscale", "kscale", "kshift" (measured on the first `correction_rows` tail rows) and
    "state" (with `state_offsets` {layer: [value heads, key dim, value dim]}), for the fill arms
    (ridgefill.runtime.corrections)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = int(ids.shape[0])
    _check_rows_rules(anchor, outliers)
    rows = _check(lm, n, arm, split, tail, maps, exact_rows)
    fix = _fix(lm, arm, split, corrections, state_offsets, correction_rows)
    keep = _logits_rows(logits_rows, tail)
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
            out = lm.model(input_ids=ids[None], use_cache=True, logits_to_keep=keep)
            logits = out.logits[0, -keep:].float()
            cache = getattr(out, "cache", None)  # 5.x name; `past_key_values` is a deprecated alias
        else:
            logits, cache, rows = _fill(lm, ids, arm, split, tail, maps, rows, select, keep, outliers, fix)
    _sync()  # a GPU runs asynchronously: the clock stops when its work is done
    seconds = time.perf_counter() - start
    return PrefillResult(logits=logits, cache=cache, seconds=seconds, arm=arm, split=split, tail=tail,
                         num_rows=n, exact_rows=rows)  # fmt: skip


@dataclass(frozen=True)
class _Fix:
    """The corrections of one fill: which, the terminal-state offsets on the layers' devices, rows to measure on."""

    which: tuple[str, ...] = ()
    offsets: dict | None = None
    rows: int = fixes.CORRECTION_ROWS


def _fix(lm, arm, split, corrections, state_offsets, rows) -> _Fix:
    which = fixes.check_corrections(lm.adapter, split, corrections, state_offsets)
    if not which:
        return _Fix()
    if arm in ("exact", "nofill"):
        raise BadInput(f"corrections apply to the fill arms, not '{arm}'")
    if not (isinstance(rows, int) and rows >= 1):
        raise BadInput(f"correction_rows must be a positive number of tail rows, got {rows!r}")
    offsets = None
    if "state" in which:
        ad = lm.adapter
        offsets = {int(l): torch.as_tensor(o, dtype=torch.float32).to(ad.layer_device(int(l)))
                   for l, o in state_offsets.items()}  # fmt: skip
    return _Fix(which, offsets, rows)


def _check_rows_rules(anchor, outliers) -> None:
    if not (isinstance(anchor, int) and anchor >= 0):
        raise BadInput(f"anchor must be a non-negative number of rows, got {anchor!r}")
    if not (isinstance(outliers, (int, float)) and (outliers == 0 or outliers > 1)):
        raise BadInput(f"outliers must be 0 (off) or a norm ratio above 1, got {outliers!r}")


def _with_outliers(rows: list[int], h_split, prefix: int, outliers: float) -> list[int]:
    """`rows` plus the prefix rows whose split state h_split [N, d] is an outlier by norm (`outlier_rows`)."""
    if not outliers or prefix < 1:
        return rows
    found = torch.nonzero(outlier_rows(h_split[:prefix], outliers)).flatten().tolist()
    return sorted(set(rows) | set(found))


def _logits_rows(logits_rows, tail: int) -> int:
    if logits_rows is None:
        return tail
    if not (isinstance(logits_rows, int) and 1 <= logits_rows <= tail):
        raise BadInput(f"logits_rows must be in 1..{tail} (the tail), got {logits_rows!r}")
    return logits_rows


@dataclass
class ExactRun:
    """One exact forward that many fills are built from (`exact_run`, then `prefill_from` per arm and split).

    Every fill arm at split S runs layers 0..S-1 exactly on every row, and the exact forward has run them all: so
    the exact forward's cache (its early layers) and its hidden state entering layer S are all a fill needs, and
    only the late layers' work remains per arm. Nothing here is ever modified: `prefill_from` copies what it keeps.
    """

    ids: torch.Tensor  # [N], on the input device
    logits: torch.Tensor  # [logits_rows, vocab] float32: exact's last rows
    cache: Any  # the stock forward's DynamicCache
    states: dict[int, torch.Tensor]  # {split S: the hidden state entering layer S, [N, d] in the model dtype}
    seconds: float  # the whole forward, hooks included

    def result(self, tail: int) -> PrefillResult:
        """The exact arm, as `prefill(..., "exact")` returns it (with its own cache, to decode from)."""
        n = int(self.ids.shape[0])
        return PrefillResult(logits=self.logits, cache=_cache_copy(self.cache, len(self.cache.layers)),
                             seconds=self.seconds, arm="exact", tail=tail, num_rows=n)


def exact_run(lm, input_ids: torch.Tensor, *, splits=(), logits_rows: int = 1) -> ExactRun:
    """The stock model's forward over `input_ids` [N], keeping its cache, the last `logits_rows` rows' logits
    and the hidden state entering each layer of `splits` (memory: len(splits) x N x d)."""
    from ridgefill.capture.hooks import layer_inputs

    ad = lm.adapter
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(ad.device)
    n, splits = int(ids.shape[0]), sorted({int(s) for s in splits})
    if not 1 <= logits_rows <= n:
        raise BadInput(f"logits_rows must be in 1..{n}, got {logits_rows}")
    bad = [s for s in splits if not 0 <= s <= ad.num_layers]
    if bad:
        raise BadInput(f"split(s) {bad} out of range 0..{ad.num_layers}")
    _sync()
    start = time.perf_counter()
    layers = list(ad.layers) + [ad.base.norm]  # S = L: the state after the last layer is the final norm's input
    with torch.no_grad(), layer_inputs(layers, splits, stop=False) as seen:
        out = lm.model(input_ids=ids[None], use_cache=True, logits_to_keep=logits_rows)
    states = {s: seen[s][0] for s in splits}
    _sync()
    return ExactRun(ids=ids, logits=out.logits[0].float(), cache=out.cache, states=states,
                    seconds=time.perf_counter() - start)


def prefill_from(
    lm,
    run: ExactRun,
    arm: str,
    *,
    split: int,
    tail: int,
    maps: dict | None = None,
    exact_rows=None,
    anchor: int = ANCHOR_ROWS,
    logits_rows: int | None = None,
    outliers: float = OUTLIER_RATIO,
    corrections=(),
    state_offsets: dict | None = None,
    correction_rows: int = fixes.CORRECTION_ROWS,
) -> PrefillResult:
    """The fill arm `arm` ("ridgefill", "identity" or "nofill") at `split`, built from an exact run of the same
    prompt: the same result as `prefill(lm, run.ids, arm, ...)` up to float round-off, for the cost of the late
    layers alone. `seconds` is the time of that remaining work, not a prefill's: time arms with `prefill`."""
    n = int(run.ids.shape[0])
    if arm not in ("ridgefill", "identity", "nofill"):
        raise BadInput(f"prefill_from builds 'ridgefill', 'identity' or 'nofill', not '{arm}' (use prefill)")
    if split not in run.states:
        raise BadInput(f"the exact run kept no state for split {split} (it has {sorted(run.states)})")
    _check_rows_rules(anchor, outliers)
    rows = _check(lm, n, arm, split, tail, maps, exact_rows)
    fix = _fix(lm, arm, split, corrections, state_offsets, correction_rows)
    rows = sorted(set(rows) | set(range(min(anchor, n - tail))))
    rows = _with_outliers(rows, run.states[split], n - tail, outliers)
    keep = _logits_rows(logits_rows, tail)
    ad = lm.adapter
    if arm == "ridgefill":
        maps = maps_on_devices(lm, maps, range(split, ad.num_layers))
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        layers = Layers(lm)
        h = run.states[split]
        rope = layers.rope(h[None], torch.arange(n, device=ad.device))
        # The early layers' cache, copied; the late Gated DeltaNet layers write their states into it as they run.
        cache = _cache_copy(run.cache, split, lm.model.config)
        logits, late = _late(lm, layers, h, rope, arm, split, tail, maps, rows, keep, cache, fix)
        if arm == "nofill":
            early = []
            for l in range(split):
                if ad.is_linear(l):
                    early.append(None)
                    continue
                k, v = run.cache.layers[l].keys[0], run.cache.layers[l].values[0]  # a sliding layer: its last rows
                pos = torch.arange(n - k.shape[1], n, device=k.device).expand(ad.num_kv_heads, -1)
                early.append({"keys": k, "values": v, "positions": pos})
            all_pos = torch.arange(n, device=ad.device)
            cache = SlotCache(lm, early + _late_slots(ad, late, all_pos), n, states=cache)
        else:
            for l, entry in enumerate(late, start=split):
                if entry is not None:
                    cache.update(entry[0], entry[1], l)
    _sync()
    return PrefillResult(logits=logits, cache=cache, seconds=time.perf_counter() - start, arm=arm, split=split,
                         tail=tail, num_rows=n, exact_rows=rows)


def _cache_copy(cache, layers: int, config=None):
    """A cache whose first `layers` layers are copies of `cache`'s: the rest are `cache`'s own layers, or, given
    the model `config`, fresh empty ones. Decoding replaces an attention layer's tensors (it concatenates), so the
    tensors shared with `cache` are never written; a Gated DeltaNet layer's states are updated in place, so they
    are cloned (they are small: no rows)."""
    import copy

    from transformers import DynamicCache

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
    import copy

    new = copy.copy(layer)
    if holds_state(layer):
        for name in ("conv_states", "recurrent_states", "is_conv_states_initialized",
                     "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size"):
            states = getattr(layer, name)
            setattr(new, name, {i: t.clone() if isinstance(t, torch.Tensor) else t for i, t in states.items()})
    return new


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


def _fill(lm, ids, arm, split, tail, maps, rows, select, keep, outliers, fix):
    from transformers import DynamicCache

    model, ad = lm.model, lm.adapter
    layers = Layers(lm)
    cache = DynamicCache(config=model.config)  # Gated DeltaNet layers update their states here as they run
    # Positions, masks and row indices live on the input device and move to each layer's device (with a device
    # map every layer may sit on another one); each layer's key/value slots are made on its own device.
    device = ad.device
    n = int(ids.shape[0])
    prefix = n - tail
    all_pos = torch.arange(n, device=device)
    hidden = base_hidden = ad.base.embed_tokens(ids[None].to(device))  # [1, N, d]; Gemma's embedding scales
    rope = layers.rope(base_hidden, all_pos)  # [1, N, hd] per layer kind
    received = torch.zeros(n, device=device) if select else None

    early: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Early layers: every row, exactly.
    every = torch.ones(n, dtype=torch.bool, device=device)
    for l in range(split):
        if ad.is_linear(l):
            hidden = layers.run_linear(l, hidden, cache)
            early.append(None)
            continue
        keys, values = _new_slots(ad, l, n), _new_slots(ad, l, n)
        layer_in = hidden
        hidden = layers.run(l, hidden, all_pos, rope, keys, values, every, every_row=True)
        early.append((keys, values))
        if select:
            probe = torch.tensor(select[1], device=layer_in.device)
            received += _attention_received(ad, l, layer_in[0, probe], probe, keys, layers.window).to(device)
    if select:  # "+rows": the most-attended prefix rows become exact rows
        order = torch.argsort(-received[:prefix], stable=True)  # ties: earlier position first
        rows = sorted(set(rows) | set(order[: min(select[0], prefix)].tolist()))
    rows = _with_outliers(rows, hidden[0], prefix, outliers)
    logits, late = _late(lm, layers, hidden[0], rope, arm, split, tail, maps, rows, keep, cache, fix)
    if arm == "nofill":
        slots = [None if e is None else {"keys": e[0][0], "values": e[1][0],
                                         "positions": all_pos.expand(ad.num_kv_heads, n)} for e in early]
        return logits, SlotCache(lm, slots + _late_slots(ad, late, all_pos), n, states=cache), rows
    for l, entry in enumerate(early + late):
        if entry is not None:  # sliding layers keep their last window - 1 rows, as in a stock prefill
            cache.update(entry[0], entry[1], l)
    return logits, cache, rows


def _new_slots(ad, l: int, n: int) -> torch.Tensor:
    """Zeroed key (or value) slots of layer l for n rows, on the layer's device: [1, kv_heads, n, head_dim]."""
    return torch.zeros((1, ad.num_kv_heads, n, ad.head_dim), dtype=ad.dtype, device=ad.layer_device(l))


def _late_slots(ad, late, all_pos) -> list[dict]:
    """SlotCache layers of the late layers (the "nofill" arm's holes are empty slots, position -1; a Gated
    DeltaNet layer, None, keeps its states in the SlotCache's `states`)."""
    n = all_pos.shape[0]
    return [None if e is None else
            {"keys": e[0][0], "values": e[1][0], "positions": torch.where(e[2], all_pos, -1).expand(ad.num_kv_heads, n)}
            for e in late]  # fmt: skip


def _late(lm, layers, h_split, rope, arm, split, tail, maps, rows, keep, states, fix=None):
    """Late layers from the split state h_split [N, d]: the query rows (exact rows + tail) run every layer; the
    filled rows only write keys/values (attention) or their state updates (Gated DeltaNet, into `states`, a
    transformers cache). `fix`: the corrections (`_Fix`). Returns the last `keep` rows' logits and, per late
    layer, (keys, values, valid slots), or None for a Gated DeltaNet layer."""
    fix = fix or _Fix()
    kv_fix = [c for c in fix.which if c in fixes.KV_CORRECTIONS]
    ad = lm.adapter
    device, dtype = ad.device, ad.dtype
    n, L = int(h_split.shape[0]), ad.num_layers
    prefix = n - tail
    all_pos = torch.arange(n, device=device)
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
    hq = h_split[q_pos.to(h_split.device)][None]  # [1, Q, d]
    x_split = h_split.float()
    late = []
    for l in range(split, L):
        dev = ad.layer_device(l)
        if ad.is_linear(l):
            x = _predicted(arm, maps, l, x_split, fill_pos, dev)
            offset = fix.offsets[l] if "state" in fix.which else None
            hq = _late_linear(layers, l, hq, x, fill_pos, rows, prefix, states, offset)
            late.append(None)
            continue
        keys, values = _new_slots(ad, l, n), _new_slots(ad, l, n)
        kv_valid = torch.zeros(n, dtype=torch.bool, device=device)
        kv_valid[q_pos] = True
        kind = ad.layer_kinds[l]
        pos = fill_pos
        if kind == SLIDING and layers.window:
            pos = fill_pos_sliding  # the other rows are outside every query's window
        if pos.numel():
            x = _predicted(arm, maps, l, x_split, pos, dev)
            k, v = ad.kv(l, x)  # [F, kv_heads, head_dim], before RoPE, on the layer's device
            if kv_fix:  # measured on the first tail rows: from their true input (hq) and from the map's prediction
                m = min(fix.rows, tail)
                r = len(rows)
                k_true, v_true = ad.kv(l, hq[0, r : r + m])
                k_pred, v_pred = ad.kv(l, _predicted(arm, maps, l, x_split, all_pos[prefix : prefix + m], dev))
                k, v = fixes.apply_kv(fixes.kv_params(kv_fix, k_true, v_true, k_pred, v_pred), k, v)
            cos, sin = rope[kind]
            at = pos.to(cos.device)
            k = ad.apply_rope(k, cos[0, at], sin[0, at])
            at = pos.to(dev)
            keys[0, :, at] = k.transpose(0, 1).to(dev, dtype)
            values[0, :, at] = v.transpose(0, 1).to(dev, dtype)
            kv_valid[pos] = True
        hq = layers.run(l, hq, q_pos, q_rope, keys, values, kv_valid)
        late.append((keys, values, kv_valid))
    return final_logits(lm, hq[0, -keep:]), late


def _predicted(arm, maps, l, x_split, pos, dev):
    """The filled rows' input to late layer l: W_l h_S + b_l ("ridgefill"), or h_S ("identity"), for the rows at
    `pos` of x_split [N, d] float32: [F, d] float32 on `dev`."""
    x = x_split[pos.to(x_split.device)].to(dev)
    if arm.startswith("ridgefill"):
        W, b = maps[l]
        W = torch.as_tensor(W, dtype=torch.float32, device=dev)  # in place already (maps_on_devices)
        b = torch.as_tensor(b, dtype=torch.float32, device=dev)
        x = x @ W.T + b
    return x


def _late_linear(layers, l, hq, x_fill, fill_pos, rows, prefix, states, offset=None):
    """A late Gated DeltaNet layer. Its state runs over the prefix in order, every row in its own place: a filled
    row contributes from its predicted input x_fill [F, d] (at fill_pos), an exact row from its true input (hq's
    first len(rows) rows); in "nofill" (no fill_pos) only the exact rows contribute. The tail then continues from
    that state. Only the query rows (hq [1, Q, d]: the exact rows, then the tail) get the rest of the layer;
    returns their output [1, Q, d]. `offset` [value heads, key dim, value dim]: the terminal-state correction,
    added to the state at the end of the prefix scaled by the filled rows' share of it."""
    ad = layers.ad
    dev = ad.layer_device(l)
    hq = hq.to(dev)
    r = len(rows)
    at = torch.tensor(rows, dtype=torch.long, device=dev)
    if fill_pos.numel():
        x = hq.new_empty((1, prefix, hq.shape[-1]))
        x[0, fill_pos.to(dev)] = x_fill.to(hq.dtype)
        x[0, at] = hq[0, :r]
    else:
        x, at = hq[:, :r], torch.arange(r, device=dev)
    parts = []
    if x.shape[1]:
        parts.append(layers.mix(l, x, states)[:, at])
        if offset is not None and fill_pos.numel():
            filled = torch.ones(prefix, dtype=torch.bool, device=dev)
            filled[at] = False
            share = fixes.filled_share(ad.linear_log_gates(l, x[0]), filled)  # [value heads]
            state = states.layers[l].recurrent_states[0]  # [1, value heads, key dim, value dim], updated in place
            state += (share.to(offset.device)[:, None, None] * offset).to(state)[None]
    parts.append(layers.mix(l, hq[:, r:], states))
    return layers.finish(l, hq, torch.cat(parts, dim=1))
