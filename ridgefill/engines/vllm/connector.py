"""A vLLM v1 KV connector that loads a ridgefill engine cache into vLLM's paged KV cache (docs/engines.md, "The
vLLM connector").

Register it out of tree, as a consumer, naming the one folder caches are read from:

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model_dir, kv_transfer_config=KVTransferConfig(
        kv_connector="RidgefillConnector", kv_connector_module_path="ridgefill.engines.vllm", kv_role="kv_consumer",
        kv_connector_extra_config={"cache_dir": "/srv/caches"}))

and name the cache per request (`ridgefill.engines.request.vllm_request` builds both arguments):

    llm.generate({"prompt_token_ids": ids, "cache_salt": sha256_of_the_cache},
                 SamplingParams(..., extra_args={"kv_transfer_params": {"ridgefill_cache": "name/cache.safetensors"}}))

The cache (docs/cache.md) holds every layer's keys and values [kv_heads, P, head_dim] for the first P prompt
positions, keys rotated for positions 0..P-1. The scheduler side checks a request's cache (`loads.target`: under
cache_dir, made for the served model, of its shape, fewer positions than the prompt, salted with its own sha256
when prefix caching is on) and tells vLLM those P tokens are computed; the worker side writes them, layer by layer
as each layer's attention is about to run, into the request's blocks through the attention backend's own
cache-update kernel (`impl.do_kv_cache_update`), only the KV heads of its tensor-parallel rank. vLLM computes
positions P.. itself. A request without `ridgefill_cache` is served as usual.

A request whose cache the server refuses, or whose load fails, fails alone: its claimed blocks are reported
through `get_block_ids_with_load_errors`, and vLLM (its default `kv_load_failure_policy="fail"`) ends it with an
error while the others are served; the reason is logged once per request. A request preempted after its load is
loaded again when it resumes (its blocks are fresh). Imports: vLLM, torch, safetensors, numpy, the standard
library and ridgefill's engine-side modules.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ridgefill.engines.vllm import internals, loads
from ridgefill.engines.layout import vllm_slots
from ridgefill.formats import cache as cache_format
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

log = logging.getLogger("vllm.ridgefill")
PARAM = loads.PARAM
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Load:
    path: str
    start: int  # first prompt position to load (positions below it were a local prefix-cache hit)
    stop: int  # P
    block_ids: list[int] = field(default_factory=list)
    problem: str | None = None  # refused by the scheduler: its blocks fail, nothing is read


@dataclass
class RidgefillMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


def cache_dir_of(vllm_config) -> Path:
    """The connector's `cache_dir` (kv_connector_extra_config): required, an existing folder."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    folder = extra.get("cache_dir")
    if not folder or not os.path.isdir(folder):
        raise ValueError(f"ridgefill: RidgefillConnector needs kv_connector_extra_config={{'cache_dir': FOLDER}}, "
                         f"an existing folder caches are read from (got {folder!r})")
    return Path(os.path.realpath(folder))


class RidgefillConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        problem = internals.version_problem()
        if problem:
            raise ValueError(f"ridgefill: RidgefillConnector is {problem}")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        mc = vllm_config.model_config
        self._cache_dir = cache_dir_of(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._dtype = mc.dtype  # what the backend's cache update takes (it casts itself)
        self._layers = mc.hf_text_config.num_hidden_layers
        self._kv_heads = mc.get_total_num_kv_heads()  # all ranks together
        # scheduler side
        self._pending: dict[str, _Load] = {}  # request id -> its load, from update_state_after_alloc
        self._told: set[str] = set()  # requests whose refusal was logged
        self._facts = loads.FactsCache(_header_facts)
        if role == KVConnectorRole.SCHEDULER:  # the served model's fingerprint, once, at startup
            self._served = _served(mc.model, mc.revision, vllm_config.load_config.download_dir, self._layers,
                                   self._kv_heads, mc.get_head_size())  # fmt: skip
        # worker side
        self._by_name: dict[str, int] = {}  # attention layer name -> model layer index
        self._heads = slice(None)  # the KV heads of this tensor-parallel rank
        self._jobs: list[_Load] = []
        self._errors: set[int] = set()

    # --- scheduler side ---

    def _target(self, request) -> loads.Target | None:
        return loads.target(getattr(request, "kv_transfer_params", None), request.num_prompt_tokens,
                            request.cache_salt, cache_dir=self._cache_dir, served=self._served, facts=self._facts,
                            prefix_caching=self._prefix_caching)  # fmt: skip

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self._target(request)
        if t is None:
            return 0, False
        return max(t.stop - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._pending.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        t = self._target(request)
        assert t is not None, f"request {request.request_id}: external tokens without a ridgefill cache"
        if t.problem and request.request_id not in self._told:
            self._told.add(request.request_id)
            log.error("ridgefill: request %s fails: %s", request.request_id, t.problem)
        self._pending[request.request_id] = _Load(t.path, t.stop - num_external_tokens, t.stop, problem=t.problem)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = RidgefillMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            job = self._pending.pop(req.req_id, None)
            if job is not None:
                meta.loads.append(replace(job, block_ids=list(req.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A resumed request (preempted, its blocks freed) was matched again: load into its new blocks, which
            # new_block_ids lists in full for a resumed request.
            if req_id in cached.resumed_req_ids and req_id in self._pending:
                block_ids = cached.new_block_ids[i]
                assert block_ids is not None, f"resumed request {req_id} without its block ids"
                log.info("ridgefill: request %s resumed after preemption: its cache is loaded again", req_id)
                meta.loads.append(replace(self._pending.pop(req_id), block_ids=list(block_ids[0])))
        assert not self._pending, f"ridgefill: loads recorded for requests not scheduled: {sorted(self._pending)}"
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._told.discard(request.request_id)
        return False, None

    # --- worker side ---

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Map every attention layer to its model layer, or refuse at startup, naming what was expected."""
        found = {}
        for name in kv_caches:
            m = _LAYER.search(name)
            if m is None:
                raise ValueError(f"ridgefill: KV cache layer {name!r} has no '.layers.<l>.' in its name")
            found[name] = int(m.group(1))
        want = set(range(self._layers))
        if sorted(found.values()) != sorted(want):
            missing, extra = sorted(want - set(found.values())), sorted(set(found.values()) - want)
            raise ValueError(f"ridgefill: expected one KV cache layer for each of the model's {self._layers} "
                             f"layers; missing {missing}, unexpected or repeated {extra or 'none'}")
        self._by_name = found
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self._heads = loads.rank_heads(self._kv_heads, get_tensor_model_parallel_rank(),
                                       get_tensor_model_parallel_world_size())  # fmt: skip

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Take the step's loads; refused ones fail at once. The tensors are read layer by layer
        (`wait_for_layer_load`), as each layer's attention is about to run."""
        meta = self._get_connector_metadata()
        self._jobs = []
        if not isinstance(meta, RidgefillMetadata):
            return
        for job in meta.loads:
            if job.problem is None:
                self._jobs.append(job)
            else:
                self._fail(job, None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._jobs:
            return
        from vllm.forward_context import get_forward_context

        layer = get_forward_context().no_compile_layers[layer_name]
        l = self._by_name[layer_name]
        cache, heads = layer.kv_cache, self._heads
        for job in list(self._jobs):
            try:
                slots = torch.from_numpy(vllm_slots(job.block_ids, self._block_size, job.start, job.stop))
                with safe_open(job.path, framework="pt") as f:
                    k = f.get_slice(f"layer.{l}.keys")[heads, job.start : job.stop]  # [kv_heads, n, head_dim]
                    v = f.get_slice(f"layer.{l}.values")[heads, job.start : job.stop]
                if k.shape[0] != layer.num_kv_heads or v.shape != k.shape:
                    raise ValueError(f"layer {l}: {k.shape[0]} KV heads for this rank, the layer holds "
                                     f"{layer.num_kv_heads}")
                if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                    raise ValueError(f"layer {l} holds NaN or inf")
                k = k.transpose(0, 1).contiguous().to(cache.device, self._dtype)
                v = v.transpose(0, 1).contiguous().to(cache.device, self._dtype)
                layer.impl.do_kv_cache_update(layer, k, v, cache, slots.to(cache.device))
            except Exception as exc:  # the request fails alone; the step goes on
                self._fail(job, f"{job.path}: {exc}")

    def _fail(self, job: _Load, problem: str | None) -> None:
        if problem:
            log.error("ridgefill: loading %s failed: %s", job.path, problem)
        self._errors |= loads.failed_blocks(job.block_ids, self._block_size, job.start, job.stop)
        if job in self._jobs:
            self._jobs.remove(job)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer only

    def wait_for_save(self):
        return


def _header_facts(path: Path) -> loads.Facts:
    """A cache file's facts from its header, checked by the cache format's rules (docs/cache.md) with the engine's
    (every layer the same P); no tensor data is read."""
    h = cache_format.read_header(path, engine=True)
    return loads.Facts(positions=h.cached, fingerprint=h.model_fingerprint, layers=h.num_layers, kv_heads=h.kv_heads,
                       head_dim=h.head_dim, sha256="")


def _served(model: str, revision, download_dir, layers: int, kv_heads: int, head_dim: int) -> loads.Served:
    """The served model's shape and fingerprints: its folder's own and, for a `ridgefill engine model` folder whose
    marker still holds, the source model's."""
    from ridgefill.engines import identity

    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True))
    own = identity.folder_fingerprint(folder)
    fingerprints = {own}
    try:
        marker = identity.read_marker(folder)
    except ValueError:
        marker = None
    if marker is not None and marker["fingerprint"] == own:
        fingerprints.add(marker["source"]["fingerprint"])
    return loads.Served(layers, kv_heads, head_dim, frozenset(fingerprints))
