"""Bad inputs and faults a probe of the toolchain tried as a hostile user would (issue 51, B4, B5, B7): each is
refused in one line, exit 2, naming what to do, or survived. Every test builds what it needs in its own tmp_path."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from clirun import cli
from hubserver import HubServer, Token
from tiny import make_tiny_gguf

from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.formats import gguf as G
from ridgefill.formats import int8, release, safetensors
from ridgefill.formats.release import MANIFEST, MAPS_FILE, write
from ridgefill.hub.releases import locate_release


def one_line_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------- a truncated GGUF


def test_a_truncated_model_gguf_is_bad_input_before_it_is_loaded(tmp_path):
    whole = make_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])  # the tables whole, the tensor data cut short
    r = cli("capture", cut, "--store", tmp_path / "store")
    assert r.returncode == 2, r.stderr
    assert one_line_error(r) == (f"Error: '{cut}': truncated GGUF: the file ends at byte {len(whole) // 2}, its "
                                 f"tensor data at byte {len(whole)}")


def _maps_gguf(path) -> bytes:
    rng = np.random.default_rng(0)
    maps = {1: {"weight": rng.standard_normal((32, 64)).astype(np.float32),
                "bias": rng.standard_normal(32).astype(np.float32)}}
    manifest = {"model": {"name": "x"}, "split": 1, "layers": [{"index": 1, "kind": "attention", "map": "input"}]}
    G.write_gguf(path, manifest, G.encode_tensors(maps)[0])
    return path.read_bytes()  # ends with the bias, 128 bytes: a whole number of 32-byte alignments, no padding


@pytest.mark.parametrize("keep", [-1, 0.5, 200, 30])
def test_a_truncated_maps_gguf_is_refused_by_name(tmp_path, keep):
    """Cut in the tensor data (by one byte, or half the file), in the key/value table, in the fixed header."""
    whole = _maps_gguf(tmp_path / "m.gguf")
    n = len(whole) + keep if keep < 0 else int(len(whole) * keep) if keep < 1 else keep
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:n])
    where = {-1: f"its tensor data at byte {len(whole)}", 0.5: f"its tensor data at byte {len(whole)}",
             200: "inside its key/value table", 30: "inside its key/value table"}[keep]
    want = f"{cut}: not a readable GGUF file (truncated GGUF: the file ends at byte {n}, {where})"
    for read in (G.load_gguf, G.load_gguf_extras):
        with pytest.raises(BadInput) as e:
            read(cut)
        assert str(e.value) == want
    G.load_gguf(tmp_path / "m.gguf")  # the whole file reads


# ------------------------------------------------------------------------------------------------ releases


def write_release(path: Path, layers=(5, 6), **kw) -> Path:
    """A small int8 release (kv maps [48, 160] of a 7-layer model split at 5)."""
    rng = np.random.default_rng(0)
    maps = {}
    for layer in layers:
        codes, bits = int8.quantize((rng.standard_normal((48, 160)) * 0.05).astype(np.float32))
        maps[layer] = {"codes": codes, "scale_bits": bits, "bias": rng.standard_normal(48).astype(np.float32)}
    manifest = {"model": {"name": "acme/m", "architecture": "llama", "num_layers": 7, "hidden_size": 160,
                          "num_kv_heads": 2, "head_dim": 12, "fingerprint": "0123456789abcdef"},
                "split": 5, "tail_default": 512,
                "layers": [{"index": i, "kind": "attention", "map": "kv"} for i in layers],
                "fit": {"alpha": 1e-4, "exact_norm": 812.5, "skip_first_rows": 1}}
    release.write_release(path, maps, manifest, "# a release\n", **kw)
    return path


def forge_maps(folder: Path, change) -> None:
    """Rewrite maps.safetensors with `change(arrays)` applied (its metadata, the facts, kept) and list its new
    sha256 in ridgefill.json, as a forger would: the release still verifies file by file."""
    arrays, meta = safetensors.load(folder / MAPS_FILE)
    change(arrays)
    (folder / MAPS_FILE).write_bytes(safetensors.encode(arrays, meta))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][MAPS_FILE] = sha256_file(folder / MAPS_FILE)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_scale_whose_codes_overflow_float32_is_refused_without_numpy_warnings(tmp_path):
    rel = write_release(tmp_path / "rel")

    def huge_scale(arrays):
        bits = arrays["layer.6.scales"].bits.copy()
        bits[0, 0] = 0x7F00  # bf16 1.7e38: finite and positive, but 127 times it is not a float32
        arrays["layer.6.scales"] = safetensors.BF16(bits)

    forge_maps(rel, huge_scale)
    r = cli("verify", rel)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [  # the one line, no RuntimeWarning before it
        "Error: maps.safetensors: tensor 'layer.6.scales': scales times codes overflow float32 (the scale of row 0, "
        "group 0 is 1.701e+38, and 127 times it must be a float32)"]
    codes, bits = int8.quantize(np.ones((1, 4), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="^scales times codes overflow float32"):
            int8.dequantize(codes, np.full_like(bits, 0x7F00))
        assert int8.dequantize(np.zeros_like(codes), np.full_like(bits, 0x7F00)).tolist() == [[0.0] * 4]


# ----------------------------------------------------------------------------------------- Hub releases


TOKEN = "hf_rfWRITE_probe_0123456789abcdef"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The local Hub, holding a small release as acme/rel."""
    with HubServer(tokens={TOKEN: Token("alice", orgs=("acme",))}) as server:
        tmp = tmp_path_factory.mktemp("hub")
        r = cli("push", write_release(tmp / "rel"), "--repo", "acme/rel", env=hub_env(server, tmp))
        assert r.returncode == 0, r.stderr
        yield server


