"""`ridgefill eval` end to end on a tiny model: artifact, release manifest and card, gate exit code; every figure
against an independent computation from `prefill` logits (ridgefill.evaluate.metrics) and greedy decoding."""

import json

import pytest

from ridgefill.evaluate.gate import check_gate
from clirun import cli
from conftest import SMALL_CHAIN, quiet

TINY = ["--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600", "--lengths", "700", "--documents", "2", "--samples", "1"]
FILL_ARMS = ("ridgefill", "identity", "nofill")


@pytest.fixture(scope="module")
def release(tiny_chain):
    """conftest's small chain (capture -> solve -> export of the tiny llama at split 2), this module's copy."""
    c = tiny_chain(SMALL_CHAIN)
    return c.tmp, c.store, c.sol, c.release


# The eval both tests below check: the CLI's TINY settings with seed 3 (the needle prompts' seed).
CFG = dict(tail=48, scored=16, doc_tokens=128, lengths=(600, 700), documents=2, samples=1, seed=3)


@pytest.fixture(scope="module")
def measured(release, tiny_llama):
    """(EvalConfig, the loaded model, `recompute` of the release under it): computed once for the tests below."""
    from ridgefill.evaluate import EvalConfig
    from ridgefill.evaluate.source import load_source
    from ridgefill.models import load_model, resolve_model

    _, st, _, rel = release
    cfg = EvalConfig(**CFG)
    lm = load_model(resolve_model(str(tiny_llama), store_root=st.root), store_root=st.root)
    return cfg, lm, *recompute(lm, load_source(st, str(rel)), cfg)


def recompute(lm, src, cfg):
    """Eval's figures recomputed without eval's code, from one independent `prefill` per (prompt, arm): per document
    {arm: metrics.doc_summary} on the last `scored` tokens of its first `doc_tokens`, and per needle sample of
    `needle_suite(lm, cfg)` {arm: whether greedy decoding from the arm's cache answers}. Arms: exact, nofill,
    identity and ridgefill, the fill arms optionally with corrections (`ridgefill+state`); no row selectors."""
    import torch

    from ridgefill.evaluate import metrics, texts
    from ridgefill.evaluate.needles import score_answer
    from ridgefill.evaluate.run import needle_suite
    from ridgefill.runtime import greedy, prefill

    n, T, K = cfg.doc_tokens, cfg.tail, cfg.scored

    def run(ids, arm):
        base, *corrections = arm.split("+")
        kw = {"split": src.split, "tail": T, "maps": src.maps if base == "ridgefill" else None}
        if corrections:
            kw |= {"corrections": tuple(corrections), "state_offsets": src.state_offsets}
        return prefill(lm, ids, base, **kw)

    docs = []
    for d in texts.long_documents(lm.tokenizer, n, limit=cfg.documents):
        ids = torch.tensor(d.ids[:n])
        targets, pick = ids[-K:].numpy(), slice(T - K - 1, T - 1)  # logits of row t predict token t + 1
        le = run(ids, "exact").logits[pick].numpy()
        nll = metrics.token_nll(le, targets)
        cut = prefill(lm, ids[-T:], "exact", split=0, tail=T).logits[pick].numpy()  # the context cut to the tail
        key = metrics.key_mask(nll, metrics.token_nll(cut, targets))
        row = {}
        for arm in cfg.arms:
            if arm != "exact":
                la = run(ids, arm).logits[pick].numpy()
                row[arm] = metrics.doc_summary(nll, metrics.token_nll(la, targets), metrics.kl_exact_arm(le, la),
                                               metrics.top1_agree(le, la), metrics.novel_mask(ids.numpy(), n - K), key)
        docs.append(row)
    needles = []
    for s in needle_suite(lm, cfg):
        ids = torch.tensor(s.prompt_ids)
        needles.append({arm: score_answer(s, lm.tokenizer.decode(greedy(lm, run(ids, arm), s.max_new_tokens)))
                        for arm in cfg.arms})
    return docs, needles


