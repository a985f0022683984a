"""The RidgeFill fill in vLLM's own forward (docs/engines.md, "Serving a release with vLLM"): vLLM's Llama, Qwen2
and Qwen3 models with one hook, registered under their own architecture names by the plugin
(`ridgefill.engines.vllm.plugin`) when RIDGEFILL_RELEASE is set.

Per step (the plan is `ridgefill.engines.vllm.plan`'s, made where vLLM builds the attention metadata):

1. a step with no prefix row to fill (decodes, tails, requests served exactly) runs vLLM's own forward, compiled
   and graph-captured as vLLM does it;
2. otherwise layers 0..S-1 run every scheduled token; the split state h_S is vLLM's two residual summands added
   (with maps from earlier states, a `ridgefill-maps/3` release, the states entering those layers are kept as the
   early layers go by and x = [h_S; h_l1; ...] stands for h_S below, in the exact-row rule and in the maps);
   the prefix rows whose split state's norm is above the release's exact-row norm (or, in a ridgefill+protected
   release, whose token is protected: a lookup in a table over the vocabulary) join the exact rows; under tensor
   parallelism the ranks agree on them first (one all-reduce, MIN of the fill mask). Reading the mask is the step's
   one host synchronization;
3. in every late layer l the filled rows' keys and values are computed and written to their cache slots through
   the backend's own `do_kv_cache_update`: with a key/value map, `[k; v] = M_l h_S + c_l` (one GEMM of the rank's
   KV heads' rows), then the key norm (Qwen3) and the rotary embedding; with an input map, the input
   `W_l h_S + b_l` (column-parallel: d / tp rows per rank, all-gathered), then the layer's input norm, a copy of its
   key/value projection rows, key norm and rotary embedding;
4. then the exact rows run the whole late layers, in groups of at most `max_num_seqs` sequences (`plan.groups`),
   one after another, each through every late layer, so that no backend meets more sequences than its buffers
   hold. Each group attends through metadata of its own, built for its rows by the backend's own metadata builder
   from vLLM's common attention metadata (each run of consecutive exact rows of a request a sequence of its own)
   just before it is launched, and swapped into the forward context for the late layers only; vLLM's metadata for
   the whole step is never built for them (`builder_class`);
5. the final norm runs on the exact rows; filled rows' outputs are zero (no logits are read from them: vLLM
   samples each request's last scheduled row, which is a tail or decode row, or discards a partial prefill's).

The three parts of a filling step that run on the device, the early layers (`Early`), the filled rows' keys and
values (`Filled`) and the exact rows' late layers (`Late`), are compiled the way vLLM compiles its own forward:
`support_torch_compile` with vLLM's backend, compile cache and dynamic token count, each under a model tag of its
own (as vLLM's draft models are), so the pointwise work of a layer is fused and a late layer runs a handful of
kernels rather than dozens. vLLM's start-up runs (memory profiling, warm-up) run all three once (`warm_up`), so no
request pays a compile and the profiled peak includes the fill's. A filling step runs them outside CUDA graphs (its
row counts are its own); the python between them is the plan: the step's one host synchronization, the groups and
their attention metadata, and the cache writes (one backend call per late layer). A GPU server waits once more per
group after the first, until the device has taken the last group's metadata from the builder's host buffers.

The maps and the key/value projection copies (input maps only) are vLLM linear layers created with the model, so
vLLM's memory profiling counts them and each platform's own GEMM kernels run them (the CPU backend's oneDNN packing
included). The int8 codes are decoded once at load and held in the model's dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextvars import ContextVar

import numpy as np
import torch
from torch import nn

from ridgefill.engines.vllm import loads, plan, served
from ridgefill.engines.vllm.parts import Early, Filled, Late, stacked
from ridgefill.runtime.rows import norm_rows, protected_rows, token_table
from vllm.compilation.backends import set_model_tag
from vllm.config import CompilationMode, CUDAGraphMode
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.attention.backend import subclass_attention_backend

log = logging.getLogger("vllm.ridgefill")  # under vLLM's logger: its handler and format

RUNNER: ContextVar = ContextVar("ridgefill_runner", default=None)  # the model runner inside execute_model
_ACTIVE: list = []  # the worker's EngineFill module (one model per worker process)
_STEP: list = [None]  # the plan the late layers' builder made for the step about to run (a `Step`), or None
_BACKENDS: dict = {}


@dataclasses.dataclass(eq=False)
class Step:
    """A filling step's plan, made where vLLM builds the late layers' attention metadata, and that metadata's
    stand-in in the forward context (the forward checks it is the one it is given): the late layers of a filling
    step attend through each group's own metadata (`group_metadata`), so vLLM's build for the whole step, which
    would be thrown away, is never made."""

    builder: object  # the late layers' metadata builder (`builder_class`)
    common: object  # vLLM's CommonAttentionMetadata of the step
    prefix: np.ndarray  # bool [num_actual_tokens]: prefix rows (plan.prefix_rows)
    query_start: np.ndarray  # int64 [R + 1]
    seq_lens: np.ndarray  # int64 [R]


def fill_backend(base):
    """The late layers' attention backend: `base` with the metadata builder `builder_class` makes of its own."""
    if base not in _BACKENDS:
        _BACKENDS[base] = subclass_attention_backend("Ridgefill", base, builder_class(base.get_builder_cls()))
    return _BACKENDS[base]


