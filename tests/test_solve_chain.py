"""Solve, quantize, export and verify on a tiny random llama, through the real CLI entry point."""

import json

import numpy as np
import pytest

from ridgefill.artifacts import Store, tensors
from ridgefill.capture.run import CaptureConfig, capture, load_heldout, load_stats
from ridgefill.output import Output
from ridgefill.solve.ridge import direct_solve
from clirun import cli

TEXTS = [("The rain in Spain stays mainly in the plain. " * 9), ("import os\nprint(os.getcwd())\n" * 12),
         ("We hold these truths to be self-evident. " * 10), ("while True:\n    x = x + 1\n" * 11),
         ("To be, or not to be, that is the question. " * 8), ("a = [i * i for i in range(9)]\n" * 10)]




@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("chain")
    data = tmp / "data"
    data.mkdir()
    for i, t in enumerate(TEXTS):
        (data / f"d{i}.txt").write_text(t)
    store = tmp / "store"
    cap, _ = capture(Store(store), str(tiny_llama), [str(data)],
                     CaptureConfig(splits=(2,), chunk=48, held_out=2, held_out_rows=64), Output(quiet=True))
    r = cli("solve", cap.id, "--store", store, "--alpha", "1e-4", "--alpha", "0.01", "--alpha", "1", "--json")
    assert r.returncode == 0, r.stderr
    solve = json.loads(r.stdout)
    return {"tmp": tmp, "store": store, "cap": cap, "solve": solve, "data": data}


def _kv_brute(model, l, x):
    """k = k_proj(rmsnorm(x)), v = v_proj(rmsnorm(x)) from the raw weights, float64."""
    layer = model.model.layers[l]
    g = layer.input_layernorm.weight.detach().double().numpy()
    eps = layer.input_layernorm.variance_epsilon
    xn = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g
    k = xn @ layer.self_attn.k_proj.weight.detach().double().numpy().T
    v = xn @ layer.self_attn.v_proj.weight.detach().double().numpy().T
    hd = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // model.config.num_attention_heads
    return k.reshape(len(x), -1, hd), v.reshape(len(x), -1, hd)


def _cos(a, b):
    return ((a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))).mean()


