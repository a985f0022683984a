"""`ridgefill compact` and `ridgefill fold` on the tiny models: artifacts, the plain-cache check, refusals."""

import json

import numpy as np
import pytest
import torch

from ridgefill.artifacts import Store
from ridgefill.fold import artifact as fold_artifact
from ridgefill.fold.compaction import CompactConfig, compact
from ridgefill.fold.math import round_to
from ridgefill.fold.run import FoldConfig, fold
from ridgefill.output import Output
from ridgefill.models import load_model, resolve_model
from clirun import cli

CONTEXT = ("The ridge map predicts a late layer's input from the split state; keys and values are written from "
           "the prediction. ")  # fmt: skip
FOLD = FoldConfig(question=" Q: what?", answer_tokens=4)
QUIET = Output(quiet=True)


def run_both(model, context, store):
    """compact (budget 0.25) then fold, in process; returns their results as the CLI's --json would."""
    st = Store(store)
    comp, c_hit = compact(st, str(model), context, CompactConfig(budget=0.25), QUIET)
    fold_art, f_hit = fold(st, comp.id, FOLD, QUIET)
    return ({"id": comp.id, "cached": c_hit, "summary": comp.manifest["summary"]},
            {"id": fold_art.id, "cached": f_hit, "summary": fold_art.manifest["summary"]})


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    p = tmp_path_factory.mktemp("ctx") / "context.txt"
    p.write_text(CONTEXT)
    return p


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def folded(request, tmp_path_factory, context):
    model = request.getfixturevalue({"llama": "tiny_llama", "gemma3_text": "tiny_gemma3"}[request.param])
    store = tmp_path_factory.mktemp("store")
    comp, fold_ = run_both(model, context, store)
    return request.param, model, store, comp, fold_


def test_compact_artifact(folded):
    arch, model, store, comp, _ = folded
    st = Store(store)
    art = st.get(comp["id"])
    s = comp["summary"]
    n = s["context_tokens"]
    assert s["kept_per_head"] == int(0.25 * n)
    cache = fold_artifact.load_cache(art)
    full_layers = [0, 1, 2, 3] if arch == "llama" else [1, 3]  # Gemma's sliding layers 0, 2 stay whole
    assert s["compacted_layers"] == full_layers
    for l, layer in cache.items():
        if l in full_layers:
            assert set(layer) == {"keys", "values", "positions", "beta"}
            assert layer["keys"].shape == (2, s["kept_per_head"], 16) and layer["beta"].dtype == np.float32
            assert np.all(np.abs(layer["beta"]) <= 3) and np.all(np.diff(layer["positions"], axis=1) > 0)
            assert np.array_equal(round_to(layer["keys"], "bfloat16"), layer["keys"])  # stored as bf16
        else:
            assert set(layer) == {"keys", "values", "positions"} and layer["keys"].shape == (2, n, 16)
    from transformers import AutoTokenizer

    assert fold_artifact.load_context(art).tolist() == AutoTokenizer.from_pretrained(model)(CONTEXT)["input_ids"]
    report = json.loads(art.file(fold_artifact.REPORT).read_text())
    assert all(h["residual"] <= h["start_residual"] + 1e-12 for h in report["heads"])


def test_fold_artifact_and_check(folded):
    arch, model, store, comp, fold = folded
    st = Store(store)
    art = st.get(fold["id"])
    s = fold["summary"]
    assert s["fold_stock_equals_reference"] is True
    check = json.loads(art.file("check.json").read_text())
    assert check["arms"]["fold_reference"]["max_logprob_diff_vs_fold"] < 1e-4
    assert set(check["arms"]) == {"full", "am", "fold", "drop", "fold_reference"}
    assert check["arms"]["full"]["answer_matches_full"] is True
    for arm in ("am", "fold", "drop"):
        assert check["arms"][arm]["kl"] >= 0
    biased, folded_cache = fold_artifact.load_cache(st.get(comp["id"])), fold_artifact.load_cache(art)
    for l, layer in folded_cache.items():
        if "beta" in biased[l]:
            assert set(layer) == {"keys", "values", "positions", "u"}
            assert np.array_equal(layer["positions"], biased[l]["positions"])
        else:
            assert np.array_equal(layer["keys"], biased[l]["keys"])
    report = json.loads(art.file("report.json").read_text())
    for h in report["heads"]:
        assert abs(h["qu_mean_fit"] - 1) < 1e-5  # u is fitted so that the mean of q.u is 1
        assert h["keep_fit"] >= h["drop_fit"] - 1e-9  # refit values never lose to the originals on the fit queries