def builder_class(base):
    """The late layers' metadata builder: `base`, which first plans the step (`_plan_step`). A step with nothing to
    fill gets `base`'s metadata; a filling step gets its plan (a `Step`), and the fill builds each group's metadata
    (`build_group`), one build per group.

    A builder may keep one host buffer that every build rewrites and copies to the device without waiting
    (FlashInfer's `plan()`: its wrapper's pinned buffers, to which the metadata points). So each build first waits
    until the device has taken what the fill's last group build left there (an event recorded after that build, as
    vLLM guards its own reused input buffers between steps): the next group's build, or the next step's, never
    rewrites a buffer whose copy a launched group still waits for. On the CPU every copy is done when its call
    returns, and nothing waits."""

    class Builder(base):
        _ridgefill_copied = None  # the event after the fill's last group build, until a build has waited on it

        def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
            step = _STEP[0] = _plan_step(self, common_attn_metadata)
            if step is not None:
                return step
            self._ridgefill_wait()
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)

        def build_group(self, common_attn_metadata):
            """The metadata of one group of a filling step's exact runs, built by `base` itself."""
            self._ridgefill_wait()
            meta = super().build(0, common_attn_metadata)
            self._ridgefill_copied = _event(common_attn_metadata.query_start_loc.device)
            return meta

        def _ridgefill_wait(self):
            copied, self._ridgefill_copied = self._ridgefill_copied, None
            if copied is not None:
                with gpu_sync_allowed():  # deliberate: vLLM's sync check (VLLM_GPU_SYNC_CHECK) lets it pass
                    copied.synchronize()

    return Builder


