"""The fill inside stock vLLM on tiny random Qwen2 and Qwen3 models (4 layers, d = 128) with releases of their own,
against ridgefill's reference runtime, on one rank: both map kinds, protected rows, more exact runs than the backend
has room for, one-token chunks among decodes, the host syncs of a filling step, and the compile cache keyed by the
release; and the units that need vLLM installed but no engine (the vLLM internals the fill touches, the late layers'
metadata per group). Needs the vLLM environment with the plugin (`scripts/setup-engines.sh vllm`); skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from engine_refs import agreement
from vllm_plugin_harness import (
    NEW, ROOT, TINY_PROMPTS, check, engine_env, extra_plugin, in_vllm, report, run_engine, tiny, tiny_filled_rows,
    vllm_python,
)

pytestmark = [pytest.mark.engines, pytest.mark.slow]


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


@pytest.mark.parametrize("arch, configuration, maps, earlier", [
    ("qwen2", "ridgefill", "input", None), ("qwen2", "ridgefill", "kv", None),
    ("qwen3", "ridgefill+protected", "input", None), ("qwen3", "ridgefill+protected", "kv", None),
    ("qwen2", "ridgefill", "input", "1,2"), ("qwen3", "ridgefill+protected", "kv", "2,1"),
])  # fmt: skip
def test_the_fill_in_vllm_on_qwen2_and_qwen3(tiny, arch, configuration, maps, earlier, tmp_path):
    """Tiny random models (qkv bias in Qwen2, q/k norms in Qwen3), each with releases of its own (int8, tail 16) of
    input maps and of key/value maps: the same hook, chunked and batched, against the reference runtime. Qwen3's
    releases are `ridgefill+protected`: rows holding a protected token run exactly in the middle of the prefix, so a
    prompt's exact rows form many sequences of their own. A key/value map's output goes through Qwen3's key norm
    and the rotary embedding; Qwen2's has the qkv bias folded into its own. Two releases' maps read earlier states
    too (ridgefill-maps/3: [h_2; h_1; h_0] and [h_2; h_0; h_1], the embeddings among them), which the compiled early
    part keeps as it goes."""
    t = tiny(arch, configuration, maps, earlier=earlier)
    prompts, refs, names = t["prompts"], t["refs"], list(t["prompts"])
    small = {"max_model_len": 256, "enable_prefix_caching": False}
    runs = [{"name": "chunked", "engine": small | {"max_num_batched_tokens": 64, "max_num_seqs": 1}, "prompts": names,
             "max_new": NEW},
            {"name": "batched", "engine": small | {"max_num_batched_tokens": 128, "max_num_seqs": 4}, "prompts": names,
             "submit": "together", "max_new": NEW}]  # fmt: skip
    got = run_engine(tmp_path, arch, t["model"], prompts, runs, engine_env(t["release"]))
    for run in ("chunked", "batched"):
        fig = agreement(got[run]["outputs"], refs) | {"engine": got[run]["stats"]}
        report((f"{arch}_{run}" if maps == "input" else f"{arch}_{maps}_{run}")
               + (f"_earlier{earlier.replace(',', '.')}" if earlier else ""), fig)
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
        env = engine_env(t["release"], VLLM_CACHE_ROOT=str(cache))
        got = run_engine(tmp_path, name, t["model"], prompts, [run], env)
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
