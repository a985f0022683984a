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
import os
import struct
from pathlib import Path

import numpy as np

from ridgefill.capture import artifact
from ridgefill.capture.dist import World
from ridgefill.capture.kvstate import PREFIX, Lazy, Snapshot
from ridgefill.capture.stats import Moments, merge_into
from ridgefill.errors import BadInput
from ridgefill.formats import safetensors

STATE = "state.safetensors"
# the safetensors dtypes a state file holds -> numpy dtype (bfloat16 as its bits)
_NUMPY = {"F64": "<f8", "I64": "<i8", "F32": "<f4", "I32": "<i4", "F16": "<f2", "BF16": "<u2"}


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
                for v, s in keys:
                    st.total[(v, s)] = Moments.from_arrays(read, f"total.{v}.split{s}")
                    st.part[(v, s)] = Moments.from_arrays(read, f"part.{v}.split{s}")
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
        for (v, s), m in which.items():
            arrays.update(m.to_arrays(f"{v}.split{s}"))
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

    def write_outputs(self, path: Path, splits, layers, num_layers) -> None:
        artifact.write_stats(path, self.total, splits, num_layers)
        held = concat(self.held)
        if held:
            artifact.write_heldout(path, held, layers)


# ------------------------------------------------------------------------------------- the file, tensor by tensor


def _write(path: Path, arrays: dict[str, np.ndarray], lazy: dict[str, Lazy], meta: dict[str, str]) -> None:
    """A safetensors file of `arrays` and `lazy` (each fetched only when its turn comes, then dropped), written to a
    temporary file and renamed, so a crash never leaves a half-written state."""
    entries: dict[str, Lazy] = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        entries[name] = Lazy(safetensors.dtype_of(a), a.shape, a.nbytes, lambda a=a: a)
    entries |= lazy
    width = lambda n: -(entries[n].nbytes // max(1, int(np.prod(entries[n].shape))))  # noqa: E731 (wider first)
    order = sorted(entries, key=lambda n: (width(n), n))
    header: dict = {"__metadata__": dict(sorted(meta.items()))}
    at = 0
    for name in order:
        e = entries[name]
        header[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            e = entries[name]
            a = e.fetch()
            data = np.ascontiguousarray(a.bits if isinstance(a, safetensors.BF16) else a)
            data = data.astype(data.dtype.newbyteorder("<"), copy=False)  # safetensors is little-endian
            if data.nbytes != e.nbytes or tuple(data.shape) != tuple(e.shape):
                raise RuntimeError(f"capture checkpoint: {name} changed while it was written")
            if data.size:
                f.write(memoryview(data.reshape(-1)).cast("B"))
            del a, data
    os.replace(tmp, path)


class _Read:
    """The tensors of a state file, each read from its byte range when asked for."""

    def __init__(self, path: Path, entries, base: int):
        self.path, self.entries, self.base = path, entries, base

    def __getitem__(self, name: str):
        e = self.entries[name]
        count = int(np.prod(e.shape))
        a = np.fromfile(self.path, dtype=_NUMPY[e.dtype], count=count, offset=self.base + e.start).reshape(e.shape)
        return safetensors.BF16(a) if e.dtype == "BF16" else a

    def lazy(self, name: str) -> Lazy:
        e = self.entries[name]
        return Lazy(e.dtype, e.shape, e.end - e.start, lambda: self[name])


def _reader(path: Path) -> tuple[_Read, list[str], dict[str, str]]:
    """(tensors by name, read on demand; their names; the metadata) of a state file, its header checked by
    `safetensors.read_header`."""
    entries, meta = safetensors.read_header(path)
    for name, e in entries.items():
        if e.dtype not in _NUMPY:
            raise BadInput(f"{path.name}: tensor {name!r} has dtype {e.dtype}, which no capture state holds")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return _Read(path, entries, 8 + n), list(entries), meta
