"""Which weights a Hub model download fetches (ridgefill/hub/snapshot.py), against the local Hub server.

A repo may hold more than one copy of its weights: sharded files with `model.safetensors.index.json` and, next to
them, a `consolidated.safetensors` (Mistral's repos). A download takes one set, the one transformers loads:
`model.safetensors`; else the index and exactly the shards its weight_map names; else every top-level
`*.safetensors`. The tests assert the snapshot's file set exactly, what was asked of the server (and in which
order), that the model resolves and loads from the snapshot, that its fingerprint is the one of the same files in a
plain directory, and that the cached snapshot is complete for an offline or unreachable run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
from hubserver import HubServer

from ridgefill.errors import BadInput, RidgefillError
from ridgefill.models import load_model, resolve_model

HUB_ONLY = ("HF_", "HUGGINGFACE", "TRANSFORMERS_OFFLINE")
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
CONSOLIDATED = "consolidated.safetensors"
FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def sharded(folder: Path) -> dict[str, bytes]:
    """The tiny llama's files with its weights split in two shards and an index, as save_pretrained writes them."""
    from safetensors.torch import load_file, save

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    out = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "model.safetensors"}
    weight_map = {}
    for shard, part in zip(SHARDS, (names[:half], names[half:])):
        out[shard] = save({n: tensors[n] for n in part}, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    out[INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
    return out


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


def consolidated(folder: Path) -> bytes:
    """The same weights once more in one file, under other tensor names, as Mistral's repos carry them."""
    from safetensors.torch import load_file, save

    return save({f"consolidated.{k}": v for k, v in load_file(folder / "model.safetensors").items()})


@pytest.fixture(scope="module")
def files(tiny_llama) -> dict[str, dict[str, bytes]]:
    plain = {p.name: p.read_bytes() for p in tiny_llama.iterdir()}
    shards = sharded(tiny_llama)
    return {"plain": plain, "shards": shards, "mistral": {**shards, CONSOLIDATED: consolidated(tiny_llama)}}


@pytest.fixture(scope="module")
def repos(hub, files):
    def make(repo_id: str, content: dict[str, bytes]) -> str:
        hub.create_repo(repo_id)
        return hub.put_files(repo_id, content)

    return {"mistral": make("acme/mistral", {**files["mistral"], "pytorch_model.bin": b"PK\3\4 pickle" * 4}),
            "shards": make("acme/shards", files["shards"]),
            "both": make("acme/both", {**files["mistral"], "model.safetensors": files["plain"]["model.safetensors"]}),
            "loose": make("acme/loose", {**files["plain"], CONSOLIDATED: files["mistral"][CONSOLIDATED]})}


@pytest.fixture
def point(monkeypatch, tmp_path):
    """Point this process at a Hub and a cache through the environment, as a user's shell would."""

    def to(endpoint: str, cache: Path | None = None, offline: bool = False) -> Path:
        cache = cache or tmp_path / "hf-cache"
        for k in [k for k in os.environ if k.startswith(HUB_ONLY)]:
            monkeypatch.delenv(k)
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if offline:
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        return cache

    return to


def dead_endpoint() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def snapshot_dir(cache: Path, repo_id: str, sha: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / sha


def asked(log: list[dict]) -> list[str]:
    """Repo paths asked for on /resolve/ (HEAD or GET), in order."""
    return [q["path"].split("/resolve/", 1)[1].split("/", 1)[1] for q in log if "/resolve/" in q["path"]]


def fetched(hub, repo_id: str, log: list[dict]) -> list[str]:
    """Repo paths whose content was downloaded, in order: GET on /resolve/ for regular files, the GET of the LFS
    object from the storage origin for LFS files."""
    lfs = {e.lfs: path for c in hub.repo(repo_id).commits.values() for path, e in c.files.items() if e.lfs}
    out = []
    for q in log:
        if q["method"] != "GET":
            continue
        if q["server"] == "cdn":
            out.append(lfs[q["path"].rsplit("/", 1)[1]])
        elif "/resolve/" in q["path"]:
            out.append(q["path"].split("/resolve/", 1)[1].split("/", 1)[1])
    return out


def fingerprint(hub, repo_id: str, weights) -> str:
    """The documented formula over the served files, the weights' sha256 being the Hub's LFS oid."""
    commit = hub.resolve(repo_id)
    tok = hashlib.sha256()
    for name in sorted(("chat_template.jinja", "tokenizer.json", "tokenizer_config.json")):
        data = hub.read(repo_id, name)
        tok.update(f"{name}\0{len(data)}\0".encode() + data)
    doc = {"config": hashlib.sha256(hub.read(repo_id, "config.json")).hexdigest(), "tokenizer": tok.hexdigest(),
           "weights": {w: commit.files[w].lfs for w in weights}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------ one set


def test_sharded_repo_with_consolidated_weights_downloads_the_shards_once(hub, repos, files, point, tmp_path):
    cache = point(hub.url)
    n = len(hub.requests)
    ref = resolve_model("acme/mistral", store_root=tmp_path / "store")
    log = hub.requests_since(n)

    snap = snapshot_dir(cache, "acme/mistral", repos["mistral"])
    assert sorted(p.name for p in snap.iterdir()) == sorted({*FILES, INDEX, *SHARDS})
    for name in (*FILES, INDEX, *SHARDS):
        assert (snap / name).read_bytes() == files["mistral"][name], name
    # consolidated.safetensors (and the pickle) never asked for, not even a HEAD; every wanted file fetched once;
    # the index came first, and named the shards that followed
    assert not [q for q in log if CONSOLIDATED in q["path"] or ".bin" in q["path"]]
    got = fetched(hub, "acme/mistral", log)
    assert sorted(got) == sorted({*FILES, INDEX, *SHARDS})
    weights = [f for f in got if "safetensors" in f]
    assert weights[0] == INDEX and sorted(weights[1:]) == sorted(SHARDS)
    blobs = [p.read_bytes() for p in (cache / "models--acme--mistral" / "blobs").iterdir()]
    assert files["mistral"][CONSOLIDATED] not in blobs

    # the model resolves from the snapshot, fingerprinted over what was downloaded
    assert (ref.kind, ref.name, ref.revision, ref.model_type, ref.num_layers) == (
        "hub", "acme/mistral", repos["mistral"], "llama", 4)
    assert ref.fingerprint == fingerprint(hub, "acme/mistral", SHARDS)
    local = tmp_path / "local"
    local.mkdir()
    for name, data in files["shards"].items():
        (local / name).write_bytes(data)
    assert resolve_model(str(local), store_root=tmp_path / "store").fingerprint == ref.fingerprint

    # and it loads: transformers reads the shards through the index
    from safetensors.torch import load_file

    lm = load_model(ref, store_root=tmp_path / "store")
    state = lm.model.state_dict()
    for shard in SHARDS:
        for name, tensor in load_file(snap / shard).items():
            assert state[name].equal(tensor), name


def test_a_consolidated_copy_does_not_change_a_sharded_repos_fingerprint(hub, repos, point, tmp_path):
    """acme/shards holds the shards and the index only (a normal sharded repo): the same download and the same
    fingerprint as before, and the same as acme/mistral's, whose extra copy of the weights is not fetched."""
    cache = point(hub.url)
    n = len(hub.requests)
    ref = resolve_model("acme/shards", store_root=tmp_path / "store")
    assert sorted(fetched(hub, "acme/shards", hub.requests_since(n))) == sorted({*FILES, INDEX, *SHARDS})
    assert sorted(p.name for p in snapshot_dir(cache, "acme/shards", repos["shards"]).iterdir()) == sorted(
        {*FILES, INDEX, *SHARDS})
    assert ref.fingerprint == fingerprint(hub, "acme/shards", SHARDS)
    assert ref.fingerprint == resolve_model("acme/mistral", store_root=tmp_path / "store").fingerprint


def test_model_safetensors_wins_and_a_repo_without_index_keeps_every_safetensors(hub, repos, files, point, tmp_path):
    """transformers loads model.safetensors when the repo has it, whatever else is there; with neither it nor an
    index, every top-level *.safetensors is fetched, as before."""
    cache = point(hub.url)
    n = len(hub.requests)
    ref = resolve_model("acme/both", store_root=tmp_path / "store")
    log = hub.requests_since(n)
    assert sorted(fetched(hub, "acme/both", log)) == sorted(set(asked(log))) == sorted({*FILES, "model.safetensors"})
    assert sorted(p.name for p in snapshot_dir(cache, "acme/both", repos["both"]).iterdir()) == sorted(
        {*FILES, "model.safetensors"})
    assert ref.fingerprint == fingerprint(hub, "acme/both", ["model.safetensors"])

    n = len(hub.requests)
    resolve_model("acme/loose", store_root=tmp_path / "store")
    assert sorted(fetched(hub, "acme/loose", hub.requests_since(n))) == sorted(
        {*FILES, "model.safetensors"})  # model.safetensors present: consolidated.safetensors is not fetched
    hub.create_repo("acme/consolidated-only")
    sha = hub.put_files("acme/consolidated-only", {**{k: v for k, v in files["plain"].items()
                                                      if k != "model.safetensors"},
                                                   CONSOLIDATED: files["mistral"][CONSOLIDATED]})
    resolve_model("acme/consolidated-only", store_root=tmp_path / "store")
    assert sorted(p.name for p in snapshot_dir(cache, "acme/consolidated-only", sha).iterdir()) == sorted(
        {*FILES, CONSOLIDATED})


@pytest.mark.parametrize("case", ["unlisted-shard", "sub-folder", "no-weight-map", "not-json"])
def test_a_bad_index_is_refused_before_any_weight_is_fetched(hub, files, point, tmp_path, case):
    index = json.loads(files["shards"][INDEX])
    if case == "unlisted-shard":
        index["weight_map"][min(index["weight_map"])] = "model-00003-of-00002.safetensors"
        why = "model.safetensors.index.json names model-00003-of-00002.safetensors, which is not in the repo"
    elif case == "sub-folder":
        index["weight_map"][min(index["weight_map"])] = "original/model.safetensors"
        why = ("model.safetensors.index.json maps a tensor to 'original/model.safetensors', which is not a "
               "top-level *.safetensors file")
    elif case == "no-weight-map":
        index = {"metadata": {}}
        why = "model.safetensors.index.json has no weight_map naming the shard files"
    repo_id = f"acme/bad-{case}"
    hub.create_repo(repo_id)
    body = b"{not json" if case == "not-json" else json.dumps(index).encode()
    sha = hub.put_files(repo_id, {**files["shards"], INDEX: body, "original/model.safetensors": b"\0" * 8})
    if case == "not-json":
        why = "model.safetensors.index.json is not valid JSON (Expecting property name enclosed in double quotes: "
    point(hub.url)
    n = len(hub.requests)
    with pytest.raises(BadInput) as info:
        resolve_model(repo_id, store_root=tmp_path / "store")
    assert str(info.value).startswith(f"{repo_id} (commit {sha[:12]}): {why}")
    assert "\n" not in str(info.value)
    assert [f for f in fetched(hub, repo_id, hub.requests_since(n))] == [INDEX]
    assert not (tmp_path / "store").exists()


# ------------------------------------------------------------------------------------ offline, unreachable


def test_the_narrow_snapshot_is_complete_offline_and_when_the_hub_is_unreachable(hub, repos, point, tmp_path):
    """huggingface_hub checks an offline snapshot against the file list it cached and the patterns asked for: the
    download must ask offline for what it fetched online, or a snapshot without consolidated.safetensors would be
    called incomplete."""
    cache = point(hub.url)
    online = resolve_model("acme/mistral", store_root=tmp_path / "store")
    assert (cache / "models--acme--mistral" / "trees" / f"{repos['mistral']}.json").is_file()
    n = len(hub.requests)
    for endpoint, offline in ((hub.url, True), (dead_endpoint(), False)):
        point(endpoint, cache=cache, offline=offline)
        for spec in ("acme/mistral", f"acme/mistral@{repos['mistral']}"):
            ref = resolve_model(spec, store_root=tmp_path / "store")
            assert (ref.revision, ref.fingerprint) == (online.revision, online.fingerprint)
    assert hub.requests_since(n) == []


@pytest.mark.parametrize("how", ["offline", "unreachable"])
@pytest.mark.parametrize("listing", ["cached", "not-cached"])
def test_a_snapshot_missing_a_shard_is_incomplete(hub, repos, point, monkeypatch, tmp_path, listing, how):
    """Offline (HF_HUB_OFFLINE=1), an incomplete snapshot is bad input (exit 2); with the Hub out of reach it is a
    failure (exit 1). With the file list huggingface_hub cached, it tells; without one, the snapshot's index does."""
    cache = point(hub.url)
    resolve_model("acme/mistral", store_root=tmp_path / "store")
    link = snapshot_dir(cache, "acme/mistral", repos["mistral"]) / SHARDS[1]
    Path(os.path.realpath(link)).unlink()  # an interrupted download: neither the blob nor the snapshot link
    link.unlink()
    if listing == "not-cached":  # a cache written without the file list (an older huggingface_hub)
        import huggingface_hub._tree_cache as tree_cache

        shutil.rmtree(cache / "models--acme--mistral" / "trees")
        monkeypatch.setattr(tree_cache, "_IN_MEMORY_TREE_CACHE", {})
    dead = dead_endpoint()
    if how == "offline":
        point(hub.url, cache=cache, offline=True)
    else:
        point(dead, cache=cache)
    with pytest.raises(RidgefillError) as info:
        resolve_model("acme/mistral", store_root=tmp_path / "store")
    missing = "" if listing == "cached" else f" ({SHARDS[1]} is missing)"
    if how == "offline":
        assert isinstance(info.value, BadInput)
        assert str(info.value) == (f"acme/mistral: the cached snapshot in {cache} is incomplete{missing} and "
                                   "HF_HUB_OFFLINE is set; run again with network access to finish the download")
    else:
        assert not isinstance(info.value, BadInput)
        assert str(info.value) == (f"acme/mistral: the cached snapshot in {cache} is incomplete{missing} and the Hub "
                                   f"at {dead} cannot be reached; run again when it answers to finish the download")
    point(hub.url, cache=cache)  # online again: the missing shard is fetched, and only that one
    n = len(hub.requests)
    assert resolve_model("acme/mistral", store_root=tmp_path / "store").revision == repos["mistral"]
    assert fetched(hub, "acme/mistral", hub.requests_since(n)) == [SHARDS[1]]
