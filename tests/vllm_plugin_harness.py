"""What the vLLM plugin's engine tests share (tests/test_vllm_plugin*.py): vLLM's environment and the runner
(tests/vllm_plugin_runner.py) that drives its offline engine, the reference answers they are held to, the figures'
report, and the tiny random Qwen2 and Qwen3 models with releases of their own.

Every answer is compared with `runtime.prefill(lm, ids, arm, **rel.options())` of the whole prompt: the engine's first
token must be the reference's, its top-2 margin within MARGIN_TOL of the reference's, and its greedy answer (NEW
tokens) the reference's, except where the two part at a near-tie (engine_refs.agreement). Figures go to
$RIDGEFILL_ENGINE_REPORT_DIR/engines_vllm_plugin.json when that is set.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import engine_refs

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".engines" / "vllm"
RELEASE = Path(os.environ.get("RIDGEFILL_ENGINE_RELEASE", ROOT / "release" / "smollm2-135m"))
NEW = 16  # tokens each request generates
MARGIN_TOL = 1e-3  # nats: the engine's first-token margin against the reference's (float32 on both sides)
RUNNER = ROOT / "tests" / "vllm_plugin_runner.py"


def vllm_python() -> Path:
    if not (VLLM / ".done").is_file():
        pytest.skip("the vllm environment is not built (.engines/vllm): run scripts/setup-engines.sh vllm")
    return VLLM / "bin" / "python"


def engine_env(release: Path | None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RIDGEFILL_RELEASE"}
    if release is not None:
        env["RIDGEFILL_RELEASE"] = str(release)
    return env | {"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2")} | extra


def extra_plugin(site: Path, module: str, source: str) -> Path:
    """A test-only vLLM plugin `module` (its `register` a `vllm.general_plugins` entry point) in the folder `site`, to
    put on an engine's PYTHONPATH beside ridgefill's plugin."""
    info = site / f"{module}-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{module} = {module}:register\n")
    (site / f"{module}.py").write_text(source)
    return site


def run_engine(work: Path, name: str, model: Path, prompts: dict, runs: list, env: dict, timeout=None) -> dict:
    spec, out = work / f"jobs-{name}.json", work / f"results-{name}.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "runs": runs}))
    r = subprocess.run([vllm_python(), RUNNER, spec, out], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())["runs"]


def reference(lm, ids, arm: str, new: int = NEW, **options) -> dict:
    return engine_refs.reference(lm, ids, arm, new, **options)


def check(fig: dict, count: int) -> None:
    assert fig["prompts"] >= count and fig["misses"] == 0, fig
    assert fig["first_token_equal"] == fig["prompts"] and fig["first_margin_max_diff"] < MARGIN_TOL, fig


def report(key: str, figures) -> None:
    out = os.environ.get("RIDGEFILL_ENGINE_REPORT_DIR")
    if out:
        import fcntl

        path = Path(out) / "engines_vllm_plugin.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:  # two pytest-xdist workers add to one file
            fcntl.flock(lock, fcntl.LOCK_EX)
            got = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps(got | {key: figures}, indent=1))


def engine_model(model: str, out: Path) -> Path:
    """`ridgefill engine model`: the folder vLLM serves."""
    from clirun import cli

    if not (out / "config.json").is_file():
        r = cli("engine", "model", model, "--out", out)
        assert r.returncode == 0, r.stderr
    return out


def in_vllm(code: str) -> dict:
    """Run `code` in the vLLM environment (no engine started); the JSON its last line of output prints."""
    r = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, cwd=ROOT, env=engine_env(None))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ tiny Qwen2, Qwen3

TINY_TAIL = 16
TINY_PROMPTS = 8  # random-token prompts per tiny model: enough for many exact runs in one step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random models (4 layers, d = 128, 2 KV heads of 32: vLLM's CPU kernels) and releases of their own (split
    2, int8, tail TINY_TAIL), made once and shared by the tests below: `tiny(arch, configuration, maps)` -> the model
    folder, the loaded model, the release (folder, and as the runtime reads it), TINY_PROMPTS random-token prompts
    and their references. One capture per architecture, from which both kinds of map are solved (and one more where
    a release's maps read earlier states: `earlier`, capture's --earlier)."""
    from clirun import cli
    from conftest import CAT_TEXTS
    from tiny import make_tiny_model

    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import load_release_maps

    models, captures, made = {}, {}, {}

    def make(arch: str, configuration: str, maps: str, outlier_ratio: float | None = None, kv_heads: int = 2,
             split: int = 2, earlier: str | None = None) -> dict:
        vllm_python()
        arch_key, arch = (arch, kv_heads), arch
        if arch_key not in models:
            work = tmp_path_factory.mktemp(f"tiny-{arch}-{kv_heads}kv")
            model = make_tiny_model(work / "model", arch=arch, layers=4, hidden=128, kv_heads=kv_heads)
            data, store = work / "data", work / "store"
            data.mkdir()
            for i, text in enumerate(CAT_TEXTS):
                (data / f"d{i}.txt").write_text(text)
            lm = load_model(resolve_model(str(model), store_root=store), store_root=store)
            models[arch_key] = {"work": work, "model": model, "store": store, "data": data, "lm": lm}
        c = models[arch_key]
        cap_key = (arch_key, outlier_ratio, split, earlier)
        if cap_key not in captures:
            ratio = [] if outlier_ratio is None else ["--outlier-ratio", str(outlier_ratio)]
            states = [] if earlier is None else ["--earlier", earlier]
            r = cli("capture", c["model"], "--data", c["data"], "--split", str(split), "--chunk", "64", *ratio,
                    *states, "--store", c["store"])  # fmt: skip
            assert r.returncode == 0, r.stderr
            captures[cap_key] = r.stdout.strip()
        key = (arch_key, configuration, maps, outlier_ratio, split, earlier)
        if key not in made:
            r = cli("solve", captures[cap_key], "--maps", maps, "--store", c["store"])
            assert r.returncode == 0, r.stderr
            r = cli("quantize", r.stdout.strip(), "--store", c["store"])
            assert r.returncode == 0, r.stderr
            release = c["work"] / (f"release-{configuration}-{maps}-{outlier_ratio or 'default'}-{split}"
                                   + (f"-earlier{earlier.replace(',', '.')}" if earlier else ""))
            r = cli("export", r.stdout.strip(), "--out", release, "--tail", TINY_TAIL, "--configuration",
                    configuration, "--store", c["store"])  # fmt: skip
            assert r.returncode == 0, r.stderr
            rel = load_release_maps(c["lm"], release)
            assert set(rel.map_kinds.values()) == {maps}, rel.map_kinds
            assert len(rel.release.states) == 1 + len(earlier.split(",") if earlier else ()), rel.release.states
            rng = np.random.default_rng(0)
            prompts = {f"p{i}": rng.integers(6, 320, int(rng.integers(100, 220))).tolist() for i in range(TINY_PROMPTS)}
            refs = {name: reference(c["lm"], p, rel.arm, **rel.options()) for name, p in prompts.items()}
            made[key] = {"model": c["model"], "rel": rel, "release": release, "prompts": prompts, "refs": refs}
        return made[key]

    return make


def tiny_filled_rows(prompts: dict, refs: dict) -> int:
    return sum(len(p) - TINY_TAIL - refs[n]["exact_rows"] for n, p in prompts.items())