def _event(device: torch.device):
    """An event recorded now on `device`'s current stream, or None on the CPU."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


def _plan_step(builder, cam) -> Step | None:
    """The step's plan, from the model runner's requests (their prompt lengths, and whether each is served exactly);
    None outside a scheduled step (profiling, graph capture) and for a step with no prefix row. A step in which
    every request is past its N - T (decodes, tails) returns before any per-request or per-token work."""
    runner = RUNNER.get()
    if runner is None or not _ACTIVE:
        return None
    fill, batch, n = _ACTIVE[0], runner.input_batch, cam.num_reqs
    if n != batch.num_reqs or n == 0:
        return None
    qsl = cam.query_start_loc_cpu[: n + 1].numpy().astype(np.int64)
    seq = cam.seq_lens_cpu_upper_bound if cam.seq_lens_cpu_upper_bound is not None else cam.seq_lens.cpu()
    seq = seq[:n].numpy().astype(np.int64)
    prompts = batch.num_prompt_tokens[:n]
    if not plan.reaches_prefix(qsl, seq, prompts, tail=fill.tail):
        return None
    prefix = plan.prefix_rows(qsl, seq, prompts, _served_exactly(runner, n), tail=fill.tail, anchor=fill.anchor)
    if not prefix.any():
        return None
    return Step(builder, cam, prefix, qsl, seq)


def _served_exactly(runner, n: int) -> list[bool]:
    """Whether each of the step's first n requests is served exactly, by its own parameters (vLLM's
    `num_prompt_logprobs` forgets a request once its prompt is done, and a request preempted later is recomputed)."""
    return [plan.served_exactly(runner.requests[rid].sampling_params) for rid in runner.input_batch.req_ids[:n]]


def keep_off_decode_graph(runner, num_reqs: int) -> bool:
    """Whether a step of one scheduled token per request (what vLLM may replay as a full decode graph) holds a
    prefix row to fill, a one-token prompt chunk among decodes, and so must run the Python forward; counted in the
    fill's `decode_graph_vetoes`."""
    if not _ACTIVE or num_reqs == 0:
        return False
    fill, batch = _ACTIVE[0], runner.input_batch
    qsl, seq = np.arange(num_reqs + 1), np.asarray(batch.num_computed_tokens_cpu[:num_reqs], np.int64) + 1
    prompts = batch.num_prompt_tokens[:num_reqs]
    if not plan.reaches_prefix(qsl, seq, prompts, tail=fill.tail):
        return False  # every request is past its prefix (steady decoding): no per-request check needed
    fills = plan.prefix_rows(qsl, seq, prompts, _served_exactly(runner, num_reqs), tail=fill.tail,
                             anchor=fill.anchor).any()  # fmt: skip
    fill.stats["decode_graph_vetoes"] += int(fills)
    return bool(fills)


