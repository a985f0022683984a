"""Where a model runs: --device / --dtype on every command that runs one, and accelerate's device maps.

These are the CPU paths, checked on any machine: every test here runs as on a machine without a GPU (`no_gpu`:
torch sees no CUDA device in this process, and the CLI subprocesses get CUDA_VISIBLE_DEVICES=""), so `auto` is the
CPU and `--device cuda` is refused the same way on CI and on a GPU machine. The GPU paths are checked as what they
are: the same code with the device as data (`test_devices_on_a_machine_with_gpus` simulates two). Here: refusals
of devices and dtypes (one line, exit 2, nothing written), bfloat16 on the CPU (other recipe ids, sound figures),
and a model split between CPU memory and accelerate's disk offload, which must give exactly the numbers of the
plainly loaded model (same device, same dtype, same operations).
"""

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from ridgefill.artifacts import Store
from ridgefill.errors import BadInput
from ridgefill.models import load_model, resolve_model
from ridgefill.models.device import where
from clirun import cli, cli_here
from conftest import SMALL_CHAIN, TINY_FIXTURES, quiet
from test_eval import recompute

pytestmark = pytest.mark.usefixtures("one_thread", "no_gpu")

CONTEXT = ("The ridge map predicts a late layer's input from the split state; keys and values are written from "
           "the prediction. ")  # fmt: skip
NO_CUDA = "Error: --device cuda: torch sees no CUDA device on this machine (use --device cpu or auto)"
# Embeddings (+ tied head, 80 KiB) and one 145 KiB layer of the tiny models fit; the other layers go to disk.
CPU_BYTES = 400_000
EVAL_ARGS = ["--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600", "--documents", "2",
             "--depths", "0.5", "--tasks", "single", "--arms", "exact", "--arms", "ridgefill", "--arms", "nofill"]


