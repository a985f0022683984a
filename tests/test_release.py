"""Release folder `ridgefill-maps/2` (and `/1`, still read; docs/format.md): bytes, round trips, the facts maps.safetensors records,
refusals by message, folders as `hf download` leaves them, export from a store (group size, atomic replace),
model card. Every test builds what it needs in its own tmp_path: none reads another test's files."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.export import card as card_mod
from ridgefill.export.config import ExportConfig
from ridgefill.formats import int8, release, safetensors
from ridgefill.formats.release import CARD, FORMAT, MANIFEST, MAPS_FILE
from conftest import quiet

LAYERS = (9, 10, 11)  # "layer.10" sorts before "layer.9": name order is not numeric order
D = 300  # the hidden size; a ragged last group
KV_HEADS, HEAD_DIM = 2, 25  # a kv map is [2 * 2 * 25, 300] = [100, 300]


def make_manifest() -> dict:
    return {
        "model": {
            "name": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "revision": "12fd25f",
            "architecture": "llama",
            "num_layers": 12,
            "hidden_size": D,
            "num_kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "fingerprint": "0123456789abcdef",
        },
        "split": 9,
        "tail_default": 512,
        "layers": [{"index": i, "kind": "attention", "map": "input"} for i in LAYERS],
        "fit": {"alpha": 1e-4, "lambda": 0.0123456, "rows": 98304, "documents": 211, "exact_norm": 812.5,
                "skip_first_rows": 1},
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
    manifest = json.loads((rel / MANIFEST).read_text())
    facts = {k: v for k, v in manifest.items() if k != "files"}
    metadata = {"format": FORMAT, "ridgefill.facts": json.dumps(facts, sort_keys=True, separators=(",", ":"))}
    data = (rel / MAPS_FILE).read_bytes()
    lib = save(tensors, metadata=metadata)  # the library orders __metadata__ by a hash map: any order
    header_len = int.from_bytes(data[:8], "little")
    assert header_len % 8 == 0 and data[:8] == lib[:8] and data[8 + header_len:] == lib[8 + header_len:]
    header = json.loads(lib[8:8 + header_len])  # the library's header with its metadata sorted: ours, byte for byte
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    assert data[8:8 + header_len] == text + b" " * (header_len - len(text))
    with safe_open(str(rel / MAPS_FILE), framework="pt") as f:
        assert f.metadata() == metadata
        assert f.get_tensor("layer.10.scales").shape == (D, 3)
    assert safetensors.read_header(rel / MAPS_FILE)[1] == metadata


def test_manifest_contents(rel):
    m = json.loads((rel / MANIFEST).read_text())
    text = (rel / MANIFEST).read_text()
    assert text.endswith("}\n") and text == json.dumps(m, sort_keys=True, indent=2) + "\n"
    assert m["format"] == FORMAT
    assert m["projector"] == {"dtype": "int8", "group_size": 128, "files": [MAPS_FILE]}
    assert set(m["files"]) == {MAPS_FILE}  # README.md (and the manifest itself) never hashed
    assert m["files"][MAPS_FILE] == sha256_file(rel / MAPS_FILE)
    assert m["split"] == 9 and m["fit"]["rows"] == 98304
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

    from ridgefill.formats.release import folder

    monkeypatch.setattr(folder, "move_into_place", boom)
    with pytest.raises(OSError):
        write(tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


def test_malformed_maps_are_refused_before_writing(tmp_path):
    maps = quant_maps()
    maps[9]["bias"] = maps[9]["bias"][:10]
    with pytest.raises(ValueError, match="bias has shape"):
        write(tmp_path / "r", maps)
    mixed = {**quant_maps(), 5: float_maps()[9]}
    with pytest.raises(ValueError, match="all the same"):
        write(tmp_path / "r", mixed)
    with pytest.raises(ValueError, match="do not match"):
        write(tmp_path / "r", {9: quant_maps()[9]})  # manifest lists 9, 10, 11
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
    (rel / MANIFEST).write_text('{"format": "ridgefill-maps/2",')
    refused(rel, r"^ridgefill.json: invalid JSON \(.* line 1 column")
    (rel / MANIFEST).write_text("[1, 2]")
    refused(rel, "^ridgefill.json: invalid manifest")


def test_wrong_format(rel):
    edit_manifest(rel, lambda m: m.update(format="ridgefill-maps/4"))
    refused(rel, r"^ridgefill.json: format is 'ridgefill-maps/4', expected 'ridgefill-maps/1' or 'ridgefill-maps/2' "
                 r"or 'ridgefill-maps/3'$")
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
    got = sha256_file(rel / MAPS_FILE)
    msg = refused(rel, "^maps.safetensors: sha256 mismatch")
    assert msg == f"maps.safetensors: sha256 mismatch (expected {want}, got {got})"
    refused(rel, "sha256 mismatch", fn=release.load_release)


@pytest.mark.parametrize("extra", ["notes.txt", ".gitignore", ".DS_Store", "maps.safetensors.bak"])
def test_unlisted_file_is_refused(rel, extra):
    (rel / extra).write_text("x")
    msg = refused(rel, "in the release folder but not listed in ridgefill.json")
    assert msg.startswith(f"{extra}: ")


def test_unlisted_subfolder_is_refused(rel):
    (rel / ".cache").mkdir()
    refused(rel, r"^\.cache: in the release folder but not listed")


def test_the_maps_are_one_file_and_every_listed_file_is_named(rel):
    """A second maps file's hash would be in no fact, and a listed file no fact names is not tied to the release."""
    edit_manifest(rel, lambda m: m["projector"].update(files=[MAPS_FILE, "more.safetensors"]))
    refused(rel, r"^ridgefill.json: 'projector.files' is \[\"maps.safetensors\",\"more.safetensors\"\], expected "
                 r"\['maps.safetensors'\] \(the maps are in one file, whose hash covers the facts\)$")
    edit_manifest(rel, lambda m: m["projector"].update(files=[MAPS_FILE]))
    release.verify_release(rel)
    (rel / "notes.txt").write_text("x")
    edit_manifest(rel, lambda m: m["files"].update({"notes.txt": sha256_file(rel / "notes.txt")}))
    refused(rel, "^ridgefill.json: 'files' lists 'notes.txt', which no field of the manifest names")


