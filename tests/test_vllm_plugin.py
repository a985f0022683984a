"""The fill inside stock vLLM, switched on by RIDGEFILL_RELEASE (ridgefill.engines.vllm.plugin), against ridgefill's
reference runtime: SmolLM2 with the main job's release, and tiny random Qwen2 and Qwen3 models with releases of
their own, all in float32.

These need the vLLM environment with the plugin installed (`scripts/setup-engines.sh vllm`) and the main job's
release (`scripts/main.sh`); `scripts/test-engines.sh` builds both and runs this file. Without them every test here
is skipped, saying which is missing.

Every prompt is compared with `runtime.prefill(lm, ids, "ridgefill", **rel.options())` of the whole prompt: the
engine's first token must be the reference's, its top-2 margin within MARGIN_TOL of the reference's, and its greedy
answer (NEW tokens) the reference's, except where the two part at a near-tie (the reference's own margin below
NEAR_TIE there). Engine settings, one engine each, PROMPTS prose prompts of N tokens (the release's tail of 512 is
exact): the whole prompt in one step, one prompt at a time; chunked prefill with budgets of 256 and 512 tokens;
4 requests at once with a 1,024-token budget (chunks of several prompts and decodes of others in the same steps);
prefix caching on, every prompt sent twice and then extended by EXTEND tokens; a KV space so small that requests
are preempted and recomputed; requests asking for prompt log-probabilities beside filled ones (those are served
exactly: the reference is the exact model). The switch off must equal vLLM without the plugin bit for bit, and
`vllm serve` with the switch on must answer as the offline engine does; a bad RIDGEFILL_RELEASE stops it with one
line. Figures go to $RIDGEFILL_ENGINE_REPORT_DIR/engines_vllm_plugin.json when that is set.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from engine_refs import reference_path

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".engines" / "vllm"
RELEASE = Path(os.environ.get("RIDGEFILL_ENGINE_RELEASE", ROOT / "release" / "smollm2-135m"))
PROMPTS, N, NEW, EXTEND, BLOCK = 20, 1536, 16, 256, 128
NEAR_TIE = 0.05  # nats: the reference's own top-2 margin below which parting ways is a near-tie
MARGIN_TOL = 1e-3  # nats: the engine's first-token margin against the reference's (float32 on both sides)
RUNNER = "ridgefill.engines.vllm.plugin_runner"

pytestmark = [pytest.mark.engines, pytest.mark.slow]


def vllm_python() -> Path:
    if not (VLLM / ".done").is_file():
        pytest.skip("the vllm environment is not built (.engines/vllm): run scripts/setup-engines.sh vllm")
    return VLLM / "bin" / "python"


def engine_env(release: Path | None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RIDGEFILL_RELEASE"}
    if release is not None:
        env["RIDGEFILL_RELEASE"] = str(release)
    return env | {"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2")} | extra


def run_engine(work: Path, name: str, model: Path, prompts: dict, runs: list, env: dict) -> dict:
    spec, out = work / f"jobs-{name}.json", work / f"results-{name}.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "runs": runs}))
    r = subprocess.run([vllm_python(), "-m", RUNNER, spec, out], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())["runs"]


def reference(lm, ids, arm: str, **options) -> dict:
    """The reference's greedy answer and margins after a prefill of the whole prompt, and its exact prefix rows."""
    import torch

    from ridgefill.runtime import prefill

    res = prefill(lm, torch.tensor(ids), arm, **options)
    answer, margins = reference_path(lm, res.logits[-1], res.cache, len(ids), NEW)
    return {"top1": answer, "margin": margins, "exact_rows": len(res.exact_rows)}


def agreement(outputs: list, refs: dict) -> dict:
    """Each output against the reference of its prompt: first token, first margin, greedy answer."""
    firsts = ties = misses = greedy = 0
    worst = 0.0
    for out in outputs:
        ref = refs[out["prompt"]]
        (t1, l1), (_, l2) = out["top2"][0]
        if t1 == ref["top1"][0]:
            firsts += 1
            worst = max(worst, abs((l1 - l2) - ref["margin"][0]))
        tokens, want = out["tokens"], ref["top1"][:NEW]
        if tokens == want:
            greedy += 1
            continue
        part = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
        if ref["margin"][part] < NEAR_TIE:
            ties += 1
        else:
            misses += 1
    return {"prompts": len(outputs), "first_token_equal": firsts, "first_margin_max_diff": worst,
            "greedy_equal": greedy, "near_ties": ties, "misses": misses}  # fmt: skip


