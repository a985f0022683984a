"""The sweep's needle prompts and their outcomes: the suite (`needle_suite`), every outcome measured so far
(`NeedleMemo`, resumable) and the measuring itself (`Prompts.measure`, what the searches in search.py call).

A prompt is measured once for every (split, arm) asked of it at once: one exact forward (or its early layers, read
back or cut at the deepest split), each split's fills on top of it, and one batched greedy decode of them all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.evaluate.arms import Arm, parse_arm
from ridgefill.evaluate.needles import TASKS  # eval's needle kinds: the mix holds them in equal shares
from ridgefill.evaluate.measure import fills
from ridgefill.sweep.config import Setup, SweepConfig
from ridgefill.sweep.early import EarlyCaches, attention_only, early_run

HAYSTACKS = ("noise", "prose")  # the single needles' two haystacks, in turn
FORMS = ("chat", "plain")  # through the chat template (where the model has one), and plain text with "Answer:"
NEEDLE_DEPTHS = 8  # each kind's prompts spread over this many depths of the filled prefix
MIN_GROUP = 8  # the rule looks after whole rounds of the mix, at least this many prompts apart
DECODE_BATCH = 9  # prefills decoded together: one batched forward per step


class Kind(NamedTuple):
    """What one needle prompt tests: eval's task, the haystack it hides in, the prompt form and its length."""

    task: str
    haystack: str
    form: str
    length: int

    @property
    def label(self) -> str:
        return f"{self.task} {self.haystack} {self.form} {self.length}"


