"""`ridgefill engine model MODEL --out DIR` (ridgefill/engines/model_dir.py) and the served-model checks the vLLM
plugin runs (ridgefill/engines/identity.py).

The sources are tiny GGUF models (a folder is refused: vLLM serves it as it is): tests/tiny.py's llama, qwen2 and
qwen3 as GGUFs. The written folder must load with transformers and give the source model's logits bit for bit,
tokenize as the source does, carry a marker that `served_fingerprint_problem` accepts for the source's release and
for nothing else, and be the same bytes on every run. The real SmolLM2 is the `slow` test at the end.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clirun import cli_here
from tiny import TEXT, make_tiny_gguf

from ridgefill.engines.identity import (MARKER, folder_fingerprint, served_config_problem,
                                        served_fingerprint_problem)
from ridgefill.models import load_model, resolve_model
from ridgefill.models.fingerprint import dir_fingerprint, gguf_fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")

FILES = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", MARKER,
         "tokenizer.json", "tokenizer_config.json"]
SAMPLES = [TEXT, "ünïcödé 🙂 and\ttabs\n\nnew lines", "def fill(x): return x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the ridge map?"}]
ROOT = Path(__file__).resolve().parent.parent


def tiny_gguf(path: Path, arch: str, seed: int = 0) -> Path:
    return make_tiny_gguf(path, arch, layers=2, hidden=512 if arch == "qwen3" else 64, seed=seed)


def manifest_of(ref) -> dict:
    """A release manifest's model part for `ref`, as ridgefill/export/build.py writes it."""
    from ridgefill.models.spec import upstream

    up = upstream(ref.spec, ref.name, ref.revision)
    return {"model": {"name": ref.name, "revision": ref.revision, "architecture": ref.model_type,
                      "num_layers": ref.num_layers, "hidden_size": ref.hidden_size, "fingerprint": ref.fingerprint,
                      **{k: up[k] for k in ("base_model", "source", "spec") if k in up}}}


def engine_model(*args) -> subprocess.CompletedProcess:
    return cli_here("engine", "model", *args)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """arch -> (gguf, store, out, the --json result) of `engine model` run once per architecture."""
    done = {}

    def get(arch: str):
        if arch not in done:
            root = tmp_path_factory.mktemp(f"engine-model-{arch}")
            gguf = tiny_gguf(root / f"tiny-{arch}.gguf", arch)
            r = engine_model(gguf, "--out", root / "served", "--store", root / "store", "--json")
            assert r.returncode == 0, r.stderr
            done[arch] = (gguf, root / "store", root / "served", json.loads(r.stdout))
        return done[arch]

    return get


