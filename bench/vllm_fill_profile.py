"""One filling step of the vLLM fill, profiled on vLLM's CPU backend (figure "vllm_fill_profile"): what the step
dispatches and how often it waits for the device, for the fill's code now and an earlier commit's, in one run.

    .venv/bin/python bench/vllm_fill_profile.py [RELEASE_DIR] [--length 2048] [--repeat 3] [--before REF]
        [--out FILE]

Needs the vLLM environment (scripts/setup-engines.sh vllm) and a SmolLM2 release (default release/smollm2-135m).
Codes: the working tree's `ridgefill` and REF's (default HEAD~1, taken with `git archive`, put first on the
engine's PYTHONPATH). For each code and mode (eager: --enforce-eager; compiled: vLLM's default compilation, its
compile cache off so every kernel is compiled with profiling on) one offline engine in one process serves a
warm-up prompt, then --repeat new prose prompts of --length tokens, each prefilled in one step (a budget of
--length tokens, one token asked); a stock engine (no release, vLLM's plugin loading off) serves the same prompts.
Each step's model forward runs under torch.profiler (TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1: a compiled
graph's fused kernels are profiled too).

Per step (medians over the prompts):
- launches: the ops the forward dispatches, each counted once with what it calls: an op called from Python (an
  aten or vLLM op: on a GPU one kernel or a few) and, inside a compiled graph, each of its kernels and each op it
  calls out to (GEMMs, attention, collectives);
- launches per late layer: what the fill's forward launches beyond its early layers, over the L - S late layers
  (each late layer's filled keys and values, its cache write and its exact rows' pass, and the few ops of the
  row mask); the early layers' launches are their compiled graph's where they are compiled (the first graph the
  fill's forward calls), else the stock step's share (S / L of its launches); the stock step's launches per layer
  beside it;
- host syncs (eager only: a Python mode counting over the fill's forward): every call that waits for the device
  on a GPU (Tensor.cpu, .item, .tolist, nonzero, isin, unique, masked_select, bool/int/float of a tensor), with
  where each is made;
- step seconds: the profiled forward's wall time (profiler overhead included, alike for all).

Value: launches per late layer, now and before, compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Bench, Parser, engine_model, positive, release  # noqa: E402

MODEL = "builtin:smollm2-135m"
VLLM = REPO / ".engines" / "vllm"
# The calls that wait for the device on CUDA (.numpy() needs a host tensor): a copy to the host, a value read,
# nonzero (its count), and isin / unique / masked_select (a result whose size the host reads; isin sorts, with a
# unique, once a step has more than a few tokens).
SYNCS = ("cpu", "item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "isin", "unique", "masked_select")


def arguments():
    ap = Parser(__doc__)
    ap.add_argument("release", type=release, nargs="?", default=REPO / "release" / "smollm2-135m")
    ap.add_argument("--length", type=positive, default=2048)
    ap.add_argument("--repeat", type=positive, default=3)
    ap.add_argument("--before", default="HEAD~1", help="the commit whose fill is profiled beside the working tree's")
    ap.add_argument("--store", type=Path, default=None, help="ridgefill store (default: a fresh temporary one)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


# ------------------------------------------------------------------------------------------------ in the engine


def is_op(name: str) -> bool:
    return not name.startswith("#") and ("::" in name or name.startswith(("cpp_fused", "triton_")))


def launches(event) -> int:
    """The ops under a profiler event, each counted once with what it calls (an op's own children are its parts)."""
    if is_op(event.name):
        return 1
    return sum(launches(c) for c in event.cpu_children)


def worker(spec_path: Path) -> None:
    """In the vLLM environment: one engine, its profiled steps, written to spec["out"]."""
    import torch
    from torch.overrides import TorchFunctionMode
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.llama import LlamaForCausalLM

    spec = json.loads(spec_path.read_text())
    fill_on = bool(os.environ.get("RIDGEFILL_RELEASE"))
    syncs: list = []  # (call, the file and function that made it)

    class CountSyncs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in SYNCS:
                caller = sys._getframe(1).f_code
                syncs.append(f"{func.__name__} in {Path(caller.co_filename).name}:{caller.co_name}")
            return func(*args, **(kwargs or {}))

    def labelled(forward, label, count_syncs):
        def wrapped(self, *args, **kwargs):
            with torch.profiler.record_function(label):
                if count_syncs:
                    with CountSyncs():
                        return forward(self, *args, **kwargs)
                return forward(self, *args, **kwargs)

        return wrapped

    eager = spec["mode"] == "eager"
    if fill_on:
        from ridgefill.engines.vllm import model as fill_model

        fill_model.FillMixin.forward = labelled(fill_model.FillMixin.forward, "step_forward", False)
        fill_model.EngineFill.forward = labelled(fill_model.EngineFill.forward, "fill_forward", eager)
    else:
        LlamaForCausalLM.forward = labelled(LlamaForCausalLM.forward, "step_forward", False)

    n = spec["length"]
    llm = LLM(spec["model"], dtype="float32", skip_tokenizer_init=True, seed=0, enforce_eager=eager,
              max_model_len=n + 16, max_num_batched_tokens=n, enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    prompts = spec["prompts"]
    llm.generate([{"prompt_token_ids": prompts[0]}], [params], use_tqdm=False)  # warm-up
    steps = []
    for ids in prompts[1:]:
        syncs.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)
        events = prof.profiler.function_events
        forwards = [e for e in events if e.name == "step_forward"]
        outer = [e for e in forwards if not any(a.name == "step_forward" for a in ancestors(e))]
        prefill = max(outer, key=lambda e: e.time_range.elapsed_us())  # the prompt's step (not a sampler run)
        counted = eager and fill_on
        fill = next((e for e in subtree(prefill) if e.name == "fill_forward"), None)
        graphs = [e for e in subtree(fill) if e.name.startswith("## Call CompiledFxGraph")] if fill else []
        early = min(graphs, key=lambda e: e.time_range.start) if graphs else None  # the first: the early layers
        steps.append({"launches": launches_in(prefill), "fill_launches": launches_in(fill) if fill else None,
                      "early_launches": launches(early) if early else None,
                      "syncs": len(syncs) if counted else None,
                      "sync_sites": sorted(set(syncs)) if counted else None,
                      "seconds": prefill.time_range.elapsed_us() / 1e6})  # fmt: skip
    stats = None
    if fill_on:
        from ridgefill.engines.vllm.model import fill_stats

        stats = llm.apply_model(fill_stats)[0]
    Path(spec["out"]).write_text(json.dumps({"steps": steps, "stats": stats}))


def ancestors(event):
    while event.cpu_parent is not None:
        event = event.cpu_parent
        yield event


def launches_in(event) -> int:
    return sum(launches(c) for c in event.cpu_children)


def subtree(event):
    for c in event.cpu_children:
        yield c
        yield from subtree(c)


# ------------------------------------------------------------------------------------------------ the bench


def run_engine(bench, name: str, code: Path | None, release_dir: Path | None, mode: str, folder: Path,
               prompts: list, length: int) -> dict:  # fmt: skip
    spec = bench.scratch / f"{name}.json"
    out = bench.scratch / f"{name}-out.json"
    spec.write_text(json.dumps({"model": str(folder), "prompts": prompts, "length": length, "mode": mode,
                                "out": str(out)}))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RIDGEFILL_RELEASE", "PYTHONPATH")}
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_DISABLE_COMPILE_CACHE": "1",
            "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2")}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    if release_dir is not None:
        env["RIDGEFILL_RELEASE"] = str(release_dir)
    else:
        env["VLLM_PLUGINS"] = ""
    log = bench.scratch / f"{name}.log"
    with open(log, "w") as f:
        r = subprocess.run([VLLM / "bin" / "python", __file__, "--worker", spec], stdout=f, stderr=subprocess.STDOUT,
                           env=env, cwd=REPO)  # fmt: skip
    if r.returncode:
        raise SystemExit(f"vllm_fill_profile: the {name} engine failed; its log: {log}\n" + log.read_text()[-3000:])
    got = json.loads(out.read_text())
    steps = got["steps"]
    syncs = [s["syncs"] for s in steps if s["syncs"] is not None]
    def med(key):
        got = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(got) if got else None

    return {"launches": med("launches"), "fill_launches": med("fill_launches"), "early_launches": med("early_launches"),
            "syncs": statistics.median(syncs) if syncs else None,
            "seconds": round(statistics.median(s["seconds"] for s in steps), 4), "runs": steps, "stats": got["stats"]}


