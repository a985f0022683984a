"""Bad inputs and faults a probe of the toolchain tried as a hostile user would (issue 51, B4, B5, B7): each is
refused in one line, exit 2, naming what to do, or survived. Every test builds what it needs in its own tmp_path."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from clirun import cli
from tiny import make_tiny_gguf

from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.formats import gguf as G
from ridgefill.formats import int8, release, safetensors
from ridgefill.formats.release import MANIFEST, MAPS_FILE


def one_line_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------- a truncated GGUF


def test_a_truncated_model_gguf_is_bad_input_before_it_is_loaded(tmp_path):
    whole = make_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])  # the tables whole, the tensor data cut short
    r = cli("capture", cut, "--store", tmp_path / "store")
    assert r.returncode == 2, r.stderr
    assert one_line_error(r) == (f"Error: '{cut}': truncated GGUF: the file ends at byte {len(whole) // 2}, its "
                                 f"tensor data at byte {len(whole)}")


def _maps_gguf(path) -> bytes:
    rng = np.random.default_rng(0)
    maps = {1: {"weight": rng.standard_normal((32, 64)).astype(np.float32),
                "bias": rng.standard_normal(32).astype(np.float32)}}
    manifest = {"model": {"name": "x"}, "split": 1, "layers": [{"index": 1, "kind": "attention", "map": "input"}]}
    G.write_gguf(path, manifest, G.encode_tensors(maps)[0])
    return path.read_bytes()  # ends with the bias, 128 bytes: a whole number of 32-byte alignments, no padding


@pytest.mark.parametrize("keep", [-1, 0.5, 200, 30])
def test_a_truncated_maps_gguf_is_refused_by_name(tmp_path, keep):
    """Cut in the tensor data (by one byte, or half the file), in the key/value table, in the fixed header."""
    whole = _maps_gguf(tmp_path / "m.gguf")
    n = len(whole) + keep if keep < 0 else int(len(whole) * keep) if keep < 1 else keep
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:n])
    where = {-1: f"its tensor data at byte {len(whole)}", 0.5: f"its tensor data at byte {len(whole)}",
             200: "inside its key/value table", 30: "inside its key/value table"}[keep]
    want = f"{cut}: not a readable GGUF file (truncated GGUF: the file ends at byte {n}, {where})"
    for read in (G.load_gguf, G.load_gguf_extras):
        with pytest.raises(BadInput) as e:
            read(cut)
        assert str(e.value) == want
    G.load_gguf(tmp_path / "m.gguf")  # the whole file reads


# ------------------------------------------------------------------------------------------------ releases


def write_release(path: Path, layers=(5, 6), **kw) -> Path:
    """A small int8 release (kv maps [48, 160] of a 7-layer model split at 5)."""
    rng = np.random.default_rng(0)
    maps = {}
    for layer in layers:
        codes, bits = int8.quantize((rng.standard_normal((48, 160)) * 0.05).astype(np.float32))
        maps[layer] = {"codes": codes, "scale_bits": bits, "bias": rng.standard_normal(48).astype(np.float32)}
    manifest = {"model": {"name": "acme/m", "architecture": "llama", "num_layers": 7, "hidden_size": 160,
                          "num_kv_heads": 2, "head_dim": 12, "fingerprint": "0123456789abcdef"},
                "split": 5, "tail_default": 512, "layers": [{"index": i, "kind": "attention", "map": "kv"} for i in layers],
                "fit": {"alpha": 1e-4, "exact_norm": 812.5, "skip_first_rows": 1}}
    release.write_release(path, maps, manifest, "# a release\n", **kw)
    return path


def forge_maps(folder: Path, change) -> None:
    """Rewrite maps.safetensors with `change(arrays)` applied (its metadata, the facts, kept) and list its new
    sha256 in ridgefill.json, as a forger would: the release still verifies file by file."""
    arrays, meta = safetensors.load(folder / MAPS_FILE)
    change(arrays)
    (folder / MAPS_FILE).write_bytes(safetensors.encode(arrays, meta))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][MAPS_FILE] = sha256_file(folder / MAPS_FILE)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_scale_whose_codes_overflow_float32_is_refused_without_numpy_warnings(tmp_path):
    rel = write_release(tmp_path / "rel")

    def huge_scale(arrays):
        bits = arrays["layer.6.scales"].bits.copy()
        bits[0, 0] = 0x7F00  # bf16 1.7e38: finite and positive, but 127 times it is not a float32
        arrays["layer.6.scales"] = safetensors.BF16(bits)

    forge_maps(rel, huge_scale)
    r = cli("verify", rel)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [  # the one line, no RuntimeWarning before it
        "Error: maps.safetensors: tensor 'layer.6.scales': scales times codes overflow float32 (the scale of row 0, "
        "group 0 is 1.701e+38, and 127 times it must be a float32)"]
    codes, bits = int8.quantize(np.ones((1, 4), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="^scales times codes overflow float32"):
            int8.dequantize(codes, np.full_like(bits, 0x7F00))
        assert int8.dequantize(np.zeros_like(codes), np.full_like(bits, 0x7F00)).tolist() == [[0.0] * 4]