# -- the folder: loads, computes and tokenizes as the source model ---------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_folder_has_the_source_models_logits_and_tokenizer(arch, written):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, store, out, doc = written(arch)
    assert sorted(p.name for p in out.iterdir()) == FILES
    assert doc["files"] == {p.name: p.stat().st_size for p in out.iterdir()}
    assert doc["bytes"] == sum(doc["files"].values())
    assert (doc["out"], doc["dtype"]) == (str(out), "float32")
    src = load_model(resolve_model(str(gguf), store_root=store), store_root=store)
    served = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert served.dtype == torch.float32 and served.config.model_type == arch
    ids = src.tokenizer(TEXT)["input_ids"][:24]
    with torch.no_grad():
        assert torch.equal(served(torch.tensor([ids])).logits, src.model(torch.tensor([ids])).logits)
    # the tokenizer: the same ids as the source's (as ridgefill loads it, and as transformers reads the GGUF itself)
    direct = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    for text in SAMPLES:
        assert tok(text)["input_ids"] == src.tokenizer(text)["input_ids"] == direct(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat == src.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat == "<|system|>Be brief.</s><|user|>What is the ridge map?</s><|assistant|>"
    assert (tok.eos_token, tok.bos_token) == (src.tokenizer.eos_token, src.tokenizer.bos_token)


def test_bfloat16_folder_holds_the_source_weights_rounded(written, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf, store, out, _ = written("llama")
    r = engine_model(gguf, "--out", tmp_path / "bf16", "--store", store, "--dtype", "bfloat16", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "bf16" / MARKER).read_text())["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    full, half = load_file(out / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert full.keys() == half.keys()
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", local_files_only=True)
    src = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.bfloat16)
    ids = torch.tensor([[5, 60, 100, 200, 7, 9]])
    with torch.no_grad():
        assert served.dtype == torch.bfloat16 and torch.equal(served(ids).logits, src(ids).logits)
    ref = resolve_model(str(gguf), store_root=store)
    assert served_fingerprint_problem(tmp_path / "bf16", manifest_of(ref)) is None


def test_two_runs_write_the_same_bytes(written, tmp_path):
    """A fresh store dequantizes the GGUF again: the folder is still the same bytes, and --force replaces it."""
    gguf, _, out, doc = written("llama")
    r = engine_model(gguf, "--out", tmp_path / "again", "--store", tmp_path / "store", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["built_cache"] is True
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    (tmp_path / "again" / "config.json").write_text("{}")
    r = engine_model(gguf, "--out", tmp_path / "again", "--store", tmp_path / "store", "--force")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{tmp_path / 'again'}\n"  # stdout: only the folder
    assert "engine model: tiny-llama (" in r.stderr and "as float32, 7 files" in r.stderr
    assert all((tmp_path / "again" / n).read_bytes() == (out / n).read_bytes() for n in FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "store"]  # no staging folder left beside it
    assert oct((tmp_path / "again" / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


# -- the marker and the served-model checks -----------------------------------------------------------------


def test_marker_records_the_folder_and_its_source(written):
    gguf, store, out, doc = written("llama")
    ref = resolve_model(str(gguf), store_root=store)
    own = dir_fingerprint(out)
    assert ref.fingerprint == gguf_fingerprint(gguf) != own
    expected = {"dtype": "float32", "fingerprint": own, "format": "ridgefill-engine-model/1",
                "source": {"fingerprint": ref.fingerprint, "name": "tiny-llama", "spec": str(gguf)}}
    assert (out / MARKER).read_text() == json.dumps(expected, sort_keys=True, indent=2) + "\n"
    assert (doc["fingerprint"], doc["source"]) == (own, expected["source"])
    # the marker is not part of the folder's own fingerprint
    bare = out.parent / "bare"
    shutil.copytree(out, bare)
    (bare / MARKER).unlink()
    assert dir_fingerprint(bare) == own


def test_served_fingerprint_problem_accepts_the_source_and_nothing_else(written, tmp_path):
    gguf, store, out, _ = written("llama")
    mine = manifest_of(resolve_model(str(gguf), store_root=store))
    other = manifest_of(resolve_model(str(tiny_gguf(tmp_path / "other.gguf", "llama", seed=1)), store_root=store))
    assert served_fingerprint_problem(out, mine) is None
    fp, ofp = mine["model"]["fingerprint"][:12], other["model"]["fingerprint"][:12]
    assert served_fingerprint_problem(out, other) == (
        f"the release was made for other (fingerprint {ofp}), the served model {out} was written from {gguf} "
        f"(fingerprint {fp}); serve that model's own folder, or for a GGUF model the folder `ridgefill engine model "
        "MODEL --out DIR` writes from it")

    def edited(name: str, change) -> Path:
        folder = tmp_path / f"edited-{name}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(out, folder)
        change(folder / name)
        return folder

    def flip_last_byte(p: Path):
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))

    own = dir_fingerprint(out)
    for name, change in (("model.safetensors", flip_last_byte),
                         ("tokenizer.json", lambda p: p.write_text(p.read_text().replace('"<s>"', '"<S>"'))),
                         ("config.json", lambda p: p.write_text(p.read_text().replace('"dtype"', '"dtype" '))),
                         (MARKER, lambda p: p.write_text(p.read_text().replace(own, "0" * 64)))):
        folder = edited(name, change)
        have = folder_fingerprint(folder)[:12]
        recorded = "000000000000" if name == MARKER else own[:12]
        assert served_fingerprint_problem(folder, mine) == (
            f"the served model {folder} does not match its {MARKER} (which records fingerprint {recorded}; the folder "
            f"has {have}): edited since `ridgefill engine model` wrote it; write it again: `ridgefill engine model "
            f"{gguf} --out {folder} --force`"), name
    # a marker edited to claim another source is accepted for that source only: a record, not a signature
    claims = edited(MARKER, lambda p: p.write_text(p.read_text().replace(mine["model"]["fingerprint"],
                                                                          other["model"]["fingerprint"])))
    assert served_fingerprint_problem(claims, other) is None
    assert "was written from" in served_fingerprint_problem(claims, mine)
    broken = edited(MARKER, lambda p: p.write_text("{"))
    assert served_fingerprint_problem(broken, mine).startswith(
        f"the release was made for tiny-llama (fingerprint {fp}); the served model {broken} has fingerprint "
        f"{own[:12]} and a damaged marker: {broken / MARKER} is not JSON")
    wrong = edited(MARKER, lambda p: p.write_text(p.read_text().replace("ridgefill-engine-model/1", "x/2")))
    assert served_fingerprint_problem(wrong, mine).endswith(
        f"{wrong / MARKER}: 'format' is not 'ridgefill-engine-model/1'")
    unmarked = edited(MARKER, Path.unlink)
    assert served_fingerprint_problem(unmarked, mine) == (
        f"the release was made for tiny-llama (fingerprint {fp}), the served model {unmarked} has fingerprint "
        f"{own[:12]}; serve that model's own folder, or for a GGUF model the folder `ridgefill engine model MODEL "
        "--out DIR` writes from it")
    assert served_fingerprint_problem(tmp_path / "nowhere", mine).startswith(
        f"cannot fingerprint the served model {tmp_path / 'nowhere'}: ")
    assert served_fingerprint_problem(out, {"model": {}}) == (
        "the release manifest has no model.fingerprint (64 hex digits): not a ridgefill release")


def test_served_folder_that_is_the_model_itself(tiny_llama, tmp_path):
    """A release of a model folder (or a Hub snapshot of it) needs no marker: the folder's own fingerprint is the
    release's. A Hub snapshot's weights are fingerprinted by their blob names, the sha256 the Hub keeps."""
    import hashlib

    manifest = manifest_of(resolve_model(str(tiny_llama), store_root=tmp_path))
    assert served_fingerprint_problem(tiny_llama, manifest) is None
    repo = tmp_path / "hub" / "models--me--tiny"
    snapshot = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for p in tiny_llama.iterdir():
        blob = repo / "blobs" / hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, blob)
        (snapshot / p.name).symlink_to(os.path.relpath(blob, snapshot))
    assert served_fingerprint_problem(snapshot, manifest) is None
    weights = (snapshot / "model.safetensors").resolve()
    weights.rename(weights.with_name("f" * 64))  # a blob name the Hub did not give these bytes
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(weights.with_name("f" * 64), snapshot))
    assert "has fingerprint" in served_fingerprint_problem(snapshot, manifest)


