"""Capture on tiny random models: statistics against a brute-force pass, resume, cache, refusals."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ridgefill.artifacts import Store
from ridgefill.formats import safetensors
from ridgefill.capture.artifact import COUNTS, DOCS, HELDOUT, STATS
from ridgefill.capture.run import CaptureConfig, capture
from ridgefill.capture.stats import Moments, merge, moments_of
from ridgefill.errors import BadInput
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


def brute_force(model_dir, texts, docs, splits, max_length=256, outliers=None):
    """Moments from one plain forward per calibration document (no cache, no chunks), float64 numpy. With
    `outliers` = (ratio, chunk), a row whose split state's norm exceeds ratio x the median over its chunk's fitted
    rows is left out."""
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
        hs = [h[0].double().numpy() for h in hs]
        for s in splits:
            keep = np.arange(1, len(ids))  # a document's first row is not fitted
            if outliers:
                ratio, chunk = outliers
                norms = np.linalg.norm(hs[s], axis=1)
                starts = keep // chunk * chunk
                lower_median = lambda v: np.sort(v)[(len(v) - 1) // 2]  # noqa: E731 (torch.median's, for an even count)
                medians = {c: lower_median(norms[max(c, 1) : c + chunk]) for c in set(starts.tolist())}
                keep = keep[norms[keep] <= ratio * np.array([medians[c] for c in starts])]
            want[s] = merge(want[s], moments_of(hs[s][keep], np.stack([h[keep] for h in hs[s:L]])))
    return want


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
    assert art.recipe["outlier_ratio"] == 1.1 and base.recipe["outlier_ratio"] == 20.0 and art.id != base.id
    arrays, _ = safetensors.load(art.file(STATS))
    calib = [i for i, d in enumerate(json.loads(art.file(DOCS).read_text())) if d["role"] == "calibration"]
    texts = [(corpus / f"doc{i}.txt").read_text() for i in range(len(TEXTS))]
    want = brute_force(tiny_llama, texts, calib, (1, 2), outliers=(1.1, 32))
    everything = brute_force(tiny_llama, texts, calib, (1, 2))
    for s in (1, 2):
        got = Moments.from_arrays(arrays, f"raw.split{s}")
        assert 0 < everything[s].n - got.n < everything[s].n / 2  # some rows really are left out
        assert_moments_close(got, want[s], 1e-5)
    for bad in (0.5, 1.0, -2.0):
        with pytest.raises(BadInput, match="outlier ratio must be 0 .off. or above 1"):
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




# Runs `ridgefill ARGS...` in a child process that counts the documents it feeds through the model (one line per
# call of capture.forward.document_chunks, appended to $COUNT_FILE as it happens) and, when $PAUSE_AT is set,
# stops still right after the checkpoint that records PAUSE_AT finished units (touching $PAUSED), so that the test
# can kill -9 it at a known place.
CHILD = """
import os, sys, time
from pathlib import Path

import ridgefill.capture.forward as forward
import ridgefill.capture.checkpoint as checkpoint

count, pause_at, paused = Path(os.environ["COUNT_FILE"]), int(os.environ.get("PAUSE_AT", "-1")), os.environ["PAUSED"]
chunks, save = forward.document_chunks, checkpoint.State.save

def counted(lm, ids, *a, **k):
    with count.open("a") as f:
        f.write(f"{len(ids)}\\n")
    yield from chunks(lm, ids, *a, **k)

def pausing(self, work, run_id):
    save(self, work, run_id)
    if self.next_unit == pause_at:
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
    assert not store.exists()  # a refusal writes nothing: not even the store or its fingerprint cache


def test_missing_model_path(tmp_path, corpus):
    r = cli("capture", tmp_path / "no-model", "--data", corpus, "--store", tmp_path / "store")
    assert r.returncode == 2
    assert r.stderr.strip() == f"Error: model path '{tmp_path / 'no-model'}' does not exist"
    assert "Traceback" not in r.stderr