def main() -> None:
    args = arguments()
    if args.worker is not None:
        return worker(args.worker)
    if not (VLLM / ".done").is_file():
        raise SystemExit("vllm_fill_profile: the vLLM environment is not built: run scripts/setup-engines.sh vllm")
    with Bench("vllm_fill_profile", args, MODEL) as bench:
        from ridgefill.engines.vllm.served import load as load_release
        from ridgefill.evaluate.texts import prose_prompts

        from transformers import AutoTokenizer

        rel = load_release(args.release)
        L, S = rel.model["num_layers"], rel.split
        before = bench.scratch / "before"
        before.mkdir()
        commit = subprocess.run(["git", "rev-parse", args.before], capture_output=True, text=True, cwd=REPO)
        if commit.returncode:
            raise SystemExit(f"vllm_fill_profile: --before {args.before}: not a commit")
        subprocess.run(f"git archive {commit.stdout.strip()} ridgefill | tar -x -C {before}", shell=True, check=True,
                       cwd=REPO)  # fmt: skip
        folder = engine_model(bench, MODEL)
        tok = AutoTokenizer.from_pretrained(folder)
        prompts = prose_prompts(tok, args.length, args.repeat + 1)
        got = {}
        for mode in ("eager", "compiled"):
            got[f"stock_{mode}"] = run_engine(bench, f"stock_{mode}", None, None, mode, folder, prompts, args.length)
            for side, code in (("before", before), ("now", None)):
                got[f"{side}_{mode}"] = run_engine(bench, f"{side}_{mode}", code, args.release, mode, folder, prompts,
                                                   args.length)  # fmt: skip
        table = {}
        for mode in ("eager", "compiled"):
            stock = got[f"stock_{mode}"]["launches"]
            for side in ("before", "now"):
                run = got[f"{side}_{mode}"]
                fill = run["launches"]
                # the early layers' launches: their compiled graph's, else the stock step's share of them
                early = run["early_launches"] if run["early_launches"] is not None else stock * S / L
                table[f"{side}_{mode}"] = {
                    "launches_per_late_layer": round((run["fill_launches"] - early) / (L - S), 1),
                    "launches_per_early_layer": round(early / S, 1),
                    "stock_launches_per_layer": round(stock / L, 1), "step_launches": fill,
                    "stock_step_launches": stock,
                    "host_syncs": got[f"{side}_{mode}"]["syncs"], "step_s": got[f"{side}_{mode}"]["seconds"],
                    "stock_step_s": got[f"stock_{mode}"]["seconds"]}  # fmt: skip
        value = {k: v["launches_per_late_layer"] for k, v in table.items()}
        bench.finish(value, details={"table": table, "before": commit.stdout.strip(), "release": str(args.release),
                                     "layers": L, "split": S, "tail": rel.tail, "length": args.length,
                                     "repeat": args.repeat, "engines": got})  # fmt: skip


if __name__ == "__main__":
    main()
