"""Every patch the fill makes to a vLLM class or function, in one place, each labelled with the process it takes
effect in (the plugin applies them all in every process vLLM starts; each is a no-op where its code does not run).
What they wrap is listed, with the other internals touched, in internals.py. Each patch is applied once per process
(marked `_ridgefill`) and calls the original.
"""

from __future__ import annotations


def apply(check_engine, block_key) -> None:
    """All of them: `check_engine(config)` refuses a configuration, `block_key(request, start, end)` is the plan's
    part of a block hash (the plugin's)."""
    engine_config(check_engine)
    model_runner()
    block_hashes(block_key)


def _marked(fn):
    fn._ridgefill = True
    return fn


def engine_config(check_engine) -> None:
    """API server (and an offline `LLM`'s process): `EngineArgs.create_engine_config` checks the configuration it
    makes against the release (`check_engine`), so a setting the fill cannot honour stops startup."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config
    if getattr(create, "_ridgefill", False):
        return

    @_marked
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        check_engine(config)
        return config

    EngineArgs.create_engine_config = create_engine_config


def model_runner() -> None:
    """Worker: `GPUModelRunner.execute_model` (the CPU runner is its subclass) runs inside `model.RUNNER`, so the
    late layers' metadata builder reads the step's requests from the runner that schedules them; and
    `_determine_batch_execution_and_padding` never calls a step a uniform decode (which a full CUDA graph replays,
    skipping the fill's forward) when it holds a prefix row: a one-token prompt chunk among decodes."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ridgefill.engines.vllm.model import RUNNER, keep_off_decode_graph

    execute = GPUModelRunner.execute_model
    if getattr(execute, "_ridgefill", False):
        return

    @_marked
    def execute_model(self, *args, **kwargs):
        token = RUNNER.set(self)
        try:
            return execute(self, *args, **kwargs)
        finally:
            RUNNER.reset(token)

    determine = GPUModelRunner._determine_batch_execution_and_padding
    signature = inspect.signature(determine)

    @_marked
    def determine_batch_execution_and_padding(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        a = bound.arguments
        if (a.get("force_uniform_decode") is None and a["max_num_scheduled_tokens"] == 1
                and a["num_tokens"] == a["num_reqs"] and keep_off_decode_graph(self, a["num_reqs"])):
            a["force_uniform_decode"] = False
        return determine(*bound.args, **bound.kwargs)

    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._determine_batch_execution_and_padding = determine_batch_execution_and_padding


def block_hashes(block_key) -> None:
    """Engine core (the scheduler hashes each request's blocks): `generate_block_hash_extra_keys` adds the plan's
    part (`block_key`), in both modules that call it by name."""
    import vllm.v1.core.block_pool as block_pool
    import vllm.v1.core.kv_cache_utils as utils

    extra_keys = utils.generate_block_hash_extra_keys
    if getattr(extra_keys, "_ridgefill", False):
        return

    @_marked
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, mm_idx = extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)
        return (keys or ()) + (block_key(request, start_token_idx, end_token_idx),), mm_idx

    for module in (utils, block_pool):
        module.generate_block_hash_extra_keys = generate_block_hash_extra_keys
