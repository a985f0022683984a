"""The ridgefill KV connector inside stock vLLM (ridgefill.engines.vllm.RidgefillConnector) at startup and on two
tensor-parallel ranks on the CPU: it finds every model layer among vLLM's KV cache layers or refuses with one line,
and each rank writes only its own KV heads. Needs the vLLM environment (`scripts/setup-engines.sh vllm`); skipped
without it. The connector serving SmolLM2's caches beside llama.cpp: test_engines.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from vllm_plugin_harness import NEW, ROOT, vllm_python

pytestmark = [pytest.mark.engines, pytest.mark.slow]


CONNECTOR_STARTUP = """
import sys, torch
import vllm.distributed as dist
from ridgefill.engines.vllm import RidgefillConnector

dist.get_tensor_model_parallel_rank = lambda: int(sys.argv[2])
dist.get_tensor_model_parallel_world_size = lambda: int(sys.argv[3])
c = RidgefillConnector.__new__(RidgefillConnector)  # the worker side's state only
c._layers, c._kv_heads = 4, 2
names = sys.argv[1].split(",")
try:
    c.register_kv_caches({n: torch.zeros(1) for n in names})
    print("heads", c._heads.start, c._heads.stop)
except ValueError as e:
    print(e)
"""


@pytest.mark.parametrize("names, rank, world, says", [
    ("model.layers.0.self_attn.attn,model.layers.1.self_attn.attn,model.layers.2.self_attn.attn,"
     "model.layers.3.self_attn.attn", 0, 1, "heads 0 2"),
    ("model.layers.0.self_attn.attn,model.layers.1.self_attn.attn,model.layers.2.self_attn.attn,"
     "model.layers.3.self_attn.attn", 1, 2, "heads 1 2"),
    ("model.layers.0.self_attn.attn,model.layers.1.self_attn.attn,model.layers.3.self_attn.attn", 0, 1,
     "ridgefill: expected one KV cache layer for each of the model's 4 layers; missing [2], unexpected or repeated "
     "none"),
    ("model.layers.0.self_attn.attn,model.layers.1.self_attn.attn,model.layers.2.self_attn.attn,"
     "model.layers.3.self_attn.attn,model.layers.4.self_attn.attn", 0, 1,
     "ridgefill: expected one KV cache layer for each of the model's 4 layers; missing [], unexpected or repeated [4]"),
    ("model.layers.0.self_attn.attn,mtp.attn", 0, 1, "ridgefill: KV cache layer 'mtp.attn' has no '.layers.<l>.' "
                                                      "in its name"),
])  # fmt: skip
def test_vllm_connector_finds_every_layer_at_startup_and_its_ranks_heads(names, rank, world, says):
    """register_kv_caches maps every KV cache layer to a model layer or refuses, naming what it expected; a rank's KV
    heads under a mocked tensor-parallel rank and world size (2 KV heads)."""
    py = vllm_python()
    r = subprocess.run([py, "-c", CONNECTOR_STARTUP, names, str(rank), str(world)], capture_output=True, text=True,
                       cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == says


def test_vllm_connector_with_two_tensor_parallel_ranks(tmp_path):
    """Two tensor-parallel ranks on the CPU (a tiny Llama, 2 KV heads: one per rank): each rank writes only its
    heads, so the answers equal one rank's and the model's own full prefill's; another model's cache still fails
    alone."""
    import shutil

    from tiny import make_tiny_model

    from ridgefill.artifacts import sha256_file
    from ridgefill.engines.prepare import prefix_cache
    from ridgefill.formats import safetensors
    from ridgefill.models import load_model, resolve_model

    py = vllm_python()
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel ranks need two CPUs")
    model = make_tiny_model(tmp_path / "model", "llama", layers=4, hidden=128)  # 2 KV heads of 32
    lm = load_model(resolve_model(str(model), store_root=tmp_path / "store"), store_root=tmp_path / "store")
    caches, rng = tmp_path / "caches", np.random.default_rng(0)
    prompts, requests = {}, {}
    for i in range(8):
        ids = rng.integers(6, 320, int(rng.integers(120, 200))).tolist()
        path = prefix_cache(lm, ids, "exact", tail=24).save(caches / f"c{i}")[0]
        prompts[f"c{i}"], requests[f"c{i}"] = ids, {"cache": str(path), "salt": sha256_file(path)}
    shutil.copytree(caches / "c1", caches / "other")
    other = caches / "other" / "cache.safetensors"
    arrays, meta = safetensors.load(other)
    safetensors.save(other, arrays, meta | {"model_fingerprint": "0" * 64})
    prompts["other"], requests["other"] = prompts["c1"], {"cache": str(other), "salt": sha256_file(other)}
    names = [f"c{i}" for i in range(8)]
    connector = {"kv_connector": "RidgefillConnector", "kv_connector_module_path": "ridgefill.engines.vllm",
                 "kv_role": "kv_consumer", "kv_connector_extra_config": {"cache_dir": str(caches)}}  # fmt: skip
    engine = {"max_model_len": 256, "block_size": 32, "max_num_seqs": 4}
    runs = [{"name": "own", "engine": engine, "prompts": names, "submit": "together", "max_new": NEW},
            {"name": "one", "engine": engine | {"kv_transfer_config": connector}, "prompts": names,
             "submit": "together", "max_new": NEW},
            {"name": "two", "engine": engine | {"kv_transfer_config": connector, "tensor_parallel_size": 2,
                                                "distributed_executor_backend": "mp"},
             "prompts": names + ["other"], "submit": "together", "max_new": NEW}]  # fmt: skip
    spec, out = tmp_path / "jobs.json", tmp_path / "results.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "runs": runs, "requests": requests}))
    env = {k: v for k, v in os.environ.items() if k != "RIDGEFILL_RELEASE"}
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([py, ROOT / "tests" / "vllm_plugin_runner.py", spec, out], capture_output=True, text=True,
                       cwd=ROOT, env=env)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    got = {run: {o["prompt"]: o for o in v["outputs"]} for run, v in json.loads(out.read_text())["runs"].items()}
    for n in names:
        assert got["two"][n]["finish"] == "length" and got["two"][n]["tokens"] == got["one"][n]["tokens"], n
        assert got["one"][n]["tokens"] == got["own"][n]["tokens"], n
        assert abs(got["two"][n]["top2"][0][0][1] - got["one"][n]["top2"][0][0][1]) < 1e-4, n
    assert got["two"]["other"]["finish"] == "error"
