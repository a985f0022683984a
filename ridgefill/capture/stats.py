"""Streaming second moments for the ridge fit, merged exactly with Chan's parallel update (docs/capture.md).

For one split, x is the split state h_S and y_l the input of late layer l (or, for key/value maps, its keys and
values). A `Moments` holds, in float64:
n, mean_x [dx], cxx = sum (x - mean_x)(x - mean_x)^T [dx, dx], mean_y [k, dy],
cxy[l] = sum (x - mean_x)(y_l - mean_y_l)^T [k, dx, dy], yy[l] = sum ||y_l - mean_y_l||^2 [k].
Memory is independent of the number of rows. Pure numpy: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ridgefill.formats.release.names import INPUT_MAP, KV_MAP

FIELDS = ("n", "mean_x", "cxx", "mean_y", "cxy", "yy")
# What a split's statistics fit: the late layers' inputs (y_l = h_l, an input map's target), or the late attention
# layers' keys before RoPE and QK-norm and their values side by side (a key/value map's target, width 2 * kv_heads *
# head_dim). Both share the rows, so their n, mean_x and cxx are equal.
INPUT, KV = INPUT_MAP, KV_MAP


@dataclass
class Moments:
    n: int
    mean_x: np.ndarray  # [dx]
    cxx: np.ndarray  # [dx, dx]
    mean_y: np.ndarray  # [k, dy]
    cxy: np.ndarray  # [k, dx, dy]
    yy: np.ndarray  # [k]

    @classmethod
    def empty(cls, k: int, dx: int, dy: int) -> "Moments":
        z = np.zeros
        return cls(0, z(dx), z((dx, dx)), z((k, dy)), z((k, dx, dy)), z(k))

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        out = {f"{prefix}.{f}": np.ascontiguousarray(getattr(self, f)) for f in FIELDS if f != "n"}
        out[f"{prefix}.n"] = np.array([self.n], dtype=np.int64)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str) -> "Moments":
        get = lambda f: np.asarray(arrays[f"{prefix}.{f}"], dtype=np.float64)  # noqa: E731
        return cls(int(arrays[f"{prefix}.n"][0]), get("mean_x"), get("cxx"), get("mean_y"), get("cxy"), get("yy"))


def moments_of(x: np.ndarray, ys: np.ndarray) -> Moments:
    """Moments of one batch: x [n, dx], ys [k, n, dy] (any float dtype; computed in float64)."""
    x = np.asarray(x, dtype=np.float64)
    ys = np.asarray(ys, dtype=np.float64)
    k, n, dy = ys.shape
    mean_x = x.mean(axis=0)
    mean_y = ys.mean(axis=1)  # [k, dy]
    xc = x - mean_x
    yc = ys - mean_y[:, None, :]  # [k, n, dy]
    # One matmul for all layers: [dx, n] @ [n, k*dy] -> [dx, k, dy] -> [k, dx, dy]
    cxy = (xc.T @ yc.transpose(1, 0, 2).reshape(n, k * dy)).reshape(-1, k, dy).transpose(1, 0, 2)
    yy = np.einsum("knd,knd->k", yc, yc)
    return Moments(n, mean_x, xc.T @ xc, mean_y, np.ascontiguousarray(cxy), yy)


def merge(a: Moments, b: Moments) -> Moments:
    """Chan et al.'s pairwise update: exact for any split of the rows into a and b. Neither input is changed."""
    if a.n == 0:
        return b
    if b.n == 0:
        return a
    copy = Moments(a.n, a.mean_x, a.cxx.copy(), a.mean_y, a.cxy.copy(), a.yy.copy())
    return merge_into(copy, b)


def merge_into(a: Moments, b: Moments) -> Moments:
    """`merge(a, b)` computed in a's arrays (same arithmetic, same bits), so that a running total of a large model
    (16 late layers x 4096 x 4096 float64 is 2 GiB) does not need two more copies of itself for every update.
    Returns the merged moments; `a` is consumed."""
    if a.n == 0:
        return Moments(b.n, b.mean_x.copy(), b.cxx.copy(), b.mean_y.copy(), b.cxy.copy(), b.yy.copy())
    if b.n == 0:
        return a
    n = a.n + b.n
    dx = b.mean_x - a.mean_x  # [dx]
    dy = b.mean_y - a.mean_y  # [k, dy]
    f = a.n * b.n / n
    a.cxx += b.cxx
    a.cxx += f * np.outer(dx, dx)
    a.cxy += b.cxy
    a.cxy += f * dx[None, :, None] * dy[:, None, :]
    a.yy += b.yy
    a.yy += f * np.einsum("kd,kd->k", dy, dy)
    return Moments(n, a.mean_x + dx * (b.n / n), a.cxx, a.mean_y + dy * (b.n / n), a.cxy, a.yy)


def select_x(m: Moments, idx: np.ndarray) -> Moments:
    """The moments of the sub-vector x[idx] against the same targets (the moments of a part of x are the matching
    blocks of its moments): the maps from some of the stacked states a capture holds."""
    return Moments(m.n, m.mean_x[idx], m.cxx[np.ix_(idx, idx)], m.mean_y, np.ascontiguousarray(m.cxy[:, idx, :]),
                   m.yy)


def scale_x(m: Moments, scale: np.ndarray) -> Moments:
    """The moments of D x against the same targets, D = diag(scale [dx]): a ridge fit on them is a fit on x with a
    penalty of its own per coordinate, whose maps are the fitted ones times D (column j times scale[j])."""
    return Moments(m.n, m.mean_x * scale, m.cxx * scale[:, None] * scale[None, :], m.mean_y,
                   m.cxy * scale[None, :, None], m.yy)


def mix(a: Moments, b: Moments, share_b: float) -> Moments:
    """Weighted mixture: rows of b weigh `share_b` of the total, rows of a the rest.

    Per-row covariances mix as (1-w) Ca/na + w Cb/nb + w (1-w) d d^T; the result is scaled back to
    n = na + nb rows so that its magnitude matches a plain merge (ridge is scale-free anyway).
    """
    if not 0.0 <= share_b <= 1.0:
        raise ValueError("share must be in [0, 1]")
    if b.n == 0 or share_b == 0.0:
        return a
    if a.n == 0 or share_b == 1.0:
        return b
    w, n = share_b, a.n + b.n
    dx = b.mean_x - a.mean_x
    dy = b.mean_y - a.mean_y
    mixcov = lambda ca, cb, cross: n * ((1 - w) * ca / a.n + w * cb / b.n + w * (1 - w) * cross)  # noqa: E731
    return Moments(
        n,
        a.mean_x + w * dx,
        mixcov(a.cxx, b.cxx, np.outer(dx, dx)),
        a.mean_y + w * dy,
        mixcov(a.cxy, b.cxy, dx[None, :, None] * dy[:, None, :]),
        mixcov(a.yy, b.yy, np.einsum("kd,kd->k", dy, dy)),
    )