def test_readme_is_not_hashed(rel):
    (rel / CARD).write_text("---\nlicense: mit\n---\nrewritten by the Hub\n")
    release.verify_release(rel)
    release.load_release(rel)
    (rel / CARD).unlink()
    release.verify_release(rel)


def _encode(tensors: dict, metadata: dict) -> bytes:
    """{name: (safetensors dtype, array)} as a safetensors file's bytes (bf16 given as uint16 bit patterns)."""
    return safetensors.encode({n: safetensors.BF16(a) if dt == "BF16" else a for n, (dt, a) in tensors.items()},
                              metadata)


def _replace_maps(rel: Path, data: bytes) -> None:
    (rel / MAPS_FILE).write_bytes(data)
    edit_manifest(rel, lambda m: m["files"].update({MAPS_FILE: sha256_file(rel / MAPS_FILE)}))


def _facts(rel: Path, edit=lambda m: None) -> dict:
    """maps.safetensors metadata recording the folder's manifest (edited by `edit`) as its facts."""
    m = json.loads((rel / MANIFEST).read_text())
    edit(m)
    return {"format": FORMAT, "ridgefill.facts": release.facts_json(m)}


@pytest.mark.parametrize("data", [b"not a tensor file at all", b"\xff" * 8 + b"{}", (2).to_bytes(8, "little") + b"[]",
                                  (1).to_bytes(8, "little") + b"{", b"\0\0"],
                         ids=["text", "huge-header", "not-an-object", "not-json", "short"])
def test_verify_refuses_a_file_that_is_not_safetensors(rel, data):
    _replace_maps(rel, data)  # the hash matches; the header that records the facts cannot be read
    refused(rel, "^maps.safetensors: not a readable safetensors file")
    refused(rel, "^maps.safetensors: not a readable safetensors file", fn=release.load_release)


def test_load_refuses_unexpected_and_missing_tensors(rel):
    tensors = {f"layer.{i}.{k}": v for i, m in quant_maps().items() for k, v in m.items() if k != "scale_bits"}
    st = {n: ("I8" if a.dtype == np.int8 else "F32", a) for n, a in tensors.items()}
    _replace_maps(rel, _encode(st, _facts(rel)))
    # hash and facts hold, and still the folder does not verify: it verifies if and only if it loads
    for fn in (release.verify_release, release.load_release):
        refused(rel, r"^maps.safetensors: tensor 'layer.9.scales' is missing", fn=fn)
    st["extra"] = ("F32", np.zeros(3, np.float32))
    _replace_maps(rel, _encode(st, _facts(rel)))
    for fn in (release.verify_release, release.load_release):
        refused(rel, "^maps.safetensors: unexpected tensor 'extra'", fn=fn)


def test_load_refuses_layers_that_do_not_match_the_tensors(rel):
    def more(m):
        m["layers"].append({"index": 12, "kind": "attention", "map": "input"})

    st = {n: ("I8", a) for n, a in ()}  # the same tensors, with facts that list one more layer
    for layer, m in quant_maps().items():
        st[f"layer.{layer}.codes"] = ("I8", m["codes"])
        st[f"layer.{layer}.scales"] = ("BF16", m["scale_bits"])
        st[f"layer.{layer}.bias"] = ("BF16", int8.f32_to_bf16_bits(m["bias"]))
    _replace_maps(rel, _encode(st, _facts(rel, more)))
    edit_manifest(rel, more)
    for fn in (release.verify_release, release.load_release):
        refused(rel, r"^maps.safetensors: the tensors are of layers \[9, 10, 11\], but 'layers' lists \[9, 10, 11, 12\]",
                fn=fn)


# ------------------------------------------------------------------------------------- protected facts

# (field, edit, the refusal's wording after "ridgefill.json: "): every fact a runtime or eval relies on
FACT_EDITS = [
    ("split", lambda m: m.update(split=10), "'split' is 10 but maps.safetensors records 9"),
    ("split-type", lambda m: m.update(split="9"), "'split' is \"9\" but maps.safetensors records 9"),
    ("bool-for-number", lambda m: m.update(tail_default=True), "'tail_default' is true but maps.safetensors records 512"),
    ("tail_default", lambda m: m.update(tail_default=256), "'tail_default' is 256 but maps.safetensors records 512"),
    ("model.name", lambda m: m["model"].update(name="other/Model"),
     "'model.name' is \"other/Model\" but maps.safetensors records \"HuggingFaceTB/SmolLM2-135M-Instruct\""),
    ("model.revision", lambda m: m["model"].update(revision="main"), "'model.revision' is \"main\""),
    ("model.architecture", lambda m: m["model"].update(architecture="qwen2"), "'model.architecture' is \"qwen2\""),
    ("model.num_layers", lambda m: m["model"].update(num_layers=31), "'model.num_layers' is 31"),
    ("model.hidden_size", lambda m: m["model"].update(hidden_size=577), "'model.hidden_size' is 577"),
    ("model.num_kv_heads", lambda m: m["model"].update(num_kv_heads=4), "'model.num_kv_heads' is 4"),
    ("model.head_dim", lambda m: m["model"].update(head_dim=50), "'model.head_dim' is 50"),
    ("model.fingerprint", lambda m: m["model"].update(fingerprint="f" * 16),
     f"'model.fingerprint' is \"{'f' * 16}\" but maps.safetensors records \"0123456789abcdef\""),
    ("layers.kind", lambda m: m["layers"][1].update(kind="sliding_attention"),
     "'layers[1].kind' is \"sliding_attention\" but maps.safetensors records \"attention\""),
    ("layers.index", lambda m: m["layers"][0].update(index=3), "'layers[0].index' is 3 but maps.safetensors records 9"),
    ("layers.map", lambda m: m["layers"][2].update(map="kv"),
     "'layers[2].map' is \"kv\" but maps.safetensors records \"input\""),
    ("layers.dropped", lambda m: m["layers"].pop(), "'layers' is [{"),
    ("projector.dtype", lambda m: m["projector"].update(dtype="bf16"), "'projector.dtype' is \"bf16\""),
    ("projector.group_size", lambda m: m["projector"].update(group_size=64),
     "'projector.group_size' is 64 but maps.safetensors records 128"),
    ("fit.alpha", lambda m: m["fit"].update(alpha=0.1), "'fit.alpha' is 0.1 but maps.safetensors records 0.0001"),
    ("heldout", lambda m: m["heldout"]["fitted"].update(k_cosine=0.99), "'heldout.fitted.k_cosine' is 0.99"),
    ("removed", lambda m: m.pop("tail_default"), "'tail_default' is missing but maps.safetensors records 512"),
    ("added", lambda m: m.update(license="mit"), "'license' is \"mit\" but maps.safetensors records no such field"),
    ("added-model", lambda m: m["model"].update(trust_remote_code=True), "'model.trust_remote_code' is true"),
]


