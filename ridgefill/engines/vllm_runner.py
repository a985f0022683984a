"""Run engine jobs (ridgefill.engines.jobs) in vLLM, offline, with the ridgefill connector; in vLLM's environment:

    python -m ridgefill.engines.vllm_runner JOBS.json RESULTS.json

The model runs in float32 with prefix caching off, in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that each
request's time is the engine's own. Per job: a 1-token request timed (time to first token), a greedy run of
`max_new` tokens, and one teacher-forced request whose prompt logprobs give the engine's top-2 at every forced
position.
"""

from __future__ import annotations

import os
import time

from ridgefill.engines.jobs import main_args, read_jobs, write_results


def _top2(entry) -> tuple[int, float]:
    """(top-1 token, its log-prob margin over the second) of one position's logprob dict."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return ranked[0][0], ranked[0][1].logprob - ranked[1][1].logprob


def main() -> None:
    jobs_path, out_path = main_args()
    spec = read_jobs(jobs_path)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    longest = max(len(j["ids"]) + len(j.get("forced", [])) + j.get("max_new", 1) for j in spec["jobs"])
    llm = LLM(spec["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0,
              max_model_len=max(256, longest + 16), enable_prefix_caching=False, max_num_seqs=1,
              kv_transfer_config=KVTransferConfig(kv_connector="RidgefillConnector", kv_role="kv_consumer",
                                                  kv_connector_module_path="ridgefill.engines.vllm"))  # fmt: skip

    def run(job, ids, **sp):
        extra = {"kv_transfer_params": {"ridgefill_cache": job["cache"]}} if job.get("cache") else None
        params = SamplingParams(temperature=0.0, detokenize=False, extra_args=extra, **sp)
        return llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]

    results = []
    for job in spec["jobs"]:
        start = time.perf_counter()
        run(job, job["ids"], max_tokens=1)
        seconds = time.perf_counter() - start
        if job.get("measure_only"):
            results.append({"name": job["name"], "seconds": seconds})
            continue
        greedy = list(run(job, job["ids"], max_tokens=job.get("max_new", 16)).outputs[0].token_ids)
        forced = list(job.get("forced", []))
        o = run(job, job["ids"] + forced, max_tokens=1, logprobs=2, prompt_logprobs=2 if forced else None)
        tops = [_top2(o.prompt_logprobs[len(job["ids"]) + i]) for i in range(len(forced))]
        tops.append(_top2(o.outputs[0].logprobs[0]))
        results.append({"name": job["name"], "greedy": greedy, "forced_top1": [t for t, _ in tops],
                        "forced_margin": [m for _, m in tops], "seconds": seconds})  # fmt: skip
    write_results(out_path, results)


if __name__ == "__main__":
    main()
