"""Group-wise int8 quantization of the RidgeFill maps (the `int8` projector of docs/format.md).

Pure numpy: arrays in, arrays out, no I/O, no torch (in the manner of gguf-py's quants.py).

Per output row, the input columns are cut into groups of `group` consecutive columns (`GROUP_SIZE`, 128, unless
the caller says otherwise: a quantize artifact and a release record the size they used); when `d_in`
is not a multiple of the group size the last group is shorter. Each group stores one bf16 scale and one int8
code per weight. Exactly, for a group `g` of a float32 row:

    absmax = max |w| over g                                   (float32, exact)
    s32    = absmax / 127                                     (one IEEE float32 division)
    scale  = bf16(s32)                                        (round to nearest, ties to even; see below)
    scale  = 1.0 if scale == 0                                (all-zero group, or absmax < 127 * 2**-134)
    code   = clip(rint(w / scale), -127, 127)                 (w / scale: one IEEE float32 division, not
                                                               w * (1/scale); rint: round half to even)
    decoded w = code * scale                                  (exact in float32: 7 bits times 8 bits)

`bf16(x)` is the float32 -> bfloat16 conversion torch uses (`ridgefill.numerics.f32_to_bf16_bits`: round to
nearest, ties to even; quantize refuses NaN). bf16 values are carried in numpy as their uint16 bit patterns.
Note `scale` is double-rounded (float32, then bf16) on purpose: that is what
`torch.tensor(absmax / 127, dtype=float32).to(bfloat16)` computes, so a torch reference matches bit for bit.

Why the clip almost never fires: RNE moves a normal bf16 scale down by at most half a bf16 ulp, a factor of
at most 1 + 2**-8 < 127.5/127, so |w| / scale stays below 127.5 and rounds to at most 127. Only groups whose
scale is a bf16 subnormal (absmax below about 1.5e-36) lose enough precision for the ratio to pass 127.5;
there the clip keeps codes in range and the round-trip bound |w - decoded| <= scale/2 no longer holds.
"""

from __future__ import annotations

import numpy as np

from ridgefill.numerics import bf16_bits_to_f32, f32_to_bf16_bits

GROUP_SIZE = 128
CODE_MAX = 127  # symmetric: -128 is never written, and a reader refuses it
_BF16_ONE = np.uint16(0x3F80)


