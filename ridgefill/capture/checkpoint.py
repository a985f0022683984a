"""The capture's resumable state: totals over finished blocks, the current block's partial statistics and the
held-out rows kept so far, saved exactly (one safetensors file, written by rename) every `--checkpoint-every`
seconds to `.work-<id>/state.safetensors`, so that a run stopped anywhere (even `kill -9`) resumes where it was and
writes byte-identical statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ridgefill.capture import artifact
from ridgefill.capture.dist import World
from ridgefill.capture.stats import Moments, merge_into
from ridgefill.formats import safetensors

STATE = "state.safetensors"


def concat(held_rows: dict) -> dict[str, np.ndarray]:
    """{key: list of row arrays} -> {key: one array}; the lists collapse in place, so saving a checkpoint again
    copies nothing it copied before (peak memory must not grow with the checkpoints a long run writes)."""
    for k, v in held_rows.items():
        if len(v) > 1:
            held_rows[k] = [np.concatenate(v)]
    return {k: v[0] for k, v in held_rows.items() if v}


class State:
    """Totals over finished blocks, the current block's partial statistics, held-out rows; saved exactly."""

    def __init__(self, total: dict):
        self.total = total  # {(variant, split): Moments} over blocks < next_block
        self.part = {k: Moments.empty(len(m.yy), len(m.mean_x), m.mean_y.shape[1]) for k, m in total.items()}  # same shapes
        self.held: dict[str, list[np.ndarray]] = {}  # rows of finished blocks
        self.part_held: dict[str, list[np.ndarray]] = {}  # rows of the current block
        self.next_block = 0
        self.next_unit = 0

    @classmethod
    def load(cls, work: Path, run_id: str, keys, empty, world: World) -> "State":
        st = cls(empty())
        f = work / STATE
        if f.is_file():
            arrays, meta = safetensors.load(f)
            if meta.get("id") == run_id:
                for v, s in keys:
                    st.total[(v, s)] = Moments.from_arrays(arrays, f"total.{v}.split{s}")
                    st.part[(v, s)] = Moments.from_arrays(arrays, f"part.{v}.split{s}")
                for name in arrays:
                    for prefix, into in (("held.", st.held), ("partheld.", st.part_held)):
                        if name.startswith(prefix):
                            into[name.removeprefix(prefix)] = [arrays[name]]
                st.next_block, st.next_unit = int(meta["next_block"]), int(meta["next_unit"])
        return st

    def drop_partial(self, empty: dict, blocks) -> None:
        self.part, self.part_held = empty, {}
        self.next_unit = blocks[self.next_block - 1][1] if self.next_block else 0

    def add_held(self, rows: dict[str, list[np.ndarray]], partial: bool) -> None:
        into = self.part_held if partial else self.held
        for k, v in rows.items():
            if v:
                into.setdefault(k, []).extend(v)

    def finish_block(self, empty: dict) -> None:
        for k, m in self.part.items():
            self.total[k] = merge_into(self.total[k], m)
        self.add_held(self.part_held, partial=False)
        self.part, self.part_held = empty, {}
        self.next_block += 1

    def held_rows(self) -> int:
        return int(sum(len(a) for a in self.held.get("doc", [])))

    def _arrays(self, which: dict) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        for (v, s), m in which.items():
            arrays.update(m.to_arrays(f"{v}.split{s}"))
        return arrays

    def save(self, work: Path, run_id: str) -> None:
        work.mkdir(parents=True, exist_ok=True)
        arrays = {f"total.{k}": a for k, a in self._arrays(self.total).items()}
        arrays |= {f"part.{k}": a for k, a in self._arrays(self.part).items()}
        arrays |= {f"held.{k}": a for k, a in concat(self.held).items()}
        arrays |= {f"partheld.{k}": a for k, a in concat(self.part_held).items()}
        meta = {"id": run_id, "next_block": str(self.next_block), "next_unit": str(self.next_unit)}
        safetensors.save(work / STATE, arrays, meta)

    def write_outputs(self, path: Path, splits, layers, num_layers) -> None:
        artifact.write_stats(path, self.total, splits, num_layers)
        held = concat(self.held)
        if held:
            artifact.write_heldout(path, held, layers)


