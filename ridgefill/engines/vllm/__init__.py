"""ridgefill inside vLLM (docs/engines.md): the fill plugin and the KV connector, laid out by where each part runs.

vLLM runs a server in up to three kinds of process, and calls the plugin (`plugin.register`) in each:

    API server        `EngineArgs.create_engine_config`: the startup checks (plugin.check_engine)
    engine core       the scheduler: prefix-cache block hashes (plugin.block_key); the connector's scheduler side
    worker (per rank) the model (model.py): the plan of each step, the fill's forward; the connector's worker side

    plugin.py         the switch (RIDGEFILL_RELEASE), the startup checks, the block-hash rule
    patches.py        every patch of a vLLM class or function, each labelled with the process it runs in
    internals.py      the vLLM version this is written for, and every vLLM internal the code touches
    model.py          the fill in vLLM's Llama, Qwen2 and Qwen3 (torch, vLLM)
    plan.py           which rows of a step are filled, as attention sequences (numpy only)
    served.py         the release an engine fills with: located, read, checked (numpy only)
    connector.py      RidgefillConnector: engine caches loaded into vLLM's paged KV cache
    loads.py          the connector's rules (numpy only)

The offline runners of job files the tests and benches drive vLLM through are tests/vllm_runner.py and
tests/vllm_plugin_runner.py, outside the package.

`ridgefill.engines.vllm.RidgefillConnector` is the name a user gives vLLM (`kv_connector_module_path`); it is
imported on first use, so the numpy-only modules load without vLLM.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("RidgefillConnector", "RidgefillMetadata"):
        from ridgefill.engines.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
