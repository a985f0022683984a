"""A release is untrusted input (docs/format.md, "Verifying", rules 11 and 13): forged manifest values refused in one
line without an allocation sized by them, and maps whose values could overflow a runtime refused by every reader (the
verifier, eval, `engine prefix`, the runtime's loader and the vLLM plugin's), before anything is written. Each forged
release here is sealed as a forger would seal it: its hashes and recorded facts agree, so only these rules can
refuse it."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.formats import release, safetensors
from ridgefill.formats.release import MANIFEST, MAPS_FILE, MAX_MAP_OUTPUT, map_bound
from clirun import cli
from conftest import SMALL_CHAIN

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600", "--documents", "1",
        "--samples", "1"]


def reseal(d: Path, edit=lambda m: None, tensors=lambda t: None) -> None:
    """Edit the manifest (`edit`) and the maps' tensors (`tensors`, on {name: (dtype, array)}) of the release in `d`,
    then record the manifest as the facts and rewrite the hashes, as a forger would."""
    m = json.loads((d / MANIFEST).read_text())
    edit(m)
    t = release.read_tensors(d / MAPS_FILE)
    tensors(t)
    blob = safetensors.encode({n: safetensors.BF16(a) if dt == "BF16" else a for n, (dt, a) in t.items()},
                              {"format": m["format"], "ridgefill.facts": release.facts_json(m)})
    (d / MAPS_FILE).write_bytes(blob)
    m["files"][MAPS_FILE] = sha256_file(d / MAPS_FILE)
    (d / MANIFEST).write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")


def small(path: Path, fmt: str = release.FORMAT) -> Path:
    """A small f32 release of a 4-layer, 64-wide model at split 2 (maps of size like a fit's)."""
    rng = np.random.default_rng(0)
    maps = {l: {"weight": (rng.standard_normal((64, 64)) / 8).astype(np.float32),
                "bias": rng.standard_normal(64).astype(np.float32)} for l in (2, 3)}
    manifest = {"model": {"name": "example/model-1", "revision": None, "architecture": "llama", "num_layers": 4,
                          "hidden_size": 64, "num_kv_heads": 2, "head_dim": 16, "fingerprint": "ab" * 32},
                "split": 2, "tail_default": 8,
                "layers": [{"index": l, "kind": "full_attention", "map": "input"} for l in (2, 3)],
                "fit": {"exact_norm": 812.5, "skip_first_rows": 1}}
    release.write_release(path, maps, manifest, "# card\n", weight_dtype="f32")
    if fmt != release.FORMAT:  # a /1 release: no map kinds
        reseal(path, lambda m: (m.update(format=fmt), [x.pop("map") for x in m["layers"]]),
               lambda t: None)
    return path


def refusal(d: Path, fn=release.verify_release) -> str:
    with pytest.raises(BadInput) as e:
        fn(d)
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    return str(e.value)


# ------------------------------------------------------------------------------ the bound a map writes within


def test_map_bound_is_the_largest_value_a_filled_row_can_write():
    """max_i ||W_i|| n + |b_i| against float64 by brute force: no split state of norm <= n gives more, and the one
    along the largest row's W_i (signed as its bias) gives exactly that."""
    rng = np.random.default_rng(1)
    W = rng.standard_normal((40, 300)).astype(np.float32) * rng.uniform(0.1, 3, (40, 1)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32) * 5
    norm = 123.4
    W64, b64 = W.astype(np.float64), b.astype(np.float64)
    rows = np.linalg.norm(W64, axis=1) * norm + np.abs(b64)
    got = map_bound(W, b, norm)
    assert got == pytest.approx(rows.max(), rel=1e-6)
    i = int(rows.argmax())
    h = W64[i] / np.linalg.norm(W64[i]) * norm * np.sign(b64[i])  # the worst split state
    assert abs(W64[i] @ h + b64[i]) == pytest.approx(got, rel=1e-6)
    for _ in range(200):  # and none of norm n writes more
        h = rng.standard_normal(300)
        h *= norm / np.linalg.norm(h)
        assert np.abs(W64 @ h + b64).max() <= got * (1 + 1e-6)
    with np.errstate(all="raise"):  # an overflowing sum is infinity, quietly, and refused by every limit
        assert map_bound(np.full((2, 4), 3e38, np.float32), np.zeros(2, np.float32), 1.0) == np.inf


def test_a_release_knows_its_bound(tmp_path):
    rel = release.read_release(small(tmp_path / "rel"))
    want = max(map_bound(m["weight"], m["bias"], 812.5) for m in rel.maps.values())
    assert rel.output_bound == want and 0 < want < MAX_MAP_OUTPUT


@pytest.mark.parametrize("edit, tensors, layer", [
    (lambda m: None, lambda t: t.__setitem__("layer.3.weight", ("F32", np.full((64, 64), 3e38, np.float32))), 3),
    (lambda m: None, lambda t: t.__setitem__("layer.2.bias", ("F32", np.full(64, 1e30, np.float32))), 2),
    (lambda m: m["fit"].update(exact_norm=1e30), lambda t: None, 2),  # fit maps, a forged exact-row norm
], ids=["huge-weights", "huge-bias", "huge-exact-norm"])
def test_maps_that_could_overflow_are_refused(tmp_path, edit, tensors, layer):
    d = small(tmp_path / "rel")
    reseal(d, edit, tensors)
    msg = refusal(d)
    assert msg.startswith(f"{MAPS_FILE}: layer {layer}'s map writes values up to ")
    assert msg.endswith(f", past {MAX_MAP_OUTPUT:.3g}: not the maps of a fit, and a runtime's keys and values would "
                        "overflow")
    assert refusal(d, release.load_release) == msg


def test_a_float16_model_refuses_maps_past_its_range(tmp_path):
    d = small(tmp_path / "rel")
    reseal(d, lambda m: m["fit"].update(exact_norm=1e5))  # rows of norm ~1: up to ~1.2e5, well within float32
    rel = release.read_release(d)
    assert 65504 < rel.output_bound < MAX_MAP_OUTPUT
    facts = dict(fingerprint=None, num_layers=4, hidden_size=64, num_kv_heads=2, head_dim=16, vocab_size=None,
                 name="m", where="here")
    rel.check_model(**facts, dtype="bfloat16")
    rel.check_model(**facts, dtype="float32")
    with pytest.raises(BadInput) as e:
        rel.check_model(**facts, dtype="float16")
    assert str(e.value) == (f"here: the maps write values up to {rel.output_bound:.3g}, past float16's largest "
                            f"finite value 65504: run 'm' in bfloat16 or float32")


# ------------------------------------------------------------------------ every reader, one line, nothing written


@pytest.fixture(scope="module")
def chain(tiny_chain):
    return tiny_chain(SMALL_CHAIN)


def test_every_reader_refuses_an_overflowing_release(chain, tmp_path):
    """The chain's release with one map scaled to 1e30: `verify`, `eval`, `engine prefix` exit 2 with one line and
    leave nothing behind (no artifact, no staging folder, the release unchanged); the runtime's and the vLLM
    plugin's loaders refuse it with the same words."""
    import shutil

    from ridgefill.engines.vllm import served
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps

    d = tmp_path / "forged"
    shutil.copytree(chain.release, d)
    reseal(d, tensors=lambda t: t.__setitem__("layer.3.weight", ("F32", t["layer.3.weight"][1] * np.float32(1e30))))
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    store = chain.store.root
    before = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    want = refusal(d)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat on the mat. " * 8)
    for args in (["verify", d], ["eval", chain.model, d, *TINY, "--store", store],
                 ["engine", "prefix", chain.model, d, "--prompt", prompt, "--out", tmp_path / "out", "--tail", 5,
                  "--store", store]):
        r = cli(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("Error: ") and want in lines[0], r.stderr
    assert {p.name: p.read_bytes() for p in d.iterdir()} == files
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forged", "prompt.txt"]
    lm = load_model(resolve_model(str(chain.model), store_root=store), store_root=store)
    assert want in refusal(d, lambda p: load_release_maps(lm, p))
    assert want in refusal(d, served.load)


# --------------------------------------------------------------------------------- forged manifest values


FORGED = [  # (edit, the refusal after "ridgefill.json: ")
    (lambda m: m["layers"][0].update(index=[2]),
     "'layers' has the indices [[2], 3], expected 2..3 ascending (every layer from 'split' to model.num_layers - 1)"),
    (lambda m: m["layers"][0].update(index=2.5),
     "'layers' has the indices [2.5, 3], expected 2..3 ascending (every layer from 'split' to model.num_layers - 1)"),
    (lambda m: m["model"].update(num_layers=10**12),
     "'layers' has the indices [2, 3], expected 2..999999999999 ascending (every layer from 'split' to "
     "model.num_layers - 1)"),
    (lambda m: m["model"].update(num_layers=10**8),
     "'layers' has the indices [2, 3], expected 2..99999999 ascending (every layer from 'split' to "
     "model.num_layers - 1)"),
    (lambda m: m["model"].update(name=["a"]), "'model.name' is [\"a\"], expected a non-empty string"),
    (lambda m: m["model"].pop("name"), "'model.name' is missing, expected a non-empty string"),
    (lambda m: m["model"].update(fingerprint=7), "'model.fingerprint' is 7, expected a non-empty string"),
    (lambda m: m["fit"].update(calibration_sha256=[["x"]]),
     "'fit.calibration_sha256' is [[\"x\"]], expected a list of sha256 strings"),
]


@pytest.mark.parametrize("edit, message", FORGED, ids=["index-list", "index-float", "layers-1e12", "layers-1e8",
                                                       "name-list", "name-missing", "fingerprint-int",
                                                       "calibration-nested"])
def test_forged_manifest_values_are_refused_without_allocating_by_them(tmp_path, edit, message):
    d = small(tmp_path / "rel")
    reseal(d, edit)
    tracemalloc.start()
    try:
        msg = refusal(d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert msg == f"{MANIFEST}: {message}"
    assert peak < 2**22  # 4 MiB: nothing sized by a number the manifest gives


def test_a_v1_release_with_a_forged_layer_index_is_refused(tmp_path):
    d = small(tmp_path / "rel", fmt=release.FORMAT_V1)
    release.read_release(d)  # the /1 release as written reads
    reseal(d, lambda m: m["layers"][1].update(index={"l": 3}))
    assert refusal(d) == f"{MANIFEST}: 'layers[1].index' is {{\"l\": 3}}, expected a layer index (an integer >= 0)"