class EngineFill(nn.Module):
    """The release on the model: maps, key/value projection copies, and the fill's forward."""

    def __init__(self, causal_lm, vllm_config, release: served.Fill):
        super().__init__()
        layers = causal_lm.model.layers
        L = len(layers)
        self.release, self.split = release, release.split
        self.late = list(range(release.split, L))
        self.tail, self.anchor, self.exact_norm = release.tail, release.anchor, release.exact_norm
        first = layers[self.split].self_attn
        self.kv_maps = [release.map_kinds.get(l) == "kv" for l in self.late]
        self.heads = loads.rank_heads(first.total_num_kv_heads, get_tensor_model_parallel_rank(),
                                      get_tensor_model_parallel_world_size())
        local = 2 * (self.heads.stop - self.heads.start) * first.head_dim
        self.tp = get_tensor_model_parallel_world_size()
        # Compiled as vLLM compiles its own forward (not under --enforce-eager), each part under a tag of its own.
        self.compiled = vllm_config.compilation_config.mode != CompilationMode.NONE
        self.warm = False
        late_layers = [layers[l] for l in self.late]
        self.earlier = tuple(release.earlier)  # maps from earlier states: the states entering these layers too
        with set_model_tag("ridgefill_early"):
            self.early = Early(vllm_config=vllm_config, prefix="ridgefill.early", layers=layers[: self.split],
                               earlier=self.earlier)
        with set_model_tag("ridgefill_filled"):
            self.filled = Filled(vllm_config=vllm_config, prefix="ridgefill.filled", layers=late_layers,
                                 kv_maps=self.kv_maps, local=local, states=1 + len(self.earlier))  # fmt: skip
        with set_model_tag("ridgefill_late"):
            self.late_layers = Late(vllm_config=vllm_config, prefix="ridgefill.late", layers=late_layers,
                                    norm=causal_lm.model.norm)  # fmt: skip
        if release.protected is not None:  # a lookup table over the vocabulary, on the model's device
            table = token_table(release.protected, vllm_config.model_config.get_vocab_size())
            self.register_buffer("protected", torch.as_tensor(table), persistent=False)
        else:
            self.protected = None
        self.late_names = []
        for l in self.late:
            attn = layers[l].self_attn.attn
            attn.attn_backend = fill_backend(attn.attn_backend)
            self.late_names.append(attn.layer_name)
        self.stats = {"fill_steps": 0, "stock_steps": 0, "filled_rows": 0, "exact_prefix_rows": 0, "groups": 0,
                      "max_group_seqs": 0, "rank": get_tensor_model_parallel_rank(), "map_bytes": 0,
                      "decode_graph_vetoes": 0, "warm_up_s": None}
        # The most attention sequences one late-layer pass may hold: the scheduler's max_num_seqs, the size of the
        # builders' per-sequence buffers (FlashInfer's indptr, FA3's scheduler metadata under full graphs).
        self.max_seqs = vllm_config.scheduler_config.max_num_seqs
        _ACTIVE[:] = [self]

    def own(self) -> list[tuple[str, nn.Parameter]]:
        """The fill's own parameters (the maps and the key/value copies; the layers it runs are the model's)."""
        return [(f"filled.{n}", p) for n, p in self.filled.named_parameters() if n.startswith(("maps.", "kv."))]

    def load(self, causal_lm) -> set[str]:
        """Fill the maps (decoded, in the model's dtype) and the key/value copies (from the qkv weights just loaded);
        the parameter names it loaded, as vLLM's loader counts them."""
        layers = causal_lm.model.layers
        maps, kv = self.filled.maps, self.filled.kv
        for i, l in enumerate(self.late):
            W, b = self.release.maps[l]
            if self.kv_maps[i]:
                rows = loads.rank_map_rows(self.heads, W.shape[0], layers[l].self_attn.head_dim)
            else:
                rows = loads.rank_input_rows(W.shape[0], get_tensor_model_parallel_rank(), self.tp)
            W, b = W[rows], b[rows]
            maps[i].weight.data.copy_(torch.from_numpy(np.ascontiguousarray(W)))
            maps[i].bias.data.copy_(torch.from_numpy(np.ascontiguousarray(b)))
            if self.kv_maps[i]:
                continue
            sa = layers[l].self_attn
            rows = slice(sa.q_size, sa.q_size + 2 * sa.kv_size)
            kv[i].weight.data.copy_(sa.qkv_proj.weight.data[rows])
            if kv[i].bias is not None:
                kv[i].bias.data.copy_(sa.qkv_proj.bias.data[rows])
        self.release = self.release.without_maps()  # the float32 copies are no longer needed
        maps_only = [p for n, p in self.own() if n.startswith("filled.maps.")]
        self.stats["map_bytes"] = sum(p.numel() * p.element_size() for p in maps_only)
        return {f"ridgefill.{name}" for name, _ in self.own()}

    def memory(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.own())

    # -- the forward -----------------------------------------------------------------------------------------------

    def warm_up(self, causal_lm, input_ids, positions, inputs_embeds) -> None:
        """In vLLM's first start-up run (memory profiling or warm-up, with no request and no attention metadata):
        run the fill's three compiled parts once on its tokens, so they compile now rather than in a request, and
        vLLM's profiled peak memory includes theirs. Nothing is written to the cache."""
        started = time.perf_counter()
        m = causal_lm.model
        h = inputs_embeds if inputs_embeds is not None else m.embed_input_ids(input_ids)
        h, residual, *kept = self.early(h, positions)
        self.filled(stacked(h + residual, kept), positions)
        self.late_layers(h, residual, positions)
        self.warm = True
        self.stats["warm_up_s"] = round(time.perf_counter() - started, 3)
        log.info("ridgefill: the fill's compiled parts (layers 0..%d, the filled keys and values, layers %d..%d) "
                 "ran at start-up on %d tokens in %.1f s", self.split - 1, self.split, self.late[-1],
                 positions.shape[-1], self.stats["warm_up_s"])  # fmt: skip

    def forward(self, causal_lm, input_ids, positions, inputs_embeds):
        """The fill's forward of this step, or None when the step is vLLM's own (no plan, or nothing to fill)."""
        step, ctx = _STEP[0], get_forward_context()
        meta = ctx.attn_metadata
        if step is None or not isinstance(meta, dict) or meta.get(self.late_names[0]) is not step:
            self.stats["stock_steps"] += 1
            return None
        graphs = ctx.cudagraph_runtime_mode
        ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE  # the fill's parts run outside CUDA graphs
        try:
            return self._fill(causal_lm.model, step, ctx, input_ids, positions, inputs_embeds)
        finally:
            ctx.cudagraph_runtime_mode = graphs

    def _fill(self, m, step: Step, ctx, input_ids, positions, inputs_embeds):
        h = inputs_embeds if inputs_embeds is not None else m.embed_input_ids(input_ids)
        h, residual, *kept = self.early(h, positions)
        x = stacked(h + residual, kept)  # what the maps read: the residual stream entering layer S (and earlier ones)
        num = step.prefix.shape[0]  # scheduled tokens; rows past them are padding
        fill = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        fill[:num] = to_device(step.prefix, h.device)
        fill &= ~norm_rows(x, self.exact_norm)
        if self.protected is not None and input_ids is not None:
            fill &= ~protected_rows(input_ids, self.protected)
        if self.tp > 1:  # every rank runs the same rows: a row fills only where every rank would fill it
            agreed = fill.to(torch.int32)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=get_tp_group().device_group)
            fill = agreed.bool()
        with gpu_sync_allowed():  # the step's one host synchronization: every other copy is to the device
            filled = fill[:num].cpu().numpy()
        self.stats["exact_prefix_rows"] += int(step.prefix.sum() - filled.sum())
        f_rows = to_device(np.flatnonzero(filled), h.device)
        slots = ctx.slot_mapping[self.late_names[0]]
        if f_rows.numel():  # every late layer's filled keys and values first: they depend on x alone
            keys, values = self.filled(x[f_rows], positions[f_rows])
            slots_f = slots[f_rows]
            for l, k, v in zip(self.late, keys, values):
                attn = m.layers[l].self_attn.attn
                attn.impl.do_kv_cache_update(attn, k.view(-1, attn.num_kv_heads, attn.head_size),
                                             v.view(-1, attn.num_kv_heads, attn.head_size_v), attn.kv_cache,
                                             slots_f)  # fmt: skip
        # The exact rows through the late layers, in groups of at most as many sequences as the backend has room
        # for (plan.groups), one after another in position order (planned while the device writes the filled rows).
        parts = plan.groups(plan.runs(~filled, step.query_start, step.seq_lens), self.max_seqs)
        out = late_groups(self.late_layers, self.late_names, step, parts, ctx, h, residual, positions, slots)
        self.stats["fill_steps"] += 1
        self.stats["filled_rows"] += int(f_rows.numel())
        self.stats["groups"] += len(parts)
        self.stats["max_group_seqs"] = max(self.stats["max_group_seqs"], *(g.owner.size for g in parts), 0)
        return out


