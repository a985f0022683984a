"""The fill inside stock vLLM, switched on by RIDGEFILL_RELEASE (ridgefill.engines.vllm.plugin), against ridgefill's
reference runtime: SmolLM2 with the main job's release, in float32 (and once in bfloat16). The tiny random models'
tests are test_vllm_plugin_tiny.py and test_vllm_plugin_tp.py; what all three share is vllm_plugin_harness.py.

These need the vLLM environment with the plugin installed (`scripts/setup-engines.sh vllm`) and the main job's
release (`scripts/main.sh`); `scripts/test-engines.sh` builds both and runs this file. Without them every test here
is skipped, saying which is missing.

Every prompt is compared with `runtime.prefill(lm, ids, "ridgefill", **rel.options())` of the whole prompt: the
engine's first token must be the reference's, its top-2 margin within MARGIN_TOL of the reference's, and its greedy
answer (NEW tokens) the reference's, except where the two part at a near-tie (the reference's own margin below
NEAR_TIE there). Engine settings, one engine each, PROMPTS prose prompts of N tokens (the release's tail of 512 is
exact): the whole prompt in one step, one prompt at a time; chunked prefill with a budget of 256 tokens;
4 requests at once with a 1,024-token budget (chunks of several prompts and decodes of others in the same steps);
prefix caching on, every prompt sent twice and EXTENDED of them extended by EXTEND tokens; a KV space so small that
requests are preempted and recomputed; requests asking for prompt log-probabilities beside filled ones (those are served
exactly: the reference is the exact model). The switch off must equal vLLM without the plugin bit for bit, and
`vllm serve` with the switch on must answer as the offline engine does; a bad RIDGEFILL_RELEASE stops it with one
line. Figures go to $RIDGEFILL_ENGINE_REPORT_DIR/engines_vllm_plugin.json when that is set.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
from engine_refs import agreement, distance
from vllm_plugin_harness import (
    MARGIN_TOL, NEW, RELEASE, ROOT, check, engine_env, engine_model, free_port, reference, report, run_engine,
    vllm_python,
)

PROMPTS, N, EXTEND, BLOCK = 4, 1024, 256, 128
EXTENDED = 3  # p0..p2 sent again extended by EXTEND tokens, in the prefix-caching run

pytestmark = [pytest.mark.engines, pytest.mark.slow]


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
    long = prose_prompts(lm.tokenizer, N + EXTEND, max(PROMPTS, 6))  # six for the preempted prompt log-probs
    prompts = {f"p{i}": ids[:N] for i, ids in enumerate(long)}
    prompts |= {f"e{i}": ids for i, ids in enumerate(long[:EXTENDED])}
    return {"python": python, "work": work, "model": model, "prompts": prompts, "lm": lm, "rel": rel}


@pytest.fixture(scope="module")
def smol(smol_model):
    """The references, and every engine run."""
    lm, rel, prompts, work, model = (smol_model[k] for k in ("lm", "rel", "prompts", "work", "model"))
    names = [f"p{i}" for i in range(PROMPTS)]
    extended = [f"e{i}" for i in range(EXTENDED)]
    refs = {name: reference(lm, prompts[name], rel.arm, **rel.options()) for name in names + extended}
    refs |= {f"x{i}": reference(lm, prompts[f"p{i}"], "exact", split=0, tail=N) for i in (1, 3)}
    runs = [{"name": "alone", "engine": ALONE, "prompts": names, "max_new": NEW},
            {"name": "chunked256", "engine": CHUNKED | {"max_num_batched_tokens": 256}, "prompts": names},
            {"name": "batched", "engine": BATCHED, "prompts": names, "submit": "together"},
            {"name": "prefix", "engine": PREFIX, "prompts": names + names + extended},
            {"name": "preempted", "engine": TINY_KV, "prompts": names, "submit": "together"},
            {"name": "logprobs", "engine": BATCHED, "prompts": ["p0", "p1", "p2", "p3"], "submit": "together",
             "prompt_logprobs": ["p1", "p3"]}]  # fmt: skip
    for run in runs:
        run.setdefault("max_new", NEW)
    fill = run_engine(work, "fill", model, prompts, runs, engine_env(RELEASE))
    # The switch off against no plugin: a few requests of the prefix-caching run (two prompts, each sent
    # again, one extended) show bit-for-bit equality as well as all of them.
    off_runs = [runs[3] | {"name": "off", "prompts": ["p0", "p1", "p0", "p1", "e0"]}]
    off = run_engine(work, "off", model, prompts, off_runs, engine_env(None))
    stock = run_engine(work, "stock", model, prompts, off_runs, engine_env(None, VLLM_PLUGINS=""))
    return smol_model | {"refs": refs, "fill": fill, "off": off["off"], "stock": stock["off"]}


def filled_rows(smol, names) -> int:
    """How many rows the reference fills for these prompts: each prompt's prefix rows minus its exact ones."""
    T = smol["rel"].tail
    return sum(len(smol["prompts"][n]) - T - smol["refs"][n]["exact_rows"] for n in names)


