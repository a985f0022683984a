"""The sweep's one budget: its needle prompts are the release gate's kinds (eval's single, multi-key and multi-value
needles, in both prompt forms, at the sweep's length and a long one where the context holds it), and a gate's
thresholds are its limits. A split whose single needles hold while its multi-key needles fail is over budget."""

from types import SimpleNamespace

import pytest

from ridgefill.errors import BadInput
from ridgefill.evaluate.needles import TASKS
from ridgefill.sweep.config import SweepConfig, budget, check_config, check_context, long_length
from ridgefill.sweep.documents import over_budget
from ridgefill.sweep.needles import Mix, mix_of, needle_suite
from ridgefill.sweep.search import find_edges, rule_of
from conftest import quiet

CFG = SweepConfig(length=600, tail=48, needles=16)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_1k):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_1k)


def fake_lm(tokenizer, context=1024):
    """What the suite reads of a loaded model: its tokenizer (the tiny llama's, which has a chat template) and
    context."""
    return SimpleNamespace(tokenizer=tokenizer, ref=SimpleNamespace(context_length=context))


def test_the_mix_holds_evals_tasks_in_equal_shares_in_both_forms(tokenizer):
    """Every round holds each (form, task) once; single needles turn between noise and prose; the prompts are
    whole rounds (16 asked: 18), their needles before the tail, at the depths in turn; the rule looks after whole
    rounds of at least 8 prompts."""
    lm = fake_lm(tokenizer)
    mix = mix_of(lm, CFG)
    assert mix == Mix(lengths=(600,), forms=("chat", "plain")) and (mix.size, mix.group) == (6, 12)
    suite = needle_suite(lm, CFG)
    assert len(suite) == mix.prompts(16) == 18
    for r in range(3):
        kinds = [k for k, _ in suite[6 * r : 6 * r + 6]]
        assert sorted((k.form, k.task) for k in kinds) == sorted((f, t) for f in ("chat", "plain") for t in TASKS)
        assert [k.haystack for k in kinds if k.task == "single"] == [("noise", "prose")[(r + j) % 2] for j in (0, 1)]
        assert all(k.haystack == "prose" for k in kinds if k.task != "single")
    for kind, s in suite:
        assert (s.task, s.n, s.format) == (kind.task, 600, kind.form) and s.in_filled_region(48)
        if kind.form == "plain":
            assert s.prompt_ids[-3:] == tokenizer.encode("\nAnswer:", add_special_tokens=False)[-3:]
    multikey = [s.depth for k, s in suite if (k.task, k.form) == ("multikey", "chat")]
    assert len(set(multikey)) == 3  # its three prompts at three depths
    rule = rule_of(CFG, mix)
    assert (rule.samples, rule.looks, rule.budget) == (18, (12, 18), 0.10)


def test_the_long_length_joins_the_mix_where_the_context_holds_it(tokenizer):
    """By default 16384 tokens where the model's context holds it, else none; a length given past the context is
    refused as --length is; 0 turns it off. With one, every round holds each (length, form, task) once."""
    assert long_length(SweepConfig(), 8192) == 0 and long_length(SweepConfig(), 32768) == 16384
    assert long_length(SweepConfig(), None) == 0 and long_length(SweepConfig(long_length=0), 32768) == 0
    assert long_length(SweepConfig(length=16384), 32768) == 0  # not longer than the sweep's own length
    with pytest.raises(BadInput, match=r"^--long-length 20000 is longer than the model's context \(8192 positions\)$"):
        check_context(SweepConfig(long_length=20000), 8192)
    with pytest.raises(BadInput, match="long-length must be a length in tokens, or 0 for none"):
        check_config(SweepConfig(long_length=-1))
    cfg = SweepConfig(length=600, long_length=1000, tail=48, needles=12)
    mix = mix_of(fake_lm(tokenizer), cfg)
    assert mix.lengths == (600, 1000) and (mix.size, mix.group) == (12, 12)
    suite = needle_suite(fake_lm(tokenizer), cfg, mix)
    assert sorted((k.length, k.form, k.task) for k, _ in suite) == sorted(
        (n, f, t) for n in (600, 1000) for f in ("chat", "plain") for t in TASKS)
    assert all(s.n == k.length and s.in_filled_region(48) for k, s in suite)


