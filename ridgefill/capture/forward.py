"""The capture's forward: one document at a time, chunk by chunk through the model's KV cache.

A document longer than `chunk` tokens is fed in pieces with continuing positions, so every row sees its whole
left context, exactly as in a one-shot forward, while activation memory stays bounded by one chunk (plus the
document's KV cache). Forward pre-hooks record the input of every wanted layer; the forward is stopped before
the last decoder layer runs, so neither it nor the LM head costs anything (ridgefill.models.hooks).

Each chunk's statistics are computed where the hidden states are (the GPU, on a GPU machine) and only the
small results travel to the host: means in float64, centred products `xc^T xc`, `xc^T yc` in `product_dtype`
(float32 by default, with TF32 off; float64 on request), then merged into float64 totals on the host with
Chan's update (capture/stats.py). Centring each chunk before its product keeps float32 accurate: the solved
maps' held-out scores agree with an all-float64 capture to ~1e-6 (tests/test_capture.py checks 1e-4).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ridgefill.capture.stats import INPUT, KV, Moments
from ridgefill.capture.units import SKIP_FIRST
from ridgefill.runtime.rows import outlier_rows


@contextmanager
def exact_float32() -> Iterator[None]:
    """float32 matmuls at full precision (no TF32 on Ampere+ GPUs) for the duration; restored after."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def new_cache(lm):
    """The cache a document starts with: a DynamicCache built from the model's config (sliding-window layers keep
    only their window, linear-attention layers their conv and recurrent states)."""
    from transformers import DynamicCache

    return DynamicCache(config=lm.model.config)


def document_chunks(lm, ids: np.ndarray, layers: list[int], chunk: int, device, *, first: int = 0,
                    cache=None) -> Iterator[tuple[int, dict]]:
    """Feed one document through the model chunk by chunk; yield (start, {l: h_l [rows, d]}) per chunk.

    The tensors stay where the model put them (any device, the model's dtype). Positions continue across
    chunks through `cache` (default: `new_cache(lm)`). A document resumed from a checkpoint starts at `first`, a
    chunk boundary, with the cache restored as it was there (capture/kvstate.py); the caller that made the cache
    may read it between two chunks.
    """
    import torch

    from ridgefill.models.hooks import StopForward, layer_inputs

    x = torch.from_numpy(np.asarray(ids, dtype=np.int64))  # [N]
    if cache is None:
        cache = new_cache(lm)
    with torch.inference_mode():
        for start in range(first, len(x), chunk):
            piece = x[start : start + chunk][None].to(device)  # [1, rows]
            with layer_inputs(lm.adapter.layers, layers) as seen:
                try:
                    lm.adapter.base(input_ids=piece, cache=cache, use_cache=True)
                except StopForward:
                    pass
            yield start, {l: seen[l][0] for l in layers}  # [rows, d] each


_WORKSPACE: dict = {}


def _buffer(name: str, rows: int, cols: int, dtype, device):
    """A [rows, cols] scratch tensor reused from chunk to chunk: allocating (and page-faulting) ~35 MB anew for
    every chunk cost a CPU as much as the products themselves. `release_workspace()` frees them."""
    import torch

    key = (name, cols, dtype, str(device))
    buf = _WORKSPACE.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = _WORKSPACE[key] = torch.empty((rows, cols), dtype=dtype, device=device)
    return buf[:rows]


def release_workspace() -> None:
    _WORKSPACE.clear()


def _center_(y):
    """Subtract the column means of y [n, c] in place; return them in float64.

    Two passes in y's own dtype: the mean, then the mean of what is left (tiny), so the float64 sum of the two is
    as exact as a float64 reduction, which on a CPU is many times slower than these (sum(dtype=float64) over a
    [1024, 8640] chunk: ~30 ms against ~2 ms)."""
    import torch

    n = y.shape[0]
    first = y.sum(0) / n  # [c]
    y -= first
    rest = y.sum(0) / n  # [c], ~eps * spread
    y -= rest
    return first.to(torch.float64) + rest.to(torch.float64)


def chunk_moments(x, ys: list, product_dtype: str = "float32") -> Moments:
    """Moments of one chunk (capture/stats.py's fields), computed on x's device.

    x: [n, dx]; ys: k tensors [n, dy] (any float dtype, any devices). Means are float64; the centred products run
    in `product_dtype`; the result is float64 numpy on the host. Equals `stats.moments_of` up to rounding.
    """
    return grouped_moments(x, [ys], product_dtype)[0]


