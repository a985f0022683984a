"""The CLI through its real entry point: fast --help, exit codes, JSON on stdout, artifacts commands."""

import json
import subprocess
import sys

import pytest
from clirun import cli




def test_help_does_not_import_torch():
    code = ("import sys; sys.argv = ['ridgefill', '--help']\n"
            "from ridgefill.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'safetensors', 'huggingface_hub') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout
    for cmd in ("capture", "solve", "quantize", "export", "verify", "artifacts"):
        assert cmd in r.stdout


def test_usage_error_exits_2():
    r = cli("capture")
    assert r.returncode == 2
    assert "Missing argument" in r.stderr


def test_unknown_builtin_is_bad_input(tmp_path):
    r = cli("capture", "builtin:nope", "--store", tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("Error: unknown built-in model 'builtin:nope'") or "builtin:nope" in r.stderr
    assert "Traceback" not in r.stderr


def test_debug_shows_traceback(tmp_path):
    r = cli("capture", tmp_path / "missing", "--store", tmp_path, "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.fixture(scope="module")
def store_with_capture(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "d.txt").write_text("one two three four five six seven eight nine ten. " * 20)
    (tmp / "e.txt").write_text("alpha beta gamma delta epsilon zeta eta theta. " * 20)
    (tmp / "f.txt").write_text("print('hello')\nx = 1\n" * 30)
    store = tmp / "store"
    r = cli("capture", tiny_llama, "--data", tmp / "d.txt", "--data", tmp / "e.txt", "--data", tmp / "f.txt",
            "--split", 2, "--held-out", 1, "--chunk", 64, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["stage"] == "capture" and doc["cached"] is False
    return store, doc["id"], tmp


def test_capture_rerun_is_cached_and_stdout_is_the_id(store_with_capture, tiny_llama):
    store, cid, tmp = store_with_capture
    r = cli("capture", tiny_llama, "--data", tmp / "d.txt", "--data", tmp / "e.txt", "--data", tmp / "f.txt",
            "--split", 2, "--held-out", 1, "--chunk", 64, "--store", store)
    assert r.returncode == 0
    assert r.stdout == cid + "\n"
    assert "(cached)" in r.stderr


def test_artifacts_ls_show_verify_gc(store_with_capture):
    store, cid, _ = store_with_capture
    r = cli("artifacts", "ls", "--store", store, "--json")
    assert [a["id"] for a in json.loads(r.stdout)["artifacts"]] == [cid]
    r = cli("artifacts", "show", cid[:8], "--store", store, "--json")
    assert json.loads(r.stdout)["recipe"]["splits"] == [2]
    assert cli("artifacts", "verify", cid, "--store", store).returncode == 0
    (store / "capture" / ".tmp-deadbeef-1").mkdir()
    stats = store / "capture" / cid / "stats.safetensors"
    good = stats.read_bytes()
    stats.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    r = cli("artifacts", "verify", "--store", store)
    assert r.returncode == 1 and "stats.safetensors: sha256 mismatch" in r.stderr
    r = cli("artifacts", "gc", "--dry-run", "--store", store, "--json")
    assert sorted(json.loads(r.stdout)["removed"]) == sorted([str(store / "capture" / ".tmp-deadbeef-1"), str(store / "capture" / cid)])
    stats.write_bytes(good)
    r = cli("artifacts", "gc", "--store", store, "--json")
    assert json.loads(r.stdout)["removed"] == [str(store / "capture" / ".tmp-deadbeef-1")]
    assert (store / "capture" / cid).is_dir()
