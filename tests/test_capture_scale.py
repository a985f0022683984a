"""Capture at scale: chunked prefill through the KV cache, float32 products, blocks, torchrun worlds."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from ridgefill.artifacts import Store
from ridgefill.formats import safetensors
from ridgefill.capture.artifact import COUNTS, DOCS, HELDOUT, STATS
from ridgefill.capture.run import CaptureConfig, capture
from ridgefill.models.device import where
from ridgefill.capture.units import Unit, blocks as _blocks
from ridgefill.capture.stats import Moments, merge, moments_of
from conftest import TINY_FIXTURES, quiet

pytestmark = pytest.mark.usefixtures("one_thread")

# Long enough that a document spans many chunks (the tiny models' context is 256 tokens).
LONG = [
    "A ridge map predicts the late layers from the split state; the tail runs every layer exactly. " * 9,
    "def step(x, w, b):\n    y = x @ w.T + b\n    return y / (1 + abs(y))\n" * 7,
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation .,;:!?()[]{} come back again and again. " * 8,
    "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 9,
    "for i in range(10):\n    total += i * i\nprint(total)\n" * 10,
]
ARGS = ["--split", 1, "--split", 2, "--held-out", 1, "--held-out-rows", 30]


@pytest.fixture
def long_corpus(tmp_path):
    d = tmp_path / "long"
    d.mkdir()
    for i, t in enumerate(LONG):
        (d / f"doc{i}.txt").write_text(t)
    return d


def stats_of(art, key):
    arrays, _ = safetensors.load(art.file(STATS))
    return Moments.from_arrays(arrays, key)


def chunked_moments(model_dir, texts, docs, *, split, chunk, dtype) -> Moments:
    """Brute force: the moments of split `split` over documents `docs` (indices into `texts`), each cut to the tiny
    model's 256-token context and fed to transformers' model in `dtype` `chunk` tokens at a time through a
    DynamicCache, its layer inputs (`output_hidden_states`) taken to float64 numpy; a document's first row is not
    fitted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    total = Moments.empty(L - split, d, d)
    for i in docs:
        ids = torch.tensor(tok(texts[i])["input_ids"][:256])
        cache, pieces = DynamicCache(config=model.config), []
        with torch.inference_mode():
            for start in range(0, len(ids), chunk):
                hs = model.model(input_ids=ids[None, start : start + chunk], cache=cache, use_cache=True,
                                 output_hidden_states=True).hidden_states  # L + 1 x [1, rows, d]
                pieces.append(np.stack([h[0].double().numpy() for h in hs[:L]]))  # [L, rows, d]: layer inputs
        hs = np.concatenate(pieces, axis=1)  # [L, N, d]
        total = merge(total, moments_of(hs[split, 1:], hs[split:, 1:]))
    return total


def rel_err(a: Moments, b: Moments) -> float:
    assert a.n == b.n
    return max(np.linalg.norm(getattr(a, f) - getattr(b, f)) / np.linalg.norm(getattr(b, f))
               for f in ("mean_x", "cxx", "mean_y", "cxy", "yy"))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_chunked_equals_one_shot(tmp_path, request, long_corpus, arch):
    """Small chunks through the cache (Gemma: across its 8-token sliding window) equal one forward per document."""
    model = request.getfixturevalue(TINY_FIXTURES[arch])
    cfg = dict(splits=(1, 2), held_out=1, held_out_rows=30, product_dtype="float64")
    one, _ = capture(Store(tmp_path / "a"), str(model), [str(long_corpus)], CaptureConfig(chunk=4096, **cfg), quiet())
    many, _ = capture(Store(tmp_path / "b"), str(model), [str(long_corpus)], CaptureConfig(chunk=7, **cfg), quiet())
    assert one.id != many.id  # the chunk is part of the recipe
    docs = json.loads(one.file(DOCS).read_text())
    assert max(d["tokens"] for d in docs) > 5 * 7
    for s in (1, 2):
        assert rel_err(stats_of(many, f"raw.split{s}"), stats_of(one, f"raw.split{s}")) <= 1e-5
    a, _ = safetensors.load_zst(one.file(HELDOUT))
    b, _ = safetensors.load_zst(many.file(HELDOUT))
    np.testing.assert_array_equal(a["pos"], b["pos"])
    np.testing.assert_allclose(b["hidden.3"], a["hidden.3"], rtol=1e-4, atol=1e-5)


def test_max_length_truncates_and_reports(tmp_path, tiny_llama, long_corpus):
    art, _ = capture(Store(tmp_path / "s"), str(tiny_llama), [str(long_corpus)],
                     CaptureConfig(splits=(2,), chunk=16, max_length=40, held_out=1), quiet())
    docs = json.loads(art.file(DOCS).read_text())
    assert max(d["tokens"] for d in docs) == 40
    s = art.manifest["summary"]
    assert s["max_length"] == 40 and s["max_length_from"] == "--max-length" and s["truncated_documents"] == 5
    assert s["rows"]["raw.split2"] == 4 * 39  # every row of every (truncated) calibration document but the first
    default, _ = capture(Store(tmp_path / "d"), str(tiny_llama), [str(long_corpus)],
                         CaptureConfig(splits=(2,), chunk=64, held_out=1), quiet())
    assert default.manifest["summary"]["max_length"] == 256  # the tiny model's context
    assert default.manifest["summary"]["max_length_from"] == "the model's context"


