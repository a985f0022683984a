"""Shared fixtures: tiny random models (one per supported architecture) and the `slow` marker.

Tests marked `slow` load the real built-in models (tens of seconds each); skip them with `-m "not slow"`.
"""

import sys
from pathlib import Path

import pytest
import torch

# tiny.py sits next to this file; make it importable whether or not tests/ is a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import make_tiny_model  # noqa: E402


def pytest_configure(config):
    # Registered here so that no pytest.ini is needed and `--strict-markers` accepts it.
    config.addinivalue_line("markers", "slow: loads a real built-in model (tens of seconds); -m 'not slow' skips")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "gemma3", arch="gemma3_text")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_next", arch="qwen3_next")


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_5", arch="qwen3_5")


TINY_FIXTURES = {"llama": "tiny_llama", "gemma3_text": "tiny_gemma3", "qwen2": "tiny_qwen2", "qwen3": "tiny_qwen3",
                 "qwen3_next": "tiny_qwen3_next", "qwen3_5": "tiny_qwen3_5"}
_LOADED: dict = {}


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
