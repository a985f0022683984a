"""The sweep's configuration phase: at the splits just shallower than the fitted maps' edge, the quality
configurations a release can record (+rows, +kscale, +protected), each beside its equal-cost control (docs/sweep.md,
"Configurations, not only splits").

Key ΔNLL first, on the documents. Then the needles: in an exhaustive sweep of every configuration and control not
over on key ΔNLL; in an adaptive one only of what can change the recommendation (`groups`), in order of compute
ceiling, stopping at the first within budget (every later one has a lower ceiling).
"""

from __future__ import annotations

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.evaluate.arms import parse_arm
from ridgefill.evaluate.measure import Checkpoint
from ridgefill.formats.release.names import CONFIGURATIONS
from ridgefill.runtime.rows import DEFAULT_TAIL
from ridgefill.sweep import documents
from ridgefill.sweep.config import Setup
from ridgefill.sweep.needles import NeedleMemo, Prompts, with_selected
from ridgefill.sweep.search import decision_words, run_pass
from ridgefill.sweep.sequential import TOLERANCE, Rule
from ridgefill.sweep.timing import ceiling_at

CONFIGS = CONFIGURATIONS[1:]  # the quality configurations a release can record, beyond the plain fill
CONTROL = {"ridgefill+rows": "ridgefill+rows:tail", "ridgefill+kscale": None,  # the equal-cost control of each
           "ridgefill+protected": "ridgefill+protected:tail"}
CONFIG_SPLITS = 2  # configurations are measured at this many candidates just shallower than the maps' edge
DOCUMENTS = "configuration_documents"  # their document rows in the checkpoint


def config_splits(splits: list[int], edge: int | None) -> list[int]:
    """The candidates just shallower than the fitted maps' edge (or the deepest, when no split is within)."""
    below = [s for s in splits if edge is None or s < edge]
    return below[-CONFIG_SPLITS:]


def kept_splits(splits: list[int], key_over: dict) -> tuple[int, ...]:
    """The splits this phase may measure at, known before the needles: those just shallower than any split the
    needles may find as the fitted maps' edge (one not over on key ΔNLL), or than none."""
    edges = [s for s in splits if not key_over[(s, "ridgefill")]] + [None]
    return tuple(sorted({c for e in edges for c in config_splits(splits, e)}))


def kscale_applies(lm, split: int) -> bool:
    """+kscale rescales keys, which a QK-norm renormalizes: only for models without one above the split."""
    from ridgefill.runtime.corrections import plan

    if lm.adapter.has_qk_norm:
        return False
    try:
        plan(lm.adapter, "ridgefill", split, ("kscale",), None, DEFAULT_TAIL)
    except BadInput:
        return False
    return True


def measure(setup: Setup, near: list[int], verdicts: dict, bar: float | None, prompts: Prompts, rule: Rule,
            done: Checkpoint) -> dict:
    """The configurations at the splits `near`, each beside its control. -> {(split, name): {"figures", "verdict",
    "decided", "pairs", "control": {...}, "beats_control", "why", "extra_rows"}}. `verdicts`: the plain search's
    ({(split, arm): verdict}); `bar`: the plain recommendation's ceiling (None: no split is within)."""
    names = [c for c in CONFIGS if c != "ridgefill+kscale" or kscale_applies(setup.lm, min(near))]
    names = [c for c in names if c != "ridgefill+protected" or all(setup.sources[s].protected for s in near)]
    if not names:
        return {}
    arms = with_selected([parse_arm(c) for c in names] + [parse_arm(CONTROL[c]) for c in names if CONTROL[c]])
    setup.out.info(f"configurations at split{'s' if len(near) > 1 else ''} {', '.join(map(str, near))}: "
                   + ", ".join(a.name for a in arms))
    docs = documents.measure(setup, near, arms, done, DOCUMENTS)
    if setup.cfg.exhaustive:  # every configuration and control not over on key ΔNLL, side by side
        want = [(s, a) for s in near for c in names for a in (c, CONTROL[c]) if a and not docs.over[(s, a)]]
        got, skipped = run_pass(list(dict.fromkeys(want)), rule, prompts.measure), {}
    else:
        groups = _groups(setup, near, names, docs, prompts.memo, done)
        got, skipped = _adaptive(groups, bar, rule, prompts.measure)
    out = {}
    for s in near:
        for c in names:
            entry = _entry((s, c), docs, got, skipped)
            ctl = CONTROL[c]
            if ctl:
                entry["control"] = {"arm": ctl, **_entry((s, ctl), docs, got, skipped)}
            else:  # a correction costs no rows: its control is the plain fill at the same split
                entry["control"] = {"arm": "ridgefill", "figures": None, "verdict": verdicts[(s, "ridgefill")],
                                    "decided": "the plain fill at this split"}
            entry["beats_control"], entry["why"] = _beats(entry, got, (s, c), (s, ctl) if ctl else None)
            entry["extra_rows"] = extra_rows(s, c, prompts.memo, done)
            out[(s, c)] = entry
    return out


def _entry(job, docs: documents.Documents, got: dict, skipped: dict) -> dict:
    """One configuration's (or control's) figures on the documents, its verdict and the needle pairs behind it."""
    return {"figures": docs.figures[job], **_verdict(job, docs.over, got, skipped),
            "pairs": got[job][1] if job in got else []}


