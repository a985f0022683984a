"""Solve: closed-form ridge maps over an alpha grid, chosen on held-out rows (docs/method.md, "Ridge maps"
and "Choosing alpha").

    from ridgefill.solve import solve                        # the stage (run.py)
    from ridgefill.solve import artifact                     # its files: maps, protected tokens, state offsets
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"solve": "run"})