@pytest.mark.parametrize("edit, wording", [e[1:] for e in FACT_EDITS], ids=[e[0] for e in FACT_EDITS])
def test_an_edited_fact_is_refused_by_name(tmp_path, edit, wording):
    d = tmp_path / "rel"
    write(d)
    edit_manifest(d, edit)
    msg = refused(d, "^ridgefill.json: ")
    assert msg.startswith(f"ridgefill.json: {wording}"), msg
    assert msg.endswith(" (the manifest was edited)")
    refused(d, "the manifest was edited", fn=release.load_release)


def test_eval_and_files_are_the_only_unhashed_fields(rel):
    assert release.NOT_FACTS == {"files", "eval"}
    edit_manifest(rel, lambda m: m.update(eval={"gate": {"passed": True}}))
    assert release.verify_release(rel)["eval"] == {"gate": {"passed": True}}
    release.load_release(rel)
    m = release.write_eval(rel, {"arms": {"ridgefill": {"kl": 0.1}}}, card_mod.model_card)
    assert release.verify_release(rel) == m and m["eval"] == {"arms": {"ridgefill": {"kl": 0.1}}}


def test_a_release_without_recorded_facts_is_refused(rel):
    tensors = {n: ("BF16" if isinstance(a, np.ndarray) and a.dtype == np.uint16 else None, a) for n, a in ()}
    for layer, m in quant_maps().items():
        tensors[f"layer.{layer}.codes"] = ("I8", m["codes"])
        tensors[f"layer.{layer}.scales"] = ("BF16", m["scale_bits"])
        tensors[f"layer.{layer}.bias"] = ("BF16", int8.f32_to_bf16_bits(m["bias"]))
    _replace_maps(rel, _encode(tensors, {"format": FORMAT}))  # as releases were written before
    msg = refused(rel, "^maps.safetensors: records no release facts")
    assert "export the release again" in msg
    _replace_maps(rel, _encode(tensors, {"format": FORMAT, "ridgefill.facts": "[1]"}))
    refused(rel, "^maps.safetensors: 'ridgefill.facts' metadata is not a JSON object")


def _quant_tensors() -> dict:
    """quant_maps() as {name: (safetensors dtype, array)}, what `write` puts in maps.safetensors."""
    tensors = {}
    for layer, m in quant_maps().items():
        tensors[f"layer.{layer}.codes"] = ("I8", m["codes"])
        tensors[f"layer.{layer}.scales"] = ("BF16", m["scale_bits"])
        tensors[f"layer.{layer}.bias"] = ("BF16", int8.f32_to_bf16_bits(m["bias"]))
    return tensors


@pytest.mark.parametrize("fit, shown", [({}, "missing"), ({"exact_norm": 0}, "0"), ({"exact_norm": -2.5}, "-2.5"),
                                        ({"exact_norm": True}, "true"), ({"exact_norm": "812.5"}, '"812.5"'),
                                        ({"exact_norm": None}, "null")],
                         ids=["missing", "zero", "negative", "bool", "string", "null"])
def test_the_exact_row_norm_is_required(rel, tmp_path, fit, shown):
    """`fit.exact_norm`, the split-state norm above which a runtime runs a prefix row exactly, is a positive number in
    every release: the writer never writes a release without one, and the reader refuses one (a release exported
    before the field existed) in one line, by verify and load alike, even with every hash resealed."""
    def change(m):
        m["fit"].pop("exact_norm")
        m["fit"].update(fit)

    manifest = make_manifest()
    change(manifest)
    with pytest.raises(ValueError, match=re.escape(f"'fit.exact_norm' is {shown}")):
        write(tmp_path / "new", manifest=manifest)
    assert not (tmp_path / "new").exists()
    _replace_maps(rel, _encode(_quant_tensors(), _facts(rel, change)))
    edit_manifest(rel, change)  # the facts and the manifest agree, every hash matches
    for fn in (release.verify_release, release.load_release):
        msg = refused(rel, "^ridgefill.json: 'fit.exact_norm' is ", fn=fn)
        if shown == "missing":
            assert msg == ("ridgefill.json: 'fit.exact_norm' is missing (a release exported before the exact-row norm "
                           "existed: export it again)")
        else:
            assert msg.startswith(f"ridgefill.json: 'fit.exact_norm' is {shown}, expected a positive number")


def test_maps_file_must_be_listed(rel):
    (rel / "more.safetensors").write_bytes((rel / MAPS_FILE).read_bytes())
    (rel / MAPS_FILE).unlink()

    def move(m):
        m["files"] = {"more.safetensors": m["files"].pop(MAPS_FILE)}
        m["projector"]["files"] = ["more.safetensors"]

    edit_manifest(rel, move)
    refused(rel, "^ridgefill.json: 'files' does not list maps.safetensors")


def test_eval_loads_release_facts_only_through_verify(tmp_path):
    """`eval`'s source loader refuses a release whose manifest was edited (it would have trusted the split)."""
    from ridgefill.artifacts import Store
    from ridgefill.evaluate.source import load_source

    d = tmp_path / "rel"
    write(d)
    src = load_source(Store(tmp_path / "store"), str(d))
    assert src.split == 9 and src.fingerprint == "0123456789abcdef"
    edit_manifest(d, lambda m: m.update(split=10))
    with pytest.raises(BadInput, match="^ridgefill.json: 'split' is 10 but maps.safetensors records 9"):
        load_source(Store(tmp_path / "store"), str(d))


