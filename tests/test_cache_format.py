"""The cache format `ridgefill-cache/2` (docs/cache.md) through its conformance corpus
(examples/reader/cache_conformance.py): every valid and invalid file gets its expected verdict from every reader
path (`read_header`, `read_cache`, the engine readers with rule 12, llama.cpp's loader without llama.cpp, and
`read_layer`), each refusal one line naming the file, the tensor and the rule; the values read are the written
ones, rounded as torch rounds them, and written back byte for byte. Also the writer's refusals and the engine
folder's prompt reader (`request.read_prompt`)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ridgefill.engines import layout, llamacpp
from ridgefill.engines.request import read_prompt, vllm_request
from ridgefill.errors import BadInput
from ridgefill.formats import cache, safetensors

READER_DIR = Path(__file__).resolve().parents[1] / "examples" / "reader"
spec = importlib.util.spec_from_file_location("cache_conformance", READER_DIR / "cache_conformance.py")
conf = importlib.util.module_from_spec(spec)
sys.modules["cache_conformance"] = conf  # dataclasses look their module up
spec.loader.exec_module(conf)
CASES = {c.name: c for c in conf.CASES}
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cache-corpus")
    conf.generate(out)
    return out


def _shape(model: dict) -> cache.ModelShape:
    return cache.ModelShape(**model)


def _verdict(fn) -> str | None:
    try:
        fn()
    except BadInput as e:
        return str(e)
    return None


def _agrees(name: str, path: Path, reader: str, message: str | None) -> None:
    case, rule = CASES[name], CASES[name].verdicts[reader]
    if rule == 0:
        assert message is None, f"{name}: {reader} refused a file it must accept: {message}"
        return
    assert message is not None, f"{name}: {reader} accepted a file that breaks rule {rule}"
    assert "\n" not in message
    assert message.startswith(f"{path}: "), f"{name}: {message!r} does not start with the path"
    assert message.endswith(f"(rule {rule})"), f"{name}: {reader}: {message!r} is not rule {rule}"
    for text in case.names if rule == case.rule else ():
        assert text in message, f"{name}: {message!r} does not name {text}"


def test_the_corpus_covers_every_rule(corpus):
    expected = json.loads((corpus / "expected.json").read_text())
    assert set(expected) == set(CASES) and len(expected) >= 60
    assert {e["rule"] for e in expected.values()} == set(range(13))
    assert {e["base"] for e in expected.values() if e["rule"] == 0} >= {"engine-f32", "engine-bf16", "engine-f16",
                                                                        "compact-bf16", "compact-sliding", "fold-f16",
                                                                        "fold-sliding-f32"}  # fmt: skip
    assert all(e["names"] for e in expected.values() if e["rule"])  # every refusal names what it is about


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_reader_gives_the_expected_verdict(corpus, name):
    path = corpus / f"{name}.safetensors"
    model = _shape(CASES[name].model)
    layout_ = llamacpp.StateLayout(False, 0, 0, False, model.num_layers, model.kv_heads, model.head_dim)
    readers = {
        "header": lambda: cache.read_header(path),
        "cache": lambda: cache.read_cache(path),
        "engine_header": lambda: cache.read_header(path, model, engine=True),
        "engine_cache": lambda: cache.read_cache(path, model, engine=True),
    }
    for reader, fn in readers.items():
        _agrees(name, path, reader, _verdict(fn))
    _agrees(name, path, "engine_cache", _verdict(lambda: llamacpp.cache_state(path, layout_, model.fingerprint)))
    if CASES[name].verdicts["header"] == 0:  # layer by layer after the header: the whole file's data verdict
        header = cache.read_header(path)

        def each_layer():
            for l in range(header.num_layers):
                cache.read_layer(header, l)

        _agrees(name, path, "cache", _verdict(each_layer))


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """The reference rounding: torch's own cast (float64 -> float32 -> dtype, as torch rounds a float64 tensor)."""
    return torch.tensor(x, dtype=torch.float32).to(TORCH[dtype]).float().numpy()


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.rule == 0))
def test_valid_caches_read_back_the_written_values(corpus, name):
    path, base = corpus / f"{name}.safetensors", conf.BASES[CASES[name].base]
    want = base.layers()
    got = cache.read_cache(path)
    header = cache.read_header(path)
    assert list(got) == list(range(len(want))) and header.num_layers == len(want)
    for l, fields in want.items():
        assert sorted(got[l]) == sorted(fields)
        np.testing.assert_array_equal(got[l]["keys"], _rounded(fields["keys"], base.dtype))
        np.testing.assert_array_equal(got[l]["values"], _rounded(fields["values"], base.dtype))
        for f in ("positions", "beta", "u"):
            if f in fields:
                assert got[l][f].dtype == fields[f].dtype
                np.testing.assert_array_equal(got[l][f], fields[f])
        one = cache.read_layer(header, l)
        assert sorted(one) == sorted(got[l]) and all(np.array_equal(one[f], got[l][f]) for f in one)
    # the header's facts
    n = [fields["keys"].shape[1] for fields in want.values()]
    assert (header.dtype, header.model_fingerprint, header.kind) == (base.dtype, base.fingerprint, base.kind)
    assert (header.kv_heads, header.head_dim, header.entries) == (conf.H, conf.HD, tuple(n))
    assert header.cached == (n[0] if len(set(n)) == 1 else None)
    assert header.compacted == tuple(l for l, f in want.items() if "beta" in f or "u" in f)
    assert header.shapes["layer.0.keys"] == want[0]["keys"].shape and header.format == cache.FORMAT


