"""Capture on tiny random models: statistics against a brute-force pass, resume, cache, refusals."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ridgefill.artifacts import Store, tensors
from ridgefill.capture.run import COUNTS, DOCS, HELDOUT, STATS, CaptureConfig, capture
from ridgefill.capture.stats import Moments, merge, moments_of
from ridgefill.output import Output
from clirun import cli

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


def quiet():
    return Output(json_mode=False, quiet=True)


def run(store, model, data, **kw):
    cfg = CaptureConfig(**{"splits": (2,), "chunk": 32, "held_out": 2, "held_out_rows": 40, **kw})
    return capture(store, str(model), [str(data)], cfg, quiet(), checkpoint_every=0)


def brute_force(model_dir, texts, docs, splits, max_length=256):
    """Moments from one plain forward per calibration document (no cache, no chunks), float64 numpy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    want = {s: Moments.empty(L - s, d, d) for s in splits}
    for i in docs:
        ids = tok(texts[i])["input_ids"][:max_length]
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        hs = [h[0, 1:].double().numpy() for h in hs]  # a document's first row is not fitted
        for s in splits:
            want[s] = merge(want[s], moments_of(hs[s], np.stack(hs[s:L])))
    return want


def assert_moments_close(got, want, rel):
    assert got.n == want.n
    for f in ("mean_x", "cxx", "mean_y", "cxy", "yy"):
        a, b = getattr(got, f), getattr(want, f)
        assert np.linalg.norm(a - b) <= rel * np.linalg.norm(b), (f, np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("product_dtype", ["float64", "float32"])
def test_stats_match_brute_force(tmp_path, tiny_llama, corpus, product_dtype):
    """Documents fed through the KV cache in 32-token chunks give the statistics of one-shot forwards."""
    from transformers import AutoTokenizer

    store = Store(tmp_path / "store")
    art, cached = run(store, tiny_llama, corpus, splits=(1, 2), product_dtype=product_dtype)
    assert not cached
    arrays, meta = tensors.load(art.file(STATS))
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
    vocab_counts = tensors.load(art.file(COUNTS))[0]["counts"]
    ref = np.zeros_like(vocab_counts)
    for i in calib:
        np.add.at(ref, tok(texts[i])["input_ids"][:256], 1)
    np.testing.assert_array_equal(vocab_counts, ref)
    held, _ = tensors.load_zst(art.file(HELDOUT))
    assert held["hidden.1"].shape[0] == held["doc"].shape[0] <= 40 + 2
    assert set(held["doc"].tolist()) == {i for i, d in enumerate(docs) if d["role"] == "held_out"}
    assert (held["pos"] != 0).all()  # never a document's first row


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




def test_kill_9_then_rerun_is_byte_identical(tmp_path, tiny_llama, corpus):
    ref_art, _ = run(Store(tmp_path / "ref"), tiny_llama, corpus)
    store = tmp_path / "store"
    args = ["-m", "ridgefill", "capture", tiny_llama, "--data", corpus, "--split", 2, "--chunk", 32,
            "--held-out", 2, "--held-out-rows", 40, "--checkpoint-every", 0, "--store", store]
    state = store / "capture" / f".work-{ref_art.id}" / "state.safetensors"
    kills = 0
    for delay in (0.0, 0.3):
        p = subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        before = state.stat().st_mtime_ns if state.exists() else None
        while time.time() < deadline and p.poll() is None:
            if state.exists() and state.stat().st_mtime_ns != before:
                break
            time.sleep(0.005)
        time.sleep(delay)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            kills += 1
        p.wait()
    assert kills >= 1
    interrupted = state.exists()
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if interrupted:  # it resumed past the first document rather than starting over
        assert f"resuming capture {ref_art.id} at unit " in r.stderr
        assert " at unit 0/" not in r.stderr
    assert r.stdout.strip() == ref_art.id
    final = store / "capture" / ref_art.id
    for name in (STATS, HELDOUT, COUNTS, DOCS):
        assert (final / name).read_bytes() == ref_art.file(name).read_bytes(), name


def test_chat_statistics_kept_apart(tmp_path, tiny_llama, corpus):
    art, _ = run(Store(tmp_path / "s"), tiny_llama, corpus, chat=True)
    arrays, meta = tensors.load(art.file(STATS))
    assert meta["variants"] == "raw,chat"
    raw_only, _ = run(Store(tmp_path / "r"), tiny_llama, corpus)
    np.testing.assert_array_equal(arrays["raw.split2.cxx"], tensors.load(raw_only.file(STATS))[0]["raw.split2.cxx"])
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
        (["--product-dtype", "float16"], "unknown product dtype 'float16' (choose float32 or float64)"),
        (["--device", "cuda"], "--device cuda: torch sees no CUDA device on this machine (use --device cpu or auto)"),
        (["--device", "tpu"], "unknown device 'tpu' (choose auto, cpu, cuda or cuda:N)"),
        (["--dtype", "float8"], "unknown dtype 'float8' (choose one of: auto, float32, bfloat16, float16)"),
        (["--max-memory", "cpu=1GiB"], "--max-memory only applies with --device-map auto"),
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
    assert not store.exists() or not any((store / "capture").glob("*"))


def test_missing_model_path(tmp_path, corpus):
    r = cli("capture", tmp_path / "no-model", "--data", corpus, "--store", tmp_path / "store")
    assert r.returncode == 2
    assert r.stderr.strip() == f"Error: model path '{tmp_path / 'no-model'}' does not exist"
    assert "Traceback" not in r.stderr
