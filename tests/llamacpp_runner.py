"""Run engine jobs (tests/engine_jobs.py) in llama.cpp through llama-cpp-python; in its environment:

    python tests/llamacpp_runner.py JOBS.json RESULTS.json

The GGUF (`model` in the job file, F32 or F16) runs with F32 keys and values, one sequence. Per job: the cache is
injected (`llamacpp.inject`) and the remaining prompt positions evaluated, timed to the first token; greedy
tokens from there; then, after a fresh injection, prompt + forced continuation in one evaluation, whose logits
give llama.cpp's top-2 at every forced position. `flash_attn` in the job file (default false) picks llama.cpp's
attention path, and with it whether values are stored transposed.
"""

from __future__ import annotations

import time

import numpy as np

from engine_jobs import main_args, read_jobs, write_results
from ridgefill.engines.llamacpp import clear, inject, probe


def _top2(row: np.ndarray) -> tuple[int, float]:
    lp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    a, b = np.argsort(lp)[-2:][::-1]
    return int(a), float(lp[a] - lp[b])


def main() -> None:
    jobs_path, out_path = main_args()
    spec = read_jobs(jobs_path)
    from llama_cpp import Llama

    longest = max(len(j["ids"]) + len(j.get("forced", [])) + j.get("max_new", 1) for j in spec["jobs"])
    llm = Llama(model_path=spec["model"], n_ctx=longest + 16, n_batch=2048, n_ubatch=512, logits_all=True,
                type_k=0, type_v=0, flash_attn=bool(spec.get("flash_attn", False)), seed=0, verbose=False)  # fmt: skip
    layout = probe(llm)

    def start(job) -> int:
        """The cache injected (or the context cleared); how many prompt positions are already there."""
        if job.get("cache"):
            return inject(llm, job["cache"], job["ids"], layout)
        clear(llm)
        return 0

    results = []
    for job in spec["jobs"]:
        ids = list(job["ids"])
        t0 = time.perf_counter()
        p = start(job)
        llm.eval(ids[p:])
        seconds = time.perf_counter() - t0
        if job.get("measure_only"):
            results.append({"name": job["name"], "seconds": seconds})
            continue
        greedy = []
        while len(greedy) < job.get("max_new", 16):
            greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            if len(greedy) < job.get("max_new", 16):
                llm.eval([greedy[-1]])
        forced = list(job.get("forced", []))
        p = start(job)
        llm.eval(ids[p:] + forced)
        tops = [_top2(np.asarray(llm.scores[len(ids) - 1 + i], np.float64)) for i in range(len(forced) + 1)]
        results.append({"name": job["name"], "greedy": greedy, "forced_top1": [t for t, _ in tops],
                        "forced_margin": [m for _, m in tops], "seconds": seconds})  # fmt: skip
    write_results(out_path, results)


if __name__ == "__main__":
    main()
