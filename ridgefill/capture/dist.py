"""Several processes or machines for one capture: `torchrun --nproc-per-node N -m ridgefill capture ...`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT); without them this is a world of
one and nothing here touches torch.distributed. The work is cut into blocks that depend on the input alone
(capture/runner.py); in round j, rank r computes block j*W + r, sends its statistics to rank 0, and rank 0 merges
the blocks in block order. The merge order is fixed by the work, not by the number of processes, so the
artifact is the same bytes for 1, 2 or 3 processes. Only rank 0 writes.

The statistics travel as flat float64 tensors over gloo (host memory, also on GPU machines: they are on the
host by then); no pickle. A rank that dies makes the others' sends or receives fail: they stop with one line
and the checkpoint of the last finished round stays, so re-running the same command resumes.

For tests, `RIDGEFILL_FAULT=RANK:BLOCK` makes that rank exit abruptly (as a kill -9 would) right after it has
computed that block; it is read only in a torchrun world.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ridgefill import environment
from ridgefill.capture.stats import FIELDS, Moments
from ridgefill.errors import BadInput, RidgefillError

RESUME = "the run stopped. Re-run the same command to resume from the last checkpoint."
LOST = "torchrun: rank {rank} lost contact with another rank ({why}); " + RESUME
STOPPED = "torchrun: rank {rank} was stopped (SIGTERM: another rank failed, or the job was cancelled); " + RESUME


class World:
    """This process's place among torchrun's workers (rank 0 of 1 without torchrun)."""

    def __init__(self) -> None:
        self.size = int(environment.get(environment.WORLD_SIZE))
        self.rank = int(environment.get(environment.RANK)) if self.size > 1 else 0
        self.local_rank = int(environment.get(environment.LOCAL_RANK)) if self.size > 1 else 0
        self._up = False

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def start(self) -> None:
        if not self.distributed or self._up:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")  # env:// rendezvous from torchrun's variables
        self._up = True
        # torchrun stops the other workers with SIGTERM when one fails: say so in one line (the checkpoint stays).
        self._sigterm = signal.signal(signal.SIGTERM, self._stopped)

    def _stopped(self, signum, frame):
        raise RidgefillError(STOPPED.format(rank=self.rank))

    def close(self, failed: bool = False) -> None:
        """Leave the world. After a failure the group is not torn down: a peer may be gone, and tearing down
        would wait for it; the process is about to exit anyway."""
        if self._up:
            import torch.distributed as dist

            signal.signal(signal.SIGTERM, self._sigterm)
            if not failed:
                dist.destroy_process_group()
            self._up = False

    # -- agreement ---------------------------------------------------------------------------------------

    def agree(self, what: str, text: str) -> None:
        """Every rank must have computed the same `text` (e.g. the capture id), or all stop with exit 2."""
        if not self.distributed:
            return
        import torch
        import torch.distributed as dist

        mine = torch.tensor(list(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        self._call(dist.all_gather, every, mine)
        differ = [r for r, t in enumerate(every) if not torch.equal(t, every[0])]
        if differ:
            raise BadInput(f"torchrun: ranks disagree on the command ({what} of rank {differ[0]} differs from "
                           f"rank 0's); run the same command, data and model on every rank")

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value, on every rank."""
        if not self.distributed:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        self._call(dist.broadcast, t, 0)
        return int(t.item())

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            self._call(dist.barrier)

    @contextmanager
    def rank0_first(self) -> Iterator[None]:
        """Rank 0 runs the body first (filling caches on disk), the others after it: one writer at a time."""
        if self.rank != 0:
            self.barrier()
        yield
        if self.rank == 0:
            self.barrier()

    # -- block results -----------------------------------------------------------------------------------

    def send_block(self, moments: list[Moments], held: dict[str, np.ndarray]) -> None:
        """Ship one block's statistics (and held-out rows) to rank 0."""
        import torch
        import torch.distributed as dist

        self._call(dist.send, torch.from_numpy(pack(moments)), 0)
        count = len(held.get("doc", ()))
        self._call(dist.send, torch.tensor([count], dtype=torch.int64), 0)
        if count:
            for key in sorted(held):
                self._call(dist.send, torch.from_numpy(np.ascontiguousarray(held[key])), 0)

    def recv_block(self, src: int, like: list[Moments], held_like: dict[str, tuple[tuple, np.dtype]]):
        """Rank 0: one block from `src`, shaped like `like` (moments) and `held_like` ({key: (row shape, dtype)})."""
        import torch
        import torch.distributed as dist

        flat = torch.empty(sum(packed_size(m) for m in like), dtype=torch.float64)
        self._call(dist.recv, flat, src)
        count = torch.empty(1, dtype=torch.int64)
        self._call(dist.recv, count, src)
        held = {}
        n = int(count.item())
        if n:
            for key in sorted(held_like):
                shape, dtype = held_like[key]
                buf = torch.from_numpy(np.empty((n, *shape), dtype=dtype))
                self._call(dist.recv, buf, src)
                held[key] = buf.numpy()
        return unpack(flat.numpy(), like), held

    def fault_point(self, block: int) -> None:
        """Test hook: RIDGEFILL_FAULT=RANK:BLOCK kills this rank (no cleanup, like kill -9) after that block."""
        spec = environment.get(environment.RIDGEFILL_FAULT)
        if self.distributed and spec == f"{self.rank}:{block}":
            os._exit(137)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as exc:  # gloo: connection closed / reset by a peer that died
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            why = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # drop gloo's "[file.cc:553] " prefix
            raise RidgefillError(LOST.format(rank=self.rank, why=why[:160])) from exc


def packed_size(m: Moments) -> int:
    return 1 + sum(getattr(m, f).size for f in FIELDS if f != "n")


def pack(moments: list[Moments]) -> np.ndarray:
    """Moments -> one flat float64 array: per Moments n, then the fields in FIELDS order."""
    parts = []
    for m in moments:
        parts.append(np.array([m.n], dtype=np.float64))  # exact for n < 2**53
        parts += [np.asarray(getattr(m, f), dtype=np.float64).ravel() for f in FIELDS if f != "n"]
    return np.concatenate(parts)


def unpack(flat: np.ndarray, like: list[Moments]) -> list[Moments]:
    out, at = [], 0
    for m in like:
        n = int(flat[at])
        at += 1
        vals = {}
        for f in FIELDS:
            if f == "n":
                continue
            shape = getattr(m, f).shape
            size = int(np.prod(shape))
            vals[f] = flat[at : at + size].reshape(shape).copy()
            at += size
        out.append(Moments(n, **vals))
    return out
