"""The capture's resumable state: totals over finished blocks, the current block's partial statistics and the
held-out rows kept so far, saved exactly (one safetensors file, written by rename) every `--checkpoint-every`
seconds to `.work-<id>/state.safetensors`, so that a run stopped anywhere (even `kill -9`) resumes where it was and
writes byte-identical statistics.

A checkpoint falls between two documents or, in a long one, between two of its chunks: then it also holds the
position reached in that document (`doc_pos`: where its next chunk starts; the partial statistics and held-out rows
include its chunks so far) and the model's cache there (`cache.*` tensors, their layout in the metadata's `cache`;
capture/kvstate.py), and the run continues the document from that chunk with the cache restored.

The file is written tensor by tensor (a cache tensor is copied to the host only when its turn comes, and dropped
after) and read back the same way (`safetensors.read_header`, then each tensor from its byte range; the cache's only
when the document resumes), so a checkpoint inside a document adds at most one cache tensor to the host memory a
checkpoint between documents takes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ridgefill.capture import artifact
from ridgefill.capture.dist import World
from ridgefill.capture.kvstate import PREFIX, Lazy, Snapshot
from ridgefill.capture.stats import Moments, merge_into
from ridgefill.errors import BadInput
from ridgefill.formats import safetensors

STATE = "state.safetensors"
_DTYPES = ("F64", "I64", "F32", "I32", "F16", "BF16")  # what a state file holds


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
        self.total = total  # {(variant, split, target): Moments} over blocks < next_block
        self.part = {k: Moments.empty(len(m.yy), len(m.mean_x), m.mean_y.shape[1]) for k, m in total.items()}  # same shapes
        self.held: dict[str, list[np.ndarray]] = {}  # rows of finished blocks
        self.part_held: dict[str, list[np.ndarray]] = {}  # rows of the current block
        self.next_block = 0
        self.next_unit = 0
        # Inside unit `next_unit`: where its next chunk starts (0: not begun), and the model's cache there (a
        # kvstate.Snapshot: of the live cache when saving, of the file after `load`).
        self.doc_pos = 0
        self.doc_cache: Snapshot | None = None

    @classmethod
    def load(cls, work: Path, run_id: str, keys, empty, world: World) -> "State":
        st = cls(empty())
        f = work / STATE
        if f.is_file():
            read, names, meta = _reader(f)
            if meta.get("id") == run_id:
                for key in keys:
                    st.total[key] = Moments.from_arrays(read, f"total.{artifact.stats_prefix(key)}")
                    st.part[key] = Moments.from_arrays(read, f"part.{artifact.stats_prefix(key)}")
                for name in names:
                    for prefix, into in (("held.", st.held), ("partheld.", st.part_held)):
                        if name.startswith(prefix):
                            into[name.removeprefix(prefix)] = [read[name]]
                st.next_block, st.next_unit = int(meta["next_block"]), int(meta["next_unit"])
                st.doc_pos = int(meta.get("doc_pos", "0"))
                if st.doc_pos:
                    st.doc_cache = Snapshot(json.loads(meta["cache"]), {n: read.lazy(n) for n in names
                                                                        if n.startswith(PREFIX)})
        return st

    def drop_partial(self, empty: dict, blocks) -> None:
        self.part, self.part_held = empty, {}
        self.doc_pos, self.doc_cache = 0, None
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
        for key, m in which.items():
            arrays.update(m.to_arrays(artifact.stats_prefix(key)))
        return arrays

    def save(self, work: Path, run_id: str) -> None:
        """Write the state (with `doc_pos` set, also `doc_cache`: the cache inside the document) by rename."""
        work.mkdir(parents=True, exist_ok=True)
        arrays = {f"total.{k}": a for k, a in self._arrays(self.total).items()}
        arrays |= {f"part.{k}": a for k, a in self._arrays(self.part).items()}
        arrays |= {f"held.{k}": a for k, a in concat(self.held).items()}
        arrays |= {f"partheld.{k}": a for k, a in concat(self.part_held).items()}
        meta = {"id": run_id, "next_block": str(self.next_block), "next_unit": str(self.next_unit),
                "doc_pos": str(self.doc_pos)}
        lazy: dict[str, Lazy] = {}
        if self.doc_pos:
            meta["cache"] = json.dumps(self.doc_cache.layout, separators=(",", ":"), sort_keys=True)
            lazy = self.doc_cache.tensors
        _write(work / STATE, arrays, lazy, meta)

    def write_outputs(self, path: Path, splits, layers, num_layers, kv_layers, earlier=()) -> None:
        artifact.write_stats(path, self.total, splits, num_layers, kv_layers, earlier)
        held = concat(self.held)
        if held:
            artifact.write_heldout(path, held, layers)


# ------------------------------------------------------------------------------------- the file, tensor by tensor


def _write(path: Path, arrays: dict[str, np.ndarray], lazy: dict[str, Lazy], meta: dict[str, str]) -> None:
    """The state file: `arrays` and the `lazy` cache tensors, tensor by tensor (safetensors.save_streamed)."""
    safetensors.save_streamed(path, {n: safetensors.lazy_array(a) for n, a in arrays.items()} | lazy, meta)


def _reader(path: Path) -> tuple[safetensors.LazyFile, list[str], dict[str, str]]:
    """(tensors by name, read on demand; their names; the metadata) of a state file, its header checked."""
    f = safetensors.LazyFile(path)
    for name, e in f.entries.items():
        if e.dtype not in _DTYPES:
            raise BadInput(f"{path.name}: tensor {name!r} has dtype {e.dtype}, which no capture state holds")
    return f, f.names, f.metadata