def hub_env(hub: HubServer, tmp: Path, **more) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp / "hf"), HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN,
               HF_HUB_DISABLE_PROGRESS_BARS="1", RIDGEFILL_CACHE=str(tmp / "cache"), **more)
    return env


@pytest.mark.parametrize("rev", ["..", "."])
def test_revisions_dot_and_dot_dot_are_refused_before_any_request(hub, tmp_path, rev):
    n = len(hub.requests)
    problem = f"'{rev}' is not a revision name (a branch, tag or commit sha, as git spells a ref)"
    r = cli("verify", f"hf://acme/rel@{rev}", env=hub_env(hub, tmp_path))
    assert r.returncode == 2 and one_line_error(r) == f"Error: hf://acme/rel@{rev}: {problem}"
    r = cli("pull", f"acme/rel@{rev}", "--out", tmp_path / "out", env=hub_env(hub, tmp_path))
    assert r.returncode == 2 and one_line_error(r) == f"Error: 'acme/rel@{rev}': {problem}"
    rel = write_release(tmp_path / "rel")
    r = cli("push", rel, "--repo", "acme/rel", "--revision", rev, env=hub_env(hub, tmp_path))
    assert r.returncode == 2 and one_line_error(r) == f"Error: --revision '{rev}': push needs a branch name"
    assert hub.requests_since(n) == [] and list(tmp_path.iterdir()) == [rel]  # no refs/.. file, no cache at all
    from ridgefill.hub.snapshot import download_snapshot

    with pytest.raises(BadInput, match=rf"^'acme/model@{re.escape(rev)}': {re.escape(problem)}$"):
        download_snapshot(f"acme/model@{rev}", tmp_path / "hf")


