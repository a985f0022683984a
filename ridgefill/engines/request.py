"""Reading an engine cache folder on the engine's side (docs/engines.md), and the vLLM request that uses it.

    from ridgefill.engines.request import vllm_request
    prompt, extra = vllm_request("cache-dir")
    llm.generate(prompt, SamplingParams(max_tokens=32, extra_args=extra))

Imports: numpy, the standard library and ridgefill's numpy-only file formats and hashing.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ridgefill.artifacts import sha256_file
from ridgefill.errors import BadInput
from ridgefill.formats import cache as cache_format
from ridgefill.formats import safetensors

CACHE, PROMPT = cache_format.FILE, "prompt.safetensors"
_COUNT = re.compile(r"0|[1-9][0-9]*")


def read_prompt(folder) -> tuple[list[int], int]:
    """(ids to send the engine, how many of them the cache holds) of an engine cache folder. BadInput, one line
    naming the file, for a missing or unreadable prompt.safetensors, `ids` that are not a 1-D tensor of token ids
    (non-negative integers), a `cached` that is missing, not a decimal count, or not the P of the folder's engine
    cache (docs/cache.md, which `read_header` checks), and one that leaves the engine no position to compute."""
    path = Path(folder) / PROMPT
    if not path.is_file():
        raise BadInput(f"{path}: missing (an engine cache folder holds {CACHE} and {PROMPT})")
    try:
        arrays, meta = safetensors.load(path)
    except BadInput as e:
        raise BadInput(f"{path}: {str(e).removeprefix(PROMPT + ': ')}") from None
    ids = arrays.get("ids")
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        shape = None if ids is None else ids.bits.shape if isinstance(ids, safetensors.BF16) else ids.shape
        what = "missing" if ids is None else f"{safetensors.dtype_of(ids)} {list(shape)}"
        raise BadInput(f"{path}: 'ids' is {what}, not a 1-D tensor of integer token ids")
    if ids.size and ids.min() < 0:
        raise BadInput(f"{path}: 'ids' holds a negative token id ({int(ids.min())})")
    cached = meta.get("cached")
    if cached is None or not _COUNT.fullmatch(cached):
        raise BadInput(f"{path}: metadata 'cached' is {cached!r}, not a count of cached positions")
    cached = int(cached)
    if cached >= len(ids):
        raise BadInput(f"{path}: metadata 'cached' is {cached} of {len(ids)} ids: the engine must compute at least "
                       f"the last position")
    header = cache_format.read_header(Path(folder) / CACHE, engine=True)
    if cached != header.cached:
        raise BadInput(f"{path}: metadata 'cached' is {cached}, but {CACHE} holds {header.cached} positions")
    return [int(i) for i in ids], cached


def vllm_request(folder) -> tuple[dict, dict]:
    """The prompt (token ids, salted with the cache's sha256 so that vLLM's prefix cache never hands the filled
    blocks to another request) and the SamplingParams `extra_args` that name the cache for the connector."""
    cache = (Path(folder) / CACHE).resolve()
    ids, _ = read_prompt(folder)
    return ({"prompt_token_ids": ids, "cache_salt": sha256_file(cache)},
            {"kv_transfer_params": {"ridgefill_cache": str(cache)}})
