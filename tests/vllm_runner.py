"""Run engine jobs (tests/engine_jobs.py) in vLLM, offline, with the ridgefill connector; in vLLM's environment:

    python tests/vllm_runner.py JOBS.json RESULTS.json

The model runs in float32 with prefix caching on, as in a server (each request salted with its cache's sha256), in
one process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the connector reading caches from the job file's "cache_dir" (by
default the folder holding them all). Per job: a 1-token request timed (time to first token), and a greedy run whose
per-step top-2 gives the teacher-forced figures while its answer follows the forced one; past the first
difference, one request per forced position.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine_jobs import main_args, read_jobs, top2, write_results
from ridgefill.artifacts import sha256_file


def _margin(entry) -> tuple[int, float]:
    """(top-1 token, its log-prob margin over the second) of one position's logprob dict."""
    (first, lp1), (_, lp2) = top2(entry)
    return first, lp1 - lp2


def main() -> None:
    jobs_path, out_path = main_args()
    spec = read_jobs(jobs_path)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    longest = max(len(j["ids"]) + len(j.get("forced", [])) + j.get("max_new", 1) for j in spec["jobs"])
    caches = [j["cache"] for j in spec["jobs"] if j.get("cache")]
    cache_dir = spec.get("cache_dir") or (os.path.commonpath([os.path.dirname(c) for c in caches]) if caches else ".")
    salts = {c: sha256_file(Path(c)) for c in set(caches)}
    connector = KVTransferConfig(kv_connector="RidgefillConnector", kv_role="kv_consumer",
                                 kv_connector_module_path="ridgefill.engines.vllm",
                                 kv_connector_extra_config={"cache_dir": cache_dir})  # fmt: skip
    llm = LLM(spec["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0,
              max_model_len=max(256, longest + 16), enable_prefix_caching=True, max_num_seqs=1,
              max_num_batched_tokens=max(2048, longest + 16),  # a whole prompt in one step: no chunking
              kv_transfer_config=connector)  # fmt: skip

    def run(job, ids, **sp):
        prompt = {"prompt_token_ids": list(ids)}
        extra = None
        if job.get("cache"):
            prompt["cache_salt"] = salts[job["cache"]]
            extra = {"kv_transfer_params": {"ridgefill_cache": job["cache"]}}
        params = SamplingParams(temperature=0.0, detokenize=False, extra_args=extra, **sp)
        return llm.generate([prompt], params, use_tqdm=False)[0]

    results = []
    for job in spec["jobs"]:
        start = time.perf_counter()
        run(job, job["ids"], max_tokens=1)
        seconds = time.perf_counter() - start
        if job.get("measure_only"):
            results.append({"name": job["name"], "seconds": seconds})
            continue
        # One greedy request with the top-2 at every step; a forced position after the engine's own answer has
        # left the forced one gets a request of its own. (Prompt logprobs cannot teacher-force here: vLLM computes
        # the whole prompt of a request that asks for them, loading no external KV.)
        max_new, forced = job.get("max_new", 16), list(job.get("forced", []))
        o = run(job, job["ids"], max_tokens=max(max_new, len(forced) + 1), logprobs=2).outputs[0]
        greedy, steps = list(o.token_ids), [_margin(lp) for lp in o.logprobs]
        tops = []
        for i in range(len(forced) + 1):
            if i < len(steps) and greedy[:i] == forced[:i]:
                tops.append(steps[i])
            else:
                tops.append(_margin(run(job, job["ids"] + forced[:i], max_tokens=1, logprobs=2).outputs[0].logprobs[0]))
        results.append({"name": job["name"], "greedy": greedy[:max_new], "forced_top1": [t for t, _ in tops],
                        "forced_margin": [m for _, m in tops], "seconds": seconds})  # fmt: skip
    write_results(out_path, results)


if __name__ == "__main__":
    main()
