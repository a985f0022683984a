"""The capture's work plan: one unit per document (calibration documents raw then chat, then the held-out ones), and
blocks of units that depend on the input alone (contiguous, balanced by tokens, at most MAX_BLOCKS). A block's
statistics are merged from empty, and blocks into the totals in block order, so the artifact is the same bytes
whatever the number of processes (capture/dist.py) and wherever a run resumed."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SKIP_FIRST = 1  # a document's first row is an attention sink with outsized activations: not fitted
MAX_BLOCKS = 64  # blocks of work; a torchrun world keeps at most this many ranks busy


@dataclass
class Unit:
    doc: int
    variant: str  # "raw" | "chat"
    tokens: int
    held: bool
    keep: list[int] = field(default_factory=list)  # held-out rows kept (document positions)


def make_units(ids: dict[str, list], calib: list[int], held: list[int], held_out_rows: int) -> list[Unit]:
    """Calibration documents (raw, then chat), then held-out documents (raw): one unit each."""
    units = [Unit(doc, v, len(ids[v][doc]), False) for v in ("raw", "chat") if v in ids for doc in calib]
    units = [u for u in units if u.tokens > SKIP_FIRST]
    # Held-out rows: an even share per document, evenly spaced over its usable rows (never row 0).
    if held and held_out_rows:
        quota = -(-held_out_rows // len(held))  # ceil
        for doc in held:
            n = len(ids["raw"][doc])
            if n <= SKIP_FIRST:
                continue
            take = np.unique(np.linspace(SKIP_FIRST, n - 1, num=min(quota, n - SKIP_FIRST)).round().astype(int))
            units.append(Unit(doc, "raw", n, True, [int(p) for p in take]))
    return units


def blocks(units: list[Unit]) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of units, about equal in tokens, at most MAX_BLOCKS: fixed by the input."""
    total = sum(u.tokens for u in units)
    count = min(MAX_BLOCKS, len(units))
    if count == 0:
        return []
    # Unit i goes to the block its token midpoint falls in.
    edges, before = [], 0
    for u in units:
        edges.append(min(count - 1, int((before + u.tokens / 2) * count / total)))
        before += u.tokens
    blocks, start = [], 0
    for i in range(1, len(units) + 1):
        if i == len(units) or edges[i] != edges[i - 1]:
            blocks.append((start, i))
            start = i
    return blocks


