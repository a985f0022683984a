"""Forward pre-hooks that record the hidden state entering chosen decoder layers.

The hooks only store references; the math runs afterwards (capture/stats.py). After the last layer we
need has been recorded, the forward is stopped, so the rest of the stack and the LM head never run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class StopForward(Exception):
    """Raised by the last hook: everything we need has been recorded."""


@contextmanager
def layer_inputs(layers, wanted: list[int], stop: bool = True) -> Iterator[dict[int, object]]:
    """Record `h_l` (the input of layer l, [batch, seq, d]) for each l in `wanted` into the yielded dict; with
    `stop`, the forward ends (StopForward) once the last of them is recorded."""
    seen: dict[int, object] = {}
    last = max(wanted) if stop and wanted else None
    handles = []

    def make(idx: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            seen[idx] = h.detach()
            if idx == last:
                raise StopForward

        return hook

    try:
        for i in wanted:
            handles.append(layers[i].register_forward_pre_hook(make(i), with_kwargs=True))
        yield seen
    finally:
        for h in handles:
            h.remove()
