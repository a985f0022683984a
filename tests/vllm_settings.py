"""Run in vLLM's environment by tests/test_vllm_plugin.py: the fill plugin's startup check (`plugin.check_engine`,
run where vLLM makes its configuration) on each engine setting the fill cannot honour.

    RIDGEFILL_RELEASE=RELEASE python tests/vllm_settings.py MODEL OUT.json

OUT: {case: the one line it was refused with, or null when it started}. A setting vLLM's CPU platform itself does
not take (context parallelism) is set on a configuration vLLM made, then checked.
"""

from __future__ import annotations

import json
import os
import sys

from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs

from ridgefill.engines.vllm import plugin

CONNECTOR = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                             kv_connector_extra_config={"shared_storage_path": "/tmp"})  # fmt: skip
CASES = {  # name: (engine arguments, environment, configuration attributes set afterwards)
    "accepted": ({}, {}, {}),
    "prompt_embeds": ({"enable_prompt_embeds": True}, {}, {}),
    "stock_torch_compile": ({"compilation_config": {"mode": 1}}, {}, {}),
    "breakable_cuda_graphs": ({}, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, {}),
    "kv_connector": ({"kv_transfer_config": CONNECTOR}, {}, {}),
    "context_below_tail": ({"max_model_len": 512}, {}, {}),
    "kv_cache_fp8": ({"kv_cache_dtype": "fp8"}, {}, {}),
    "decode_context_parallel": ({}, {}, {"decode_context_parallel_size": 2}),
    "prefill_context_parallel": ({}, {}, {"prefill_context_parallel_size": 2}),
}


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    plugin.register()
    got = {}
    for name, (args, env, attrs) in CASES.items():
        os.environ.update(env)
        try:
            config = EngineArgs(**({"model": model, "dtype": "float32", "skip_tokenizer_init": True,
                                    "max_model_len": 2048} | args)).create_engine_config()  # fmt: skip
            for key, value in attrs.items():
                setattr(config.parallel_config, key, value)
            if attrs:
                plugin.check_engine(config)
            got[name] = None
        except plugin.Refused as e:
            got[name] = str(e)
        finally:
            for key in env:
                del os.environ[key]
    with open(out, "w") as f:
        json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
