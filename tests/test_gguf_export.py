"""GGUF export (`ridgefill export --format gguf`): Q8_0 maps against a brute-force Q8_0 and the float maps,
orientation, metadata against the release manifest, identical bytes, overwrite policy and refusals, through the
real CLI. No model is loaded: releases are written directly, and store chains are built from hand-made
capture/solve/quantize artifacts.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ridgefill.artifacts import Store
from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.formats import gguf as G
from ridgefill.formats import int8, release
from clirun import cli
from fakestore import D_IN, D_OUT, FP, LAYERS, calibration_mean, fake_chain, float_maps


# The hand-made releases (ridgefill-maps/2): the fake store's three maps [96, 160] as the kv maps of layers 9..11 of
# a 12-layer model of hidden size 160 with 2 KV heads of 24 dims ("blk.10" sorts before "blk.9": orders must be
# numeric). The store chains keep the fake store's own layers (LAYERS).
REL = (9, 10, 11)
KV_HEADS, HEAD_DIM = 2, 24  # 2 * 2 * 24 = D_OUT


def manifest(d_in: int = D_IN) -> dict:
    return {
        "model": {"name": "fake/Model-1", "revision": None, "architecture": "llama", "num_layers": 12,
                  "hidden_size": d_in, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "fingerprint": FP},
        "split": 9,
        "tail_default": 512,
        "license": "mit",
        "layers": [{"index": l, "kind": "sliding_attention" if l == 10 else "attention", "map": "kv"} for l in REL],
        "fit": {"alpha": 1e-4, "lambda": 0.0123456789, "rows": 98304, "documents": 2, "tokens": 98306,
                "calibration_sha256": ["a" * 64, "c" * 64], "capture_id": "1" * 16, "solve_id": "2" * 16,
                "skip_first_rows": 1, "chat": False, "chat_share": None, "exact_norm": 812.5},
        "heldout": {"fitted": {"k_cosine": 0.96512, "v_cosine": 0.80934}, "identity": {"k_cosine": 0.857,
                    "v_cosine": 0.574}, "rows": 1843, "metric": "kv", "int8_score": 0.8856, "float_score": 0.8871},
    }


def int8_maps(seed: int = 0, d_in: int = D_IN) -> dict[int, dict[str, np.ndarray]]:
    out = {}
    for layer, m in float_maps(seed, d_in).items():
        codes, bits = int8.quantize(m["weight"])
        out[layer] = {"codes": codes, "scale_bits": bits, "bias": m["bias"]}
    return out


def as_release_layers(maps: dict) -> dict:
    """The fake store's maps {2, 12, 13} as the release's layers {9, 10, 11}."""
    return {r: maps[l] for r, l in zip(REL, LAYERS)}


def write_release(path: Path, kind: str = "int8", d_in: int = D_IN) -> Path:
    maps = as_release_layers(int8_maps(d_in=d_in) if kind == "int8" else float_maps(d_in=d_in))
    release.write_release(path, maps, manifest(d_in), "# card\n", weight_dtype=None if kind == "int8" else "f32")
    return path


def no_nulls(x):
    if isinstance(x, dict):
        return {k: no_nulls(v) for k, v in x.items() if v is not None and v != []}
    return x


def shuffled(d: dict, seed: int) -> dict:
    items = list(d.items())
    random.Random(seed).shuffle(items)
    return {k: shuffled(v, seed + 1) if isinstance(v, dict) else v for k, v in items}


def one_line_error(r, code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


# ------------------------------------------------------------------------------------ brute-force Q8_0


def q8_0_reference(w: np.ndarray) -> bytes:
    """ggml-quants.c `quantize_row_q8_0_ref`, one value at a time in float32: d = amax / 127, id = 1 / d,
    q = roundf(x * id) (half away from zero), block = f16(d) then 32 int8."""
    out = bytearray()
    for row in w:
        for b in range(0, len(row), 32):
            block = row[b:b + 32]
            amax = np.float32(max(abs(float(v)) for v in block))
            d = np.float32(amax / np.float32(127))
            inv = np.float32(1) / d if d else np.float32(0)
            out += np.float16(d).tobytes()
            for v in block:
                x = float(np.float32(v) * inv)
                out += int(math.copysign(math.floor(abs(x) + 0.5), x)).to_bytes(1, "little", signed=True)
    return bytes(out)


def q8_0_bound(w: np.ndarray) -> np.ndarray:
    """Per element: half a step of the exact scale d = absmax/127, the f16 rounding of d times the largest
    code (127), and float32 slack for x * (1/d) and code * scale -> [d_out, d_in]."""
    blocks = w.reshape(w.shape[0], -1, 32)  # [d_out, nb, 32]
    d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float64)  # [d_out, nb]
    d16 = d.astype(np.float32).astype(np.float16).astype(np.float64)
    bound = d * (0.5 + 1e-4) + 127 * np.abs(d16 - d)  # [d_out, nb]
    return np.repeat(bound, 32, axis=1)


# ---------------------------------------------------------------------------------- library round trip


@pytest.fixture(scope="module")
def int8_release(tmp_path_factory) -> Path:
    return write_release(tmp_path_factory.mktemp("gguf") / "rel")


@pytest.mark.parametrize("kind", ["int8", "f32"])
def test_q8_0_tensors_match_brute_force_and_float_maps(tmp_path, kind):
    from gguf import GGMLQuantizationType, GGUFReader, quants

    rel = write_release(tmp_path / "rel", kind)
    manifest_, maps = release.load_release(rel)  # float maps: the int8 release decoded, or the f32 weights
    tensors_, errors = G.encode_tensors(maps)
    G.write_gguf(tmp_path / "m.gguf", manifest_, tensors_)
    reader = GGUFReader(tmp_path / "m.gguf")

    names = [t.name for t in reader.tensors]
    assert names == [f"blk.{l}.ridgefill.{k}" for l in REL for k in ("weight", "bias")]
    for t in reader.tensors:
        layer = int(t.name.split(".")[1])
        w, b = maps[layer]["weight"], maps[layer]["bias"]
        if t.name.endswith(".bias"):
            assert t.tensor_type == GGMLQuantizationType.F32
            assert t.shape.tolist() == [D_OUT]
            assert np.array_equal(np.asarray(t.data), b)  # biases exactly the release's
            continue
        assert t.tensor_type == GGMLQuantizationType.Q8_0
        assert t.shape.tolist() == [D_IN, D_OUT]  # GGML order: ne[0] = d_in, the row (block) direction
        assert t.data.shape == (D_OUT, D_IN // 32 * 34)  # numpy order, bytes per row
        assert np.asarray(t.data).tobytes() == q8_0_reference(w)  # bit-exact against ggml's reference
        deq = quants.dequantize(np.asarray(t.data), GGMLQuantizationType.Q8_0)  # [d_out, d_in]
        assert deq.shape == (D_OUT, D_IN)
        err = np.abs(deq.astype(np.float64) - w)
        bound = q8_0_bound(w)
        assert (err <= bound).all(), float((err - bound).max())
        assert (err.max(axis=1) <= bound.max(axis=1)).all()  # per row, as the brief states it
        assert np.array_equal(deq[5], np.zeros(D_IN)) and np.array_equal(deq[7, 32:64], np.zeros(32))
        # orientation: the file computes the same x_hat = W h + b as the float map, for a non-square W
        h = np.random.default_rng(layer).standard_normal(D_IN)
        assert np.allclose(deq @ h + b, w @ h + b, rtol=0, atol=float(bound.max()) * np.abs(h).sum() + 1e-9)
        assert errors[str(layer)]["max_abs"] == pytest.approx(float(err.max()))
        assert errors[str(layer)]["max_rel"] == pytest.approx(float(err.max() / np.abs(w).max()))


def test_load_gguf_returns_the_manifest_facts_and_maps(tmp_path, int8_release):
    manifest_, maps = release.load_release(int8_release)
    tensors_, _ = G.encode_tensors(maps)
    G.write_gguf(tmp_path / "m.gguf", manifest_, tensors_, {"source_artifact": "quantize/abc"})
    facts, got = G.load_gguf(tmp_path / "m.gguf")
    assert facts == no_nulls(manifest_)  # every fact of ridgefill.json, incl. files -> sha256 of maps.safetensors
    assert facts["files"] == {"maps.safetensors": sha256_file(int8_release / "maps.safetensors")}
    assert facts["layers"] == manifest_["layers"] and {x["map"] for x in facts["layers"]} == {"kv"}
    assert sorted(got) == list(REL)
    for layer, m in got.items():
        assert m["weight"].shape == (D_OUT, D_IN) and np.array_equal(m["bias"], maps[layer]["bias"])
        assert (np.abs(m["weight"] - maps[layer]["weight"]) <= q8_0_bound(maps[layer]["weight"])).all()


def test_gguf_carries_state_offsets_and_the_protected_table(tmp_path, int8_release):
    manifest_, maps = release.load_release(int8_release)
    rng = np.random.default_rng(0)
    offsets = {10: rng.standard_normal((4, 8, 8)).astype(np.float32), 11: rng.standard_normal((4, 8, 8)).astype(np.float32)}
    table = np.array([3, 17, 250], dtype=np.int32)
    tensors_, _ = G.encode_tensors(maps)
    G.write_gguf(tmp_path / "m.gguf", manifest_, tensors_ + G.extra_tensors(offsets, table))
    _, got = G.load_gguf(tmp_path / "m.gguf")
    assert sorted(got) == list(REL)  # the maps read as before
    got_offsets, got_table = G.load_gguf_extras(tmp_path / "m.gguf")
    assert sorted(got_offsets) == [10, 11] and all(np.array_equal(got_offsets[l], offsets[l]) for l in offsets)
    assert got_table.tolist() == table.tolist()


def test_metadata_keys_and_types(tmp_path, int8_release):
    from gguf import GGUFReader, GGUFValueType as T

    manifest_, maps = release.load_release(int8_release)
    G.write_gguf(tmp_path / "m.gguf", manifest_, G.encode_tensors(maps)[0],
                 {"source_artifact": "quantize/abc", "release_artifact": "export/def"})
    fields = GGUFReader(tmp_path / "m.gguf").fields
    kv = {k: (f.types, f.contents()) for k, f in fields.items() if not k.startswith("GGUF.")}
    assert list(kv)[0] == "general.architecture" and list(kv)[1:] == sorted(list(kv)[1:])
    want = {
        "general.architecture": ([T.STRING], "ridgefill"),
        "general.type": ([T.STRING], "adapter"),
        "general.name": ([T.STRING], "fake/Model-1 ridgefill maps, split 9"),
        "general.base_model.count": ([T.UINT32], 1),
        "general.base_model.0.name": ([T.STRING], "fake/Model-1"),
        "general.file_type": ([T.UINT32], 7),
        "general.quantization_version": ([T.UINT32], 2),
        "general.license": ([T.STRING], "mit"),
        "ridgefill.gguf.format": ([T.STRING], "ridgefill-maps-gguf/2"),
        "ridgefill.gguf.source_artifact": ([T.STRING], "quantize/abc"),
        "ridgefill.gguf.release_artifact": ([T.STRING], "export/def"),
        "ridgefill.format": ([T.STRING], "ridgefill-maps/2"),
        "ridgefill.model.name": ([T.STRING], "fake/Model-1"),
        "ridgefill.model.fingerprint": ([T.STRING], FP),
        "ridgefill.model.num_layers": ([T.INT64], 12),
        "ridgefill.model.num_kv_heads": ([T.INT64], 2),
        "ridgefill.model.head_dim": ([T.INT64], 24),
        "ridgefill.split": ([T.INT64], 9),
        "ridgefill.tail_default": ([T.INT64], 512),
        "ridgefill.layers": ([T.ARRAY, T.INT64], list(REL)),
        "ridgefill.layer_kinds": ([T.ARRAY, T.STRING], ["attention", "sliding_attention", "attention"]),
        "ridgefill.layer_maps": ([T.ARRAY, T.STRING], ["kv", "kv", "kv"]),
        "ridgefill.fit.alpha": ([T.FLOAT64], 1e-4),
        "ridgefill.fit.lambda": ([T.FLOAT64], 0.0123456789),
        "ridgefill.fit.rows": ([T.INT64], 98304),
        "ridgefill.fit.chat": ([T.BOOL], False),
        "ridgefill.fit.calibration_sha256": ([T.ARRAY, T.STRING], ["a" * 64, "c" * 64]),
        "ridgefill.heldout.fitted.k_cosine": ([T.FLOAT64], 0.96512),
        "ridgefill.heldout.int8_score": ([T.FLOAT64], 0.8856),
        "ridgefill.projector.dtype": ([T.STRING], "int8"),
        "ridgefill.files": ([T.ARRAY, T.STRING], ["maps.safetensors"]),
        "ridgefill.files_sha256": ([T.ARRAY, T.STRING], [manifest_["files"]["maps.safetensors"]]),
    }
    for key, value in want.items():
        assert kv[key] == value, key
    # nulls are left out, not written as empty strings
    assert "ridgefill.model.revision" not in kv and "ridgefill.fit.chat_share" not in kv
    assert "general.base_model.0.version" not in kv


def test_same_inputs_give_identical_bytes_regardless_of_dict_order(tmp_path, int8_release):
    manifest_, maps = release.load_release(int8_release)
    G.write_gguf(tmp_path / "a.gguf", manifest_, G.encode_tensors(maps)[0])
    G.write_gguf(tmp_path / "b.gguf", shuffled(manifest_, 1), G.encode_tensors(shuffled(maps, 2))[0])
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf"]  # no temp files left


def test_library_refusals(tmp_path):
    with pytest.raises(BadInput, match=r"^layer 3: d_in = 100 is not a multiple of 32"):
        G.q8_0(3, np.zeros((4, 100), np.float32))
    big = np.ones((2, 64), np.float32)
    big[1, 40] = 1e7  # 1e7 / 127 > 65504: the f16 scale overflows
    with pytest.raises(BadInput, match="overflows Q8_0's f16 scale"):
        G.q8_0(4, big)
    with pytest.raises(ValueError, match="NaN/inf"):
        G.q8_0(5, np.full((2, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="reserved"):
        G.manifest_metadata({**manifest(), "gguf": {"x": 1}})
    with pytest.raises(ValueError, match="one scalar type"):
        G.manifest_metadata({**manifest(), "eval": {"arms": [1, "a"]}})
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(BadInput, match="not a readable GGUF file"):
        G.load_gguf(tmp_path / "x.gguf")


def test_layer_maps_round_trip_and_a_v1_release_has_none():
    """`layers` [{index, kind, map}] -> ridgefill.layers + layer_kinds + layer_maps, and back exactly; a /1 release's
    layers have no `map`, and its GGUF no layer_maps; mixed shapes and a `layer_maps` fact are refused."""
    m = manifest()
    m["layers"] = [{"index": 9, "kind": "linear_attention", "map": "input"}, {"index": 10, "kind": "full_attention",
                                                                             "map": "kv"}]
    kv = G.manifest_metadata(m)
    assert kv["ridgefill.layer_maps"] == ("array:str", ["input", "kv"])
    assert kv["ridgefill.layer_kinds"] == ("array:str", ["linear_attention", "full_attention"])
    assert G.metadata_manifest({k: v for k, (_, v) in kv.items()})["layers"] == m["layers"]
    for x in m["layers"]:
        x.pop("map")
    kv = G.manifest_metadata(m)
    assert "ridgefill.layer_maps" not in kv
    assert G.metadata_manifest({k: v for k, (_, v) in kv.items()})["layers"] == m["layers"]
    m["layers"][0]["map"] = "input"  # one with a map, one without
    with pytest.raises(ValueError, match="must be a list of"):
        G.manifest_metadata(m)
    with pytest.raises(ValueError, match="reserved"):
        G.manifest_metadata({**manifest(), "layer_maps": ["kv"]})


def test_a_v1_layout_gguf_still_loads(tmp_path, int8_release, monkeypatch):
    """A file written before layout 2 (`ridgefill-maps-gguf/1`, a /1 release's facts: no map kinds) loads; another
    layout is refused."""
    manifest_, maps = release.load_release(int8_release)
    old = {**manifest_, "format": release.FORMAT_V1, "layers": [{"index": x["index"], "kind": x["kind"]}
                                                                for x in manifest_["layers"]]}
    tensors_ = G.encode_tensors(maps)[0]
    for layout, ok in (("ridgefill-maps-gguf/1", True), ("ridgefill-maps-gguf/4", False)):
        monkeypatch.setattr(G, "LAYOUT", layout)  # what the writer of that layout wrote
        G.write_gguf(tmp_path / "old.gguf", old, tensors_)
        monkeypatch.undo()
        if ok:
            facts, got = G.load_gguf(tmp_path / "old.gguf")
            assert facts["layers"] == old["layers"] and sorted(got) == list(REL)
        else:
            with pytest.raises(BadInput, match="not a ridgefill maps GGUF"):
                G.load_gguf(tmp_path / "old.gguf")


def test_gguf_module_is_lazy():
    code = "import sys, ridgefill.export.gguf; print(sorted(m for m in ('gguf', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------- CLI, store


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("store") / "store"
    return root, fake_chain(root)


def test_cli_exports_a_quantize_artifact_as_gguf(chain, tmp_path):
    root, ids = chain
    out = tmp_path / "sub" / "maps.gguf"
    r = cli("export", ids["quantize"], "--format", "gguf", "--out", out, "--store", root, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["stage"] == "export" and doc["format"] == "gguf" and doc["out"] == str(out)
    assert doc["summary"]["tensors"] == 2 * len(LAYERS) and doc["summary"]["files"] == ["maps.gguf"]
    art = Path(doc["path"])
    assert out.read_bytes() == (art / "maps.gguf").read_bytes()
    assert sorted(p.name for p in art.iterdir()) == ["artifact.json", "maps.gguf"]
    rec = json.loads((art / "artifact.json").read_text())["recipe"]
    rel_id = rec["source"].split("/")[1]
    assert rec == {"stage": "export", "version": 4, "format": "gguf", "source": f"export/{rel_id}"}
    assert doc["summary"]["bias_correction"] is True

    # the GGUF's facts are the release's manifest (its maps: see test_store_gguf_is_one_rounding_of_the_float_maps)
    rel = tmp_path / "rel"
    assert cli("export", ids["quantize"], "--out", rel, "--store", root).returncode == 0  # the default format
    assert (root / "export" / rel_id / "ridgefill.json").read_bytes() == (rel / "ridgefill.json").read_bytes()
    want, _ = release.load_release(rel)
    facts, got = G.load_gguf(out)
    assert facts == no_nulls(want) and sorted(got) == list(LAYERS)
    assert G.load_gguf_extras(out) == (None, None)  # a hand-built solve: no protected-token table
    from gguf import GGUFReader

    fields = GGUFReader(out).fields
    assert fields["ridgefill.gguf.source_artifact"].contents() == f"quantize/{ids['quantize']}"
    assert fields["ridgefill.gguf.release_artifact"].contents() == f"export/{rel_id}"
    assert fields["ridgefill.gguf.float_maps_artifact"].contents() == f"solve/{ids['solve']}"

    # again: a cache hit, and the identical file is left alone
    mtime = out.stat().st_mtime_ns
    r = cli("export", ids["quantize"], "--format", "gguf", "--out", out, "--store", root, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cached"] is True
    assert "left alone" in r.stderr and out.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("stage", ["quantize", "solve"])
def test_store_gguf_is_one_rounding_of_the_float_maps(chain, tmp_path, stage):
    """From the store the Q8_0 weights are the float maps rounded once (bit-exact against the brute-force Q8_0 of
    the solve's float weights, not of the int8 maps), and the bias takes the rounding error along the calibration
    mean: at the mean, the GGUF's maps give the float maps' output. The old path (the int8 release decoded and
    rounded again, the int8 bias kept) is computed alongside: its error is larger, and at the mean it is off."""
    root, ids = chain
    out = tmp_path / "m.gguf"
    r = cli("export", ids[stage], "--format", "gguf", "--out", out, "--store", root, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)["summary"]
    _, got = G.load_gguf(out)
    from gguf import GGUFReader

    blocks = {t.name: np.asarray(t.data) for t in GGUFReader(out).tensors}
    mean = calibration_mean()
    fm = float_maps()
    from ridgefill.quantize.artifact import load_quant

    int8_maps_ = {l: (int8.dequantize(q["codes"], q["scale_bits"]), q["bias"])  # as the old path decoded them
                  for l, q in load_quant(Store(root).get(ids["quantize"])).items()}
    worst_new = worst_old = 0.0
    for layer in LAYERS:
        w = fm[layer]["weight"].astype(np.float64)
        b = fm[layer]["bias"].astype(np.float64)
        assert blocks[G.tensor_name(layer, "weight")].tobytes() == q8_0_reference(fm[layer]["weight"])
        wq, bq = got[layer]["weight"].astype(np.float64), got[layer]["bias"].astype(np.float64)
        err = np.abs(wq - w)
        assert (err <= q8_0_bound(fm[layer]["weight"])).all()  # one rounding
        assert np.array_equal(got[layer]["bias"], (b + (w - wq) @ mean).astype(np.float32))
        scale = np.abs(w) @ np.abs(mean) + np.abs(b)  # [d_out]: the size of the terms summed at the mean
        assert (np.abs((wq @ mean + bq) - (w @ mean + b)) <= 1e-6 * scale).all()
        worst_new = max(worst_new, err.max() / np.abs(w).max())
        # the old path: from a quantize artifact, Q8_0 of the decoded int8 weights with the int8 release's
        # (int8-corrected, bf16) bias; from a solve artifact, Q8_0 of the float weights with the bias unchanged
        if stage == "quantize":
            old_w = G.dequantize_q8_0(G.q8_0(layer, int8_maps_[layer][0])).astype(np.float64)
            old_b = int8_maps_[layer][1].astype(np.float64)
        else:
            old_w, old_b = wq, b
        worst_old = max(worst_old, np.abs(old_w - w).max() / np.abs(w).max())
        assert np.abs((old_w @ mean + old_b) - (w @ mean + b)).max() > 1e3 * (1e-6 * scale).max()
    assert summary["q8_0_max_rel_error_worst"] == pytest.approx(worst_new)
    assert worst_new < worst_old if stage == "quantize" else worst_new == worst_old


def test_byte_identical_in_a_fresh_store(chain, tmp_path):
    root, ids = chain
    other = tmp_path / "store2"
    ids2 = fake_chain(other)
    assert ids2 == ids  # same recipes, same ids
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert cli("export", ids["quantize"], "--format", "gguf", "--out", a, "--store", root).returncode == 0
    assert cli("export", ids["quantize"], "--format", "gguf", "--out", b, "--store", other).returncode == 0
    assert a.read_bytes() == b.read_bytes()


def test_cli_exports_a_release_folder(tmp_path, int8_release):
    out = tmp_path / "m.gguf"
    r = cli("export", int8_release, "--format", "gguf", "--out", out, "--store", tmp_path / "st", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert json.loads((Path(doc["path"]) / "artifact.json").read_text())["recipe"]["source"].startswith("release:")
    facts, _ = G.load_gguf(out)
    assert facts == no_nulls(release.verify_release(int8_release))


def test_overwrite_policy(chain, tmp_path):
    root, ids = chain
    out = tmp_path / "m.gguf"
    base = ("export", ids["quantize"], "--format", "gguf", "--out", out, "--store", root)
    other = tmp_path / "other.gguf"
    G.write_gguf(other, manifest(), G.encode_tensors({9: float_maps()[9]})[0])
    out.write_bytes(other.read_bytes())
    msg = one_line_error(cli(*base))
    assert "holds a different GGUF file; pass --force" in msg
    assert out.read_bytes() == other.read_bytes()
    assert cli(*base, "--force").returncode == 0
    assert out.read_bytes() != other.read_bytes()
    G.load_gguf(out)

    precious = tmp_path / "notes.gguf"
    precious.write_text("not a gguf")
    msg = one_line_error(cli("export", ids["quantize"], "--format", "gguf", "--out", precious, "--force",
                             "--store", root))
    assert "is not a GGUF file; refusing to replace it" in msg and precious.read_text() == "not a gguf"
    (tmp_path / "dir.gguf").mkdir()
    assert "not a regular file" in one_line_error(cli(*base[:4], "--out", tmp_path / "dir.gguf", "--store", root))
    assert "names the .gguf file" in one_line_error(cli(*base[:4], "--out", tmp_path / "m.bin", "--store", root))


def test_refusals_exit_2_with_one_line(chain, tmp_path):
    root, ids = chain
    msg = one_line_error(cli("export", ids["quantize"], "--format", "onnx", "--out", tmp_path / "x", "--store", root))
    assert msg == "Error: --format 'onnx' is not one of: release, gguf"

    # d_in = 100: refused before anything is written, from a release folder and from the store
    rel = write_release(tmp_path / "rel100", "f32", d_in=100)
    st = tmp_path / "st"
    msg = one_line_error(cli("export", rel, "--format", "gguf", "--out", tmp_path / "a.gguf", "--store", st))
    assert msg.startswith("Error: layer 9: d_in = 100 is not a multiple of 32")
    ids100 = fake_chain(st, d_in=100)
    for stage in ("quantize", "solve"):
        msg = one_line_error(cli("export", ids100[stage], "--format", "gguf", "--out", tmp_path / "a.gguf",
                                 "--store", st))
        assert "d_in = 100 is not a multiple of 32" in msg
    assert not (tmp_path / "a.gguf").exists() and not (st / "export").exists()

    msg = one_line_error(cli("export", ids["capture"], "--format", "gguf", "--store", root))
    assert "is a capture artifact" in msg
