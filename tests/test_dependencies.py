"""pyproject.toml's floors against the library APIs the code calls (checked on the installed versions)."""

import inspect
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def floor(name: str) -> Version:
    """The lowest version pyproject.toml allows for `name` (its `>=` bound)."""
    for dep in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]:
        req = Requirement(dep)
        if req.name == name:
            lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
            assert lows, f"{name} has no lower bound in pyproject.toml"
            return max(lows)
    raise AssertionError(f"{name} is not a dependency in pyproject.toml")


def test_transformers_floor_has_the_cache_keyword():
    """Every forward here passes the KV cache as `cache=` and reads `.cache` back (capture/forward.py, the fill
    runtime, fold's check). transformers 5.24.0 is the first release with that name: up to 5.23 the keyword is
    `past_key_values`, and an unknown `cache=` is swallowed by the models' **kwargs without an error, so a capture
    silently loses every chunk's left context. The floor must not admit those versions."""
    assert floor("transformers") >= Version("5.24.0")

    from transformers import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    for model, layer in ((modeling_llama.LlamaForCausalLM, modeling_llama.LlamaDecoderLayer),
                         (modeling_llama.LlamaModel, modeling_llama.LlamaAttention),
                         (modeling_qwen2.Qwen2Model, modeling_qwen2.Qwen2DecoderLayer),
                         (modeling_qwen3.Qwen3Model, modeling_qwen3.Qwen3DecoderLayer),
                         (modeling_gemma3.Gemma3TextModel, modeling_gemma3.Gemma3DecoderLayer)):
        for cls in (model, layer):
            assert "cache" in inspect.signature(cls.forward).parameters, cls.__name__
    assert "cache" in CausalLMOutputWithPast.__dataclass_fields__
    assert "cache" in BaseModelOutputWithPast.__dataclass_fields__
    assert "config" in inspect.signature(DynamicCache.__init__).parameters  # DynamicCache(config=model.config)
    # Gemma 3's rotary embedding takes the layer kind (models/adapters.py)
    assert "layer_type" in inspect.signature(modeling_gemma3.Gemma3RotaryEmbedding.forward).parameters


def test_torch_floor_is_what_transformers_needs():
    """transformers disables PyTorch below the version its `torch` extra names; our floor must not be lower."""
    needs = [Requirement(r) for r in metadata.requires("transformers") or []]
    torch = [r for r in needs if r.name == "torch" and r.marker is not None and "torch" in str(r.marker)]
    assert torch, "transformers names no torch requirement"
    lows = [Version(s.version) for r in torch for s in r.specifier if s.operator == ">="]
    assert floor("torch") >= max(lows)


def test_an_older_transformers_is_refused_at_load_time():
    """A --no-deps install can still hold transformers 5.23, which would run without an error and give wrong
    statistics: load_model refuses it in one line, and the floor it names is pyproject.toml's."""
    import pytest

    from ridgefill.errors import BadInput
    from ridgefill.models.load import TRANSFORMERS_FLOOR, check_transformers

    assert Version(".".join(map(str, TRANSFORMERS_FLOOR))) == floor("transformers")
    with pytest.raises(BadInput, match=r"^transformers 5\.23\.0 is too old: ridgefill needs >= 5\.24 "):
        check_transformers("5.23.0")
    check_transformers("5.24.0")
    check_transformers("6.0.0.dev0")
    check_transformers()  # the installed one
