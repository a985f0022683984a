"""The fill itself: the early layers on every row, then the late layers with the filled rows written from the
split state (api.py says what each arm does, and how the layers are called).

`fill` runs a whole fill arm from the token ids; `late_layers` runs the late layers from a split state, which is
all `prefill_from` needs on top of an exact run. Both take one `Fill`: the arm and everything it fills with.

What a filled row writes in late attention layer l depends on its map's kind (docs/method.md#keyvalue-maps): an
input map predicts the layer's input, x_hat = W_l h_S + b_l, which goes through the layer's input norm, k_proj (and
k_norm) and v_proj; a key/value map predicts the keys before RoPE and QK-norm and the values directly, [k; v]_hat =
M_l h_S + c_l, and only the key norm (QK-norm models) is left. RoPE then rotates the keys at their positions either
way. A Gated DeltaNet layer's map always predicts its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ridgefill.formats.release.names import INPUT_MAP, KV_MAP  # what a late layer's map predicts
from ridgefill.runtime import corrections as fixes
from ridgefill.runtime.cache import SlotCache
from ridgefill.runtime.layers import SLIDING, Layers, final_logits
from ridgefill.runtime.rows import attention_received, most_attended, prefix_end, with_norm_rows


@dataclass(frozen=True)
class Fill:
    """One fill arm's settings, checked (api._plan): what `fill` and `late_layers` run."""

    arm: str  # "ridgefill", "identity", "nofill" or "ridgefill+rows" (api.ARMS)
    split: int  # S: layers 0..S-1 run every row
    tail: int  # T: the last T rows run every layer
    rows: list[int]  # prefix rows that run every layer too (anchor, asked for, protected; more are added on the way)
    keep: int  # the last rows whose logits are returned
    maps: dict | None = None  # {layer: (W float32 [d_out, d], b float32 [d_out])} on each late layer's device
    map_kinds: dict = field(default_factory=dict)  # {layer: INPUT_MAP | KV_MAP}; a layer not in it: INPUT_MAP
    fix: fixes.Fix = field(default_factory=fixes.Fix)  # the corrections
    exact_norm: float | None = None  # prefix rows whose split state's norm exceeds it run exactly (None: none)
    select: tuple | None = None  # "+rows"'s (count, probe rows)
    earlier: tuple = ()  # earlier layers whose inputs the maps read under h_S, side by side (maps from earlier states)

    def map_kind(self, l: int) -> str:
        return self.map_kinds.get(l, INPUT_MAP)


def fill(lm, ids, f: Fill):
    """A fill arm's prefill of ids [N] on the input device: (last `f.keep` rows' logits, cache, exact rows)."""
    from transformers import DynamicCache

    split, tail, select, rows = f.split, f.tail, f.select, f.rows
    model, ad = lm.model, lm.adapter
    layers = Layers(lm)
    cache = DynamicCache(config=model.config)  # Gated DeltaNet layers update their states here as they run
    # Positions, masks and row indices live on the input device and move to each layer's device (with a device
    # map every layer may sit on another one); each layer's key/value slots are made on its own device.
    device = ad.device
    n = int(ids.shape[0])
    prefix = prefix_end(n, tail)
    all_pos = torch.arange(n, device=device)
    hidden = base_hidden = ad.base.embed_tokens(ids[None].to(device))  # [1, N, d]; Gemma's embedding scales
    rope = layers.rope(base_hidden, all_pos)  # [1, N, hd] per layer kind
    received = torch.zeros(n, device=device) if select else None

    early: list[tuple[torch.Tensor, torch.Tensor]] = []
    kept = {}  # the inputs of the earlier layers the maps read
    # Early layers: every row, exactly.
    every = torch.ones(n, dtype=torch.bool, device=device)
    for l in range(split):
        if l in f.earlier:
            kept[l] = hidden[0]
        if ad.is_linear(l):
            hidden = layers.run_linear(l, hidden, cache)
            early.append(None)
            continue
        keys, values = new_slots(ad, l, n), new_slots(ad, l, n)
        layer_in = hidden
        hidden = layers.run(l, hidden, all_pos, rope, keys, values, every, every_row=True)
        early.append((keys, values))
        if select:
            probe = torch.tensor(select[1], device=layer_in.device)
            received += attention_received(ad, l, layer_in[0, probe], probe, keys, layers.window).to(device)
    if select:  # "+rows": the most-attended prefix rows become exact rows
        rows = sorted(set(rows) | set(most_attended(received, prefix, select[0])))
    x = stacked(hidden[0], [kept[l] for l in f.earlier])  # what the maps read, whose norm the exact-row rule bounds
    rows = with_norm_rows(rows, x, prefix, f.exact_norm)
    logits, late = late_layers(lm, layers, hidden[0], rope, replace(f, rows=rows), cache, x)
    if f.arm == "nofill":
        slots = [None if e is None else {"keys": e[0][0], "values": e[1][0],
                                         "positions": all_pos.expand(ad.num_kv_heads, n)} for e in early]
        return logits, SlotCache(lm, slots + late_slots(ad, late, all_pos), n, states=cache), rows
    for l, entry in enumerate(early + late):
        if entry is not None:  # sliding layers keep their last window - 1 rows, as in a stock prefill
            cache.update(entry[0], entry[1], l)
    return logits, cache, rows


