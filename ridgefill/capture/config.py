"""The capture's settings (`CaptureConfig`) and its other defaults: where the calibration text comes from when none
is given (`DEFAULT_DATA`) and how often a run checkpoints (`CHECKPOINT_EVERY`). Light: the CLI and the recipe reader
import it without torch or numpy, so that each option's default is the one written here.

    cfg = CaptureConfig(splits=(12,), chunk=512)
    capture(store, model, list(DEFAULT_DATA), cfg, out)     # capture/run.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ridgefill.capture.corpus import BUILTIN
from ridgefill.errors import BadInput
from ridgefill.runtime.rows import OUTLIER_RATIO

DEFAULT_DATA = (BUILTIN,)  # the calibration text when none is given (--data, a recipe's [capture] data)
CHECKPOINT_EVERY = 30.0  # seconds between resumable checkpoints by default (0: after every document)
SAVE_SHARE = 0.1  # by default, checkpoints are spaced so that writing them takes at most this share of the run
PRODUCT_DTYPES = ("float32", "float64")  # the per-chunk centred products' dtypes


def checkpoint_due(since: float, every: float | None, save_s: float) -> bool:
    """Whether a checkpoint is due `since` seconds after the last one, which took `save_s` to write. `every`: the
    seconds asked for (--checkpoint-every), honoured as given; None, the default: every CHECKPOINT_EVERY seconds,
    or less often where writing one would take more than SAVE_SHARE of the run (a 1.5B capture with earlier states
    writes 2 GB of moments per checkpoint: at 30 s apart, writing them took 40 % of its time)."""
    if every is not None:
        return since >= every
    return since >= max(CHECKPOINT_EVERY, save_s * (1 - SAVE_SHARE) / SAVE_SHARE)


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


def flag(key: str) -> str:
    """How `ridgefill capture` names a setting: its flag."""
    return "--" + key.replace("_", "-")


def check_config(cfg: CaptureConfig, prefix: str = "", name: Callable[[str], str] = flag) -> None:
    """BadInput for a config no model could run, naming the setting as the user gave it (`name`: the command's
    flags, or a recipe's [capture] keys after `prefix`)."""
    if cfg.chunk < 2:
        raise BadInput(f"{prefix}{name('chunk')} must be at least 2 tokens (got {cfg.chunk})")
    if cfg.max_length is not None and cfg.max_length < 2:
        raise BadInput(f"{prefix}{name('max_length')} must be at least 2 tokens (got {cfg.max_length})")
    if cfg.held_out_rows < 0:
        raise BadInput(f"{prefix}{name('held_out_rows')} must be >= 0")
    if not (cfg.outlier_ratio == 0 or cfg.outlier_ratio > 1):
        raise BadInput(f"{prefix}the outlier ratio ({name('outlier_ratio')}) must be 0 (off) or above 1, got "
                       f"{cfg.outlier_ratio}")
    if cfg.product_dtype not in PRODUCT_DTYPES:
        raise BadInput(f"{prefix}unknown product dtype '{cfg.product_dtype}' for {name('product_dtype')} (choose "
                       f"{' or '.join(PRODUCT_DTYPES)})")
    earlier = cfg.earlier
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in earlier):
        raise BadInput(f"{prefix}{name('earlier')} takes offsets k >= 1 below the split (the states h_{{S-k}}), got "
                       + ", ".join(map(str, earlier)))
    if len(set(earlier)) != len(earlier):
        raise BadInput(f"{prefix}{name('earlier')} names an offset twice: {', '.join(map(str, earlier))}")
