"""The needle prompt's layout (ridgefill.evaluate.needles.build_sample), on a tokenizer of one token per character, so
that every position is checked against the text by brute force, and the drawn samples pinned to the values the
module gave before build_sample was split into steps (commit 4b94d83)."""

import hashlib
import re

import pytest

from ridgefill.evaluate.needles import HEADER, NEEDLE, QUESTIONS, TASKS, build_sample, build_suite

BOS = 1


class CharTokenizer:
    """One token per character (its code point); a BOS before a text with special tokens; no chat template."""

    chat_template = None

    def __call__(self, texts, add_special_tokens=True):
        one = isinstance(texts, str)
        ids = [([BOS] if add_special_tokens else []) + [ord(c) for c in t] for t in ([texts] if one else texts)]
        return {"input_ids": ids[0] if one else ids}

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != BOS)


def _doc(name: str, n: int) -> tuple[str, str]:
    """Sentences and paragraphs without digits or needle words."""
    words = ("river", "stone", "market", "window", "garden", "lamp", "road", "field")
    sentences = [f"The {words[i % 8]} near the {words[(3 * i + 1) % 8]} was seen by {name} again." for i in range(n)]
    return name, "".join(s + ("\n\n" if i % 5 == 4 else " ") for i, s in enumerate(sentences))


HAYSTACK = [_doc("alpha", 12), _doc("beta", 8), _doc("gamma", 15)]  # about 600, 400 and 750 characters
TOK = CharTokenizer()

# (task, length, depth, seed) -> (key, answers, needle_spans, sha256 of the prompt ids' text [:16], sources),
# from the build_sample of commit 4b94d83.
PINNED = {
    ("single", 900, 0.5, 11): ("lucky-wagon", ("8580488",), [(441, 503)], "1bee4317f57dc5ea", ("gamma",)),
    ("multikey", 1200, 0.3, 12): ("narrow-meadow", ("9095657",), [(186, 249), (299, 363), (413, 478), (529, 593)],
                                  "8ad0bee58a6b43a7", ("beta", "gamma")),
    ("multivalue", 1500, 0.8, 13): ("fierce-needle", ("4777607", "3468933", "4868131", "4115934"),
                                    [(187, 251), (353, 417), (769, 833), (1138, 1202)], "9e8cf6307727f4c6",
                                    ("alpha", "beta")),
}


def _digest(ids) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _facts(s):
    return s.key, s.answers, [tuple(x) for x in s.needle_spans], _digest(s.prompt_ids), s.sources


@pytest.mark.parametrize("case", sorted(PINNED))
def test_pinned(case):
    task, length, depth, seed = case
    s = build_sample(TOK, task, length, depth, seed, haystack=HAYSTACK, tail=64, chat=False)
    assert _facts(s) == PINNED[case]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.35, 1.0])
def test_layout_by_brute_force(task, depth):
    length = 1000
    s = build_sample(TOK, task, length, depth, 5, haystack=HAYSTACK, tail=64, chat=False)
    ids = s.prompt_ids
    assert len(ids) == length and s.format == "plain" and ids[0] == BOS
    text = TOK.decode(ids)  # one character per id after the BOS
    question = QUESTIONS[task].format(key=s.key)
    tail = "\nQuestion: " + question + "\nAnswer:"
    assert text.startswith(HEADER) and text.endswith(tail) and s.question == question

    # Every needle span holds exactly one needle sentence (with its leading space), and nothing else does.
    needles = [text[a - 1 : b - 1] for a, b in s.needle_spans]  # text positions are id positions - 1 (the BOS)
    assert all(re.fullmatch(r" " + re.escape(NEEDLE).replace(r"\{key\}", r"[a-z]+-[a-z]+")
                            .replace(r"\{value\}", r"\d{7}"), n) for n in needles)
    assert text.count("special magic numbers for") == len(needles) + (0 if task != "multivalue" else 1)
    assert sorted(s.needle_spans) == s.needle_spans
    n_needles = {"single": 1, "multikey": 4, "multivalue": 4}[task]
    assert len(needles) == n_needles

    # Without the needles, the body is the haystack documents, from the first one used, joined by blank lines and
    # cut to the budget.
    body = text[len(HEADER) : len(text) - len(tail)]
    cut = body
    for n in needles:
        cut = cut.replace(n, "", 1)
    names = [name for name, _ in HAYSTACK]
    first = names.index(s.sources[0])
    joined = "\n\n".join(HAYSTACK[(first + k) % 3][1].strip() for k in range(3))
    budget = length - 1 - len(HEADER) - len(tail) - sum(map(len, needles))
    assert cut == joined[:budget] and len(cut) == budget

    # The queried needle (multivalue: the deepest) sits at the piece boundary nearest depth * budget (the earlier on
    # a tie); a boundary is the haystack's start or end, a sentence end before whitespace, or a blank line.
    bounds = sorted({0, budget} | {m.end() for m in re.finditer(r"[.!?](?=\s)", cut)}
                    | {m.start() for m in re.finditer(r"\n\n", cut)})
    want = min(bounds, key=lambda p: (abs(p - depth * budget), p))
    at, seen = {}, 0  # needle -> its insertion point in the cut haystack
    for a, b in s.needle_spans:
        at[text[a - 1 : b - 1]] = a - 1 - len(HEADER) - seen
        seen += b - a
    asked = [n for n in needles if any(v in n for v in s.answers)]
    queried_at = [at[n] for n in asked]
    assert (max(queried_at) if task == "multivalue" else queried_at[0]) == want
    assert all(p in bounds and p <= want for p in at.values())  # no needle deeper than `depth`


def test_suite_cells_are_the_samples():
    suite = build_suite(TOK, lengths=(700, 900), depths=(0.2, 0.6), tasks=TASKS, samples=2, seed=3, tail=64,
                        haystack=HAYSTACK, chat=False)
    assert [(s.context_tokens, s.depth, s.task) for s in suite] == [
        (n, d, t) for n in (700, 900) for d in (0.2, 0.6) for t in TASKS for _ in range(2)]
    again = build_sample(TOK, suite[5].task, suite[5].context_tokens, suite[5].depth, suite[5].seed,
                         haystack=HAYSTACK, tail=64, chat=False)
    assert again == suite[5]
