"""The fill inside stock vLLM on two tensor-parallel ranks on the CPU, one core each (a tiny random Qwen2 with
releases of its own): key/value and input maps, and ranks that would decide differently agreeing on the exact rows.
Needs the vLLM environment with the plugin (`scripts/setup-engines.sh vllm`) and two CPUs; skipped without them.
"""

from __future__ import annotations

import os

import pytest
from engine_refs import agreement
from vllm_plugin_harness import (
    NEW, check, engine_env, extra_plugin, report, run_engine, tiny, tiny_filled_rows,
)

pytestmark = [pytest.mark.engines, pytest.mark.slow]


TP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
          "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # fmt: skip
TP_ENGINE = {"max_model_len": 256, "enable_prefix_caching": False, "max_num_batched_tokens": 128, "max_num_seqs": 4}


# Input maps are column-parallel over the hidden rows whatever the KV heads: one case of them is enough, and it reads
# earlier states too (maps from h_S alone are the same code with none kept).
@pytest.mark.parametrize("maps, kv_heads", [("kv", 2), ("input", 2), ("kv", 1)])
def test_the_fill_on_two_tensor_parallel_ranks(tiny, maps, kv_heads, tmp_path):
    """The tiny Qwen2 on two tensor-parallel ranks on the CPU, with key/value maps (each rank holding its own heads'
    rows) for 2 KV heads (one per rank) and for 1 (replicated on both), and with input maps (column-parallel: each
    rank holding half the rows, the prediction all-gathered) that read the states entering layers 0 and 1 beside
    h_2 (ridgefill-maps/3): the answers equal one rank's and the reference's, both ranks fill the reference's rows,
    and each holds its share of the maps. The input maps run compiled, as vLLM runs by default."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel ranks need two CPUs")
    t = tiny("qwen2", "ridgefill", maps, kv_heads=kv_heads, earlier="2,1" if maps == "input" else None)
    names = [f"p{i}" for i in range(4)]
    prompts, refs = {n: t["prompts"][n] for n in names}, {n: t["refs"][n] for n in names}
    runs = [{"name": "two", "engine": TP_ENGINE | {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
             "prompts": names, "submit": "together", "max_new": NEW}]  # fmt: skip
    if (maps, kv_heads) == ("kv", 2):  # one rank beside it, once: the other cases are held to the reference
        runs.insert(0, {"name": "one", "engine": TP_ENGINE, "prompts": names, "submit": "together", "max_new": NEW})
    # Once, as vLLM runs by default: the fill's parts compiled (the input maps' all-gather inside one of them) and
    # warmed up at start-up.
    compiled = (maps, kv_heads) == ("input", 2)
    if compiled:
        runs[-1]["engine"] = runs[-1]["engine"] | {"enforce_eager": False}
    # As the connector's two-rank test runs vLLM: its engine core in a process of its own, one core per rank; the
    # runner's reading of the fill's counters (`LLM.apply_model`, a function sent to the engine core) needs vLLM's
    # pickle fallback across processes.
    got = run_engine(tmp_path, "tp", t["model"], prompts, runs, engine_env(t["release"], **TP_ENV))
    for run in got:
        fig = agreement(got[run]["outputs"], refs) | {"engine": got[run]["rank_stats"]}
        report(f"qwen2_{maps}_{kv_heads}kv_tp_{run}", fig)
        check(fig, len(names))
        for stats in got[run]["rank_stats"]:
            assert stats["filled_rows"] == tiny_filled_rows(prompts, refs), fig
    if "one" in got:
        one = {o["prompt"]: o for o in got["one"]["outputs"]}
        for o in got["two"]["outputs"]:
            assert o["tokens"] == one[o["prompt"]]["tokens"], o["prompt"]
            assert abs(o["top2"][0][0][1] - one[o["prompt"]]["top2"][0][0][1]) < 1e-4, o["prompt"]
    ranks = got["two"]["rank_stats"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all((r["warm_up_s"] is not None) == compiled for r in ranks), ranks
    # input maps: half the rows each; key/value maps: the rank's KV heads' rows (all of them when one is replicated)
    d = 128  # the tiny model's hidden size; its heads are 32 wide
    width = d if maps == "input" else 2 * kv_heads * 32
    d_in = 3 * d if maps == "input" else d  # the input maps read [h_2; h_1; h_0]
    whole = 2 * 4 * (width * d_in + width)  # 2 late layers of float32 maps and biases
    share = whole // 2 if maps == "input" or kv_heads == 2 else whole
    assert [r["map_bytes"] for r in ranks] == [share, share], (whole, ranks)


FAULT_PLUGIN = """
import os


def register():
    rank = int(os.environ["RIDGEFILL_FAULT_RANK"])
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank
    from ridgefill.engines.vllm import model

    norm_rows = model.norm_rows

    def disagreeing(h, limit):
        rows = norm_rows(h, limit)
        if get_tensor_model_parallel_rank() == rank:
            rows = rows | (torch.arange(rows.shape[0], device=rows.device) % 5 == 3)
        return rows

    model.norm_rows = disagreeing
"""


def test_ranks_that_would_decide_differently_agree_on_the_exact_rows(tiny, tmp_path):
    """Rank 1 made to see every fifth row as norm-exact while rank 0 does not (a test-only vLLM plugin, installed
    beside ridgefill's for this engine only): the ranks agree (one all-reduce, MIN of "fill") before either uses the
    mask, so both run the same rows, each fills exactly what the other does, and the engine answers every request;
    rank 0 runs rank 1's extra exact rows too."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel ranks need two CPUs")
    t = tiny("qwen2", "ridgefill", "kv")
    names = [f"p{i}" for i in range(4)]
    prompts = {n: t["prompts"][n] for n in names}
    site = extra_plugin(tmp_path / "site", "ridgefill_fault", FAULT_PLUGIN)
    runs = [{"name": name, "engine": TP_ENGINE | {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
             "prompts": names, "submit": "together", "max_new": NEW} for name in ("agreed",)]  # fmt: skip
    plain = run_engine(tmp_path, "plain", t["model"], prompts, [runs[0] | {"name": "plain"}],
                       engine_env(t["release"], **TP_ENV))["plain"]  # fmt: skip
    env = engine_env(t["release"], **TP_ENV, RIDGEFILL_FAULT_RANK="1",
                     PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    got = run_engine(tmp_path, "fault", t["model"], prompts, runs, env, timeout=900)["agreed"]
    r0, r1 = got["rank_stats"]
    assert all(o["finish"] == "length" and len(o["tokens"]) == NEW for o in got["outputs"]), got["outputs"]
    assert r0["filled_rows"] == r1["filled_rows"] and r0["exact_prefix_rows"] == r1["exact_prefix_rows"], (r0, r1)
    p0 = plain["rank_stats"][0]
    assert r0["exact_prefix_rows"] > p0["exact_prefix_rows"] and r0["filled_rows"] < p0["filled_rows"], (r0, p0)
    assert r0["exact_prefix_rows"] + r0["filled_rows"] == p0["exact_prefix_rows"] + p0["filled_rows"], (r0, p0)
    report("tp_fault_agreement", {"plain": plain["rank_stats"], "rank1_disagrees": got["rank_stats"]})
