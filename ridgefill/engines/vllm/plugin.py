"""The vLLM plugin: one switch, `RIDGEFILL_RELEASE`, turns the RidgeFill fill on in a stock vLLM (docs/engines.md,
"Serving a release with vLLM").

    pip install --no-deps <ridgefill>                      # into vLLM's own environment
    RIDGEFILL_RELEASE=release/smollm2-135m vllm serve MODEL

Registered as the `vllm.general_plugins` entry point `ridgefill` (pyproject.toml), which vLLM calls in every
process it starts (the API server, the engine core, each worker). With RIDGEFILL_RELEASE unset or empty,
`register` does nothing: vLLM runs untouched. Set, it reads the release (a folder, or a Hub release
hf://owner/name[@rev] pulled and verified once, then read from the cache), and

- registers ridgefill's Llama, Qwen2 and Qwen3 (`ridgefill.engines.vllm.model`) under vLLM's own architecture
  names, so the user's model folder or Hub id is served as it is;
- checks the engine's configuration against the release where vLLM makes it (`EngineArgs.create_engine_config`):
  the served model's architecture, layer count, hidden size and, for a local folder, fingerprint; and the features
  the fill does not serve (pipeline parallelism, speculative decoding, full CUDA graphs of mixed batches, breakable
  CUDA graphs, stock torch.compile, dual-batch overlap, context parallelism, prompt embeddings, a KV connector,
  quantized checkpoints, LoRA, model runner V2, a context not above the release's tail). A problem stops startup
  with one line (`Refused`);
- gives the late layers' metadata builder the step's requests (`GPUModelRunner.execute_model` runs inside
  `model.RUNNER`): their prompt lengths and whether each is served exactly (`plan.served_exactly`: prompt
  log-probabilities need every row's logits, so such a request has no prefix rows);
- adds the plan to every prefix-cache block's hash (`generate_block_hash_extra_keys`): the release's maps sha256
  and how many of the block's rows were prefix rows for the request that computed it (`plan.prefix_rows_in_block`),
  so a cached block is reused only where it holds what the plan would write.

The patches (patches.py) are written for vLLM 0.32 (`internals.supported()`, ridgefill's `vllm` extra); another
version is refused at startup rather than run on guesses.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, Callable

from ridgefill import environment
from ridgefill.engines.vllm import internals, served
from ridgefill.errors import RidgefillError

class Refused(RuntimeError):
    """The fill cannot start as configured: one line naming the problem."""


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    if served.PROCESS.fill is not None or not environment.raw(served.ENV):  # unset or empty: vLLM runs untouched
        return
    sys.excepthook = _one_line(sys.excepthook)
    try:
        fill = served.from_environment()
    except RidgefillError as e:
        raise Refused(f"ridgefill: {e}") from None
    if fill.origin:  # named in the start-up output: where the maps came from
        print(f"ridgefill: {fill.origin} pulled and verified into {fill.folder}", file=sys.stderr)
    environment.put(served.ENV, str(fill.folder))  # the processes vLLM starts read the folder, not the Hub again
    problem = internals.version_problem()
    if problem:
        raise Refused(f"ridgefill: the fill is {problem}")
    if environment.get(environment.VLLM_USE_V2_MODEL_RUNNER).strip().lower() in ("1", "true"):
        raise Refused("ridgefill: the fill runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
    environment.put(environment.VLLM_USE_V2_MODEL_RUNNER, "0")
    served.PROCESS.remember(fill)  # its facts: every vLLM process runs this, and only one that builds the model reads
    from vllm import ModelRegistry

    from ridgefill.engines.vllm.model import CLASSES

    for arch, cls in CLASSES.items():
        ModelRegistry.register_model(arch, f"{cls.__module__}:{cls.__name__}")
    from ridgefill.engines.vllm import patches

    patches.apply(check_engine, functools.partial(block_key, fill))


def _one_line(previous):
    """An excepthook that prints a `Refused` as its one line (the rest as before)."""

    def hook(kind, value, tb):
        if isinstance(value, Refused):
            print(str(value), file=sys.stderr)
            return
        previous(kind, value, tb)

    return hook


# -- startup checks ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One engine setting the fill does not run with. `name` is how docs/engines.md's "What it refuses" names it
    (a test holds the paragraph to the table); `reads`, the VllmConfig fields (`internals.CONFIG_FIELDS`, resolved
    in the installed vLLM by the engine tests) and environment variables `when` reads; `when(config, fill)` says
    whether the setting is on, `says(config, fill)` completes "the fill does not run with ..."."""

    name: str
    reads: tuple[str, ...]
    when: Callable[[Any, Any], bool]
    says: Callable[[Any, Any], str]