def test_float32_products_solve_like_float64(tmp_path, tiny_llama, long_corpus):
    """Products in float32 (the default) give maps whose held-out score equals the all-float64 path within 1e-4."""
    from ridgefill.solve.config import SolveConfig
    from ridgefill.solve.run import solve

    store = Store(tmp_path / "s")
    scores = {}
    for pd in ("float32", "float64"):
        cap, _ = capture(store, str(tiny_llama), [str(long_corpus)],
                         CaptureConfig(splits=(2,), chunk=32, held_out=1, held_out_rows=60, product_dtype=pd), quiet())
        maps, _ = solve(store, cap.id, SolveConfig(alphas=(1e-3,)), quiet())
        scores[pd] = maps.manifest["summary"]["score"]
    assert abs(scores["float32"] - scores["float64"]) <= 1e-4


def test_model_dtype_and_device_kind_are_in_the_id(tmp_path, tiny_llama, long_corpus):
    store = Store(tmp_path / "s")
    f32, _ = capture(store, str(tiny_llama), [str(long_corpus)], CaptureConfig(splits=(2,), chunk=64, held_out=1), quiet())
    bf16, _ = capture(store, str(tiny_llama), [str(long_corpus)],
                      CaptureConfig(splits=(2,), chunk=64, held_out=1), quiet(), place=where(dtype="bfloat16"))
    assert f32.recipe["device"] == bf16.recipe["device"] == "cpu"
    assert (f32.recipe["dtype"], bf16.recipe["dtype"]) == ("float32", "bfloat16")
    assert f32.id != bf16.id
    # Each run's statistics are those of transformers' own forward in its dtype, fed chunk by chunk as capture feeds
    # it, up to the rounding of capture's float32 products (4e-8 measured; 1e-6 allows for other machines' float32
    # kernels). bfloat16's rounding moves them from float32's by 0.0036 on this model and corpus, so a bfloat16 run
    # that computed in float32, or the reverse, fails here.
    calib = [i for i, d in enumerate(json.loads(bf16.file(DOCS).read_text())) if d["role"] == "calibration"]
    want = {dtype: chunked_moments(tiny_llama, LONG, calib, split=2, chunk=64, dtype=dtype)
            for dtype in ("float32", "bfloat16")}
    assert rel_err(stats_of(f32, "raw.split2"), want["float32"]) <= 1e-6
    assert rel_err(stats_of(bf16, "raw.split2"), want["bfloat16"]) <= 1e-6
    assert rel_err(want["bfloat16"], want["float32"]) > 1e-3


def test_blocks_are_contiguous_balanced_and_fixed_by_the_work():
    units = [Unit(i, "raw", n, False) for i, n in enumerate([500, 20, 20, 20, 400, 10, 300, 300, 5, 90])]
    blocks = _blocks(units)
    assert blocks[0][0] == 0 and blocks[-1][1] == len(units)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(blocks, blocks[1:]))
    assert blocks == _blocks(units)
    # 10 blocks of ~166 tokens; a unit goes where its token midpoint falls, so the small ones share a block
    assert blocks == [(0, 1), (1, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 10)]
    many = [Unit(i, "raw", 100, False) for i in range(640)]
    assert _blocks(many) == [(10 * j, 10 * j + 10) for j in range(64)]


# -- torchrun --------------------------------------------------------------------------------------------------


def torchrun(nproc, model, data, store, *extra, env=None, nnodes=None):
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes:
        args += nnodes
    else:
        args += ["--standalone"]
    args += ["-m", "ridgefill", "capture", str(model), "--data", str(data), "--chunk", "16",
             "--checkpoint-every", "0", "--store", str(store), *map(str, ARGS), *map(str, extra)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)


def files_of(path):
    return {name: (path / name).read_bytes() for name in (STATS, HELDOUT, COUNTS, DOCS)}


def test_torchrun_1_2_3_processes_give_the_same_artifact(tmp_path, tiny_llama, long_corpus):
    from clirun import cli

    r = cli("capture", tiny_llama, "--data", long_corpus, "--chunk", 16, *ARGS, "--store", tmp_path / "s1")
    assert r.returncode == 0, r.stderr
    ref_id = r.stdout.strip()
    ref = files_of(tmp_path / "s1" / "capture" / ref_id)
    for n in (2, 3):
        p = torchrun(n, tiny_llama, long_corpus, tmp_path / f"s{n}")
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.strip() == ref_id  # only rank 0 prints the id
        arts = list((tmp_path / f"s{n}" / "capture").iterdir())
        assert [a.name for a in arts] == [ref_id]
        assert files_of(arts[0]) == ref
        assert json.loads((arts[0] / "artifact.json").read_text())["summary"]["processes"] == n