def check_summary(s, docs, needles, arms):
    """An eval summary against `recompute`'s figures, aggregated here as docs/method.md states it: needle accuracy the
    share of samples answered (points), ΔNLL on all / novel / key tokens weighted by the documents' token counts
    (None without such tokens), KL and top-1 the mean of the documents'."""
    import numpy as np

    approx = lambda x: None if x is None else pytest.approx(x, abs=1e-4)  # noqa: E731
    assert (s["documents"], s["samples"]) == (len(docs), len(needles))
    for arm in arms:
        assert s["arms"][arm]["needle"] == pytest.approx(100 * np.mean([n[arm] for n in needles]), abs=1e-9), arm
        if arm == "exact":
            continue
        a = s["arms"][arm]
        for key, weight in (("dnll", "tokens"), ("dnll_novel", "novel_tokens"), ("dnll_key", "key_tokens")):
            w = sum(d[arm][weight] for d in docs)
            want = sum(d[arm][key] * d[arm][weight] for d in docs if d[arm][weight]) / w if w else None
            assert a.get(key) == approx(want), (arm, key)
        assert a["kl"] == approx(np.mean([d[arm]["kl"] for d in docs])), arm
        assert a["top1"] == approx(np.mean([d[arm]["top1"] for d in docs])), arm
        assert a["dnll_ci"]["low"] <= a["dnll"] <= a["dnll_ci"]["high"]


def test_eval_writes_artifact_and_release_summary(release, tiny_llama, measured):
    """Through the CLI: every arm's summary figure is what independent prefills of the same documents and needle
    prompts give (ΔNLL weighted by scored tokens, KL and top-1 the mean of the documents', needle accuracy the share
    of samples answered); the release manifest carries them rounded to 4 digits; the artifact is cached."""
    from dataclasses import asdict

    tmp, st, sol, rel = release
    cfg, _, docs, needles = measured

    r = cli("eval", tiny_llama, rel, *TINY, "--seed", "3", "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    s = doc["summary"]
    recipe = st.get(doc["id"]).recipe
    assert {k: recipe[k] for k in asdict(cfg)} == {k: list(v) if isinstance(v, tuple) else v
                                                   for k, v in asdict(cfg).items()}  # what the flags asked for
    assert set(s["arms"]) == {"exact", "ridgefill", "identity", "nofill"}
    assert (len(docs), len(needles)) == (2, 12)  # 2 lengths x 2 depths x 3 tasks, one sample each
    check_summary(s, docs, needles, ("exact", *FILL_ARMS))
    # the fills differ from exact, and from each other: the figures measure something
    assert len({round(s["arms"][arm]["kl"], 6) for arm in FILL_ARMS}) == 3 and min(s["arms"][a]["kl"] for a in FILL_ARMS) > 0
    res = json.loads((st.root / "eval" / doc["id"] / "results.json").read_text())
    assert all(set(n["correct"]) == set(s["arms"]) for n in res["needles"])
    man = json.loads((rel / "ridgefill.json").read_text())
    assert man["eval"]["eval_id"] == doc["id"]
    keep = ("needle", "dnll", "dnll_novel", "dnll_key", "kl", "top1", "prefill_s", "speedup", "rows_added")
    assert man["eval"]["arms"] == {arm: {k: round(v, 4) for k, v in fig.items() if k in keep and v is not None}
                                   for arm, fig in s["arms"].items()}
    assert "## Evaluation" in (rel / "README.md").read_text()
    assert cli("verify", rel).returncode == 0  # the manifest's eval does not break the hashes
    again = cli("eval", tiny_llama, rel, *TINY, "--seed", "3", "--store", st.root, "--json")
    assert json.loads(again.stdout)["cached"] is True and json.loads(again.stdout)["id"] == doc["id"]


def test_eval_arms_equal_their_own_prefills(release, tiny_llama, measured):
    """Eval builds every fill arm from one exact forward per prompt. Its figures equal those of independent
    `prefill` calls per arm (today's arms, recomputed here from the documents and needle prompts), and the speed
    comes from one timed prefill per arm and length."""
    from ridgefill.evaluate import evaluate
    from ridgefill.evaluate.run import needle_suite

    _, st, sol, rel = release
    cfg, lm, docs, needles = measured
    art, _ = evaluate(st, str(tiny_llama), str(rel), cfg, quiet())  # the CLI's artifact when it ran first
    res = json.loads(art.file("results.json").read_text())
    assert len(res["documents"]) == len(docs) == 2
    for want, row in zip(docs, res["documents"]):
        for arm in FILL_ARMS:
            for k, v in want[arm].items():
                assert row[arm][k] == (None if v is None else pytest.approx(v, abs=1e-4)), (arm, k)
    suite = needle_suite(lm, cfg)
    assert len(suite) == len(res["needles"]) == len(needles) > 0
    for want, row in zip(needles, res["needles"]):
        assert row["correct"] == want
    assert [t["length"] for t in res["timing"]] == sorted({s.context_tokens for s in suite})
    # The seconds are wall-clock times, so only a range: one per arm and length, each positive.
    assert all(set(t["seconds"]) == set(cfg.arms) and min(t["seconds"].values()) > 0 for t in res["timing"])
    # The summary's speed is defined from them: an arm's prefill_s is its timed prefill at the longest length (one
    # timing per length), its speedup exact's prefill_s over its own.
    longest = res["timing"][-1]["seconds"]
    for arm, fig in art.manifest["summary"]["arms"].items():
        assert fig["prefill_s"] == pytest.approx(longest[arm], rel=1e-12), arm
        assert fig.get("speedup") == (None if arm == "exact" else pytest.approx(longest["exact"] / longest[arm],
                                                                                  rel=1e-12)), arm


def test_gate_exit_code_names_the_threshold(release, tiny_llama, tmp_path):
    _, st, sol, rel = release
    gate = tmp_path / "gate.toml"
    gate.write_text('arm = "ridgefill"\n[thresholds]\nkl_max = -1.0\ntop1_min = 0.0\n')
    r = cli("eval", tiny_llama, sol.id, *TINY, "--gate", gate, "--store", st.root)
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1].startswith("Error: gate failed: kl_max: ridgefill kl = ")
    gate.write_text("[thresholds]\nkl_max = 1e9\n")
    assert cli("eval", tiny_llama, sol.id, *TINY, "--gate", gate, "--store", st.root).returncode == 0
    gate.write_text("[thresholds]\nspeed_max = 1\n")
    r = cli("eval", tiny_llama, sol.id, *TINY, "--gate", gate, "--store", st.root)
    assert r.returncode == 2 and "unknown key(s) speed_max" in r.stderr