@pytest.fixture
def no_gpu(monkeypatch):
    """This process as on a machine without a GPU: torch sees no CUDA device (whatever the machine has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def run(*args):
    """The CLI in a subprocess on one thread, as the in-process tests run (the machine is shared), and without a GPU
    (CUDA_VISIBLE_DEVICES="": torch sees none), like this process under `no_gpu`."""
    return cli(*args, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})


def one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# -- refusals through the real CLI ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    p = tmp_path_factory.mktemp("ctx") / "context.txt"
    p.write_text(CONTEXT)
    return p


def command(name, model, context):
    """Each command that runs a model, with inputs that do not exist: the device is refused before anything."""
    return {"solve": ["solve", "0123abcd"], "quantize": ["quantize", "0123abcd"],
            "eval": ["eval", model, "no-such-release"], "compact": ["compact", model, "--context", context],
            "fold": ["fold", "0123abcd"]}[name]  # fmt: skip


@pytest.mark.parametrize("name", ["solve", "quantize", "eval", "compact", "fold"])
@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], NO_CUDA),
    (["--device", "tpu"], "Error: unknown device 'tpu' (choose auto, cpu, cuda or cuda:N)"),
    (["--dtype", "float8"], "Error: unknown dtype 'float8' (choose one of: auto, float32, bfloat16, float16)"),
])
def test_bad_device_or_dtype_is_one_line_exit_2(name, args, message, tiny_llama, context, tmp_path):
    r = cli_here(*command(name, tiny_llama, context), *args, "--store", tmp_path / "st")
    assert r.returncode == 2
    assert one_line(r) == message
    assert not (tmp_path / "st").exists()  # nothing written


@pytest.mark.parametrize("name", ["eval", "compact"])
@pytest.mark.parametrize("args, message", [
    (["--device-map", "balanced"], "Error: unknown device map 'balanced' (only 'auto' is supported: accelerate "
                                   "places the model over the GPUs, CPU memory and disk)"),
    (["--max-memory", "cpu=1GB"], "Error: --max-memory only applies with --device-map auto"),
    (["--device-map", "auto", "--max-memory", "0=1GiB"],
     "Error: --max-memory names GPU 0 but the model runs on the CPU (--device cpu)"),
    (["--device-map", "auto", "--max-memory", "cpu=lots"],
     "Error: --max-memory cpu=lots: not a size (e.g. 20GiB, 500MB or a number of bytes)"),
    (["--device-map", "auto", "--max-memory", "cpu"],
     "Error: --max-memory 'cpu': expected DEVICE=SIZE (e.g. 0=20GiB, cpu=64GiB, disk=200GiB)"),
])  # fmt: skip
def test_bad_device_map_is_one_line_exit_2(name, args, message, tiny_llama, context, tmp_path):
    r = cli_here(*command(name, tiny_llama, context), *args, "--store", tmp_path / "st")
    assert r.returncode == 2
    assert one_line(r) == message
    assert not (tmp_path / "st").exists()


def test_devices_on_a_machine_with_gpus(monkeypatch):
    """The same resolution with two GPUs simulated: auto is the first GPU in bfloat16 (recorded in the recipe), a
    GPU past the last is refused by count, and naming a GPU is refused only when the model runs on the CPU."""
    from ridgefill.models.device import Where

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert where() == Where(device="cuda:0", dtype="bfloat16")
    assert where().recipe() == {"device": "cuda", "dtype": "bfloat16"}
    assert where("cuda:1", "float32") == Where(device="cuda:1", dtype="float32")
    assert where("cpu") == Where(device="cpu", dtype="float32") and where("cpu").recipe() == {}
    w = where(device_map="auto", max_memory=["0=1GiB", "cuda:1=2GiB", "cpu=3GiB"])
    assert (w.device, w.device_map, w.max_memory) == ("cuda:0", "auto", {0: 2**30, 1: 2 * 2**30, "cpu": 3 * 2**30})
    for kw, message in (({"device": "cuda:2"}, "--device cuda:2: this machine has 2 CUDA device(s) (cuda:0..cuda:1)"),
                        ({"device_map": "auto", "max_memory": ["2=1GiB"]},
                         "--max-memory names GPU 2: this machine has 2 CUDA device(s)"),
                        ({"device": "cpu", "device_map": "auto", "max_memory": ["0=1GiB"]},
                         "--max-memory names GPU 0 but the model runs on the CPU (--device cpu)")):
        with pytest.raises(BadInput) as e:
            where(**kw)
        assert str(e.value) == message, kw


def model_bytes(path) -> int:
    """Parameters (a tied head once) and buffers of the model: what accelerate sizes, counted here directly."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path)
    return sum(t.numel() * t.element_size() for _, t in [*m.named_parameters(), *m.named_buffers()])


def test_a_model_that_cannot_be_placed_is_refused(tiny_llama, context, tmp_path):
    """No CPU memory and no disk: one line naming how much would have gone to disk; nothing written."""
    kib = model_bytes(tiny_llama) / 1024
    r = run("compact", tiny_llama, "--context", context, "--device-map", "auto", "--max-memory", "cpu=0",
            "--max-memory", "disk=0", "--store", tmp_path / "st")
    assert r.returncode == 2
    assert one_line(r) == (f"Error: the model does not fit in --max-memory: {kib:.1f} KiB of it would go to disk, "
                           "more than disk=0 B")
    assert not (tmp_path / "st" / "compact").exists() and not (tmp_path / "st" / "offload").exists()


# -- device maps in Python: CPU memory + disk offload --------------------------------------------------------


def split_load(path, store, **kw):
    ref = resolve_model(str(path), store_root=store)
    return load_model(ref, store_root=store, **kw)


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def pair(request, tmp_path_factory):
    """(plain, dispatched) loads of a tiny model; the dispatched one keeps embeddings and layer 0 in CPU memory
    and offloads the rest to disk."""
    path = request.getfixturevalue(TINY_FIXTURES[request.param])
    store = tmp_path_factory.mktemp("store")
    plain = split_load(path, store)
    split = split_load(path, store, device_map="auto", max_memory={"cpu": CPU_BYTES})
    return plain, split