def _context_parallel(size: str) -> Refusal:
    return Refusal("context parallelism", (f"parallel_config.{size}",),
                   lambda c, f: getattr(c.parallel_config, size) > 1,
                   lambda c, f: f"{size} {getattr(c.parallel_config, size)} (context parallelism: each rank holds a "
                                f"part of a request's keys and values)")  # fmt: skip


def _full_graphs(c, f) -> bool:
    graphs = c.compilation_config.cudagraph_mode
    return graphs is not None and graphs.mixed_mode().name == "FULL"


# In the order they are checked: the first that applies is the one line startup stops with.
REFUSALS = (
    Refusal("pipeline parallelism", ("parallel_config.pipeline_parallel_size",),
            lambda c, f: c.parallel_config.pipeline_parallel_size > 1,
            lambda c, f: "pipeline parallelism (the late layers need the split state of every row)"),
    Refusal("dual-batch overlap", ("parallel_config.enable_dbo",),
            lambda c, f: bool(c.parallel_config.enable_dbo), lambda c, f: "dual-batch overlap"),
    Refusal("speculative decoding", ("speculative_config",), lambda c, f: c.speculative_config is not None,
            lambda c, f: "speculative decoding (not verified with the fill)"),
    Refusal("quantized checkpoint", ("model_config.quantization",),
            lambda c, f: c.model_config.quantization is not None,
            lambda c, f: f"a {c.model_config.quantization}-quantized checkpoint (the fill copies the late layers' "
                         f"key/value weights)"),
    Refusal("model runner V2", ("use_v2_model_runner",), lambda c, f: bool(c.use_v2_model_runner),
            lambda c, f: "model runner V2"),
    Refusal("LoRA", ("lora_config",), lambda c, f: c.lora_config is not None,
            lambda c, f: "LoRA adapters (the filled rows' keys and values come from the base weights)"),
    Refusal("--kv-sharing-fast-prefill", ("cache_config.kv_sharing_fast_prefill",),
            lambda c, f: bool(c.cache_config.kv_sharing_fast_prefill), lambda c, f: "--kv-sharing-fast-prefill"),
    Refusal("`cudagraph_mode` `FULL`", ("compilation_config.cudagraph_mode",), _full_graphs,
            lambda c, f: f"cudagraph_mode {c.compilation_config.cudagraph_mode.name} (a step with prompt rows must "
                         f"run the Python forward: use FULL_AND_PIECEWISE, PIECEWISE or FULL_DECODE_ONLY)"),
    Refusal("VLLM_USE_BREAKABLE_CUDAGRAPH=1", (environment.VLLM_USE_BREAKABLE_CUDAGRAPH,),
            lambda c, f: environment.get(environment.VLLM_USE_BREAKABLE_CUDAGRAPH) == "1",
            lambda c, f: "VLLM_USE_BREAKABLE_CUDAGRAPH=1 (it replays vLLM's own graph for the steps the fill runs)"),
    Refusal("STOCK_TORCH_COMPILE", ("compilation_config.mode",),
            lambda c, f: c.compilation_config.mode == _compilation_mode().STOCK_TORCH_COMPILE,
            lambda c, f: "compilation mode STOCK_TORCH_COMPILE (it compiles the whole forward as one graph, which "
                         "the fill's per-step plan cannot be part of: use VLLM_COMPILE, the default)"),
    Refusal("--enable-prompt-embeds", ("model_config.enable_prompt_embeds",),
            lambda c, f: bool(c.model_config.enable_prompt_embeds),
            lambda c, f: "--enable-prompt-embeds (the fill decides rows by their token ids, which prompt embeddings "
                         "do not carry)"),
    _context_parallel("decode_context_parallel_size"),
    _context_parallel("prefill_context_parallel_size"),
    Refusal("KV connector", ("kv_transfer_config",), lambda c, f: c.kv_transfer_config is not None,
            lambda c, f: "a KV connector (kv_transfer_config; keys and values loaded from outside would stand in "
                         "for rows the fill plans)"),
    Refusal("--kv-cache-dtype", ("cache_config.cache_dtype",),
            lambda c, f: str(c.cache_config.cache_dtype) not in ("auto", "float16", "bfloat16"),
            lambda c, f: f"--kv-cache-dtype {c.cache_config.cache_dtype} (a quantized cache: the filled keys and "
                         f"values are not measured in it; serve with auto, the model's own dtype)"),
    Refusal("max_model_len", ("model_config.max_model_len",), lambda c, f: f.tail >= c.model_config.max_model_len,
            lambda c, f: f"a context of {c.model_config.max_model_len} tokens (max_model_len) and the release's "
                         f"tail of {f.tail}: no prompt row would ever be filled; export the release with a shorter "
                         f"tail"),
    Refusal("additional_config", ("additional_config",), lambda c, f: not isinstance(c.additional_config, dict),
            lambda c, f: f"an additional_config of type {type(c.additional_config).__name__} (it keys the compile "
                         f"cache by the release there)"),
)  # fmt: skip


