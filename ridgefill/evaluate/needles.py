"""RULER-style needle-in-a-haystack prompts whose needles sit in the filled prefix (rows 0..N-T-1).

    from ridgefill.evaluate.needles import build_suite, score_answer
    suite = build_suite(tokenizer, lengths=(2048, 4096), samples=10, seed=0, tail=512)
    for s in suite:
        if not s.in_filled_region():        # a needle reaches into the tail: not a test of the fill
            continue
        text = generate(s.prompt_ids, max_new_tokens=s.max_new_tokens)   # greedy
        ok = score_answer(s, text)

Tasks (RULER's niah_single / niah_multikey / niah_multivalue, numbers as values):
- "single": one needle "One of the special magic numbers for {key} is: {value}."; the answer is its value.
- "multikey": the real needle among 3 distractor needles with other keys (and other values).
- "multivalue": 4 needles with the same key and 4 different values; the answer must contain all 4.
Keys are "adjective-noun" words from fixed lists, values 7-digit numbers, all drawn from `random.Random(seed)`,
which also picks the haystack's first document; a key or value that happens to occur in the haystack is redrawn.

Depth. The needle asked about (single, multikey) or one of the values (multivalue) goes to relative depth
`depth` of the haystack; every other needle goes to a depth drawn uniformly from [0, depth]. So no needle is
deeper than `depth`, and whether a sample lies in the filled region depends on depth, length and tail only
(up to the snapping below). Needles go in at sentence / paragraph boundaries of the haystack, the nearest one to
depth * (haystack tokens).

Prompt format. Content = HEADER + haystack with needles + "\\nQuestion: {question}". With `chat=True` and a
tokenizer that has a chat template, the content is the single user message of the template, with the generation
prompt added (no system message beyond what the template itself adds, no answer prefix); otherwise it is plain
text: the tokenizer's special prefix (e.g. BOS) + content + "\\nAnswer:".

Token ids. The prompt is a list of pieces (template text, header, haystack sentences, needles, question), each
tokenized on its own without special tokens, and the prompt ids ARE the concatenation of the pieces' ids; so
every needle's token span is known by construction. Pieces split at whitespace that leads the next piece
(" One of ...", "\\n\\nThe ..."), where byte-level and SentencePiece tokenizers split words anyway, so the ids are
what tokenizing the whole text would give except, rarely, at a piece boundary. The haystack is cut at token
level to make the prompt exactly `length` tokens.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from ridgefill.evaluate.texts import haystack_documents, special_prefix
from ridgefill.runtime.rows import DEFAULT_TAIL

TASKS = ("single", "multikey", "multivalue")
# RULER's niah_single_1 filler: repeated plain sentences, so a single needle stands out from the haystack. The
# multi-key and multi-value tasks use real prose (texts.haystack_documents), as RULER's essay variants do.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTIONS = {
    "single": "What is the special magic number for {key} mentioned in the provided text?",
    "multikey": "What is the special magic number for {key} mentioned in the provided text?",
    "multivalue": "What are all the special magic numbers for {key} mentioned in the provided text?",
}
DISTRACTORS = 3  # multikey: needles with other keys
VALUES = 4  # multivalue: values for the one key
MAX_NEW_TOKENS = {"single": 32, "multikey": 32, "multivalue": 96}
PLACEHOLDER = "RIDGEFILLCONTENTPLACEHOLDER"
LONG_PIECE = 600  # characters: longer haystack pieces (code blocks, tables) are split at their newlines too

ADJECTIVES = (
    "amber", "ancient", "bitter", "brave", "breezy", "bright", "calm", "clever", "cold", "crimson", "curious",
    "dusty", "eager", "early", "faint", "fancy", "fierce", "gentle", "golden", "grumpy", "hidden", "hollow",
    "humble", "icy", "jolly", "lazy", "little", "lively", "lucky", "misty", "narrow", "noisy", "odd", "pale",
    "proud", "quiet", "rapid", "rough", "rusty", "shiny", "silent", "silver", "sleepy", "smooth", "sour",
    "stormy", "sunny", "tall", "tender", "tiny", "velvet", "wild", "windy", "wise", "wooden", "young",
)  # fmt: skip
NOUNS = (
    "anchor", "apple", "badger", "banjo", "barrel", "beacon", "blanket", "bridge", "bucket", "candle", "canyon",
    "carpet", "castle", "cherry", "cloud", "compass", "cottage", "crayon", "dolphin", "engine", "falcon",
    "feather", "fiddle", "garden", "glacier", "hammer", "harbor", "helmet", "island", "jacket", "kettle",
    "ladder", "lantern", "lemon", "meadow", "mirror", "mitten", "needle", "orchard", "otter", "paddle",
    "parrot", "pebble", "pencil", "pepper", "pillow", "planet", "pocket", "rabbit", "ribbon", "saddle",
    "sailor", "spider", "statue", "teapot", "thunder", "tiger", "tunnel", "violin", "wagon", "walrus",
    "whistle", "window", "zebra",
)  # fmt: skip

_SPLIT = re.compile(r"(?<=[.!?])(?=\s)|(?=\n\n)")


def noise_haystack(chars: int = 200_000) -> list[tuple[str, str]]:
    """The noise filler as one haystack document of at least `chars` characters."""
    return [("noise", NOISE * (chars // len(NOISE) + 1))]


@dataclass(frozen=True)
class NeedleSample:
    task: str
    context_tokens: int  # the target length; len(prompt_ids) equals it
    depth: float
    seed: int
    prompt_ids: list[int] = field(repr=False)
    needle_spans: list[tuple[int, int]]  # [start, end) of every needle in the prompt, in prompt order
    queried: tuple[int, ...]  # indices into needle_spans of the needle(s) the question asks about
    answers: tuple[str, ...]  # every one must appear in the generated text
    question: str
    key: str
    tail: int  # the tail the sample was built for: the default of in_filled_region
    format: str  # "chat" or "plain"
    sources: tuple[str, ...]  # names of the haystack documents used, in order

    @property
    def n(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.task]

    def in_filled_region(self, tail: int | None = None) -> bool:
        """True if every needle ends before row N - tail, i.e. lies wholly in the rows the fill approximates."""
        tail = self.tail if tail is None else tail
        limit = self.n - tail
        return limit > 0 and all(end <= limit for _, end in self.needle_spans)


class _Frame(NamedTuple):
    """What surrounds the content: ids before it and after it, the text after the question inside it, the format."""

    pre: list[int]
    post: list[int]
    answer_cue: str
    format: str  # "chat" or "plain"


@dataclass(frozen=True)
class _Draw:
    """One draw of a sample's needles from its random.Random."""

    keys: list[str]  # distinct; keys[0] is the key asked about (multikey: one per needle, the others distractors)
    values: list[str]  # one per needle, distinct
    needle_keys: list[str]  # each needle's key
    depths: list[float]  # each needle's relative depth: needle 0 at `depth`, the others uniform in [0, depth]
    start: int  # the haystack's first document


