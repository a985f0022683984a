"""What every command shares, declared once.

Options of every command (`RidgefillGroup` adds them to each one, so `ridgefill capture ... --store S --json` reads
as before): `--store` (default ./ridgefill-artifacts, or RIDGEFILL_STORE), `--json`, `--debug` and `-q/--quiet`.
They set the process's `Session`, which a command reads through `store()` and `output()`; `main()` reads `--debug`
from it when an error reaches it. Where a model runs: `@placed` gives a command the four placement options
(`--device`, `--dtype`, `--device-map`, `--max-memory`) and hands it one resolved `place` (a
`ridgefill.models.device.Where`), which the stage functions take as it is.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill import environment

DEFAULT_STORE = Path(environment.DEFAULTS[environment.RIDGEFILL_STORE])


@dataclass
class Session:
    """What the options of every command asked for, in this process (reset by `main()` for each command)."""

    store_root: Path = DEFAULT_STORE
    json: bool = False
    debug: bool = False


SESSION = Session()


def reset() -> None:
    global SESSION
    SESSION = Session()
    from ridgefill.output import set_quiet

    set_quiet(False)


def _setter(field: str):
    def callback(value):
        setattr(SESSION, field, value)
        return value

    return callback


def _set_quiet(value: bool) -> None:
    from ridgefill.output import set_quiet

    set_quiet(bool(value))


StoreOpt = Annotated[Path, typer.Option("--store", envvar=environment.RIDGEFILL_STORE, callback=_setter("store_root"),
                                        expose_value=False, show_default=True, help="Artifact store root.")]
JsonOpt = Annotated[bool, typer.Option("--json", callback=_setter("json"), expose_value=False,
                                       help="Print one JSON document on stdout; human output goes to stderr.")]
DebugOpt = Annotated[bool, typer.Option("--debug", callback=_setter("debug"), expose_value=False,
                                        help="Show the traceback of an error.")]
QuietOpt = Annotated[bool, typer.Option("-q", "--quiet", callback=_set_quiet, expose_value=False,
                                        help="Only warnings and errors on stderr (no progress, no info lines); stdout "
                                             "is unchanged.")]


def shared_options() -> list:
    """The click options that `RidgefillGroup` adds to every command, made by typer from the declarations above (so
    they parse, complete and show like any other option)."""
    probe = typer.Typer(add_completion=False)

    @probe.command()
    def _probe(store: StoreOpt = DEFAULT_STORE, json: JsonOpt = False, debug: DebugOpt = False,
               quiet: QuietOpt = False) -> None:  # pragma: no cover - never run
        pass

    return typer.main.get_command(probe).params


def store():
    """The artifact store of this command (`--store`)."""
    from ridgefill.artifacts import Store

    return Store(SESSION.store_root)


def output():
    """The output object of this command (`--json`; `-q` is read by Output itself)."""
    from ridgefill.output import Output

    return Output(json_mode=SESSION.json)


ModelArg = Annotated[
    str,
    typer.Argument(help="builtin:smollm2-135m, builtin:gemma3-270m, builtin:qwen2.5-coder-1.5b (the qwen extra), a "
                        "transformers dir, a .gguf file, or a hub id OWNER/NAME\\[@REV]."),
]


def warn_token_flag(out, token: str | None) -> None:
    """A token given as --token is visible in the shell history and the process list: say so (never print it)."""
    if token:
        out.warn("a token passed with --token is saved in your shell history and visible in the process list; "
                 "prefer the HF_TOKEN environment variable or `hf auth login`")


def done(out, stage: str, art, cached: bool, extra: dict | None = None) -> None:
    """The closing line of a stage: id, cache status, where it is; JSON with --json."""
    status = "cached" if cached else "written"
    out.info(f"[bold]{stage}[/bold] {art.id} ({status}) -> {art.path}")
    out.result({"stage": stage, "id": art.id, "cached": cached, "path": str(art.path),
                "summary": art.manifest.get("summary", {}), **(extra or {})}, primary=art.id)


# -- where a model runs (ridgefill/models/device.py) ----------------------------------------------------------

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
_PLACEMENT = [
    inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation=DeviceOpt),
    inspect.Parameter("dtype", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation=DtypeOpt),
    inspect.Parameter("device_map", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=DeviceMapOpt),
    inspect.Parameter("max_memory", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=MaxMemoryOpt),
]


def offsets(text: str | None, flag: str) -> tuple[int, ...] | None:
    """--earlier's value, "2,7,13" (or "none": no earlier state) -> (2, 7, 13) or (); None when not given. BadInput
    for anything else."""
    from ridgefill.errors import BadInput

    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise BadInput(f"{flag} takes offsets separated by commas (like 2,7,13) or none, got {text!r}") from None


def placed(command):
    """A command that runs a model: typer sees the four placement options in place of its `place` parameter, and
    the command is called with them resolved and checked into one `Where` (BadInput, one line, before anything
    else happens)."""
    sig = inspect.signature(command, eval_str=True)  # typer reads the annotations from this signature
    params = [p for p in sig.parameters.values() if p.name != "place"]

    @functools.wraps(command)
    def wrapper(*args, device="auto", dtype="auto", device_map=None, max_memory=None, **kwargs):
        from ridgefill.models.device import slow_dtype_warning, where

        place = where(device, dtype, device_map, max_memory)
        if (slow := slow_dtype_warning(place)) is not None:
            output().warn(slow)
        return command(*args, place=place, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params + _PLACEMENT)
    wrapper.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "place"},
                               **{p.name: p.annotation for p in _PLACEMENT}}
    return wrapper