def _adaptive(groups: list[dict], bar: float | None, rule: Rule, measure) -> tuple[dict, dict]:
    """Measure the groups in order of ceiling (highest first; on equal ones the deeper split), skipping those that
    cannot change the recommendation. -> ({job: (Decision, pairs)}, {job: why it was not measured})."""
    got, skipped, best = {}, {j: why for g in groups for j, why in g["skip"].items()}, None
    for g in sorted(groups, key=lambda g: (-g["ceiling"], -g["split"])):
        if bar is not None and g["ceiling"] <= bar + TOLERANCE:
            why = f"not measured: its ceiling x{g['ceiling']:.2f} is not above the plain fill's x{bar:.2f}"
        elif best is not None and g["ceiling"] < best - TOLERANCE:
            why = f"not measured: a candidate of higher ceiling (x{best:.2f}) is within budget"
        else:
            res = run_pass(g["jobs"], rule, measure) if g["jobs"] else {}
            got.update(res)
            if any(d.verdict == "within" for d, _ in res.values()):
                best = g["ceiling"] if best is None else max(best, g["ceiling"])
            continue
        skipped.update({j: why for j in g["jobs"]})
    return got, skipped


def _groups(setup: Setup, near, names, docs: documents.Documents, memo: NeedleMemo, done: Checkpoint) -> list[dict]:
    """What an adaptive sweep may measure of each configuration: {"split", "name", "ceiling" (with the rows it
    adds on the documents), "jobs", "skip": {job: why not measured}}. A configuration beside a control it
    cannot beat (the control is within key ΔNLL with a key ΔNLL as low) is not measured: its control alone is,
    as a longer tail. Every group in which something is within budget is a candidate at its ceiling (a
    configuration or control within is a candidate: a control beaten is the configuration's win)."""
    groups = []
    for s in near:
        for c in names:
            ctl = CONTROL[c]
            jobs, skip = [], {}
            key = docs.figures[(s, c)].get("dnll_key")
            if not docs.over[(s, c)]:
                ctl_key = docs.figures[(s, ctl)].get("dnll_key") if ctl else None
                if ctl and not docs.over[(s, ctl)] and (key is None or ctl_key is None or key >= ctl_key):
                    skip[(s, c)] = (f"not measured: its key ΔNLL ({_f(key)}) is not below its control's "
                                    f"({_f(ctl_key)}), so it cannot beat it")
                else:
                    jobs.append((s, c))
            if ctl and not docs.over[(s, ctl)]:
                jobs.append((s, ctl))
            rows = round(extra_rows(s, c, memo, done))
            groups.append({"split": s, "name": c, "ceiling": ceiling_at(setup.cfg, s, setup.layers, rows),
                           "jobs": jobs, "skip": skip})
    return groups


def extra_rows(split: int, arm: str, memo: NeedleMemo, done: Checkpoint) -> float:
    """The mean number of prefix rows a configuration runs exactly beyond the plain fill's, over the needle
    prompts it was measured on (else the documents)."""
    if arm == "ridgefill+kscale":
        return 0.0
    vals = [v for k, v in memo.data["added"].items() if k.split("/", 1)[1] == f"{split}/{arm}"]
    if not vals:
        vals = [d["added"][str(split)][arm] for d in done.rows.get(DOCUMENTS, [])
                if arm in d.get("added", {}).get(str(split), {})]
    return float(np.mean(vals)) if vals else 0.0


def _verdict(job, key_over: dict, got: dict, skipped: dict) -> dict:
    if key_over[job]:
        return {"verdict": "over", "decided": key_over[job]}
    if job not in got:
        return {"verdict": None, "decided": skipped.get(job, "not measured")}
    return {"verdict": got[job][0].verdict, "decided": decision_words(got[job][0])}


def _beats(entry: dict, got: dict, job, control) -> tuple[bool, str]:
    """Whether a configuration within budget beats its equal-cost control: the control is over budget, or the
    configuration has the lower key-token ΔNLL and answers at least as many of the needles both were measured on."""
    if entry["verdict"] is None:
        return False, entry["decided"]
    if entry["verdict"] != "within":
        return False, "over budget"
    ctl = entry["control"]
    if ctl["verdict"] == "over":
        return True, f"its control ({ctl['arm']}) is over budget"
    if ctl["verdict"] is None:
        return False, f"its control ({ctl['arm']}) was not measured"
    if control is None:
        return False, "the plain fill at this split is within budget too"
    ours, theirs = got[job][1], got[control][1]
    n = min(len(ours), len(theirs))
    a, b = sum(y for _, y in ours[:n]), sum(y for _, y in theirs[:n])
    ka, kb = entry["figures"].get("dnll_key"), ctl["figures"].get("dnll_key")
    if a >= b and ka is not None and kb is not None and ka < kb:
        return True, f"key ΔNLL {_f(ka)} < {_f(kb)}, needles {a} ≥ {b} of {n}"
    return False, f"its control is as good (key ΔNLL {_f(kb)} vs {_f(ka)}, needles {b} vs {a} of {n})"


def _f(v) -> str:
    return "–" if v is None else f"{v:.3f}"