def test_device_map_places_on_cpu_and_disk(pair):
    plain, split = pair
    placement = split.model.hf_device_map
    assert placement == split.device_map
    assert set(placement.values()) == {"cpu", "disk"}
    assert placement["model.embed_tokens"] == "cpu" and placement["model.layers.0"] == "cpu"
    assert placement["model.layers.3"] == "disk"
    # disk-offloaded weights wait on the meta device; the adapter still says where each layer computes
    ad = split.adapter
    assert ad.layers[3].self_attn.k_proj.weight.device.type == "meta"
    assert ad.layers[0].self_attn.k_proj.weight.device.type == "cpu"
    assert [ad.layer_device(l).type for l in range(4)] == ["cpu"] * 4
    assert ad.device.type == "cpu" and ad.dtype == torch.float32
    counts = {"cpu": list(placement.values()).count("cpu"), "disk": list(placement.values()).count("disk")}
    assert split.placement() == {"device": "cpu", "dtype": "float32", "device_map": counts}
    assert plain.device_map is None and plain.placement() == {"device": "cpu", "dtype": "float32"}


def test_module_device_reads_accelerate_hooks():
    """The execution device of accelerate's hook wins over where the weights are (on a GPU machine the two
    differ: offloaded weights wait on meta or in CPU memory and are loaded onto the execution device)."""
    from types import SimpleNamespace

    from accelerate.hooks import AlignDevicesHook, SequentialHook

    from ridgefill.models.adapters import module_device

    lin = torch.nn.Linear(2, 2)
    assert module_device(lin) == torch.device("cpu")
    lin._hf_hook = AlignDevicesHook(execution_device=3)  # an int is a CUDA index
    assert module_device(lin) == torch.device("cuda", 3)
    lin._hf_hook = SequentialHook(SimpleNamespace(), AlignDevicesHook(execution_device="cuda:1"))
    assert module_device(lin) == torch.device("cuda", 1)
    meta = torch.nn.Linear(2, 2, device="meta")
    assert module_device(meta) is None and module_device(meta, torch.device("cpu")) == torch.device("cpu")
    meta.register_buffer("scale", torch.ones(1))
    assert module_device(meta) == torch.device("cpu")  # the first tensor not on meta


def test_everything_on_disk(tiny_gemma3, tmp_path):
    """No CPU memory at all: every weight on disk, the adapter still knows device and dtype, numbers unchanged."""
    from ridgefill.runtime import prefill

    plain = split_load(tiny_gemma3, tmp_path)
    split = split_load(tiny_gemma3, tmp_path, device_map="auto", max_memory={"cpu": 0})
    assert split.device_map == {"": "disk"}
    assert split.adapter.base.embed_tokens.weight.device.type == "meta"
    assert split.adapter.device == torch.device("cpu") and split.adapter.dtype == torch.float32
    ids = tokens(plain, 1)
    for arm in ("exact", "identity"):
        assert torch.equal(prefill(plain, ids, arm, split=2, tail=4).logits, prefill(split, ids, arm, split=2, tail=4).logits)


def tokens(lm, repeat=3):
    return torch.tensor(lm.tokenizer(CONTEXT * repeat)["input_ids"])


def random_maps(d=64, layers=(2, 3)):
    g = torch.Generator().manual_seed(0)
    return {l: ((0.1 * torch.randn(d, d, generator=g) + torch.eye(d)).numpy(), torch.randn(d, generator=g).numpy())
            for l in layers}


def test_device_map_runtime_equals_plain_load(pair):
    """Every arm of the fill runtime, and greedy decoding from its cache, give exactly the plain model's numbers."""
    from ridgefill.runtime import ARMS, greedy, prefill

    plain, split = pair
    ids, maps = tokens(plain), random_maps()
    for arm in ARMS:
        kw = {"split": 2, "tail": 8, "maps": maps if arm.startswith("ridgefill") else None}
        a, b = prefill(plain, ids, arm, **kw), prefill(split, ids, arm, **kw)
        assert torch.equal(a.logits, b.logits), arm
        assert a.exact_rows == b.exact_rows
        assert greedy(plain, a, 5) == greedy(split, b, 5), arm
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    for l in range(4):  # Adapter.kv calls the sub-modules directly: on disk layers their hooks load the weights
        for t, u in zip(plain.adapter.kv(l, x), split.adapter.kv(l, x)):
            assert torch.equal(t, u)


