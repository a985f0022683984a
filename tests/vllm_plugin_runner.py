"""Run prompts through vLLM's offline engine, with whatever the environment switches on (RIDGEFILL_RELEASE for the
fill plugin) or the engine settings name (the ridgefill KV connector), under several engine settings in one
process; in vLLM's environment:

    python tests/vllm_plugin_runner.py JOBS.json RESULTS.json

JOBS: {"model": path, "prompts": {name: [token ids]}, "runs": [run, ...],
       "requests": {name: {"cache": str, "salt": str}}}    # optional: a prompt's ridgefill cache and cache_salt
a run being
    {"name": str, "engine": {LLM keyword arguments; "kv_transfer_config" as a dict}, "prompts": [names],
     "max_new": int,
     "submit": "alone" | "together",        # one generate call per prompt, or all in one (the scheduler batches)
     "prompt_logprobs": [names],            # optional: these ask for prompt log-probabilities
     "after": [names],                      # optional: sent to the same engine once the others are answered,
                                            #   reading the prefix cache even when they ask for prompt log-probs
                                            #   (which vLLM's default skips it for)
     "gpu_seq_limits": bool}                # optional: the CPU backend's metadata builder refuses, as FlashInfer's
                                            #   and FlashAttention 3's would, more sequences than they have room for
RESULTS: {"runs": {name: {"outputs": [{"prompt": name, "tokens": [int], "top2": [[[id, logprob], [id, logprob]],
                                        ...], "cached": int, "finish": str}, ...],  # in the run's prompts' order
                          "stats": the fill's counters (rank 0's) or null, "rank_stats": [every rank's] or null,
                          "preemptions": int, "seconds": float, "max_batch_seqs": int or null}}}

Each run gets a fresh engine (dtype float32, token ids in and out, greedy decoding, 2 top log-probs per step, the
vLLM V1 engine in this process) unless its "engine" says otherwise. Standard library and vLLM only.
"""

from __future__ import annotations

import gc
import os
import sys
import time

from engine_jobs import main_args, top2

DEFAULTS = {"dtype": "float32", "skip_tokenizer_init": True, "seed": 0, "enforce_eager": True,
            "disable_log_stats": False}  # fmt: skip


def _preemptions(llm) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            return int(metric.value)
    return 0


def enforce_gpu_seq_limits() -> None:
    """Make the CPU attention backend's metadata builder fail where vLLM 0.32's GPU builders would on a batch of more
    sequences than their persistent buffers hold: FlashInfer's `paged_kv_indptr` (max_num_seqs + 1 entries, written
    with np.cumsum(..., out=indptr[1:S + 1])) and FlashAttention 3's scheduler metadata under full CUDA graphs
    (1 + round_up(max(max_num_seqs, max capture size), 4) * 4 entries, written [:1 + round_up(S, 4) * 4]). The
    sequence counts it saw go to SEEN. For the run that asks (LIMITS); a test device, nothing more: the CPU backend
    itself has no such limit."""
    import numpy as np
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    LIMITS["on"] = True
    build = CPUAttentionMetadataBuilder.build
    if getattr(build, "_limits", False):
        return

    def round4(n: int) -> int:
        return -(-n // 4) * 4

    def limited(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        if not LIMITS["on"]:
            return build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        seqs, sched = common_attn_metadata.num_reqs, self.vllm_config.scheduler_config
        indptr = np.zeros(sched.max_num_seqs + 1, np.int32)  # FlashInfer
        np.cumsum(np.ones(seqs, np.int32), dtype=np.int32, out=indptr[1 : seqs + 1])
        capture = self.vllm_config.compilation_config.max_cudagraph_capture_size or 0
        fa3 = np.zeros(1 + round4(max(sched.max_num_seqs, capture)) * 4, np.int32)  # FlashAttention 3
        fa3[: 1 + round4(seqs) * 4] = np.ones(1 + round4(seqs) * 4, np.int32)
        SEEN.append(seqs)
        return build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)

    limited._limits = True
    CPUAttentionMetadataBuilder.build = limited


SEEN: list[int] = []
LIMITS = {"on": False}


def run_one(model: str, run: dict, prompts: dict, caches: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    start = time.perf_counter()
    engine = DEFAULTS | run.get("engine", {})
    if isinstance(engine.get("kv_transfer_config"), dict):
        engine["kv_transfer_config"] = KVTransferConfig(**engine["kv_transfer_config"])
    LIMITS["on"] = False
    if run.get("gpu_seq_limits"):
        enforce_gpu_seq_limits()
    SEEN.clear()
    llm = LLM(model, **engine)
    names = run["prompts"]
    asks = set(run.get("prompt_logprobs", []))

    def request(name, reuse=False):
        prompt, cache = {"prompt_token_ids": prompts[name]}, caches.get(name, {})
        if cache.get("salt"):
            prompt["cache_salt"] = cache["salt"]
        extra = {"kv_transfer_params": {"ridgefill_cache": cache["cache"]}} if "cache" in cache else None
        return prompt, SamplingParams(max_tokens=run.get("max_new", 16), temperature=0.0, logprobs=2,
                                      detokenize=False, prompt_logprobs=1 if name in asks else None,
                                      skip_reading_prefix_cache=False if reuse else None,
                                      extra_args=extra)  # fmt: skip

    requests = [request(n) for n in names]
    if run.get("submit", "alone") == "together":
        got = list(llm.generate([r for r, _ in requests], [p for _, p in requests], use_tqdm=False))
    else:
        got = [llm.generate([r], [p], use_tqdm=False)[0] for r, p in requests]
    for name in run.get("after", []):
        r, p = request(name, reuse=True)
        got.append(llm.generate([r], [p], use_tqdm=False)[0])
    names = names + run.get("after", [])
    outputs = []
    for name, o in zip(names, got):
        c = o.outputs[0]
        outputs.append({"prompt": name, "tokens": list(c.token_ids), "top2": [top2(lp) for lp in c.logprobs or []],
                        "cached": int(o.num_cached_tokens or 0), "finish": str(c.finish_reason)})  # fmt: skip
    # The fill's counters, read in the model's process: this one, or (VLLM_ENABLE_V1_MULTIPROCESSING=1, tensor
    # parallelism) vLLM's engine core and workers, which need VLLM_ALLOW_INSECURE_SERIALIZATION=1 to be sent a
    # function and get it by name (a lambda does not pickle). Rank 0's, and every rank's.
    stats = ranks = None
    if os.environ.get("RIDGEFILL_RELEASE"):
        from ridgefill.engines.vllm.model import fill_stats

        ranks = llm.apply_model(fill_stats)
        stats = ranks[0]
    result = {"outputs": outputs, "stats": stats, "rank_stats": ranks, "preemptions": _preemptions(llm),
              "seconds": time.perf_counter() - start, "max_batch_seqs": max(SEEN, default=None)}  # fmt: skip
    del llm
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    gc.collect()
    return result


def main() -> None:
    import json
    from pathlib import Path

    jobs_path, out_path = main_args()
    spec = json.loads(Path(jobs_path).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = {}
    for run in spec["runs"]:
        results[run["name"]] = run_one(spec["model"], run, spec["prompts"], spec.get("requests", {}))
        print(f"vllm_plugin_runner: {run['name']}: {len(run['prompts'])} prompts in "
              f"{results[run['name']]['seconds']:.1f} s", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps({"runs": results}, indent=1))


if __name__ == "__main__":
    main()
