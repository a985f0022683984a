"""The job and result files between ridgefill and an engine runner (`python tests/<engine>_runner.py`).

A job file is JSON: {"model": <engine model path>, "jobs": [job, ...]}; a job is

    {"name": str, "ids": [int, ...],            # the whole prompt sent to the engine
     "cache": str | null,                      # an engine cache file: its P positions are loaded, not computed
     "forced": [int, ...],                     # teacher-forced continuation (may be empty)
     "max_new": int,                           # greedy tokens to generate
     "measure_only": bool}                     # optional: only the time to the first token

and its result {"name", "greedy": [int, ...], "forced_top1": [int, ...], "forced_margin": [float, ...],
"seconds": float} (a measure_only job: "name" and "seconds"): `forced_top1[i]` is the engine's top-1 token after
ids + forced[:i] (len(forced) + 1 entries), `forced_margin[i]` its log-probability margin over the engine's second
choice, and `seconds` the time to the first token (cache loading included). Standard library only.

The runners are test and bench tools, not part of the package: run as scripts with an engine environment's python,
they import this module from their own folder and ridgefill from the checkout that environment has on its path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_jobs(path) -> dict:
    spec = json.loads(Path(path).read_text())
    for j in spec["jobs"]:
        if j.get("cache") and not 0 < int(j.get("cached", 0)) < len(j["ids"]):
            raise ValueError(f"job {j['name']}: the cache must leave the engine at least one position")
    return spec


def write_results(path, results: list[dict]) -> None:
    Path(path).write_text(json.dumps({"results": results}, indent=1))


def top2(entry) -> list[list]:
    """[[token, log-prob], [token, log-prob]]: the two best of one position's log-prob dict (vLLM's {token: Logprob},
    ranked by its `rank`)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:2]
    return [[int(t), float(lp.logprob)] for t, lp in ranked]


def main_args() -> tuple[Path, Path]:
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: python {sys.argv[0]} JOBS.json RESULTS.json")
    return Path(sys.argv[1]), Path(sys.argv[2])
