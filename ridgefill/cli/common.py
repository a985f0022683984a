"""Options shared by every command, declared once.

`-q/--quiet` is not declared in each command: `ridgefill.cli` adds `QuietOpt` to every command it registers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

StoreOpt = Annotated[
    Path,
    typer.Option("--store", envvar="RIDGEFILL_STORE", help="Artifact store root.", show_default=True),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout; human output goes to stderr.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
ModelArg = Annotated[
    str,
    typer.Argument(help="builtin:smollm2-135m, builtin:gemma3-270m, a transformers dir, a .gguf file, or a cached hub id."),
]
DEFAULT_STORE = Path("ridgefill-artifacts")


def _set_quiet(value: bool) -> None:
    from ridgefill.output import set_quiet

    set_quiet(bool(value))


QuietOpt = Annotated[
    bool,
    typer.Option("-q", "--quiet", callback=_set_quiet, expose_value=False,
                 help="Only warnings and errors on stderr (no progress, no info lines); stdout is unchanged."),
]


def output(json_mode: bool):
    from ridgefill.output import Output

    return Output(json_mode=json_mode)


def warn_token_flag(out, token: str | None) -> None:
    """A token given as --token is visible in the shell history and the process list: say so (never print it)."""
    if token:
        out.warn("a token passed with --token is saved in your shell history and visible in the process list; "
                 "prefer the HF_TOKEN environment variable or `hf auth login`")


def store(root: Path):
    from ridgefill.artifacts import Store

    return Store(root)


def done(out, stage: str, art, cached: bool, extra: dict | None = None) -> None:
    """The closing line of a stage: id, cache status, where it is; JSON with --json."""
    status = "cached" if cached else "written"
    out.info(f"[bold]{stage}[/bold] {art.id} ({status}) -> {art.path}")
    out.result({"stage": stage, "id": art.id, "cached": cached, "path": str(art.path),
                "summary": art.manifest.get("summary", {}), **(extra or {})}, primary=art.id)

# Where a model runs (ridgefill/models/device.py): on every command that runs one.
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (first CUDA device, else CPU), cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Model dtype: auto (bfloat16 on a GPU, float32 on CPU), float32, bfloat16, float16.")]
DeviceMapOpt = Annotated[
    Optional[str],
    typer.Option("--device-map", help="'auto': spread the model over GPUs, CPU memory and disk with accelerate."),
]
MaxMemoryOpt = Annotated[
    Optional[list[str]],
    typer.Option("--max-memory", help="With --device-map: DEVICE=SIZE per device, e.g. 0=20GiB, cpu=64GiB; disk=SIZE caps what goes to disk (disk=0: nothing). Repeatable."),
]
