"""`ridgefill eval` end to end on a tiny model: artifact, release manifest and card, gate exit code."""

import json

import pytest

from ridgefill.artifacts import Store
from ridgefill.capture.run import CaptureConfig, capture
from ridgefill.evaluate.gate import check_gate
from ridgefill.output import Output
from ridgefill.solve.run import solve
from clirun import cli

TINY = ["--tail", "48", "--scored", "16", "--doc-tokens", "128", "--lengths", "600", "--lengths", "700", "--documents", "2", "--samples", "1"]




@pytest.fixture(scope="module")
def release(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("eval")
    data = tmp / "data"
    data.mkdir()
    for i in range(5):
        (data / f"d{i}.txt").write_text(f"document {i}: " + "the cat sat on the mat and looked around. " * (8 + i))
    st = Store(tmp / "store")
    cap, _ = capture(st, str(tiny_llama), [str(data)], CaptureConfig(splits=(2,), chunk=64, held_out=1), Output(quiet=True))
    sol, _ = solve(st, cap.id, Output(quiet=True), alphas=[1e-3])
    rel = tmp / "release"
    r = cli("export", sol.id, "--out", rel, "--store", st.root)
    assert r.returncode == 0, r.stderr
    return tmp, st, sol, rel


def test_eval_writes_artifact_and_release_summary(release, tiny_llama):
    tmp, st, sol, rel = release

    r = cli("eval", tiny_llama, rel, *TINY, "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    s = doc["summary"]
    assert set(s["arms"]) == {"exact", "ridgefill", "identity", "nofill"}
    assert s["documents"] == 2 and s["samples"] >= 1
    for arm in ("ridgefill", "identity", "nofill"):
        assert s["arms"][arm]["dnll_ci"]["low"] <= s["arms"][arm]["dnll"] <= s["arms"][arm]["dnll_ci"]["high"]
        assert 0 <= s["arms"][arm]["top1"] <= 1 and s["arms"][arm]["kl"] >= 0
    assert 0 <= s["arms"]["nofill"]["needle"] <= 100  # decoded from its cache with holes
    res = json.loads((st.root / "eval" / doc["id"] / "results.json").read_text())
    assert all(set(n["correct"]) == set(s["arms"]) for n in res["needles"])
    man = json.loads((rel / "ridgefill.json").read_text())
    assert man["eval"]["eval_id"] == doc["id"]
    assert "## Evaluation" in (rel / "README.md").read_text()
    assert cli("verify", rel).returncode == 0  # the manifest's eval does not break the hashes
    again = cli("eval", tiny_llama, rel, *TINY, "--store", st.root, "--json")
    assert json.loads(again.stdout)["cached"] is True


def test_gate_exit_code_names_the_threshold(release, tiny_llama, tmp_path):
    _, st, sol, rel = release
    gate = tmp_path / "gate.toml"
    gate.write_text('arm = "ridgefill"\n[thresholds]\nkl_max = -1.0\ntop1_min = 0.0\n')
    r = cli("eval", tiny_llama, sol.id, *TINY, "--gate", gate, "--store", st.root)
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1].startswith("Error: gate failed: kl_max: ridgefill kl = ")
    gate.write_text("[thresholds]\nkl_max = 1e9\n")
    assert cli("eval", tiny_llama, sol.id, *TINY, "--gate", gate, "--store", st.root).returncode == 0
    gate.write_text("[thresholds]\nspeed_max = 1\n")
    r = cli("eval", tiny_llama, sol.id, *TINY, "--gate", gate, "--store", st.root)
    assert r.returncode == 2 and "unknown key(s) speed_max" in r.stderr


def test_eval_rows_arm(release, tiny_llama):
    _, st, sol, rel = release
    r = cli("eval", tiny_llama, sol.id, *TINY, "--arms", "exact", "--arms", "ridgefill+rows", "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["summary"]
    assert set(s["arms"]) == {"exact", "ridgefill+rows"} and "dnll" in s["arms"]["ridgefill+rows"]
    r = cli("eval", tiny_llama, sol.id, *TINY, "--arms", "exact", "--arms", "rows", "--store", st.root)
    assert r.returncode == 2 and "unknown arm 'rows'" in r.stderr
    r = cli("eval", tiny_llama, sol.id, *TINY, "--tasks", "single", "--tasks", "haystack", "--store", st.root)
    assert r.returncode == 2 and "unknown needle task(s) haystack" in r.stderr


def test_check_gate_by_hand():
    summary = {"arms": {"exact": {"needle": 90.0}, "ridgefill": {"needle": 80.0, "dnll_key": 0.3, "kl": 0.1}}}
    assert check_gate(summary, {"thresholds": {"needle_drop_max": 5.0}}) == [
        "needle_drop_max: ridgefill needle_drop = 10, limit 5"]
    assert check_gate(summary, {"thresholds": {"needle_drop_max": 10.0, "dnll_key_max": 0.5}}) == []
    assert check_gate(summary, {"thresholds": {"top1_min": 0.5}}) == ["top1_min: ridgefill has no top1 figure"]


def test_eval_refuses_a_different_model(release, tiny_qwen3):
    _, st, sol, rel = release
    r = cli("eval", tiny_qwen3, rel, *TINY, "--store", st.root)
    assert r.returncode == 2 and "was fitted on a different model" in r.stderr


def test_example_gates_load():
    from pathlib import Path

    from ridgefill.evaluate.gate import load_gate

    gates = sorted((Path(__file__).resolve().parents[1] / "examples" / "gates").glob("*.toml"))
    assert [g.stem for g in gates] == ["gemma3-270m", "smollm2-135m"]  # one per built-in model
    for g in gates:
        rules = load_gate(g)
        assert rules["arm"] == "ridgefill" and rules["thresholds"]
