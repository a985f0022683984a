"""Shared fixtures: tiny random models (one per supported architecture), the small capture -> solve (-> export) chain
on one of them (`tiny_chain`, `ChainSpec`), and the `slow` marker.

Tests marked `slow` load the real built-in models (tens of seconds each); skip them with `-m "not slow"`.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# tiny.py sits next to this file; make it importable whether or not tests/ is a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import make_tiny_model  # noqa: E402


def pytest_configure(config):
    from ridgefill.memory import keep_freed_memory

    keep_freed_memory()  # as the CLI does: the in-process CLI runs and the models reuse freed memory
    # Registered here so that no pytest.ini is needed and `--strict-markers` accepts it.
    config.addinivalue_line("markers", "slow: loads a real built-in model (tens of seconds); -m 'not slow' skips")
    config.addinivalue_line("markers", "engines: runs a serving engine from .engines/ (scripts/test-engines.sh)")
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # under pytest-xdist (scripts/test-engines.sh: `-n 2`)
    if worker:  # one core per worker: its torch, and the engines it starts, bound there (vLLM binds every core)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(worker.removeprefix("gw")) % (os.cpu_count() or 1)))
        torch.set_num_threads(1)


def tiny_model_fixture(name: str, arch: str, folder: str, **options):
    """The session fixture `name`: the tiny `arch` model (`make_tiny_model(..., **options)`), written once per session
    into a fresh temporary `tiny*/<folder>`."""

    def make(tmp_path_factory) -> Path:
        return make_tiny_model(tmp_path_factory.mktemp("tiny") / folder, arch=arch, **options)

    make.__doc__ = f"The folder of the tiny {arch} model{f' ({options})' if options else ''}, written once per session."
    return pytest.fixture(scope="session", name=name)(make)


# architecture -> its tiny model's fixture (read by lm_of and by the tests parametrized by architecture). Each entry
# defines that fixture here, its model written into a folder named after it (tiny_qwen3_next -> tiny*/qwen3_next).
TINY_FIXTURES = {"llama": "tiny_llama", "gemma3_text": "tiny_gemma3", "qwen2": "tiny_qwen2", "qwen3": "tiny_qwen3",
                 "qwen3_next": "tiny_qwen3_next", "qwen3_5": "tiny_qwen3_5"}
globals().update({name: tiny_model_fixture(name, arch, name.removeprefix("tiny_"))
                  for arch, name in TINY_FIXTURES.items()})
# The tiny llama's weights with a context of 1024 positions: for the sweeps of 600-token prompts, which ridgefill
# refuses past a model's context (the tiny llama's is 256).
tiny_llama_1k = tiny_model_fixture("tiny_llama_1k", "llama", "llama-1k", context=1024)
_LOADED: dict = {}  # arch -> its tiny model loaded (lm_of)


def quiet():
    """The Output the in-process stage calls get: warnings and errors only, no progress (`from conftest import
    quiet`)."""
    from ridgefill.output import Output

    return Output(quiet=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several threads crawl when the machine is busy.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lm_of(request, tmp_path_factory):
    """arch -> LoadedModel of the tiny model (loaded once per session)."""
    from ridgefill.models import load_model, resolve_model

    def get(arch):
        if arch not in _LOADED:
            path = request.getfixturevalue(TINY_FIXTURES[arch])
            store = tmp_path_factory.mktemp("store")
            _LOADED[arch] = load_model(resolve_model(str(path), store_root=store), store_root=store)
        return _LOADED[arch]

    return get


# -- one small capture -> solve (-> export) chain on a tiny model -------------------------------------------------

# Five short documents: enough calibration rows for a 64-wide tiny model, one or two held out.
CAT_TEXTS = tuple(f"document {i}: " + "the cat sat on the mat and looked around. " * (8 + i) for i in range(5))


@dataclass(frozen=True)
class ChainSpec:
    """What `tiny_chain` builds: a capture of `model` (a tiny-model fixture's name) over `texts` at `splits`, solved
    with `alphas` (None: solve's default grid); with `release` a release folder exported from the solve artifact
    (float maps; the tests that need int8 quantize through the CLI)."""

    model: str = "tiny_llama"
    texts: tuple[str, ...] = CAT_TEXTS
    splits: tuple[int, ...] = (2,)
    chunk: int = 64
    held_out: int = 1
    held_out_rows: int | None = 64
    alphas: tuple[float, ...] | None = (1e-3, 1e-1)
    release: bool = True


# The chain test_eval.py, test_devices.py and test_sweep.py use: the tiny llama at split 2, a float32 release.
SMALL_CHAIN = ChainSpec()


@dataclass(frozen=True)
class Chain:
    """One test module's own copy of a built chain: `tmp` holds `data/` (the texts), `store/` and, when asked for,
    `release/`. Artifacts are read from this copy's store, so a module may add to it without touching another's."""

    spec: ChainSpec
    model: Path
    tmp: Path
    data: Path
    store: object  # ridgefill.artifacts.Store
    cap: object  # Artifact (capture)
    sol: object  # Artifact (solve)
    release: Path | None


def _build_chain(spec: ChainSpec, model: Path, root: Path) -> dict:
    """capture -> solve (-> export) in `root`, on the CPU in float32 whatever the machine has; -> the ids."""
    from ridgefill.artifacts import Store
    from ridgefill.capture import CaptureConfig, capture
    from ridgefill.export import export
    from ridgefill.export.config import ExportConfig
    from ridgefill.models.device import where
    from ridgefill.solve import solve
    from ridgefill.solve.config import SolveConfig

    out, place = quiet(), where(device="cpu", dtype="float32")
    data = root / "data"
    data.mkdir(parents=True)
    for i, text in enumerate(spec.texts):
        (data / f"d{i}.txt").write_text(text)
    st = Store(root / "store")
    extra = {} if spec.held_out_rows is None else {"held_out_rows": spec.held_out_rows}
    cfg = CaptureConfig(splits=spec.splits, chunk=spec.chunk, held_out=spec.held_out, **extra)
    cap, cached = capture(st, str(model), [str(data)], cfg, out, place=place)
    assert not cached
    sol, cached = solve(st, cap.id, SolveConfig(alphas=spec.alphas), out, place=place)
    assert not cached
    if spec.release:
        export(st, sol.id, ExportConfig(), out, out_dir=root / "release")
    return {"capture": cap.id, "solve": sol.id}


@pytest.fixture(scope="session")
def tiny_chain(request, tmp_path_factory):
    """spec -> Chain: each spec is built once per session; every call returns a fresh copy of it (its own folder and
    store), so that what one module adds (a bfloat16 solve, an eval written into the release) is not another's.

        @pytest.fixture(scope="module")
        def chain(tiny_chain):
            return tiny_chain(ChainSpec(splits=(1,), alphas=None))
    """
    import shutil

    from ridgefill.artifacts import Store

    built = {}  # spec -> (folder, ids)

    def make(spec: ChainSpec = SMALL_CHAIN) -> Chain:
        model = request.getfixturevalue(spec.model)
        if spec not in built:
            root = tmp_path_factory.mktemp("chain-built")
            built[spec] = (root, _build_chain(spec, model, root))
        root, ids = built[spec]
        tmp = tmp_path_factory.mktemp("chain")
        for name in ("data", "store", "release"):
            if (root / name).exists():
                shutil.copytree(root / name, tmp / name)
        st = Store(tmp / "store")
        return Chain(spec=spec, model=model, tmp=tmp, data=tmp / "data", store=st, cap=st.get(ids["capture"]),
                     sol=st.get(ids["solve"]), release=tmp / "release" if spec.release else None)

    return make