def test_device_map_fold_captures_equal_plain_load(pair):
    from ridgefill.fold.queries import context_cache, reference_queries

    plain, split = pair
    ids = tokens(plain, 1)
    a, b = context_cache(plain, ids), context_cache(split, ids)
    for l in range(4):
        assert torch.equal(a.keys[l], b.keys[l]) and torch.equal(a.values[l], b.values[l])
    qa, qb = reference_queries(plain, ids), reference_queries(split, ids)
    for l in range(4):
        assert all(torch.equal(s, t) for s, t in zip(qa.layers[l], qb.layers[l]))


def test_explicit_device_map_interleaving_cpu_and_disk(tiny_llama, tmp_path):
    """A hand-written map (layers alternating between CPU memory and disk) computes the same logits."""
    from ridgefill.runtime import prefill

    dmap = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk",
            "model.layers.0": "disk", "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "cpu"}
    plain = split_load(tiny_llama, tmp_path)
    split = split_load(tiny_llama, tmp_path, device_map=dmap)
    assert split.model.hf_device_map == dmap
    ids = tokens(plain)
    for arm in ("exact", "ridgefill", "nofill"):
        kw = {"split": 2, "tail": 8, "maps": random_maps() if arm == "ridgefill" else None}
        assert torch.equal(prefill(plain, ids, arm, **kw).logits, prefill(split, ids, arm, **kw).logits)


def test_device_map_refusals(tiny_llama, tmp_path, monkeypatch):
    ref = resolve_model(str(tiny_llama), store_root=tmp_path)
    with pytest.raises(BadInput) as e:
        load_model(ref, store_root=tmp_path, device_map={"model.embed_tokens": "cpu"})
    assert str(e.value).startswith("device map: The device_map provided does not give any device for the "
                                   "following parameters: ")
    with pytest.raises(BadInput, match=r"^device map entry '' names GPU 0 but the model runs on the CPU \(--device cpu\)$"):
        load_model(ref, store_root=tmp_path, device_map={"": 0})
    with pytest.raises(BadInput, match=r"^device map entry 'lm_head': unknown device 'tpu'"):
        load_model(ref, store_root=tmp_path, device_map={"": "cpu", "lm_head": "tpu"})
    with pytest.raises(BadInput, match=r"^unknown device map 'sequential' \(only 'auto' is supported"):
        load_model(ref, store_root=tmp_path, device_map="sequential")
    # an architecture that does not say which modules must stay whole cannot be split by accelerate
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_no_split_modules", None)
    with pytest.raises(BadInput) as e:
        load_model(ref, store_root=tmp_path, device_map="auto")
    assert str(e.value) == ("--device-map auto: LlamaForCausalLM does not name the modules that must stay on one "
                            "device (no _no_split_modules); load it without a device map")
    assert not (tmp_path / "offload").exists()


