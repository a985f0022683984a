"""The capture's forward: one document at a time, chunk by chunk through the model's KV cache.

A document longer than `chunk` tokens is fed in pieces with continuing positions, so every row sees its whole
left context, exactly as in a one-shot forward, while activation memory stays bounded by one chunk (plus the
document's KV cache). Forward pre-hooks record the input of every wanted layer; the forward is stopped before
the last decoder layer runs, so neither it nor the LM head costs anything (capture/hooks.py).

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

from ridgefill.capture.stats import Moments

PRODUCT_DTYPES = ("float32", "float64")


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


def document_chunks(lm, ids: np.ndarray, layers: list[int], chunk: int, device) -> Iterator[tuple[int, dict]]:
    """Feed one document through the model chunk by chunk; yield (start, {l: h_l [rows, d]}) per chunk.

    The tensors stay where the model put them (any device, the model's dtype). Positions continue across
    chunks through a DynamicCache built from the model's config (sliding-window layers keep only their window).
    """
    import torch
    from transformers import DynamicCache

    from ridgefill.capture.hooks import StopForward, layer_inputs

    x = torch.from_numpy(np.asarray(ids, dtype=np.int64))  # [N]
    cache = DynamicCache(config=lm.model.config)
    with torch.inference_mode():
        for start in range(0, len(x), chunk):
            piece = x[start : start + chunk][None].to(device)  # [1, rows]
            with layer_inputs(lm.adapter.layers, layers) as seen:
                try:
                    lm.adapter.base(input_ids=piece, cache=cache, use_cache=True)
                except StopForward:
                    pass
            yield start, {l: seen[l][0] for l in layers}  # [rows, d] each


def chunk_moments(x, ys: list, product_dtype: str = "float32") -> Moments:
    """Moments of one chunk (capture/stats.py's fields), computed on x's device.

    x: [n, dx]; ys: k tensors [n, dy] (any float dtype, any devices). Means are float64; the centred products run
    in `product_dtype`; the result is float64 numpy on the host. Equals `stats.moments_of` up to rounding.
    """
    import torch

    wd = getattr(torch, product_dtype)
    dev = x.device
    n, dx = x.shape
    k, dy = len(ys), ys[0].shape[-1]
    mean_x = x.mean(0, dtype=torch.float64)  # [dx]
    xc = x.to(wd) - mean_x.to(wd)  # [n, dx]
    yc = torch.cat([y.to(device=dev, dtype=wd) for y in ys], dim=1)  # [n, k*dy]
    mean_y = yc.mean(0, dtype=torch.float64)  # [k*dy]
    yc -= mean_y.to(wd)
    cxx = xc.T @ xc  # [dx, dx]
    cxy = xc.T @ yc  # [dx, k*dy]
    yy = torch.einsum("nkd,nkd->k", yc.view(n, k, dy), yc.view(n, k, dy))  # [k]
    host = lambda t: t.to("cpu", torch.float64).numpy()  # noqa: E731
    return Moments(
        n,
        host(mean_x),
        host(cxx),
        host(mean_y).reshape(k, dy),
        np.ascontiguousarray(host(cxy).reshape(dx, k, dy).transpose(1, 0, 2)),  # [dx, k, dy] -> [k, dx, dy]
        host(yy),
    )