def test_gguf_export_refuses_an_edited_release(tmp_path):
    from ridgefill.artifacts import Store
    from ridgefill.export.gguf import export_gguf

    d = tmp_path / "rel"
    rng = np.random.default_rng(0)
    maps = {l: {"weight": rng.standard_normal((64, 64)).astype(np.float32), "bias": np.zeros(64, np.float32)}
            for l in LAYERS}  # d_in = 64: a GGUF could be written from it
    manifest = make_manifest()
    manifest["model"]["hidden_size"] = 64
    release.write_release(d, maps, manifest, "# card\n")
    edit_manifest(d, lambda m: m["model"].update(fingerprint="f" * 16))
    with pytest.raises(BadInput, match="^ridgefill.json: 'model.fingerprint' is"):
        export_gguf(Store(tmp_path / "store"), str(d), ExportConfig(), quiet(), out_path=tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "store" / "export").exists()


# --------------------------------------------------------------------------------- `hf download` folders


def hf_download_leftovers(d: Path) -> None:
    """What `hf download --local-dir d` adds next to the files (huggingface_hub's _local_folder layout)."""
    (d / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    meta = d / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (d / ".cache" / "huggingface" / ".gitignore").write_text("*\n")
    for name in (MANIFEST, MAPS_FILE, CARD):
        (meta / f"{name}.metadata").write_text(f"{'0' * 40}\n{'1' * 64}\n1712656091.123\n")
        (meta / f"{name}.lock").write_text("")


def test_a_folder_as_hf_download_leaves_it_verifies(rel):
    hf_download_leftovers(rel)
    release.verify_release(rel)
    release.load_release(rel)


@pytest.mark.parametrize("damage, named", [
    ("cache-other", ".cache"),  # .cache holds something besides huggingface/
    ("cache-file", ".cache"),  # .cache is a file
    ("hf-file", ".cache"),  # .cache/huggingface is a file
    ("hf-symlink", ".cache"),  # .cache/huggingface is a link
    ("gitattributes-dir", ".gitattributes"),
    ("gitattributes-symlink", ".gitattributes"),
    ("huggingface-top", "huggingface"),
    ("dotfile", ".env"),
])
def test_only_the_hf_download_leftovers_are_accepted(rel, tmp_path, damage, named):
    import shutil

    hf_download_leftovers(rel)
    cache, attrs = rel / ".cache", rel / ".gitattributes"
    if damage == "cache-other":
        (cache / "pip").mkdir()
    elif damage == "cache-file":
        shutil.rmtree(cache)
        cache.write_text("x")
    elif damage in ("hf-file", "hf-symlink"):
        shutil.rmtree(cache / "huggingface")
        (tmp_path / "elsewhere").mkdir()
        if damage == "hf-file":
            (cache / "huggingface").write_text("x")
        else:
            (cache / "huggingface").symlink_to(tmp_path / "elsewhere")
    elif damage == "gitattributes-dir":
        attrs.unlink()
        attrs.mkdir()
    elif damage == "gitattributes-symlink":
        attrs.unlink()
        (tmp_path / "attrs").write_text("x")
        attrs.symlink_to(tmp_path / "attrs")
    elif damage == "huggingface-top":
        (rel / "huggingface").mkdir()
    else:
        (rel / ".env").write_text("x")
    refused(rel, f"^{re.escape(named)}: in the release folder but not listed in ridgefill.json$")


@pytest.mark.parametrize("name", [".gitattributes", ".cache"])
def test_hf_download_leftovers_cannot_be_listed(rel, name):
    edit_manifest(rel, lambda m: m["files"].update({name: "0" * 64}))
    refused(rel, f"files entry '{name}' must not be listed")


# --------------------------------------------------------------------------------- export from a store


def test_export_takes_the_group_size_of_the_quantize_artifact(tmp_path):
    """A quantize artifact made with groups of 64: the release records 64 and decodes with it, and eval's loader
    decodes the artifact with it too (a literal 128 would refuse the scales' shape)."""
    from fakestore import EXACT_NORM, LAYERS as FL, fake_chain, float_maps as fmaps

    from ridgefill.artifacts import Store
    from ridgefill.evaluate.source import load_source
    from ridgefill.export.build import export
    from ridgefill.quantize.artifact import load_quant

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root, group=64)
    q = st.get(ids["quantize"])
    out = tmp_path / "rel"
    export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=out)
    manifest, maps = release.load_release(out)
    assert manifest["projector"]["group_size"] == 64
    assert manifest["fit"]["exact_norm"] == EXACT_NORM  # the solve's exact-row norm, through the quantize artifact
    assert "groups of 64" in (out / CARD).read_text()
    src = load_source(st, ids["quantize"])
    for layer, m in load_quant(q).items():
        want = int8.dequantize(m["codes"], m["scale_bits"], 64)
        assert m["scale_bits"].shape == (fmaps()[layer]["weight"].shape[0], 3)  # ceil(160 / 64)
        assert np.array_equal(maps[layer]["weight"], want) and np.array_equal(src.maps[layer][0], want)
    assert sorted(maps) == list(FL)
    assert src.exact_norm == load_source(st, ids["solve"]).exact_norm == EXACT_NORM


def test_a_solve_without_the_exact_row_norm_is_refused(tmp_path):
    """A solve made before format 5 fixed no exact-row norm: export and eval's loader refuse it (and a quantize
    artifact made from it) in one line, before anything is written."""
    from fakestore import fake_chain

    from ridgefill.artifacts import Store
    from ridgefill.evaluate.source import load_source
    from ridgefill.export.build import export

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root, exact_norm=None)
    wording = rf"^solve {ids['solve']} has no exact-row norm \(made before solve format 5\): solve its capture again$"
    for stage in ("solve", "quantize"):
        with pytest.raises(BadInput, match=wording):
            export(st, ids[stage], ExportConfig(), quiet(), out_dir=tmp_path / "rel")
        with pytest.raises(BadInput, match=wording):
            load_source(st, ids[stage])
    assert not (tmp_path / "rel").exists() and not list((st.root / "export").glob("*"))


def test_group_size_must_agree_between_recipe_and_file(tmp_path):
    from fakestore import fake_chain

    from ridgefill.artifacts import Store
    from ridgefill.formats import safetensors
    from ridgefill.errors import RidgefillError
    from ridgefill.quantize.artifact import QUANT, group_size

    st = Store(tmp_path / "store")
    q = st.get(fake_chain(st.root, group=64)["quantize"])
    arrays, _ = safetensors.load(q.file(QUANT))
    safetensors.save(q.file(QUANT), arrays, {"group_size": "128"})
    with pytest.raises(RidgefillError, match="records group size 128, its recipe 64"):
        group_size(q)


