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
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import engine_refs
from engine_refs import agreement, distance

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".engines" / "vllm"
RELEASE = Path(os.environ.get("RIDGEFILL_ENGINE_RELEASE", ROOT / "release" / "smollm2-135m"))
PROMPTS, N, NEW, EXTEND, BLOCK = 4, 1536, 16, 256, 128
EXTENDED = 3  # p0..p2 sent again extended by EXTEND tokens, in the prefix-caching run
MARGIN_TOL = 1e-3  # nats: the engine's first-token margin against the reference's (float32 on both sides)
RUNNER = ROOT / "tests" / "vllm_plugin_runner.py"

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


def extra_plugin(site: Path, module: str, source: str) -> Path:
    """A test-only vLLM plugin `module` (its `register` a `vllm.general_plugins` entry point) in the folder `site`, to
    put on an engine's PYTHONPATH beside ridgefill's plugin."""
    info = site / f"{module}-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{module} = {module}:register\n")
    (site / f"{module}.py").write_text(source)
    return site


def run_engine(work: Path, name: str, model: Path, prompts: dict, runs: list, env: dict, timeout=None) -> dict:
    spec, out = work / f"jobs-{name}.json", work / f"results-{name}.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "runs": runs}))
    r = subprocess.run([vllm_python(), RUNNER, spec, out], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())["runs"]


def reference(lm, ids, arm: str, new: int = NEW, **options) -> dict:
    return engine_refs.reference(lm, ids, arm, new, **options)


def check(fig: dict, count: int = PROMPTS) -> None:
    assert fig["prompts"] >= count and fig["misses"] == 0, fig
    assert fig["first_token_equal"] == fig["prompts"] and fig["first_margin_max_diff"] < MARGIN_TOL, fig


def report(key: str, figures) -> None:
    out = os.environ.get("RIDGEFILL_ENGINE_REPORT_DIR")
    if out:
        import fcntl

        path = Path(out) / "engines_vllm_plugin.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:  # two pytest-xdist workers add to one file
            fcntl.flock(lock, fcntl.LOCK_EX)
            got = json.loads(path.read_text()) if path.is_file() else {}
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
    check(fig)
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
    run = {"name": "preempted", "engine": TINY_KV | {"enable_prefix_caching": True}, "prompts": names,
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


def test_every_vllm_internal_the_fill_touches_is_in_the_installed_vllm():
    """internals.INTERNALS resolves, entry by entry, in the installed vLLM, CommonAttentionMetadata has every
    field the fill sets, and the configuration has every field the startup checks read (internals.CONFIG_FIELDS):
    a vLLM that moved one is caught here, by name, not in a server."""
    code = ("import dataclasses, json\nfrom ridgefill.engines.vllm import internals\nmissing = []\n"
            "for where, _, _ in internals.INTERNALS:\n    try:\n        internals.resolve(where)\n"
            "    except (ImportError, AttributeError) as e:\n        missing.append(f'{where}: {e}')\n"
            "cam = internals.resolve('vllm.v1.attention.backend:CommonAttentionMetadata')\n"
            "fields = {f.name for f in dataclasses.fields(cam)}\n"
            "missing += [f'CommonAttentionMetadata.{f}' for f in internals.COMMON_FIELDS if f not in fields]\n"
            "for path in internals.CONFIG_FIELDS:\n    try:\n        internals.resolve_field(path)\n"
            "    except AttributeError as e:\n        missing.append(f'{path}: {e}')\n"
            "print(json.dumps([internals.version_problem(), missing]))")  # fmt: skip
    r = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, cwd=ROOT, env=engine_env(None))
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [None, []]


def in_vllm(code: str) -> dict:
    """Run `code` in the vLLM environment (no engine started); the JSON its last line of output prints."""
    r = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, cwd=ROOT, env=engine_env(None))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# A device emulated on the host: launched work waits in a queue (a stream) until the host waits for an event. The
