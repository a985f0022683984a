"""The solve's settings (`SolveConfig`), written once: the command's options and the stage's keyword arguments take
their defaults from here. Light: no numpy, no torch."""

from __future__ import annotations

from dataclasses import dataclass

# --maps: what the late attention layers' maps predict. formats.release.names.INPUT_MAP / KV_MAP, written here again
# because this module stays light (the CLI reads it without numpy; tests/test_kv_maps.py holds the two equal)
INPUT_MAPS, KV_MAPS = "input", "kv"
MAP_CHOICES = (INPUT_MAPS, KV_MAPS)
METRIC_CHOICES = ("kv", "input")


@dataclass(frozen=True)
class SolveConfig:
    alphas: tuple[float, ...] | None = None  # None: ridge.DEFAULT_ALPHAS
    metric: str = "kv"  # held-out selection: mean key/value cosine, or the input cosine (input maps only)
    maps: str = INPUT_MAPS  # key/value maps for the late attention layers, or input maps (Gated DeltaNet layers: input)
    chat_share: float | None = None
    alpha_per_layer: bool = False
    state_chunk: int = 2048  # tokens between two measured states (--state-data)
