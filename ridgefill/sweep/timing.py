"""The sweep's speed figures: the compute ceiling of a (split, tail) (`ceiling_at`, the runtime's), the timing
rounds of real prefills (`rounds`), the measured speed-ups drawn from them (`add_speeds`), and the CPU and wall
seconds each phase of a run spent (`Clock`).
"""

from __future__ import annotations

import time

import numpy as np

from ridgefill.evaluate.arms import parse_arm
from ridgefill.sweep.config import Setup, SweepConfig
from ridgefill.sweep.needles import with_selected


def ceiling_at(cfg: SweepConfig, split: int, layers: int, rows: int = 0) -> float:
    """The compute ceiling (`runtime.ceiling_speedup`) of a fill at `split` of `layers` on `length`-token prompts
    whose exact tail is `tail` plus `rows` rows a configuration runs exactly (at most the whole prompt)."""
    from ridgefill.runtime import ceiling_speedup

    return ceiling_speedup(cfg.length, min(cfg.tail + rows, cfg.length), split, layers)


def rounds(setup: Setup, prompt: list[int], rec: dict) -> dict:
    """`repeats` rounds of real, timed prefills of `prompt` (the first needle prompt): exact, then the fitted maps
    at every split (and the recommendation `rec`, when it is a configuration or a longer tail, at its split), the
    order reversed every other round, so that a slow spell of a shared machine lands on every arm alike. Each is a
    whole prefill of its own, early layers included (`fills(timed=True)`)."""
    import torch

    from ridgefill.evaluate.measure import fills
    from ridgefill.runtime import ExactRun, prefill

    cfg, lm = setup.cfg, setup.lm
    ids = torch.tensor(prompt)
    arms = [(s, parse_arm("ridgefill"), cfg.tail) for s in setup.splits]
    if rec["split"] is not None and (rec["configuration"] != "ridgefill" or rec["tail"] != cfg.tail):
        arms.append((rec["split"], parse_arm(rec["configuration"]), rec["tail"]))
    setup.out.info(f"timing: {cfg.repeats} rounds of {len(arms) + 1} prefills of {len(prompt)} tokens")
    run = ExactRun(ids=ids.to(lm.adapter.device), logits=None, cache=None, states={}, seconds=0.0)
    out = []
    for r in range(cfg.repeats):
        secs = {"exact": prefill(lm, ids, "exact", split=0, tail=cfg.tail, logits_rows=1).seconds}
        for s, arm, tail in (arms if r % 2 == 0 else arms[::-1]):
            res, _ = fills(lm, run, setup.sources[s], with_selected([arm]), tail, timed=True, logits_rows=1,
                           seed=cfg.seed)
            secs[f"{s}/{arm.name}/{tail}"] = res[arm.name].seconds
        out.append(secs)
    return {"length": len(prompt), "repeats": cfg.repeats, "rounds": out}


def add_speeds(result: dict) -> None:
    """Add the measured speed-ups of `result`'s timing rounds: per split (the fitted maps) and for the
    recommendation, the median and [min, max] over the rounds of exact's time over the arm's, flagged as noise where
    the median exceeds the compute ceiling (a prefill cannot beat the work it skips: such a figure is the machine,
    not the fill)."""
    t, tail = result["timing"], result["tail"]

    def speed(key: str, ceiling_speedup: float) -> dict | None:
        runs = [r["exact"] / r[key] for r in t["rounds"] if r.get(key)]
        if not runs:
            return None
        med = float(np.median(runs))
        return {"median": med, "low": float(min(runs)), "high": float(max(runs)), "runs": runs,
                "noise": med > ceiling_speedup}

    for e in result["splits"]:
        e["speed"] = speed(f"{e['split']}/ridgefill/{tail}", e["ceiling_speedup"])
    rec = result["recommended"]
    if rec["split"] is not None:
        rec["speed"] = speed(f"{rec['split']}/{rec['configuration']}/{rec['tail']}", rec["ceiling_speedup"])


class Clock:
    """CPU and wall seconds of each phase of this process's run (a resumed sweep counts only what it did again)."""

    def __init__(self):
        self.laps: dict = {}
        self._cpu, self._wall = time.process_time(), time.perf_counter()

    def lap(self, name: str) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        self.laps[name] = {"cpu": round(cpu - self._cpu, 2), "wall": round(wall - self._wall, 2)}
        self._cpu, self._wall = cpu, wall