@dataclass(frozen=True)
class _Parts:
    """A sample's pieces as token ids, before the haystack is cut to its budget."""

    draw: _Draw
    question: str
    header: list[int]
    question_ids: list[int]  # the question and the answer cue
    needles: list[list[int]]  # in draw order
    haystack: list[tuple[str, list[int]]]  # (text, ids) pieces holding at least `budget` tokens
    sources: list[str]  # the haystack documents used, in order
    budget: int  # the haystack tokens that make the prompt `length` long


def _derive_seed(*parts) -> int:
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _split(text: str) -> list[str]:
    pieces = []
    for p in _SPLIT.split(text):
        if len(p) > LONG_PIECE:
            # (?=\n) splits before each newline, so the newline leads the next piece like the space does.
            pieces += [q for q in re.split(r"(?=\n)", p) if q]
        elif p:
            pieces.append(p)
    return pieces


def _frame(tokenizer, chat: bool) -> _Frame:
    """The prompt's frame: a chat template's text around the user message, else the special prefix and the
    plain-text answer cue."""
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": PLACEHOLDER}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(PLACEHOLDER) != 1:
            raise ValueError("the chat template does not render the user message exactly once")
        before, after = rendered.split(PLACEHOLDER)
        pre, post = _encode(tokenizer, [before, after])
        return _Frame(pre, post, "", "chat")
    return _Frame(special_prefix(tokenizer), [], "\nAnswer:", "plain")


def _haystack(tokenizer, docs, start: int, budget: int):
    """Pieces (text, ids) from docs[start], docs[start+1], ... (wrapping) holding at least `budget` tokens."""
    pieces: list[tuple[str, list[int]]] = []
    names: list[str] = []
    total = 0
    for k in range(len(docs)):
        name, text = docs[(start + k) % len(docs)]
        parts = _split(("\n\n" if pieces else "") + text.strip())
        ids = _encode(tokenizer, parts)
        names.append(name)
        for p, i in zip(parts, ids):
            if i:
                pieces.append((p, i))
                total += len(i)
        if total >= budget:
            return pieces, names
    raise ValueError(f"the haystack documents hold {total} tokens, fewer than the {budget} needed")


