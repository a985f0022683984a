"""The solve's settings (`SolveConfig`), written once: the command's options, a recipe's [solve] table and the
stage's argument all take their defaults from here, and `check_config` refuses a bad value by the name the user gave
it. Light: no numpy, no torch.

    cfg = SolveConfig(split=12, alphas=(1e-3, 1e-2), maps="kv")
    solve(store, capture_id, cfg, out)                       # solve/run.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ridgefill.errors import BadInput

# --maps: what the late attention layers' maps predict. formats.release.names.INPUT_MAP / KV_MAP, written here again
# because this module stays light (the CLI reads it without numpy; tests/test_kv_maps.py holds the two equal)
INPUT_MAPS, KV_MAPS = "input", "kv"
MAP_CHOICES = (INPUT_MAPS, KV_MAPS)
METRIC_CHOICES = ("kv", "input")


@dataclass(frozen=True)
class SolveConfig:
    split: int | None = None  # which captured split; None: the capture's only one
    alphas: tuple[float, ...] | None = None  # None: ridge.DEFAULT_ALPHAS
    metric: str = "kv"  # held-out selection: mean key/value cosine, or the input cosine (input maps only)
    maps: str = INPUT_MAPS  # key/value maps for the late attention layers, or input maps (Gated DeltaNet layers: input)
    chat_share: float | None = None
    alpha_per_layer: bool = False
    state_data: tuple[str, ...] = ()  # hybrids: documents kept apart from the capture's (capture's --data forms)
    state_chunk: int = 2048  # tokens between two measured states (--state-data)
    # offsets k of the earlier states h_{S-k} the maps read besides h_S (the capture's --earlier, some or all of them,
    # in this order); None: every one the capture has; (): h_S alone
    earlier: tuple[int, ...] | None = None


FLAGS = {"alphas": "--alpha"}  # the command's flag of a setting, where it is not --<setting>


def flag(key: str) -> str:
    """How `ridgefill solve` names a setting: its flag."""
    return FLAGS.get(key, "--" + key.replace("_", "-"))


def check_config(cfg: SolveConfig, prefix: str = "", name: Callable[[str], str] = flag) -> None:
    """What can be checked without the capture; BadInput names the first problem by the name the user gave it
    (`name`: the command's flags, or a recipe's [solve] keys after `prefix`)."""
    for a in cfg.alphas or ():
        if not a > 0 or not math.isfinite(a):
            raise BadInput(f"{prefix}{name('alphas')} must be > 0 (got {a:g})")
    if cfg.metric not in METRIC_CHOICES:
        raise BadInput(f"{prefix}{name('metric')} must be one of {', '.join(METRIC_CHOICES)}, got {cfg.metric!r}")
    if cfg.maps not in MAP_CHOICES:
        raise BadInput(f"{prefix}{name('maps')} must be one of {', '.join(MAP_CHOICES)}, got {cfg.maps!r}")
    if cfg.maps == KV_MAPS and cfg.metric != "kv":
        raise BadInput(f"{prefix}{name('metric')} input scores predicted layer inputs, and key/value maps predict "
                       f"none: use {name('metric')} kv with {name('maps')} kv")
    if cfg.earlier is not None and (len(set(cfg.earlier)) != len(cfg.earlier) or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in cfg.earlier)):
        raise BadInput(f"{prefix}{name('earlier')} must be distinct offsets >= 1 (the states h_{{S-k}}), got "
                       f"{', '.join(map(str, cfg.earlier))}")
    if cfg.state_chunk < 1:
        raise BadInput(f"{prefix}{name('state_chunk')} must be >= 1, got {cfg.state_chunk}")
