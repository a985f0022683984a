"""`ridgefill push` / `ridgefill pull` through the real CLI against a local Hub-compatible server.

The server (tests/hubserver.py) speaks the endpoints huggingface_hub's client uses and keeps what it receives,
so the tests assert on what arrived: stored bytes, commits per push, the request log, the Authorization header.
Release folders are written without a model (small random int8 maps), as in test_release.py.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
from clirun import cli
from hubserver import HubServer, Token

from ridgefill.formats import int8, release
from ridgefill.export.card import model_card
from ridgefill.formats.release import CARD, MANIFEST, MAPS_FILE

WRITE = "hf_rfWRITE_5e1f0c9a7b3d4e2f8a6c"  # alice, may write to alice/* and acme/*
READ = "hf_rfREAD_0a9b8c7d6e5f4a3b2c1d"  # alice, read-only
LEAK = "hf_rfLEAKCHECK_7c1e9d4b2a6f3e8d5c0b"  # only used by the token-leak test
HUB_ONLY = ("HF_", "HUGGINGFACE")  # inherited variables that would point the client elsewhere


@pytest.fixture(scope="module")
def hub():
    tokens = {WRITE: Token("alice", orgs=("acme",)), READ: Token("alice", orgs=("acme",), write=False),
              LEAK: Token("alice", orgs=("acme",))}
    with HubServer(tokens=tokens) as server:
        yield server


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hfhome")


def hub_env(hub: HubServer, home: Path, token: str | None = WRITE, endpoint: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(HUB_ONLY)}
    env.update(HF_ENDPOINT=endpoint or hub.url, HF_HOME=str(home), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if token:
        env["HF_TOKEN"] = token
    return env


def run(hub, home, *args, token: str | None = WRITE, **kw):
    return cli(*args, env=hub_env(hub, home, token, **kw))


def write_release(path: Path, seed: int = 0, overwrite: bool = False) -> Path:
    rng = np.random.default_rng(seed)
    maps = {}
    for layer in (5, 6):
        codes, bits = int8.quantize((rng.standard_normal((48, 160)) * 0.05).astype(np.float32))
        maps[layer] = {"codes": codes, "scale_bits": bits, "bias": rng.standard_normal(48).astype(np.float32)}
    manifest = {"model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "architecture": "llama", "num_layers": 7,
                          "hidden_size": 160, "num_kv_heads": 2, "head_dim": 12, "fingerprint": "ab" * 32},  # kv maps [48, 160]
                "split": 5, "tail_default": 512, "layers": [{"index": i, "kind": "attention", "map": "kv"} for i in (5, 6)],
                "fit": {"alpha": 1e-4, "seed": seed, "exact_norm": 812.5, "skip_first_rows": 1}}
    card = model_card({**manifest, "format": release.FORMAT, "projector": {"dtype": "int8", "group_size": 128}})
    release.write_release(path, maps, manifest, card, overwrite=overwrite)
    return path


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def remote_files(hub: HubServer, repo_id: str, rev: str = "main") -> dict[str, bytes]:
    return {p: hub.read(repo_id, p, rev) for p in sorted(hub.resolve(repo_id, rev).files) if p != ".gitattributes"}


def one_line_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".")], list(parent.iterdir())


@pytest.fixture(scope="module")
def published(hub, home, tmp_path_factory):
    """acme/maps with release v1 pushed once (human output)."""
    folder = write_release(tmp_path_factory.mktemp("pub") / "rel")
    n = len(hub.requests)
    r = run(hub, home, "push", folder, "--repo", "acme/maps")
    assert r.returncode == 0, r.stderr
    return folder, r, hub.requests_since(n)


# ------------------------------------------------------------------------------------------------ push


def test_push_creates_repo_and_one_commit_equal_to_the_folder(hub, published):
    folder, r, log = published
    sha = r.stdout.strip()
    assert r.stdout == f"{sha}\n" and len(sha) == 40  # stdout: the commit sha only
    assert f"{hub.url}/acme/maps/commit/{sha}" in r.stderr  # the commit URL on stderr
    # the system commit that created the repo, then exactly one commit from the push
    assert hub.history("acme/maps") == [sha, hub.resolve("acme/maps").parent]
    assert hub.repo("acme/maps").commits[hub.history("acme/maps")[1]].summary == "initial commit"
    assert remote_files(hub, "acme/maps") == files_of(folder)
    assert ".gitattributes" in hub.resolve("acme/maps").files
    # the weights took the git-LFS path (batch, signed PUT to the other origin, verify), text went inline
    assert hub.resolve("acme/maps").files[MAPS_FILE].lfs is not None
    assert hub.resolve("acme/maps").files[MANIFEST].lfs is None
    assert [q["path"] for q in log if q["server"] == "cdn"] == [
        f"/upload/acme/maps/{hub.resolve('acme/maps').files[MAPS_FILE].lfs}"]
    assert sum(q["path"] == "/api/models/acme/maps/commit/main" for q in log) == 1


def test_repush_is_a_no_op(hub, home, published):
    folder, first, _ = published
    sha = first.stdout.strip()
    history = hub.history("acme/maps")
    n = len(hub.requests)
    r = run(hub, home, "push", folder, "--repo", "acme/maps", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc == {"repo": "acme/maps", "revision": "main", "commit": sha, "unchanged": True,
                   "url": f"{hub.url}/acme/maps/commit/{sha}", "files": [CARD, MAPS_FILE, MANIFEST]}
    assert f"unchanged: acme/maps@main already at {sha}" in r.stderr
    assert hub.history("acme/maps") == history
    writes = [q["path"] for q in hub.requests_since(n)
              if q["server"] == "cdn" or "/preupload/" in q["path"] or "/commit/" in q["path"] or ".git/" in q["path"]]
    assert writes == []


def test_changed_release_is_one_new_commit_and_the_old_sha_still_pulls(hub, home, tmp_path):
    v1 = files_of(write_release(tmp_path / "rel", seed=1))
    r1 = run(hub, home, "push", tmp_path / "rel", "--repo", "acme/evolving", "--json")
    assert r1.returncode == 0, r1.stderr
    old = json.loads(r1.stdout)["commit"]
    write_release(tmp_path / "rel", seed=2, overwrite=True)
    v2 = files_of(tmp_path / "rel")
    assert v2[MAPS_FILE] != v1[MAPS_FILE]
    r2 = run(hub, home, "push", tmp_path / "rel", "--repo", "acme/evolving", "--json",
             "--commit-message", "refit with seed 2")
    assert r2.returncode == 0, r2.stderr
    doc = json.loads(r2.stdout)
    assert doc["unchanged"] is False and doc["commit"] != old
    assert hub.history("acme/evolving")[:2] == [doc["commit"], old]  # exactly one new commit
    assert hub.resolve("acme/evolving").summary == "refit with seed 2"
    assert remote_files(hub, "acme/evolving") == v2

    r = run(hub, home, "pull", f"acme/evolving@{old}", "--out", tmp_path / "old", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["commit"] == old
    assert files_of(tmp_path / "old") == v1
    r = run(hub, home, "pull", "acme/evolving", "--out", tmp_path / "new")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{doc['commit']}\n"
    assert files_of(tmp_path / "new") == v2


@pytest.mark.parametrize("damage", ["tampered", "no-manifest", "unlisted-dotfile", "edited-fact"])
def test_push_refuses_a_bad_folder_and_sends_nothing(hub, home, tmp_path, damage):
    folder = write_release(tmp_path / "rel")
    if damage == "edited-fact":  # a fact the hash of maps.safetensors covers
        m = json.loads((folder / MANIFEST).read_text())
        m["split"] = 6
        (folder / MANIFEST).write_text(json.dumps(m))
        named = f"{MANIFEST}: 'split' is 6 but {MAPS_FILE} records 5 (the manifest was edited)"
    elif damage == "tampered":
        data = bytearray((folder / MAPS_FILE).read_bytes())
        data[-1] ^= 1
        (folder / MAPS_FILE).write_bytes(bytes(data))
        named = MAPS_FILE
    elif damage == "no-manifest":
        (folder / MANIFEST).unlink()
        named = MANIFEST
    else:
        (folder / ".DS_Store").write_bytes(b"\0")
        named = ".DS_Store"
    n = len(hub.requests)
    r = run(hub, home, "push", folder, "--repo", "acme/bad")
    assert r.returncode == 2
    assert one_line_error(r).startswith(f"Error: {named}" + ("" if damage == "edited-fact" else ": "))
    assert r.stdout == ""
    assert hub.requests_since(n) == [] and "acme/bad" not in hub.repos


# ------------------------------------------------------------------------------------------------ pull


def test_pull_verifies_and_equals_the_source(hub, home, published, tmp_path):
    folder, first, _ = published
    out = tmp_path / "pulled"
    r = run(hub, home, "pull", "acme/maps", "--out", out, "--json", token=None)  # public repo: no token needed
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"repo": "acme/maps", "revision": "main", "commit": first.stdout.strip(),
                                    "out": str(out), "files": [CARD, MAPS_FILE, MANIFEST]}
    assert files_of(out) == files_of(folder)
    release.verify_release(out)
    no_leftovers(tmp_path)
    # pulling again into the same release is fine (named as RIDGEFILL_RELEASE names it, hf://, too); into another
    # release only with --force
    r = run(hub, home, "pull", "acme/maps", "--out", out)
    assert r.returncode == 0 and "unchanged" in r.stderr, r.stderr
    r = run(hub, home, "pull", "hf://acme/maps@main", "--out", out)
    assert r.returncode == 0 and "unchanged" in r.stderr, r.stderr
    other = write_release(tmp_path / "other", seed=9)
    r = run(hub, home, "pull", "acme/maps", "--out", other)
    assert r.returncode == 2 and "holds a different release" in one_line_error(r)
    assert files_of(other) != files_of(folder)
    r = run(hub, home, "pull", "acme/maps", "--out", other, "--force")
    assert r.returncode == 0, r.stderr
    assert files_of(other) == files_of(folder)
    no_leftovers(tmp_path)


@pytest.mark.parametrize("change", ["flip-byte", "truncate"])
def test_pull_refuses_a_tampered_remote_file_and_writes_nothing(hub, home, tmp_path, change):
    repo_id = f"acme/tampered-{change}"
    hub.create_repo(repo_id)
    hub.put_files(repo_id, files_of(write_release(tmp_path / "src")))
    assert hub.resolve(repo_id).files[MAPS_FILE].lfs  # stored as an upload would store it
    hub.tamper(repo_id, MAPS_FILE, (lambda b: b[:-1] + bytes([b[-1] ^ 1])) if change == "flip-byte" else
               (lambda b: b[:-8]))
    r = run(hub, home, "pull", repo_id, "--out", tmp_path / "out" / "rel")
    assert r.returncode == 2
    assert one_line_error(r).startswith(f"Error: {MAPS_FILE}: ")
    assert not (tmp_path / "out" / "rel").exists()
    no_leftovers(tmp_path / "out")


def test_pull_refuses_a_remote_manifest_whose_facts_were_edited(hub, home, tmp_path):
    repo_id = "acme/edited"
    hub.create_repo(repo_id)
    files = files_of(write_release(tmp_path / "src"))
    m = json.loads(files[MANIFEST])
    m["layers"][1]["kind"] = "sliding_attention"
    hub.put_files(repo_id, {**files, MANIFEST: json.dumps(m).encode()})
    r = run(hub, home, "pull", repo_id, "--out", tmp_path / "out" / "rel")
    assert r.returncode == 2
    assert one_line_error(r).startswith(f"Error: {MANIFEST}: 'layers[1].kind' is \"sliding_attention\" but "
                                        f"{MAPS_FILE} records \"attention\" (the manifest was edited); pulled from ")
    assert not (tmp_path / "out" / "rel").exists()
    no_leftovers(tmp_path / "out")


def test_a_release_fetched_with_hf_download_verifies(hub, home, tmp_path):
    """`hf download REPO --local-dir DIR` leaves the Hub's .gitattributes and its own .cache/huggingface/ in DIR:
    the folder verifies, loads, pushes back unchanged; anything else added to it is still refused."""
    import subprocess
    import sys

    repo_id = "acme/fetched"
    src = write_release(tmp_path / "src", seed=5)
    assert run(hub, home, "push", src, "--repo", repo_id).returncode == 0
    out = tmp_path / "dl"
    hf = Path(sys.executable).with_name("hf")
    r = subprocess.run([str(hf), "download", repo_id, "--local-dir", str(out)], capture_output=True, text=True,
                       env=hub_env(hub, home, token=None))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([".cache", ".gitattributes", CARD, MAPS_FILE, MANIFEST])
    assert [p.name for p in (out / ".cache").iterdir()] == ["huggingface"]
    assert (out / ".cache" / "huggingface" / "download" / f"{MAPS_FILE}.metadata").is_file()
    r = run(hub, home, "verify", out)
    assert r.returncode == 0, r.stderr
    assert f"1 file(s) match {MANIFEST} ({MAPS_FILE}), and its facts match those {MAPS_FILE} records" in r.stderr
    assert release.load_release(out)[0] == release.verify_release(src)
    r = run(hub, home, "push", out, "--repo", repo_id, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["unchanged"] is True, r.stderr
    (out / ".cache" / "notes").mkdir()
    r = run(hub, home, "verify", out)
    assert r.returncode == 2
    assert one_line_error(r) == f"Error: .cache: in the release folder but not listed in {MANIFEST}"


def test_pull_downloads_only_the_listed_files(hub, home, tmp_path):
    repo_id = "acme/extras"
    hub.create_repo(repo_id)
    src = files_of(write_release(tmp_path / "src"))
    hub.put_files(repo_id, {**src, "notes.txt": b"unlisted\n", "sub/extra.bin": b"\0\1\2"})
    n = len(hub.requests)
    r = run(hub, home, "pull", repo_id, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert files_of(tmp_path / "out") == src
    log = hub.requests_since(n)
    fetched = [q["path"].split("/resolve/")[1].split("/", 1)[1] for q in log if "/resolve/" in q["path"]]
    assert fetched[0] == MANIFEST and set(fetched) == {MANIFEST, MAPS_FILE, CARD}
    assert not any(".gitattributes" in q["path"] or "/tree/" in q["path"] for q in log)
    cdn = [q["path"] for q in log if q["server"] == "cdn"]
    assert cdn == [f"/blobs/acme/extras/{hub.resolve(repo_id).files[MAPS_FILE].lfs}"]

    # push makes the remote equal the release: the stale files go, .gitattributes stays, in one commit
    before = hub.history(repo_id)
    r = run(hub, home, "push", tmp_path / "src", "--repo", repo_id)
    assert r.returncode == 0, r.stderr
    assert hub.history(repo_id)[1:] == before
    assert set(hub.resolve(repo_id).files) == {".gitattributes", *src}


def test_branch_push_and_pull(hub, home, published, tmp_path):
    folder = write_release(tmp_path / "dev", seed=3)
    main_head = hub.history("acme/maps")[0]
    r = run(hub, home, "push", folder, "--repo", "acme/maps", "--revision", "dev", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["revision"] == "dev" and doc["unchanged"] is False
    assert hub.history("acme/maps", "dev")[:2] == [doc["commit"], main_head]  # branched from main, one commit
    assert hub.history("acme/maps")[0] == main_head  # main untouched
    assert remote_files(hub, "acme/maps", "dev") == files_of(folder)
    r = run(hub, home, "push", folder, "--repo", "acme/maps", "--revision", "dev")  # human mode: stdout = the sha
    assert r.returncode == 0 and r.stdout == f"{doc['commit']}\n"
    assert f"unchanged: acme/maps@dev already at {doc['commit']}" in r.stderr
    r = run(hub, home, "pull", "acme/maps@dev", "--out", tmp_path / "pulled")
    assert r.returncode == 0, r.stderr
    assert files_of(tmp_path / "pulled") == files_of(folder)


# ------------------------------------------------------------------------------------------ tokens, errors


def test_token_never_leaks(hub, home, tmp_path):
    folder = write_release(tmp_path / "rel", seed=4)
    n = len(hub.requests)
    runs = [run(hub, home, "push", folder, "--repo", "acme/secret", "--private", "--token", LEAK, "--json", token=None),
            run(hub, home, "pull", "acme/secret", "--out", tmp_path / "a", "--token", LEAK, token=None),
            run(hub, home, "pull", "acme/secret", "--out", tmp_path / "b", "--json", token=LEAK)]  # via HF_TOKEN
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert LEAK not in r.stdout and LEAK not in r.stderr
    assert hub.repo("acme/secret").private
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b") == files_of(folder)

    log = hub.requests_since(n)
    for q in log:
        assert LEAK not in q["path"] and LEAK not in json.dumps(q["query"])
        assert LEAK.encode() not in q["body"]
        assert not any(LEAK in v for k, v in q["headers"].items() if k != "authorization")
        if q["server"] == "hub":  # the token travels to the Hub, and only in the Authorization header
            assert q["headers"].get("authorization") == f"Bearer {LEAK}"
        else:  # never to the storage origin
            assert "authorization" not in q["headers"]
    repo = hub.repo("acme/secret")
    stored = [*repo.objects.values(), *repo.lfs.values()]
    stored += [f"{c.summary}\n{c.description}\n{c.author}".encode() for c in repo.commits.values()]
    assert not any(LEAK.encode() in blob for blob in stored)
    for p in [*tmp_path.rglob("*"), *home.rglob("*")]:  # release folders, pulled folders, the HF home
        assert p.is_dir() or LEAK.encode() not in p.read_bytes(), p

    r = run(hub, home, "pull", "acme/secret", "--out", tmp_path / "c", token=None)  # private: not without a token
    assert r.returncode == 2 and "acme/secret: repository not found" in one_line_error(r)

    # a refused token: bad input (exit 2) as for a model download, one line, and the (wrong) token is not echoed
    bad = "hf_rfWRONG_1d2c3b4a5f6e7d8c9b0a"
    r = run(hub, home, "push", folder, "--repo", "acme/secret", "--token", bad, token=None)
    assert r.returncode == 2
    errors = [line for line in r.stderr.strip().splitlines() if not line.startswith("Warning: ")]  # --token warns
    assert len(errors) == 1 and errors[0].startswith(f"Error: acme/secret: the Hub at {hub.url} refused the token "
                                                     "(401: "), r.stderr
    assert bad not in r.stderr + r.stdout and "Traceback" not in r.stderr


def test_push_needs_a_token_with_write_access(hub, home, published, tmp_path):
    folder, _, _ = published
    r = run(hub, home, "push", folder, "--repo", "acme/nope", token=None)
    assert r.returncode == 1 and "no Hub token" in one_line_error(r)
    r = run(hub, home, "push", folder, "--repo", "acme/readonly", token=READ)
    assert r.returncode == 2 and f"acme/readonly: the Hub at {hub.url} refused access (403: " in one_line_error(r)
    assert READ not in r.stderr
    assert "acme/nope" not in hub.repos and "acme/readonly" not in hub.repos


def test_pull_errors(hub, home, published, tmp_path):
    r = run(hub, home, "pull", "acme/missing", "--out", tmp_path / "x")
    assert r.returncode == 2 and "acme/missing: repository not found" in one_line_error(r)
    r = run(hub, home, "pull", "acme/maps@nope", "--out", tmp_path / "x")
    assert r.returncode == 2 and "acme/maps@nope: revision not found" in one_line_error(r)
    r = run(hub, home, "pull", "not-a-repo-id", "--out", tmp_path / "x")
    assert r.returncode == 2 and "not a Hub repo id" in one_line_error(r)
    assert not (tmp_path / "x").exists()
    # a non-empty folder that is not a release is refused before anything is downloaded
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "keep.txt").write_text("mine")
    n = len(hub.requests)
    r = run(hub, home, "pull", "acme/maps", "--out", tmp_path / "docs")
    assert r.returncode == 2 and "not a release folder" in one_line_error(r)
    assert hub.requests_since(n) == [] and (tmp_path / "docs" / "keep.txt").read_text() == "mine"


def test_unreachable_hub_is_a_failure_that_names_the_endpoint(hub, home, published, tmp_path):
    """No network (nothing listens at HF_ENDPOINT): exit 1, as for a model download with nothing cached -- the
    input is fine and the same command works once the Hub answers; one line, nothing written."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    folder, _, _ = published
    before = files_of(folder)
    for args, where in ((("push", folder, "--repo", "acme/maps"), "acme/maps@main"),
                        (("pull", "acme/maps", "--out", tmp_path / "out" / "x"), "acme/maps@main"),
                        (("pull", "acme/maps@v9", "--out", tmp_path / "out" / "x", "--json"), "acme/maps@v9")):
        r = run(hub, home, *args, endpoint=dead)
        assert r.returncode == 1 and r.stdout == ""
        line = one_line_error(r)
        assert line.startswith(f"Error: cannot reach the Hub at {dead} (ConnectError: ") and line.endswith(
            f") for {where}"), line
    assert not (tmp_path / "out").exists()
    assert files_of(folder) == before
    r = run(hub, home, "pull", "acme/maps", "--out", tmp_path / "out" / "x")  # the same command, Hub back
    assert r.returncode == 0, r.stderr
    assert files_of(tmp_path / "out" / "x") == before


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_pull_and_push_are_bad_input_before_any_request(hub, home, published, tmp_path, variable):
    """pull and push keep no cache, so with HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set there is nothing they can
    do: the user's own setting refuses what was asked, exit 2 as a model download offline with nothing cached is;
    one line, not one request, nothing written."""
    folder, _, _ = published
    before = files_of(folder)
    env = {**hub_env(hub, home), variable: "1"}
    n = len(hub.requests)
    for args, where in ((("pull", "acme/maps", "--out", tmp_path / "out" / "x"), "acme/maps@main"),
                        (("pull", "acme/maps@dev", "--out", tmp_path / "out" / "x", "--json"), "acme/maps@dev"),
                        (("push", folder, "--repo", "acme/offline"), "acme/offline@main")):
        r = cli(*args, env=env)
        assert r.returncode == 2 and r.stdout == ""
        command = args[0]
        assert one_line_error(r) == (f"Error: {where}: {variable} is set, and {command} needs the Hub at {hub.url} "
                                     f"({command} keeps no cache); unset {variable} to {command}")
    assert hub.requests_since(n) == [] and "acme/offline" not in hub.repos
    assert not (tmp_path / "out").exists()
    assert files_of(folder) == before