def test_eval_selectors_controls_and_corrections(release, tiny_llama):
    """Selected-rows arms come with their two equal-cost controls; every arm's figures equal an independent prefill
    with the same rows / tail / corrections; the pairs compare each with what it changes; the release records the
    corrections it was validated with."""
    import numpy as np
    import torch

    from ridgefill.evaluate import metrics, texts
    from ridgefill.evaluate.measure import rows_rng as _rows_rng
    from ridgefill.evaluate.run import EvalConfig, evaluate
    from ridgefill.evaluate.source import load_source
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import prefill

    _, st, sol, rel = release
    arms = ("exact", "ridgefill", "ridgefill+protected", "ridgefill+kshift+vscale", "ridgefill+rows")
    cfg = EvalConfig(arms=arms, tail=48, scored=16, doc_tokens=128, lengths=(600,), documents=2, seed=3)
    art, _ = evaluate(st, str(tiny_llama), str(rel), cfg, quiet())
    res = json.loads(art.file("results.json").read_text())
    s = art.manifest["summary"]
    assert list(s["arms"]) == ["exact", "ridgefill", "ridgefill+protected", "ridgefill+protected:random",
                               "ridgefill+protected:tail", "ridgefill+vscale+kshift", "ridgefill+rows",
                               "ridgefill+rows:random", "ridgefill+rows:tail"]
    assert set(s["pairs"]) == {"ridgefill+protected - ridgefill", "ridgefill+protected:random - ridgefill+protected",
                               "ridgefill+protected:tail - ridgefill+protected", "ridgefill+vscale+kshift - ridgefill",
                               "ridgefill+rows - ridgefill", "ridgefill+rows:random - ridgefill+rows",
                               "ridgefill+rows:tail - ridgefill+rows"}
    lm = load_model(resolve_model(str(tiny_llama), store_root=st.root), store_root=st.root)
    src = load_source(st, str(rel))
    assert src.protected is not None and len(src.protected) > 0
    fill = {"split": src.split, "maps": src.maps}
    for d, row in zip(texts.long_documents(lm.tokenizer, 128, limit=2), res["documents"]):
        ids = torch.tensor(d.ids[:128])
        targets, pick = ids[-16:].numpy(), slice(48 - 16 - 1, 48 - 1)
        le = prefill(lm, ids, "exact", split=src.split, tail=48).logits[pick].numpy()
        nll = metrics.token_nll(le, targets)

        def check(arm, **kw):
            la = prefill(lm, ids, "ridgefill", **fill, **kw).logits[-17:-1][: 16].numpy() if "tail" in kw and kw[
                "tail"] != 48 else prefill(lm, ids, "ridgefill", tail=48, **fill, **kw).logits[pick].numpy()
            assert row[arm]["dnll"] == pytest.approx(float(np.mean(metrics.token_nll(la, targets) - nll)), abs=1e-4), arm

        protected = [p for p in range(128 - 48) if int(ids[p]) in src.protected]
        count = row["rows_added"]["ridgefill+protected"]
        assert count == len(set(protected) - {0}) > 0  # row 0 is exact in every fill arm anyway
        assert row["rows_added"]["ridgefill+protected:random"] == row["rows_added"]["ridgefill+protected:tail"] == count
        check("ridgefill+protected", exact_rows=protected)
        free = np.arange(1, 128 - 48)
        randoms = sorted(_rows_rng(3, ids).choice(free, size=count, replace=False).tolist())
        assert set(randoms) != set(protected) - {0}
        check("ridgefill+protected:random", exact_rows=randoms)
        check("ridgefill+protected:tail", tail=48 + count)
        check("ridgefill+vscale+kshift", corrections=("vscale", "kshift"))
        probe = range(128 - 16 - 64, 128 - 16)  # documents: the stretch before the scored tokens
        rows = set(prefill(lm, ids, "ridgefill+rows", tail=48, probe=probe, **fill).exact_rows) - {0}
        assert row["rows_added"]["ridgefill+rows"] == row["rows_added"]["ridgefill+rows:tail"] == len(rows) > 0
        check("ridgefill+rows:tail", tail=48 + len(rows))
    man = json.loads((rel / "ridgefill.json").read_text())
    r = cli("eval", tiny_llama, rel, *TINY, "--arms", "exact", "--arms", "ridgefill+vscale", "--store", st.root)
    assert r.returncode == 0, r.stderr
    assert json.loads((rel / "ridgefill.json").read_text())["eval"]["corrections"] == ["vscale"]
    assert "ridgefill+vscale vs ridgefill" not in r.stderr  # no plain ridgefill arm to compare with
    assert man["protected_tokens"]["share"] == 0.25


