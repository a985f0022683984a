"""The sweep's long-document phase: ΔNLL, KL and top-1 of each (split, arm) against exact, measured with eval's
code on eval's documents, and the verdict on the budget's document figures (key-token ΔNLL, and a gate's ΔNLL, KL
and top-1 limits) that decides a (split, arm) before any needle.

Every document runs the exact model once; each (split, arm) runs only its late layers on top of it
(`evaluate.measure.measure_documents`). The rows go to the build's `Checkpoint`, so a stopped sweep resumes at the
next document.
"""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.evaluate.measure import Checkpoint, eval_documents, measure_documents
from ridgefill.sweep.config import FIGURES, Setup, SweepConfig, budget
from ridgefill.sweep.sequential import TOLERANCE


@dataclass(frozen=True)
class Documents:
    """One document pass: the rows (per document: {"name", "tokens", split: {arm: doc_summary}, "added": {split:
    {arm: rows}}}), each (split, arm)'s figures (`figures`), and which figure puts each over budget (`over`)."""

    rows: list
    figures: dict  # {(split, arm name): {"dnll", "dnll_key", "kl", "top1", ...}}
    over: dict  # {(split, arm name): the first figure over budget, in words ("key ΔNLL 0.61 > 0.5"), or None}


def measure(setup: Setup, splits, arms, done: Checkpoint, kind: str) -> Documents:
    """The documents at `splits` for `arms` (evaluate.arms.Arm), as checkpoint rows named `kind`."""
    cfg = setup.cfg
    docs = eval_documents(setup.lm, cfg.length, cfg.documents, setup.calib)

    def row(name, tokens, per):
        return {"name": name, "tokens": tokens, **{str(s): p[0] for s, p in per.items()},
                "added": {str(s): p[1] for s, p in per.items()}}

    rows = measure_documents(setup.lm, docs, cfg.length, {s: setup.sources[s] for s in splits}, arms, cfg.tail,
                             cfg.scored, setup.out, row=row, seed=cfg.seed, done=done, kind=kind)
    figures = {(s, a.name): figures_of(rows, s, a.name, cfg, setup.layers) for s in splits for a in arms}
    return Documents(rows, figures, {job: over_budget(job, f, cfg) for job, f in figures.items()})


def figures_of(rows: list[dict], split: int, arm: str, cfg: SweepConfig, layers: int) -> dict:
    """The long-document figures of one (split, arm): eval's summary of the documents alone ({} if unmeasured)."""
    from ridgefill.evaluate import EvalConfig
    from ridgefill.evaluate.summary import summarize

    k = str(split)
    docs = [{"name": d["name"], "tokens": d["tokens"], arm: d[k][arm]} for d in rows if arm in d.get(k, {})]
    if not docs:
        return {}
    ecfg = EvalConfig(arms=("exact", arm), tail=cfg.tail, lengths=(cfg.length,), seed=cfg.seed,
                      bootstrap=cfg.bootstrap)
    summ = summarize({"split": split, "num_layers": layers, "tail": cfg.tail, "documents": docs, "needles": []}, ecfg)
    return {k: v for k, v in summ["arms"][arm].items() if k.startswith(("dnll", "kl", "top1"))}


def over_budget(job, figures: dict, cfg: SweepConfig) -> str | None:
    """The first of the budget's document figures (`config.budget`) that puts `job` (split, arm) over, in words, or
    None when it is within on all. A figure not measured (no key tokens in the documents) is over, as it cannot
    show the arm within."""
    for key, (kind, limit) in budget(cfg).items():
        if key == "needle_drop":
            continue
        v = figures.get(key)
        if v is None:
            return f"{FIGURES[key]} not measured"
        if (kind == "max" and v > limit + TOLERANCE) or (kind == "min" and v < limit - TOLERANCE):
            return f"{FIGURES[key]} {v:.3g} {'>' if kind == 'max' else '<'} {limit:g}"
    return None
