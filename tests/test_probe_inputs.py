"""Bad inputs and faults a probe of the toolchain tried as a hostile user would (issue 51, B4, B5, B7): each is
refused in one line, exit 2, naming what to do, or survived. Every test builds what it needs in its own tmp_path."""

from __future__ import annotations

import numpy as np
import pytest
from clirun import cli
from tiny import make_tiny_gguf

from ridgefill.errors import BadInput
from ridgefill.formats import gguf as G


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