@pytest.mark.parametrize("name, message", [
    ("rows", "unknown arm 'rows' (an arm is one of exact, nofill, identity, ridgefill, optionally with +modifiers)"),
    ("ridgefill+vrescale", "arm 'ridgefill+vrescale': unknown modifier 'vrescale'"),
    ("nofill+vscale", "arm 'nofill+vscale': 'nofill' takes no modifiers (they apply to the fill arms)"),
    ("identity+rows", "arm 'identity+rows': row selectors apply to ridgefill"),
    ("ridgefill+rows+protected", "arm 'ridgefill+rows+protected': one selector per arm"),
    ("ridgefill+rows:", "arm 'ridgefill+rows:': unknown modifier 'rows:'"),  # an empty control is no control
    ("ridgefill+vscale:", "arm 'ridgefill+vscale:': unknown modifier 'vscale:'"),
])
def test_arm_names_refused(name, message):
    from ridgefill.errors import BadInput
    from ridgefill.evaluate.arms import plan

    with pytest.raises(BadInput) as e:
        plan(["exact", name])
    assert str(e.value).startswith(message)


def test_arm_names_canonical():
    from ridgefill.evaluate.arms import plan

    assert [a.name for a in plan(["exact", "ridgefill+rows:tail", "ridgefill+kshift+vscale", "ridgefill+vscale+kshift"])] \
        == ["exact", "ridgefill+rows", "ridgefill+rows:random", "ridgefill+rows:tail", "ridgefill+vscale+kshift"]


def test_eval_refuses_bad_arms(release, tiny_llama):
    """Through the CLI: one line, exit 2, no eval artifact."""
    _, st, sol, rel = release
    before = sorted((st.root / "eval").iterdir()) if (st.root / "eval").exists() else []
    for arms, message in ((["rows"], "unknown arm 'rows'"),
                          (["ridgefill+state"], "arm 'ridgefill+state' needs terminal-state offsets, and ")):
        r = cli("eval", tiny_llama, rel, *TINY, "--arms", "exact", *[x for a in arms for x in ("--arms", a)],
                "--store", st.root)
        assert r.returncode == 2 and r.stderr.startswith("Error: " + message), r.stderr
    assert (sorted((st.root / "eval").iterdir()) if (st.root / "eval").exists() else []) == before


