"""The model's cache in the middle of a document, for a capture checkpoint taken between two chunks
(capture/checkpoint.py saves it, capture/runner.py restores it and the document continues at its next chunk).

The cache is the transformers `DynamicCache` that capture/forward.py builds from the model's config: one layer
object per decoder layer, of which the forward fills only those below its stop point (ridgefill.models.hooks
.StopForward: the last decoder layer never runs, so its cache layer stays uninitialized). What each kind of layer
holds, and all that is saved of it, every tensor exactly (its own dtype and shape, bfloat16 as its bits):

    DynamicLayer (full attention)            keys, values [batch, kv_heads, rows so far, head_dim]
    DynamicSlidingWindowLayer                keys, values of the window only (the last sliding_window - 1 rows)
                                             and `cumulative_length`, the rows seen (the mask and positions read it)
    LinearAttentionLayer (Gated DeltaNet)    per state i: `conv_states[i]` [batch, channels, conv_kernel_size] with
                                             its `conv_kernel_size[i]`, `recurrent_states[i]`, `has_previous_state[i]`;
                                             and, from transformers 5.25, `cumulative_length_linear`, the rows seen
                                             (the cache's length, which the positions read)
    LinearAttentionAnd{Full,SlidingWindow}AttentionLayer   both of the above
    DummyLayer (no cache)                    nothing

`snapshot` describes a cache as a `Snapshot`: a JSON-able layout (the class of every layer and its non-tensor
state) and the tensors as {name: Lazy}, each copied to the host only when the checkpoint writer reaches it, so a
checkpoint holds at most one layer's tensor in host memory beyond the cache itself. `snapshot(cache, layers=n)`
keeps only the first n layers, the rest as a forward stopped before them leaves them (uninitialized): the sweep
keeps a prompt's early layers that way (sweep/early.py, `EarlyCaches`). `restore` builds a fresh cache
from the model's config, checks that its layers are of the same classes, and fills them through the layers' own
`lazy_initialization` and public attributes, on each layer's device. A cache with a layer of any other class
(e.g. a model's own remote code) or a tensor of another dtype is not known to be saved faithfully: `snapshot`
raises `NotSaved`, and the capture then checkpoints between documents only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ridgefill.errors import RidgefillError
from ridgefill.formats import safetensors

LAYOUT_VERSION = 1
PREFIX = "cache."

# torch dtype name -> safetensors dtype (bfloat16 travels as its uint16 bit patterns, `safetensors.BF16`)
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


class NotSaved(Exception):
    """This cache holds something `snapshot` cannot save exactly (the message says what)."""


Lazy = safetensors.Lazy  # a tensor copied to the host only when the checkpoint writer reaches it


@dataclass
class Snapshot:
    layout: dict  # {"version", "layers": [{"type", ...}]}: JSON, goes to the checkpoint's metadata
    tensors: dict[str, Lazy]  # "cache.<l>.keys" | ".values" | ".conv.<i>" | ".recurrent.<i>"


def _classes() -> dict[str, type]:
    from transformers import cache_utils as cu

    names = ("DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer",
             "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer", "DummyLayer")
    return {n: getattr(cu, n) for n in names if hasattr(cu, n)}


def lazy(t) -> Lazy:
    """A torch tensor as a Lazy: copied to the host (contiguous) only when fetched."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise NotSaved(f"a cache tensor of dtype {name}")
    st = _DTYPES[name]

    def fetch():
        h = t.detach().to("cpu").contiguous()
        if st == "BF16":
            return safetensors.BF16(h.view(torch.int16).numpy().view(np.uint16))
        return h.numpy()

    return Lazy(st, tuple(t.shape), t.numel() * t.element_size(), fetch)


