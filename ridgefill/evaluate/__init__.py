"""Evaluation: the release-gate measurements (documents, needles, summary, gate) built on the fill runtime
(`ridgefill.runtime`).

    from ridgefill.evaluate import EvalConfig, check, evaluate, record   # the stage (run.py)

Importing this package does not import torch; `ridgefill.runtime` does.
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"DEFAULT_ARMS": "config", "EvalConfig": "config", "check": "run",
                                          "evaluate": "run", "record": "run"})
