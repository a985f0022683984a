"""Needle prompts (ridgefill.evaluate.needles) and evaluation texts (ridgefill.evaluate.texts), on the tiny
model's real byte-level BPE tokenizer."""

import pytest

from ridgefill.capture.corpus import builtin_sources, read_corpus
from ridgefill.evaluate.needles import NEEDLE, TASKS, build_sample, build_suite, score_answer
from ridgefill.evaluate.texts import (
    check_disjoint,
    code_documents,
    haystack_documents,
    long_documents,
    prose_documents,
    reused,
    sha256_text,
)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)


@pytest.fixture(scope="module")
def docs():
    return haystack_documents()


def _needle_ends(tok, sample):
    """Brute force, without the spans: for each needle sentence in the decoded prompt, the smallest k such
    that decode(ids[:k]) contains it (k = the exclusive end of its last token)."""
    ids = sample.prompt_ids
    text = tok.decode(ids)
    ends = []
    start = 0
    while True:
        i = text.find("One of the special magic numbers for ", start)
        if i < 0:
            return ends
        j = text.index(".", text.index(" is: ", i)) + 1
        needle = text[i:j]
        occurrence = text[:j].count(needle)  # needles are unique, but be exact anyway
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if tok.decode(ids[:mid]).count(needle) >= occurrence:
                hi = mid
            else:
                lo = mid + 1
        ends.append(lo)
        start = j


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("chat", [True, False])
def test_spans_decode_to_needles(tok, docs, task, chat):
    s = build_sample(tok, task, 1024, 0.5, 7, haystack=docs, tail=128, chat=chat)
    assert s.format == ("chat" if chat else "plain")
    assert len(s.needle_spans) == {"single": 1, "multikey": 4, "multivalue": 4}[task]
    assert s.needle_spans == sorted(s.needle_spans)
    for a, b in s.needle_spans:
        assert tok.decode(s.prompt_ids[a:b]).strip().startswith("One of the special magic numbers for ")
    for q, value in zip(s.queried, s.answers):
        a, b = s.needle_spans[q]
        assert tok.decode(s.prompt_ids[a:b]).strip() == NEEDLE.format(key=s.key, value=value)
    if task == "multikey":
        others = [tok.decode(s.prompt_ids[a:b]) for i, (a, b) in enumerate(s.needle_spans) if i not in s.queried]
        assert all(s.key not in t and s.answers[0] not in t for t in others)
    decoded = tok.decode(s.prompt_ids)
    assert decoded.count(f"for {s.key} is: ") == len(s.answers)
    assert s.question in decoded and decoded.rstrip().endswith("<|assistant|>" if chat else "Answer:")


def test_filter_agrees_with_brute_force(tok, docs):
    seen = {True: 0, False: 0}
    for length in (512, 1024):
        for depth in (0.0, 0.2, 0.5, 0.8, 0.95, 1.0):
            for task in ("single", "multikey"):
                s = build_sample(tok, task, length, depth, 3, haystack=docs, tail=256)
                ends = _needle_ends(tok, s)
                assert ends == [b for _, b in s.needle_spans]
                for tail in (0, 16, 128, 256, 400):
                    brute = all(e <= s.n - tail for e in ends)
                    assert s.in_filled_region(tail) == brute
                    seen[brute] += 1
                assert s.in_filled_region() == s.in_filled_region(256)
    assert seen[True] and seen[False]
    # A needle at the very end with a large tail must be rejected, one near the start kept.
    late = build_sample(tok, "single", 1024, 1.0, 1, haystack=docs, tail=256)
    assert not late.in_filled_region()
    assert build_sample(tok, "multivalue", 1024, 0.1, 1, haystack=docs, tail=256).in_filled_region()
    assert not late.in_filled_region(late.n)  # no filled rows at all