def test_solve_maps_and_choice_match_brute_force(chain, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    store = Store(chain["store"])
    sol = store.get(chain["solve"]["id"], stage="solve")
    rep = json.loads(sol.file("report.json").read_text())
    m = load_stats(chain["cap"], 2)
    held = load_heldout(chain["cap"])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    L = model.config.num_hidden_layers
    x = held["hidden.2"].astype(np.float64)
    scores = {}
    for alpha in (1e-4, 0.01, 1.0):
        w, b = direct_solve(m, alpha)
        ks, vs = [], []
        for i, l in enumerate(range(2, L)):
            y = held[f"hidden.{l}"].astype(np.float64)
            kp, vp = _kv_brute(model, l, x @ w[i].T + b[i])
            kt, vt = _kv_brute(model, l, y)
            ks.append(_cos(kp, kt))
            vs.append(_cos(vp, vt))
        scores[alpha] = (np.mean(ks) + np.mean(vs)) / 2
    grid = {g["alpha"]: g["score"] for g in rep["grid"]}
    for a in scores:
        assert grid[a] == pytest.approx(scores[a], abs=2e-5)
    assert rep["alpha"] == max(scores, key=scores.get)
    arrays, _ = tensors.load(sol.file("maps.safetensors"))
    w, b = direct_solve(m, rep["alpha"])
    for i, l in enumerate(range(2, L)):
        np.testing.assert_allclose(arrays[f"layer.{l}.weight"], w[i], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(arrays[f"layer.{l}.bias"], b[i], rtol=1e-4, atol=1e-5)
    # the identity fill scores layer S (whose input is h_S itself) perfectly
    assert rep["identity"]["layers"]["2"]["k_cosine"] == pytest.approx(1.0, abs=1e-6)


def test_solve_cache_hit(chain):
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--alpha", "1e-4", "--alpha", "0.01", "--alpha", "1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cached"] is True


def test_solve_refusals(chain, tmp_path, tiny_qwen3):
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--alpha", "0")
    assert (r.returncode, r.stderr.strip()) == (2, "Error: alpha must be > 0 (got 0)")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--alpha", "-1e-3")
    assert (r.returncode, r.stderr.strip()) == (2, "Error: alpha must be > 0 (got -0.001)")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--model", tiny_qwen3)
    assert r.returncode == 2
    assert r.stderr.startswith(f"Error: capture {chain['cap'].id} was made with a different model")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--split", "3")
    assert (r.returncode, r.stderr.strip()) == (2, f"Error: capture {chain['cap'].id} has no split 3 (it has 2)")
    assert len(list((chain["store"] / "solve").iterdir())) == 1  # nothing new written


def test_quantize_export_verify(chain):
    store = chain["store"]
    r = cli("quantize", chain["solve"]["id"], "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)
    assert q["summary"]["max_rel_error_worst"] < 1 / 127
    assert abs(q["summary"]["score_int8"] - q["summary"]["score_float"]) < 1e-2
    out = chain["tmp"] / "release"
    r = cli("export", q["id"], "--out", out, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "maps.safetensors", "ridgefill.json"]
    man = json.loads((out / "ridgefill.json").read_text())
    assert man["format"] == "ridgefill-maps/1" and man["split"] == 2 and man["projector"]["dtype"] == "int8"
    assert [x["index"] for x in man["layers"]] == [2, 3]
    r = cli("verify", out)
    assert r.returncode == 0, r.stderr
    # the release decodes to the quantized maps
    from ridgefill.export.release import load_release

    _, maps = load_release(out)
    sol = Store(store).get(chain["solve"]["id"])
    w = tensors.load(sol.file("maps.safetensors"))[0]["layer.3.weight"]
    assert np.abs(maps[3]["weight"] - w).max() <= np.abs(w).max() / 127
    # re-export into the same folder: identical, nothing to do; a second export is a cache hit
    r = cli("export", q["id"], "--out", out, "--store", store, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cached"] is True


@pytest.mark.parametrize("damage, message", [
    ("missing", "maps.safetensors: listed in ridgefill.json but missing from"),
    ("extra", "notes.txt: in the release folder but not listed in ridgefill.json"),
    ("altered", "maps.safetensors: sha256 mismatch"),
    ("dotdot", "ridgefill.json: files entry '../x' is not a bare file name inside the release folder"),
])
def test_verify_refusals(chain, tmp_path, damage, message):
    import shutil

    src = chain["tmp"] / "release"
    if not src.exists():
        pytest.skip("needs test_quantize_export_verify")
    d = tmp_path / "rel"
    shutil.copytree(src, d)
    if damage == "missing":
        (d / "maps.safetensors").unlink()
    elif damage == "extra":
        (d / "notes.txt").write_text("hi")
    elif damage == "altered":
        b = bytearray((d / "maps.safetensors").read_bytes())
        b[-1] ^= 1
        (d / "maps.safetensors").write_bytes(bytes(b))
    else:
        man = json.loads((d / "ridgefill.json").read_text())
        man["files"]["../x"] = "0" * 64
        (d / "ridgefill.json").write_text(json.dumps(man))
    r = cli("verify", d)
    assert r.returncode == 2
    assert r.stderr.startswith("Error: " + message), r.stderr


def test_export_never_replaces_a_folder_that_is_not_a_release(chain, tmp_path):
    q = json.loads(cli("quantize", chain["solve"]["id"], "--store", chain["store"], "--json").stdout)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    r = cli("export", q["id"], "--out", precious, "--force", "--store", chain["store"])
    assert (r.returncode, r.stderr.strip()) == (2, f"Error: --out {precious} exists, is not empty and is not a release folder")
    assert (precious / "thesis.tex").read_text() == "years of work"