@dataclass(frozen=True)
class Mix:
    """The needle prompts' kinds, drawn in rounds: every round holds each (length, form, task) once, so that the
    pooled drop weighs eval's three tasks equally, as the release gate's does, in each prompt form the model takes
    and at each length. The single needle's haystack turns between noise and prose from one (length, form) to the
    next and from round to round. `group`: whole rounds of at least MIN_GROUP prompts, the sequential rule's look."""

    lengths: tuple[int, ...]
    forms: tuple[str, ...]

    def round(self, r: int) -> list[Kind]:
        out = []
        for j, (n, form) in enumerate((n, f) for n in self.lengths for f in self.forms):
            for task in TASKS:
                hay = HAYSTACKS[(r + j) % 2] if task == "single" else "prose"
                out.append(Kind(task, hay, form, n))
        return out

    @property
    def size(self) -> int:
        return len(TASKS) * len(self.lengths) * len(self.forms)

    @property
    def group(self) -> int:
        return self.size * -(-MIN_GROUP // self.size)

    def prompts(self, needles: int) -> int:
        """`needles` rounded up to whole rounds: the most prompts a job draws."""
        return self.size * -(-needles // self.size)


def mix_of(lm, cfg: SweepConfig) -> Mix:
    """The mix a sweep of `cfg` draws on `lm`: its length and the long length where the model's context holds it,
    both prompt forms where the tokenizer has a chat template (else plain text alone)."""
    from ridgefill.sweep.config import long_length

    long = long_length(cfg, lm.ref.context_length)  # what check_context held the sweep to
    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    return Mix(lengths=(cfg.length,) + ((long,) if long else ()), forms=FORMS if chat else ("plain",))


def needle_suite(lm, cfg: SweepConfig, mix: Mix | None = None) -> list[tuple[Kind, object]]:
    """The sweep's needle prompts as (kind, sample), `mix.prompts(cfg.needles)` of them: round after round of the
    mix, each kind's prompts spread over NEEDLE_DEPTHS depths of its filled prefix in turn (one kind's k-th prompt
    at depth k + its place in the round, modulo the depths), so that any first rounds cover every kind and depth.
    Their needles lie before the tail. Single needles hide in RULER's noise filler or in real prose (eval's
    haystack documents), the other tasks in prose, as in eval's suite."""
    from ridgefill.evaluate.needles import build_suite, noise_haystack
    from ridgefill.evaluate.texts import haystack_documents

    mix = mix or mix_of(lm, cfg)
    rounds = mix.prompts(cfg.needles) // mix.size
    kinds = [mix.round(r) for r in range(rounds)]
    want: dict = {}  # {kind: [depth index of its k-th prompt]}
    for r, ks in enumerate(kinds):
        for place, k in enumerate(ks):
            want.setdefault(k, []).append((r + place) % NEEDLE_DEPTHS)
    made = {}
    for k, at in want.items():
        top = (k.length - cfg.tail) / k.length  # the filled prefix ends here
        depths = tuple(round(float(x), 4) for x in np.linspace(0.05, top * 0.9, NEEDLE_DEPTHS))
        per = max(at.count(d) for d in set(at))
        hay = noise_haystack() if k.haystack == "noise" else haystack_documents()
        try:
            suite = build_suite(lm.tokenizer, lengths=(k.length,), depths=depths, tasks=(k.task,), samples=per,
                                seed=cfg.seed + FORMS.index(k.form), tail=cfg.tail, chat=k.form == "chat",
                                haystack=hay)
        except ValueError as e:
            raise BadInput(f"needles ({k.label}): {e}") from None
        by_depth = [[s for s in suite[d * per : (d + 1) * per] if s.in_filled_region(cfg.tail)]
                    for d in range(NEEDLE_DEPTHS)]
        made[k] = []
        for d in at:
            if not by_depth[d]:
                raise BadInput(f"needles ({k.label}): a prompt of {k.length} tokens at depth {depths[d]} has its "
                               f"needles in the tail of {cfg.tail} tokens")
            made[k].append(by_depth[d].pop(0))
    return [(k, made[k].pop(0)) for ks in kinds for k in ks]


class NeedleMemo:
    """Every needle outcome measured so far, in `<work>/needles.json` (rewritten by rename after each prompt): exact's
    answer per prompt, each (prompt, split, arm)'s, and the rows a selector added. A stopped sweep resumes where it
    was, and a job already measured on a prompt is never measured again."""

    def __init__(self, work):
        self.path = Path(work) / "needles.json"
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {"exact": {}, "arms": {}, "added": {}}

    @staticmethod
    def key(i: int, split: int, arm: str) -> str:
        return f"{i}/{split}/{arm}"

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, self.data)

    def pairs(self, split: int, arm: str) -> list[tuple[bool, bool]]:
        """The (exact right, arm right) pairs measured for (split, arm), in prompt order."""
        job = f"{split}/{arm}"
        idx = sorted(int(k.split("/", 1)[0]) for k in self.data["arms"] if k.split("/", 1)[1] == job)
        return [(self.data["exact"][str(i)], self.data["arms"][self.key(i, split, arm)]) for i in idx]


def with_selected(arms) -> list[Arm]:
    """`arms` with, before each control, the selected-rows arm it matches in cost (`fills` counts its rows)."""
    out: list[Arm] = []
    for a in arms:
        a = parse_arm(a) if isinstance(a, str) else a
        if a.control and a.selected not in out:
            out.append(a.selected)
        if a not in out:
            out.append(a)
    return out


class Prompts:
    """The needle prompts of one sweep, measured on demand: `measure(i, jobs)` is prompt i's outcome for each job
    (split, arm), from the memo where it is there. `forwards` counts the exact forwards this process ran, `reused`
    the prompts whose early layers it read back instead (the cost report)."""

    def __init__(self, setup: Setup, suite: list, memo: NeedleMemo, early: EarlyCaches):
        self.setup, self.suite, self.memo, self.early = setup, suite, memo, early
        self.forwards = 0
        self.reused = 0

    def measure(self, i: int, jobs) -> tuple[bool, dict]:
        """-> (exact right, {job: arm right}) on prompt i; what the memo lacks is measured now, in one pass."""
        memo, data = self.memo, self.memo.data
        todo = [(s, a) for s, a in jobs if memo.key(i, s, a) not in data["arms"]]
        if todo or str(i) not in data["exact"]:
            self._measure(i, todo)
        got = {(s, a): data["arms"][memo.key(i, s, a)] for s, a in jobs}
        kind, line = self.suite[i][0], ", ".join(f"{a}@{s}" for s, a in jobs)
        self.setup.out.info(f"  prompt {i + 1} ({kind}): exact {'✓' if data['exact'][str(i)] else '✗'} · "
                            + " ".join(f"{a}@{s} {'✓' if got[(s, a)] else '✗'}" for s, a in jobs) if len(line) < 200
                            else f"  prompt {i + 1} ({kind}): {len(jobs)} jobs")
        return data["exact"][str(i)], got

    def _measure(self, i: int, todo: list) -> None:
        """Measure prompt i's exact answer (if not in the memo) and the jobs `todo`, and save them in the memo."""
        import torch

        from ridgefill.evaluate.needles import decode_and_score

        lm, cfg, memo, data = self.setup.lm, self.setup.cfg, self.memo, self.memo.data
        sample = self.suite[i][1]
        splits = sorted({s for s, _ in todo})
        reads = sorted({l for s in splits for l in self.setup.sources[s].reads})  # the states the maps read
        run = self._exact_run(i, torch.tensor(sample.prompt_ids), reads)
        made, names = [], []  # the prefills to decode, and whose each is (None: exact's)
        if str(i) not in data["exact"]:
            made.append(run.result(cfg.tail))
            names.append(None)
        for s in splits:
            want = [a for t, a in todo if t == s]
            arms = with_selected(want)  # a control's selected arm counts its rows; only the jobs are decoded
            res, added = fills(lm, run, self.setup.sources[s], arms, cfg.tail, logits_rows=1, seed=cfg.seed,
                               counted={a.name for a in arms} - set(want))
            made += [res[a] for a in want]
            names += [(s, a) for a in want]
            for a, n in added.items():
                data["added"][memo.key(i, s, a)] = n
        ok = []
        for at in range(0, len(made), DECODE_BATCH):
            ok += decode_and_score(lm, sample, made[at : at + DECODE_BATCH])
        for name, right in zip(names, ok):
            if name is None:
                data["exact"][str(i)] = bool(right)
            else:
                data["arms"][memo.key(i, *name)] = bool(right)
        memo.save()

    def _exact_run(self, i: int, ids, splits: list[int]):
        """The exact run prompt i's fills start from, keeping the states entering `splits` (the fills' splits and
        any earlier layers their maps read). Once exact's answer is known the fills need only
        the layers below them: read back where they were kept, else cut at the deepest split (a model whose cache is
        keys and values alone). Otherwise the whole forward, whose early layers are kept for a later pass."""
        from ridgefill.runtime import exact_run

        lm, known = self.setup.lm, str(i) in self.memo.data["exact"]
        run = self.early.load(i, ids, splits) if known else None
        if run is not None:
            self.reused += 1
            return run
        self.forwards += 1
        if known and attention_only(lm):
            return early_run(lm, ids, splits)
        run = exact_run(lm, ids, splits=sorted(set(splits) | set(self.early.splits)))
        self.early.save(i, run)
        return run