def test_served_config_problem(written, tmp_path):
    gguf, store, out, _ = written("llama")
    manifest = manifest_of(resolve_model(str(gguf), store_root=store))
    config = json.loads((out / "config.json").read_text())
    assert served_config_problem(config, manifest) is None
    assert served_config_problem({**config, "model_type": "qwen2"}, manifest) == (
        "the release was made for tiny-llama, whose architecture is 'llama'; the served model's is 'qwen2'")
    assert served_config_problem({**config, "num_hidden_layers": 3}, manifest) == (
        "the release was made for tiny-llama, whose layer count is 2; the served model's is 3")
    assert served_config_problem({**config, "hidden_size": 32}, manifest) == (
        "the release was made for tiny-llama, whose hidden size is 64; the served model's is 32")
    vl = {"model_type": "llama", "text_config": {"num_hidden_layers": 2, "hidden_size": 64}}
    assert served_config_problem(vl, manifest) is None
    assert served_config_problem(config, {}) == "the release manifest has no 'model' object: not a ridgefill release"


def test_identity_imports_only_what_an_engine_has():
    """identity.py runs inside vLLM's environment: the standard library and ridgefill's numpy-only modules only;
    a fresh interpreter that imports it loads none of torch, transformers, typer, rich, safetensors or numpy."""
    allowed = {"__future__", "json", "pathlib"}
    tree = ast.parse((ROOT / "ridgefill" / "engines" / "identity.py").read_text())
    for node in ast.walk(tree):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) else []
        for m in mods:
            assert m in allowed or m in ("ridgefill.errors", "ridgefill.models.fingerprint"), m
    heavy = ("torch", "transformers", "typer", "rich", "click", "safetensors", "huggingface_hub", "numpy")
    code = f"import sys, ridgefill.engines.identity; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_imports_no_torch():
    code = ("import sys; sys.argv = ['ridgefill', 'engine', 'model', '--help']\n"
            "from ridgefill.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print('HEAVY', [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout and "--dtype" in r.stdout and "--force" in r.stdout


# -- refusals: one line, exit 2, nothing written --------------------------------------------------------------


def refused(args, tmp_path, message: str, out: Path | None = None, env=None) -> None:
    """`engine model ARGS` exits 2 with `message`, and nothing appears at or beside --out (default
    tmp_path/outs/served; the store, which may cache the dequantized GGUF, is tmp_path/store)."""
    out = out or tmp_path / "outs" / "served"
    out.parent.mkdir(exist_ok=True)
    before = sorted(p.name for p in out.parent.iterdir())
    r = cli_here("engine", "model", *args, "--out", out, "--store", tmp_path / "store", env=env)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.splitlines()[-1:] == [f"Error: {message}"], r.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == before  # nothing written beside it either


def test_refusals(written, tiny_llama, tmp_path):
    gguf, _, _, _ = written("llama")
    refused([gguf, "--dtype", "float8"], tmp_path,
            "--dtype must be one of auto, float32, bfloat16, float16, got 'float8'")
    refused([tiny_llama], tmp_path, f"'{tiny_llama}' is a model folder, which vLLM serves as it is (`vllm serve "
            f"{tiny_llama}`); `engine model` writes folders for GGUF models")
    hub = tmp_path / "hf"
    refused(["someone/tiny@v1"], tmp_path, "'someone/tiny@v1' is a Hub model, a Hugging Face folder already, which "
            "vLLM serves as it is (`vllm serve someone/tiny --revision v1`); `engine model` writes folders for GGUF "
            "models", env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "0"})
    assert not hub.exists()  # nothing was downloaded
    gemma = make_tiny_gguf(tmp_path / "g" / "gemma.gguf", arch="gemma3", layers=4, hidden=64)
    refused([gemma], tmp_path, f"the vLLM plugin serves llama, qwen2, qwen3 models; '{gemma}' is gemma3_text")
    refused([tmp_path / "missing.gguf"], tmp_path, f"model path '{tmp_path / 'missing.gguf'}' does not exist")


