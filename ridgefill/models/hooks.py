"""Forward pre-hooks on the model's own modules: context managers that register them and remove them on exit.

- `layer_inputs`: the hidden state entering chosen decoder layers (capture's statistics, the runtime's exact run).
  The hooks only store references; the math runs afterwards. With `stop`, the forward ends once the last wanted
  layer is recorded, so the rest of the stack and the LM head never run.
- `attention_inputs`: what each attention module is called with (the fold's queries, keys and values).
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


@contextmanager
def attention_inputs(adapter, layers, on_input):
    """Forward pre-hooks on `self_attn` of `layers` that pass (l, module, hidden [1, T, d], (cos, sin)) to
    `on_input`; removed on exit."""
    handles = []

    def make(l):
        def pre(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            rope = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            on_input(l, module, hidden, rope)

        return pre

    try:
        for l in layers:
            handles.append(adapter.attn(l).register_forward_pre_hook(make(l), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