# late layers' builder is made from one that behaves as FlashInfer's does: each build rewrites the builder's one host
# buffer at once and leaves its copy to the device buffer, to which the metadata points, to the stream.
GROUPS_UNIT = """
import json, types
import numpy as np, torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from ridgefill.engines.vllm import model, plan

QUEUE, DONE = [], [0]


def run_to(k):
    while DONE[0] < k:
        QUEUE[DONE[0]]()
        DONE[0] += 1


class Event:  # recorded at the stream's end; waiting for it runs the stream that far
    def __init__(self):
        self.at = len(QUEUE)

    def synchronize(self):
        run_to(self.at)


class FlashInferLike:
    builds = 0

    def __init__(self):
        self.host, self.device = np.zeros(8, np.int64), np.zeros(8, np.int64)

    def build(self, common_prefix_len, cam, *args, **kwargs):
        FlashInferLike.builds += 1
        self.host[:] = -1
        self.host[: cam.num_reqs] = cam.seq_lens_cpu_upper_bound.numpy()
        host, device = self.host, self.device
        QUEUE.append(lambda: device.__setitem__(slice(None), host))
        return types.SimpleNamespace(seq_lens=device)


class Requests(dict):  # the runner's requests, counting reads
    reads = 0

    def __getitem__(self, key):
        type(self).reads += 1
        return super().__getitem__(key)


def common(qsl, seq):
    qsl, seq = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
    n = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu_upper_bound=seq,
        num_reqs=len(seq), num_actual_tokens=n, max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(seq.max()), block_table_tensor=torch.zeros(len(seq), 4, dtype=torch.int32),
        slot_mapping=torch.arange(n), positions=torch.arange(n))


def step(guarded):
    QUEUE.clear(); DONE[0] = 0; FlashInferLike.builds = 0; Requests.reads = 0
    model._event = (lambda device: Event()) if guarded else (lambda device: None)
    params = types.SimpleNamespace(prompt_logprobs=None, prompt_logprob_token_ids=None)
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(num_reqs=2, num_prompt_tokens=np.array([40, 30]), req_ids=["a", "b"]),
        requests=Requests(a=types.SimpleNamespace(sampling_params=params),
                          b=types.SimpleNamespace(sampling_params=params)))
    model._ACTIVE[:] = [types.SimpleNamespace(tail=8, anchor=1)]
    model.RUNNER.set(runner)
    builder = model.builder_class(FlashInferLike)()
    out = {}
    # two prompts prefilled whole (40 and 30 tokens, tail 8, anchor 1), rows 10 and 20 of the first run exactly
    qsl, seq = [0, 40, 70], [40, 30]
    cam = common(qsl, seq)
    got = builder.build(0, cam)
    out["fill_step_is_planned"] = isinstance(got, model.Step) and model._STEP[0] is got
    out["whole_step_builds"] = FlashInferLike.builds
    out["plan_reads_requests"] = Requests.reads
    exact = ~got.prefix
    exact[[10, 20]] = True
    parts = plan.groups(plan.runs(exact, got.query_start, got.seq_lens), 2)
    names = ["late.2", "late.3"]
    ctx = types.SimpleNamespace(attn_metadata={n: got for n in names},
                                slot_mapping={n: cam.slot_mapping for n in names})
    reads = []

    def late(h, residual, positions):  # a group's attention reads its metadata when the stream gets to it
        seen = ctx.attn_metadata[names[0]].seq_lens
        QUEUE.append(lambda: reads.append(seen.tolist()))
        return h

    h = torch.zeros(70, 4)
    model.late_groups(late, names, got, parts, ctx, h, h, torch.arange(70), cam.slot_mapping)
    out["group_builds"] = FlashInferLike.builds
    out["groups"] = len(parts)
    out["context_restored"] = all(ctx.attn_metadata[n] is got for n in names)
    # the next step, two decodes: vLLM's own build, with no plan and no request read
    decode = builder.build(0, common([0, 1, 2], [41, 31]))
    out["decode_planned"] = model._STEP[0] is not None
    out["decode_builds"] = FlashInferLike.builds - out["group_builds"]
    out["decode_reads_requests"] = Requests.reads - out["plan_reads_requests"]
    run_to(len(QUEUE))
    out["reads"] = reads
    out["want"] = [g.seq_lens.tolist() + [-1] * (8 - g.owner.size) for g in parts]
    return out


print(json.dumps({"guarded": step(True), "unguarded": step(False)}))
"""