def test_offload_folder_lifecycle(tiny_llama, tmp_path):
    """<store>/offload/<pid>-<n> exists while the model does; release() or garbage collection removes it, and a
    folder left by a dead process is removed by the next load."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "offload" / f"{dead.pid}-0"
    stale.mkdir(parents=True)
    lm = split_load(tiny_llama, tmp_path, device_map="auto", max_memory={"cpu": CPU_BYTES})
    assert not stale.exists()
    assert lm.offload_dir.parent == tmp_path / "offload" and lm.offload_dir.is_dir()
    lm.release()
    assert not (tmp_path / "offload").exists()
    lm = split_load(tiny_llama, tmp_path, device_map="auto", max_memory={"cpu": CPU_BYTES})
    folder = lm.offload_dir
    assert folder.is_dir()
    del lm
    gc.collect()
    assert not folder.exists()


def test_device_map_in_bfloat16(tiny_llama, tmp_path):
    """Offloaded float32 weights come back from disk as bfloat16, like the plain bfloat16 load."""
    from ridgefill.runtime import prefill

    plain = split_load(tiny_llama, tmp_path, dtype="bfloat16")
    split = split_load(tiny_llama, tmp_path, dtype="bfloat16", device_map="auto", max_memory={"cpu": CPU_BYTES // 2})
    assert "disk" in split.device_map.values() and split.adapter.dtype == torch.bfloat16
    ids = tokens(plain)
    for arm in ("exact", "ridgefill"):
        kw = {"split": 2, "tail": 8, "maps": random_maps() if arm == "ridgefill" else None}
        assert torch.equal(prefill(plain, ids, arm, **kw).logits, prefill(split, ids, arm, **kw).logits)


# -- stages: bfloat16 on the CPU, and device maps through the CLI ----------------------------------------------


def test_compact_and_fold_in_bfloat16_and_with_a_device_map(tiny_llama, context, tmp_path):
    from ridgefill.fold.compaction import CompactConfig, compact
    from ridgefill.fold.run import FoldConfig, fold

    st = Store(tmp_path / "st")
    cfg = CompactConfig(budget=0.25)
    f32, _ = compact(st, str(tiny_llama), context, cfg, quiet())
    bf16, _ = compact(st, str(tiny_llama), context, cfg, quiet(), place=where(dtype="bfloat16"))
    assert f32.id != bf16.id
    assert "device" not in f32.recipe and "model_dtype" not in f32.recipe  # the ids of CPU float32 runs stay
    assert (bf16.recipe["device"], bf16.recipe["model_dtype"], bf16.recipe["dtype"]) == ("cpu", "bfloat16", "bfloat16")
    assert bf16.info["placement"] == {"device": "cpu", "dtype": "bfloat16"}
    held = (f32.manifest["summary"]["am_held_median"], bf16.manifest["summary"]["am_held_median"])
    assert held[0] != held[1] and abs(held[0] - held[1]) < 0.05  # another model dtype: close, not the same

    # The CLI's --cache-dtype is the recipe's dtype, --dtype the model's.
    r = run("compact", tiny_llama, "--context", context, "--budget", 0.25, "--cache-dtype", "bfloat16", "--dtype",
            "bfloat16", "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["id"] == bf16.id and json.loads(r.stdout)["cached"] is True

    # A fold on another dtype than its compact's says so, in one warning line.
    folded, _ = fold(st, bf16.id, FoldConfig(question=" Q: what?", answer_tokens=4), quiet(),
                     place=where(dtype="bfloat16"))
    assert folded.manifest["summary"]["fold_stock_equals_reference"] is True
    r = run("fold", bf16.id, "--question", " Q: what?", "--answer-tokens", 4, "--store", st.root)
    assert r.returncode == 0, r.stderr
    assert (f"Warning: compact {bf16.id} was made on cpu in bfloat16; this run computes on cpu in float32: its figures mix "
            "the two (pass --device cpu --dtype bfloat16 to match)") in r.stderr.splitlines()

    # The same compact through the CLI with a CPU + disk device map: the same id (a device map changes no
    # number) and the same bytes, written in another store.
    other = tmp_path / "other"
    r = run("compact", tiny_llama, "--context", context, "--budget", 0.25, "--device-map", "auto", "--max-memory",
            f"cpu={CPU_BYTES}", "--store", other, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["id"] == f32.id and doc["cached"] is False
    art = Store(other).get(doc["id"])
    assert set(art.info["placement"]["device_map"]) == {"cpu", "disk"}
    for name in ("cache.safetensors", "context.safetensors", "report.json"):
        assert art.file(name).read_bytes() == f32.file(name).read_bytes(), name
    assert not (other / "offload").exists()  # removed when the process ended


@pytest.fixture(scope="module")
def chain(tiny_chain):
    """A capture (CPU, float32) and its float32 solve and release: conftest's small chain, this module's copy."""
    c = tiny_chain(SMALL_CHAIN)
    return c.tmp, c.store, c.cap, c.sol, c.release


def test_solve_scores_in_bfloat16(chain, tiny_llama):
    _, st, cap, f32, _ = chain
    assert cap.recipe.get("device", "cpu") == "cpu" and cap.recipe.get("dtype", "float32") == "float32"
    assert "device" not in f32.recipe and "dtype" not in f32.recipe
    r = run("solve", cap.id, "--alpha", "1e-3", "--alpha", "1e-1", "--dtype", "bfloat16", "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    assert (f"Warning: capture {cap.id} was made on cpu in float32; this run computes on cpu in bfloat16: its "
            "figures mix the two (pass --device cpu --dtype float32 to match)") in r.stderr.splitlines()
    doc = json.loads(r.stdout)
    assert doc["id"] != f32.id
    bf16 = st.get(doc["id"])
    assert (bf16.recipe["device"], bf16.recipe["dtype"]) == ("cpu", "bfloat16")
    # The scores come from bfloat16 keys and values: close to float32's, not the same; input cosines need no model.
    a, b = (json.loads(x.file("report.json").read_text()) for x in (f32, bf16))
    for ga, gb in zip(a["grid"], b["grid"]):
        assert ga["alpha"] == gb["alpha"] and ga["input_cosine"] == gb["input_cosine"]  # no model in it
        assert ga["k_cosine"] != gb["k_cosine"] and abs(ga["k_cosine"] - gb["k_cosine"]) < 5e-3
        assert abs(ga["v_cosine"] - gb["v_cosine"]) < 5e-3
    # the default run (CPU, float32) gives no warning and is a cache hit on the Python run's id
    r = run("solve", cap.id, "--alpha", "1e-3", "--alpha", "1e-1", "--store", st.root, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["id"] == f32.id and "Warning" not in r.stderr


def test_quantize_scores_in_bfloat16(chain):
    from ridgefill.quantize.run import quantize

    _, st, _, sol, _ = chain
    f32, _ = quantize(st, sol.id, quiet())
    bf16, _ = quantize(st, sol.id, quiet(), place=where(dtype="bfloat16"))
    assert "device" not in f32.recipe and f32.recipe["dtype"] == "int8"
    assert (bf16.recipe["device"], bf16.recipe["model_dtype"], bf16.recipe["dtype"]) == ("cpu", "bfloat16", "int8")
    assert bf16.id != f32.id
    assert bf16.file("quant.safetensors").read_bytes() == f32.file("quant.safetensors").read_bytes()  # no model in it
    a, b = f32.manifest["summary"], bf16.manifest["summary"]
    assert a["score_float"] != b["score_float"] and abs(a["score_float"] - b["score_float"]) < 5e-3


def eval_figures(st, ident):
    """results.json without wall times (and without the summary, which holds them too)."""
    res = json.loads((st.root / "eval" / ident / "results.json").read_text())
    res.pop("summary")
    res.pop("timing")
    return res


def test_eval_in_bfloat16_and_with_a_device_map(chain, tiny_llama, tmp_path):
    from ridgefill.evaluate.run import EvalConfig, evaluate
    from ridgefill.evaluate.source import load_source

    _, st, _, _, rel = chain
    cfg = EvalConfig(arms=("exact", "ridgefill", "nofill"), tail=48, scored=16, doc_tokens=128, lengths=(600,),
                     documents=2, depths=(0.5,), tasks=("single",))
    plain, _ = evaluate(st, str(tiny_llama), str(rel), cfg, quiet())
    bf16, _ = evaluate(st, str(tiny_llama), str(rel), cfg, quiet(), place=where(dtype="bfloat16"))
    assert bf16.id != plain.id
    assert (bf16.recipe["device"], bf16.recipe["dtype"]) == ("cpu", "bfloat16") and "device" not in plain.recipe
    p, b = eval_figures(st, plain.id), eval_figures(st, bf16.id)
    # bfloat16's figures are those of independent bfloat16 prefills per arm (test_eval's recompute, the model loaded
    # in bfloat16): the same operations, equal to the last bit as measured, so 1e-6 relative, far below what bfloat16
    # moves them by from float32's (KL 0.1 to 0.5 %, the exact arm's NLL 1e-4): an arm computed in float32 fails
    lm = load_model(resolve_model(str(tiny_llama), store_root=st.root), store_root=st.root,
                    **where(dtype="bfloat16").load_args())
    docs, needles = recompute(lm, load_source(st, str(rel)), cfg)
    assert len(b["documents"]) == len(docs) == 2 and [n["correct"] for n in b["needles"]] == needles
    for dp, db, want in zip(p["documents"], b["documents"], docs):
        for arm in ("ridgefill", "nofill"):
            for k, v in want[arm].items():
                assert db[arm][k] == (None if v is None else pytest.approx(v, rel=1e-6)), (arm, k)
        assert dp["ridgefill"]["kl"] != db["ridgefill"]["kl"]
    # A device map changes no number: same id (in another store), same figures, through the CLI.
    r = run("eval", tiny_llama, rel, *EVAL_ARGS, "--device-map", "auto", "--max-memory", f"cpu={CPU_BYTES}",
            "--store", tmp_path / "st", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["id"] == plain.id and doc["cached"] is False
    assert eval_figures(Store(tmp_path / "st"), doc["id"]) == p
    split = Store(tmp_path / "st").get(doc["id"])
    assert set(split.info["placement"]["device_map"]) == {"cpu", "disk"}


@pytest.mark.parametrize("text, message", [
    ('model = "{m}"\ndevice = "cuda"\n', NO_CUDA),
    ('model = "{m}"\ndtype = "float8"\n', "Error: unknown dtype 'float8' (choose one of: auto, float32, bfloat16, float16)"),
    ('model = "{m}"\nmax_memory = {{ cpu = "1GB" }}\n', "Error: --max-memory only applies with --device-map auto"),
    ('model = "{m}"\ndevice = 0\n', "Error: recipe [top level]: device must be a string, got integer 0"),
])  # fmt: skip
def test_release_recipe_device_refusals(text, message, tiny_llama, tmp_path):
    """`ridgefill release`: the recipe's device / dtype / device map are checked before any stage runs."""
    path = tmp_path / "r.toml"
    path.write_text(text.format(m=tiny_llama))
    r = cli_here("release", path, "--store", tmp_path / "st")
    assert r.returncode == 2
    assert one_line(r) == message.format(p=path)
    assert not (tmp_path / "st").exists()