def test_gate_and_counts_refused_before_any_work(release, tiny_llama, tmp_path):
    """A gate that names an arm eval will not measure, a threshold that is not a number, or zero samples / documents:
    one line, exit 2, before the model is loaded: no eval artifact, the release folder untouched."""
    _, st, sol, rel = release
    before = {p.name: p.read_bytes() for p in rel.iterdir()}
    evals = sorted((st.root / "eval").iterdir()) if (st.root / "eval").exists() else []
    gate = tmp_path / "g.toml"
    for text, args, message in (
            ('arm = "ridgefill+rows"\n[thresholds]\nkl_max = 1.0\n', [],
             f"gate file '{gate}': arm 'ridgefill+rows' is not among the arms eval measures (exact, ridgefill, "
             "identity, nofill); add it with --arms (a recipe: [eval] arms)"),
            ('[thresholds]\nkl_max = "0.5"\n', [], f"gate file '{gate}': kl_max must be a number, got '0.5'"),
            ("[thresholds]\nkl_max = 1.0\n", ["--documents", 0], "--documents must be at least 1, got 0"),
            ("[thresholds]\nkl_max = 1.0\n", ["--samples", 0], "--samples must be at least 1, got 0")):
        gate.write_text(text)
        r = cli("eval", tiny_llama, rel, *TINY, *args, "--gate", gate, "--store", st.root)
        assert r.returncode == 2 and r.stderr.strip() == f"Error: {message}", r.stderr
    assert {p.name: p.read_bytes() for p in rel.iterdir()} == before
    assert (sorted((st.root / "eval").iterdir()) if (st.root / "eval").exists() else []) == evals


def test_eval_tasks_refusal(release, tiny_llama):
    _, st, sol, rel = release
    r = cli("eval", tiny_llama, sol.id, *TINY, "--tasks", "single", "--tasks", "haystack", "--store", st.root)
    assert r.returncode == 2 and "unknown needle task(s) haystack" in r.stderr


def test_check_gate_by_hand():
    summary = {"arms": {"exact": {"needle": 90.0}, "ridgefill": {"needle": 80.0, "dnll_key": 0.3, "kl": 0.1}}}
    assert check_gate(summary, {"thresholds": {"needle_drop_max": 5.0}}) == [
        "needle_drop_max: ridgefill needle_drop = 10, limit 5"]
    assert check_gate(summary, {"thresholds": {"needle_drop_max": 10.0, "dnll_key_max": 0.5}}) == []
    assert check_gate(summary, {"thresholds": {"top1_min": 0.5}}) == ["top1_min: ridgefill has no top1 figure"]


def test_eval_refuses_a_different_model(release, tiny_qwen3):
    _, st, sol, rel = release
    r = cli("eval", tiny_qwen3, rel, *TINY, "--store", st.root)
    assert r.returncode == 2 and "was fitted on a different model" in r.stderr


def test_eval_refuses_a_protected_table_past_the_vocabulary(release, tiny_llama, tmp_path):
    """The release's maps with a protected-token table holding the first id past the model's vocabulary: refused in
    one line before anything is measured, as the runtime's loader refuses it."""
    import numpy as np

    from ridgefill.formats.release import read_release, write_release

    _, st, _, rel = release
    read = read_release(rel)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    facts = {k: v for k, v in read.manifest.items() if k not in ("format", "projector", "files", "eval")}
    write_release(tmp_path / "past", read.maps, facts, "card\n", protected=np.array([3, vocab], np.int32),
                  protected_facts={"share": 0.25, "types": 2})
    r = cli("eval", tiny_llama, tmp_path / "past", *TINY, "--store", st.root)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"Error: {tmp_path / 'past'}: the protected-token table holds token id {vocab}, past the vocabulary of "
        f"'{tiny_llama}' ({vocab} tokens: ids 0..{vocab - 1})"), r.stderr


def test_example_gates_load():
    from pathlib import Path

    from ridgefill.evaluate.gate import load_gate

    gates = sorted((Path(__file__).resolve().parents[1] / "examples" / "gates").glob("*.toml"))
    from ridgefill.models.spec import BUILTINS

    # one per built-in model with a shipped split
    assert [g.stem for g in gates] == sorted(name for name, b in BUILTINS.items() if b.split is not None)
    for g in gates:
        rules = load_gate(g)
        assert "arm" not in rules  # the release's configured arm is judged
        # at the built-ins' measured splits the releases keep retrieval: every gate reads needles and loss
        assert {"needle_drop_max", "dnll_max", "kl_max"} <= set(rules["thresholds"])


