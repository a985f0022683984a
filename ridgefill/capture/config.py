"""The capture's settings (`CaptureConfig`) and its other defaults: where the calibration text comes from when none
is given (`DEFAULT_DATA`) and how often a run checkpoints (`CHECKPOINT_EVERY`). Light: the CLI and the recipe reader
import it without torch or numpy, so that each option's default is the one written here.

    cfg = CaptureConfig(splits=(12,), chunk=512)
    capture(store, model, list(DEFAULT_DATA), cfg, out)     # capture/run.py
"""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.capture.corpus import BUILTIN
from ridgefill.runtime.rows import OUTLIER_RATIO

DEFAULT_DATA = (BUILTIN,)  # the calibration text when none is given (--data, a recipe's [capture] data)
CHECKPOINT_EVERY = 30.0  # seconds between resumable checkpoints (0: after every document)


@dataclass(frozen=True)
class CaptureConfig:
    splits: tuple[int, ...] = ()  # empty: the model's default split
    chat: bool = False
    chunk: int = 1024  # tokens per forward through the KV cache
    max_length: int | None = None  # truncate documents; None: the model's context
    held_out: int = 4
    held_out_rows: int = 2048
    seed: int = 0
    product_dtype: str = "float32"  # the per-chunk centred products (totals are float64 either way)
    trust_remote_code: bool = False
    outlier_ratio: float = OUTLIER_RATIO  # rows whose split state exceeds this x their chunk's median norm: not fitted
    # offsets k of the earlier states h_{S-k} stacked under each split's h_S as the maps' input (docs/method.md,
    # "Maps from earlier states"); empty: the maps read h_S alone
    earlier: tuple[int, ...] = ()