def test_export_replaces_an_old_release_atomically(tmp_path, monkeypatch):
    """--force swaps the new release in through move_into_place: if the final rename fails, the old release is
    still there, whole, and no temporary folder is left behind."""
    import os

    from fakestore import fake_chain

    from ridgefill.artifacts import Store
    from ridgefill.export.build import export

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root)
    out = tmp_path / "out" / "rel"
    write(out)  # an older, different release
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    rename = os.rename

    def failing(src, dst, *a, **kw):
        if Path(dst) == out and ".tmp" in Path(src).name:
            raise OSError("no space left on device")
        return rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="no space left"):
        export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert sorted(p.name for p in out.parent.iterdir()) == ["rel"]
    monkeypatch.setattr(os, "rename", rename)
    export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=out, force=True)
    assert release.verify_release(out)["split"] == 9
    assert sorted(p.name for p in out.parent.iterdir()) == ["rel"]


def test_export_again_after_eval_leaves_the_evaluated_release(tmp_path):
    """`ridgefill eval DIR` records its figures in the release (ridgefill.json's unhashed `eval`, and the card made
    from that manifest): exporting the same artifact into DIR again finds the same release there and leaves it, the
    figures with it. A card or a fact edited otherwise is still a different release, refused without --force."""
    from fakestore import fake_chain

    from ridgefill.artifacts import Store
    from ridgefill.export.build import export

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root)
    out = tmp_path / "rel"
    export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=out)
    release.write_eval(out, {"arms": {"ridgefill": {"kl": 0.1}}}, card_mod.model_card)
    evaluated = {p.name: p.read_bytes() for p in out.iterdir()}
    assert json.loads(evaluated[MANIFEST])["eval"] == {"arms": {"ridgefill": {"kl": 0.1}}}
    assert export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=out)[1:] == (True, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == evaluated
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".rel.")]  # nothing staged beside it

    different = f"^--out {re.escape(str(out))} holds a different release; pass --force to replace it$"
    edits = [lambda: (out / CARD).write_text((out / CARD).read_text() + "my notes\n"),  # a card eval did not write
             lambda: edit_manifest(out, lambda m: m.update(tail_default=64)),  # a fact
             lambda: edit_manifest(out, lambda m: m.update(eval=[1]))]  # an eval the card was not made from
    for edit in edits:
        edit()
        with pytest.raises(BadInput, match=different):
            export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=out)
        for name, data in evaluated.items():
            (out / name).write_bytes(data)


