"""Every environment variable ridgefill reads: its name, default and meaning, in one table (`VARIABLES`).

The modules that read one import its name from here and read it with `get` (or hand the name to typer as an
`envvar`); nothing else in the package touches `os.environ` (tests/test_environment.py holds the package to this,
and docs/cli.md's "Environment" table to `VARIABLES`). Each is read when it is used, not at import, so a caller
can change it later. Standard library only: the CLI's `--help`, the engines' environments and the vLLM plugin
import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One variable: `default` is what `get` returns while it is unset or empty ("" for none, or where the
    default is derived, as `meaning` says)."""

    name: str
    default: str
    meaning: str


RIDGEFILL_STORE = "RIDGEFILL_STORE"
RIDGEFILL_DEBUG = "RIDGEFILL_DEBUG"
RIDGEFILL_CACHE = "RIDGEFILL_CACHE"
RIDGEFILL_RELEASE = "RIDGEFILL_RELEASE"
RIDGEFILL_FAULT = "RIDGEFILL_FAULT"
HF_ENDPOINT = "HF_ENDPOINT"
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"
TRANSFORMERS_OFFLINE = "TRANSFORMERS_OFFLINE"
HF_HOME = "HF_HOME"
HF_HUB_CACHE = "HF_HUB_CACHE"
HUGGINGFACE_HUB_CACHE = "HUGGINGFACE_HUB_CACHE"
XDG_CACHE_HOME = "XDG_CACHE_HOME"
WORLD_SIZE = "WORLD_SIZE"
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
VLLM_USE_V2_MODEL_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
VLLM_USE_BREAKABLE_CUDAGRAPH = "VLLM_USE_BREAKABLE_CUDAGRAPH"

VARIABLES = (
    Variable(RIDGEFILL_STORE, "./ridgefill-artifacts", "the artifact store, where `--store` is not given"),
    Variable(RIDGEFILL_DEBUG, "", "any value: show an error's traceback, as `--debug` does"),
    Variable(RIDGEFILL_CACHE, "~/.cache/ridgefill", "the root of the cache Hub releases (`hf://...`) are pulled "
             "into (`$RIDGEFILL_CACHE/releases`)"),
    Variable(RIDGEFILL_RELEASE, "", "the vLLM plugin's switch: the release to serve (a folder or `hf://owner/name"
             "[@rev]`); unset or empty, vLLM runs untouched"),
    Variable(RIDGEFILL_FAULT, "", "tests only: `RANK:BLOCK` makes that torchrun rank of `capture` exit abruptly "
             "after that block"),
    Variable(HF_ENDPOINT, "https://huggingface.co", "the Hub to talk to"),
    Variable(HF_HUB_OFFLINE, "", "1, ON, YES or TRUE: never contact the Hub (models from the cache; push and pull "
             "refused)"),
    Variable(TRANSFORMERS_OFFLINE, "", "the same, where HF_HUB_OFFLINE is not set"),
    Variable(HF_HOME, "", "Hugging Face's home (default `$XDG_CACHE_HOME/huggingface`); the hub cache is its "
             "`hub` folder"),
    Variable(HF_HUB_CACHE, "", "the Hugging Face hub cache models are downloaded into (default `$HF_HOME/hub`)"),
    Variable(HUGGINGFACE_HUB_CACHE, "", "the same, where HF_HUB_CACHE is not set"),
    Variable(XDG_CACHE_HOME, "~/.cache", "the base of HF_HOME's default"),
    Variable(WORLD_SIZE, "1", "set by torchrun: the number of `capture` ranks"),
    Variable(RANK, "0", "set by torchrun: this rank"),
    Variable(LOCAL_RANK, "0", "set by torchrun: this rank on its machine (its GPU)"),
    Variable(VLLM_USE_V2_MODEL_RUNNER, "", "vLLM's: the fill runs on the V1 model runner; 1 or true is refused "
             "with the fill on (the plugin sets 0)"),
    Variable(VLLM_USE_BREAKABLE_CUDAGRAPH, "0", "vLLM's: 1 is refused with the fill on (it replays vLLM's own "
             "graph for steps the fill runs)"),
)  # fmt: skip
DEFAULTS = {v.name: v.default for v in VARIABLES}


def markdown() -> str:
    """VARIABLES as docs/cli.md's "Environment" table (tests/test_environment.py checks the page against it)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {f'`{v.default}`' if v.default else 'unset'} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"


def get(name: str) -> str:
    """The variable `name` (one of VARIABLES) as it is now, or its default while it is unset or empty."""
    return os.environ.get(name) or DEFAULTS[name]


def raw(name: str) -> str | None:
    """The variable `name` (one of VARIABLES) exactly as set, None when unset: for the readers that tell an empty
    value from blanks (RIDGEFILL_RELEASE)."""
    if name not in DEFAULTS:
        raise KeyError(name)
    return os.environ.get(name)


def put(name: str, value: str) -> None:
    """Set the variable `name` (one of VARIABLES) for this process and the ones it starts."""
    if name not in DEFAULTS:
        raise KeyError(name)
    os.environ[name] = value