# ---------------------------------------------------------------- the summary, by hand


def _doc(tokens, novel, key, dnll, dnll_novel, dnll_key, kl, top1):
    return {"tokens": tokens, "novel_tokens": novel, "key_tokens": key, "dnll": dnll, "dnll_novel": dnll_novel,
            "dnll_key": dnll_key, "kl": kl, "top1": top1}


def _needle(length, correct):
    return {"task": "single", "length": length, "depth": 0.5, "seed": 0, "answers": ["x"],
            "correct": dict(zip(("exact", "ridgefill", "identity"), correct))}


def _timing(length, seconds):
    return {"length": length, "tokens": length, "seconds": dict(zip(("exact", "ridgefill", "identity"), seconds))}


# Three documents (16, 8 and 24 scored tokens; the second has no key token), four needle samples at two lengths and
# one timed prefill per arm at each length.
HAND = {
    "split": 2, "num_layers": 4, "tail": 48,
    "documents": [
        {"name": "a", "tokens": 128,
         "ridgefill": _doc(16, 10, 3, 0.10, 0.05, 0.90, 0.20, 0.750),
         "identity": _doc(16, 10, 3, 0.30, 0.20, 1.50, 0.50, 0.500)},
        {"name": "b", "tokens": 128,
         "ridgefill": _doc(8, 4, 0, 0.02, 0.01, None, 0.10, 0.875),
         "identity": _doc(8, 4, 0, 0.20, 0.10, None, 0.30, 0.625)},
        {"name": "c", "tokens": 128,
         "ridgefill": _doc(24, 12, 5, -0.04, 0.08, 0.30, 0.15, 0.8),
         "identity": _doc(24, 12, 5, 0.40, 0.35, 2.10, 0.60, 0.4)},
    ],
    "needles": [
        _needle(600, (True, True, False)),
        _needle(700, (True, False, False)),
        _needle(700, (False, False, False)),
        _needle(600, (True, True, True)),
    ],
    "timing": [_timing(600, (1.0, 0.5, 0.4)), _timing(700, (2.1, 0.9, 0.8))],
}


def _enumerated(d, w=None):
    """The exact bootstrap distribution of the (weighted) mean: all n^n equally likely resamples, sorted."""
    import itertools

    n = len(d)
    w = [1.0] * n if w is None else w
    return sorted(sum(w[i] * d[i] for i in idx) / sum(w[i] for i in idx)
                  for idx in itertools.product(range(n), repeat=n))


def _exact_quantile(vals, p):
    """Smallest x with P(X <= x) >= p over the sorted, equally likely vals."""
    import math

    return vals[max(math.ceil(p * len(vals) - 1e-12), 1) - 1]


def _seeded(d, w, samples, seed):
    """The percentile interval as documented: default_rng(seed) draws samples x n unit indices."""
    import numpy as np

    d, w = np.asarray(d, float), np.ones(len(d)) if w is None else np.asarray(w, float)
    idx = np.random.default_rng(seed).integers(0, len(d), size=(samples, len(d)))
    stats = (w[idx] * d[idx]).sum(1) / w[idx].sum(1)
    return [float(q) for q in np.quantile(stats, [0.025, 0.975])]