SLOW = ("Warning: bfloat16 on this CPU (no avx512_bf16 or amx_bf16 instructions) runs many times slower than "
        "float32: pass --dtype float32 (a recipe: dtype = \"float32\")")


@pytest.mark.parametrize("flags, warned", [
    (frozenset({"sse2", "avx2", "fma"}), True),                 # this project's 2-core machine today
    (frozenset({"avx2", "avx512f", "avx512_bf16"}), False),     # AVX-512 with bfloat16
    (frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"}), False),  # AMX
    (None, False),                                              # no /proc/cpuinfo flags: not judged
])  # fmt: skip
def test_bfloat16_on_a_cpu_without_its_instructions_is_warned_in_one_line(flags, warned, monkeypatch, tmp_path):
    from ridgefill.models import device

    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    r = cli_here("solve", "0123abcd", "--dtype", "bfloat16", "--store", tmp_path / "st")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith("Error: ") and "Traceback" not in r.stderr
    assert lines[:-1] == ([SLOW] if warned else [])
    # float32, a GPU and float16 with its own instructions are never warned
    slow = frozenset({"avx2"})
    assert device.slow_dtype_warning(where("cpu", "float32"), slow) is None
    assert device.slow_dtype_warning(device.Where("cuda:0", "bfloat16"), slow) is None
    assert device.slow_dtype_warning(where("cpu", "float16"), frozenset({"avx512_fp16"})) is None
    half = device.slow_dtype_warning(where("cpu", "float16"), slow)
    assert half.startswith("float16 on this CPU (no avx512_fp16 or amx_fp16 instructions) runs many times slower")