def test_reading_and_writing_a_release_does_not_import_torch(rel):
    """The release format is numpy only: a runtime that loads releases needs nothing of the stages or of torch."""
    code = ("import sys; from ridgefill.formats import release; from ridgefill.export import card; "
            f"m, maps = release.load_release({str(rel)!r}); print(len(maps), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(len(LAYERS)), "False"]


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
    assert front_matter(text)["library_name"] == "ridgefill"  # the Hub metadata: tests/test_card.py
    for s in ("Split layer: 9", "512 tokens", "Maps: 3 (layers 9–11)", "int8, groups of 128",
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


# ------------------------------------------------------------------------- verify if and only if it loads


def with_protected(path: Path, ids=(3, 7, 40)) -> Path:
    write(path, protected=np.array(ids, dtype=np.int32), protected_facts={"share": 0.25, "types": len(ids)})
    return path


def test_extra_tensor_files_are_tied_to_the_release(tmp_path):
    """protected.safetensors (like corrections.safetensors) is named by the facts and its sha256 recorded in them:
    dropping it, or swapping in another release's file with `files` updated, is refused by verify, not only by a
    later load."""
    a, b = with_protected(tmp_path / "a"), with_protected(tmp_path / "b", ids=(5, 6))
    m = json.loads((a / MANIFEST).read_text())
    assert m["protected_tokens"]["sha256"] == m["files"]["protected.safetensors"] == sha256_file(a / "protected.safetensors")
    assert release.read_release(a).protected.tolist() == [3, 7, 40]
    (a / "protected.safetensors").write_bytes((b / "protected.safetensors").read_bytes())
    edit_manifest(a, lambda m: m["files"].update({"protected.safetensors": sha256_file(a / "protected.safetensors")}))
    for fn in (release.verify_release, release.load_release):
        refused(a, r"^protected.safetensors: its sha256 is not the one the facts record \('protected_tokens.sha256' "
                   r"is '[0-9a-f]{64}'\): the file does not belong to this release$", fn=fn)
    (a / "protected.safetensors").unlink()
    edit_manifest(a, lambda m: m["files"].pop("protected.safetensors"))
    refused(a, r"^ridgefill.json: 'protected.safetensors' is named by the manifest but not listed in 'files'$")


def test_numbers_in_the_facts_are_compared_by_value(rel):
    """20 and 20.0 are one JSON number (a JavaScript reader cannot tell them apart); a string or a boolean is not."""
    edit_manifest(rel, lambda m: m.update(split=9.0, fit={**m["fit"], "alpha": 0.00010}))
    assert release.verify_release(rel)["split"] == 9.0
    assert release.read_release(rel).split == 9 and type(release.read_release(rel).split) is int


@pytest.mark.parametrize("text, message", [
    ('{"format": "ridgefill-maps/1", "split": 12, "split": 13}',
     r"^ridgefill.json: invalid JSON \(the key 'split' appears twice in one object\)$"),
    ('{"format": "ridgefill-maps/1", "eval": {"x": NaN}}', r"^ridgefill.json: invalid JSON \(NaN is not JSON\)$"),
    ('{"format": "ridgefill-maps/1", "eval": {"x": -Infinity}}',
     r"^ridgefill.json: invalid JSON \(-Infinity is not JSON\)$"),
])
def test_manifest_json_is_strict(rel, text, message):
    (rel / MANIFEST).write_text(text)
    refused(rel, message)


@pytest.mark.parametrize("name", [MAPS_FILE, CARD])
def test_symbolic_links_are_refused(rel, tmp_path, name):
    real = tmp_path / f"real-{name}"
    (rel / name).rename(real)
    (rel / name).symlink_to(real)
    refused(rel, f"^{name}: a symbolic link \\(a release holds regular files only\\)$")


def test_the_tensor_files_format_is_checked(rel):
    """maps.safetensors' `format` metadata is the release's format: another value is refused even when the facts
    and every hash hold."""
    st = {}
    for layer, m in quant_maps().items():
        st[f"layer.{layer}.codes"] = ("I8", m["codes"])
        st[f"layer.{layer}.scales"] = ("BF16", m["scale_bits"])
        st[f"layer.{layer}.bias"] = ("BF16", int8.f32_to_bf16_bits(m["bias"]))
    facts = _facts(rel)
    _replace_maps(rel, _encode(st, {**facts, "format": "ridgefill-maps/X"}))
    refused(rel, r"^maps.safetensors: metadata 'format' is 'ridgefill-maps/X', expected 'ridgefill-maps/2' \(the "
                 r"manifest's format\)$")
    _replace_maps(rel, _encode(st, facts))
    release.verify_release(rel)


# A child that runs `ridgefill export ... --force` and is killed (SIGKILL, by itself) at the N-th rename of the swap
# into $OUT (renames inside the store are not counted), as `strace -e inject=rename:signal=SIGKILL` would kill it.
KILLED_AT_RENAME = """
import os, signal, sys
rename, count = os.rename, [0]

def killing(src, dst, *a, **kw):
    if os.environ["OUT"] in (str(src), str(dst)):
        count[0] += 1
        if count[0] == int(os.environ["KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
    return rename(src, dst, *a, **kw)

os.rename = killing
from ridgefill.cli import main
sys.argv = ["ridgefill", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("kill_at", [1, 2])
def test_export_force_killed_mid_swap_leaves_a_release_or_the_next_run_restores_it(tmp_path, kill_at):
    """Killed before the first rename (out moved aside) or between the two (the new folder not yet in place): the
    folder holds the old release, or the next run finds no folder and puts the old one back; then it swaps the new
    release in and no `.rel.old-*` / `.rel.tmp-*` is left."""
    from fakestore import fake_chain

    from ridgefill.artifacts import Store

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root)
    out = tmp_path / "out" / "rel"
    write(out)  # an older, different release
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    args = ["export", ids["quantize"], "--out", out, "--force", "--store", st.root]
    env = {**os.environ, "KILL_AT": str(kill_at), "OUT": str(out)}
    r = subprocess.run([sys.executable, "-c", KILLED_AT_RENAME, *map(str, args)], env=env, capture_output=True)
    assert r.returncode == -9
    # `.rel.lock`: export's lock on --out (formats/release/folder.py out_lock), whose file a killed holder leaves
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name != "rel")
    if kill_at == 1:  # killed before moving the old release aside: it is still there, whole
        assert {p.name: p.read_bytes() for p in out.iterdir()} == old
        assert [n.split("-")[0] for n in leftovers] == [".rel.lock", ".rel.tmp"]
    else:  # killed with the old release aside and the new one not yet in place: no release at `out`
        assert not out.exists() and sorted(n.split("-")[0] for n in leftovers) == [".rel.lock", ".rel.old", ".rel.tmp"]
        release.recover(out)  # what the next run does first
        assert {p.name: p.read_bytes() for p in out.iterdir()} == old
        assert sorted(p.name for p in out.parent.iterdir()) == ["rel"]  # the killed run's lock file too
    r = subprocess.run([sys.executable, "-m", "ridgefill", *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert release.verify_release(out)["split"] == 9
    assert sorted(p.name for p in out.parent.iterdir()) == ["rel"]


def test_recover_leaves_a_live_process_s_folders_alone(tmp_path):
    out = tmp_path / "rel"
    write(out)
    busy = tmp_path / f".rel.tmp-{os.getppid()}-x"  # a process that runs (pytest's parent)
    busy.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".rel.old-{gone.stdout.strip()}-y"  # a process that has exited
    stale.mkdir()
    release.recover(out)
    assert busy.is_dir() and not stale.exists() and release.verify_release(out)


def test_export_describes_the_model_from_the_model_never_from_unhashed_info(tmp_path):
    """An artifact's `info` is outside its id: a store whose capture `info` claims another model (name,
    fingerprint, layer kinds, depth) still exports a release describing the captured model, read from the model
    folder the capture id's fingerprint identifies; a model folder with other files is refused."""
    from fakestore import CONFIG, MODEL_NAME, fake_chain, fake_model

    from ridgefill.artifacts import Store
    from ridgefill.artifacts.store import MANIFEST as ART_MANIFEST
    from ridgefill.evaluate.source import load_source
    from ridgefill.export.build import export

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root)
    folder, fp = fake_model(st.root)
    for stage in ("capture", "solve", "quantize"):
        path = st.root / stage / ids[stage] / ART_MANIFEST
        m = json.loads(path.read_text())
        m["info"]["model"] = {"name": "evil-model", "revision": None, "model_type": "qwen3_next", "num_layers": 99,
                              "hidden_size": 7, "fingerprint": "f" * 64}
        m["info"]["layer_kinds"] = {str(i): "linear_attention" for i in range(99)}
        m["summary"]["split"] = 5
        path.write_text(json.dumps(m))
    export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=tmp_path / "rel")
    manifest = release.verify_release(tmp_path / "rel")
    assert manifest["model"] == {"name": MODEL_NAME, "revision": None, "architecture": "llama", "num_layers": 12,
                                 "hidden_size": CONFIG["hidden_size"], "fingerprint": fp,
                                 "num_kv_heads": CONFIG["num_key_value_heads"], "head_dim": CONFIG["head_dim"]}
    assert manifest["split"] == 9
    assert manifest["layers"] == [{"index": l, "kind": "full_attention", "map": "kv"} for l in (9, 10, 11)]
    src = load_source(st, ids["quantize"])
    assert (src.fingerprint, src.split) == (fp, 9)

    # the capture's info pointing at another model: refused by the fingerprint the capture id covers
    other = tmp_path / "other" / MODEL_NAME
    shutil.copytree(folder, other)
    (other / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 99}))
    path = st.root / "capture" / ids["capture"] / ART_MANIFEST
    m = json.loads(path.read_text())
    m["info"]["model_spec"] = str(other)
    path.write_text(json.dumps(m))
    shutil.rmtree(st.root / "export")
    with pytest.raises(BadInput, match=r"was made with a different model .* than '.*other/Model-1'"):
        export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=tmp_path / "rel2")
    assert not (tmp_path / "rel2").exists()
    export(st, ids["quantize"], ExportConfig(), quiet(), out_dir=tmp_path / "rel2",
           model=str(folder))  # --model: where it is
    assert release.verify_release(tmp_path / "rel2")["model"]["fingerprint"] == fp


