"""`ridgefill engine prefix MODEL RELEASE --prompt FILE --out DIR` and `ridgefill engine fold FOLD --question TEXT
--out DIR`: engine cache folders for vLLM and llama.cpp; `ridgefill engine model MODEL --out DIR`: a Hugging Face
folder vLLM serves, for a GGUF model (docs/engines.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import ModelArg, output, placed, store

app = typer.Typer(help="For serving engines (vLLM, llama.cpp): a RidgeFill prefix or a folded cache; a model folder.",
                  no_args_is_help=True)
Out = Annotated[Path, typer.Option("--out", help="Engine cache folder to write (cache.safetensors, prompt.safetensors).")]
Force = Annotated[bool, typer.Option("--force", help="Replace an engine cache folder in --out.")]
Dtype = Annotated[str, typer.Option("--cache-dtype", help="float32, float16 or bfloat16: what the engine's cache holds.")]


def _report(out, ec, folder: Path, seconds: bool) -> None:
    n = len(ec.ids)
    took = f" in {ec.seconds:.2f} s" if seconds else ""
    out.info(f"{ec.kind} cache: {ec.cached} of {n} positions{took}; the engine computes the last {n - ec.cached} "
             f"-> {folder}")
    out.result({"kind": ec.kind, "cached": ec.cached, "tokens": n, "seconds": ec.seconds, "out": str(folder)})


@app.command("prefix")
@placed
def prefix(
    model: ModelArg,
    release: Annotated[str, typer.Argument(help="Release folder (ridgefill export) for this model, or a Hub release "
                                                "hf://OWNER/NAME\\[@REV] (pulled into the release cache once).")],
    prompt: Annotated[Path, typer.Option("--prompt", help="Text file: the whole prompt.")],
    out: Out,
    arm: Annotated[str, typer.Option("--arm", help="ridgefill (the release's fill), identity, or exact.")] = "ridgefill",
    tail: Annotated[Optional[int], typer.Option("--tail", help="Tokens the engine computes (default: the release's tail).")] = None,
    cache_dtype: Dtype = "float32",
    force: Force = False,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """A prompt's prefix computed by ridgefill, for the engine to load; the engine computes the tail."""
    from ridgefill.engines.make import make_prefix

    o = output()
    ec = make_prefix(store(), model, release, prompt, out, arm=arm, tail=tail, dtype=cache_dtype, force=force,
                     place=place, warn=o.warn)
    _report(o, ec, out, True)


@app.command("fold")
@placed
def fold(
    fold_id: Annotated[str, typer.Argument(help="Fold artifact id (or unique prefix).")],
    question: Annotated[str, typer.Option("--question", help="Text after the context: what the engine computes.")],
    out: Out,
    cache_dtype: Dtype = "float32",
    force: Force = False,
    model: Annotated[Optional[str], typer.Option("--model", help="The fold's model from another place (same fingerprint).")] = None,
    place=None,
) -> None:
    """A folded cache as r placeholder positions (keys turned for them), then the question."""
    from ridgefill.engines.make import make_fold

    ec = make_fold(store(), fold_id, question, out, dtype=cache_dtype, force=force, model=model, place=place)
    _report(output(), ec, out, False)


ModelOut = Annotated[Path, typer.Option("--out", help="Model folder to write (config, safetensors weights, "
                                                       "tokenizer, ridgefill-model.json).")]
WeightsDtype = Annotated[str, typer.Option("--dtype", help="Weights' dtype: auto (float32: a GGUF's dequantized "
                                                           "weights, unrounded), float32, bfloat16, float16.")]


@app.command("model")
def model(
    model: ModelArg,
    out: ModelOut,
    dtype: WeightsDtype = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace an engine model folder in --out.")] = False,
) -> None:
    """A Hugging Face folder vLLM serves, for a GGUF model (the built-ins too), marked with the model it comes from."""
    from ridgefill.engines.model_dir import write_model_dir

    o = output()
    md = write_model_dir(store(), model, out, dtype=dtype, force=force, info=o.info)
    o.info(f"engine model: {md.source['name']} ({md.source['fingerprint'][:12]}) as {md.dtype}, {len(md.files)} "
           f"files, {md.bytes / 1e6:.1f} MB in {md.seconds['total']:.1f} s; folder fingerprint {md.fingerprint[:12]} "
           f"-> {out}")
    o.result({"out": str(out), "dtype": md.dtype, "fingerprint": md.fingerprint, "source": md.source,
              "files": md.files, "bytes": md.bytes, "seconds": md.seconds, "built_cache": md.built_cache},
             primary=str(out))
