"""Models: resolve a spec (HF dir, hub id, .gguf, built-in) and load it; per-architecture layer access.

    from ridgefill.models import resolve_model, load_model
    ref = resolve_model("builtin:smollm2-135m", store_root=store)   # reads metadata only: no torch, fast
    lm = load_model(ref, store_root=store)                          # torch + transformers
    k, v = lm.adapter.kv(l, x)                                      # what layer l writes to its cache

Importing this package does not import torch or transformers: spec.py and load.py import them inside
functions, and `adapter_for` / `Adapter` (adapters.py needs torch at import) are loaded on first access.
"""

from ridgefill.lazy import exports
from ridgefill.models.load import LoadedModel, load_model
from ridgefill.models.spec import BUILTINS, SUPPORTED_ARCHS, ModelRef, resolve_model

# `from ridgefill.models import adapter_for` works, but only then pulls in torch (adapters.py needs it at import).
__getattr__, _ = exports(__name__, {"Adapter": "adapters", "adapter_for": "adapters"})
__all__ = ["BUILTINS", "SUPPORTED_ARCHS", "Adapter", "LoadedModel", "ModelRef", "adapter_for", "load_model",
           "resolve_model"]  # fmt: skip