@pytest.mark.parametrize("run", ["alone", "chunked256", "batched"])
def test_the_fill_in_vllm_equals_the_reference_prefill(smol, run):
    got = smol["fill"][run]
    fig = agreement(got["outputs"], smol["refs"]) | {"engine": got["stats"], "seconds": got["seconds"]}
    report(run, fig)
    check(fig, PROMPTS)
    assert got["stats"]["filled_rows"] == filled_rows(smol, [o["prompt"] for o in got["outputs"]]), fig


def test_prefix_caching_reuses_only_blocks_the_plan_would_write(smol):
    """A prompt sent again reuses its whole blocks; a prompt extended by EXTEND tokens reuses only the blocks below
    the first prompt's tail (whose rows were filled for both), and computes the rest under its own plan."""
    got = smol["fill"]["prefix"]
    outs = got["outputs"]
    fig = agreement(outs, smol["refs"]) | {"engine": got["stats"], "cached": [o["cached"] for o in outs]}
    report("prefix", fig)
    check(fig, 2 * PROMPTS + EXTENDED)
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
    check(fig, PROMPTS)


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


def stepwise_margin_diff(outputs: list, refs: dict) -> float:
    """The largest difference between an output's top-2 margin and its reference's, over every generated token up to
    the first that differs from the reference's answer."""
    worst = 0.0
    for out in outputs:
        ref = refs[out["prompt"]]
        for i, ((t1, l1), (_, l2)) in enumerate(out["top2"]):
            if i >= len(ref["top1"]) or out["tokens"][:i] != ref["top1"][:i] or t1 != ref["top1"][i]:
                break
            worst = max(worst, abs((l1 - l2) - ref["margin"][i]))
    return worst


def test_a_preempted_prompt_logprobs_request_is_recomputed_exactly(smol_model, tmp_path):
    """A request asking for prompt log-probabilities is served exactly however often it is scheduled. Prompts of
    1,000 tokens (eight blocks less 24 rows) answering 40 tokens, in a KV space of 26 blocks: three run at once,
    their decodes cross into a ninth block, and one gives way while it decodes, its prompt done; recomputed, its
    prompt is computed exactly again, as its prefix-cache block hashes say. Every answer, and the last prompts sent
    again with prompt log-probabilities reading the prefix cache (what the recomputed requests left there), equals
    the exact model's at every generated token."""
    lm, new, length = smol_model["lm"], 40, 1000
    names = [f"p{i}" for i in range(6)]
    prompts = {n: smol_model["prompts"][n][:length] for n in names}
    refs = {n: reference(lm, prompts[n], "exact", new=new, split=0, tail=length) for n in names}
    engine = TINY_KV | {"enable_prefix_caching": True, "num_gpu_blocks_override": 26}
    run = {"name": "preempted", "engine": engine, "prompts": names,
           "submit": "together", "max_new": new, "prompt_logprobs": names, "after": names[-2:]}  # fmt: skip
    got = run_engine(tmp_path, "preempted-logprobs", smol_model["model"], prompts, [run],
                     engine_env(RELEASE))["preempted"]  # fmt: skip
    fig = agreement(got["outputs"], refs) | {"engine": got["stats"], "preemptions": got["preemptions"],
                                             "margin_max_diff": stepwise_margin_diff(got["outputs"], refs),
                                             "cached": [o["cached"] for o in got["outputs"]]}  # fmt: skip
    report("preempted_prompt_logprobs", fig)
    assert got["preemptions"] > 0, fig
    assert got["stats"]["filled_rows"] == 0, fig
    check(fig, len(names) + 2)
    assert fig["margin_max_diff"] < MARGIN_TOL, fig


BF16_PROMPTS = 4


