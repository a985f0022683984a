"""One spelling of a release wherever one is named (`ridgefill.hub.releases.locate_release`): eval, engine prefix,
push, verify, the Python loader `load_release_maps`, RIDGEFILL_RELEASE (tests/test_vllm_plan.py) and the bench scripts.

`hf://owner/name[@rev]` is a Hub release, here served by the local Hub-compatible server (tests/hubserver.py),
pulled and verified into $RIDGEFILL_CACHE/releases and run from there; anything else is a folder, and a missing
one (`release/x`, typed in the wrong folder) is refused in one line, exit 2, without a request to the Hub and with
nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import cli
from conftest import SMALL_CHAIN, quiet
from hubserver import HubServer, Token

from ridgefill.errors import BadInput
from ridgefill.formats.release import MANIFEST, verify_release
from ridgefill.hub.releases import locate_release

TOKEN = "hf_rfWRITE_names_0123456789abcdef"
ROOT = Path(__file__).resolve().parent.parent
MISSING = "Error: release/x: no such folder ({}/release/x); a Hub release is written hf://release/x"


@pytest.fixture(scope="module")
def chain(tiny_chain):
    return tiny_chain(SMALL_CHAIN)


@pytest.fixture(scope="module")
def hub(chain):
    """The local Hub, holding the chain's release as acme/tiny."""
    with HubServer(tokens={TOKEN: Token("alice", orgs=("acme",))}) as server:
        r = cli("push", chain.release, "--repo", "acme/tiny", env=hub_env(server, chain.tmp / "pushed"))
        assert r.returncode == 0, r.stderr
        yield server


def hub_env(hub: HubServer, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(cache / "hf"), HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN,
               HF_HUB_DISABLE_PROGRESS_BARS="1", RIDGEFILL_CACHE=str(cache / "cache"))
    return env


def cached(cache: Path) -> Path:
    """The one release folder the cache holds."""
    (folder,) = [p for p in (cache / "cache" / "releases" / "acme--tiny").iterdir() if p.name != "refs"]
    return folder


