"""The eval's settings (`EvalConfig`) and its default arms. Light: the CLI imports it without torch or numpy, so that
each option's default is the one written here."""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.runtime.rows import DEFAULT_TAIL

DEFAULT_ARMS = ("exact", "ridgefill", "identity", "nofill")  # the rest are asked for by name (evaluate/arms.py)


@dataclass(frozen=True)
class EvalConfig:
    arms: tuple[str, ...] = DEFAULT_ARMS
    tail: int = DEFAULT_TAIL
    lengths: tuple[int, ...] = (2048, 4096)
    depths: tuple[float, ...] = (0.25, 0.5)
    tasks: tuple[str, ...] = ("single", "multikey", "multivalue")
    samples: int = 1  # per (length, depth, task) cell
    documents: int = 4
    doc_tokens: int = 2048
    scored: int = 256
    seed: int = 0
    bootstrap: int = 10000
