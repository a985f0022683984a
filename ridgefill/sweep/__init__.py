"""Sweep: measure several split layers side by side with eval's measurements and recommend the one to ship
(docs/sweep.md). config.py holds the settings and their checks, run.py the stage and the order of its phases
(documents.py, needles.py with search.py and sequential.py, configurations.py, early.py, result.py, timing.py),
report.py the recommendation and table, plot.py the plot, artifact.py its files; kinds.py puts a sweep of each map
kind side by side.

    from ridgefill.sweep import SweepConfig, parse_splits, sweep
    from ridgefill.sweep import RECIPE_KEYS, check_config     # a recipe's [sweep] table, checked as it is read
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"SweepConfig": "config", "parse_splits": "config", "sweep": "run",
                                          "RECIPE_KEYS": "config", "RENAMED": "config", "check_config": "config",
                                          "renamed": "config"})
