"""The fill inside vLLM (figure "vllm_fill"): prefill time of a model that runs the RidgeFill fill in vLLM's own
forward (`ridgefill.engines.vllm_fill`, a prototype) against the same model stock, both served by one vLLM process.

    .venv/bin/python bench/vllm_fill_bench.py [RELEASE_DIR] [--length 2048] [--tail 512] [--repeat 3]
        [--prompts 4] [--out FILE]

Needs the vLLM environment (scripts/setup-engines.sh vllm) and a SmolLM2 release (default release/smollm2-135m).
Prompts are real text (the eval's long documents). Two engines in one process (float32, prefix caching off, a
whole prompt per step): the stock model folder and the fill model folder (`prepare.fill_model_dir`: same weights,
the release's maps, split and anchor, the given tail). Time to first token of each, interleaved, one warm-up round,
median of --repeat on the first prompt; speed-up = stock / fill, beside the compute ceiling
1 / ((S(N-T) + LT) / (LN)). Correctness on --prompts prompts: the fill engine's first token and its top-2 margin
against ridgefill's reference prefill (runtime.prefill, "ridgefill", same tail) and against the exact model; the
engine's own count of filled steps shows the fill ran.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Bench, load, vllm_arguments  # noqa: E402

MODEL = "builtin:smollm2-135m"


def main() -> None:
    args, py = vllm_arguments(__doc__, {"--prompts": 4})

    with Bench("vllm_fill", args, MODEL) as bench:
        import torch

        from ridgefill.engines.prepare import fill_model_dir
        from ridgefill.evaluate import texts
        from ridgefill.runtime import ceiling, load_release_maps, prefill

        _, lm = load(MODEL, bench.store)
        rel = load_release_maps(lm, args.release)
        opts = {**rel.options(), "tail": args.tail}
        docs = texts.long_documents(lm.tokenizer, args.length, limit=args.prompts)
        prompts = [[int(i) for i in d.ids[: args.length]] for d in docs]
        refs = []
        for ids in prompts:
            row = {}
            for arm, o in (("ridgefill", opts), ("exact", {"split": 0, "tail": args.tail})):
                logits = prefill(lm, torch.tensor(ids), arm, **o).logits[-1]
                lp = logits.double().log_softmax(-1)
                top = lp.topk(2)
                row[arm] = {"top1": int(top.indices[0]), "margin": float(top.values[0] - top.values[1])}
            refs.append(row)
        stock, fill = bench.scratch / "stock", bench.scratch / "fill"
        lm.model.save_pretrained(stock)
        fill_model_dir(lm, rel, fill, tail=args.tail)
        jobs = [{"name": f"check{i}", "model": "fill", "ids": ids, "cache": None, "max_new": 1}
                for i, ids in enumerate(prompts)]  # fmt: skip
        for rep in range(args.repeat + 1):  # round 0 warms up
            for key in ("stock", "fill"):
                jobs.append({"name": f"{key}{rep}", "model": key, "ids": prompts[0], "cache": None,
                             "measure_only": True})
        spec, out = bench.scratch / "jobs.json", bench.scratch / "results.json"
        spec.write_text(json.dumps({"models": {"stock": str(stock), "fill": str(fill)}, "fill_plugin": True,
                                    "jobs": jobs}))  # fmt: skip
        r = subprocess.run([py, "-m", "ridgefill.engines.vllm_runner", spec, out], capture_output=True, text=True,
                           cwd=REPO)  # fmt: skip
        if r.returncode:
            raise SystemExit(f"vllm_fill: the vLLM runner failed:\n{r.stderr[-3000:]}")
        got = json.loads(out.read_text())
        res = {x["name"]: x for x in got["results"]}
        times = {k: [res[f"{k}{rep}"]["seconds"] for rep in range(1, args.repeat + 1)] for k in ("stock", "fill")}
        med = {k: statistics.median(v) for k, v in times.items()}
        checks = []
        for i, ref in enumerate(refs):
            e = res[f"check{i}"]
            m = e["forced_margin"][0]
            checks.append({"engine_top1": e["forced_top1"][0], "engine_margin": round(m, 5),
                           "reference": ref["ridgefill"], "exact": ref["exact"],
                           "margin_diff_vs_reference": round(abs(m - ref["ridgefill"]["margin"]), 5),
                           "margin_diff_vs_exact": round(abs(m - ref["exact"]["margin"]), 5)})  # fmt: skip
        L = lm.adapter.num_layers
        value = {"speedup": round(med["stock"] / med["fill"], 3),
                 "ceiling": round(1 / ceiling(args.length, args.tail, rel.split, L), 3)}  # fmt: skip
        details = {"release": str(args.release), "split": rel.split, "layers": L, "length": args.length,
                   "tail": args.tail, "repeat": args.repeat, "median_s": {k: round(v, 3) for k, v in med.items()},
                   "runs_s": times, "checks": checks, "engine_stats": got.get("model_stats", {})}  # fmt: skip
        ok = {"top-1 equals the reference on every prompt": all(c["engine_top1"] == c["reference"]["top1"] for c in checks),
              "the fill ran": got.get("model_stats", {}).get("fill", {}).get("filled_steps", 0) > 0}  # fmt: skip
        print(json.dumps(checks, indent=1))
        bench.finish(value, details=details, checks=ok)


if __name__ == "__main__":
    main()
