"""Release folder `ridgefill-maps/1` (DESIGN.md §5): bytes, round trips, refusals by message, model card."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ridgefill.errors import BadInput
from ridgefill.export import card as card_mod
from ridgefill.export import int8, release
from ridgefill.export.release import CARD, FORMAT, MANIFEST, MAPS_FILE

LAYERS = (2, 12, 13)  # "layer.12" sorts before "layer.2": name order is not numeric order
D = 300  # ragged last group


def make_manifest() -> dict:
    return {
        "model": {
            "name": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "revision": "12fd25f",
            "architecture": "llama",
            "num_layers": 30,
            "hidden_size": 576,
            "fingerprint": "0123456789abcdef",
        },
        "split": 12,
        "tail_default": 512,
        "layers": [{"index": i, "kind": "attention"} for i in LAYERS],
        "fit": {"alpha": 1e-4, "lambda": 0.0123456, "rows": 98304, "documents": 211},
        "heldout": {
            "fitted": {"k_cosine": 0.96512, "v_cosine": 0.80934, "input_cosine": 0.9321},
            "identity": {"k_cosine": 0.85701, "v_cosine": 0.57432, "input_cosine": 0.7788},
        },
    }


def float_maps(seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        layer: {
            "weight": (rng.standard_normal((D, D)) * 0.05).astype(np.float32),
            "bias": rng.standard_normal(D).astype(np.float32),
        }
        for layer in LAYERS
    }


def quant_maps(seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    out = {}
    for layer, m in float_maps(seed).items():
        codes, bits = int8.quantize(m["weight"])
        out[layer] = {"codes": codes, "scale_bits": bits, "bias": m["bias"]}
    return out


def shuffled(d: dict, seed: int) -> dict:
    items = list(d.items())
    random.Random(seed).shuffle(items)
    return {k: shuffled(v, seed + 1) if isinstance(v, dict) else v for k, v in items}


def write(path: Path, maps=None, manifest=None, **kw) -> dict:
    manifest = make_manifest() if manifest is None else manifest
    return release.write_release(path, quant_maps() if maps is None else maps, manifest, "# card\n", **kw)


@pytest.fixture
def rel(tmp_path) -> Path:
    out = tmp_path / "rel"
    write(out)
    return out


def edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / MANIFEST).read_text())
    fn(m)
    (d / MANIFEST).write_text(json.dumps(m))


def refused(d: Path, match: str, fn=release.verify_release) -> str:
    with pytest.raises(BadInput, match=match) as e:
        fn(d)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    return msg


# -------------------------------------------------------------------------------------------- writing


@pytest.mark.parametrize("kind", ["int8", "bf16", "f32"])
def test_same_maps_give_identical_bytes_regardless_of_dict_order(tmp_path, kind):
    maps = quant_maps() if kind == "int8" else float_maps()
    dtype = None if kind == "int8" else kind
    write(tmp_path / "a", maps, weight_dtype=dtype)
    write(tmp_path / "b", shuffled(maps, 1), shuffled(make_manifest(), 2), weight_dtype=dtype)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted([CARD, MANIFEST, MAPS_FILE])
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_tensor_file_is_what_safetensors_itself_writes(rel):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save

    tensors, bf16 = {}, torch.bfloat16
    for layer, m in quant_maps().items():
        tensors[f"layer.{layer}.codes"] = torch.from_numpy(m["codes"])
        tensors[f"layer.{layer}.scales"] = torch.from_numpy(m["scale_bits"].view(np.int16)).view(bf16)
        tensors[f"layer.{layer}.bias"] = torch.from_numpy(m["bias"]).to(bf16)
    data = (rel / MAPS_FILE).read_bytes()
    assert data == save(tensors, metadata={"format": FORMAT})
    header_len = int.from_bytes(data[:8], "little")
    assert header_len % 8 == 0
    with safe_open(str(rel / MAPS_FILE), framework="pt") as f:
        assert f.metadata() == {"format": FORMAT}
        assert f.get_tensor("layer.12.scales").shape == (D, 3)


def test_manifest_contents(rel):
    m = json.loads((rel / MANIFEST).read_text())
    text = (rel / MANIFEST).read_text()
    assert text.endswith("}\n") and text == json.dumps(m, sort_keys=True, indent=2) + "\n"
    assert m["format"] == FORMAT
    assert m["projector"] == {"dtype": "int8", "group_size": 128, "files": [MAPS_FILE]}
    assert set(m["files"]) == {MAPS_FILE}  # README.md (and the manifest itself) never hashed
    assert m["files"][MAPS_FILE] == release.sha256_file(rel / MAPS_FILE)
    assert m["split"] == 12 and m["fit"]["rows"] == 98304
    assert release.verify_release(rel) == m
    assert (rel / CARD).read_text() == "# card\n"


def test_write_returns_the_manifest_written_and_sets_unquantized_projector(tmp_path):
    got = write(tmp_path / "r", float_maps(), weight_dtype="bf16")
    assert got == json.loads((tmp_path / "r" / MANIFEST).read_text())
    assert got["projector"] == {"dtype": "bf16", "group_size": None, "files": [MAPS_FILE]}


def test_existing_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty")  # an empty folder is fine
    release.verify_release(tmp_path / "empty")
    with pytest.raises(BadInput, match="exists and is not empty"):
        write(tmp_path / "empty")
    write(tmp_path / "empty", float_maps(), overwrite=True)
    assert release.verify_release(tmp_path / "empty")["projector"]["dtype"] == "f32"
    other = tmp_path / "home"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    with pytest.raises(BadInput, match="not a ridgefill release; refusing"):
        write(other, overwrite=True)
    assert (other / "precious.txt").read_text() == "x"
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="not a directory"):
        write(tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "home"]  # no temp folders left


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(tmp, out):
        raise OSError("disk full")

    monkeypatch.setattr(release, "move_into_place", boom)
    with pytest.raises(OSError):
        write(tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


def test_malformed_maps_are_refused_before_writing(tmp_path):
    maps = quant_maps()
    maps[2]["bias"] = maps[2]["bias"][:10]
    with pytest.raises(ValueError, match="bias has shape"):
        write(tmp_path / "r", maps)
    mixed = {**quant_maps(), 5: float_maps()[2]}
    with pytest.raises(ValueError, match="all the same"):
        write(tmp_path / "r", mixed)
    with pytest.raises(ValueError, match="do not match"):
        write(tmp_path / "r", {2: quant_maps()[2]})  # manifest lists 2, 12, 13
    with pytest.raises(ValueError, match="weight_dtype"):
        write(tmp_path / "r", float_maps(), weight_dtype="f16")
    m = make_manifest()
    m["fit"]["alpha"] = float("nan")
    with pytest.raises(ValueError, match="plain JSON"):
        write(tmp_path / "r", manifest=m)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------------------------------- loading


def test_round_trip_quantized_is_exact(rel):
    manifest, maps = release.load_release(rel)
    assert manifest["projector"]["dtype"] == "int8"
    assert sorted(maps) == list(LAYERS)
    for layer, m in quant_maps().items():
        assert maps[layer]["weight"].dtype == np.float32
        assert np.array_equal(maps[layer]["weight"], int8.dequantize(m["codes"], m["scale_bits"]))
        assert np.array_equal(maps[layer]["bias"], int8.bf16_bits_to_f32(int8.f32_to_bf16_bits(m["bias"])))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_round_trip_unquantized_is_exact(tmp_path, dtype):
    write(tmp_path / "r", float_maps(), weight_dtype=dtype)
    _, maps = release.load_release(tmp_path / "r")
    for layer, m in float_maps().items():
        for key in ("weight", "bias"):
            want = m[key] if dtype == "f32" else int8.bf16_bits_to_f32(int8.f32_to_bf16_bits(m[key]))
            assert maps[layer][key].dtype == np.float32
            assert np.array_equal(maps[layer][key], want), (layer, key)


# ------------------------------------------------------------------------------------------- refusals


def test_missing_manifest(rel):
    (rel / MANIFEST).unlink()
    msg = refused(rel, "ridgefill.json: missing")
    assert str(rel) in msg
    refused(rel.parent / "nope", "not a directory")


def test_invalid_json(rel):
    (rel / MANIFEST).write_text('{"format": "ridgefill-maps/1",')
    refused(rel, r"^ridgefill.json: invalid JSON \(.* line 1 column")
    (rel / MANIFEST).write_text("[1, 2]")
    refused(rel, "^ridgefill.json: invalid manifest")


def test_wrong_format(rel):
    edit_manifest(rel, lambda m: m.update(format="ridgefill-maps/2"))
    refused(rel, r"^ridgefill.json: format is 'ridgefill-maps/2', expected 'ridgefill-maps/1'$")
    edit_manifest(rel, lambda m: m.pop("format"))
    refused(rel, "format is None")


@pytest.mark.parametrize("name", ["../x", "a/b", "/etc/passwd", ".", "..", "", "a\\b", "..\\x", "C:x"])
def test_file_names_must_be_bare(rel, name):
    edit_manifest(rel, lambda m: m["files"].update({name: "0" * 64}))
    msg = refused(rel, "is not a bare file name inside the release folder")
    assert repr(name) in msg


@pytest.mark.parametrize("name", [CARD, MANIFEST])
def test_documentation_and_manifest_cannot_be_listed(rel, name):
    edit_manifest(rel, lambda m: m["files"].update({name: "0" * 64}))
    refused(rel, f"files entry '{name}' must not be listed")


def test_bad_sha256_value(rel):
    edit_manifest(rel, lambda m: m["files"].update({MAPS_FILE: "ABC"}))
    refused(rel, "'maps.safetensors' has no valid sha256")


def test_listed_file_missing(rel):
    (rel / MAPS_FILE).unlink()
    refused(rel, "^maps.safetensors: listed in ridgefill.json but missing from ")


def test_sha256_mismatch_names_the_file(rel):
    want = json.loads((rel / MANIFEST).read_text())["files"][MAPS_FILE]
    data = bytearray((rel / MAPS_FILE).read_bytes())
    data[-1] ^= 1
    (rel / MAPS_FILE).write_bytes(bytes(data))
    got = release.sha256_file(rel / MAPS_FILE)
    msg = refused(rel, "^maps.safetensors: sha256 mismatch")
    assert msg == f"maps.safetensors: sha256 mismatch (expected {want}, got {got})"
    refused(rel, "sha256 mismatch", fn=release.load_release)


@pytest.mark.parametrize("extra", ["notes.txt", ".gitattributes", "maps.safetensors.bak"])
def test_unlisted_file_is_refused(rel, extra):
    (rel / extra).write_text("x")
    msg = refused(rel, "in the release folder but not listed in ridgefill.json")
    assert msg.startswith(f"{extra}: ")


def test_unlisted_subfolder_is_refused(rel):
    (rel / ".cache").mkdir()
    refused(rel, r"^\.cache: in the release folder but not listed")


def test_projector_file_must_be_listed(rel):
    edit_manifest(rel, lambda m: m["projector"].update(files=[MAPS_FILE, "more.safetensors"]))
    refused(rel, "projector file 'more.safetensors' is not listed in 'files'")


def test_readme_is_not_hashed(rel):
    (rel / CARD).write_text("---\nlicense: mit\n---\nrewritten by the Hub\n")
    release.verify_release(rel)
    release.load_release(rel)
    (rel / CARD).unlink()
    release.verify_release(rel)


def _replace_maps(rel: Path, data: bytes) -> None:
    (rel / MAPS_FILE).write_bytes(data)
    edit_manifest(rel, lambda m: m["files"].update({MAPS_FILE: release.sha256_file(rel / MAPS_FILE)}))


def test_load_refuses_a_file_that_is_not_safetensors(rel):
    _replace_maps(rel, b"not a tensor file at all")
    release.verify_release(rel)  # the hash matches: only the loader can tell
    refused(rel, "^maps.safetensors: not a readable safetensors file", fn=release.load_release)


def test_load_refuses_unexpected_and_missing_tensors(rel):
    tensors = {f"layer.{i}.{k}": v for i, m in quant_maps().items() for k, v in m.items() if k != "scale_bits"}
    st = {n: ("I8" if a.dtype == np.int8 else "F32", a) for n, a in tensors.items()}
    _replace_maps(rel, release._encode_safetensors(st, {}))
    refused(rel, r"^maps.safetensors: tensor 'layer.2.scales' is missing", fn=release.load_release)
    st["extra"] = ("F32", np.zeros(3, np.float32))
    _replace_maps(rel, release._encode_safetensors(st, {}))
    refused(rel, "^maps.safetensors: unexpected tensor 'extra'", fn=release.load_release)


def test_load_refuses_layers_that_do_not_match_the_manifest(rel):
    edit_manifest(rel, lambda m: m["layers"].append({"index": 14, "kind": "attention"}))
    refused(rel, r"layers \[2, 12, 13, 14\] do not match", fn=release.load_release)


def test_release_module_does_not_import_torch():
    code = "import sys, ridgefill.export.release, ridgefill.export.card; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------- card


def front_matter(text: str) -> dict:
    """Tiny YAML subset: `key: value` lines and `- item` lists under a `key:` line."""
    lines = text.split("\n")
    assert lines[0] == "---"
    end = lines.index("---", 1)
    out, key = {}, None
    for line in lines[1:end]:
        if line.startswith("- "):
            out[key].append(line[2:])
        else:
            key, _, value = line.partition(": ")
            key = key.rstrip(":")
            out[key] = json.loads(value) if value.startswith('"') else (value or [])
    return out


def test_model_card(rel):
    manifest = release.verify_release(rel)
    text = card_mod.model_card(manifest)
    fm = front_matter(text)
    assert fm == {
        "library_name": "ridgefill",
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": "apache-2.0",
        "tags": ["ridgefill", "kv-cache", "prefill"],
    }
    for s in ("Split layer: 12", "512 tokens", "Maps: 3 (layers 2–13)", "int8, groups of 128",
              "alpha 0.0001", "lambda 0.01235", "rows 98304", "documents 211",
              "| K cosine | 0.9651 | 0.8570 |", "| V cosine | 0.8093 | 0.5743 |",
              "| input cosine | 0.9321 | 0.7788 |", "ridgefill verify DIR", FORMAT):
        assert s in text, s
    assert "Evaluation" not in text
    assert card_mod.model_card(shuffled(manifest, 3)) == text  # deterministic, order-free


def test_model_card_eval_license_and_local_model_names():
    m = make_manifest()
    m["model"]["name"] = "SmolLM2-135M-Instruct.Q4_1.gguf"
    m["model"]["revision"] = None
    m["license"] = "mit"
    m["eval"] = {"gate": {"passed": True}, "needle": {"fitted": 0.4, "identity": 0.0}}
    m["heldout"].update(rows=4096, float_score=0.88712, int8_score=0.88654)
    m["heldout"]["fitted"]["rel_se"] = 0.1234
    text = card_mod.model_card(m)
    assert "(4096 rows)" in text and "float maps 0.8871" in text and "int8 maps 0.8865" in text
    assert "| relative squared error | 0.1234 | – |" in text
    fm = front_matter(text)
    assert "base_model" not in fm  # not a Hub id: the Hub would reject it as metadata
    assert fm["license"] == "mit"
    assert "- gate.passed: True" in text and "- needle.fitted: 0.4" in text
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in text
    assert "(architecture `llama`)" in text and "None" not in text
