"""Reading an engine cache folder on the engine's side (docs/engines.md), and the vLLM request that uses it.

    from ridgefill.engines.request import vllm_request
    prompt, extra = vllm_request("cache-dir")
    llm.generate(prompt, SamplingParams(max_tokens=32, extra_args=extra))

Imports: numpy, the standard library and ridgefill's numpy-only file formats and hashing.
"""

from __future__ import annotations

from pathlib import Path

from ridgefill.artifacts import sha256_file
from ridgefill.formats import safetensors

CACHE, PROMPT = "cache.safetensors", "prompt.safetensors"


def read_prompt(folder) -> tuple[list[int], int]:
    """(ids to send the engine, how many of them the cache holds) of an engine cache folder."""
    arrays, meta = safetensors.load(Path(folder) / PROMPT)
    return [int(i) for i in arrays["ids"]], int(meta["cached"])


def vllm_request(folder) -> tuple[dict, dict]:
    """The prompt (token ids, salted with the cache's sha256 so that vLLM's prefix cache never hands the filled
    blocks to another request) and the SamplingParams `extra_args` that name the cache for the connector."""
    cache = (Path(folder) / CACHE).resolve()
    ids, _ = read_prompt(folder)
    return ({"prompt_token_ids": ids, "cache_salt": sha256_file(cache)},
            {"kv_transfer_params": {"ridgefill_cache": str(cache)}})