def late_groups(late, names, step: Step, parts: list, ctx, h, residual, positions, slots) -> torch.Tensor:
    """The exact rows through the late layers (`late`, with the final norm), group by group (`parts`, from
    `plan.groups`): each group's metadata is built (`group_metadata`) and swapped into the forward context for the
    late layers `names`, then the group is launched. Returns [tokens, d]: the exact rows' outputs, zero elsewhere."""
    out = torch.zeros_like(h)
    meta = ctx.attn_metadata
    saved = {name: (meta[name], ctx.slot_mapping[name]) for name in names}
    try:
        for runs in parts:
            q_rows = to_device(runs.rows, h.device)
            group_meta = group_metadata(step, runs, positions, slots, q_rows)
            for name in names:
                meta[name], ctx.slot_mapping[name] = group_meta, slots[q_rows]
            out[q_rows] = late(h[q_rows], residual[q_rows], positions[q_rows])
    finally:
        for name, (old_meta, old_slots) in saved.items():
            meta[name], ctx.slot_mapping[name] = old_meta, old_slots
    return out


def group_metadata(step: Step, runs: plan.Runs, positions, slots, q_rows):
    """The late layers' attention metadata for one group of exact runs, from the backend's own builder (after the
    builder's last group build has been copied to the device: `builder_class`)."""
    cam, dev = step.common, positions.device
    owner = to_device(runs.owner, cam.block_table_tensor.device)
    qsl, seq = runs.query_start.astype(np.int32), runs.seq_lens.astype(np.int32)
    sub = dataclasses.replace(
        cam, query_start_loc=to_device(qsl, dev), query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens=to_device(seq, dev), seq_lens_cpu_upper_bound=torch.from_numpy(seq),
        num_reqs=int(runs.owner.size), num_actual_tokens=int(runs.rows.size), max_query_len=runs.max_query_len,
        max_seq_len=int(runs.seq_lens.max()), block_table_tensor=cam.block_table_tensor[owner],
        slot_mapping=slots[q_rows], causal=True, positions=positions[q_rows],
        is_prefilling=None if cam.is_prefilling is None else cam.is_prefilling[torch.from_numpy(runs.owner)],
        logits_indices_padded=None, num_logits_indices=None, max_logits_per_req=None, req_idx=None,
        dcp_local_seq_lens=None, dcp_local_seq_lens_cpu_upper_bound=None, mm_req_doc_ranges=None,
        rswa_prefix_lens=None, _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)  # fmt: skip
    return step.builder.build_group(sub)