def test_each_group_of_a_filling_step_reads_its_own_metadata():
    """The late layers' builder, made from one that reuses a single host buffer as FlashInfer's `plan()` does (a
    build rewrites it at once; its copy to the device runs when the stream gets there), on a device emulated on the
    host. A filling step: vLLM's build for the whole step is not made (its plan stands in); each group's metadata is
    built once, just before the group is launched, after the device has taken the previous group's; every group
    reads its own sequence lengths, and so does the last group after the next step (two decodes) has built vLLM's
    own metadata, which reads no request (the decode fast exit). Without the wait, a group reads a later build's."""
    got = in_vllm(GROUPS_UNIT)
    ok = got["guarded"]
    assert ok["fill_step_is_planned"] and ok["whole_step_builds"] == 0 and ok["plan_reads_requests"] == 2, ok
    assert ok["groups"] == 3 and ok["group_builds"] == 3 and ok["context_restored"], ok
    assert not ok["decode_planned"] and ok["decode_builds"] == 1 and ok["decode_reads_requests"] == 0, ok
    assert ok["reads"] == ok["want"] and [w[:2] for w in ok["want"]] == [[1, 11], [21, 40], [1, 30]], ok
    bad = got["unguarded"]  # build after launch, nothing waiting: the copies run late and read the last build
    assert bad["want"] == ok["want"] and bad["reads"] != bad["want"], bad


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


# ------------------------------------------------------------------------------------------------ tiny Qwen2, Qwen3