def test_summary_by_hand():
    """ΔNLL weighted by scored tokens, needle %, prefill time at the longest length, speed-up, ceiling, and every
    interval: against arithmetic done here and an independent bootstrap."""
    from dataclasses import replace

    from ridgefill.evaluate.run import EvalConfig
    from ridgefill.evaluate.summary import summarize

    cfg = EvalConfig(arms=("exact", "ridgefill", "identity"), tail=48, lengths=(600, 700), seed=11, bootstrap=20000)
    s = summarize(HAND, cfg)
    approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)  # noqa: E731
    assert (s["documents"], s["samples"]) == (3, 4)
    rf, ident, ex = s["arms"]["ridgefill"], s["arms"]["identity"], s["arms"]["exact"]
    # needle accuracy in points
    assert (ex["needle"], rf["needle"], ident["needle"]) == (75.0, 50.0, 25.0)
    # ΔNLL: token-weighted over documents; the document without key tokens counts nothing for dnll_key
    assert rf["dnll"] == approx((16 * 0.10 + 8 * 0.02 + 24 * -0.04) / 48)
    assert rf["dnll_novel"] == approx((10 * 0.05 + 4 * 0.01 + 12 * 0.08) / 26)
    assert rf["dnll_key"] == approx((3 * 0.90 + 5 * 0.30) / 8)
    assert ident["dnll"] == approx((16 * 0.30 + 8 * 0.20 + 24 * 0.40) / 48)
    assert ident["dnll_key"] == approx((3 * 1.50 + 5 * 2.10) / 8)
    # KL and top-1: the mean of the documents' means
    assert rf["kl"] == approx((0.20 + 0.10 + 0.15) / 3) and rf["top1"] == approx((0.750 + 0.875 + 0.8) / 3)
    # prefill time: the timed prefill at the longest length; speed-up against exact's
    assert ex["prefill_s"] == approx(2.1) and rf["prefill_s"] == approx(0.9) and ident["prefill_s"] == approx(0.8)
    assert rf["speedup"] == approx(2.1 / 0.9) and ident["speedup"] == approx(2.1 / 0.8) and "speedup" not in ex
    # ceiling: (S (N - T) + L T) / (L N) of the layer work at N = the longest length
    assert s["ceiling_r"] == approx((2 * (700 - 48) + 4 * 48) / (4 * 700))
    assert s["ceiling_speedup"] == 4 * 700 / (2 * (700 - 48) + 4 * 48)  # one correctly rounded division

    # intervals: (values, weights, point) of each; the weights drop the document without key tokens
    dn = lambda arm, k: [d[arm][k] for d in HAND["documents"]]  # noqa: E731
    w = lambda arm, k: [d[arm][k] for d in HAND["documents"]]  # noqa: E731
    hit = lambda arm: [100.0 * n["correct"][arm] for n in HAND["needles"]]  # noqa: E731
    cases = {
        ("ridgefill", "dnll_ci"): (dn("ridgefill", "dnll"), w("ridgefill", "tokens"), rf["dnll"]),
        ("ridgefill", "dnll_novel_ci"): (dn("ridgefill", "dnll_novel"), w("ridgefill", "novel_tokens"), rf["dnll_novel"]),
        ("ridgefill", "dnll_key_ci"): ([0.90, 0.30], [3, 5], rf["dnll_key"]),
        ("identity", "dnll_ci"): (dn("identity", "dnll"), w("identity", "tokens"), ident["dnll"]),
        ("ridgefill", "needle_minus_exact"): ([a - b for a, b in zip(hit("ridgefill"), hit("exact"))], None, -25.0),
        ("identity", "needle_minus_exact"): ([a - b for a, b in zip(hit("identity"), hit("exact"))], None, -50.0),
        ("rmi", "needle"): ([a - b for a, b in zip(hit("ridgefill"), hit("identity"))], None, 25.0),
        ("rmi", "dnll_key"): ([0.90 - 1.50, 0.30 - 2.10], [3, 5], (3 * -0.6 + 5 * -1.8) / 8),
    }
    for (arm, key), (d, wt, point) in cases.items():
        got = s["ridgefill_minus_identity"][key] if arm == "rmi" else s["arms"][arm][key]
        assert got["mean"] == approx(point) and got["n"] == len(d), (arm, key)
        assert got["low"] <= point <= got["high"], (arm, key)
        exact = _enumerated(d, wt)
        for side, p in (("low", 0.025), ("high", 0.975)):  # Monte-Carlo error in p: ~1.1e-3 at 20000 samples
            lo, hi = _exact_quantile(exact, p - 0.006), _exact_quantile(exact, p + 0.006)
            assert lo - 1e-12 <= got[side] <= hi + 1e-12, (arm, key, side, got[side], lo, hi)
    # the draws themselves: with few resamples the percentiles interpolate between single draws, so they show
    # whether the intervals come from default_rng(seed) over the right units
    few = summarize(HAND, replace(cfg, bootstrap=37))
    for (arm, key), (d, wt, point) in cases.items():
        got = few["ridgefill_minus_identity"][key] if arm == "rmi" else few["arms"][arm][key]
        assert [got["low"], got["high"]] == pytest.approx(_seeded(d, wt, 37, cfg.seed), abs=1e-12), (arm, key)
