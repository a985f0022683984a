"""Run in vLLM's environment by tests/test_vllm_plugin_tiny.py: the compile-cache key vLLM derives for the fill's parts
under each release (`plugin.key_compiled_parts`), without compiling anything.

    RIDGEFILL_RELEASE=FIRST python tests/vllm_compile_key.py MODEL OUT.json NAME=RELEASE ...

OUT: {NAME: {"config_hash": the configuration's hash (a factor of the piecewise cache's folder), "aot_factors":
vLLM's own factors of an AOT artifact's hash, "ridgefill": what the plugin put in additional_config}}.
"""

from __future__ import annotations

import json
import sys

from vllm.compilation.caching import aot_compile_hash_factors
from vllm.engine.arg_utils import EngineArgs

from ridgefill.engines.vllm import plugin, served


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    plugin.register()
    got = {}
    for item in sys.argv[3:]:
        name, folder = item.split("=", 1)
        served.PROCESS.remember(served.load(folder))
        config = EngineArgs(model=model, dtype="float32", skip_tokenizer_init=True,
                            max_model_len=256).create_engine_config()
        config_hash = config.compute_hash()
        got[name] = {"config_hash": config_hash, "aot_factors": [str(f) for f in aot_compile_hash_factors(config)],
                     "ridgefill": config.additional_config.get("ridgefill")}
    with open(out, "w") as f:
        json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