TINY_TAIL = 16
TINY_PROMPTS = 8  # random-token prompts per tiny model: enough for many exact runs in one step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random models (4 layers, d = 128, 2 KV heads of 32: vLLM's CPU kernels) and releases of their own (split
    2, int8, tail TINY_TAIL), made once and shared by the tests below: `tiny(arch, configuration, maps)` -> the model
    folder, the loaded model, the release (folder, and as the runtime reads it), TINY_PROMPTS random-token prompts
    and their references. One capture per architecture, from which both kinds of map are solved."""
    from clirun import cli
    from conftest import CAT_TEXTS
    from tiny import make_tiny_model

    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps

    models, captures, made = {}, {}, {}

    def make(arch: str, configuration: str, maps: str, outlier_ratio: float | None = None, kv_heads: int = 2,
             split: int = 2) -> dict:
        vllm_python()
        arch_key, arch = (arch, kv_heads), arch
        if arch_key not in models:
            work = tmp_path_factory.mktemp(f"tiny-{arch}-{kv_heads}kv")
            model = make_tiny_model(work / "model", arch=arch, layers=4, hidden=128, kv_heads=kv_heads)
            data, store = work / "data", work / "store"
            data.mkdir()
            for i, text in enumerate(CAT_TEXTS):
                (data / f"d{i}.txt").write_text(text)
            lm = load_model(resolve_model(str(model), store_root=store), store_root=store)
            models[arch_key] = {"work": work, "model": model, "store": store, "data": data, "lm": lm}
        c = models[arch_key]
        if (arch_key, outlier_ratio, split) not in captures:
            ratio = [] if outlier_ratio is None else ["--outlier-ratio", str(outlier_ratio)]
            r = cli("capture", c["model"], "--data", c["data"], "--split", str(split), "--chunk", "64", *ratio,
                    "--store", c["store"])  # fmt: skip
            assert r.returncode == 0, r.stderr
            captures[(arch_key, outlier_ratio, split)] = r.stdout.strip()
        key = (arch_key, configuration, maps, outlier_ratio, split)
        if key not in made:
            r = cli("solve", captures[(arch_key, outlier_ratio, split)], "--maps", maps, "--store", c["store"])
            assert r.returncode == 0, r.stderr
            r = cli("quantize", r.stdout.strip(), "--store", c["store"])
            assert r.returncode == 0, r.stderr
            release = c["work"] / f"release-{configuration}-{maps}-{outlier_ratio or 'default'}-{split}"
            r = cli("export", r.stdout.strip(), "--out", release, "--tail", TINY_TAIL, "--configuration",
                    configuration, "--store", c["store"])  # fmt: skip
            assert r.returncode == 0, r.stderr
            rel = load_release_maps(c["lm"], release)
            assert set(rel.map_kinds.values()) == {maps}, rel.map_kinds
            rng = np.random.default_rng(0)
            prompts = {f"p{i}": rng.integers(6, 320, int(rng.integers(100, 220))).tolist() for i in range(TINY_PROMPTS)}
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
        check(fig, TINY_PROMPTS)
        assert got[run]["stats"]["filled_rows"] == tiny_filled_rows(prompts, refs), fig
        if configuration == "ridgefill+protected":
            assert got[run]["stats"]["exact_prefix_rows"] > TINY_PROMPTS, fig  # protected rows amid the prefix


def test_more_exact_runs_than_the_backend_has_room_for_run_in_groups(tiny, tmp_path):
    """A release whose exact-row norm is barely above the median (a capture at outlier ratio 1.05: about a third of
    the prefix rows run exactly, most of them alone) gives a step many more exact runs than `max_num_seqs`. With the
    CPU builder failing as FlashInfer's and FlashAttention 3's would past their buffers (plugin_runner's
    gpu_seq_limits), max_num_seqs 1 to 4: the late layers run the runs in groups the backend takes, and the answers
    equal the reference fill's."""
    t = tiny("qwen2", "ridgefill", "input", outlier_ratio=1.05)
    names = [f"p{i}" for i in range(TINY_PROMPTS)]
    prompts, refs = {n: t["prompts"][n] for n in names}, {n: t["refs"][n] for n in names}
    runs = [{"name": f"seqs{k}", "engine": {"max_model_len": 256, "enable_prefix_caching": False,
                                            "max_num_batched_tokens": 128, "max_num_seqs": k},
             "prompts": names, "submit": "together", "max_new": NEW, "gpu_seq_limits": True}
            for k in (1, 2, 3, 4)]  # fmt: skip
    got = run_engine(tmp_path, "groups", t["model"], prompts, runs, engine_env(t["release"]))
    for k in (1, 2, 3, 4):
        g = got[f"seqs{k}"]
        fig = agreement(g["outputs"], refs) | {"engine": g["stats"], "max_batch_seqs": g["max_batch_seqs"]}
        report(f"groups_max_num_seqs_{k}", fig)
        check(fig, len(names))
        stats = g["stats"]
        assert stats["filled_rows"] == tiny_filled_rows(prompts, refs), fig
        assert stats["exact_prefix_rows"] > 10 * len(names), fig  # many exact rows amid the prefix
        assert stats["groups"] > stats["fill_steps"] and 1 <= stats["max_group_seqs"] <= k, fig
        assert g["max_batch_seqs"] <= k, fig


def test_a_one_token_prompt_chunk_among_decodes_is_kept_off_the_decode_graph(tiny, tmp_path):
    """A budget of 2 tokens for 2 requests at a time: while one decodes, the other's prompt goes one token per
    step beside it, a step vLLM calls a uniform decode (a full CUDA graph would replay it, skipping the fill). The
    plugin keeps such steps off the decode graph (counted), and the answers are the reference fill's."""
    t = tiny("qwen2", "ridgefill", "input")
    names = [f"p{i}" for i in range(4)]
    prompts, refs = {n: t["prompts"][n] for n in names}, {n: t["refs"][n] for n in names}
    run = {"name": "trickle", "engine": {"max_model_len": 256, "enable_prefix_caching": False,
                                         "max_num_batched_tokens": 2, "max_num_seqs": 2},
           "prompts": names, "submit": "together", "max_new": NEW}  # fmt: skip
    got = run_engine(tmp_path, "trickle", t["model"], prompts, [run], engine_env(t["release"]))["trickle"]
    fig = agreement(got["outputs"], refs) | {"engine": got["stats"]}
    report("one_token_chunks_among_decodes", fig)
    check(fig, len(names))
    assert got["stats"]["filled_rows"] == tiny_filled_rows(prompts, refs), fig
    assert got["stats"]["decode_graph_vetoes"] > 0, fig


