"""The sweep's result (`sweep.json`, docs/sweep.md "Output"), assembled from what the phases measured: per split
the held-out cosines, both fills' figures and verdicts, the compute ceiling, the multiply-accumulates and the
configurations measured there; the rule, the search, every needle outcome and the cost. The recommendation, the
timing and the speeds are added after (run.py).
"""

from __future__ import annotations

import numpy as np

from ridgefill.sweep.artifact import ARMS
from ridgefill.sweep.config import Setup, SweepConfig, budget
from ridgefill.sweep.configurations import CONTROL
from ridgefill.sweep.documents import Documents
from ridgefill.sweep.needles import TASKS, Prompts
from ridgefill.sweep.search import Edges
from ridgefill.sweep.sequential import WITHIN_FACTOR, Rule
from ridgefill.sweep.timing import ceiling_at


def assemble(setup: Setup, model: str, fits: list, plain: Documents, edges: Edges, configs: dict, prompts: Prompts,
             rule: Rule) -> dict:
    """The result before the recommendation. `fits`: [(split, solve artifact, quantize artifact or None)]; `plain`
    and `edges`: the plain fills' documents and needle search; `configs`: the configuration phase's entries."""
    cfg, memo, suite = setup.cfg, prompts.memo, prompts.suite
    exact = memo.data["exact"]
    measured = sorted(int(i) for i in exact)
    by_suite = {k: [exact[str(i)] for i in measured if suite[i][0].task == k] for k in TASKS}
    jobs = dict(edges.jobs)  # every job measured, in this run's searches or (configurations) from the memo
    for k in memo.data["arms"]:
        _, s, a = k.split("/", 2)
        jobs.setdefault((int(s), a), (None, memo.pairs(int(s), a)))
    cost = {"needle_prompts": {f"{s}/{a}": len(p) for (s, a), (_, p) in sorted(jobs.items())},
            "prompts_with_exact_answer": len(measured), "exact_forwards": prompts.forwards,
            "early_layers_read_back": prompts.reused}
    return {"model": model, "num_layers": setup.layers, "length": cfg.length, "tail": cfg.tail,
            "samples": cfg.needles,  # the key the format has had from the start (RENAMED)
            "documents": cfg.documents, "mode": "exhaustive" if cfg.exhaustive else "adaptive",
            "budget": {"max_needle_drop": cfg.max_needle_drop, "max_key_dnll": cfg.max_key_dnll,
                       "gate": dict(cfg.gate), "limits": {k: list(v) for k, v in budget(cfg).items()}},
            "rule": {"alpha": rule.alpha, "group": rule.group, "within_factor": WITHIN_FACTOR,
                     "looks": list(rule.looks), "level": rule.level, "bounds": rule.bounds()},
            "exact": {"needle": 100.0 * float(np.mean([exact[str(i)] for i in measured])) if measured else None,
                      "needle_by_suite": {k: [sum(v), len(v)] for k, v in by_suite.items()}},
            "splits": [_split_entry(setup, fit, plain, edges, configs, suite) for fit in fits],
            "search": edges.search, "cost": cost,
            "mix": {"lengths": sorted({k.length for k, _ in suite}), "forms": sorted({k.form for k, _ in suite}),
                    "tasks": list(TASKS), "group": rule.group},
            "needles": [{"index": i, **suite[i][0]._asdict(), "depth": suite[i][1].depth, "exact": exact[str(i)],
                         "arms": {k.split("/", 1)[1]: v for k, v in memo.data["arms"].items()
                                  if int(k.split("/", 1)[0]) == i}} for i in measured],
            "documents_detail": plain.rows}


