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
- Exact rows, in every arm but "exact": the first `anchor` prompt rows (default 1) and `exact_rows`, the prefix rows
  whose token id is in `protected` (a release's protected-token table, for its ridgefill+protected configuration),
  and prefix rows whose split state's norm exceeds `exact_norm` (the release's `fit.exact_norm`; None, the default,
  turns this off): sinks, which a map's prediction would extrapolate to (rows.py has the rules).
- "ridgefill+rows": "ridgefill" plus attention-selected exact rows: the `row_share`
  (default 10 %) of prompt rows that receive the most attention from the `probe` rows (default: the last 64
  prompt rows), summed over the heads of every layer below the split, run every layer exactly. The selection
  happens inside the prefill, after the early layers, and its cost is part of the measured time.

`prefix_prefill` computes the first N - T rows' cache alone, for an engine that computes the tail itself.

Options (`FillOptions`, keyword arguments of `prefill`, `prefill_from` and `prefix_prefill`): `split`, `tail`,
`maps`, `exact_rows`, `row_share`, `probe`, `anchor`, `logits_rows`, `exact_norm`, `corrections`, `state_offsets`,
`correction_rows`, `protected`, `states`. A release's maps and configuration give them: `prefill(lm, ids, rel.arm,
**rel.options())` (maps.py).

How it runs (fill.py). The layers are the model's own decoder-layer modules, called one at a time with the model's own
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
from ridgefill.models.kinds import FULL, LINEAR, SLIDING
from ridgefill.runtime import corrections as fixes
from ridgefill.runtime.cache import SlotCache, cache_copy
from ridgefill.runtime.fill import INPUT_MAP, KV_MAP, Fill, fill, late_layers, late_slots, stacked
from ridgefill.runtime.layers import Layers
from ridgefill.runtime.maps import maps_on_devices
from ridgefill.runtime.rows import (ANCHOR_ROWS, PROBE_ROWS, ROW_SHARE, anchor_rows, attention_received, is_norm,
                                    most_attended, prefix_end, tail_fits, with_norm_rows)

ARMS = ("exact", "ridgefill", "identity", "nofill", "ridgefill+rows")


def ceiling(N: int, T: int, S: int, L: int) -> float:
    """Fraction of the exact prefill's layer-rows the fill still runs: (S*(N-T) + L*T) / (L*N).

    The speed-up ceiling is its inverse (filled rows' K/V projections counted as free): `ceiling_speedup`."""
    run, total = _layer_rows(N, T, S, L)
    return run / total


def ceiling_speedup(N: int, T: int, S: int, L: int) -> float:
    """The speed-up ceiling 1 / `ceiling`, as one division of the integer counts, (L*N) / (S*(N-T) + L*T):
    correctly rounded, which 1 / ceiling(...) (two roundings) is not always (it may differ in the last bit)."""
    run, total = _layer_rows(N, T, S, L)
    return total / run if run else float("inf")


def _layer_rows(N: int, T: int, S: int, L: int) -> tuple[int, int]:
    """(layer-rows the fill runs, layer-rows the exact prefill runs) for N rows, tail T, split S and L layers."""
    if not (L > 0 and N > 0 and 0 <= T <= N and 0 <= S <= L):
        raise BadInput(f"ceiling needs L > 0, N > 0, 0 <= T <= N, 0 <= S <= L (got N={N}, T={T}, S={S}, L={L})")
    return S * (N - T) + L * T, L * N


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


@dataclass(frozen=True)
class FillOptions:
    """How a prefill fills: the keyword arguments of `prefill` and `prefill_from`, with their defaults.

    `row_share` and `probe` (prompt positions; default the last 64) only matter for "ridgefill+rows". `anchor`:
    how many first prompt rows run every layer in the fill arms (0 fills the sink too, for comparison only).
    `exact_norm`: prefix rows whose split state's norm exceeds it run every layer too (None: none; a release's
    `fit.exact_norm`, which `ReleaseMaps.options()` gives). `logits_rows`: how many last rows get logits (default
    `tail`; 1 is enough to decode).
    `corrections`: any of "vscale", "kscale", "kshift" (measured on the first `correction_rows` tail rows) and
    "state" (with `state_offsets` {layer: [value heads, key dim, value dim]}), for the fill arms
    (ridgefill.runtime.corrections). `protected`: token ids (a list, set, array or tensor); in the fill arms every
    prefix row whose token is one of them runs every layer (a release's protected-token table)."""

    split: int
    tail: int
    maps: dict | None = None  # {layer: (W [d_out, d], b [d_out])} for the late layers: the "ridgefill" arms
    map_kinds: dict | None = None  # {layer: "input" | "kv"}: what each map predicts (None, or a layer not in it: input)
    exact_rows: Any = None  # prefix positions that run every layer
    row_share: float = ROW_SHARE
    probe: Any = None
    anchor: int = ANCHOR_ROWS
    logits_rows: int | None = None
    exact_norm: float | None = None
    corrections: Any = ()
    state_offsets: dict | None = None
    correction_rows: int = fixes.CORRECTION_ROWS
    protected: Any = None  # token ids: prefix rows holding one run every layer (fill arms)
    states: tuple | None = None  # (split, l1, ...): the maps read these layers' inputs side by side; None: h_S alone


@dataclass(frozen=True)
class _Plan:
    """A prefill's checked options: its exact rows so far (asked for, the anchor and the protected tokens'),
    corrections, logits rows, map kinds."""

    rows: list[int]
    fix: fixes.Fix
    keep: int
    map_kinds: dict
    earlier: tuple = ()  # the earlier layers whose inputs the maps read under h_S (the states after the split)

    def fill(self, arm: str, o: FillOptions, maps, select=None, *, tail: int | None = None, keep: int | None = None,
             rows: list[int] | None = None) -> Fill:
        """The `Fill` these options make for `arm` (with the maps in place)."""
        return Fill(arm=arm, split=o.split, tail=o.tail if tail is None else tail,
                    rows=self.rows if rows is None else rows, keep=self.keep if keep is None else keep, maps=maps,
                    map_kinds=self.map_kinds, fix=self.fix, exact_norm=o.exact_norm, select=select,
                    earlier=self.earlier)


def _protected_rows(ids: torch.Tensor, protected, prefix: int) -> list[int]:
    """The prefix positions (< prefix) of ids [N] whose token is one of the `protected` token ids."""
    if isinstance(protected, (set, frozenset)):
        protected = sorted(protected)
    table = torch.as_tensor(protected).reshape(-1)
    if table.numel() == 0:
        return []
    if table.is_floating_point() or table.is_complex() or table.dtype == torch.bool:
        raise BadInput(f"protected must be token ids (integers), got {table.dtype}")
    hit = torch.isin(ids[:prefix].cpu(), table.cpu().long())
    return torch.nonzero(hit).flatten().tolist()


def _plan(lm, ids: torch.Tensor, arm: str, o: FillOptions) -> _Plan:
    """Check `o` for a prefill of ids [N] with `arm` (BadInput names the first problem)."""
    n = int(ids.shape[0])
    L = lm.adapter.num_layers
    if not (isinstance(o.anchor, int) and o.anchor >= 0):
        raise BadInput(f"anchor must be a non-negative number of rows, got {o.anchor!r}")
    if not (o.exact_norm is None or is_norm(o.exact_norm)):
        raise BadInput(f"exact_norm must be None (off) or a positive norm, got {o.exact_norm!r}")
    if arm not in ARMS:
        raise BadInput(f"unknown arm '{arm}' (choose one of: {', '.join(ARMS)})")
    if n < 1:
        raise BadInput("prefill needs at least one input row")
    if not tail_fits(o.tail, n):
        raise BadInput(f"tail must be in 1..{n} (the number of input rows), got {o.tail!r}")
    if not 0 <= o.split <= L:
        raise BadInput(f"split must be in 0..{L} (the number of layers), got {o.split}")
    if arm.startswith("ridgefill"):
        if o.maps is None:
            raise BadInput(f"arm '{arm}' needs maps {{layer: (W, b)}}")
        missing = [l for l in range(o.split, L) if l not in o.maps]
        if missing:
            raise BadInput(f"maps lack late layers {missing} (split {o.split}, {L} layers)")
    earlier = _earlier(o, L)
    map_kinds = _map_kinds(lm.adapter, o, arm, 1 + len(earlier))  # what each map predicts, checked against its shape
    rows = sorted({int(r) for r in (o.exact_rows if o.exact_rows is not None else [])})
    prefix = prefix_end(n, o.tail)
    if rows and not (0 <= rows[0] and rows[-1] < prefix):
        raise BadInput(f"exact_rows must be prefix positions in 0..{prefix - 1}")
    if getattr(lm.adapter.config, "use_bidirectional_attention", False):
        raise BadInput("the fill runtime needs causal attention (this model uses bidirectional attention)")
    kinds = set(lm.adapter.layer_kinds)
    if not kinds <= {FULL, SLIDING, LINEAR}:
        raise BadInput(f"the fill runtime supports attention and Gated DeltaNet layers only (this model has "
                       f"{sorted(kinds)})")
    fix = fixes.plan(lm.adapter, arm, o.split, o.corrections, o.state_offsets, o.correction_rows)
    keep = o.tail if o.logits_rows is None else o.logits_rows
    if o.logits_rows is not None and not (isinstance(keep, int) and 1 <= keep <= o.tail):
        raise BadInput(f"logits_rows must be in 1..{o.tail} (the tail), got {o.logits_rows!r}")
    if arm != "exact":
        rows = sorted(set(rows) | set(anchor_rows(n, tail=o.tail, anchor=o.anchor)))
        if o.protected is not None:
            rows = sorted(set(rows) | set(_protected_rows(ids, o.protected, prefix)))
    return _Plan(rows, fix, keep, map_kinds, earlier)


def _earlier(o: FillOptions, L: int) -> tuple:
    """The earlier layers of `o.states` (after the split, which must come first); BadInput for states that are not
    the split then distinct layers below it."""
    if o.states is None:
        return ()
    states = [int(l) for l in o.states]
    if not states or states[0] != o.split or len(set(states)) != len(states) or \
            any(not 0 <= l < o.split for l in states[1:]):
        raise BadInput(f"states must be the split {o.split} then distinct layers below it, got {list(o.states)}")
    return tuple(states[1:])


def _map_kinds(ad, o: FillOptions, arm: str, states: int = 1) -> dict:
    """{layer: kind} of the late layers' maps, checked against the maps' shapes; BadInput names the first problem: an
    unknown kind, a key/value map on a Gated DeltaNet layer, or a map whose width is not its kind's (d_out d for an
    input map, 2 * kv_heads * head_dim for a key/value map; d_in d times the count of `states` read)."""
    kinds = {int(l): k for l, k in (o.map_kinds or {}).items()}
    if not arm.startswith("ridgefill"):
        return kinds
    d = ad.hidden_size
    for l in range(o.split, ad.num_layers):
        kind = kinds.get(l, INPUT_MAP)
        if kind not in (INPUT_MAP, KV_MAP):
            raise BadInput(f"map_kinds: layer {l} is {kind!r}, expected '{INPUT_MAP}' or '{KV_MAP}'")
        if kind == KV_MAP and ad.is_linear(l):
            raise BadInput(f"map_kinds: layer {l} is a Gated DeltaNet layer, which needs an input map (it has no keys)")
        W, b = o.maps[l]
        rows = d if kind == INPUT_MAP else ad.kv_width
        if tuple(W.shape) != (rows, d * states) or tuple(b.shape) != (rows,):
            raise BadInput(f"layer {l}'s {kind} map is {tuple(W.shape)}, expected ({rows}, {d * states}) for this "
                           "model" + (f" and {states} states" if states > 1 else ""))
    return kinds


def _select(arm: str, o: FillOptions, n: int) -> tuple[int, list[int]] | None:
    """"ridgefill+rows"'s selection for a prompt of n rows: (rows to pick, probe rows); None for another arm."""
    if arm != "ridgefill+rows":
        return None
    if not 0 < o.row_share < 1:
        raise BadInput(f"row_share must be in (0, 1), got {o.row_share}")
    probe = list(range(max(0, n - PROBE_ROWS), n)) if o.probe is None else sorted({int(p) for p in o.probe})
    if not probe or probe[0] < 0 or probe[-1] >= n:
        raise BadInput(f"probe rows must be prompt positions in 0..{n - 1}")
    return round(o.row_share * n), probe


def prefill(lm, input_ids: torch.Tensor, arm: str, **options) -> PrefillResult:
    """Prefill `input_ids` [N] (one sequence) with `arm`; `options` are `FillOptions` (split and tail required).
    See the module docstring."""
    o = FillOptions(**options)
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = int(ids.shape[0])
    plan = _plan(lm, ids, arm, o)
    select = _select(arm, o, n)
    ids = ids.to(lm.adapter.device)
    maps = o.maps
    if arm.startswith("ridgefill"):
        maps = maps_on_devices(lm, maps, range(o.split, lm.adapter.num_layers))  # before the clock starts
    rows = plan.rows
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        if arm == "exact":
            out = lm.model(input_ids=ids[None], use_cache=True, logits_to_keep=plan.keep)
            logits = out.logits[0, -plan.keep:].float()
            cache = getattr(out, "cache", None)  # 5.x name; `past_key_values` is a deprecated alias
        else:
            logits, cache, rows = fill(lm, ids, plan.fill(arm, o, maps, select))
    _sync()  # a GPU runs asynchronously: the clock stops when its work is done
    seconds = time.perf_counter() - start
    return PrefillResult(logits=logits, cache=cache, seconds=seconds, arm=arm, split=o.split, tail=o.tail,
                         num_rows=n, exact_rows=rows)  # fmt: skip


def prefix_prefill(lm, input_ids: torch.Tensor, arm: str, **options) -> PrefillResult:
    """The cache `prefill(lm, input_ids, arm, **options)` writes for the first P = N - tail rows, computed from those
    rows alone: the tail is left to whoever continues from it (a serving engine, docs/engines.md). The filled rows
    and the exact rows (anchor, rows above the exact-row norm) are those of a prefill of all N rows. Arms "exact",
    "ridgefill", "identity"; corrections, measured on the tail, are refused. `logits` is empty; `seconds` the
    computation."""
    o = FillOptions(**options)
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = int(ids.shape[0])
    if arm not in ("exact", "ridgefill", "identity"):
        raise BadInput(f"a prefix is 'exact', 'ridgefill' or 'identity', not '{arm}'")
    if o.corrections:
        raise BadInput("corrections are measured on the tail rows, which a prefix does not run")
    plan = _plan(lm, ids, arm, o)
    p = prefix_end(n, o.tail)
    ad = lm.adapter
    prefix = ids[:p].to(ad.device)
    maps = maps_on_devices(lm, o.maps, range(o.split, ad.num_layers)) if arm == "ridgefill" else None
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        if arm == "exact":
            cache = lm.model(input_ids=prefix[None], use_cache=True, logits_to_keep=1).cache
            rows = []
        else:  # tail 0: the late layers' query rows are the exact rows alone
            _, cache, rows = fill(lm, prefix, plan.fill(arm, o, maps, tail=0, keep=1))
    _sync()
    return PrefillResult(logits=torch.zeros(0), cache=cache, seconds=time.perf_counter() - start, arm=arm,
                         split=o.split, tail=o.tail, num_rows=n, exact_rows=rows)


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
        return PrefillResult(logits=self.logits, cache=cache_copy(self.cache, len(self.cache.layers)),
                             seconds=self.seconds, arm="exact", tail=tail, num_rows=n)


def exact_run(lm, input_ids: torch.Tensor, *, splits=(), logits_rows: int = 1) -> ExactRun:
    """The stock model's forward over `input_ids` [N], keeping its cache, the last `logits_rows` rows' logits
    and the hidden state entering each layer of `splits` (memory: len(splits) x N x d)."""
    from ridgefill.models.hooks import layer_inputs

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


def prefill_from(lm, run: ExactRun, arm: str, **options) -> PrefillResult:
    """The fill arm `arm` ("ridgefill", "identity", "nofill" or "ridgefill+rows") at `split`, built from an exact run
    of the same prompt: the same result as `prefill(lm, run.ids, arm, **options)` up to float round-off, for the cost
    of the late layers alone ("+rows" also runs its probe rows through the early layers, to select its rows; only
    where every layer below the split kept every row's keys, `selects_from`). `seconds` is the time of that
    remaining work, not a prefill's: time arms with `prefill`."""
    o = FillOptions(**options)
    rows, plan = _rows_from_run(lm, run, arm, o)
    split, tail, n = o.split, o.tail, int(run.ids.shape[0])
    ad = lm.adapter
    maps = o.maps
    if arm.startswith("ridgefill"):
        maps = maps_on_devices(lm, maps, range(split, ad.num_layers))
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        layers = Layers(lm)
        h = run.states[split]
        rope = layers.rope(h[None], torch.arange(n, device=ad.device))
        # The early layers' cache, copied; the late Gated DeltaNet layers write their states into it as they run.
        cache = cache_copy(run.cache, split, lm.model.config)
        x = _read_from_run(run, split, plan.earlier)
        logits, late = late_layers(lm, layers, h, rope, plan.fill(arm, o, maps, rows=rows), cache, x)
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
            cache = SlotCache(lm, early + late_slots(ad, late, all_pos), n, states=cache)
        else:
            for l, entry in enumerate(late, start=split):
                if entry is not None:
                    cache.update(entry[0], entry[1], l)
    _sync()
    return PrefillResult(logits=logits, cache=cache, seconds=time.perf_counter() - start, arm=arm, split=split,
                         tail=tail, num_rows=n, exact_rows=rows)


def fill_rows(lm, run: ExactRun, arm: str, **options) -> list[int]:
    """The exact rows (prefix positions) of `prefill_from(lm, run, arm, **options)`, without the late layers: what a
    configuration's equal-cost control needs to know of it."""
    return _rows_from_run(lm, run, arm, FillOptions(**options))[0]


def selects_from(lm, run: ExactRun, split: int) -> bool:
    """Whether `prefill_from` can make "ridgefill+rows"'s selection at `split` from the exact run: every layer below
    the split is attention that kept the keys of every row (not a sliding window's last rows, not Gated
    DeltaNet)."""
    n = int(run.ids.shape[0])
    return all(not lm.adapter.is_linear(l) and run.cache.layers[l].keys.shape[-2] == n for l in range(split))


def _rows_from_run(lm, run: ExactRun, arm: str, o: FillOptions) -> tuple[list[int], _Plan]:
    """prefill_from's checks and its exact rows: the plan's, "+rows"'s selection, the rows above the exact-row norm
    at the split."""
    n = int(run.ids.shape[0])
    if arm not in ("ridgefill", "identity", "nofill", "ridgefill+rows"):
        raise BadInput(f"prefill_from builds 'ridgefill', 'identity', 'nofill' or 'ridgefill+rows', not '{arm}' "
                       "(use prefill)")
    plan = _plan(lm, run.ids, arm, o)
    if o.split not in run.states:
        raise BadInput(f"the exact run kept no state for split {o.split} (it has {sorted(run.states)})")
    missing = [l for l in plan.earlier if l not in run.states]
    if missing:
        raise BadInput(f"the exact run kept no state for earlier layer(s) {missing} the maps read (it has "
                       f"{sorted(run.states)})")
    rows, select, prefix = plan.rows, _select(arm, o, n), prefix_end(n, o.tail)
    if select:
        if not selects_from(lm, run, o.split):
            raise BadInput("prefill_from selects 'ridgefill+rows' rows from the keys of every row below the split; "
                           "this model has a sliding-window or Gated DeltaNet layer there (use prefill)")
        with torch.no_grad():
            received = _received_from_run(lm, run, o.split, select[1])
        rows = sorted(set(rows) | set(most_attended(received, prefix, select[0])))
    return with_norm_rows(rows, _read_from_run(run, o.split, plan.earlier), prefix, o.exact_norm), plan


def _read_from_run(run: ExactRun, split: int, earlier: tuple) -> torch.Tensor:
    """What the maps read for every row, from the exact run: h_S [N, d], or [h_S; h_l1; ...] [N, d x states]."""
    return stacked(run.states[split], [run.states[l] for l in earlier])


def _received_from_run(lm, run: ExactRun, split: int, probe: list[int]) -> torch.Tensor:
    """The attention each row receives from the `probe` rows in the layers below `split`, as `fill` sums it inside a
    prefill, from the exact run: the probe rows alone run those layers (their inputs are what `fill` needs),
    attending causally to the exact run's keys and values, which already hold every row. [N] float32."""
    ad = lm.adapter
    layers = Layers(lm)
    n = int(run.ids.shape[0])
    pos = torch.tensor(probe, dtype=torch.long, device=ad.device)
    h = ad.base.embed_tokens(run.ids[pos][None])  # [1, P, d]; Gemma's embedding scales
    rope = layers.rope(h, pos)
    received = torch.zeros(n, device=ad.device)
    valid = torch.ones(n, dtype=torch.bool, device=ad.device)
    for l in range(split):
        kv = run.cache.layers[l]
        layer_in = h
        # the probe rows write their own keys/values again (equal up to round-off): into copies, as the run is shared
        h = layers.run(l, h, pos, rope, kv.keys.clone(), kv.values.clone(), kv_valid=valid)
        received += attention_received(ad, l, layer_in[0], pos, kv.keys, layers.window).to(ad.device)
    return received


def _sync() -> None:
    """Wait for queued GPU work (a no-op without CUDA), so that wall time measures the computation."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