@pytest.mark.parametrize("base", sorted(conf.BASES))
def test_written_back_byte_for_byte(corpus, base, tmp_path):
    """A cache read and written again is the same file (also for one whose header came in another order)."""
    first, again = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    conf.write_base(base, first)
    header = cache.read_header(first)
    cache.write_cache(again, cache.read_cache(first), header.dtype, header.model_fingerprint)
    assert again.read_bytes() == first.read_bytes()
    if base == "compact-sliding":
        conf._reordered(again)
        assert again.read_bytes() != first.read_bytes()
        cache.write_cache(again, cache.read_cache(again), header.dtype, header.model_fingerprint)
        assert again.read_bytes() == first.read_bytes()


@pytest.mark.parametrize("interleaved", [False, True])
def test_llama_cpp_state_of_a_valid_engine_cache(corpus, interleaved):
    path = corpus / "valid-engine-bf16.safetensors"
    lay = llamacpp.StateLayout(True, 0, 0, interleaved, 3, conf.H, conf.HD)
    state = llamacpp.cache_state(path, lay, conf.FP)
    layers = cache.read_cache(path)
    assert state.positions.tolist() == list(range(conf.P)) and len(state.keys) == 3 and state.v_trans
    for l in range(3):
        k = layers[l]["keys"]  # [heads, P, hd] -> row p: every head's key at p, one after another
        k = layout.to_ggml_rope_order(k) if interleaved else k
        np.testing.assert_array_equal(state.keys[l], k.transpose(1, 0, 2).reshape(conf.P, -1))
        np.testing.assert_array_equal(state.values[l], layers[l]["values"].transpose(1, 0, 2).reshape(conf.P, -1))


def test_old_format_is_refused_with_a_way_forward(tmp_path):
    path = tmp_path / "cache.safetensors"
    kv = {"layer.0.keys": np.zeros((1, 2, 4), np.float32), "layer.0.values": np.zeros((1, 2, 4), np.float32)}
    safetensors.save(path, kv, {"format": "ridgefill-cache/1", "dtype": "float32"})
    with pytest.raises(BadInput) as e:
        cache.read_cache(path)
    assert str(e.value) == (f"{path}: format 'ridgefill-cache/1' records no model fingerprint, so it cannot be bound "
                            "to its model: make the cache again (ridgefill compact / fold / engine prefix / engine "
                            "fold) (rule 2)")  # fmt: skip


def test_the_writer_refuses_what_a_reader_would(tmp_path):
    path = tmp_path / "cache.safetensors"
    good = conf._engine(2, 0)
    bad_nan = {l: {f: a.copy() for f, a in d.items()} for l, d in good.items()}
    bad_nan[1]["values"][0, 2, 1] = np.nan
    for layers, fp, rule, text in [
        (bad_nan, conf.FP, 10, "'layer.1.values' holds nan at [0, 2, 1]"),
        ({0: good[0], 2: good[1]}, conf.FP, 5, "layer 1 is missing"),
        ({0: good[0], 1: {"keys": good[1]["keys"][:, :3], "values": good[1]["values"][:, :3]}}, conf.FP, 9,
         "'layer.1.keys' holds 3 positions and 'layer.0.keys' 6"),
        (good, "AB" * 32, 2, "'model_fingerprint'"),
    ]:  # fmt: skip
        with pytest.raises(BadInput, match=rf"\(rule {rule}\)$") as e:
            cache.write_cache(path, layers, "float32", fp)
        assert text in str(e.value)
        assert not path.exists() and not list(tmp_path.iterdir())
    cache.write_cache(path, good, "float32", conf.FP)
    assert cache.read_header(path).cached == conf.P