SYNC_PLUGIN = """
from torch.overrides import TorchFunctionMode

# The calls that make the host wait for the device on CUDA: a copy to the host, a value read, nonzero (its count), and
# isin / unique (they sort, and read how many distinct values they found).
WAITS = {"cpu", "item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "isin", "unique", "masked_select"}


class Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in WAITS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def register():
    from ridgefill.engines.vllm import model

    forward = model.EngineFill.forward

    def counted(self, *args, **kwargs):
        with Count() as seen:
            out = forward(self, *args, **kwargs)
        if out is not None:  # a filling step
            self.stats.setdefault("host_syncs", []).append(sorted(seen.calls))
        return out

    model.EngineFill.forward = counted
"""


def test_host_syncs_per_filling_step(tiny, tmp_path):
    """Each filling step's calls that wait for the device on CUDA, counted over the fill's forward in eager mode (a
    test-only vLLM plugin, installed beside ridgefill's for these engines only; vLLM's own checker,
    VLLM_GPU_SYNC_CHECK, runs on CUDA only): one, the read of the fill mask, for a plain release and for a
    ridgefill+protected one (whose protected tokens are looked up in a table: torch.isin would sort, and wait)."""
    site = extra_plugin(tmp_path / "site", "ridgefill_syncs", SYNC_PLUGIN)
    figures = {}
    for arch, configuration in (("qwen2", "ridgefill"), ("qwen3", "ridgefill+protected")):
        t = tiny(arch, configuration, "input")
        names = [f"p{i}" for i in range(4)]
        prompts, refs = {n: t["prompts"][n] for n in names}, {n: t["refs"][n] for n in names}
        run = {"name": "syncs", "engine": {"max_model_len": 256, "enable_prefix_caching": False,
                                           "max_num_batched_tokens": 64, "max_num_seqs": 2},
               "prompts": names, "submit": "together", "max_new": NEW}  # fmt: skip
        env = engine_env(t["release"], PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
        got = run_engine(tmp_path, f"syncs-{arch}", t["model"], prompts, [run], env)["syncs"]
        check(agreement(got["outputs"], refs), len(names))
        stats = got["stats"]
        assert len(stats["host_syncs"]) == stats["fill_steps"] > 1, stats
        assert all(calls == ["cpu"] for calls in stats["host_syncs"]), stats["host_syncs"]
        figures[configuration] = {"fill_steps": stats["fill_steps"], "host_syncs_per_step": 1}
    report("host_syncs_per_filling_step", figures)


TP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
          "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # fmt: skip
TP_ENGINE = {"max_model_len": 256, "enable_prefix_caching": False, "max_num_batched_tokens": 128, "max_num_seqs": 4}


# Input maps are column-parallel over the hidden rows whatever the KV heads: one case of them is enough.
@pytest.mark.parametrize("maps, kv_heads", [("kv", 2), ("input", 2), ("kv", 1)])
def test_the_fill_on_two_tensor_parallel_ranks(tiny, maps, kv_heads, tmp_path):
    """The tiny Qwen2 on two tensor-parallel ranks on the CPU, with key/value maps (each rank holding its own heads'
    rows) for 2 KV heads (one per rank) and for 1 (replicated on both), and with input maps (column-parallel: each
    rank holding half the rows, the prediction all-gathered): the answers equal one rank's and the reference's,
    both ranks fill the reference's rows, and each holds its share of the maps. The input maps run compiled, as
    vLLM runs by default."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two tensor-parallel ranks need two CPUs")
    t = tiny("qwen2", "ridgefill", maps, kv_heads=kv_heads)
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
    whole = 2 * 4 * (width * d + width)  # 2 late layers of float32 maps and biases
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


def test_the_compile_cache_is_keyed_by_the_release(tiny, tmp_path):
    """vLLM keys its compile cache (the piecewise cache's folder, the AOT artifact's hash) by its configuration's hash,
    the VLLM_* variables and the forward's source location. With the fill on, the configuration carries the release
    (its maps' sha256, split and map kinds): releases at two splits and of two kinds give three keys, the same release
    the same key, in both of vLLM's compile paths (the configuration's hash is a factor of the piecewise cache's folder
    and of an AOT artifact's hash)."""
    releases = {"input-2": tiny("qwen2", "ridgefill", "input")["release"],
                "kv-2": tiny("qwen2", "ridgefill", "kv")["release"],
                "input-3": tiny("qwen2", "ridgefill", "input", split=3)["release"]}
    model = tiny("qwen2", "ridgefill", "input")["model"]
    out = tmp_path / "keys.json"
    r = subprocess.run([vllm_python(), str(ROOT / "tests" / "vllm_compile_key.py"), str(model), str(out),
                        *(f"{k}={v}" for k, v in releases.items()), f"again={releases['input-2']}"],
                       capture_output=True, text=True, cwd=ROOT, env=engine_env(releases["input-2"]))  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["again"] == got["input-2"]
    keys = [got[k] for k in releases]
    for part in ("config_hash", "aot_factors"):
        assert len({str(k[part]) for k in keys}) == 3, (part, keys)
    assert got["input-3"]["ridgefill"] == {"release": json.loads((releases["input-3"] / "ridgefill.json").read_text())
                                           ["files"]["maps.safetensors"], "split": 3, "maps": ["input"]}


def test_two_compiled_servers_sharing_one_compile_cache_answer_as_their_releases(tiny, tmp_path):
    """Two compiled engines (vLLM's default) on one VLLM_CACHE_ROOT, one after the other, with releases at two splits
    and of two kinds: each answers as its own release's reference (what an engine on an empty cache answers), and each
    compiled its parts into a cache folder of its own, so the second never loaded the first's."""
    a, b = tiny("qwen2", "ridgefill", "input"), tiny("qwen2", "ridgefill", "kv", split=3)
    cache = tmp_path / "vllm-cache"
    names = [f"p{i}" for i in range(2)]
    engine = {"max_model_len": 256, "enable_prefix_caching": False, "max_num_batched_tokens": 128,
              "max_num_seqs": 2, "enforce_eager": False}
    folders = []
    for name, t in (("input-2", a), ("kv-3", b)):
        prompts, refs = {n: t["prompts"][n] for n in names}, {n: t["refs"][n] for n in names}
        run = {"name": name, "engine": engine, "prompts": names, "submit": "together", "max_new": NEW}
        got = run_engine(tmp_path, name, t["model"], prompts, [run], engine_env(t["release"], VLLM_CACHE_ROOT=str(cache)))
        check(agreement(got[name]["outputs"], refs), len(names))
        assert got[name]["stats"]["warm_up_s"] is not None  # compiled, and run once at start-up
        folders.append(compile_folders(cache))
    # vLLM 0.32 compiles ahead of time on the CPU: one folder per part (the backbone and the fill's three), each named
    # by its key; the second engine added four of its own rather than finding the first's
    assert len(folders[0]) == 4 and len(folders[1]) == 8 and folders[0] < folders[1], folders


def compile_folders(root: Path) -> set[str]:
    """The keyed folders of vLLM's compile cache under VLLM_CACHE_ROOT `root`: each AOT artifact's
    (torch_aot_compile/<hash>) and each piecewise cache's (<hash>)."""
    cache = root / "torch_compile_cache"
    aot = {f"aot/{p.name}" for p in (cache / "torch_aot_compile").glob("*") if p.is_dir()}
    return aot | {p.name for p in cache.glob("*") if p.is_dir() and p.name != "torch_aot_compile"}