def stacked(h_split, earlier: list) -> torch.Tensor:
    """What the maps read for every row: h_S [N, d] itself, or [h_S; h_l1; ...] side by side [N, d x (1 + len)] (each
    earlier state moved to h_S's device)."""
    if not earlier:
        return h_split
    return torch.cat([h_split, *(h.to(h_split.device) for h in earlier)], dim=-1)


def new_slots(ad, l: int, n: int) -> torch.Tensor:
    """Zeroed key (or value) slots of layer l for n rows, on the layer's device: [1, kv_heads, n, head_dim]."""
    return torch.zeros((1, ad.num_kv_heads, n, ad.head_dim), dtype=ad.dtype, device=ad.layer_device(l))


def late_slots(ad, late, all_pos) -> list[dict]:
    """SlotCache layers of the late layers (the "nofill" arm's holes are empty slots, position -1; a Gated
    DeltaNet layer, None, keeps its states in the SlotCache's `states`)."""
    n = all_pos.shape[0]
    return [None if e is None else
            {"keys": e[0][0], "values": e[1][0], "positions": torch.where(e[2], all_pos, -1).expand(ad.num_kv_heads, n)}
            for e in late]  # fmt: skip


def late_layers(lm, layers, h_split, rope, f: Fill, states, x=None):
    """Late layers from the split state h_split [N, d]: the query rows (f.rows + tail) run every layer; the filled
    rows only write keys/values (attention) or their state updates (Gated DeltaNet, into `states`, a transformers
    cache). `x` [N, d x states]: what the maps read, when they read earlier states too (`stacked`); the identity arm
    always writes from h_S. Returns the last `f.keep` rows' logits and, per late layer, (keys, values, valid slots),
    or None for a Gated DeltaNet layer."""
    arm, split, tail, maps, rows, fix = f.arm, f.split, f.tail, f.maps, f.rows, f.fix
    kv_fix = [c for c in fix.which if c in fixes.KV_CORRECTIONS]
    ad = lm.adapter
    device, dtype = ad.device, ad.dtype
    n, L = int(h_split.shape[0]), ad.num_layers
    prefix = prefix_end(n, tail)
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
    x_split = (h_split if x is None or not arm.startswith("ridgefill") else x).float()
    late = []
    for l in range(split, L):
        dev = ad.layer_device(l)
        if ad.is_linear(l):
            x = _predicted(arm, maps, l, x_split, fill_pos, dev)
            offset = fix.offsets[l] if "state" in fix.which else None
            hq = _late_linear(layers, l, hq, x, fill_pos, rows, prefix, states, offset)
            late.append(None)
            continue
        keys, values = new_slots(ad, l, n), new_slots(ad, l, n)
        kv_valid = torch.zeros(n, dtype=torch.bool, device=device)
        kv_valid[q_pos] = True
        kind = ad.layer_kinds[l]
        pos = fill_pos
        if kind == SLIDING and layers.window:
            pos = fill_pos_sliding  # the other rows are outside every query's window
        if pos.numel():
            k, v = _filled_kv(ad, f, l, x_split, pos, dev)  # [F, kv_heads, head_dim], before RoPE, on the layer's dev
            if kv_fix:  # measured on the first tail rows: from their true input (hq) and from the map's prediction
                m = min(fix.rows, tail)
                r = len(rows)
                k_true, v_true = ad.kv(l, hq[0, r : r + m])
                k_pred, v_pred = _filled_kv(ad, f, l, x_split, all_pos[prefix : prefix + m], dev)
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
    return final_logits(lm, hq[0, -f.keep:]), late


def _filled_kv(ad, f: Fill, l, x_split, pos, dev):
    """What attention layer l writes for the filled rows at `pos`, before RoPE: (k, v) [F, kv_heads, head_dim] in the
    model's dtype on `dev`. An input map's prediction (or, "identity", h_S) goes through the layer's own norm and
    projections; a key/value map's is the keys (then the key norm) and values themselves."""
    predicted = _predicted(f.arm, f.maps, l, x_split, pos, dev)  # [F, d] or, a key/value map's, [F, 2kv] float32
    if not (f.arm.startswith("ridgefill") and f.map_kind(l) == KV_MAP):
        return ad.kv(l, predicted)
    return ad.from_kv_target(l, predicted)  # keys before the key norm and RoPE, then values


def _predicted(arm, maps, l, x_split, pos, dev):
    """The map's prediction for the filled rows at `pos` of x_split [N, d] float32, W_l h_S + b_l ("ridgefill": the
    layer's input [F, d], or a key/value map's keys and values [F, 2kv]), or h_S ("identity"): float32 on `dev`."""
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
