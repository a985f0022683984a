"""End to end on the real built-in models (slow): capture -> solve -> quantize -> export -> verify."""

import json

import pytest

from ridgefill.capture.corpus import builtin_sources
from clirun import cli

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """Six real documents (three license texts, three stdlib sources), cut to about 4K characters each."""
    d = tmp_path_factory.mktemp("corpus")
    src = builtin_sources()
    picks = src[:3] + src[-3:]
    for p in picks:
        (d / f"{p.name}.txt").write_text(p.read_text(errors="replace")[:4000])
    return d


@pytest.mark.parametrize("model, split, layers", [("builtin:smollm2-135m", 15, 30), ("builtin:gemma3-270m", 7, 18)])
def test_chain_on_real_model(tmp_path, small_corpus, model, split, layers):
    store = tmp_path / "store"
    r = cli("capture", model, "--data", small_corpus, "--held-out", 2, "--held-out-rows", 256,
            "--max-tokens", 512, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    cap = json.loads(r.stdout)
    assert cap["summary"]["splits"] == [split]  # the default split for this model
    r = cli("solve", cap["id"], "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    sol = json.loads(r.stdout)["summary"]
    assert sol["layers"] == list(range(split, layers))
    # the fitted maps beat the identity fill on held-out keys and values
    assert sol["fitted"]["k_cosine"] > sol["identity"]["k_cosine"]
    assert sol["fitted"]["v_cosine"] > sol["identity"]["v_cosine"]
    r = cli("quantize", json.loads(cli("solve", cap["id"], "--store", store, "--json").stdout)["id"],
            "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)["summary"]
    assert abs(q["score_int8"] - q["score_float"]) < 2e-3
    out = tmp_path / "release"
    r = cli("export", json.loads(r.stdout)["id"], "--out", out, "--store", store)
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "ridgefill.json").read_text())
    assert man["model"]["num_layers"] == layers and man["split"] == split
    assert cli("verify", out).returncode == 0