def test_a_damaged_cached_hub_release_names_the_folder_to_delete(hub, tmp_path):
    env = hub_env(hub, tmp_path)
    r = cli("verify", "hf://acme/rel", "--json", env=env)
    assert r.returncode == 0, r.stderr
    folder = Path(json.loads(r.stdout)["folder"])
    assert folder.parent == tmp_path / "cache" / "releases" / "acme--rel"
    data = bytearray((folder / MAPS_FILE).read_bytes())
    data[-1] ^= 1  # one bit of the last map's bias
    (folder / MAPS_FILE).write_bytes(bytes(data))
    got = sha256_file(folder / MAPS_FILE)
    want = json.loads((folder / MANIFEST).read_text())["files"][MAPS_FILE]
    line = (f"Error: maps.safetensors: sha256 mismatch (expected {want}, got {got}); in {folder}, the cached copy of "
            "hf://acme/rel: delete that folder and run again to pull it anew")
    for more in ({}, {"HF_HUB_OFFLINE": "1"}):  # found online (the revision resolved to it) and offline
        r = cli("verify", "hf://acme/rel", env={**env, **more})
        assert r.returncode == 2 and one_line_error(r) == line
    with pytest.raises(BadInput) as e:  # as RIDGEFILL_RELEASE names it
        with_env(env, lambda: locate_release("hf://acme/rel", where="RIDGEFILL_RELEASE=hf://acme/rel"))
    assert str(e.value) == "RIDGEFILL_RELEASE=hf://acme/rel: " + line.removeprefix("Error: ")
    shutil.rmtree(folder)  # as the line says
    r = cli("verify", "hf://acme/rel", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["folder"] == str(folder), r.stderr


def with_env(env: dict, fn):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        return fn()
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ---------------------------------------------------------------------------------------- blanks in a name


BLANKS = "has blanks around it; name a release folder, or a Hub release hf://owner/name[@rev] without them"


def test_blanks_around_a_release_name_are_refused_wherever_it_is_named(tmp_path, monkeypatch):
    write_release(tmp_path / "X")  # the folder the blanks would have been trimmed to
    r = cli("verify", " X", cwd=tmp_path)
    assert r.returncode == 2 and one_line_error(r) == f"Error:  X: ' X' {BLANKS}"
    monkeypatch.chdir(tmp_path)
    for value in ("X ", "\tX", " hf://acme/rel "):
        with pytest.raises(BadInput) as e:
            locate_release(value, where=f"RIDGEFILL_RELEASE={value}")
        assert str(e.value) == f"RIDGEFILL_RELEASE={value}: {value!r} {BLANKS}"
    assert locate_release("X") == Path("X")


def test_the_served_release_follows_the_same_rule_for_blanks(tmp_path, monkeypatch):
    from ridgefill.engines.vllm import served

    write_release(tmp_path / "X")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RIDGEFILL_RELEASE", " X ")
    with pytest.raises(BadInput) as e:
        served.from_environment()
    assert str(e.value) == f"RIDGEFILL_RELEASE= X : ' X ' {BLANKS}"


# ------------------------------------------------------------------------------- an eval killed mid-summary


KILLED_WRITER = """
import os, signal, sys
from ridgefill.formats.release import write
names = []
def replace(tmp, dst):  # record the temporary's name; with `kill`, die as `kill -9` would before the rename
    names.append(os.path.basename(tmp))
    print(names[-1], flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os.rename(tmp, dst)
write.os.replace = replace
write.write_eval(sys.argv[1], {"arms": {"ridgefill": {"kl": 0.1}}}, lambda m: "# card\\n")
"""


def eval_summary(rel: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_WRITER, str(rel), mode], capture_output=True, text=True)


def test_eval_summary_temporaries_are_per_process_and_keep_the_mode(tmp_path):
    rel = write_release(tmp_path / "rel")
    (rel / MANIFEST).chmod(0o640)
    r = eval_summary(rel, "write")
    assert r.returncode == 0, r.stderr
    pid = r.stdout.split("-")[1]
    assert re.fullmatch(rf"\.ridgefill\.json\.tmp-{pid}-\w+\n\.README\.md\.tmp-{pid}-\w+\n", r.stdout), r.stdout
    assert sorted(p.name for p in rel.iterdir()) == sorted([MANIFEST, MAPS_FILE, "README.md"])
    assert (rel / MANIFEST).stat().st_mode & 0o777 == 0o640
    assert release.verify_release(rel)["eval"] == {"arms": {"ridgefill": {"kl": 0.1}}}


