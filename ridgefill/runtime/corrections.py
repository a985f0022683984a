"""Per-request corrections of a fill, and the terminal-state correction of its Gated DeltaNet layers (docs/runtime.md).

Each removes an average error of the filled cache; none is trained. Three are measured on every request, on the
first `rows` tail rows (default 512), which run the late layers exactly anyway: each late attention layer computes
their keys and values twice, from their true input and from the map's prediction for the same rows, and per KV head

- "vscale": the filled values are multiplied by mean over rows of |v_true| / |v_pred|;
- "kscale": the filled keys (before RoPE) are multiplied by mean over rows of |k_true| / |k_pred|;
- "kshift": mean over rows of (k_true - k_pred) is added to the filled keys (before RoPE; after "kscale" when both
  are asked, measured on the rescaled predictions).

The fourth, "state", is measured once, at fit time (`ridgefill solve --state-data`): per late Gated DeltaNet layer
and value head, `offset` = the mean difference between the exact and the filled recurrent state. At the end of the
prefix it is added once, scaled by the filled rows' share of the state (`filled_share`), read from the gates the
fill computes anyway.

torch is imported only where a function needs it: the names above are read by eval's arm grammar without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ridgefill.errors import BadInput

if TYPE_CHECKING:
    import torch

KV_CORRECTIONS = ("vscale", "kscale", "kshift")
CORRECTIONS = KV_CORRECTIONS + ("state",)
CORRECTION_ROWS = 512  # tail rows the per-request corrections are measured on


def check_corrections(ad, split: int, corrections, state_offsets=None) -> tuple[str, ...]:
    """The corrections asked for, in canonical order, or BadInput: an unknown name, a correction for layers the
    model does not have above the split, or terminal-state offsets that do not match its layers."""
    asked = set(corrections or ())
    unknown = sorted(asked - set(CORRECTIONS))
    if unknown:
        raise BadInput(f"unknown correction '{unknown[0]}' (choose from {', '.join(CORRECTIONS)})")
    late = range(split, ad.num_layers)
    linear = [l for l in late if ad.is_linear(l)]
    if asked & set(KV_CORRECTIONS) and len(linear) == len(late):
        name = sorted(asked & set(KV_CORRECTIONS))[0]
        raise BadInput(f"correction '{name}' needs attention layers above split {split}; this model has none")
    if "state" in asked:
        if not linear:
            raise BadInput(f"the terminal-state correction needs Gated DeltaNet layers above split {split}; "
                           "this model has none")
        check_state_offsets(ad, split, state_offsets)
    return tuple(c for c in CORRECTIONS if c in asked)


@dataclass(frozen=True)
class Fix:
    """The corrections of one fill: which, the terminal-state offsets on the layers' devices, rows to measure on."""

    which: tuple[str, ...] = ()
    offsets: dict | None = None
    rows: int = CORRECTION_ROWS


def plan(ad, arm: str, split: int, corrections, state_offsets, rows) -> Fix:
    """The checked corrections of a prefill with `arm` (BadInput for corrections of "exact" or "nofill", or a row
    count that is not a positive integer), with the terminal-state offsets moved to their layers' devices."""
    which = check_corrections(ad, split, corrections, state_offsets)
    if not which:
        return Fix()
    if arm in ("exact", "nofill"):
        raise BadInput(f"corrections apply to the fill arms, not '{arm}'")
    if not (isinstance(rows, int) and rows >= 1):
        raise BadInput(f"correction_rows must be a positive number of tail rows, got {rows!r}")
    offsets = None
    if "state" in which:
        import torch

        offsets = {int(l): torch.as_tensor(o, dtype=torch.float32).to(ad.layer_device(int(l)))
                   for l, o in state_offsets.items()}  # fmt: skip
    return Fix(which, offsets, rows)


def state_shape(ad, l: int) -> tuple[int, int, int]:
    """The recurrent state of Gated DeltaNet layer l, per request: [value heads, key head dim, value head dim]."""
    gdn = ad.layers[l].linear_attn
    return (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)


def check_state_offsets(ad, split: int, offsets) -> None:
    """Offsets must cover exactly the late Gated DeltaNet layers, each with that layer's state shape."""
    want = [l for l in range(split, ad.num_layers) if ad.is_linear(l)]
    have = sorted(int(l) for l in (offsets or {}))
    if have != want:
        raise BadInput(f"terminal-state offsets cover layers {have}, but the Gated DeltaNet layers above split "
                       f"{split} are {want}")
    for l in want:
        shape = tuple(offsets[l].shape)
        if shape != state_shape(ad, l):
            raise BadInput(f"terminal-state offset of layer {l} has shape {list(shape)}, but the layer's state is "
                           f"{list(state_shape(ad, l))}")


def kv_params(which, k_true, v_true, k_pred, v_pred) -> dict:
    """The per-KV-head corrections `which` from the first tail rows' keys / values [m, kv_heads, head_dim] computed
    from the true and the predicted input (before RoPE). Returns {"kscale" | "vscale": [kv_heads],
    "kshift": [kv_heads, head_dim]}, float32."""
    k_true, v_true, k_pred, v_pred = (t.float() for t in (k_true, v_true, k_pred, v_pred))
    ratio = lambda a, b: (a.norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).mean(0)  # noqa: E731
    out = {}
    if "vscale" in which:
        out["vscale"] = ratio(v_true, v_pred)
    if "kscale" in which:
        out["kscale"] = ratio(k_true, k_pred)
        k_pred = k_pred * out["kscale"][None, :, None]
    if "kshift" in which:
        out["kshift"] = (k_true - k_pred).mean(0)
    return out


def apply_kv(params: dict, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Filled keys and values [rows, kv_heads, head_dim] (before RoPE) with `kv_params` applied, in their dtype."""
    dtype = k.dtype
    k, v = k.float(), v.float()
    if "kscale" in params:
        k = k * params["kscale"].to(k.device)[None, :, None]
    if "kshift" in params:
        k = k + params["kshift"].to(k.device)[None]
    if "vscale" in params:
        v = v * params["vscale"].to(v.device)[None, :, None]
    return k.to(dtype), v.to(dtype)


def filled_share(log_gates: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """The filled rows' share of a Gated DeltaNet state at the end of a run of rows, per value head.

    log_gates [P, heads]: each row's log decay g (the state is multiplied by exp(g) <= 1 as the row arrives);
    filled [P] bool. Row t's update reaches the end weighted by the product of the later rows' gates,
    w_t = exp(sum_{s > t} g_s); the share is sum_{filled t} w_t / sum_t w_t ([heads], float64; 0 for no rows)."""
    g = log_gates.double()
    if g.shape[0] == 0:
        return g.new_zeros(g.shape[1:])
    later = g.flip(0).cumsum(0).flip(0) - g  # sum over s > t
    w = later.exp()  # [P, heads], the last row's weight is 1
    return (w * filled.to(w.device)[:, None]).sum(0) / w.sum(0)
