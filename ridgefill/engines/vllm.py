"""A vLLM v1 KV connector that loads a ridgefill engine cache into vLLM's paged KV cache (docs/engines.md).

Register it out of tree, as a consumer:

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model_dir, kv_transfer_config=KVTransferConfig(
        kv_connector="RidgefillConnector", kv_connector_module_path="ridgefill.engines.vllm", kv_role="kv_consumer"))

and name the cache per request (`ridgefill.engines.request.vllm_request` builds both arguments):

    llm.generate({"prompt_token_ids": ids, "cache_salt": salt},
                 SamplingParams(..., extra_args={"kv_transfer_params": {"ridgefill_cache": "/abs/cache.safetensors"}}))

The cache file (format `ridgefill-cache/1`) holds `layer.<l>.keys` / `layer.<l>.values` [kv_heads, P, head_dim] for
the first P prompt positions, keys already rotated as the engine's RoPE expects at positions 0..P-1. The scheduler
side counts P from the file's header and tells vLLM those P tokens are computed; the worker side writes them into
the request's blocks through the attention backend's own cache-update kernel (`impl.do_kv_cache_update`), so the
block layout (the CPU backend's column-major keys, a GPU backend's) is the backend's business, never this module's.
vLLM then computes prompt positions P.. itself. A request without `ridgefill_cache` is served as usual.

Prefix caching would let a later request with the same token ids reuse blocks this connector wrote; a request
with a ridgefill cache must therefore carry a `cache_salt` (the cache's sha256: `vllm_request` sets it), or this
connector refuses it when prefix caching is on. Imports: vLLM, torch, safetensors and the standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from ridgefill.engines.layout import vllm_slots
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

PARAM = "ridgefill_cache"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def cached_rows(path: str) -> int:
    """P: how many prompt positions the cache file holds (from layer 0's keys, read from the header only)."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "ridgefill-cache/1":
            raise ValueError(f"{path}: not a ridgefill-cache/1 file (format {meta.get('format')!r})")
        return int(f.get_slice("layer.0.keys").get_shape()[1])


@dataclass
class _Load:
    path: str
    block_ids: list[int]
    start: int  # first prompt position to load (positions below it were a local prefix-cache hit)
    stop: int  # P


@dataclass
class RidgefillMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


class RidgefillConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._dtype = vllm_config.model_config.dtype  # what the backend's cache update takes (it casts itself)
        self._pending: dict[str, tuple[str, int, int]] = {}  # request id -> (path, start, stop)

    # --- scheduler side ---

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        path = params.get(PARAM)
        if not path:
            return 0, False
        if self._prefix_caching and not request.cache_salt:
            raise ValueError(f"request {request.request_id}: a ridgefill cache needs a cache_salt while prefix "
                             f"caching is on (ridgefill.engines.request.vllm_request sets one)")
        p = cached_rows(path)
        if p >= request.num_prompt_tokens:
            raise ValueError(f"request {request.request_id}: the cache holds {p} positions but the prompt has "
                             f"{request.num_prompt_tokens} tokens; at least one must be left for the engine")
        if num_computed_tokens >= p:
            return 0, False
        self._pending[request.request_id] = (path, num_computed_tokens, p)
        return p - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens == 0:
            self._pending.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = RidgefillMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            job = self._pending.pop(req.req_id, None)
            if job is not None:
                meta.loads.append(_Load(job[0], list(req.block_ids[0]), job[1], job[2]))
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # --- worker side ---

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RidgefillMetadata) or not meta.loads:
            return
        layers = {}
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            m = _LAYER.search(name)
            if isinstance(cache, torch.Tensor) and cache.numel() and m and hasattr(layer, "impl"):
                layers[int(m.group(1))] = layer
        for job in meta.loads:
            slots = torch.from_numpy(vllm_slots(job.block_ids, self._block_size, job.start, job.stop))
            with safe_open(job.path, framework="pt") as f:
                for l, layer in sorted(layers.items()):
                    cache = layer.kv_cache
                    k = f.get_slice(f"layer.{l}.keys")[:, job.start : job.stop]  # [kv_heads, n, head_dim]
                    v = f.get_slice(f"layer.{l}.values")[:, job.start : job.stop]
                    k = k.transpose(0, 1).contiguous().to(cache.device, self._dtype)
                    v = v.transpose(0, 1).contiguous().to(cache.device, self._dtype)
                    layer.impl.do_kv_cache_update(layer, k, v, cache, slots.to(cache.device))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer only

    def wait_for_save(self):
        return