# ------------------------------------------------------------------------ map kinds, the release as applied

KV = 2 * KV_HEADS * HEAD_DIM


def kv_manifest(kinds=("linear_attention", "full_attention", "full_attention")) -> dict:
    """make_manifest() with its layers' kinds, a kv map on every attention layer and an input map on the others."""
    m = make_manifest()
    m["layers"] = [{"index": l, "kind": k, "map": "input" if k == "linear_attention" else "kv"}
                   for l, k in zip(LAYERS, kinds)]
    return m


def kv_maps(manifest: dict, seed: int = 0) -> dict:
    """float32 maps of the widths the manifest's map kinds need: [KV, D] for kv, [D, D] for input."""
    rng = np.random.default_rng(seed)
    return {x["index"]: {"weight": (rng.standard_normal((KV if x["map"] == "kv" else D, D)) * 0.05).astype(np.float32),
                         "bias": rng.standard_normal(KV if x["map"] == "kv" else D).astype(np.float32)}
            for x in manifest["layers"]}


@pytest.mark.parametrize("dtype", ["int8", "f32"])
def test_a_release_of_kv_and_input_maps_reads_back_exactly(tmp_path, dtype):
    """A hybrid's release: an input map on its Gated DeltaNet layer, kv maps [2 kv_heads head_dim, d] on the
    attention layers; decoded bit for bit as written, with the facts a runtime applies it with."""
    m = kv_manifest()
    maps = kv_maps(m)
    if dtype == "int8":
        maps = {l: {"codes": c, "scale_bits": s, "bias": x["bias"]} for l, x in maps.items()
                for c, s in [int8.quantize(x["weight"])]}
    written = write(tmp_path / "r", maps, m, weight_dtype=None if dtype == "int8" else "f32")
    assert written["format"] == FORMAT == "ridgefill-maps/2"
    assert safetensors.read_header(tmp_path / "r" / MAPS_FILE)[1]["format"] == FORMAT
    rel = release.read_release(tmp_path / "r")
    assert dict(rel.map_kinds) == {9: "input", 10: "kv", 11: "kv"} and rel.kv_width == KV == 100
    assert (rel.format, rel.split, rel.tail, rel.anchor, rel.exact_norm) == (FORMAT, 9, 512, 1, 812.5)
    for l, x in maps.items():
        want = x["weight"] if dtype == "f32" else int8.dequantize(x["codes"], x["scale_bits"])
        assert np.array_equal(rel.maps[l]["weight"], want) and rel.maps[l]["weight"].shape == want.shape
    with pytest.raises(TypeError):
        rel.map_kinds[9] = "kv"  # read-only
    with pytest.raises(AttributeError):
        rel.split = 3


# (what the manifest is changed to, the writer's and the reader's refusal after "ridgefill.json: ")
MAP_RULES = [
    ("map-missing", lambda m: m["layers"][1].pop("map"), "'layers[1].map' is missing, expected one of 'input', 'kv'"),
    ("map-unknown", lambda m: m["layers"][2].update(map="keys"), "'layers[2].map' is \"keys\", expected one of"),
    ("kv-on-linear", lambda m: m["layers"][0].update(map="kv"),
     "'layers[0].map' is \"kv\" on a linear_attention layer (layer 9)"),
    ("num-kv-heads", lambda m: m["model"].pop("num_kv_heads"), "'model.num_kv_heads' is missing, expected a positive"),
    ("head-dim", lambda m: m["model"].update(head_dim=0), "'model.head_dim' is 0, expected a positive integer"),
    ("split-too-big", lambda m: m.update(split=12), "'split' is 12, expected an integer from 1 to 11"),
    ("split-zero", lambda m: m.update(split=0), "'split' is 0, expected an integer from 1 to 11"),
    ("tail-overflow", lambda m: m.update(tail_default=10**30), "'tail_default' is 1000000000000000000000000000000, "
                                                               "expected an integer from 1 to 2147483647"),
    ("tail-zero", lambda m: m.update(tail_default=0), "'tail_default' is 0, expected an integer from 1 to"),
    ("skip-negative", lambda m: m["fit"].update(skip_first_rows=-1), "'fit.skip_first_rows' is -1, expected an "
                                                                      "integer >= 0"),
    ("skip-missing", lambda m: m["fit"].pop("skip_first_rows"), "'fit.skip_first_rows' is missing"),
    ("layers-from-split", lambda m: m.update(split=8), "'layers' has the indices [9, 10, 11], expected 8..11 ascending"),
    ("layers-to-the-last", lambda m: m["model"].update(num_layers=13),
     "'layers' has the indices [9, 10, 11], expected 9..12 ascending"),
]


@pytest.mark.parametrize("edit, wording", [r[1:] for r in MAP_RULES], ids=[r[0] for r in MAP_RULES])
def test_the_map_kinds_and_applied_facts_are_checked_by_writer_and_reader(tmp_path, edit, wording):
    """Rules 11 and 12: the writer never writes such a release, and a folder made consistently by hand (facts and
    manifest agree, every hash holds) is refused by the reader in one line naming the field."""
    m = kv_manifest()
    maps = kv_maps(m)
    edit(m)
    with pytest.raises(ValueError) as e:
        write(tmp_path / "new", maps, m, weight_dtype="f32")
    assert str(e.value).startswith(wording), str(e.value)
    assert not (tmp_path / "new").exists()
    d = tmp_path / "rel"
    write(d, maps, kv_manifest(), weight_dtype="f32")
    _refact(d, edit)
    for fn in (release.verify_release, release.load_release):
        refused(d, "^" + re.escape(f"ridgefill.json: {wording}"), fn=fn)