def snapshot(cache, layers: int | None = None) -> Snapshot:
    """The cache's state as a Snapshot (no tensor copied yet). NotSaved if it holds a layer this module does not know
    how to save and restore exactly (or one that records its past, or an offloading cache: capture makes neither).
    `layers`: keep only the first `layers` attention layers; the later ones are saved uninitialized (NotSaved if
    one of them is a Gated DeltaNet layer, whose fresh state this module does not write)."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    known = _classes()
    if type(cache).__name__ != "DynamicCache" or getattr(cache, "offloading", False):
        raise NotSaved(f"a {type(cache).__name__}{' that offloads' if getattr(cache, 'offloading', False) else ''}")
    layers_out, tensors = [], {}
    for l, layer in enumerate(cache.layers):
        kind = type(layer).__name__
        if known.get(kind) is not type(layer):
            raise NotSaved(f"cache layer {l} is a {kind}")
        if getattr(layer, "record_past", False):
            raise NotSaved(f"cache layer {l} records its past")
        entry: dict = {"type": kind}
        if layers is not None and l >= layers:  # cut: as a forward that stopped before this layer leaves it
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                raise NotSaved(f"a cut at layer {layers} with Gated DeltaNet layer {l} after it")
            layers_out.append(entry | {"kv": False})
            continue
        if isinstance(layer, CacheLayerMixin):
            entry["kv"] = bool(layer.is_initialized)
            if layer.is_initialized:
                tensors[f"{PREFIX}{l}.keys"], tensors[f"{PREFIX}{l}.values"] = lazy(layer.keys), lazy(layer.values)
            if hasattr(layer, "cumulative_length"):  # sliding window: the rows seen, beyond the window it keeps
                entry["cumulative_length"] = int(layer.cumulative_length)
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            n = layer.number_of_states
            entry["states"] = n
            entry["conv_kernel_size"] = [int(layer.conv_kernel_size[i]) if layer.is_conv_states_initialized[i]
                                         else None for i in range(n)]
            entry["recurrent"] = [bool(layer.is_recurrent_states_initialized[i]) for i in range(n)]
            entry["previous"] = [bool(layer.has_previous_state[i]) for i in range(n)]
            if hasattr(layer, "cumulative_length_linear"):  # transformers >= 5.25: the rows seen
                entry["cumulative_length_linear"] = int(layer.cumulative_length_linear)
            for i in range(n):
                if layer.is_conv_states_initialized[i]:
                    tensors[f"{PREFIX}{l}.conv.{i}"] = lazy(layer.conv_states[i])
                if layer.is_recurrent_states_initialized[i]:
                    tensors[f"{PREFIX}{l}.recurrent.{i}"] = lazy(layer.recurrent_states[i])
        layers_out.append(entry)
    return Snapshot({"version": LAYOUT_VERSION, "layers": layers_out}, tensors)


def tensor(a, device):
    """A host array from the checkpoint (bfloat16 as `safetensors.BF16`) as a torch tensor on `device`, in memory of
    torch's own (not the array's)."""
    import torch

    if isinstance(a, safetensors.BF16):
        return torch.from_numpy(np.ascontiguousarray(a.bits).view(np.int16)).view(torch.bfloat16).to(device, copy=True)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, copy=True)


def restore(lm, saved: Snapshot, new_cache: Callable[[], object], where: str):
    """A cache equal to the one `saved` was taken of: `new_cache()` (a fresh cache for `lm`, as capture/forward.py
    makes it) filled layer by layer on each layer's device. RidgefillError if the fresh cache's layers are not of
    the saved classes (another transformers version, say): the checkpoint cannot continue its document here."""
    import torch
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    layout = saved.layout
    entries = layout.get("layers", [])

    def refuse(why: str) -> RidgefillError:
        return RidgefillError(f"the capture checkpoint in {where} stopped inside a document and holds the model's cache, "
                              f"which cannot be restored here ({why}); delete {where} to start the capture over")

    if layout.get("version") != LAYOUT_VERSION:
        raise refuse(f"cache layout version {layout.get('version')!r}, this version reads {LAYOUT_VERSION}")
    cache = new_cache()
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while replicate is not None and len(cache.layers) < len(entries):  # a cache that adds its layers lazily
        cache.layers.append(replicate())
    if len(cache.layers) != len(entries):
        raise refuse(f"{len(entries)} cache layers saved, {len(cache.layers)} now")
    for l, (layer, entry) in enumerate(zip(cache.layers, entries)):
        if type(layer).__name__ != entry["type"]:
            raise refuse(f"cache layer {l} was a {entry['type']}, is a {type(layer).__name__} now")

    def get(name: str, device):
        if name not in saved.tensors:
            raise refuse(f"tensor {name} is missing")
        return tensor(saved.tensors[name].fetch(), device)

    with torch.inference_mode():  # the cache's own tensors are inference tensors: filled in place as in the forward
        for l, (layer, entry) in enumerate(zip(cache.layers, entries)):
            device = None
            if isinstance(layer, CacheLayerMixin) and entry.get("kv"):
                device = lm.adapter.layer_device(l)
                k, v = get(f"{PREFIX}{l}.keys", device), get(f"{PREFIX}{l}.values", device)
                layer.lazy_initialization(k, v)  # device, dtype, is_initialized (and the window tensor's device)
                layer.keys, layer.values = k, v
            if isinstance(layer, CacheLayerMixin) and "cumulative_length" in entry:
                layer.cumulative_length = int(entry["cumulative_length"])
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                if layer.number_of_states != entry["states"]:
                    raise refuse(f"cache layer {l} has {layer.number_of_states} states, {entry['states']} saved")
                device = device or lm.adapter.layer_device(l)
                for i in range(entry["states"]):
                    size = entry["conv_kernel_size"][i]
                    if size is not None:
                        c = get(f"{PREFIX}{l}.conv.{i}", device)
                        layer.lazy_initialization(conv_states=c, state_idx=i, conv_kernel_size=int(size))
                        layer.conv_states[i].copy_(c)
                    if entry["recurrent"][i]:
                        r = get(f"{PREFIX}{l}.recurrent.{i}", device)
                        layer.lazy_initialization(recurrent_states=r, state_idx=i)
                        layer.recurrent_states[i].copy_(r)
                    layer.has_previous_state[i] = bool(entry["previous"][i])
                if hasattr(layer, "cumulative_length_linear"):
                    if "cumulative_length_linear" not in entry:
                        raise refuse(f"cache layer {l} counts its rows (transformers 5.25 or newer), which the "
                                     "checkpoint did not save")
                    count = layer.cumulative_length_linear
                    layer.cumulative_length_linear = torch.tensor(int(entry["cumulative_length_linear"]),
                                                                  dtype=count.dtype, device=count.device)
    return cache