def test_fold_fails_when_the_stock_path_disagrees_with_the_reference(folded, monkeypatch):
    """The folded cache through stock attention must answer as the reference computation (SlotCache) does:
    a stock path that disagrees (here: its logits negated, so its greedy tokens are the least likely ones) makes
    `fold` exit 1 with one line, and no fold artifact is written."""
    from ridgefill.fold import check
    from clirun import cli_here

    _, _, store, comp, fold_ = folded
    stock_step = check._Stock.step
    monkeypatch.setattr(check._Stock, "step", lambda self, token: -stock_step(self, token))

    def built():
        return sorted(p.name for p in (store / "fold").iterdir() if (p / "artifact.json").is_file())

    before = built()
    assert before == [fold_["id"]]
    # --answer-tokens 3: another recipe than the fixture's fold, so it runs (a cached fold is not re-checked)
    r = cli_here("fold", comp["id"], "--question", " Q: what?", "--answer-tokens", 3, "--store", store)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: the folded cache answers ") and "through the stock attention path but" in last
    assert "through the reference computation (SlotCache" in last and last.endswith("nothing written")
    assert "Traceback" not in r.stderr
    assert built() == before


def test_artifacts_are_byte_reproducible(tiny_llama, tmp_path, context):
    """Two stores, same inputs: the same ids and the same bytes (one architecture: the writers are shared)."""
    model, store = tiny_llama, tmp_path / "store1"
    comp, fold = run_both(model, context, store)
    other = tmp_path / "store2"
    c2, f2 = run_both(model, context, other)
    assert (c2["id"], f2["id"]) == (comp["id"], fold["id"])
    for stage, ident in (("compact", comp["id"]), ("fold", fold["id"])):
        for f in sorted((store / stage / ident).iterdir()):
            if f.name != "artifact.json":  # holds timings
                assert f.read_bytes() == (other / stage / ident / f.name).read_bytes(), f.name
    r = cli("fold", comp["id"], "--question", " Q: what?", "--answer-tokens", 4, "--store", store, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cached"] is True and json.loads(r.stdout)["id"] == fold["id"]


def test_slot_cache_bias_equals_duplicated_keys(tiny_llama, tmp_path):
    """A logit bias of log 2 on a key is the same attention as that key stored twice."""
    from ridgefill.runtime import SlotCache
    from ridgefill.fold.queries import context_cache

    lm = load_model(resolve_model(str(tiny_llama), store_root=tmp_path), store_root=tmp_path)
    ids = torch.tensor(lm.tokenizer(CONTEXT)["input_ids"][:30])
    cc = context_cache(lm, ids)
    n, dup = 30, [3, 7, 20]
    pos = np.broadcast_to(np.arange(n), (2, n))
    bias = np.zeros((2, n), np.float32)
    bias[:, dup] = np.log(2)
    biased = [{"keys": cc.keys[l], "values": cc.values[l], "positions": pos, "bias": bias} for l in range(4)]
    twice = [{"keys": torch.cat([cc.keys[l], cc.keys[l][:, dup]], 1), "values": torch.cat([cc.values[l], cc.values[l][:, dup]], 1),
              "positions": np.concatenate([pos, pos[:, dup]], 1)} for l in range(4)]
    plain = [{"keys": cc.keys[l], "values": cc.values[l], "positions": pos} for l in range(4)]
    a, b, c = SlotCache(lm, biased, n), SlotCache(lm, twice, n), SlotCache(lm, plain, n)
    for t in (5, 9, 11):
        la, lb, lc = a.step(t), b.step(t), c.step(t)
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
        assert (la - lc).abs().max() > 1e-4  # the bias matters
    # and with no bias the slot cache decodes like the stock model from its own prefill
    with torch.no_grad():
        ref = lm.model(input_ids=torch.cat([ids, torch.tensor([5, 9, 11])])[None]).logits[0, -1]
    torch.testing.assert_close(lc, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("args, message", [
    (["--budget", 0], "--budget must be a share strictly between 0 and 1, got 0.0"),
    (["--budget", 1], "--budget must be a share strictly between 0 and 1, got 1.0"),
    (["--budget", 0.001], "keeps no key"),
    (["--source", "echo"], "unknown query source 'echo'"),
    (["--cache-dtype", "int8"], "unknown cache dtype 'int8'"),
    (["--dtype", "int8"], "unknown dtype 'int8' (choose one of: auto, float32, bfloat16, float16)"),  # the model's
])
def test_compact_refusals(tiny_llama, context, tmp_path, args, message):
    r = cli("compact", tiny_llama, "--context", context, *args, "--store", tmp_path / "st")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert message in lines[-1] and "Traceback" not in r.stderr
    assert not (tmp_path / "st" / "compact").exists()  # nothing written


def test_compact_refuses_missing_context_and_non_attention_model(tiny_llama, tmp_path):
    r = cli("compact", tiny_llama, "--context", tmp_path / "nope.txt", "--store", tmp_path / "st")
    assert r.returncode == 2 and "context file" in r.stderr and "does not exist" in r.stderr
    mamba = tmp_path / "mamba"
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 2, "hidden_size": 8}))
    ctx = tmp_path / "c.txt"
    ctx.write_text(CONTEXT)
    r = cli("compact", mamba, "--context", ctx, "--store", tmp_path / "st")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "mamba" in r.stderr