def _compilation_mode():
    from vllm.config import CompilationMode

    return CompilationMode


def check_engine(config) -> None:
    """Refused naming the first reason the engine configuration `config` (a VllmConfig) cannot serve the fill: the
    first of REFUSALS that applies, then the served model against the release."""
    fill = served.PROCESS.fill
    mc = config.model_config
    for refusal in REFUSALS:
        if refusal.when(config, fill):
            raise Refused(f"ridgefill: the fill does not run with {refusal.says(config, fill)}")
    from ridgefill.engines.vllm.model import CLASSES

    arch = (mc.architectures or ["?"])[0]
    if arch not in CLASSES:
        raise Refused(f"ridgefill: the served model is a {arch}; the fill runs in {', '.join(sorted(CLASSES))}")
    path = mc.model if os.path.isdir(mc.model) else None
    try:
        served.check_model(fill, mc.hf_text_config.to_dict(), path, dtype=str(mc.dtype))
    except RidgefillError as e:
        raise Refused(f"ridgefill: {e}") from None
    key_compiled_parts(config, fill)


def key_compiled_parts(config, fill: served.Fill) -> None:
    """Make the release part of the key of every part vLLM compiles. vLLM keys its compile cache (the piecewise
    cache's folder, and the AOT artifact's hash) by its configuration's hash, the VLLM_* variables and the source
    location of the forward, none of which knows the release; yet the release fixes what the fill's parts trace
    (`Early` holds layers 0..split-1, `Filled` branches on each layer's map kind). So the release's identity goes
    into `additional_config`, which `VllmConfig.compute_hash` covers: a server with another release never loads
    these parts from a cache that one with this release wrote (and its stock backbone is compiled under its own key
    too). `config.additional_config` is a dict (REFUSALS)."""
    kinds = sorted(set(fill.map_kinds.values()))
    config.additional_config["ridgefill"] = {"release": fill.sha256, "split": fill.split, "maps": kinds}


# -- prefix-cache block hashes -------------------------------------------------------------------------------------


def block_key(fill, request, start: int, end: int) -> tuple:
    """The plan's part of the hash of a request's cache block holding rows start..end-1."""
    from ridgefill.engines.vllm.plan import prefix_rows_in_block, served_exactly

    exact = served_exactly(getattr(request, "sampling_params", None))
    rows = prefix_rows_in_block(request.num_prompt_tokens, start, end, tail=fill.tail, exact_request=exact)
    return ("ridgefill", f"{fill.sha256}:{rows}")
