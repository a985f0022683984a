"""int8 group quantization (docs/format.md, the int8 projector): exact codes on hand-made rows, a slow reference, torch bf16."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from ridgefill.formats.int8 import GROUP_SIZE, bf16_bits_to_f32, dequantize, f32_to_bf16_bits, quantize

ONE = 0x3F80  # bf16 1.0


# ------------------------------------------------------------------------------- slow pure-Python reference


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (ties to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def ref_bf16_bits(x: float) -> int:
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def ref_bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def ref_quantize(w: np.ndarray, group: int = GROUP_SIZE) -> tuple[list[list[int]], list[list[int]]]:
    """One element at a time. Float32 division is emulated by a float64 division rounded to float32, which
    is exactly the correctly rounded float32 quotient (53 >= 2*24 + 2)."""
    codes, scales = [], []
    for row in w.tolist():
        crow, srow = [], []
        for g in range(0, len(row), group):
            vals = row[g : g + group]
            absmax = max(abs(v) for v in vals)
            bits = ref_bf16_bits(f32(absmax / 127.0))
            if bits & 0x7FFF == 0:
                bits = ONE
            scale = ref_bits_to_float(bits)
            srow.append(bits)
            crow += [max(-127, min(127, round(f32(v / scale)))) for v in vals]  # round(): half to even
        codes.append(crow)
        scales.append(srow)
    return codes, scales


def scale_per_column(bits: np.ndarray, d_in: int) -> np.ndarray:
    return np.repeat(bf16_bits_to_f32(bits), GROUP_SIZE, axis=1)[:, :d_in]


# ----------------------------------------------------------------------------------------- hand-made rows


def test_all_zero_group_gets_scale_one_and_zero_codes():
    w = np.zeros((2, 256), dtype=np.float32)
    w[0, 128:] = np.linspace(-1, 1, 128, dtype=np.float32)
    codes, bits = quantize(w)
    assert bits.dtype == np.uint16 and bits.shape == (2, 2)
    assert bits[0, 0] == ONE and bits[1, 0] == ONE and bits[1, 1] == ONE
    assert bits[0, 1] == f32_to_bf16_bits(np.float32(np.float32(1.0) / np.float32(127)))
    assert not codes[0, :128].any() and not codes[1].any()
    assert np.array_equal(dequantize(codes, bits)[1], np.zeros(256, np.float32))


def test_ties_round_half_to_even():
    # absmax 127 -> scale exactly 1.0; absmax 31.75 -> scale exactly 0.25
    row1 = [0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 126.5, 127.0]
    row2 = [0.125, 0.375, 0.625, -0.375, 31.625, 31.75]  # 0.5, 1.5, 2.5, -1.5, 126.5, 127 times the scale
    w = np.zeros((2, 128), dtype=np.float32)
    w[0, : len(row1)] = row1
    w[1, : len(row2)] = row2
    codes, bits = quantize(w)
    assert bits[0, 0] == ONE
    assert bf16_bits_to_f32(bits[1, 0]) == 0.25
    assert codes[0, : len(row1)].tolist() == [0, 2, 2, 4, 0, -2, -2, 126, 127]
    assert codes[1, : len(row2)].tolist() == [0, 2, 2, -2, 126, 127]


def test_clamp_when_bf16_rounding_shrinks_the_scale():
    # A bf16-subnormal scale is coarse: absmax/127 = 1.26 * 2**-133 rounds down to 2**-133 (bits 0x0001),
    # so the ratio absmax/scale is 160 and the codes clamp at +-127.
    u = 2.0**-133
    vals = [160 * u, 128 * u, -160 * u, -127.5 * u, 100 * u, 0.5 * u, 1.5 * u]
    w = np.zeros((1, 128), dtype=np.float32)
    w[0, : len(vals)] = vals
    assert [float(x) for x in w[0, : len(vals)]] == vals  # all exactly representable
    codes, bits = quantize(w)
    assert bits[0, 0] == 0x0001
    assert codes[0, : len(vals)].tolist() == [127, 127, -127, -127, 100, 0, 2]
    assert codes.min() >= -127


def test_normal_scales_never_need_the_clamp():
    # The worst case for a normal scale: absmax/127 = 1 + 2**-8 is a bf16 tie and rounds down to 1.0, so the
    # largest ratio is 127 * (1 + 2**-8) = 127.496..., still below 127.5.
    absmax = 127 * (1 + 2.0**-8)
    w = np.array([[absmax, -absmax] + [0.0] * 126], dtype=np.float32)
    assert float(w[0, 0]) == absmax
    codes, bits = quantize(w)
    assert bits[0, 0] == ONE
    assert codes[0, :2].tolist() == [127, -127]


def test_ragged_last_group():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 300)).astype(np.float32)
    w[:, 256:] *= np.float32(0.01)
    w[1, 256:] = 0.0  # ragged group all zero
    w[2, 299] = 44.0  # ragged group's max is its last column
    codes, bits = quantize(w)
    assert codes.shape == (4, 300) and codes.dtype == np.int8
    assert bits.shape == (4, 3)
    assert bits[1, 2] == ONE and not codes[1, 256:].any()
    assert bits[2, 2] == f32_to_bf16_bits(np.float32(44.0) / np.float32(127))
    assert codes[2, 299] == 127
    ref_codes, ref_bits = ref_quantize(w)
    assert codes.tolist() == ref_codes and bits.tolist() == ref_bits
    assert dequantize(codes, bits).shape == (4, 300)


# ------------------------------------------------------------------------------------- against references


@pytest.mark.parametrize("d_in", [128, 300, 1, 129])
def test_matches_slow_reference_exactly(d_in):
    rng = np.random.default_rng(d_in)
    w = rng.standard_normal((9, d_in)).astype(np.float32)
    w *= (np.float32(2.0) ** rng.integers(-30, 30, (9, 1))).astype(np.float32)  # rows at many magnitudes
    w[0] = 0.0
    w[1, ::3] = 0.0
    # plant exact ties: values at (k + 0.5) * scale for a scale of 1.0 (absmax 127)
    w[2] = np.clip(np.round(rng.uniform(-126, 126, d_in)) + 0.5, -126.5, 126.5)
    w[2, 0] = 127.0
    w[3] *= np.float32(1e-38)  # tiny and subnormal values
    codes, bits = quantize(w)
    ref_codes, ref_bits = ref_quantize(w)
    assert codes.tolist() == ref_codes
    assert bits.tolist() == ref_bits


def test_matches_a_torch_float32_reference():
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    t = torch.from_numpy(w).view(16, 4, 128)  # [d_out, groups, 128]
    scale = (t.abs().amax(dim=2) / 127).to(torch.bfloat16)  # [d_out, groups]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    ref = torch.clamp(torch.round(t / scale.float()[:, :, None]), -127, 127).to(torch.int8).view(16, 512)
    codes, bits = quantize(w)
    assert np.array_equal(codes, ref.numpy())
    assert np.array_equal(bits, scale.view(torch.int16).numpy().view(np.uint16))


def test_bf16_conversion_matches_torch_bit_for_bit():
    rng = np.random.default_rng(11)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x[:1000] = (x[:1000] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exact ties
    x[1000:2000] &= np.uint32(0x807FFFFF)  # subnormals
    x[2000:3000] = (x[2000:3000] & np.uint32(0xFFFF0000)) | np.uint32(0x7FFF)  # just below a tie
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, 1.0], np.float32)
    xs = np.concatenate([x.view(np.float32), special])
    ours = f32_to_bf16_bits(xs)
    theirs = torch.from_numpy(xs).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(xs)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(bf16_bits_to_f32(ours[nan])).all()  # NaN bit patterns differ between torch's code paths
    # and back: bf16 -> f32 is exact, as torch does it
    back = torch.from_numpy(ours[~nan].view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16_bits_to_f32(ours[~nan]).view(np.uint32), back.view(np.uint32))


# ------------------------------------------------------------------------------------ round trip, errors


def test_round_trip_error_is_at_most_half_a_scale():
    rng = np.random.default_rng(5)
    for d_in in (256, 300, 1000):
        w = rng.standard_normal((64, d_in)).astype(np.float32)
        w *= (np.float32(2.0) ** rng.integers(-60, 60, (64, 1))).astype(np.float32)
        codes, bits = quantize(w)
        deq = dequantize(codes, bits)
        assert deq.dtype == np.float32
        scale = scale_per_column(bits, d_in).astype(np.float64)
        # the decoded value is exactly code * scale (no float32 rounding in the product)
        assert np.array_equal(deq.astype(np.float64), codes.astype(np.float64) * scale)
        assert (np.abs(w.astype(np.float64) - deq) <= scale / 2).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(bad):
    w = np.zeros((3, 200), dtype=np.float32)
    w[2, 150] = bad
    with pytest.raises(ValueError, match="row 2, column 150"):
        quantize(w)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        quantize(np.zeros((2, 8)))
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="group size"):
        quantize(np.zeros((2, 8), np.float32), group=0)
    codes, bits = quantize(np.ones((2, 300), np.float32))
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        dequantize(codes, bits[:, :2])
    bad = codes.copy()
    bad[0, 0] = -128
    with pytest.raises(ValueError, match="-128"):
        dequantize(bad, bits)
    with pytest.raises(ValueError, match="finite and positive"):
        dequantize(codes, np.zeros_like(bits))
