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

The patches (patches.py) are written for vLLM 0.32 (`internals.SUPPORTED`); another version is refused at startup
rather than run on guesses.
"""

from __future__ import annotations

import functools
import os
import sys

from ridgefill.engines.vllm import internals, served
from ridgefill.errors import RidgefillError

class Refused(RuntimeError):
    """The fill cannot start as configured: one line naming the problem."""


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    if served.PROCESS.fill is not None or not os.environ.get(served.ENV):  # unset or empty: vLLM untouched (blanks are refused below)
        return
    sys.excepthook = _one_line(sys.excepthook)
    try:
        fill = served.from_environment()
    except RidgefillError as e:
        raise Refused(f"ridgefill: {e}") from None
    if fill.origin:  # named in the start-up output: where the maps came from
        print(f"ridgefill: {fill.origin} pulled and verified into {fill.folder}", file=sys.stderr)
    os.environ[served.ENV] = str(fill.folder)  # the processes vLLM starts read the folder, not the Hub again
    problem = internals.version_problem()
    if problem:
        raise Refused(f"ridgefill: the fill is {problem}")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise Refused("ridgefill: the fill runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
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


def check_engine(config) -> None:
    """Refused naming the first reason the engine configuration `config` (a VllmConfig) cannot serve the fill."""
    from vllm.config import CompilationMode

    fill = served.PROCESS.fill
    mc = config.model_config
    problems = []
    if config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (the late layers need the split state of every row)")
    if getattr(config.parallel_config, "enable_dbo", False):
        problems.append("dual-batch overlap")
    if config.speculative_config is not None:
        problems.append("speculative decoding (not verified with the fill)")
    if mc.quantization is not None:
        problems.append(f"a {mc.quantization}-quantized checkpoint (the fill copies the late layers' key/value "
                        f"weights)")  # fmt: skip
    if config.use_v2_model_runner:
        problems.append("model runner V2")
    if config.lora_config is not None:
        problems.append("LoRA adapters (the filled rows' keys and values come from the base weights)")
    if getattr(config.cache_config, "kv_sharing_fast_prefill", False):
        problems.append("--kv-sharing-fast-prefill")
    graphs = config.compilation_config.cudagraph_mode
    if graphs is not None and graphs.mixed_mode().name == "FULL":
        problems.append(f"cudagraph_mode {graphs.name} (a step with prompt rows must run the Python forward: use "
                        f"FULL_AND_PIECEWISE, PIECEWISE or FULL_DECODE_ONLY)")  # fmt: skip
    if os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1":
        problems.append("VLLM_USE_BREAKABLE_CUDAGRAPH=1 (it replays vLLM's own graph for the steps the fill runs)")
    if config.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE:
        problems.append("compilation mode STOCK_TORCH_COMPILE (it compiles the whole forward as one graph, which the "
                        "fill's per-step plan cannot be part of: use VLLM_COMPILE, the default)")
    if getattr(mc, "enable_prompt_embeds", False):
        problems.append("--enable-prompt-embeds (the fill decides rows by their token ids, which prompt embeddings "
                        "do not carry)")
    parallel = config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            problems.append(f"{name} {getattr(parallel, name)} (context parallelism: each rank holds a part of a "
                            f"request's keys and values)")  # fmt: skip
    if config.kv_transfer_config is not None:
        problems.append("a KV connector (kv_transfer_config; keys and values loaded from outside would stand in for "
                        "rows the fill plans)")
    cache_dtype = str(config.cache_config.cache_dtype)
    if cache_dtype not in ("auto", "float16", "bfloat16"):
        problems.append(f"--kv-cache-dtype {cache_dtype} (a quantized cache: the filled keys and values are not "
                        f"measured in it; serve with auto, the model's own dtype)")
    if fill.tail >= mc.max_model_len:
        problems.append(f"a context of {mc.max_model_len} tokens (max_model_len) and the release's tail of "
                        f"{fill.tail}: no prompt row would ever be filled; export the release with a shorter tail")
    if problems:
        raise Refused(f"ridgefill: the fill does not run with {problems[0]}")
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
    too)."""
    if not isinstance(config.additional_config, dict):
        raise Refused(f"ridgefill: the fill does not run with an additional_config of type "
                      f"{type(config.additional_config).__name__} (it keys the compile cache by the release there)")
    kinds = sorted(set(fill.map_kinds.values()))
    config.additional_config["ridgefill"] = {"release": fill.sha256, "split": fill.split, "maps": kinds}


# -- prefix-cache block hashes -------------------------------------------------------------------------------------


def block_key(fill, request, start: int, end: int) -> tuple:
    """The plan's part of the hash of a request's cache block holding rows start..end-1."""
    from ridgefill.engines.vllm.plan import prefix_rows_in_block, served_exactly

    exact = served_exactly(getattr(request, "sampling_params", None))
    rows = prefix_rows_in_block(request.num_prompt_tokens, start, end, tail=fill.tail, exact_request=exact)
    return ("ridgefill", f"{fill.sha256}:{rows}")