def build_sample(
    tokenizer,
    task: str,
    length: int,
    depth: float,
    seed: int,
    *,
    haystack: list[tuple[str, str]] | None = None,
    tail: int = DEFAULT_TAIL,
    chat: bool = True,
) -> NeedleSample:
    """One prompt of exactly `length` tokens; see the module docstring. `haystack`: (name, text) documents,
    default `haystack_documents()`."""
    if task not in TASKS:
        raise ValueError(f"unknown needle task {task!r} (known: {', '.join(TASKS)})")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    docs = haystack_documents() if haystack is None else list(haystack)
    if not docs:
        raise ValueError("no haystack documents")
    frame = _frame(tokenizer, chat)
    parts = _clean_parts(tokenizer, docs, task, length, depth, random.Random(seed), frame)
    cut = _cut(parts.haystack, parts.budget)
    slots = _slots(cut, parts.budget, parts.draw.depths)
    prompt, spans = _assemble(frame, parts, cut, slots)
    assert len(prompt) == length, (len(prompt), length)

    draw = parts.draw
    in_order = sorted(range(len(spans)), key=lambda i: spans[i])
    queried_needles = [0] if task != "multivalue" else list(range(len(spans)))
    return NeedleSample(
        task=task,
        context_tokens=length,
        depth=depth,
        seed=seed,
        prompt_ids=prompt,
        needle_spans=[spans[i] for i in in_order],
        queried=tuple(sorted(in_order.index(i) for i in queried_needles)),
        answers=tuple(draw.values[i] for i in in_order if i in queried_needles),
        question=parts.question,
        key=draw.keys[0],
        tail=tail,
        format=frame.format,
        sources=tuple(parts.sources),
    )


def _draw(rng: random.Random, task: str, depth: float, n_docs: int) -> _Draw:
    """Keys, values, depths and the haystack's first document, drawn in that order."""
    n_needles = {"single": 1, "multikey": 1 + DISTRACTORS, "multivalue": VALUES}[task]
    n_keys = n_needles if task == "multikey" else 1
    keys: list[str] = []
    while len(keys) < n_keys:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in keys:
            keys.append(k)
    values: list[str] = []
    while len(values) < n_needles:
        v = str(rng.randint(1_000_000, 9_999_999))
        if v not in values:
            values.append(v)
    needle_keys = keys if task == "multikey" else [keys[0]] * n_needles
    depths = [depth] + [rng.uniform(0.0, depth) for _ in range(n_needles - 1)]
    return _Draw(keys, values, needle_keys, depths, rng.randrange(n_docs))


def _parts(tokenizer, docs, task: str, length: int, draw: _Draw, frame: _Frame) -> _Parts:
    """The header, question and needles of `draw` tokenized, and haystack pieces enough to fill the prompt to
    `length`; ValueError when the prompt without haystack is already that long."""
    question = QUESTIONS[task].format(key=draw.keys[0])
    needle_texts = [" " + NEEDLE.format(key=k, value=v) for k, v in zip(draw.needle_keys, draw.values)]
    header, question_ids, *needles = _encode(
        tokenizer, [HEADER, "\nQuestion: " + question + frame.answer_cue] + needle_texts
    )
    fixed = len(frame.pre) + len(header) + len(question_ids) + len(frame.post) + sum(map(len, needles))
    budget = length - fixed
    if budget < 1:
        raise ValueError(f"length {length} is too short: the prompt without haystack is {fixed} tokens")
    pieces, names = _haystack(tokenizer, docs, draw.start, budget)
    return _Parts(draw, question, header, question_ids, needles, pieces, names, budget)


def _clean_parts(tokenizer, docs, task: str, length: int, depth: float, rng: random.Random,
                 frame: _Frame) -> _Parts:
    """The parts of the first of up to 20 draws none of whose keys or values occurs in its haystack."""
    for _attempt in range(20):
        parts = _parts(tokenizer, docs, task, length, _draw(rng, task, depth, len(docs)), frame)
        hay_text = "".join(p for p, _ in parts.haystack)
        if not any(x in hay_text for x in parts.draw.values + parts.draw.keys):
            return parts
    raise ValueError("could not draw needle keys and values absent from the haystack")