def _split_entry(setup: Setup, fit, plain: Documents, edges: Edges, configs: dict, suite: list) -> dict:
    """One split's entry: its maps, held-out cosines, ceiling, MACs, both fills and its configurations."""
    cfg, (s, sol, q) = setup.cfg, fit
    rep = sol.manifest["summary"]
    arms = {a: {**plain.figures[(s, a)], **needle_figures(edges.jobs[(s, a)][1] if (s, a) in edges.jobs else [],
                                                           suite, cfg),
                "verdict": edges.verdicts[(s, a)], "decided": edges.decided[(s, a)]} for a in ARMS}
    return {"split": s, "alpha": rep["alpha"], "solve": sol.id, "quantize": q.id if q else None,
            "ceiling_speedup": ceiling_at(cfg, s, setup.layers),
            "heldout": {"fitted": _kv(rep["fitted"]), "identity": _kv(rep["identity"])},
            "macs": macs(setup, s, "ridgefill", 0), "arms": arms,
            "configurations": {name: _configuration(setup, s, name, c, suite)
                               for (cs, name), c in configs.items() if cs == s}}


def _configuration(setup: Setup, split: int, name: str, c: dict, suite: list) -> dict:
    """One configuration's entry beside its control (the control's tail: the rows it adds, on top of the tail)."""
    cfg, extra = setup.cfg, c["extra_rows"]
    tail = cfg.tail + round(extra)
    conf = {"figures": {**c["figures"], **needle_figures(c["pairs"], suite, cfg)},
            "verdict": c["verdict"], "decided": c["decided"], "extra_rows": extra,
            "ceiling_speedup": ceiling_at(cfg, split, setup.layers, round(extra)),
            "beats_control": c["beats_control"], "why": c["why"],
            "control": {**{k: v for k, v in c["control"].items() if k != "pairs"},
                        "tail": tail if CONTROL[name] else cfg.tail}}
    if CONTROL[name]:
        conf["control"]["figures"] = {**(c["control"]["figures"] or {}),
                                      **needle_figures(c["control"]["pairs"], suite, cfg)}
    conf["macs"] = macs(setup, split, name, extra)
    return conf


def needle_figures(pairs: list, suite: list, cfg: SweepConfig) -> dict:
    """Needle figures of one job's (exact right, arm right) pairs, on the suite's first prompts: accuracy, exact's
    on the same prompts, the right answers per task, and the paired bootstrap interval of (arm - exact) in points. No
    accuracy for a job never measured."""
    from ridgefill.numerics import paired_bootstrap

    if not pairs:
        return {"needle": None, "needle_n": 0}
    e = np.array([100.0 * x for x, _ in pairs])
    a = np.array([100.0 * y for _, y in pairs])
    n = len(pairs)
    kinds = [suite[i][0].task for i in range(n)]
    suites = {k: [int(sum(a[j] > 0 for j in range(n) if kinds[j] == k)), kinds.count(k)] for k in TASKS}
    return {"needle": float(a.mean()), "needle_exact": float(e.mean()), "needle_n": n, "needle_by_suite": suites,
            "needle_minus_exact": paired_bootstrap(a, e, samples=cfg.bootstrap, seed=cfg.seed)}


def macs(setup: Setup, split: int, arm: str, extra: float) -> dict:
    """Multiply-accumulates of exact and of the arm at `length` (evaluate/macs.py): `extra`, the rows the arm runs
    exactly beyond the plain fill's, counted with the anchor row as its first prefix rows ("+rows" also pays for
    its probe)."""
    from ridgefill.evaluate.macs import model_shape, prefill_macs

    cfg = setup.cfg
    shape = model_shape(setup.lm.adapter)
    base = "ridgefill+rows" if arm == "ridgefill+rows" else "ridgefill"
    return {"exact": prefill_macs(shape, cfg.length, cfg.tail, split, "exact")["total"],
            "arm": prefill_macs(shape, cfg.length, cfg.tail, split, base, exact_rows=1 + round(extra),
                                map_kinds=setup.sources[split].map_kinds,
                                states=len(setup.sources[split].reads))["total"]}


def _kv(scores: dict) -> dict:
    return {"k_cosine": scores["k_cosine"], "v_cosine": scores["v_cosine"]}