def test_an_eval_killed_writing_its_summary_leaves_a_release_the_next_eval_cleans(tmp_path):
    rel = write_release(tmp_path / "rel")
    before = (rel / MANIFEST).read_bytes()
    r = eval_summary(rel, "kill")
    assert r.returncode == -9
    (left,) = [p for p in rel.iterdir() if p.name.startswith(".")]
    assert left.name == r.stdout.strip() and (rel / MANIFEST).read_bytes() == before  # the old manifest, whole
    assert write.is_writer_leftover(left)
    old = rel / ".ridgefill.json.tmp"  # the one name an eval killed by an older ridgefill left
    old.write_text("{")
    assert write.is_writer_leftover(old)
    assert not write.is_writer_leftover(rel / ".ridgefill.json.tmp-1-a.b") and not write.is_writer_leftover(rel)
    r = eval_summary(rel, "write")  # removes both before it reads the release
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in rel.iterdir()) == sorted([MANIFEST, MAPS_FILE, "README.md"])
    live = rel / f".README.md.tmp-{os.getpid()}-abc"  # a running eval's (this process's) is not touched
    live.write_text("#")
    write.remove_writer_leftovers(rel)
    assert write.is_writer_leftover(live) and live.read_text() == "#"


def test_a_release_with_a_killed_evals_temporary_still_verifies(tmp_path):
    rel = write_release(tmp_path / "rel")
    assert eval_summary(rel, "kill").returncode == -9  # the reader passes over it: no eval need run first
    (rel / ".ridgefill.json.tmp").write_text("{")
    (rel / f".README.md.tmp-{os.getpid()}-abc").write_text("#")  # a running eval's
    r = cli("verify", rel)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------ one rule for a group size


SECOND_READER = Path(__file__).resolve().parents[1] / "examples" / "reader" / "ridgefill_reader.py"


def forge_facts(folder: Path, change) -> None:
    """Apply `change` to the facts in both places (ridgefill.json and maps.safetensors' metadata), hashes resealed:
    what a forger who edits consistently makes."""
    arrays, meta = safetensors.load(folder / MAPS_FILE)
    facts = json.loads(meta[release.META_FACTS])
    change(facts)
    (folder / MAPS_FILE).write_bytes(safetensors.encode(arrays, {**meta, release.META_FACTS: json.dumps(facts)}))
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    manifest["files"][MAPS_FILE] = sha256_file(folder / MAPS_FILE)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def second_reader(folder: Path) -> tuple[int, str]:
    r = subprocess.run([sys.executable, SECOND_READER, folder], capture_output=True, text=True)
    return r.returncode, r.stdout.strip()


def test_the_second_reader_refuses_a_fractional_group_size_as_ridgefill_does(tmp_path):
    rel = write_release(tmp_path / "rel")
    forge_facts(rel, lambda m: m["projector"].update(group_size=128.5))
    r = cli("verify", rel)
    assert r.returncode == 2 and "'projector.group_size'" in one_line_error(r)
    code, said = second_reader(rel)
    assert code == 2 and said.startswith("refused: ridgefill.json: ") and "'projector.group_size'" in said


def test_a_group_size_written_128_0_is_one_integer_to_both_readers(tmp_path):
    """docs/format.md: an integer is a JSON number with no fractional part (9 and 9.0 alike); the second reader
    (written from the spec alone) follows it, and so must ridgefill's."""
    rel = write_release(tmp_path / "rel")
    maps = release.load_release(rel)[1]
    forge_facts(rel, lambda m: m["projector"].update(group_size=128.0))
    assert second_reader(rel) == (0, "ok: 2 layers")
    r = cli("verify", rel)
    assert r.returncode == 0, r.stderr
    got = release.load_release(rel)[1]
    assert all(np.array_equal(got[l]["weight"], maps[l]["weight"]) for l in maps)
