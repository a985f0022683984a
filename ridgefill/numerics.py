"""Numerics that several stages share: bfloat16 rounding, log-softmax and the paired bootstrap.

Pure numpy, no I/O, no torch, and nothing of ridgefill above it: the int8 format (bf16 scales), the fold (caches
rounded to bf16), eval's metrics and the fold's report all use these one definitions.

bf16 values are carried in numpy as their uint16 bit patterns (numpy has no bfloat16).
"""

from __future__ import annotations

import numpy as np

_BF16_NAN = np.uint16(0x7FC0)
CACHE_DTYPES = ("bfloat16", "float16", "float32")


# ---------------------------------------------------------------------------------------------- bfloat16


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 bf16 bit patterns, round to nearest even (bit-identical to torch).

    The conversion torch uses (c10 `round_to_nearest_even`): add `0x7FFF + ((bits >> 16) & 1)` to the float32 bit
    pattern and keep the high 16 bits. NaN becomes 0x7FC0 (torch's scalar path)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding_bias = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    # uint32 addition cannot wrap here: the largest non-NaN pattern is 0xFF800000 (-inf)
    out = ((bits + rounding_bias) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(x), _BF16_NAN, out)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact: bf16 is the top half of a float32)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise ValueError(f"bf16 bits must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to(x, dtype: str) -> np.ndarray:
    """Round x (float32 or float64) to a cache dtype; returns float32 holding the rounded values, same shape.

    Matches torch's `.to(dtype)` bit for bit. Like torch, a float64 input is first rounded to float32 (so it is
    rounded twice); bfloat16 then rounds the float32 bit pattern to nearest even (`f32_to_bf16_bits`), float16 is
    numpy's round-to-nearest-even cast.
    """
    x32 = np.asarray(x).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x32)).reshape(x32.shape)
    if dtype == "float16":
        return x32.astype(np.float16).astype(np.float32)
    if dtype == "float32":
        return x32
    raise ValueError(f"cache dtype must be one of {', '.join(CACHE_DTYPES)}, got {dtype!r}")


# ------------------------------------------------------------------------------------------- log-softmax


def log_softmax(x) -> np.ndarray:
    """Log-softmax over the last axis in float64, stabilised by each row's maximum (an all -inf row stays -inf,
    NaN after the subtraction). x: [..., V] any real dtype -> [..., V] float64."""
    x = np.asarray(x).astype(np.float64, copy=False)
    m = np.max(x, axis=-1, keepdims=True)  # [..., 1]
    m = np.where(np.isfinite(m), m, 0.0)
    z = x - m  # [..., V]
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))  # [..., V]


# -------------------------------------------------------------------------------------- paired bootstrap


def paired_bootstrap(a, b, *, samples: int = 10000, seed: int = 0, level: float = 0.95, weights=None) -> dict:
    """Paired bootstrap percentile interval for the mean of ``a - b`` over units (documents, needle samples,
    queries).

    a, b: [n] float, one value per unit (e.g. per-document mean NLL of an arm and of exact);
    weights: optional [n] float >= 0 (e.g. token counts), making the statistic ``sum(w (a-b)) / sum(w)``.
    Units with weight 0 are dropped before resampling (their a, b may then be NaN); every kept value must be
    finite. Each of ``samples`` resamples draws n kept units with replacement (numpy ``default_rng(seed)``,
    so the result is a function of the inputs and the seed). The interval is the (1-level)/2 and (1+level)/2
    quantiles (numpy "linear" method) of the resampled statistic; when a - b is constant (up to round-off)
    the interval is exactly [mean, mean].

    ->  dict(mean=statistic on the data, low, high, n=units used) (floats / int).
    Raises ValueError on mismatched shapes, n == 0, non-finite values, negative weights, a bad level or
    samples < 1.
    """
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"a {x.shape} and b {y.shape} must be 1-D arrays of equal length")
    samples = int(samples)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    level = float(level)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    d = x - y  # [n]
    w = None
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != d.shape:
            raise ValueError(f"weights {w.shape} must have the shape of a {d.shape}")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError("weights must be finite and >= 0")
        keep = w > 0
        d, w = d[keep], w[keep]
    n = int(d.shape[0])
    if n == 0:
        raise ValueError("paired_bootstrap needs at least one unit (with positive weight)")
    if not np.all(np.isfinite(d)):
        raise ValueError("a and b must be finite on every unit used")
    point = float(np.mean(d)) if w is None else float(np.sum(w * d) / np.sum(w))

    rng = np.random.default_rng(seed)
    stats = np.empty(samples, dtype=np.float64)  # [samples]
    chunk = max(1, min(samples, 4_000_000 // n))  # bound memory at ~32 MB of indices
    for lo in range(0, samples, chunk):
        m = min(chunk, samples - lo)
        idx = rng.integers(0, n, size=(m, n))  # [m, n]
        if w is None:
            stats[lo : lo + m] = d[idx].mean(axis=1)
        else:
            ww = w[idx]  # [m, n]
            stats[lo : lo + m] = (ww * d[idx]).sum(axis=1) / ww.sum(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    # A difference that is constant up to round-off (e.g. (b + c) - b) resamples to that constant: report a
    # zero-width interval at the point estimate rather than a few ulps of noise.
    if np.ptp(d) <= 8 * np.finfo(np.float64).eps * np.max(np.abs(d)):
        low = high = point
    return {"mean": point, "low": float(low), "high": float(high), "n": n}