def n_groups(d_in: int, group: int = GROUP_SIZE) -> int:
    """Number of scale columns for `d_in` input columns: ceil(d_in / group)."""
    return -(-d_in // group)


def _check_group(group: int) -> None:
    if not isinstance(group, (int, np.integer)) or isinstance(group, bool) or group < 1:
        raise ValueError(f"group size must be a positive integer, got {group!r}")


def quantize(w: np.ndarray, group: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float32 map `w [d_out, d_in]` -> (codes int8 [d_out, d_in], scale_bits uint16 [d_out, n_groups]).

    Raises ValueError on a non-float32 or non-2-D input, or on NaN/inf (the first bad element is named).
    """
    _check_group(group)
    w = np.asarray(w)
    if w.dtype != np.float32:
        raise ValueError(f"quantize expects float32 weights, got {w.dtype} (cast explicitly first)")
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D [d_out, d_in] map, got shape {tuple(w.shape)}")
    finite = np.isfinite(w)
    if not finite.all():
        r, c = np.argwhere(~finite)[0]
        raise ValueError(f"weights contain NaN/inf ({int((~finite).sum())} values, first at row {r}, column {c})")
    d_out, d_in = w.shape
    ng = n_groups(d_in, group)

    # zero padding to a whole number of groups does not change any absmax, and its codes are cut off below
    wp = np.zeros((d_out, ng * group), dtype=np.float32)  # [d_out, ng*group]
    wp[:, :d_in] = w
    wg = wp.reshape(d_out, ng, group)  # [d_out, ng, group]

    absmax = np.abs(wg).max(axis=2)  # [d_out, ng]
    scale_bits = f32_to_bf16_bits(absmax / np.float32(CODE_MAX))  # [d_out, ng]
    # +0.0 and -0.0 bf16 both mean "no usable scale": all-zero group, or a scale that underflowed bf16
    scale_bits = np.where((scale_bits & np.uint16(0x7FFF)) == 0, _BF16_ONE, scale_bits)
    scale = bf16_bits_to_f32(scale_bits)  # [d_out, ng] float32

    ratio = wg / scale[:, :, None]  # [d_out, ng, group] float32, one IEEE division per element
    codes = np.clip(np.rint(ratio), -CODE_MAX, CODE_MAX).astype(np.int8)  # [d_out, ng, group]
    codes = codes.reshape(d_out, ng * group)[:, :d_in]  # [d_out, d_in]
    return np.ascontiguousarray(codes), scale_bits


def dequantize(codes: np.ndarray, scale_bits: np.ndarray, group: int = GROUP_SIZE) -> np.ndarray:
    """Decode (codes int8 [d_out, d_in], scale_bits uint16 [d_out, n_groups]) -> float32 [d_out, d_in].

    Raises ValueError on wrong dtypes or shapes, a code of -128, a scale that is not finite and positive, or one
    so large that a code times it overflows float32 (without numpy's overflow warning).
    """
    _check_group(group)
    codes = np.asarray(codes)
    scale_bits = np.asarray(scale_bits)
    if codes.dtype != np.int8 or codes.ndim != 2:
        raise ValueError(f"codes must be a 2-D int8 array, got {codes.dtype} {tuple(codes.shape)}")
    if scale_bits.dtype != np.uint16:
        raise ValueError(f"scale bits must be uint16 (bf16 patterns), got {scale_bits.dtype}")
    d_out, d_in = codes.shape
    ng = n_groups(d_in, group)
    if scale_bits.shape != (d_out, ng):
        raise ValueError(
            f"scales have shape {tuple(scale_bits.shape)}, expected ({d_out}, {ng}) "
            f"for codes ({d_out}, {d_in}) with group size {group}"
        )
    if codes.size and codes.min() < -CODE_MAX:
        raise ValueError("codes contain -128, which this format never writes")
    scale = bf16_bits_to_f32(scale_bits)  # [d_out, ng]
    if not (np.isfinite(scale) & (scale > 0)).all():
        raise ValueError("scales must be finite and positive")
    scale_cols = np.repeat(scale, group, axis=1)[:, :d_in]  # [d_out, d_in]
    with np.errstate(over="ignore"):  # an overflow is refused just below, by name, not warned about
        w = codes.astype(np.float32) * scale_cols  # exact: |code| < 2**7, scale has 8 significant bits
    if not np.isfinite(w).all():  # a forged scale near float32's top (bf16 0x7f00 is 1.7e38): 127 x it is inf
        r, c = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"scales times codes overflow float32 (the scale of row {r}, group {c // group} is "
                         f"{float(scale[r, c // group]):.4g}, and {CODE_MAX} times it must be a float32)")
    return w


def bias_correction(b: np.ndarray, w: np.ndarray, w_q: np.ndarray, mean_x: np.ndarray) -> np.ndarray:
    """The bias that carries a quantized map's rounding error along the calibration mean, float32 [d_out]:
    b_q = b + (W - W_q) mean_x, computed in float64, so that W_q mean_x + b_q = W mean_x + b.

    b [d_out], w and its decoded w_q [d_out, d_in], mean_x [d_in]. Its part along the mean is the same on every
    row, so the bias can hold it; it matters on models with massive activations (Gemma 3: one split-state
    dimension reaches 4.5e4 against a median of 50), whose nearly constant huge input multiplies the coarse
    rounding of that column's small weights. int8 here and Q8_0 (ridgefill.formats.gguf) both use it."""
    err = np.asarray(w, dtype=np.float64) - w_q  # [d_out, d_in]
    return (np.asarray(b, dtype=np.float64) + err @ np.asarray(mean_x, dtype=np.float64)).astype(np.float32)
