"""Reading an engine cache folder on the engine's side (docs/engines.md), and the vLLM request that uses it.

    from ridgefill.engines.request import vllm_request
    prompt, extra = vllm_request("cache-dir")
    llm.generate(prompt, SamplingParams(max_tokens=32, extra_args=extra))

Imports: safetensors, numpy and the standard library.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CACHE, PROMPT = "cache.safetensors", "prompt.safetensors"


def read_prompt(folder) -> tuple[list[int], int]:
    """(ids to send the engine, how many of them the cache holds) of an engine cache folder."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / PROMPT), framework="np") as f:
        meta = f.metadata() or {}
        return [int(i) for i in f.get_tensor("ids")], int(meta["cached"])


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def vllm_request(folder) -> tuple[dict, dict]:
    """The prompt (token ids, salted with the cache's sha256 so that vLLM's prefix cache never hands the filled
    blocks to another request) and the SamplingParams `extra_args` that name the cache for the connector."""
    cache = (Path(folder) / CACHE).resolve()
    ids, _ = read_prompt(folder)
    return ({"prompt_token_ids": ids, "cache_salt": file_sha256(cache)},
            {"kv_transfer_params": {"ridgefill_cache": str(cache)}})