def check(fig: dict, count: int = PROMPTS) -> None:
    assert fig["prompts"] >= count and fig["misses"] == 0, fig
    assert fig["first_token_equal"] == fig["prompts"] and fig["first_margin_max_diff"] < MARGIN_TOL, fig


def report(key: str, figures) -> None:
    out = os.environ.get("RIDGEFILL_ENGINE_REPORT_DIR")
    if out:
        path = Path(out) / "engines_vllm_plugin.json"
        got = json.loads(path.read_text()) if path.is_file() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got | {key: figures}, indent=1))


def engine_model(model: str, out: Path) -> Path:
    """`ridgefill engine model`: the folder vLLM serves."""
    from clirun import cli

    if not (out / "config.json").is_file():
        r = cli("engine", "model", model, "--out", out)
        assert r.returncode == 0, r.stderr
    return out


# ------------------------------------------------------------------------------------------------ SmolLM2

SETTINGS = {"max_model_len": 2048, "block_size": BLOCK}
ALONE = SETTINGS | {"max_num_batched_tokens": 2048, "max_num_seqs": 1, "enable_prefix_caching": False}
CHUNKED = SETTINGS | {"max_num_seqs": 1, "enable_prefix_caching": False, "enable_chunked_prefill": True}
BATCHED = SETTINGS | {"max_num_batched_tokens": 1024, "max_num_seqs": 4, "enable_prefix_caching": False}
PREFIX = SETTINGS | {"max_num_batched_tokens": 2048, "enable_prefix_caching": True}
# Room for two prompts' blocks and a little more: running requests must give way (preempted, recomputed later).
TINY_KV = SETTINGS | {"max_num_batched_tokens": 2048, "max_num_seqs": 8, "enable_prefix_caching": False,
                      "num_gpu_blocks_override": 2 * N // BLOCK + 2}  # fmt: skip


@pytest.fixture(scope="module")
def smol_model(tmp_path_factory):
    """The engine model folder, the model and release in ridgefill, and the prompts."""
    python = vllm_python()
    if not (RELEASE / "ridgefill.json").is_file():
        pytest.skip(f"no release at {RELEASE}: run scripts/main.sh (or set RIDGEFILL_ENGINE_RELEASE)")
    from ridgefill.evaluate.texts import prose_prompts
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps

    work = tmp_path_factory.mktemp("vllm-plugin")
    store = ROOT / "ridgefill-artifacts"
    model = engine_model("builtin:smollm2-135m", work / "smollm2")
    lm = load_model(resolve_model("builtin:smollm2-135m", store_root=store), store_root=store)
    rel = load_release_maps(lm, RELEASE)
    long = prose_prompts(lm.tokenizer, N + EXTEND, PROMPTS)
    prompts = {f"p{i}": ids[:N] for i, ids in enumerate(long)}
    prompts |= {f"e{i}": ids for i, ids in enumerate(long[:5])}  # p0..p4 extended by EXTEND tokens
    return {"python": python, "work": work, "model": model, "prompts": prompts, "lm": lm, "rel": rel}


@pytest.fixture(scope="module")
def smol(smol_model):
    """The references, and every engine run."""
    lm, rel, prompts, work, model = (smol_model[k] for k in ("lm", "rel", "prompts", "work", "model"))
    refs = {name: reference(lm, ids, rel.arm, **rel.options()) for name, ids in prompts.items()}
    refs |= {f"x{i}": reference(lm, prompts[f"p{i}"], "exact", split=0, tail=N) for i in (1, 3)}
    names = [f"p{i}" for i in range(PROMPTS)]
    runs = [{"name": "alone", "engine": ALONE, "prompts": names, "max_new": NEW},
            {"name": "chunked256", "engine": CHUNKED | {"max_num_batched_tokens": 256}, "prompts": names},
            {"name": "chunked512", "engine": CHUNKED | {"max_num_batched_tokens": 512}, "prompts": names},
            {"name": "batched", "engine": BATCHED, "prompts": names, "submit": "together"},
            {"name": "prefix", "engine": PREFIX, "prompts": names + names + [f"e{i}" for i in range(5)]},
            {"name": "preempted", "engine": TINY_KV, "prompts": names, "submit": "together"},
            {"name": "logprobs", "engine": BATCHED, "prompts": ["p0", "p1", "p2", "p3"], "submit": "together",
             "prompt_logprobs": ["p1", "p3"]}]  # fmt: skip
    for run in runs:
        run.setdefault("max_new", NEW)
    fill = run_engine(work, "fill", model, prompts, runs, engine_env(RELEASE))
    off_runs = [runs[3] | {"name": "off"}]
    off = run_engine(work, "off", model, prompts, off_runs, engine_env(None))
    stock = run_engine(work, "stock", model, prompts, off_runs, engine_env(None, VLLM_PLUGINS=""))
    return smol_model | {"refs": refs, "fill": fill, "off": off["off"], "stock": stock["off"]}


def filled_rows(smol, names) -> int:
    """How many rows the reference fills for these prompts: each prompt's prefix rows minus its exact ones."""
    T = smol["rel"].tail
    return sum(len(smol["prompts"][n]) - T - smol["refs"][n]["exact_rows"] for n in names)


@pytest.mark.parametrize("run", ["alone", "chunked256", "chunked512", "batched"])
def test_the_fill_in_vllm_equals_the_reference_prefill(smol, run):
    got = smol["fill"][run]
    fig = agreement(got["outputs"], smol["refs"]) | {"engine": got["stats"], "seconds": got["seconds"]}
    report(run, fig)
    check(fig)
    assert got["stats"]["filled_rows"] == filled_rows(smol, [o["prompt"] for o in got["outputs"]]), fig


def test_prefix_caching_reuses_only_blocks_the_plan_would_write(smol):
    """A prompt sent again reuses its whole blocks; a prompt extended by EXTEND tokens reuses only the blocks below
    the first prompt's tail (whose rows were filled for both), and computes the rest under its own plan."""
    got = smol["fill"]["prefix"]
    outs = got["outputs"]
    fig = agreement(outs, smol["refs"]) | {"engine": got["stats"], "cached": [o["cached"] for o in outs]}
    report("prefix", fig)
    check(fig, 2 * PROMPTS + 5)
    T = smol["rel"].tail
    first, again, extended = outs[:PROMPTS], outs[PROMPTS : 2 * PROMPTS], outs[2 * PROMPTS :]
    assert all(o["cached"] == 0 for o in first), fig
    assert all(o["cached"] == (N - 1) // BLOCK * BLOCK for o in again), fig  # every whole block but the last
    assert all(o["cached"] == (N - T) // BLOCK * BLOCK for o in extended), fig  # blocks wholly below N - T


def test_preempted_requests_are_recomputed_under_the_same_plan(smol):
    got = smol["fill"]["preempted"]
    fig = agreement(got["outputs"], smol["refs"]) | {"engine": got["stats"], "preemptions": got["preemptions"]}
    report("preempted", fig)
    assert got["preemptions"] > 0, fig
    check(fig)


def test_requests_asking_for_prompt_logprobs_are_served_exactly(smol):
    """Prompt log-probabilities need every row's logits: such a request is served exactly (its reference is the
    exact model), beside filled requests in the same steps."""
    outs = smol["fill"]["logprobs"]["outputs"]
    refs = dict(smol["refs"]) | {"p1": smol["refs"]["x1"], "p3": smol["refs"]["x3"]}
    fig = agreement(outs, refs)
    report("prompt_logprobs", fig)
    check(fig, 4)
    fill_ref = smol["refs"]["p1"]["margin"][0]
    (_, l1), (_, l2) = outs[1]["top2"][0]
    assert abs((l1 - l2) - fill_ref) > MARGIN_TOL  # not the filled answer


def test_the_switch_off_is_vllm_without_the_plugin_bit_for_bit(smol):
    off, stock = smol["off"], smol["stock"]
    assert off["stats"] is None and stock["stats"] is None
    assert off["outputs"] == stock["outputs"]
    fig = agreement(off["outputs"], smol["refs"])  # and the stock engine is not the fill
    assert fig["first_margin_max_diff"] > MARGIN_TOL or fig["first_token_equal"] < PROMPTS, fig


KV_PROMPTS = 4  # a few prompts: the key/value release's runs add little to the engine suite's time


@pytest.fixture(scope="module")
def smol_kv(smol_model):
    """The main job's capture (its cached artifact, as scripts/main.sh makes it) solved with key/value maps at the
    same split (cached in the store too), quantized and exported; its references and engine runs on KV_PROMPTS of
    the prompts, chunked and batched."""
    from clirun import cli

    from ridgefill.runtime import load_release_maps

    store, work, lm = ROOT / "ridgefill-artifacts", smol_model["work"], smol_model["lm"]
    ids = []
    for args in (["capture", "builtin:smollm2-135m", "--data", "builtin:default"],
                 ["solve", "--split", str(smol_model["rel"].split), "--maps", "kv"], ["quantize"]):  # fmt: skip
        r = cli(*args[:1], *ids[-1:], *args[1:], "--store", store, "-q", cwd=ROOT)
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.strip())
    release = work / "release-kv"
    r = cli("export", ids[-1], "--out", release, "--force", "--store", store, "-q", cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rel = load_release_maps(lm, release)
    assert set(rel.map_kinds.values()) == {"kv"}, rel.map_kinds
    names = [f"p{i}" for i in range(KV_PROMPTS)]
    prompts = {n: smol_model["prompts"][n] for n in names}
    refs = {n: reference(lm, p, rel.arm, **rel.options()) for n, p in prompts.items()}
    runs = [{"name": "chunked256", "engine": CHUNKED | {"max_num_batched_tokens": 256}, "prompts": names},
            {"name": "batched", "engine": BATCHED, "prompts": names, "submit": "together"}]  # fmt: skip
    for run in runs:
        run["max_new"] = NEW
    got = run_engine(work, "fill-kv", smol_model["model"], prompts, runs, engine_env(release))
    return {"rel": rel, "prompts": prompts, "refs": refs, "fill": got}


@pytest.mark.parametrize("run", ["chunked256", "batched"])
def test_a_key_value_release_in_vllm_equals_the_reference_prefill(smol_kv, run):
    """SmolLM2 with key/value maps (keys before RoPE, then values, of its 3 KV heads: [384, 576] per late layer)."""
    got = smol_kv["fill"][run]
    fig = agreement(got["outputs"], smol_kv["refs"]) | {"engine": got["stats"], "seconds": got["seconds"]}
    report(f"kv_{run}", fig)
    check(fig, KV_PROMPTS)
    T, refs = smol_kv["rel"].tail, smol_kv["refs"]
    assert got["stats"]["filled_rows"] == sum(len(p) - T - refs[n]["exact_rows"] for n, p in smol_kv["prompts"].items())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(smol, release, *extra):
    port = free_port()
    cmd = [smol["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(smol["model"]), "--port",
           str(port), "--dtype", "float32", "--max-model-len", "2048", "--seed", "0", *extra]  # fmt: skip
    log = open(smol["work"] / f"serve-{port}.log", "w")
    # vLLM's CPU backend sizes its KV cache from the memory free at startup unless told (VLLM_CPU_KVCACHE_SPACE)
    env = engine_env(release, VLLM_CPU_KVCACHE_SPACE="2")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return proc, port, log


def test_vllm_serve_with_the_switch_on_answers_as_the_offline_engine(smol_model):
    smol = smol_model
    names = ["p0", "p1", "p2"]
    offline = run_engine(smol["work"], "offline", smol["model"], smol["prompts"],
                         [{"name": "alone", "engine": ALONE, "prompts": names, "max_new": NEW}], engine_env(RELEASE))
    proc, port, log = serve(smol, RELEASE)
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, (smol["work"] / f"serve-{port}.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, "the server did not start"
                time.sleep(2)
        alone = {o["prompt"]: o for o in offline["alone"]["outputs"]}
        for name in names:
            body = json.dumps({"model": str(smol["model"]), "prompt": smol["prompts"][name], "max_tokens": NEW,
                               "temperature": 0, "return_token_ids": True}).encode()  # fmt: skip
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
            choice = json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]
            assert choice["token_ids"] == alone[name]["tokens"], (name, choice)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    text = (smol["work"] / f"serve-{port}.log").read_text()
    on = [line for line in text.splitlines() if "ridgefill: release" in line]
    assert len(on) == 1 and f"split {smol['rel'].split} of 30" in on[0], on


@pytest.mark.parametrize("setting, says", [
    ("/nonexistent/release", "RIDGEFILL_RELEASE=/nonexistent/release: no such folder"),
    ("acme/no-such-release", "no such folder"),  # without hf:// a folder, never a Hub repo id
    ("   ", "RIDGEFILL_RELEASE is set to blanks"),
])  # fmt: skip
def test_a_bad_release_stops_vllm_serve_with_one_line(smol_model, setting, says):
    proc, port, log = serve(smol_model, setting)
    proc.wait(600)
    log.close()
    text = (smol_model["work"] / f"serve-{port}.log").read_text()
    assert proc.returncode != 0
    last = text.strip().splitlines()[-1]
    assert last.startswith("ridgefill: ") and says in last and "Traceback" not in text, text[-2000:]


# ------------------------------------------------------------------------------------------------ tiny Qwen2, Qwen3

TINY_TAIL = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random models (4 layers, d = 128, 2 KV heads of 32: vLLM's CPU kernels) and releases of their own (split
    2, int8, tail TINY_TAIL), made once and shared by the tests below: `tiny(arch, configuration, maps)` -> the model
    folder, the loaded model, the release (folder, and as the runtime reads it), PROMPTS random-token prompts and
    their references. One capture per architecture, from which both kinds of map are solved."""
    from clirun import cli
    from conftest import CAT_TEXTS
    from tiny import make_tiny_model

    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps

    captures, made = {}, {}

    def make(arch: str, configuration: str, maps: str) -> dict:
        vllm_python()
        if arch not in captures:
            work = tmp_path_factory.mktemp(f"tiny-{arch}")
            model = make_tiny_model(work / "model", arch=arch, layers=4, hidden=128)
            data, store = work / "data", work / "store"
            data.mkdir()
            for i, text in enumerate(CAT_TEXTS):
                (data / f"d{i}.txt").write_text(text)
            r = cli("capture", model, "--data", data, "--split", "2", "--chunk", "64", "--store", store)
            assert r.returncode == 0, r.stderr
            lm = load_model(resolve_model(str(model), store_root=store), store_root=store)
            captures[arch] = {"work": work, "model": model, "store": store, "capture": r.stdout.strip(), "lm": lm}
        key = (arch, configuration, maps)
        if key not in made:
            c = captures[arch]
            r = cli("solve", c["capture"], "--maps", maps, "--store", c["store"])
            assert r.returncode == 0, r.stderr
            r = cli("quantize", r.stdout.strip(), "--store", c["store"])
            assert r.returncode == 0, r.stderr
            release = c["work"] / f"release-{configuration}-{maps}"
            r = cli("export", r.stdout.strip(), "--out", release, "--tail", TINY_TAIL, "--configuration",
                    configuration, "--store", c["store"])  # fmt: skip
            assert r.returncode == 0, r.stderr
            rel = load_release_maps(c["lm"], release)
            assert set(rel.map_kinds.values()) == {maps}, rel.map_kinds
            rng = np.random.default_rng(0)
            prompts = {f"p{i}": rng.integers(6, 320, int(rng.integers(100, 220))).tolist() for i in range(PROMPTS)}
            refs = {name: reference(c["lm"], p, rel.arm, **rel.options()) for name, p in prompts.items()}
            made[key] = {"model": c["model"], "rel": rel, "release": release, "prompts": prompts, "refs": refs}
        return made[key]

    return make


def tiny_filled_rows(prompts: dict, refs: dict) -> int:
    return sum(len(p) - TINY_TAIL - refs[n]["exact_rows"] for n, p in prompts.items())


@pytest.mark.parametrize("arch, configuration, maps", [
    ("qwen2", "ridgefill", "input"), ("qwen2", "ridgefill", "kv"),
    ("qwen3", "ridgefill+protected", "input"), ("qwen3", "ridgefill+protected", "kv"),
])  # fmt: skip
def test_the_fill_in_vllm_on_qwen2_and_qwen3(tiny, arch, configuration, maps, tmp_path):
    """Tiny random models (qkv bias in Qwen2, q/k norms in Qwen3), each with releases of its own (int8, tail 16) of
    input maps and of key/value maps: the same hook, chunked and batched, against the reference runtime. Qwen3's
    releases are `ridgefill+protected`: rows holding a protected token run exactly in the middle of the prefix, so a
    prompt's exact rows form many sequences of their own. A key/value map's output goes through Qwen3's key norm
    and the rotary embedding; Qwen2's has the qkv bias folded into its own."""
    t = tiny(arch, configuration, maps)
    prompts, refs, names = t["prompts"], t["refs"], list(t["prompts"])
    small = {"max_model_len": 256, "enable_prefix_caching": False}
    runs = [{"name": "chunked", "engine": small | {"max_num_batched_tokens": 64, "max_num_seqs": 1}, "prompts": names,
             "max_new": NEW},
            {"name": "batched", "engine": small | {"max_num_batched_tokens": 128, "max_num_seqs": 4}, "prompts": names,
             "submit": "together", "max_new": NEW}]  # fmt: skip
    got = run_engine(tmp_path, arch, t["model"], prompts, runs, engine_env(t["release"]))
    for run in ("chunked", "batched"):
        fig = agreement(got[run]["outputs"], refs) | {"engine": got[run]["stats"]}
        report(f"{arch}_{run}" if maps == "input" else f"{arch}_{maps}_{run}", fig)
        check(fig)
        assert got[run]["stats"]["filled_rows"] == tiny_filled_rows(prompts, refs), fig
        if configuration == "ridgefill+protected":
            assert got[run]["stats"]["exact_prefix_rows"] > PROMPTS, fig  # protected rows amid the prefix


def test_key_value_maps_on_two_tensor_parallel_ranks(tiny, tmp_path):
    """The tiny Qwen2's key/value release on two tensor-parallel ranks on the CPU (2 KV heads: one per rank, each
    rank's map cut to its own head's key and value rows): the answers equal one rank's and the reference's, and the
    fill (rank 0's counters) fills the reference's rows."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel ranks need two CPUs")
    t = tiny("qwen2", "ridgefill", "kv")
    names = [f"p{i}" for i in range(8)]
    prompts, refs = {n: t["prompts"][n] for n in names}, {n: t["refs"][n] for n in names}
    engine = {"max_model_len": 256, "enable_prefix_caching": False, "max_num_batched_tokens": 128, "max_num_seqs": 4}
    runs = [{"name": "one", "engine": engine, "prompts": names, "submit": "together", "max_new": NEW},
            {"name": "two", "engine": engine | {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
             "prompts": names, "submit": "together", "max_new": NEW}]  # fmt: skip
    # As the connector's two-rank test runs vLLM: its engine core in a process of its own, one core per rank; the
    # runner's reading of the fill's counters (`LLM.apply_model`, a function sent to the engine core) needs vLLM's
    # pickle fallback across processes.
    env = engine_env(t["release"], VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
                     VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # fmt: skip
    got = run_engine(tmp_path, "tp", t["model"], prompts, runs, env)
    for run in ("one", "two"):
        fig = agreement(got[run]["outputs"], refs) | {"engine": got[run]["stats"]}
        report(f"qwen2_kv_tp_{run}", fig)
        check(fig, len(names))
        assert got[run]["stats"]["filled_rows"] == tiny_filled_rows(prompts, refs), fig
    one = {o["prompt"]: o for o in got["one"]["outputs"]}
    for o in got["two"]["outputs"]:
        assert o["tokens"] == one[o["prompt"]]["tokens"], o["prompt"]
        assert abs(o["top2"][0][0][1] - one[o["prompt"]]["top2"][0][0][1]) < 1e-4, o["prompt"]
