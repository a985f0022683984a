"""Quantize: the maps to int8 (one bf16 scale per group of a row's weights, ridgefill.formats.int8), with the
rounding error along the calibration mean folded into the bias, re-scored on the held-out rows.

    from ridgefill.quantize import quantize                  # the stage (run.py)
    from ridgefill.quantize import artifact                  # its files, and the maps of a solve or quantize
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"quantize": "run"})