def _refact(d: Path, edit, format: str | None = None) -> None:
    """Edit a folder's facts in both places (manifest and maps.safetensors metadata) and reseal its hash."""
    arrays, meta = safetensors.load(d / MAPS_FILE)
    m = json.loads((d / MANIFEST).read_text())
    edit(m)
    meta = {**meta, "ridgefill.facts": release.facts_json(m), "format": format or meta["format"]}
    (d / MAPS_FILE).write_bytes(safetensors.encode(arrays, meta))
    m["files"][MAPS_FILE] = sha256_file(d / MAPS_FILE)
    (d / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("kind, edit, tensor, want", [
    ("kv", lambda m: m["model"].update(head_dim=20), "layer.10.weight", "[80, 300]"),
    ("input", lambda m: m["layers"][1].update(map="input"), "layer.10.weight", "[300, 300]"),
    ("d_in", lambda m: m["model"].update(hidden_size=200), "layer.9.weight", "[200, 200]"),
])
def test_a_map_of_the_wrong_width_is_refused_by_its_tensor(tmp_path, kind, edit, tensor, want):
    d = tmp_path / "rel"
    write(d, kv_maps(kv_manifest()), kv_manifest(), weight_dtype="f32")
    _refact(d, edit)
    msg = refused(d, f"^maps.safetensors: tensor '{re.escape(tensor)}' has shape ")
    assert f"expected {want}" in msg
    m = kv_manifest()
    edit(m)
    with pytest.raises(ValueError, match=re.escape(f"expected {want}")):
        write(tmp_path / "new", kv_maps(kv_manifest()), m, weight_dtype="f32")


def as_v1(d: Path, skip_first_rows: bool = True) -> None:
    """Make a written /2 folder the /1 release it would have been: no map kinds, no KV shape, format /1 (in the
    manifest, the facts and the metadata)."""
    def strip(m):
        m["format"] = release.FORMAT_V1
        for x in m["layers"]:
            x.pop("map")
        m["model"].pop("num_kv_heads")
        m["model"].pop("head_dim")
        if not skip_first_rows:
            m["fit"].pop("skip_first_rows")

    _refact(d, strip, release.FORMAT_V1)


def test_a_v1_release_still_reads_as_input_maps(rel):
    """`ridgefill-maps/1`: every map an input map, no kv width, the rows the fit left out 1 when it does not say;
    `map` in its layers is refused (it has no map kinds), and so is a split out of range."""
    as_v1(rel, skip_first_rows=False)
    r = release.read_release(rel)
    assert (r.format, dict(r.map_kinds), r.kv_width, r.anchor) == (release.FORMAT_V1, dict.fromkeys(LAYERS, "input"),
                                                                   None, release.DEFAULT_SKIP_FIRST_ROWS)
    _refact(rel, lambda m: m["layers"][0].update(map="input"))
    refused(rel, r"^ridgefill.json: 'layers\[0\].map' is in a ridgefill-maps/1 release, whose maps are all input maps")
    _refact(rel, lambda m: (m["layers"][0].pop("map"), m.update(split=12)))
    refused(rel, r"^ridgefill.json: 'split' is 12, expected an integer from 1 to 11 \(model.num_layers is 12\)$")


def test_a_v1_release_is_not_held_to_layers_from_the_split(tmp_path):
    """/1 releases never tied `layers` to split..num_layers-1, nor the widths to the model: they still verify (the
    runtime's check_model refuses what its model cannot run)."""
    d = tmp_path / "rel"
    write(d)
    as_v1(d)
    _refact(d, lambda m: (m.update(split=2), m["model"].update(hidden_size=576)))
    r = release.read_release(d)
    assert r.split == 2 and sorted(r.maps) == list(LAYERS)
    with pytest.raises(BadInput, match=r"^there: the release is for a model with hidden_size 576, but 'm' has 300$"):
        r.check_model(fingerprint=None, num_layers=12, hidden_size=300, num_kv_heads=2, head_dim=25, vocab_size=None,
                      name="m", where="there")
    _refact(d, lambda m: m["model"].update(hidden_size=300))
    with pytest.raises(BadInput, match=r"^there: the release has no maps for late layers \[2, 3, 4, 5, 6, 7, 8\] "
                                       r"\(split 2, 12 layers\)$"):
        release.read_release(d).check_model(fingerprint=None, num_layers=12, hidden_size=300, num_kv_heads=None,
                                            head_dim=None, vocab_size=None, name="m", where="there")


def test_check_model_refuses_another_model_in_one_line(tmp_path):
    m = kv_manifest()
    write(tmp_path / "r", kv_maps(m), m, weight_dtype="f32")
    rel = release.read_release(tmp_path / "r")
    fp = "0123456789abcdef"
    ok = dict(fingerprint=fp, num_layers=12, hidden_size=D, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=256,
              name="tiny", where="rel")
    rel.check_model(**ok)
    rel.check_model(**{**ok, "fingerprint": None})  # not known: not compared
    for change, wording in [
        ({"fingerprint": "f" * 64}, "rel: the maps were made for another model (fingerprint 0123456789ab) than 'tiny' "
                                    "(ffffffffffff)"),
        ({"num_layers": 13}, "rel: the release is for a model with num_layers 12, but 'tiny' has 13"),
        ({"hidden_size": 256}, "rel: the release is for a model with hidden_size 300, but 'tiny' has 256"),
        ({"num_kv_heads": 1}, "rel: the release is for a model with num_kv_heads 2, but 'tiny' has 1"),
        ({"head_dim": 50}, "rel: the release is for a model with head_dim 25, but 'tiny' has 50"),
    ]:
        with pytest.raises(BadInput) as e:
            rel.check_model(**{**ok, **change})
        assert str(e.value) == wording and e.value.exit_code == 2


def test_check_model_refuses_a_protected_table_past_the_vocabulary(tmp_path):
    """A protected-token table names token ids of the model's tokenizer: an id at or past the model's vocabulary is
    refused in one line (the table was made for another tokenizer); a vocabulary not known is not compared."""
    m = kv_manifest()
    write(tmp_path / "r", kv_maps(m), m, weight_dtype="f32", protected=np.array([3, 7, 255], dtype=np.int32),
          protected_facts={"share": 0.25, "types": 3})
    rel = release.read_release(tmp_path / "r")
    ok = dict(fingerprint=None, num_layers=12, hidden_size=D, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, name="tiny",
              where="rel")
    rel.check_model(**ok, vocab_size=256)
    rel.check_model(**ok, vocab_size=None)
    with pytest.raises(BadInput) as e:
        rel.check_model(**ok, vocab_size=255)
    assert str(e.value) == ("rel: the protected-token table holds token id 255, past the vocabulary of 'tiny' (255 "
                            "tokens: ids 0..254)") and e.value.exit_code == 2
