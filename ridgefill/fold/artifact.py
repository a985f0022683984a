"""The compact and fold artifacts (docs/store.md, docs/cache.md): file names, writers and readers. Later stages read
them only through this module.

    cache.safetensors     the cache, format `ridgefill-cache/2` (ridgefill.formats.cache): biased (compact) or plain
                          with its fold directions (fold)
    context.safetensors   `ids` int32 [N]: the context's token ids, so fold and its check need no input file
    report.json           per head: fit residuals, output errors on fit and held-out queries (and, for fold, the arms)
    check.json            fold only: the plain-cache check (stock attention against the reference computation)
"""

from __future__ import annotations

import numpy as np

from ridgefill.artifacts import Artifact
from ridgefill.formats import cache, safetensors

CACHE = cache.FILE
CONTEXT = "context.safetensors"
REPORT = "report.json"
CHECK = "check.json"
MODEL_DTYPE = "model_dtype"  # a compact recipe's name for the model dtype (`dtype` there is the cache dtype)


def write(path, layers: dict[int, dict[str, np.ndarray]], dtype: str, ids, model_fingerprint: str) -> None:
    """cache.safetensors (recording the fingerprint of the model it was made from) and context.safetensors of a
    compact or fold artifact under construction."""
    cache.write_cache(path / CACHE, layers, dtype, model_fingerprint)
    safetensors.save(path / CONTEXT, {"ids": np.asarray(ids).astype(np.int32)})


def load_cache(art: Artifact) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {"keys", "values" (float32), "positions" (int32), "beta" / "u" (float32, where present)}}, refused
    (BadInput) unless every rule of docs/cache.md holds, the cache recording the model the artifact names."""
    model = art.recipe.get("model") or art.info.get("model", {}).get("fingerprint")  # compact: hashed; fold: info
    return cache.read_cache(art.file(CACHE), cache.ModelShape(fingerprint=model))


def load_context(art: Artifact) -> np.ndarray:
    arrays, _ = safetensors.load(art.file(CONTEXT))
    return arrays["ids"].astype(np.int64)
