"""The sweep's needle prompts and their outcomes: the suite (`needle_suite`), every outcome measured so far
(`NeedleMemo`, resumable) and the measuring itself (`Prompts.measure`, what the searches in search.py call).

A prompt is measured once for every (split, arm) asked of it at once: one exact forward (or its early layers, read
back or cut at the deepest split), each split's fills on top of it, and one batched greedy decode of them all.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.evaluate.arms import Arm, parse_arm
from ridgefill.evaluate.measure import fills
from ridgefill.sweep.config import Setup, SweepConfig
from ridgefill.sweep.early import EarlyCaches, attention_only, early_run

HAYSTACKS = ("noise", "prose")  # the single needles' two haystacks, half the prompts each
NEEDLE_DEPTHS = 8  # the single-needle samples spread over this many depths of the filled prefix
DECODE_BATCH = 9  # prefills decoded together: one batched forward per step


def needle_suite(lm, cfg: SweepConfig) -> list[tuple[str, object]]:
    """`needles` single needles at `length` tokens as (haystack, sample): half in RULER's noise filler ("noise"),
    half in real prose ("prose", eval's haystack documents), alternating, each half spread over NEEDLE_DEPTHS
    depths of the filled prefix in turn, so that any first prompts cover both haystacks and every depth."""
    from ridgefill.evaluate.needles import build_suite, noise_haystack
    from ridgefill.evaluate.texts import haystack_documents

    top = (cfg.length - cfg.tail) / cfg.length  # the filled prefix ends here
    depths = tuple(round(float(x), 4) for x in np.linspace(0.05, top * 0.9, NEEDLE_DEPTHS))
    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    halves = {}
    for kind, want in zip(HAYSTACKS, (cfg.needles - cfg.needles // 2, cfg.needles // 2)):
        per = -(-want // len(depths))
        hay = noise_haystack() if kind == "noise" else haystack_documents()
        try:
            suite = build_suite(lm.tokenizer, lengths=(cfg.length,), depths=depths, tasks=("single",), samples=per,
                                seed=cfg.seed, tail=cfg.tail, chat=chat, haystack=hay)
        except ValueError as e:
            raise BadInput(f"needles ({kind} haystack): {e}") from None
        suite = [s for s in suite if s.in_filled_region(cfg.tail)]
        order = sorted(range(len(suite)), key=lambda i: (i % per, i // per))  # every depth in turn
        halves[kind] = [suite[i] for i in order][:want]
        if len(halves[kind]) < want:
            raise BadInput(f"only {len(halves[kind])} needle prompts of {cfg.length} tokens in the {kind} haystack "
                           "have their needle before the tail")
    out = []
    for i in range(max(len(h) for h in halves.values())):
        out += [(kind, halves[kind][i]) for kind in HAYSTACKS if i < len(halves[kind])]
    return out


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
        run = self._exact_run(i, torch.tensor(sample.prompt_ids), splits)
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
        """The exact run prompt i's fills at `splits` start from. Once exact's answer is known the fills need only
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