def test_lengths_exact_and_close_to_retokenized(tok, docs):
    for length in (600, 777, 2048):
        for task in TASKS:
            s = build_sample(tok, task, length, 0.4, 5, haystack=docs, tail=64, chat=False)
            assert len(s.prompt_ids) == s.n == length
            whole = tok(tok.decode(s.prompt_ids), add_special_tokens=False)["input_ids"]
            assert abs(len(whole) - length) <= max(4, length // 50)
    with pytest.raises(ValueError, match="too short"):
        build_sample(tok, "multikey", 100, 0.5, 0, haystack=docs, tail=16)
    with pytest.raises(ValueError):
        build_sample(tok, "nope", 1024, 0.5, 0, haystack=docs)
    with pytest.raises(ValueError):
        build_sample(tok, "single", 1024, 1.5, 0, haystack=docs)


def test_seeded(tok, docs):
    a = build_sample(tok, "multivalue", 1024, 0.3, 42, haystack=docs, tail=128)
    b = build_sample(tok, "multivalue", 1024, 0.3, 42, haystack=docs, tail=128)
    c = build_sample(tok, "multivalue", 1024, 0.3, 43, haystack=docs, tail=128)
    assert a == b
    assert a.answers != c.answers and a.prompt_ids != c.prompt_ids
    kw = dict(lengths=(512,), depths=(0.2, 0.6), samples=2, tail=128, haystack=docs)
    s1, s2, s3 = build_suite(tok, seed=0, **kw), build_suite(tok, seed=0, **kw), build_suite(tok, seed=1, **kw)
    assert len(s1) == 1 * 2 * len(TASKS) * 2
    assert s1 == s2
    assert [x.answers for x in s1] != [x.answers for x in s3]
    assert len({x.answers for x in s1}) == len(s1)  # every sample draws its own values
    assert [(x.task, x.depth) for x in s1[:6:2]] == [(t, 0.2) for t in TASKS]
    # A sample rebuilds from its recorded seed.
    x = s1[4]
    assert build_sample(tok, x.task, x.context_tokens, x.depth, x.seed, haystack=docs, tail=128) == x


def test_score_answer(tok, docs):
    s = build_sample(tok, "multivalue", 1024, 0.5, 9, haystack=docs, tail=128)
    v = list(s.answers)
    assert len(v) == 4 and len(set(v)) == 4 and all(len(x) == 7 and x.isdigit() for x in v)
    assert score_answer(s, "The numbers are " + ", ".join(reversed(v)) + ".")
    assert not score_answer(s, "The numbers are " + ", ".join(v[:3]) + ".")
    assert not score_answer(s, " ".join(v[:3]) + " 1" + v[3])  # inside a longer digit run
    single = build_sample(tok, "single", 1024, 0.5, 9, haystack=docs, tail=128)
    assert score_answer(single, f"The special magic number is {single.answers[0]}")
    assert not score_answer(single, "I don't know")


def test_haystack_not_in_calibration_corpus(tok):
    calibration = read_corpus(["builtin:default"]).documents
    hashes = {d.sha256 for d in calibration}
    prose, code = prose_documents(), code_documents()
    assert len(prose) > 20 and len(code) > 20
    assert haystack_documents("all") == prose + code and haystack_documents() == prose
    assert reused(prose + code, hashes) == []
    check_disjoint(prose + code, hashes)
    assert not {n for n, _ in code} & {p.name for p in builtin_sources()}
    assert all(n >= "d" and not n.startswith("_") for n, _ in code)
    # The check does catch reuse.
    assert reused([(calibration[-1].name, calibration[-1].text)], hashes) == [calibration[-1].name]
    with pytest.raises(ValueError, match="calibration"):
        check_disjoint(calibration[:2], hashes)
    # Long documents: fixed order, long enough, hashed like the corpus.
    longs = long_documents(tok, 3000, limit=5)
    assert len(longs) == 5 and all(len(d.ids) >= 3000 for d in longs)
    assert [d.name for d in longs] == [d.name for d in long_documents(tok, 3000, limit=5)]
    assert all(d.sha256 == sha256_text(d.text) and d.sha256 not in hashes for d in longs)


def test_answer_complete_only_when_no_continuation_can_change_the_score():
    from types import SimpleNamespace

    from ridgefill.evaluate.needles import answer_complete, score_answer

    s = SimpleNamespace(answers=("1234567", "42"))
    for text, complete in (("1234567 and 42", False),  # 42 may still grow into 421
                           ("1234567 and 42.", True), ("12345678, 42.", False), ("x1234567\n42 ", True),
                           ("01234567 42 ", False)):
        assert answer_complete(s, text) is complete, text
        if complete:  # whatever follows, the score is already decided
            assert all(score_answer(s, text + more) for more in ("", "9", " 1234567", "\n"))