def starting_up() -> bool:
    """Whether this model call is one of vLLM's start-up runs the fill may warm up in: outside any request
    (`RUNNER` unset, checked by the caller) and outside CUDA graph capture, whose stream would record the fill's
    kernels into vLLM's graph."""
    ctx = get_forward_context()
    return ctx.cudagraph_runtime_mode == CUDAGraphMode.NONE and not (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without a host synchronization: on an accelerator, copied from pinned memory with
    `non_blocking` (ordered on the stream before the kernels that read it; PyTorch's pinned-memory cache keeps the
    buffer until the copy is done); on the CPU, the array itself."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class FillMixin:
    """The hook: vLLM's causal LM, with an `EngineFill` when RIDGEFILL_RELEASE is set."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        release = served.PROCESS.for_model()  # the release the plugin verified, with its maps
        self.ridgefill = EngineFill(self, vllm_config, release)
        self._ridgefill_source = (vllm_config.model_config.model, vllm_config.model_config.revision,
                                  vllm_config.load_config.download_dir)  # fmt: skip

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        _check_hub_model(self.ridgefill.release, *self._ridgefill_source)
        names = self.ridgefill.load(self)
        fill = self.ridgefill
        held = "maps" if all(fill.kv_maps) else "maps and key/value copies"  # a key/value map needs no copy
        param = fill.own()[0][1]
        log.info("ridgefill: %s; %s %.1f MiB in %s on %s", fill.release.describe(), held, fill.memory() / 2**20,
                 param.dtype, param.device)
        return None if loaded is None else set(loaded) | names

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        fill = self.ridgefill
        if not fill.warm and fill.compiled and RUNNER.get() is None and starting_up():
            fill.warm_up(self, input_ids, positions, inputs_embeds)  # vLLM's first start-up run
        out = fill.forward(self, input_ids, positions, inputs_embeds)
        if out is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        return out


def fill_stats(model) -> dict | None:
    """The fill's counters of this worker's model (None without the fill), for `LLM.apply_model`: a function of a
    module every vLLM process imports, so it reaches an engine core and tensor-parallel workers in other processes
    by name (with VLLM_ALLOW_INSECURE_SERIALIZATION=1, which vLLM needs to send any function there)."""
    fill = getattr(model, "ridgefill", None)
    return None if fill is None else dict(fill.stats)


def _check_hub_model(release: served.Fill, model: str, revision, download_dir) -> None:
    """A model served from the Hub (its snapshot now downloaded) must be the release's model: the fingerprint of
    its snapshot, from the blob names (the sha256 the Hub keeps). A local folder was checked at startup."""
    import os

    if os.path.isdir(model):
        return
    from huggingface_hub import snapshot_download

    from ridgefill.engines import identity

    folder = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    problem = identity.served_fingerprint_problem(folder, release.manifest)
    if problem:
        raise ValueError(f"ridgefill: {served.ENV}={release.folder}: {problem}")


class RidgefillLlamaForCausalLM(FillMixin, LlamaForCausalLM):
    pass


class RidgefillQwen2ForCausalLM(FillMixin, Qwen2ForCausalLM):
    pass


class RidgefillQwen3ForCausalLM(FillMixin, Qwen3ForCausalLM):
    pass


CLASSES = {"LlamaForCausalLM": RidgefillLlamaForCausalLM, "Qwen2ForCausalLM": RidgefillQwen2ForCausalLM,
           "Qwen3ForCausalLM": RidgefillQwen3ForCausalLM}  # fmt: skip