def test_layout_names_what_differs():
    g = np.random.default_rng(0)
    layers = {l: {"keys": g.standard_normal((2, 4, 6)), "values": g.standard_normal((2, 4, 6))} for l in (3, 4)}
    layers[4]["values"] = layers[4]["values"][:, :3]
    with pytest.raises(ValueError, match=r"^layer 4 holds keys for 2 heads x 4 positions but values for 2 x 3$"):
        layout.llama_state_from_cache(layers, rope_interleaved=False, v_trans=False)
    layers[4]["keys"] = layers[4]["keys"][:, :2]
    with pytest.raises(ValueError, match=r"^layer 4 holds 2 positions, layer 3 4: "):
        layout.llama_state_from_cache(layers, rope_interleaved=False, v_trans=False)


# -- the engine folder's prompt (request.read_prompt) -----------------------------------------------------------


def _folder(d: Path, ids=None, cached="6", base="engine-f32") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    conf.write_base(base, d / "cache.safetensors")
    ids = np.arange(10, dtype=np.int32) if ids is None else ids
    meta = {"kind": "exact"} | ({"cached": cached} if cached is not None else {})
    safetensors.save(d / "prompt.safetensors", {"ids": ids}, meta)
    return d


def test_read_prompt(tmp_path):
    d = _folder(tmp_path / "ok")
    assert read_prompt(d) == (list(range(10)), 6)
    prompt, extra = vllm_request(d)
    assert prompt["prompt_token_ids"] == list(range(10)) and extra["kv_transfer_params"]["ridgefill_cache"].endswith(
        "cache.safetensors")


@pytest.mark.parametrize("make, message", [
    (lambda d: (_folder(d), (d / "prompt.safetensors").unlink()), "prompt.safetensors: missing"),
    (lambda d: (_folder(d), (d / "prompt.safetensors").write_bytes(b"\0" * 4)), "prompt.safetensors: not a readable"),
    (lambda d: _folder(d, cached=None), "metadata 'cached' is None, not a count of cached positions"),
    (lambda d: _folder(d, cached="six"), "metadata 'cached' is 'six', not a count"),
    (lambda d: _folder(d, cached="6.0"), "metadata 'cached' is '6.0', not a count"),
    (lambda d: _folder(d, cached="-1"), "metadata 'cached' is '-1', not a count"),
    (lambda d: _folder(d, cached="12"), "metadata 'cached' is 12 of 10 ids: the engine must compute at least the last"),
    (lambda d: _folder(d, cached="10"), "metadata 'cached' is 10 of 10 ids"),
    (lambda d: _folder(d, cached="5"), "metadata 'cached' is 5, but cache.safetensors holds 6 positions"),
    (lambda d: _folder(d, ids=np.arange(10, dtype=np.int32).reshape(2, 5)), "'ids' is I32 [2, 5], not a 1-D tensor"),
    (lambda d: _folder(d, ids=np.arange(10, dtype=np.float32)), "'ids' is F32 [10], not a 1-D tensor"),
    (lambda d: _folder(d, ids=np.arange(-1, 9, dtype=np.int32)), "'ids' holds a negative token id (-1)"),
    (lambda d: (_folder(d), (d / "cache.safetensors").unlink()), "cache.safetensors: missing (rule 1)"),
    (lambda d: _folder(d, base="compact-bf16"), "which an engine cannot load as it is"),
])  # fmt: skip
def test_read_prompt_refusals(tmp_path, make, message):
    d = tmp_path / "served"
    make(d)
    with pytest.raises(BadInput) as e:
        read_prompt(d)
    text = str(e.value)
    assert "\n" not in text and text.startswith(str(d)) and message in text, text


def test_the_corpus_script_runs_as_documented(corpus, tmp_path):
    out = subprocess.run([sys.executable, READER_DIR / "cache_conformance.py", tmp_path / "c"], capture_output=True,
                         text=True, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "c" / "expected.json").read_text()) == json.loads(
        (corpus / "expected.json").read_text())
    assert out.stdout.startswith(f"{len(CASES)} cases (")
    shutil.rmtree(tmp_path / "c")