def test_torchrun_rank_death_fails_clearly_and_the_rerun_resumes(tmp_path, tiny_llama, long_corpus):
    from clirun import cli

    r = cli("capture", tiny_llama, "--data", long_corpus, "--chunk", 16, *ARGS, "--store", tmp_path / "ref")
    ref_id = r.stdout.strip()
    store = tmp_path / "s"
    # rank 1 dies (like kill -9) right after computing block 3: the second round of a 2-process world
    p = torchrun(2, tiny_llama, long_corpus, store, env={"RIDGEFILL_FAULT": "1:3"})
    _, err = p.communicate(timeout=300)
    assert p.returncode != 0
    # rank 0 either notices the lost connection itself or is stopped by torchrun first: one line either way
    line = [l for l in err.splitlines() if l.startswith("Error: torchrun: rank 0 ")]
    assert line and (" lost contact with another rank (" in line[0] or " was stopped (SIGTERM: " in line[0])
    assert line[0].endswith("the run stopped. Re-run the same command to resume from the last checkpoint.")
    assert not (store / "capture" / ref_id).exists()
    assert (store / "capture" / f".work-{ref_id}" / "state.safetensors").is_file()
    p = torchrun(2, tiny_llama, long_corpus, store)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert f"resuming capture {ref_id} at unit 2/" in err  # after round 1 (blocks 0 and 1), not from scratch
    assert files_of(store / "capture" / ref_id) == files_of(tmp_path / "ref" / "capture" / ref_id)
    summary = json.loads((store / "capture" / ref_id / "artifact.json").read_text())["summary"]
    assert summary["resumed_at_unit"] == 2 and summary["units_computed"] == summary["units"] - 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_nodes_that_disagree_on_the_command_are_refused(tmp_path, tiny_llama, long_corpus):
    """Two 'machines' (--nnodes 2 on localhost), one of which asks for another split: exit 2, nothing written."""
    port = free_port()
    nodes = lambda rank: ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",  # noqa: E731
                          "--master-port", str(port)]
    store = tmp_path / "s"
    a = torchrun(1, tiny_llama, long_corpus, store, nnodes=nodes(0))
    b = torchrun(1, tiny_llama, long_corpus, store, "--split", 3, nnodes=nodes(1))
    _, err_a = a.communicate(timeout=300)
    _, err_b = b.communicate(timeout=300)
    assert a.returncode != 0 and b.returncode != 0
    line = ("Error: torchrun: ranks disagree on the command (capture id of rank 1 differs from rank 0's); run the "
            "same command, data and model on every rank")
    assert line in err_a.splitlines() and line in err_b.splitlines()
    assert not (store / "capture").exists() or not any((store / "capture").iterdir())


def test_device_map_with_disk_offload_gives_the_same_statistics(tmp_path, tiny_llama, long_corpus):
    """Layers split between CPU memory and accelerate's disk offload: hooks and statistics do not care."""
    store = Store(tmp_path / "s")
    cfg = dict(splits=(1, 2), chunk=16, held_out=1, held_out_rows=30)
    plain, _ = capture(store, str(tiny_llama), [str(long_corpus)], CaptureConfig(**cfg), quiet())
    placement = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                 "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "disk"}
    spread, cached = capture(store, str(tiny_llama), [str(long_corpus)], CaptureConfig(**cfg), quiet(),
                             place=where(device_map=placement))
    assert cached  # same id: placement does not change what is computed ...
    store2 = Store(tmp_path / "s2")
    spread, cached = capture(store2, str(tiny_llama), [str(long_corpus)], CaptureConfig(**cfg), quiet(),
                             place=where(device_map=placement))
    assert not cached
    assert spread.id == plain.id
    assert spread.info["placement"]["device_map"] == {"cpu": 5, "disk": 3}
    assert files_of(spread.path) == files_of(plain.path)  # ... and the bytes agree too
    assert not any((tmp_path / "s2" / "offload").glob("*/*"))  # accelerate's offload folder is gone


def test_device_map_auto_from_the_cli(tmp_path, tiny_llama, long_corpus):
    from clirun import cli

    r = cli("capture", tiny_llama, "--data", long_corpus, "--chunk", 256, *ARGS, "--store", tmp_path / "s",
            "--device-map", "auto", "--max-memory", "cpu=300KB", "--json")
    assert r.returncode == 0, r.stderr
    placement = json.loads((tmp_path / "s" / "capture" / json.loads(r.stdout)["id"] / "artifact.json").read_text())
    assert set(placement["info"]["placement"]["device_map"]) == {"cpu", "disk"}
    r = cli("capture", tiny_llama, "--data", long_corpus, "--store", tmp_path / "t", "--device-map", "balanced")
    assert r.returncode == 2
    assert r.stderr.strip() == ("Error: unknown device map 'balanced' (only 'auto' is supported: accelerate places "
                                "the model over the GPUs, CPU memory and disk)")
