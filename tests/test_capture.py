"""Capture on tiny random models: statistics against a brute-force pass, resume, cache, refusals."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ridgefill.artifacts import Store, sha256_file
from ridgefill.formats import safetensors
from ridgefill.capture.artifact import COUNTS, DOCS, HELDOUT, STATS
from ridgefill.capture.run import CaptureConfig, capture
from ridgefill.capture.stats import Moments, merge, moments_of
from ridgefill.errors import BadInput, RidgefillError
from ridgefill.output import Output
from clirun import cli
from conftest import quiet

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def f(x):\n    return x * 2 + 1\n\nprint(f(3))\n" * 5,
    "All human beings are born free and equal in dignity and rights. " * 4,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 7,
    "for i in range(10):\n    total += i\n" * 8,
    "It was the best of times, it was the worst of times. " * 5,
]


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for i, t in enumerate(TEXTS):
        (d / f"doc{i}.txt").write_text(t)
    return d


def run(store, model, data, **kw):
    cfg = CaptureConfig(**{"splits": (2,), "chunk": 32, "held_out": 2, "held_out_rows": 40, **kw})
    return capture(store, str(model), [str(data)], cfg, quiet(), checkpoint_every=0)


def brute_force(model_dir, texts, docs, splits, max_length=256, outliers=None, earlier=()):
    """Moments from one plain forward per calibration document (no cache, no chunks), float64 numpy. With
    `outliers` = (ratio, chunk), a row whose split state's norm exceeds ratio x the median over its chunk's fitted
    rows is left out. `earlier` (offsets k): x is [h_S; h_{S-k}...] side by side, and the outlier rule reads its
    norm."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    want = {s: Moments.empty(L - s, d * (1 + len(earlier)), d) for s in splits}
    for i in docs:
        ids = tok(texts[i])["input_ids"][:max_length]
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        hs = [h[0].double().numpy() for h in hs]
        for s in splits:
            x = np.concatenate([hs[s], *(hs[s - k] for k in earlier)], axis=1)
            keep = np.arange(1, len(ids))  # a document's first row is not fitted
            if outliers:
                ratio, chunk = outliers
                norms = np.linalg.norm(x, axis=1)
                starts = keep // chunk * chunk
                lower_median = lambda v: np.sort(v)[(len(v) - 1) // 2]  # noqa: E731 (torch.median's, for an even count)
                medians = {c: lower_median(norms[max(c, 1) : c + chunk]) for c in set(starts.tolist())}
                keep = keep[norms[keep] <= ratio * np.array([medians[c] for c in starts])]
            want[s] = merge(want[s], moments_of(x[keep], np.stack([h[keep] for h in hs[s:L]])))
    return want


def brute_force_kv(model_dir, texts, docs, splits, max_length=256):
    """The key/value moments from one plain forward per calibration document: for every late attention layer l, its
    keys before RoPE and QK-norm and its values from its true input through the layer's own input norm, k_proj and
    v_proj ([rows, 2 * kv_heads * head_dim]), against the split state; float64 numpy. {split: (Moments, layers)}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * L
    attn = [l for l in range(L) if kinds[l] != "linear_attention"]
    layers = {s: [l for l in attn if l >= s] for s in splits}
    width = 2 * cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads)
    want = {s: Moments.empty(len(layers[s]), d, width) for s in splits}
    for i in docs:
        ids = tok(texts[i])["input_ids"][:max_length]
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            targets = {}
            for l in attn:
                layer = model.model.layers[l]
                h = layer.input_layernorm(hs[l][0])
                targets[l] = torch.cat([layer.self_attn.k_proj(h), layer.self_attn.v_proj(h)], 1).double().numpy()
        for s in splits:
            keep = np.arange(1, len(ids))
            x = hs[s][0].double().numpy()[keep]
            want[s] = merge(want[s], moments_of(x, np.stack([targets[l][keep] for l in layers[s]])))
    return {s: (want[s], layers[s]) for s in splits}


def assert_moments_close(got, want, rel):
    assert got.n == want.n
    for f in ("mean_x", "cxx", "mean_y", "cxy", "yy"):
        a, b = getattr(got, f), getattr(want, f)
        assert np.linalg.norm(a - b) <= rel * np.linalg.norm(b), (f, np.linalg.norm(a - b) / np.linalg.norm(b))


def test_outlier_rows_are_not_fitted(tmp_path, tiny_llama, corpus):
    """Rows whose split state exceeds the outlier ratio x their chunk's median norm are left out of the statistics
    (a random model has no real later sink: a low ratio makes some); the ratio is in the recipe, and bad ratios
    are refused."""
    store = Store(tmp_path / "store")
    art, _ = run(store, tiny_llama, corpus, splits=(1, 2), outlier_ratio=1.1)
    base, _ = run(store, tiny_llama, corpus, splits=(1, 2))
    assert art.recipe["outlier_ratio"] == 1.1 and base.recipe["outlier_ratio"] == 4.0 and art.id != base.id
    arrays, _ = safetensors.load(art.file(STATS))
    calib = [i for i, d in enumerate(json.loads(art.file(DOCS).read_text())) if d["role"] == "calibration"]
    texts = [(corpus / f"doc{i}.txt").read_text() for i in range(len(TEXTS))]
    want = brute_force(tiny_llama, texts, calib, (1, 2), outliers=(1.1, 32))
    everything = brute_force(tiny_llama, texts, calib, (1, 2))
    for s in (1, 2):
        got = Moments.from_arrays(arrays, f"raw.split{s}")
        assert 0 < everything[s].n - got.n < everything[s].n / 2  # some rows really are left out
        assert_moments_close(got, want[s], 1e-5)
    # solve fixes the fill's exact-row norm by the capture's own ratio: the rows left out of the fit run exactly
    from ridgefill.capture.artifact import load_heldout
    from ridgefill.solve import solve
    from ridgefill.solve.config import SolveConfig

    sol, _ = solve(store, art.id, SolveConfig(split=2, alphas=(1e-2,)), quiet())
    norms = np.linalg.norm(np.asarray(load_heldout(art)["hidden.2"], np.float64), axis=-1)
    assert sol.manifest["summary"]["exact_norm"] == pytest.approx(1.1 * float(np.median(norms)), rel=1e-12)
    for bad in (0.5, 1.0, -2.0):
        with pytest.raises(BadInput, match="outlier ratio .--outlier-ratio. must be 0 .off. or above 1"):
            run(Store(tmp_path / "bad"), tiny_llama, corpus, outlier_ratio=bad)
    assert not (tmp_path / "bad" / "capture").exists()


@pytest.mark.parametrize("product_dtype", ["float64", "float32"])
def test_stats_match_brute_force(tmp_path, tiny_llama, corpus, product_dtype):
    """Documents fed through the KV cache in 32-token chunks give the statistics of one-shot forwards."""
    from transformers import AutoTokenizer

    store = Store(tmp_path / "store")
    art, cached = run(store, tiny_llama, corpus, splits=(1, 2), product_dtype=product_dtype)
    assert not cached
    arrays, meta = safetensors.load(art.file(STATS))
    docs = json.loads(art.file(DOCS).read_text())
    calib = [i for i, d in enumerate(docs) if d["role"] == "calibration"]
    assert len(calib) == 4 and sum(d["role"] == "held_out" for d in docs) == 2
    texts = [(corpus / f"doc{i}.txt").read_text() for i in range(len(TEXTS))]
    assert max(d["tokens"] for d in docs) > 32  # some documents really span several chunks
    want = brute_force(tiny_llama, texts, calib, (1, 2))
    for s in (1, 2):
        assert_moments_close(Moments.from_arrays(arrays, f"raw.split{s}"), want[s],
                             1e-5 if product_dtype == "float32" else 1e-6)

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    vocab_counts = safetensors.load(art.file(COUNTS))[0]["counts"]
    ref = np.zeros_like(vocab_counts)
    for i in calib:
        np.add.at(ref, tok(texts[i])["input_ids"][:256], 1)
    np.testing.assert_array_equal(vocab_counts, ref)
    held, _ = safetensors.load_zst(art.file(HELDOUT))
    assert held["hidden.1"].shape[0] == held["doc"].shape[0] <= 40 + 2
    assert set(held["doc"].tolist()) == {i for i, d in enumerate(docs) if d["role"] == "held_out"}
    assert (held["pos"] != 0).all()  # never a document's first row


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_qwen3_next"])
def test_key_value_stats_match_brute_force(tmp_path, corpus, fixture, request):
    """Beside the inputs' moments, each split has the moments of the late attention layers' keys (before RoPE and
    QK-norm) and values, from the same rows: those of a one-shot forward through each layer's own norm and
    projections (Gated DeltaNet layers have none: a hybrid's kv moments cover its attention layers only)."""
    from ridgefill.capture.artifact import kv_layers, load_stats

    model = request.getfixturevalue(fixture)
    store = Store(tmp_path / "store")
    art, _ = run(store, model, corpus, splits=(1, 2))
    calib = [i for i, d in enumerate(json.loads(art.file(DOCS).read_text())) if d["role"] == "calibration"]
    texts = [(corpus / f"doc{i}.txt").read_text() for i in range(len(TEXTS))]
    want = brute_force_kv(model, texts, calib, (1, 2))
    for s in (1, 2):
        got = load_stats(art, s, target="kv")
        assert kv_layers(art, s) == want[s][1] and len(got.yy) == len(want[s][1]) > 0
        assert_moments_close(got, want[s][0], 1e-5)
        inputs = load_stats(art, s)  # the same rows: n, mean_x and cxx are the inputs' own
        assert got.n == inputs.n
        np.testing.assert_array_equal(got.mean_x, inputs.mean_x)
        np.testing.assert_allclose(got.cxx, inputs.cxx, rtol=1e-12, atol=0)
    if fixture == "tiny_qwen3_next":  # layers 0 and 2 are Gated DeltaNet: no keys, no kv moments
        assert kv_layers(art, 1) == [1, 3] and kv_layers(art, 2) == [3]


def test_cache_hit_loads_no_model(tmp_path, tiny_llama, corpus, monkeypatch):
    store = Store(tmp_path / "store")
    art, _ = run(store, tiny_llama, corpus)
    import ridgefill.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded on a cache hit"))
    again, cached = run(store, tiny_llama, corpus)
    assert cached and again.id == art.id


class Interrupt(Exception):
    pass


@pytest.mark.parametrize("stop_after", [0, 2, 4])
def test_resume_is_byte_identical(tmp_path, tiny_llama, corpus, stop_after):
    ref_art, _ = run(Store(tmp_path / "ref"), tiny_llama, corpus, splits=(1, 3))
    store = Store(tmp_path / "store")
    cfg = CaptureConfig(splits=(1, 3), chunk=32, held_out=2, held_out_rows=40)

    def boom(i):
        if i == stop_after:
            raise Interrupt

    with pytest.raises(Interrupt):
        capture(store, str(tiny_llama), [str(corpus)], cfg, quiet(), checkpoint_every=0, after_unit=boom)
    assert not (tmp_path / "store" / "capture" / ref_art.id).exists()
    seen = []
    art, cached = capture(store, str(tiny_llama), [str(corpus)], cfg, quiet(), checkpoint_every=0,
                          after_unit=seen.append)
    assert not cached and seen[0] == stop_after + 1  # resumed after the last finished unit
    for name in (STATS, HELDOUT, COUNTS, DOCS):
        assert art.file(name).read_bytes() == ref_art.file(name).read_bytes(), name


INSIDE = CaptureConfig(splits=(1, 2), chunk=16, held_out=2, held_out_rows=40)
EVERY_CHUNK = 1e-9  # seconds: a checkpoint is due after every chunk (0 means after every document only)


def chunk_ends(model, corpus, store, cfg=INSIDE, **kw):
    """An uninterrupted capture (checkpoints after every document only) and the (unit, position) after each chunk
    that ends inside its document."""
    ends = []
    art, _ = capture(store, str(model), [str(corpus)], cfg, quiet(), checkpoint_every=0,
                     after_chunk=lambda i, pos: ends.append((i, pos)), **kw)
    units = {i for i, _ in ends}
    assert len(units) == art.manifest["summary"]["units"]
    last = {i: max(p for j, p in ends if j == i) for i in units}
    return art, [(i, p) for i, p in ends if p < last[i]]


def interrupt_at(store, model, corpus, at, cfg=INSIDE, checkpoint_every=EVERY_CHUNK, **kw):
    """Run the capture until it has passed (unit, position) `at`, interrupt it there; the (unit, position) pairs it
    went through."""
    went = []

    def boom(i, pos):
        went.append((i, pos))
        if (i, pos) == at:
            raise Interrupt

    with pytest.raises(Interrupt):
        capture(store, str(model), [str(corpus)], cfg, quiet(), checkpoint_every=checkpoint_every, after_chunk=boom,
                **kw)
    return went


def state_file(store, art_id):
    return store.root / "capture" / f".work-{art_id}" / "state.safetensors"


def assert_same_artifact(art, ref_art):
    """Byte for byte, compared by sha256: on a mismatch pytest would otherwise diff megabytes of bytes (for hours)."""
    for name in (STATS, HELDOUT, COUNTS, DOCS):
        assert sha256_file(art.file(name)) == sha256_file(ref_art.file(name)), name


def check_saved_cache(arch, arrays, meta, pos, num_layers=4):
    """What the checkpoint holds of the model's cache at document position `pos`, per architecture: only the layers
    below the forward's stop point (the last decoder layer never runs), full-attention keys and values of every row
    so far, a sliding-window layer's window and its count of rows seen, a linear-attention layer's conv and
    recurrent states."""
    layout = json.loads(meta["cache"])["layers"]
    assert len(layout) == num_layers and int(meta["doc_pos"]) == pos
    names = {n for n in arrays if n.startswith("cache.")}
    assert not any(n.startswith(f"cache.{num_layers - 1}.") for n in names)  # the stop point's layer: empty
    last = layout[num_layers - 1]
    assert last.get("kv") is False or last.get("recurrent") == [False]
    for l in range(num_layers - 1):
        kind = layout[l]["type"]
        if kind == "LinearAttentionLayer":  # the hybrids' Gated DeltaNet layers
            assert {f"cache.{l}.conv.0", f"cache.{l}.recurrent.0"} <= names and f"cache.{l}.keys" not in names
            assert layout[l]["previous"] == [True] and arrays[f"cache.{l}.conv.0"].shape[-1] == 4  # the conv kernel
            continue
        keys, values = arrays[f"cache.{l}.keys"], arrays[f"cache.{l}.values"]
        assert keys.shape == values.shape and keys.shape[:2] == (1, 2)  # batch 1, 2 KV heads
        if kind == "DynamicSlidingWindowLayer":  # gemma3's local layers: the window (8) less one row, all rows seen
            assert keys.shape[2] == 7 and layout[l]["cumulative_length"] == pos
        else:
            assert kind == "DynamicLayer" and keys.shape[2] == pos
    kinds = {layout[l]["type"] for l in range(num_layers)}
    assert kinds == {"tiny_llama": {"DynamicLayer"}, "tiny_gemma3": {"DynamicLayer", "DynamicSlidingWindowLayer"},
                     "tiny_qwen3_next": {"DynamicLayer", "LinearAttentionLayer"},
                     "tiny_qwen3_5": {"DynamicLayer", "LinearAttentionLayer"}}[arch]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3", "tiny_qwen3_next", "tiny_qwen3_5"])
def test_resume_inside_a_document_is_byte_identical(tmp_path, corpus, request, arch):
    """Checkpoints fall between two chunks of a document too: the position reached, the statistics and held-out
    rows so far (the partial document's included) and the model's cache. Interrupted inside a calibration document,
    resumed (the document continues at the next chunk, the cache restored), interrupted again inside a held-out
    document, resumed to the end: the artifact is the uninterrupted run's, byte for byte."""
    model = request.getfixturevalue(arch)
    ref_art, ends = chunk_ends(model, corpus, Store(tmp_path / "ref"))
    units = ref_art.manifest["summary"]["units"]
    calib = [(i, p) for i, p in ends if i == 1]  # a calibration document (units 4, 5: the held-out ones)
    held = [(i, p) for i, p in ends if i == units - 2]
    first, second = calib[len(calib) // 2], held[len(held) // 2]
    assert first[1] > 8  # past gemma3's window: its sliding layers hold only the window

    store = Store(tmp_path / "store")
    went = interrupt_at(store, model, corpus, first)
    assert went[0] == ends[0] and went[-1] == first
    arrays, meta = safetensors.load(state_file(store, ref_art.id))  # the strict reader reads it
    assert meta["next_unit"] == str(first[0]) and int(arrays["part.raw.split1.n"][0]) == first[1] - 1  # row 0 unfitted
    check_saved_cache(arch, arrays, meta, first[1])

    went = interrupt_at(store, model, corpus, second)
    assert went[0] == (first[0], first[1] + 16)  # the document went on at the chunk after the checkpoint
    arrays, meta = safetensors.load(state_file(store, ref_art.id))
    assert meta["next_unit"] == str(second[0]) and "partheld.pos" in arrays  # the held-out rows so far
    assert arrays["partheld.pos"].max() < second[1]
    check_saved_cache(arch, arrays, meta, second[1])

    seen = []
    art, cached = capture(store, str(model), [str(corpus)], INSIDE, quiet(), checkpoint_every=EVERY_CHUNK,
                          after_chunk=lambda i, pos: seen.append((i, pos)))
    assert not cached and seen[0] == (second[0], second[1] + 16)
    assert art.manifest["summary"]["resumed_at_unit"] == second[0]
    assert_same_artifact(art, ref_art)
    assert not state_file(store, ref_art.id).parent.exists()


def test_a_linear_layers_row_count_is_saved_and_restored(tmp_path, tiny_qwen3_next, monkeypatch):
    """From transformers 5.25 a Gated DeltaNet cache layer counts the rows it has seen (`cumulative_length_linear`,
    the cache's length, which the positions read): a checkpoint keeps it, and one without it is refused where the
    layer counts (a transformers that counts is simulated here by giving the layer class the counter)."""
    import torch
    from transformers.cache_utils import LinearAttentionLayer

    from ridgefill.capture import kvstate
    from ridgefill.capture.forward import new_cache
    from ridgefill.models import load_model, resolve_model

    lm = load_model(resolve_model(str(tiny_qwen3_next), store_root=tmp_path), store_root=tmp_path)
    cache = new_cache(lm)
    with torch.no_grad():
        lm.model(input_ids=torch.arange(3, 40)[None], cache=cache, use_cache=True)
    linear = [l for l, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionLayer)]
    assert linear
    for l in linear:
        cache.layers[l].cumulative_length_linear = torch.tensor(37)
    saved = kvstate.snapshot(cache)
    assert [saved.layout["layers"][l]["cumulative_length_linear"] for l in linear] == [37] * len(linear)
    monkeypatch.setattr(LinearAttentionLayer, "cumulative_length_linear", torch.tensor(0), raising=False)
    back = kvstate.restore(lm, saved, lambda: new_cache(lm), "ckpt/")
    assert [int(back.layers[l].cumulative_length_linear) for l in linear] == [37] * len(linear)
    for l in linear:
        del saved.layout["layers"][l]["cumulative_length_linear"]
    with pytest.raises(RidgefillError, match=rf"^the capture checkpoint in ckpt/ stopped inside a document .* \(cache "
                       rf"layer {linear[0]} counts its rows \(transformers 5.25 or newer\), which the checkpoint did not "
                       "save\\); delete ckpt/ to start the capture over$"):
        kvstate.restore(lm, saved, lambda: new_cache(lm), "ckpt/")


@pytest.mark.parametrize("arch", ["tiny_gemma3", "tiny_qwen3_next"])
def test_a_snapshot_cut_keeps_the_first_layers(tmp_path, request, arch):
    """`snapshot(cache, layers=n)` keeps the first n layers exactly (a sliding layer with its count of rows) and
    restores the later ones uninitialized, as a forward that stopped before them leaves them; a cut with a Gated
    DeltaNet layer after it is not saved."""
    import torch

    from ridgefill.capture import kvstate
    from ridgefill.capture.forward import new_cache
    from ridgefill.models import load_model, resolve_model

    lm = load_model(resolve_model(str(request.getfixturevalue(arch)), store_root=tmp_path), store_root=tmp_path)
    cache = new_cache(lm)
    with torch.no_grad():
        lm.model(input_ids=torch.arange(3, 40)[None], cache=cache, use_cache=True)
    if arch == "tiny_qwen3_next":
        with pytest.raises(kvstate.NotSaved, match="with Gated DeltaNet layer"):
            kvstate.snapshot(cache, layers=1)
        return
    saved = kvstate.snapshot(cache, layers=2)
    assert sorted(saved.tensors) == ["cache.0.keys", "cache.0.values", "cache.1.keys", "cache.1.values"]
    back = kvstate.restore(lm, saved, lambda: new_cache(lm), "work/")
    for l, (a, b) in enumerate(zip(cache.layers, back.layers)):
        assert type(a) is type(b)
        if l < 2:
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
            assert getattr(a, "cumulative_length", None) == getattr(b, "cumulative_length", None)
        else:
            assert a.is_initialized and not b.is_initialized
    assert any(getattr(layer, "cumulative_length", 0) == 37 for layer in back.layers[:2])


@pytest.mark.parametrize("arch, placement", [("tiny_qwen3_next", "bfloat16"), ("tiny_gemma3", "bfloat16"),
                                             ("tiny_llama", "disk offload")])
def test_resume_inside_a_document_in_bfloat16_and_offloaded(tmp_path, corpus, request, arch, placement):
    """The cache is saved in its own dtypes (bfloat16 keys and values as their bits, a Gated DeltaNet's float32
    state beside them) and restored on each layer's device, also where accelerate offloads layers to disk."""
    from ridgefill.models.device import where

    if placement == "bfloat16":
        place = where(device="cpu", dtype="bfloat16")
    else:
        place = where(device_map={"model.embed_tokens": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu",
                                  "model.layers.0": "disk", "model.layers.1": "cpu", "model.layers.2": "disk",
                                  "model.layers.3": "cpu", "model.norm": "cpu"})
    model = request.getfixturevalue(arch)
    ref_art, ends = chunk_ends(model, corpus, Store(tmp_path / "ref"), place=place)
    at = [e for e in ends if e[0] == 1][6]
    store = Store(tmp_path / "store")
    interrupt_at(store, model, corpus, at, place=place)
    entries, _ = safetensors.read_header(state_file(store, ref_art.id))
    dtypes = {e.dtype for n, e in entries.items() if n.startswith("cache.")}
    assert dtypes == {"bfloat16": {"BF16"} | ({"F32"} if arch == "tiny_qwen3_next" else set()),
                      "disk offload": {"F32"}}[placement], dtypes
    art, _ = capture(store, str(model), [str(corpus)], INSIDE, quiet(), checkpoint_every=EVERY_CHUNK, place=place)
    assert art.manifest["summary"]["resumed_at_unit"] == 1
    assert_same_artifact(art, ref_art)


def test_resume_inside_a_document_in_a_block_of_several(tmp_path, monkeypatch):
    """With more documents than blocks, a block holds several units: a checkpoint inside its second document holds
    the first one's statistics and the second's so far together, and the resumed run is byte-identical."""
    import ridgefill.capture.runner as capture_run  # where make_blocks is called
    from ridgefill.capture.units import MAX_BLOCKS
    from tiny import make_tiny_model

    made = []
    blocks_of = capture_run.make_blocks
    monkeypatch.setattr(capture_run, "make_blocks", lambda units: made.append(blocks_of(units)) or made[-1])
    model = make_tiny_model(tmp_path / "llama", arch="llama", layers=3, hidden=32)
    data = tmp_path / "many"
    data.mkdir()
    for i in range(MAX_BLOCKS + 8):
        (data / f"d{i:03d}.txt").write_text(TEXTS[i % len(TEXTS)][: 60 + 7 * (i % 5)])
    cfg = CaptureConfig(splits=(1,), chunk=8, held_out=2, held_out_rows=40)
    ref_art, ends = chunk_ends(model, data, Store(tmp_path / "ref"), cfg)
    b, a = next((b, a) for b, (a, z) in enumerate(made[0]) if z - a >= 2)
    at = [e for e in ends if e[0] == a + 1][1]  # the block's second document, after its second chunk
    store = Store(tmp_path / "store")
    interrupt_at(store, model, data, at, cfg)
    arrays, meta = safetensors.load(state_file(store, ref_art.id))
    assert (meta["next_block"], meta["next_unit"], meta["doc_pos"]) == (str(b), str(a + 1), str(at[1]))
    assert int(arrays["part.raw.split1.n"][0]) > at[1]  # the block's first document is in there too
    art, _ = capture(store, str(model), [str(data)], cfg, quiet(), checkpoint_every=EVERY_CHUNK)
    assert art.manifest["summary"]["resumed_at_unit"] == a + 1
    assert_same_artifact(art, ref_art)


def test_a_cache_that_cannot_be_saved_or_restored(tmp_path, tiny_gemma3, corpus, monkeypatch, capsys):
    """A cache with a layer kvstate does not know: one warning, checkpoints between documents only, the same
    artifact. A checkpoint whose cache layers are not the fresh cache's (another transformers, say): one line that
    says to delete the work folder, nothing resumed wrongly."""
    from ridgefill.capture import forward, kvstate

    ref_art, ends = chunk_ends(tiny_gemma3, corpus, Store(tmp_path / "ref"))
    at = [e for e in ends if e[0] == 1][4]
    with monkeypatch.context() as m:
        m.setattr(kvstate, "_classes", dict)  # no layer class known
        store = Store(tmp_path / "plain")
        saved_at = []  # the position inside its document each checkpoint there is records

        def look(i, pos):
            if state_file(store, ref_art.id).exists():
                saved_at.append(safetensors.read_header(state_file(store, ref_art.id))[1]["doc_pos"])

        art, _ = capture(store, str(tiny_gemma3), [str(corpus)], INSIDE, Output(), checkpoint_every=EVERY_CHUNK,
                         after_chunk=look)
    assert len(saved_at) > 20 and set(saved_at) == {"0"}
    err = capsys.readouterr().err
    assert err.count("capture checkpoints fall between documents only: the model's cache cannot be saved inside "
                     "one (cache layer 0 is a DynamicSlidingWindowLayer)") == 1
    assert_same_artifact(art, ref_art)

    store = Store(tmp_path / "store")
    interrupt_at(store, tiny_gemma3, corpus, at)
    from transformers import DynamicCache

    with monkeypatch.context() as m:
        m.setattr(forward, "new_cache", lambda lm: DynamicCache())  # no config: every layer a DynamicLayer
        with pytest.raises(RidgefillError, match=r"the capture checkpoint in .*\.work-.* stopped inside a document and "
                           r"holds the model's cache, which cannot be restored here \(cache layer 0 was a "
                           r"DynamicSlidingWindowLayer, is a DynamicLayer now\); delete .* to start the capture over"):
            capture(store, str(tiny_gemma3), [str(corpus)], INSIDE, quiet(), checkpoint_every=EVERY_CHUNK)
    art, _ = capture(store, str(tiny_gemma3), [str(corpus)], INSIDE, quiet(), checkpoint_every=EVERY_CHUNK)
    assert_same_artifact(art, ref_art)  # the checkpoint was left as it was


def test_a_checkpoint_holds_one_cache_tensor_on_the_host_at_a_time(tmp_path):
    """The state file is written tensor by tensor: each cache tensor is fetched (copied to the host) only when its
    turn comes and is let go before the next one; the strict safetensors reader reads the file, and `State.load`
    gives the position and each cache tensor back, read only when asked for."""
    import weakref

    from ridgefill.capture.checkpoint import State
    from ridgefill.capture.dist import World
    from ridgefill.capture.kvstate import Lazy, Snapshot

    alive = []

    def lazy(i):
        def fetch():
            assert all(r() is None for r in alive), "a cache tensor was still held when the next one was fetched"
            a = np.full((2, 3), i, dtype=np.float32)
            alive.append(weakref.ref(a))
            return a

        return Lazy("F32", (2, 3), 24, fetch)

    empty = lambda: {("raw", 1, "input"): Moments.empty(2, 3, 3)}  # noqa: E731
    st = State(empty())
    st.doc_pos, st.doc_cache = 5, Snapshot({"version": 1, "layers": []}, {f"cache.{i}.keys": lazy(i) for i in range(4)})
    st.save(tmp_path, "the-id")
    assert len(alive) == 4
    arrays, meta = safetensors.load(tmp_path / "state.safetensors")
    assert meta["doc_pos"] == "5" and json.loads(meta["cache"]) == {"version": 1, "layers": []}
    assert [int(arrays[f"cache.{i}.keys"][0, 0]) for i in range(4)] == [0, 1, 2, 3]
    back = State.load(tmp_path, "the-id", [("raw", 1, "input")], empty, World())
    assert back.doc_pos == 5 and set(back.doc_cache.tensors) == {f"cache.{i}.keys" for i in range(4)}
    np.testing.assert_array_equal(back.doc_cache.tensors["cache.2.keys"].fetch(), np.full((2, 3), 2, np.float32))
    assert State.load(tmp_path, "another-id", [("raw", 1, "input")], empty, World()).doc_pos == 0


def test_checkpoint_every_0_saves_no_cache(tmp_path, tiny_llama, corpus):
    """`--checkpoint-every 0` checkpoints after every document (the CLI's promise), never inside one: interrupted
    inside a document, the run resumes at that document's start."""
    ref_art, ends = chunk_ends(tiny_llama, corpus, Store(tmp_path / "ref"))
    store = Store(tmp_path / "store")
    at = [e for e in ends if e[0] == 2][3]
    interrupt_at(store, tiny_llama, corpus, at, checkpoint_every=0)
    arrays, meta = safetensors.load(state_file(store, ref_art.id))
    assert (meta["next_unit"], meta["doc_pos"]) == ("2", "0") and not any(n.startswith("cache.") for n in arrays)
    seen = []
    art, _ = capture(store, str(tiny_llama), [str(corpus)], INSIDE, quiet(), checkpoint_every=0,
                     after_chunk=lambda i, pos: seen.append((i, pos)))
    assert seen[0] == (2, 16)
    assert_same_artifact(art, ref_art)


# Runs `ridgefill ARGS...` in a child process that counts the documents it feeds through the model (one line per
# call of capture.forward.document_chunks, appended to $COUNT_FILE as it happens) and, when $PAUSE_AT is set,
# stops still right after the checkpoint that records PAUSE_AT finished units (touching $PAUSED), so that the test
# can kill -9 it at a known place; with $PAUSE_POS too, right after the checkpoint inside unit PAUSE_AT at that
# position of its document.
CHILD = """
import os, sys, time
from pathlib import Path

import ridgefill.capture.forward as forward
import ridgefill.capture.checkpoint as checkpoint

count, pause_at, paused = Path(os.environ["COUNT_FILE"]), int(os.environ.get("PAUSE_AT", "-1")), os.environ["PAUSED"]
pause_pos = int(os.environ.get("PAUSE_POS", "0"))
chunks, save = forward.document_chunks, checkpoint.State.save

def counted(lm, ids, *a, **k):
    with count.open("a") as f:
        f.write(f"{len(ids)}\\n")
    yield from chunks(lm, ids, *a, **k)

def pausing(self, work, run_id):
    save(self, work, run_id)
    if self.next_unit == pause_at and self.doc_pos == pause_pos:
        Path(paused).write_text(str(self.next_unit))
        time.sleep(600)

forward.document_chunks, checkpoint.State.save = counted, pausing
from ridgefill.cli import main
sys.argv = ["ridgefill", *sys.argv[1:]]
main()
"""


def test_kill_9_resumes_where_it_stopped_and_is_byte_identical(tmp_path, tiny_llama, corpus, monkeypatch):
    """kill -9 twice, then the same command: each run starts at the unit the last checkpoint recorded, feeds
    only the documents from there on, and the result is the uninterrupted run's, byte for byte."""
    import ridgefill.capture.forward as forward

    fed = []  # token counts of the documents an uninterrupted run feeds, in order
    chunks = forward.document_chunks

    def counted(lm, ids, *a, **k):
        fed.append(len(ids))
        yield from chunks(lm, ids, *a, **k)

    monkeypatch.setattr(forward, "document_chunks", counted)
    ref_art, _ = run(Store(tmp_path / "ref"), tiny_llama, corpus)
    n = ref_art.manifest["summary"]["units"]
    assert n == len(fed) == 6 and ref_art.manifest["summary"]["resumed_at_unit"] == 0
    assert ref_art.manifest["summary"]["units_computed"] == n

    store = tmp_path / "store"
    args = ["capture", tiny_llama, "--data", corpus, "--split", 2, "--chunk", 32, "--held-out", 2,
            "--held-out-rows", 40, "--checkpoint-every", 0, "--store", store]
    state = store / "capture" / f".work-{ref_art.id}" / "state.safetensors"
    (tmp_path / "child.py").write_text(CHILD)

    def start(i: int, pause_at: int | None):
        env = {**os.environ, "COUNT_FILE": str(tmp_path / f"count{i}"), "PAUSED": str(tmp_path / f"paused{i}"),
               "OMP_NUM_THREADS": "1", **({"PAUSE_AT": str(pause_at)} if pause_at is not None else {})}
        (tmp_path / f"count{i}").write_text("")
        return subprocess.Popen([sys.executable, tmp_path / "child.py", *map(str, args)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def counted_in(i: int) -> list[int]:
        return [int(x) for x in (tmp_path / f"count{i}").read_text().split()]

    def checkpointed() -> int:
        return int(safetensors.load(state)[1]["next_unit"])

    def wait_for(p, ready, what):
        deadline = time.time() + 180
        while not ready():
            assert p.poll() is None, f"the run ended before {what}: {p.communicate()[1]}"
            assert time.time() < deadline, f"no {what} in 180 s"
            time.sleep(0.005)

    # 1: killed at an arbitrary moment once the first checkpoint exists (it cannot get past unit 3: it would
    #    stop still there)
    p = start(1, pause_at=3)
    wait_for(p, state.exists, "first checkpoint")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    first = checkpointed()
    assert 1 <= first <= 3
    assert not (store / "capture" / ref_art.id).exists()
    # 2: resumes there, killed -9 while still right after the checkpoint of unit 5
    p = start(2, pause_at=5)
    wait_for(p, (tmp_path / "paused2").exists, "unit 5")
    os.kill(p.pid, signal.SIGKILL)
    _, err = p.communicate()
    assert f"resuming capture {ref_art.id} at unit {first}/{n} " in err
    assert counted_in(2) == fed[first:5]  # units first..4 only: nothing before the checkpoint again
    assert checkpointed() == 5
    # 3: the same command to the end
    p = start(3, pause_at=None)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert f"resuming capture {ref_art.id} at unit 5/{n} " in err
    assert counted_in(3) == fed[5:]
    assert out.strip() == ref_art.id
    final = Store(store).get(ref_art.id, stage="capture")
    assert final.manifest["summary"]["resumed_at_unit"] == 5 and final.manifest["summary"]["units_computed"] == n - 5
    assert not state.parent.exists()  # the resumable work is gone once the artifact is in place
    for name in (STATS, HELDOUT, COUNTS, DOCS):
        assert final.file(name).read_bytes() == ref_art.file(name).read_bytes(), name


def test_kill_9_inside_a_document_resumes_there(tmp_path, tiny_gemma3, corpus):
    """kill -9 right after a checkpoint inside a document (the state file renamed into place, the cache in it),
    then the same command: it continues that document from the checkpoint's chunk and the artifact is the
    uninterrupted run's, byte for byte."""
    ref_art, ends = chunk_ends(tiny_gemma3, corpus, Store(tmp_path / "ref"))
    n = ref_art.manifest["summary"]["units"]
    unit, pos = [e for e in ends if e[0] == 2][5]
    store = tmp_path / "store"
    args = ["capture", tiny_gemma3, "--data", corpus, "--split", 1, "--split", 2, "--chunk", 16, "--held-out", 2,
            "--held-out-rows", 40, "--checkpoint-every", EVERY_CHUNK, "--store", store]
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "COUNT_FILE": str(tmp_path / "count"), "PAUSED": str(tmp_path / "paused"),
           "OMP_NUM_THREADS": "1"}
    child = [sys.executable, tmp_path / "child.py", *map(str, args)]
    p = subprocess.Popen(child, env={**env, "PAUSE_AT": str(unit), "PAUSE_POS": str(pos)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not (tmp_path / "paused").exists():
        assert p.poll() is None, f"the run ended before its checkpoint inside unit {unit}: {p.communicate()[1]}"
        assert time.time() < deadline, "no checkpoint inside the document in 180 s"
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    meta = safetensors.read_header(state_file(Store(store), ref_art.id))[1]
    assert (meta["next_unit"], meta["doc_pos"]) == (str(unit), str(pos))
    (tmp_path / "count").write_text("")
    p = subprocess.Popen(child, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert (f"resuming capture {ref_art.id} at unit {unit}/{n} (block {unit + 1} of {n}), "  # a unit a block here
            f"inside its document at token {pos} of ") in err
    assert out.strip() == ref_art.id
    assert len((tmp_path / "count").read_text().split()) == n - unit  # that document on, none before
    assert_same_artifact(Store(store).get(ref_art.id, stage="capture"), ref_art)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_capture_never_runs_the_last_layer_or_the_head(tmp_path, corpus, monkeypatch, request, arch):
    """Every late layer's input is recorded before the last decoder layer runs; the forward stops there, so the
    last layer, the final norm and the LM head are never called (counted on the loaded model's own modules)."""
    import ridgefill.models as models

    calls = {}
    load = models.load_model

    def counting(*a, **k):
        lm = load(*a, **k)
        ad = lm.adapter
        watched = {"layer -2": ad.layers[-2], "last layer": ad.layers[-1], "final norm": ad.base.norm,
                   "lm head": lm.model.get_output_embeddings(), "causal lm": lm.model}
        for name, module in watched.items():
            calls[name] = 0

            def forward(*args, _name=name, _forward=module.forward, **kw):
                calls[_name] += 1
                return _forward(*args, **kw)

            module.forward = forward
        return lm

    monkeypatch.setattr(models, "load_model", counting)
    art, cached = run(Store(tmp_path / "store"), request.getfixturevalue(arch), corpus, splits=(1, 2))
    assert not cached
    chunks = sum(-(-d["tokens"] // 32) for d in json.loads(art.file(DOCS).read_text()))
    assert calls["layer -2"] == chunks  # the hooks count: every chunk ran the layers up to the last one
    assert calls["last layer"] == calls["final norm"] == calls["lm head"] == calls["causal lm"] == 0


def test_chat_statistics_kept_apart(tmp_path, tiny_llama, corpus):
    art, _ = run(Store(tmp_path / "s"), tiny_llama, corpus, chat=True)
    arrays, meta = safetensors.load(art.file(STATS))
    assert meta["variants"] == "raw,chat"
    raw_only, _ = run(Store(tmp_path / "r"), tiny_llama, corpus)
    np.testing.assert_array_equal(arrays["raw.split2.cxx"], safetensors.load(raw_only.file(STATS))[0]["raw.split2.cxx"])
    assert arrays["chat.split2.n"][0] > arrays["raw.split2.n"][0]  # the template adds tokens


def test_non_utf8_is_replaced_with_a_warning(tmp_path, tiny_llama, corpus, capsys):
    (corpus / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e ".encode("latin-1") * 10)
    capture(Store(tmp_path / "s"), str(tiny_llama), [str(corpus)],
            CaptureConfig(splits=(2,), chunk=32, held_out=1), Output(), checkpoint_every=0)
    assert "1 file(s) had non-UTF-8 bytes; 40 replaced with U+FFFD" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--split", "0"], "split 0 is out of range: the model has 4 layers (use 1..3)"),
        (["--split", "4"], "split 4 is out of range: the model has 4 layers (use 1..3)"),
        (["--data", "{tmp}/nope"], "data path '{tmp}/nope' does not exist"),
        (["--data", "{tmp}/empty"], "no documents with text in: {tmp}/empty"),
        (["--held-out", "9"], "--held-out 9 leaves no calibration documents (the corpus has 6)"),
        (["--chunk", "1"], "--chunk must be at least 2 tokens (got 1)"),
        (["--max-length", "1"], "--max-length must be at least 2 tokens (got 1)"),
        (["--max-length", "300"], "--max-length 300 is longer than the model's context (256 positions)"),
        (["--product-dtype", "float16"], "unknown product dtype 'float16' for --product-dtype (choose float32 or "
                                         "float64)"),
        (["--outlier-ratio", "0.5"], "the outlier ratio (--outlier-ratio) must be 0 (off) or above 1, got 0.5"),
        (["--device", "cuda"], "--device cuda: torch sees no CUDA device on this machine (use --device cpu or auto)"),
        (["--device", "tpu"], "unknown device 'tpu' (choose auto, cpu, cuda or cuda:N)"),
        (["--dtype", "float8"], "unknown dtype 'float8' (choose one of: auto, float32, bfloat16, float16)"),
        (["--max-memory", "cpu=1GiB"], "--max-memory only applies with --device-map auto"),
        (["--split", "2", "--earlier", "1,3"], "--earlier 3 reaches below layer 0 at split 2 (the deepest earlier "
                                               "state there is h_0, offset 2)"),
        (["--earlier", "0"], "--earlier takes offsets k >= 1 below the split (the states h_{S-k}), got 0"),
        (["--earlier", "1,1"], "--earlier names an offset twice: 1, 1"),
        (["--earlier", "1;2"], "--earlier takes offsets separated by commas (like 2,7,13) or none, got '1;2'"),
    ],
)
def test_capture_refusals(tmp_path, tiny_llama, corpus, extra, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n\n")
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    data = [] if "--data" in extra else ["--data", corpus]
    store = tmp_path / "store"
    r = cli("capture", tiny_llama, *data, *extra, "--store", store)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "Error: " + message.replace("{tmp}", str(tmp_path))
    assert not store.exists()  # a refusal writes nothing: not even the store or its fingerprint cache


def test_missing_model_path(tmp_path, corpus):
    r = cli("capture", tmp_path / "no-model", "--data", corpus, "--store", tmp_path / "store")
    assert r.returncode == 2
    assert r.stderr.strip() == f"Error: model path '{tmp_path / 'no-model'}' does not exist"
    assert "Traceback" not in r.stderr


def test_default_checkpoints_take_at_most_a_tenth_of_the_run():
    """--checkpoint-every as given is honoured; by default a checkpoint is due every 30 s, or, where the last one
    took long to write (gigabytes of moments), only once 9x that time has passed, so writing is <= 1/10 of the run."""
    from ridgefill.capture.config import checkpoint_due

    assert checkpoint_due(30.0, None, 0.5) and not checkpoint_due(29.9, None, 0.5)
    assert not checkpoint_due(30.0, None, 12.0)  # a 12 s checkpoint: the next one after 108 s
    assert not checkpoint_due(107.9, None, 12.0) and checkpoint_due(108.1, None, 12.0)
    assert checkpoint_due(1e-9, 1e-9, 12.0) and checkpoint_due(5.0, 5.0, 60.0)  # an explicit interval as given