def _cut(pieces: list[tuple[str, list[int]]], budget: int) -> list[list[int]]:
    """The pieces' ids, the last one shortened (and any after it dropped) so that they hold `budget` tokens."""
    cut: list[list[int]] = []
    used = 0
    for _, ids in pieces:
        if used >= budget:
            break
        take = ids[: budget - used]
        cut.append(take)
        used += len(take)
    return cut


def _slots(cut: list[list[int]], budget: int, depths: list[float]) -> list[int]:
    """Each needle's slot: the index of the cut piece it goes before (len(cut): after the whole haystack), the
    boundary nearest its depth * budget tokens (the earlier one on a tie)."""
    starts = [0]
    for ids in cut[:-1]:
        starts.append(starts[-1] + len(ids))
    starts.append(budget)
    return [min(range(len(starts)), key=lambda j: (abs(starts[j] - d * budget), j)) for d in depths]


def _assemble(frame: _Frame, parts: _Parts, cut: list[list[int]], slots: list[int]):
    """(prompt ids, [start, end) of each needle in draw order): the frame, the header, the cut haystack with each
    needle before its slot's piece (needles sharing a slot by depth, then draw order), the question."""
    n_needles = len(parts.needles)
    prompt = frame.pre + parts.header
    spans: list[tuple[int, int]] = [(0, 0)] * n_needles
    order = sorted(range(n_needles), key=lambda i: (slots[i], parts.draw.depths[i], i))
    pos = 0
    for j in range(len(cut) + 1):
        while pos < n_needles and slots[order[pos]] == j:
            i = order[pos]
            spans[i] = (len(prompt), len(prompt) + len(parts.needles[i]))
            prompt += parts.needles[i]
            pos += 1
        if j < len(cut):
            prompt += cut[j]
    return prompt + parts.question_ids + frame.post, spans


def build_suite(
    tokenizer,
    *,
    lengths=(2048, 4096),
    depths=(0.1, 0.3, 0.5, 0.7),
    tasks=TASKS,
    samples: int = 10,
    seed: int = 0,
    tail: int = DEFAULT_TAIL,
    haystack: list[tuple[str, str]] | None = None,
    chat: bool = True,
) -> list[NeedleSample]:
    """Every (length, depth, task) cell with `samples` samples, in that nesting order. Each sample's seed is
    derived from (seed, task, length, depth, index), so a cell does not change when others are added.
    All samples are returned; the caller keeps those with `in_filled_region()`."""
    docs = haystack_documents() if haystack is None else list(haystack)
    out = []
    for length in lengths:
        for depth in depths:
            for task in tasks:
                for i in range(samples):
                    s = _derive_seed(seed, task, length, depth, i)
                    out.append(
                        build_sample(tokenizer, task, length, depth, s, haystack=docs, tail=tail, chat=chat)
                    )
    return out


def score_answer(sample: NeedleSample, text: str) -> bool:
    """Exact match: every expected value occurs in `text` as a whole number (not inside a longer digit run)."""
    return all(re.search(rf"(?<!\d){re.escape(a)}(?!\d)", text) for a in sample.answers)


def answer_complete(sample: NeedleSample, text: str) -> bool:
    """True once `text` holds every answer as a whole number that more text cannot extend (a non-digit follows it):
    `score_answer` of any continuation is then True, so greedy decoding may stop there with the same score."""
    return all(re.search(rf"(?<!\d){re.escape(a)}(?=\D)", text) for a in sample.answers)


def decode_and_score(lm, sample: NeedleSample, results: list) -> list[bool]:
    """Greedy decoding from each prefill (PrefillResults of this sample's prompt) scored against the sample, each
    stopping once its answer is complete. Prefills with DynamicCaches decode together in one batch
    (`runtime.greedy_batch`), a SlotCache ("nofill") on its own."""
    from ridgefill.runtime import SlotCache, greedy, greedy_batch

    text = lambda toks: lm.tokenizer.decode(toks, skip_special_tokens=True)  # noqa: E731
    stop = lambda toks: answer_complete(sample, text(toks))  # noqa: E731
    dyn = [i for i, r in enumerate(results) if not isinstance(r.cache, SlotCache)]
    toks = dict(zip(dyn, greedy_batch(lm, [results[i] for i in dyn], sample.max_new_tokens, stop=stop)))
    for i, r in enumerate(results):
        if i not in toks:
            toks[i] = greedy(lm, r, sample.max_new_tokens, stop=stop)
    return [score_answer(sample, text(toks[i])) for i in range(len(results))]