def refused_without_a_request(hub: HubServer, tmp_path: Path, *args) -> None:
    """`ridgefill ARGS` naming the missing folder release/x (from tmp_path): exit 2, the one line, no request, and
    nothing written in tmp_path."""
    tmp_path.mkdir(exist_ok=True)
    before = sorted(tmp_path.rglob("*"))
    n = len(hub.requests)
    r = cli(*args, env=hub_env(hub, tmp_path), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [MISSING.format(tmp_path)], r.stderr
    assert hub.requests_since(n) == []
    assert sorted(tmp_path.rglob("*")) == before


def test_locate_release_is_a_folder_unless_it_is_written_hf(tmp_path, monkeypatch):
    folder = tmp_path / "rel"
    folder.mkdir()
    assert locate_release(str(folder)) == folder
    monkeypatch.chdir(tmp_path)
    assert locate_release("rel") == Path("rel")
    refusals = {
        "release/x": f"release/x: no such folder ({tmp_path}/release/x); a Hub release is written hf://release/x",
        "./x": f"./x: no such folder ({tmp_path}/x)",
        "a/b/c": f"a/b/c: no such folder ({tmp_path}/a/b/c)",
        " ": " : empty; name a release folder, or a Hub release hf://owner/name[@rev]",
        "hf://acme": "hf://acme: a Hub release is written hf://owner/name[@rev]",
        "hf://acme/tiny@": "hf://acme/tiny@: a Hub release is written hf://owner/name[@rev]",
    }
    (tmp_path / "file").write_text("x")
    refusals["file"] = "file: not a folder (a release folder, or a Hub release hf://owner/name[@rev])"
    for value, message in refusals.items():
        with pytest.raises(BadInput) as e:
            locate_release(value, cache_root=tmp_path / "cache")
        assert str(e.value) == message
    with pytest.raises(BadInput, match="^RIDGEFILL_RELEASE=release/x: no such folder"):
        locate_release("release/x", where="RIDGEFILL_RELEASE=release/x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "rel"]  # no cache made


def test_eval_takes_a_hub_release(chain, hub, tmp_path):
    tiny = ["--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600", "--documents", "1",
            "--samples", "1", "--arms", "exact", "--arms", "ridgefill"]
    r = cli("eval", chain.model, "hf://acme/tiny", *tiny, "--store", tmp_path / "store", "--json",
            env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    folder = cached(tmp_path)
    assert f"eval summary not written into {folder}, the cached copy of a Hub release" in r.stderr
    assert "eval" not in json.loads((folder / MANIFEST).read_text())  # the cache stays the commit pulled
    assert verify_release(folder)["files"] == verify_release(chain.release)["files"]
    assert set(json.loads(r.stdout)["summary"]["arms"]) == {"exact", "ridgefill"}
    refused_without_a_request(hub, tmp_path / "bare", "eval", chain.model, "release/x", *tiny, "--store", "store")


def test_engine_prefix_takes_a_hub_release(chain, hub, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat on the mat and looked around. " * 3)
    r = cli("engine", "prefix", chain.model, "hf://acme/tiny", "--prompt", prompt, "--out", tmp_path / "served",
            "--tail", 5, "--store", chain.store.root, "--json", env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kind"] == "ridgefill"
    assert verify_release(cached(tmp_path))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "prompt.txt").write_text("the cat sat on the mat and looked around. " * 3)
    refused_without_a_request(hub, bare, "engine", "prefix", chain.model, "release/x", "--prompt", "prompt.txt",
                              "--out", "served", "--tail", 5, "--store", chain.store.root)


def test_push_copies_a_hub_release(chain, hub, tmp_path):
    r = cli("push", "hf://acme/tiny", "--repo", "acme/copy", env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in chain.release.iterdir())
    assert sorted(hub.resolve("acme/copy", "main").files) == sorted([".gitattributes", *files])
    assert all(hub.read("acme/copy", n) == (chain.release / n).read_bytes() for n in files)
    refused_without_a_request(hub, tmp_path / "bare", "push", "release/x", "--repo", "acme/other")
    assert "acme/other" not in hub.repos


def test_verify_takes_a_hub_release(chain, hub, tmp_path):
    r = cli("verify", "hf://acme/tiny", "--json", env=hub_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    got, files = json.loads(r.stdout), verify_release(chain.release)["files"]
    assert got["ok"] and got["folder"] == str(cached(tmp_path)) and got["files"] == files
    refused_without_a_request(hub, tmp_path / "bare", "verify", "release/x")


def test_python_loader_takes_a_hub_release(chain, hub, tmp_path):
    code = ("import sys; from ridgefill.models import load_model, resolve_model\n"
            "from ridgefill.runtime import load_release_maps; from ridgefill.errors import BadInput\n"
            "lm = load_model(resolve_model(sys.argv[1], store_root=sys.argv[2]), store_root=sys.argv[2], device='cpu',"
            " dtype='float32')\n"
            "rel = load_release_maps(lm, 'hf://acme/tiny'); print(rel.split, rel.folder)\n"
            "try:\n    load_release_maps(lm, 'release/x')\nexcept BadInput as e:\n    print(e)")
    bare = tmp_path / "bare"
    bare.mkdir()
    n = len(hub.requests)
    r = subprocess.run([sys.executable, "-c", code, str(chain.model), str(chain.store.root)], capture_output=True, text=True,
                       env=hub_env(hub, tmp_path), cwd=bare)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"2 {cached(tmp_path)}", MISSING.format(bare).removeprefix("Error: ")]
    assert not [q for q in hub.requests_since(n) if "release/x" in q["path"]]
    assert list(bare.iterdir()) == []


def test_bench_scripts_take_a_hub_release(chain, hub, tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import harness\n"
            "print(harness.release('hf://acme/tiny'))\n"
            "ap = harness.parser('x'); ap.add_argument('release', type=harness.release); ap.parse_args(['release/x'])")
    bare = tmp_path / "bare"
    bare.mkdir()
    n = len(hub.requests)
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench")], capture_output=True, text=True,
                       env=hub_env(hub, tmp_path), cwd=bare)
    assert r.returncode == 2, r.stderr
    assert r.stdout == f"{cached(tmp_path)}\n"
    assert r.stderr.splitlines()[-1].endswith(": error: argument release: "
                                              + MISSING.format(bare).removeprefix("Error: "))
    assert not [q for q in hub.requests_since(n) if "release/x" in q["path"]]


def test_branches_a_slash_b_and_a_dash_dash_b_are_cached_apart(chain, hub, tmp_path):
    """The release cache keeps one ref per revision: `a/b` and `a--b` are two branches (two commits here), and
    offline each resolves to the commit it last resolved to, not the other's."""
    from ridgefill.export import export
    from ridgefill.export.config import ExportConfig

    env = hub_env(hub, tmp_path)
    for branch, tail in (("a/b", 100), ("a--b", 200)):  # two releases of the chain's maps: two commits
        folder = tmp_path / f"tail{tail}"
        export(chain.store, chain.sol.id, ExportConfig(tail=tail), quiet(), out_dir=folder)
        r = cli("push", folder, "--repo", "acme/tiny", "--revision", branch, env=env)
        assert r.returncode == 0, r.stderr
    commits = {b: hub.resolve("acme/tiny", b).sha for b in ("a/b", "a--b")}
    assert commits["a/b"] != commits["a--b"]
    for offline in ("0", "1"):  # online: each resolved and pulled; offline: each from its own ref
        for branch, sha in commits.items():
            r = cli("verify", f"hf://acme/tiny@{branch}", "--json", env=env | {"HF_HUB_OFFLINE": offline})
            assert r.returncode == 0, r.stderr
            assert Path(json.loads(r.stdout)["folder"]).name == sha, (branch, offline)
    refs = tmp_path / "cache" / "releases" / "acme--tiny" / "refs"
    assert {p.name: p.read_text().strip() for p in refs.iterdir()} == {"a%2Fb": commits["a/b"], "a--b": commits["a--b"]}