def test_single_needles_that_hold_do_not_hide_multikey_needles_that_fail(tokenizer):
    """The case the budget must refuse: below split 3 the fill answers every single and multi-value needle exact
    answers and no multi-key needle. The search puts the edge at 3. On single needles alone (the sweep's suite
    before it held eval's kinds) the same fill is within at split 1: a recommendation whose gate fails."""
    lm = fake_lm(tokenizer)
    suite = needle_suite(lm, CFG)
    kinds = [k for k, _ in suite]

    def measure(i, jobs):
        return True, {(s, a): kinds[i].task != "multikey" or s >= 3 for s, a in jobs}

    splits = [1, 2, 3, 4]
    edges = find_edges(splits, ["ridgefill"], {(s, "ridgefill"): None for s in splits}, rule_of(CFG, mix_of(lm, CFG)),
                       measure, False, quiet())
    assert edges.search["ridgefill"]["edge"] == 3
    assert edges.verdicts[(2, "ridgefill")] == "over"
    d, pairs = edges.jobs[(2, "ridgefill")]
    assert d.verdict == "over" and sum(e and not a for e, a in pairs) == sum(k.task == "multikey" for k in kinds[: d.n])
    singles = [i for i, k in enumerate(kinds) if k.task == "single"]
    alone = find_edges(splits, ["ridgefill"], {(s, "ridgefill"): None for s in splits}, rule_of(CFG, mix_of(lm, CFG)),
                       lambda i, jobs: measure(singles[i % len(singles)], jobs), False, quiet())
    assert alone.search["ridgefill"]["edge"] == 1


def test_a_gates_thresholds_are_the_budget():
    """A gate's thresholds join the sweep's budget, the tighter limit winning where both set one; a document figure
    over (or not measured) puts a (split, arm) over, named in words; an unknown threshold is refused."""
    cfg = SweepConfig(gate=(("dnll_key_max", 0.3), ("kl_max", 0.08), ("needle_drop_max", 20.0), ("top1_min", 0.9)))
    assert budget(cfg) == {"needle_drop": ("max", 10.0), "dnll_key": ("max", 0.3), "kl": ("max", 0.08),
                           "top1": ("min", 0.9)}
    assert budget(SweepConfig(gate=(("needle_drop_max", 5.0),)))["needle_drop"] == ("max", 5.0)
    assert budget(SweepConfig()) == {"needle_drop": ("max", 10.0), "dnll_key": ("max", 0.5)}
    figures = {"dnll_key": 0.2, "kl": 0.05, "top1": 0.95}
    assert over_budget((1, "ridgefill"), figures, cfg) is None
    assert over_budget((1, "ridgefill"), {**figures, "dnll_key": 0.4}, cfg) == "key ΔNLL 0.4 > 0.3"
    assert over_budget((1, "ridgefill"), {**figures, "kl": 0.09}, cfg) == "KL 0.09 > 0.08"
    assert over_budget((1, "ridgefill"), {**figures, "top1": 0.85}, cfg) == "top-1 0.85 < 0.9"
    assert over_budget((1, "ridgefill"), {"kl": 0.05, "top1": 0.95}, cfg) == "key ΔNLL not measured"
    assert rule_of(SweepConfig(gate=(("needle_drop_max", 5.0),)), Mix((4096,), ("plain",))).budget == 0.05
    with pytest.raises(BadInput, match=r"^gate: 'speed_min' = 2.0 is not a threshold \(known: needle_drop_max, "):
        check_config(SweepConfig(gate=(("speed_min", 2.0),)))
