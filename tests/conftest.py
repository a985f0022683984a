"""Shared fixtures: tiny random models (one per supported architecture) and the `slow` marker.

Tests marked `slow` load the real built-in models (tens of seconds each); skip them with `-m "not slow"`.
"""

import sys
from pathlib import Path

import pytest

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