def grouped_moments(x, groups: list[list], product_dtype: str = "float32") -> list[Moments]:
    """`chunk_moments` of x against each group of targets of the same rows (the late layers' inputs; the late
    attention layers' keys and values, of their own width): x's side (its mean, centring and Cxx) is computed once,
    and the groups' Moments share those arrays (a chunk's moments are only read when merged)."""
    import torch

    wd = getattr(torch, product_dtype)
    n, dx = x.shape
    mean_x = x.sum(0, dtype=torch.float64) / n  # [dx]  (sum(dtype=) is fast where mean(dtype=) is not, on CPU)
    xc = x.to(wd) - mean_x.to(wd)  # [n, dx]
    mx, cxx = _host(mean_x), _host(xc.T @ xc)  # [dx], [dx, dx]
    return [_target_moments(xc, ys, f"y{i}", mx, cxx) for i, ys in enumerate(groups)]


def _host(t):
    """float64 numpy on the host, copied: a float64 product on the CPU would otherwise be a view of the workspace,
    which the next call reuses."""
    import torch

    return t.to("cpu", torch.float64, copy=True).numpy()


def _target_moments(xc, ys: list, name: str, mean_x, cxx) -> Moments:
    """The target side of `chunk_moments` for one group ys (k tensors [n, dy]) against the centred xc [n, dx]."""
    import torch

    wd, dev = xc.dtype, xc.device
    n, dx = xc.shape
    k, dy = len(ys), ys[0].shape[-1]
    yc = _buffer(name, n, k * dy, wd, dev)  # [n, k*dy]: every layer's target side by side
    torch.cat([y.to(device=dev, dtype=wd) for y in ys], dim=1, out=yc)
    mean_y = _center_(yc)  # [k*dy]
    cxy = torch.matmul(xc.T, yc, out=_buffer(f"{name}.cxy", dx, k * dy, wd, dev))  # [dx, n] @ [n, k*dy]
    # [k]: squares summed in float64, one layer at a time (a float32 norm over n*dy terms is off by ~5e-3)
    yy = torch.stack([yc[:, i * dy:(i + 1) * dy].square().sum(dtype=torch.float64) for i in range(k)])
    return Moments(
        n,
        mean_x,
        cxx,
        _host(mean_y).reshape(k, dy),
        _host(cxy).reshape(dx, k, dy).transpose(1, 0, 2),  # a [k, dx, dy] view: merging reads it in place
        _host(yy),
    )


def fitted_moments(hs: dict, start: int, splits, num_layers: int, outlier_ratio: float,
                   product_dtype: str = "float32", kv_layers=(), kv_of=None,
                   earlier=()) -> dict[tuple[int, str], Moments]:
    """One chunk's statistics per split and target over the rows the maps are fitted on:
    {(split, "input"): Moments of the late layers' inputs, (split, "kv"): Moments of their keys and values}.

    hs: {layer: h_l [rows, d]} for every layer from the lowest split (`document_chunks`), the chunk starting at
    document position `start`. Left out: a document's first row (an attention sink, `SKIP_FIRST`) and every row
    whose split state is an outlier by norm (`runtime.rows.outlier_rows` with `outlier_ratio`: a later sink, which
    the fill runs exactly). {} when the chunk has no row left.

    `kv_of(l, h)` -> [rows, 2 * kv_heads * head_dim]: layer l's keys (before RoPE and QK-norm) and values for its
    true input h (`key_value_targets`); computed once per chunk for each of `kv_layers` (the late attention layers)
    and fitted for every split below them, as a key/value map predicts them (docs/method.md#keyvalue-maps).

    `earlier` (offsets k): the maps' input is the split state with h_{S-k} for each k stacked under it, [n, d (1 +
    len(earlier))] (`stacked_state`); the outlier rule then looks at that stacked row's norm, as the fill does."""
    skip = SKIP_FIRST if start == 0 else 0
    targets = {l: kv_of(l, hs[l]) for l in kv_layers} if kv_of is not None else {}  # [rows, 2kv] each
    out = {}
    for s in splits:
        x = stacked_state(hs, s, earlier)[skip:]  # [n, dx]
        if x.shape[0] < 1:
            break
        ys = [hs[l][skip:] for l in range(s, num_layers)]  # k x [n, d]
        kvs = [targets[l][skip:] for l in sorted(targets) if l >= s]  # k_attn x [n, 2kv]
        sinks = outlier_rows(x, outlier_ratio)
        if sinks.any():
            x, ys, kvs = x[~sinks], [y[~sinks] for y in ys], [t[~sinks] for t in kvs]
        got = grouped_moments(x, [ys, kvs] if kvs else [ys], product_dtype)
        out[(s, INPUT)] = got[0]
        if kvs:
            out[(s, KV)] = got[1]
    return out


def stacked_state(hs: dict, split: int, earlier=()):
    """The maps' input for the rows of hs ({layer: h_l [rows, d]}): h_S, or [h_S; h_{S-k1}; ...] side by side."""
    import torch

    if not earlier:
        return hs[split]
    return torch.cat([hs[split], *(hs[split - k] for k in earlier)], dim=-1)


def key_value_targets(adapter):
    """`kv_of` for `fitted_moments`: layer l's keys and values for its true input h [rows, d], side by side as a
    key/value map predicts them (`Adapter.kv_target`)."""
    return adapter.kv_target
