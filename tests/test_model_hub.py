"""Hub model specs (`owner/name[@rev]`) downloaded as transformers users expect, against a local Hub server.

tests/hubserver.py serves the repos; `ridgefill capture` runs through the real CLI entry with HF_ENDPOINT and
HF_HUB_CACHE pointing at the server and at temporary folders. The server keeps every request, so the tests
assert what was fetched (only config, tokenizer and safetensors; never the pickle next to them), which
Authorization header went where, and that an offline run sends nothing. A few checks call `resolve_model` in
this process, which also shows that HF_ENDPOINT / HF_HUB_OFFLINE are read per call, not frozen at import.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
from clirun import cli
from hubserver import HubServer, Token

from ridgefill.artifacts import Store
from ridgefill.errors import BadInput, RidgefillError
from ridgefill.models import resolve_model

ALICE = "hf_rfMODEL_alice_3b9d2e7f1a6c4b8e0d5f"  # alice, member of acme: may read alice/* and acme/*
BOB = "hf_rfMODEL_bob_8c1f4e2a9d7b3c6e0a5f"  # bob: no organisation, no grant until a test gives one
LEAK = "hf_rfMODEL_LEAK_5d0c7b2e9f4a1c8e3b6d"  # alice; only the token-leak test uses it
HUB_ONLY = ("HF_", "HUGGINGFACE")  # inherited variables that would point the client elsewhere
WANTED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "model.safetensors"}
TOKENIZER = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json")
TEXTS = [
    "The ridge map predicts a late layer's input from the split state; keys and values follow from it.",
    "def fill(x, w, b):\n    return x @ w.T + b  # one matrix product per late layer\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation .,;:!? in a short line of prose.",
]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def hub():
    tokens = {ALICE: Token("alice", orgs=("acme",)), BOB: Token("bob"), LEAK: Token("alice", orgs=("acme",))}
    with HubServer(tokens=tokens) as server:
        yield server


def model_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def perturbed(weights: bytes) -> bytes:
    """The same safetensors file with one tensor changed (still loadable)."""
    from safetensors.numpy import load, save

    tensors = load(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1.0
    return save(tensors)


@pytest.fixture(scope="module")
def repos(hub, tiny_llama):
    """The served repos; returns {name: commit sha} for the commits the tests pin."""
    files = model_files(tiny_llama)
    extras = {"pytorch_model.bin": b"PK\x03\x04 a pickle that must never be fetched" * 8,
              "README.md": b"# tiny\n", "onnx/model.safetensors": b"\0" * 64}
    shas = {}
    hub.create_repo("acme/tiny")
    shas["tiny"] = hub.put_files("acme/tiny", {**files, **extras})
    hub.create_repo("acme/evolving")
    shas["first"] = hub.put_files("acme/evolving", files, message="first")
    hub.tag("acme/evolving", "v1")
    shas["second"] = hub.put_files("acme/evolving", {"model.safetensors": perturbed(files["model.safetensors"])},
                                   message="second")
    hub.create_repo("alice/secret", private=True)
    hub.put_files("alice/secret", files)
    hub.create_repo("acme/gated", gated=True)
    hub.put_files("acme/gated", files)
    hub.create_repo("acme/pickled")
    hub.put_files("acme/pickled", {**{k: v for k, v in files.items() if k != "model.safetensors"},
                                   "pytorch_model.bin": extras["pytorch_model.bin"]})
    return shas


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXTS):
        (d / f"doc{i}.txt").write_text(text)
    return d


def hub_env(hub, cache: Path, token: str | None = None, offline: bool = False, endpoint: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(HUB_ONLY)}
    env.update(HF_ENDPOINT=endpoint or hub.url, HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "hf-home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if token:
        env["HF_TOKEN"] = token
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def capture(hub, spec: str, corpus: Path, store: Path, cache: Path, **kw):
    return cli("capture", spec, "--data", corpus, "--held-out", "1", "--store", store, env=hub_env(hub, cache, **kw))


def one_line_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0].removeprefix("Error: ")


def expected_fingerprint(hub, repo_id: str, rev: str = "main") -> str:
    """The documented formula over the served files, with the weights' sha256 as the Hub keeps it (LFS oid)."""
    commit = hub.resolve(repo_id, rev)

    def over(names):
        h = hashlib.sha256()
        for name in sorted(names):
            data = hub.read(repo_id, name, rev)
            h.update(f"{name}\0{len(data)}\0".encode() + data)
        return h.hexdigest()

    doc = {"config": sha(hub.read(repo_id, "config.json", rev)), "tokenizer": over(TOKENIZER),
           "weights": {"model.safetensors": commit.files["model.safetensors"].lfs}}
    return sha(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def resolved(log: list[dict], method: str | None = None) -> list[str]:
    """Repo paths asked for on /resolve/ (HEAD for metadata, GET for content), by any method or by `method`."""
    return [q["path"].split("/resolve/", 1)[1].split("/", 1)[1] for q in log
            if "/resolve/" in q["path"] and method in (None, q["method"])]


def fetched(hub, repo_id: str, log: list[dict]) -> list[str]:
    """Repo paths whose content was downloaded: GET on /resolve/ (regular files), or GET of their LFS object from
    the storage origin (LFS files: the client follows the redirect its HEAD got)."""
    blobs = {q["path"].rsplit("/", 1)[1] for q in log if q["server"] == "cdn" and q["method"] == "GET"}
    files = {e.lfs: path for c in hub.repo(repo_id).commits.values() for path, e in c.files.items() if e.lfs}
    return resolved(log, "GET") + [files.get(b, b) for b in blobs]


def snapshot_dir(cache: Path, repo_id: str, sha_: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / sha_


def no_token_anywhere(token: str, *folders: Path) -> None:
    for folder in folders:
        for p in folder.rglob("*"):
            assert p.is_dir() or token.encode() not in p.read_bytes(), p


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    """Point this process at a server through the environment, as a user's shell would."""

    def point(endpoint: str, cache: Path | None = None, token: str | None = None, offline: bool = False) -> Path:
        cache = cache or tmp_path / "hf-cache"
        for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        if offline:
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        return cache

    return point


# ------------------------------------------------------------------------------------------- download


@pytest.fixture(scope="module")
def captured(hub, repos, corpus, tmp_path_factory):
    """`ridgefill capture acme/tiny` once, into a fresh HF cache and store."""
    root = tmp_path_factory.mktemp("captured")
    cache, store = root / "hf-cache", root / "store"
    n = len(hub.requests)
    r = capture(hub, "acme/tiny", corpus, store, cache)
    return r, hub.requests_since(n), cache, store


def test_capture_downloads_only_config_tokenizer_and_safetensors(hub, repos, captured):
    r, log, cache, store = captured
    assert r.returncode == 0, r.stderr
    cap_id = r.stdout.strip()
    assert r.stdout == f"{cap_id}\n" and len(cap_id) == 16  # stdout: the capture id only
    assert "Traceback" not in r.stderr

    art = Store(store).get(cap_id, "capture")
    assert art.info["model_spec"] == "acme/tiny"
    assert art.info["model"]["name"] == "acme/tiny"
    assert art.info["model"]["revision"] == repos["tiny"] == hub.resolve("acme/tiny").sha  # the commit, 40 hex
    assert art.recipe["model"] == expected_fingerprint(hub, "acme/tiny")

    # exactly the wanted files were asked for and fetched, each once: no pickle, no README, nothing in a sub-folder
    assert sorted(fetched(hub, "acme/tiny", log)) == sorted(set(resolved(log))) == sorted(WANTED)
    assert not [q for q in log if ".bin" in q["path"] or "/onnx/" in q["path"] or "README" in q["path"]]
    lfs = hub.resolve("acme/tiny").files["model.safetensors"].lfs
    assert [q["path"] for q in log if q["server"] == "cdn"] == [f"/blobs/acme/tiny/{lfs}"]

    # the normal HF cache layout, the weights' blob named by the Hub's sha256 (which the fingerprint used)
    snap = snapshot_dir(cache, "acme/tiny", repos["tiny"])
    assert sorted(p.name for p in snap.iterdir()) == sorted(WANTED)
    assert os.path.basename(os.path.realpath(snap / "model.safetensors")) == lfs
    assert (cache / "models--acme--tiny" / "refs" / "main").read_text() == repos["tiny"]
    blobs = [p.read_bytes() for p in (cache / "models--acme--tiny" / "blobs").iterdir()]
    assert hub.read("acme/tiny", "pytorch_model.bin") not in blobs


def test_hub_snapshot_fingerprints_like_the_same_files_in_a_directory(hub, repos, captured, tiny_llama, tmp_path):
    _, _, _, store = captured
    cap = Store(store).get(captured[0].stdout.strip(), "capture")
    assert resolve_model(str(tiny_llama), store_root=tmp_path).fingerprint == cap.recipe["model"]


def test_second_run_fetches_nothing_and_offline_runs_from_the_cache(hub, repos, corpus, captured):
    first, _, cache, store = captured
    n = len(hub.requests)
    r = capture(hub, "acme/tiny", corpus, store, cache)  # online: the revision is looked up, no file is fetched
    assert r.returncode == 0, r.stderr
    assert r.stdout == first.stdout  # same fingerprint, same capture: a cache hit
    log = hub.requests_since(n)
    assert fetched(hub, "acme/tiny", log) == [] and not [q for q in log if q["server"] == "cdn"]

    n = len(hub.requests)
    r = capture(hub, "acme/tiny", corpus, store, cache, offline=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == first.stdout
    assert hub.requests_since(n) == []  # offline: not one request
    r = capture(hub, f"acme/tiny@{repos['tiny']}", corpus, store, cache, offline=True)
    assert r.returncode == 0 and r.stdout == first.stdout, r.stderr


def test_revision_pins_a_commit(hub, repos, corpus, tmp_path):
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    r = capture(hub, f"acme/evolving@{repos['first']}", corpus, store, cache)
    assert r.returncode == 0, r.stderr
    art = Store(store).get(r.stdout.strip(), "capture")
    assert art.info["model"]["revision"] == repos["first"] != hub.resolve("acme/evolving").sha
    assert art.recipe["model"] == expected_fingerprint(hub, "acme/evolving", repos["first"])
    assert expected_fingerprint(hub, "acme/evolving", repos["first"]) != expected_fingerprint(hub, "acme/evolving")
    assert (snapshot_dir(cache, "acme/evolving", repos["first"]) / "model.safetensors").read_bytes() == hub.read(
        "acme/evolving", "model.safetensors", repos["first"])


def test_branch_tag_and_sha_resolve_to_their_commits(hub, repos, in_process, tmp_path):
    in_process(hub.url)
    for spec, commit in [("acme/evolving", "second"), ("acme/evolving@main", "second"), ("acme/evolving@v1", "first"),
                         (f"acme/evolving@{repos['first']}", "first")]:
        ref = resolve_model(spec, store_root=tmp_path / "store")
        assert (ref.kind, ref.name, ref.spec, ref.revision) == ("hub", "acme/evolving", spec, repos[commit])
        assert ref.fingerprint == expected_fingerprint(hub, "acme/evolving", repos[commit])
        assert (ref.model_type, ref.num_layers, ref.hidden_size) == ("llama", 4, 64)


def test_the_endpoint_is_read_per_call(hub, repos, tiny_llama, in_process, tmp_path):
    """Two servers in one process: huggingface_hub's import-time constants do not pin the first endpoint."""
    with HubServer() as other:
        other.create_repo("acme/tiny")
        files = model_files(tiny_llama)
        elsewhere = other.put_files("acme/tiny", {**files, "model.safetensors": perturbed(files["model.safetensors"])})
        for server, commit in ((hub, repos["tiny"]), (other, elsewhere), (hub, repos["tiny"])):
            in_process(server.url, cache=tmp_path / server.url.rsplit(":", 1)[1])
            ref = resolve_model("acme/tiny", store_root=tmp_path / "store")
            assert ref.revision == commit and ref.fingerprint == expected_fingerprint(server, "acme/tiny")


# ------------------------------------------------------------------------------------------- refusals


def test_offline_and_not_cached_is_one_line(hub, repos, corpus, tmp_path):
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    n = len(hub.requests)
    r = capture(hub, "acme/tiny", corpus, store, cache, offline=True)
    assert r.returncode == 2 and r.stdout == ""
    assert one_line_error(r) == (f"acme/tiny is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE "
                                 "is set; unset HF_HUB_OFFLINE to download it")
    assert hub.requests_since(n) == [] and not store.exists()


def test_missing_repo_and_unknown_revision(hub, repos, corpus, tmp_path):
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    r = capture(hub, "acme/missing", corpus, store, cache)
    assert r.returncode == 2 and r.stdout == ""
    assert one_line_error(r) == (f"acme/missing: repository not found on {hub.url}; if it is private, set HF_TOKEN "
                                 "or run `hf auth login`")
    r = capture(hub, "acme/tiny@nope", corpus, store, cache)
    assert r.returncode == 2
    assert one_line_error(r) == f"acme/tiny@nope: revision not found on {hub.url}"
    r = capture(hub, "acme/tiny@" + "0" * 40, corpus, store, cache)
    assert r.returncode == 2
    assert one_line_error(r) == f"acme/tiny@{'0' * 40}: revision not found on {hub.url}"
    assert not store.exists()


def test_repo_without_safetensors_is_refused_before_any_download(hub, repos, corpus, tmp_path):
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    n = len(hub.requests)
    r = capture(hub, "acme/pickled", corpus, store, cache)
    assert r.returncode == 2
    sha_ = hub.resolve("acme/pickled").sha
    assert one_line_error(r) == (f"acme/pickled (commit {sha_[:12]}) has no safetensors weights at the top level; "
                                 "ridgefill downloads only *.safetensors, never pickle files such as *.bin")
    assert not [q for q in hub.requests_since(n) if "/resolve/" in q["path"] or q["server"] == "cdn"]
    assert not (cache / "models--acme--pickled").exists() and not store.exists()


def test_private_repo_needs_a_token_that_can_read_it(hub, repos, corpus, tmp_path):
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    r = capture(hub, "alice/secret", corpus, store, cache)
    assert r.returncode == 2
    assert one_line_error(r) == (f"alice/secret: repository not found on {hub.url}; if it is private, set HF_TOKEN "
                                 "or run `hf auth login`")
    r = capture(hub, "alice/secret", corpus, store, cache, token=BOB)  # a valid token of another user
    assert r.returncode == 2
    assert one_line_error(r) == f"alice/secret: repository not found on {hub.url}, or the token has no access to it"
    wrong = "hf_rfMODEL_WRONG_0a1b2c3d4e5f6a7b8c9d"
    r = capture(hub, "alice/secret", corpus, store, cache, token=wrong)
    assert r.returncode == 2
    assert one_line_error(r) == (f"alice/secret: the Hub at {hub.url} refused the token (401: Invalid credentials in "
                                 "Authorization header); set HF_TOKEN or run `hf auth login` with a valid token")
    assert wrong not in r.stderr + r.stdout
    assert not store.exists()


def test_private_repo_with_a_token_works_and_the_token_never_leaks(hub, repos, corpus, tmp_path):
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    n = len(hub.requests)
    r = capture(hub, "alice/secret", corpus, store, cache, token=LEAK)
    assert r.returncode == 0, r.stderr
    art = Store(store).get(r.stdout.strip(), "capture")
    assert art.info["model"]["revision"] == hub.resolve("alice/secret").sha
    assert art.recipe["model"] == expected_fingerprint(hub, "alice/secret")
    assert LEAK not in r.stdout and LEAK not in r.stderr
    no_token_anywhere(LEAK, store, tmp_path)  # the store, the HF cache, the HF home
    log = hub.requests_since(n)
    assert sorted(fetched(hub, "alice/secret", log)) == sorted(WANTED)
    for q in log:
        assert LEAK not in q["path"] and LEAK not in json.dumps(q["query"]) and LEAK.encode() not in q["body"]
        if q["server"] == "hub":  # the token travels to the Hub, and only in the Authorization header
            assert q["headers"].get("authorization") == f"Bearer {LEAK}"
        else:  # never to the storage origin
            assert "authorization" not in q["headers"]


def test_gated_repo(hub, repos, corpus, in_process, tmp_path):
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    r = capture(hub, "acme/gated", corpus, store, cache)
    assert r.returncode == 2
    assert one_line_error(r) == (f"acme/gated is a gated repository on {hub.url}: request access at "
                                 f"{hub.url}/acme/gated, then set HF_TOKEN or run `hf auth login`")
    r = capture(hub, "acme/gated", corpus, store, cache, token=BOB)
    assert r.returncode == 2
    assert one_line_error(r) == (f"acme/gated is a gated repository on {hub.url} and the token's account has no "
                                 f"access to it: request access at {hub.url}/acme/gated")
    assert BOB not in r.stderr
    assert not store.exists() and not list((cache / "models--acme--gated").rglob("*.safetensors"))

    hub.grant("acme/gated", "bob")
    in_process(hub.url, cache=cache, token=BOB)
    ref = resolve_model("acme/gated", store_root=store)
    assert ref.revision == hub.resolve("acme/gated").sha
    assert ref.fingerprint == expected_fingerprint(hub, "acme/gated")


# ------------------------------------------------------------------------------- offline, unreachable


def test_incomplete_cached_snapshot_offline(hub, repos, in_process, tmp_path):
    cache = in_process(hub.url)
    resolve_model("acme/tiny", store_root=tmp_path / "store")
    link = snapshot_dir(cache, "acme/tiny", repos["tiny"]) / "tokenizer.json"
    Path(os.path.realpath(link)).unlink()  # an interrupted download: neither the blob nor the snapshot link
    link.unlink()
    in_process(hub.url, cache=cache, offline=True)
    with pytest.raises(BadInput) as info:
        resolve_model("acme/tiny", store_root=tmp_path / "store")
    assert str(info.value) == (f"acme/tiny: the cached snapshot in {cache} is incomplete and HF_HUB_OFFLINE is set; "
                               "run again with network access to finish the download")
    in_process(hub.url, cache=cache)  # online again: the missing file is fetched, and only that one
    n = len(hub.requests)
    assert resolve_model("acme/tiny", store_root=tmp_path / "store").revision == repos["tiny"]
    assert fetched(hub, "acme/tiny", hub.requests_since(n)) == ["tokenizer.json"]


def test_unreachable_hub_falls_back_to_the_cache(hub, repos, in_process, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cache = in_process(dead)
    with pytest.raises(RidgefillError) as info:
        resolve_model("acme/tiny", store_root=tmp_path / "store")
    assert not isinstance(info.value, BadInput)  # exit 1: a failure, not the user's input
    message = str(info.value)
    assert message.startswith(f"cannot reach the Hub at {dead} (")
    assert message.endswith(f") and acme/tiny is not in the local Hugging Face cache ({cache})")
    assert "\n" not in message

    in_process(hub.url, cache=cache)
    online = resolve_model("acme/tiny", store_root=tmp_path / "store")
    in_process(dead, cache=cache)
    assert resolve_model("acme/tiny", store_root=tmp_path / "store") == online
    shutil.rmtree(cache)


def test_download_patterns_take_top_level_config_tokenizer_and_safetensors_only():
    """The patterns as huggingface_hub applies them (fnmatch, where `*` also crosses '/')."""
    from huggingface_hub.utils import filter_repo_objects

    from ridgefill.hub.snapshot import ALLOW_PATTERNS, IGNORE_PATTERNS

    wanted = ["added_tokens.json", "chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
              "model-00001-of-00002.safetensors", "model.safetensors.index.json", "qwen.tiktoken",
              "special_tokens_map.json", "spiece.model", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
              "vocab.json"]
    unwanted = ["pytorch_model.bin", "training_args.bin", "tokenizer.pt", "optimizer.pkl", "flax_model.msgpack",
                "tf_model.h5", "onnx/model.safetensors", "original/tokenizer.model", "sub/config.json", "README.md",
                ".gitattributes", "model.onnx"]
    assert sorted(filter_repo_objects(wanted + unwanted, allow_patterns=ALLOW_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS)) == wanted


def test_later_stages_load_the_captured_commit_after_the_branch_moved(hub, repos, tiny_llama, corpus, tmp_path):
    """solve re-resolves a hub capture at the commit it was made from, not at wherever the branch is now."""
    files = model_files(tiny_llama)
    hub.create_repo("acme/moving")
    first = hub.put_files("acme/moving", files)
    cache, store = tmp_path / "hf-cache", tmp_path / "store"
    r = capture(hub, "acme/moving", corpus, store, cache)
    assert r.returncode == 0, r.stderr
    hub.put_files("acme/moving", {"model.safetensors": perturbed(files["model.safetensors"])})
    assert hub.resolve("acme/moving").sha != first
    s = cli("solve", r.stdout.strip(), "--alpha", "0.01", "--store", store, env=hub_env(hub, cache))
    assert s.returncode == 0, s.stderr
    # with the branch as given, the weights differ: that is refused, by name
    s = cli("solve", r.stdout.strip(), "--model", "acme/moving", "--store", store, env=hub_env(hub, cache))
    assert s.returncode == 2 and "was made with a different model" in one_line_error(s)
