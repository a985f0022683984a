"""The GPU check's dry run (scripts/gpu-check.sh --dry-run: bench/gpu_check.py's steps on the CPU at tiny sizes)
and its pure helpers against brute force."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
from harness import FIGURES, meets  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-out")
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--dry-run"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=300)
    return p, out


def test_dry_run_writes_every_phase_and_passes_its_checks(dry_run):
    p, out = dry_run
    assert p.returncode == 0, p.stdout[-3000:]
    doc = json.loads((out / "gpu.json").read_text())
    log = (out / "gpu-check.log").read_text()
    d = doc["details"]
    assert doc["figure"] == "gpu" and doc["target"] == FIGURES["gpu"].target and d["dry_run"] is True
    assert set(d["phases"]) == {"env", "wheels", "correctness", "model", "speed", "capture"}
    for name, rec in d["phases"].items():
        assert f"phase {name}: {rec['status']} in" in log
        assert rec["status"] == "ok" or (name == "wheels" and rec["status"] == "skipped"), (name, rec)
    if d["phases"]["wheels"]["status"] == "skipped":  # no .whl here: the dry run says so
        assert "wheels: skipped: no wheels in" in log
    else:
        assert doc["checks"]["wheels install with --no-index --no-deps, one each"] is True
    assert doc["checks"] and all(doc["checks"].values()), doc["checks"]
    for arch in gpu_check.TINY_ARCHS:  # a check for every step of every tiny model
        for step in ("capture on cpu within", "solve, quantize, export", "eval's arms", "--device-map auto",
                     "prefill on cpu within"):
            assert any(k.startswith(f"{arch}:") and step in k for k in doc["checks"]), (arch, step)
        c = d["correctness"][arch]
        assert set(c["eval"]) == {"exact", "ridgefill", "identity", "nofill"}
        assert set(c["eval_device_map"]) == {"exact", "ridgefill"}
        assert 0 < max(c["stats_rel_err"].values()) <= gpu_check.STATS_TOL  # bfloat16 differs, within bounds
    speed = d["speed"]
    assert (speed["split"], speed["layers"], speed["tail"]) == (2, 4, 64)
    assert sorted(map(int, speed["lengths"])) == [256, 512, 1024]  # (the JSON writer sorts keys)
    value = doc["value"]
    assert set(value) == {"share_min", "share_256", "share_512", "share_1024", "capture"}
    for n, rec in speed["lengths"].items():
        assert value[f"share_{n}"] == rec["share"]
        assert rec["share"] == pytest.approx(rec["speedup"] / rec["ceiling_speedup"], rel=1e-3)
        assert len(rec["runs_s"]["exact"]) == len(rec["runs_s"]["ridgefill"]) == 3
    assert value["share_min"] == min(value[f"share_{n}"] for n in speed["lengths"])
    assert value["capture"] == pytest.approx(d["capture"]["stack_s"] / d["capture"]["capture_s"], rel=1e-3)
    assert doc["passed"] is meets(doc["target"], value)


def test_ceiling_share_is_speedup_over_the_ceiling():
    # N=32768, T=512, S=16, L=32: the fill runs 16 * 32256 + 32 * 512 of 32 * 32768 layer-rows
    ceiling_speedup = (32 * 32768) / (16 * 32256 + 32 * 512)
    assert gpu_check.ceiling_share(1.5, 32768, 512, 16, 32) == pytest.approx(1.5 / ceiling_speedup, rel=1e-12)
    assert gpu_check.ceiling_share(1.0, 1000, 1000, 3, 6) == 1.0  # all rows in the tail: no speed-up to have


def test_rel_err_against_numpy():
    rng = np.random.default_rng(0)
    b = rng.standard_normal((5, 7))
    a = b + 1e-3 * rng.standard_normal((5, 7))
    assert gpu_check.rel_err(a, b) == pytest.approx(np.sqrt(((a - b) ** 2).sum() / (b**2).sum()), rel=1e-12)
    assert gpu_check.rel_err(np.zeros(3), np.zeros(3)) == 0.0
    assert gpu_check.rel_err(np.ones(3), np.zeros(3)) == float("inf")


def test_a_length_that_does_not_fit_the_budget_is_skipped():
    """The second length's predicted time ((n2/n1)^2 times the first's) exceeds what is left: recorded as skipped,
    the first measured."""
    assert gpu_check.predicted_seconds(2.0, 1000, 3000) == pytest.approx(18.0)
    lm = gpu_check.shaped_model((2, 32, 4, 2, 64, 64), "cpu", 512)
    clock = gpu_check.Clock(budget=10_000.0)
    res = gpu_check.phase_speed(lm, "cpu", [64, 512], 16, 1, clock, reserve=clock.left() - 1e-9)
    first, second = res["lengths"]["64"], res["lengths"]["512"]
    assert len(first["runs_s"]["exact"]) == 1 and first["share"] > 0
    assert second["skipped"].startswith("predicted ")


def test_figure_without_a_measurement_does_not_meet_its_target():
    assert meets("share_min >= 0.90", {"share_min": None, "capture": 1.0}) is False
    assert meets("share_min >= 0.90", {"share_min": 0.95}) is True
