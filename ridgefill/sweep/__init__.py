"""Sweep: measure several split layers side by side with eval's measurements and recommend the one to ship
(docs/sweep.md). run.py is the stage, report.py the recommendation, table and plot, artifact.py its files.

    from ridgefill.sweep import SweepConfig, parse_splits, sweep
    from ridgefill.sweep import RECIPE_KEYS, check_config     # a recipe's [sweep] table, checked as it is read
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"SweepConfig": "run", "parse_splits": "run", "sweep": "run",
                                          "RECIPE_KEYS": "run", "check_config": "run"})