def test_out_is_kept_without_force(written, tmp_path):
    gguf, store, _, _ = written("llama")
    out = tmp_path / "served"
    assert engine_model(gguf, "--out", out, "--store", store).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    refused([gguf], tmp_path, f"--out {out} already holds an engine model folder (--force replaces it)", out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    refused([gguf, "--force"], tmp_path, f"--out {other} exists, is not empty and is not an engine model folder (no "
            "ridgefill-model.json)", other)
    assert (other / "notes.txt").read_text() == "keep"
    (tmp_path / "file").write_text("x")
    refused([gguf], tmp_path, f"--out {tmp_path / 'file'} exists and is not a directory", tmp_path / "file")


def test_out_inside_a_release_folder_or_the_store_is_refused(written, tmp_path):
    """A release holds only the files its manifest lists, the store only its artifacts: a model folder inside
    either (at any depth, or through a link) would make it fail to verify."""
    gguf, _, _, _ = written("llama")
    rel = tmp_path / "rel"
    (rel / "deep").mkdir(parents=True)
    (rel / "ridgefill.json").write_text("{}")
    for out in (rel / "served", rel / "deep" / "served"):
        refused([gguf], tmp_path, f"--out {out} is inside the release folder {rel}: write the engine model folder "
                "elsewhere (a release holds only the files its manifest lists)", out)
    (tmp_path / "link").symlink_to(rel / "deep")
    refused([gguf], tmp_path, f"--out {tmp_path / 'link' / 'served'} is inside the release folder {rel}: write the "
            "engine model folder elsewhere (a release holds only the files its manifest lists)",
            tmp_path / "link" / "served")
    assert sorted(p.name for p in rel.iterdir()) == ["deep", "ridgefill.json"] and not any((rel / "deep").iterdir())
    store = tmp_path / "store"
    refused([gguf], tmp_path, f"--out {store / 'served'} is inside the artifact store {store}: write the engine model "
            "folder elsewhere (the store holds only its artifacts)", store / "served")


def test_a_second_run_into_the_same_out_is_refused_while_the_first_runs(written, tmp_path):
    """Two runs into one new --out: the second finds the first's lock (`.<name>.lock` beside --out, the one export
    and pull take) and stops at once, instead of replacing the first's folder when it is done."""
    import fcntl

    gguf, _, _, _ = written("llama")
    out = tmp_path / "outs" / "served"
    out.parent.mkdir()
    fd = os.open(out.parent / ".served.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the first run holds it (another open file: this process is refused too)
        os.write(fd, json.dumps({"pid": 4242, "host": "elsewhere"}).encode())
        for force in ([], ["--force"]):
            refused([gguf, *force], tmp_path, f"--out {out} is being written by pid 4242 on elsewhere: wait for it "
                    "to finish (then --force replaces its folder), or write elsewhere", out)
    finally:
        os.close(fd)
    assert sorted(p.name for p in out.parent.iterdir()) == [".served.lock"]
    r = engine_model(gguf, "--out", out, "--store", tmp_path / "store")  # a lock file nobody holds: taken over
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["served"]


def test_a_linked_out_is_replaced_where_it_leads(written, tmp_path):
    """--out a link to an engine model folder, with --force: the folder it leads to is replaced, the link still
    leads there, and nothing is left beside either."""
    gguf, store, first, _ = written("llama")
    real = tmp_path / "models" / "v1"
    shutil.copytree(first, real, symlinks=True)
    (real / "config.json").write_text("{}")
    link = tmp_path / "current"
    link.symlink_to(real)
    r = engine_model(gguf, "--out", link, "--store", store, "--force")
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert all((real / n).read_bytes() == (first / n).read_bytes() for n in FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "models"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]


def test_what_a_killed_run_left_is_recovered_by_the_next(written, tmp_path):
    """A run killed between its two renames leaves no folder and the old one aside (`.<name>.old-<pid>-*`, beside
    the folder a linked --out leads to); the next run puts it back, and with --force replaces it, leaving nothing."""
    gguf, store, first, _ = written("llama")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = gone.stdout.strip()
    models = tmp_path / "models"
    shutil.copytree(first, models / f".v1.old-{dead}-x")
    (models / f".v1.tmp-{dead}-y").mkdir()
    (models / ".v1.lock").write_text("{}")
    link = tmp_path / "current"
    link.symlink_to(models / "v1")  # leads nowhere until the old folder is back
    refused([gguf], tmp_path, f"--out {link} already holds an engine model folder (--force replaces it)", link)
    assert sorted(p.name for p in models.iterdir()) == ["v1"] and link.resolve() == (models / "v1").resolve()
    shutil.move(models / "v1", models / f".v1.old-{dead}-x")
    r = engine_model(gguf, "--out", link, "--store", store, "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in models.iterdir()) == ["v1"] and link.is_symlink()
    assert all((models / "v1" / n).read_bytes() == (first / n).read_bytes() for n in FILES)


def test_float16_overflow_is_refused(tmp_path):
    big = "model.layers.0.mlp.down_proj.weight"
    gguf = make_tiny_gguf(tmp_path / "g" / "big.gguf", "qwen2", scale={big: 1e7})
    refused([gguf, "--dtype", "float16"], tmp_path,
            f"float16 cannot hold the weights of {big} (beyond 65504): use --dtype bfloat16 or float32")


def test_sliding_window_models_are_refused(written, tmp_path):
    """No GGUF of a served architecture states a sliding window (transformers' GGUF reader has no key for it): the
    dequantized copy in a store is given one, as a Qwen2 config with sliding layers has it."""
    gguf, store, _, _ = written("qwen2")
    shutil.copytree(store, tmp_path / "store")
    (cached,) = [p / "config.json" for p in (tmp_path / "store" / "models").iterdir() if p.is_dir()]
    config = json.loads(cached.read_text())
    config |= {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
               "layer_types": ["full_attention", "sliding_attention"]}
    cached.write_text(json.dumps(config))
    refused([gguf], tmp_path, "an engine needs full attention in every layer (this model has ['full_attention', "
            "'sliding_attention']): it keeps one position range for all layers")


# -- the real model ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store, out = tmp_path / "store", tmp_path / "smollm2"
    r = engine_model("builtin:smollm2-135m", "--out", out, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert sorted(doc["files"]) == FILES and doc["dtype"] == "float32"
    assert 535e6 < doc["bytes"] < 550e6  # 134.5M float32 parameters, the LM head tied to the embedding
    ref = resolve_model("builtin:smollm2-135m", store_root=store)
    assert doc["source"] == {"spec": "builtin:smollm2-135m", "name": "SmolLM2-135M-Instruct.Q4_1",
                             "fingerprint": ref.fingerprint}
    src = load_model(ref, store_root=store)
    served = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "The ridge map predicts a late layer's input. Numbers 0 1 2 3 and ünïcödé, emoji 🙂 done."
    ids = src.tokenizer(text)["input_ids"]
    assert tok(text)["input_ids"] == ids
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        src.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        assert torch.equal(served(torch.tensor([ids])).logits, src.model(torch.tensor([ids])).logits)
    manifest = manifest_of(ref)
    assert manifest["model"]["spec"] == "builtin:smollm2-135m"
    assert served_fingerprint_problem(out, manifest) is None
    assert served_config_problem(json.loads((out / "config.json").read_text()), manifest) is None
    gemma = {"model": {**manifest["model"], "fingerprint": "0" * 64, "spec": "builtin:gemma3-270m"}}
    assert served_fingerprint_problem(out, gemma).endswith(
        "serve the folder `ridgefill engine model builtin:gemma3-270m --out DIR` writes from that model")