def test_the_fill_in_bfloat16_is_no_further_from_its_reference_than_stock_bfloat16(smol_model, smol, tmp_path):
    """bfloat16, the dtype a GPU server runs: the fill in vLLM in bfloat16 against the float32 reference fill,
    beside stock vLLM in bfloat16 against the float32 exact model, on the same prompts. The rule: the fill is no
    further from its reference than stock is from its own, on greedy answers (as many equal, less one: a near-tie
    may part either way) and on the mean top-2 margin difference over every generated token (at most 1.5 x stock's:
    bfloat16's rounding in the fill's own GEMMs, the maps' included, is of the same size as the model's)."""
    lm = smol_model["lm"]
    names = [f"p{i}" for i in range(BF16_PROMPTS)]
    prompts = {n: smol_model["prompts"][n] for n in names}
    fill_refs = {n: smol["refs"][n] for n in names}  # the float32 reference fill: computed once, by `smol`
    exact_refs = {n: reference(lm, prompts[n], "exact", split=0, tail=N) for n in names}
    run = {"name": "bf16", "engine": CHUNKED | {"max_num_batched_tokens": 512, "dtype": "bfloat16"}, "prompts": names,
           "max_new": NEW}  # fmt: skip
    fill = run_engine(tmp_path, "bf16-fill", smol_model["model"], prompts, [run], engine_env(RELEASE))["bf16"]
    stock = run_engine(tmp_path, "bf16-stock", smol_model["model"], prompts, [run], engine_env(None))["bf16"]
    fig = {"fill_vs_float32_fill": distance(fill["outputs"], fill_refs),
           "stock_vs_float32_exact": distance(stock["outputs"], exact_refs),
           "fill_vs_float32_exact": distance(fill["outputs"], exact_refs), "engine": fill["stats"]}  # fmt: skip
    report("bfloat16", fig)
    ours, theirs = fig["fill_vs_float32_fill"], fig["stock_vs_float32_exact"]
    assert fill["stats"]["filled_rows"] > 0, fig
    assert ours["greedy_equal"] >= theirs["greedy_equal"] - 1, fig
    assert ours["margin_mean_diff"] <= 1.5 * theirs["margin_mean_diff"], fig


SETTING_REFUSALS = {
    "prompt_embeds": "ridgefill: the fill does not run with --enable-prompt-embeds (the fill decides rows by their "
                     "token ids",
    "stock_torch_compile": "ridgefill: the fill does not run with compilation mode STOCK_TORCH_COMPILE",
    "breakable_cuda_graphs": "ridgefill: the fill does not run with VLLM_USE_BREAKABLE_CUDAGRAPH=1",
    "kv_connector": "ridgefill: the fill does not run with a KV connector (kv_transfer_config",
    "context_below_tail": "ridgefill: the fill does not run with a context of 512 tokens (max_model_len) and the "
                          "release's tail of 512: no prompt row would ever be filled",
    "kv_cache_fp8": "ridgefill: the fill does not run with --kv-cache-dtype fp8 (a quantized cache: the filled keys "
                    "and values are not measured in it; serve with auto, the model's own dtype)",
    "decode_context_parallel": "ridgefill: the fill does not run with decode_context_parallel_size 2",
    "prefill_context_parallel": "ridgefill: the fill does not run with prefill_context_parallel_size 2",
}  # fmt: skip


def test_settings_the_fill_cannot_honour_are_refused_at_startup(smol_model, tmp_path):
    """Where vLLM makes its configuration, each setting under which the fill would not run as planned (skipped
    silently, replayed as stock, or mixed with keys and values from elsewhere) stops startup with one line naming
    it; the same engine without it starts."""
    out = tmp_path / "refusals.json"
    r = subprocess.run([smol_model["python"], str(ROOT / "tests" / "vllm_settings.py"), str(smol_model["model"]),
                        str(out)], capture_output=True, text=True, cwd=ROOT, env=engine_env(RELEASE))  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got.pop("accepted") is None
    assert set(got) == set(SETTING_REFUSALS)
    for case, says in SETTING_REFUSALS.items():
        assert got[case] is not None and got[case].startswith(says) and "\n" not in got[case], (case, got[case])


def test_the_switch_off_is_vllm_without_the_plugin_bit_for_bit(smol):
    off, stock = smol["off"], smol["stock"]
    assert off["stats"] is None and stock["stats"] is None
    assert off["outputs"] == stock["outputs"]
    fig = agreement(off["outputs"], smol["refs"])  # and the stock engine is not the fill
    assert fig["first_margin_max_diff"] > MARGIN_TOL or fig["first_token_equal"] < fig["prompts"], fig


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


def serve(smol, release, *extra):
    port = free_port()
    cmd = [smol["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(smol["model"]), "--port",
           str(port), "--dtype", "float32", "--max-model-len", "2048", "--seed", "0", *extra]  # fmt: skip
    log = open(smol["work"] / f"serve-{port}.log", "w")
    # vLLM's CPU backend sizes its KV cache from the memory free at startup unless told (VLLM_CPU_KVCACHE_SPACE)
    env = engine_env(release, VLLM_CPU_KVCACHE_SPACE="2")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return proc, port, log


def test_vllm_serve_with_the_switch_on_answers_as_the_offline_engine(smol):
    """The served answers are the offline engine's (the fixture's run of one prompt at a time)."""
    names = ["p0", "p1", "p2"]
    offline = smol["fill"]
    proc, port, log = serve(smol, RELEASE, "--enforce-eager")
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