def test_a_context_with_bytes_not_utf8_is_read_with_a_warning(tmp_path):
    """As capture reads its corpus (and engine prefix its prompt): replaced with U+FFFD, and said so."""
    from ridgefill.fold.compaction import read_context

    p = tmp_path / "c.txt"
    p.write_bytes(CONTEXT.encode() + b"\xff\xfe")
    warned = []
    text, _ = read_context(p, warned.append)
    assert text == CONTEXT + "\ufffd\ufffd"
    assert warned == [f"context file '{p}' had non-UTF-8 bytes; 2 replaced with U+FFFD"]
    p.write_text(CONTEXT + "\ufffd")  # a U+FFFD in the file itself is text, not a replacement
    assert read_context(p, warned.append)[0] == CONTEXT + "\ufffd" and len(warned) == 1


def test_cache_files_round_trip(folded):
    """Reading a cache file (ridgefill.formats.cache) and writing it back gives the same bytes."""
    from ridgefill.formats import cache, safetensors

    arch, _, store, comp, fold_ = folded
    for ident in (comp["id"], fold_["id"]):
        path = Store(store).get(ident).file(cache.FILE)
        meta = safetensors.read_header(path)[1]
        assert meta["format"] == cache.FORMAT == "ridgefill-cache/2"
        assert meta["model_fingerprint"] == Store(store).get(comp["id"]).recipe["model"]  # bound to its model
        out = store / f"{ident}.safetensors"
        cache.write_cache(out, cache.read_cache(path), meta["dtype"], meta["model_fingerprint"])
        assert out.read_bytes() == path.read_bytes()
        header = cache.read_header(path)
        assert header.kind == ("compact" if ident == comp["id"] else "fold")
        assert header.num_layers == 4 and header.compacted == ((0, 1, 2, 3) if arch == "llama" else (1, 3))
