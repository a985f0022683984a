"""`ridgefill capture MODEL --data PATH... --split S` (also under `torchrun ... -m ridgefill capture`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ridgefill.capture.config import CHECKPOINT_EVERY, DEFAULT_DATA, CaptureConfig
from ridgefill.cli.common import ModelArg, done, offsets, output, placed, store

D = CaptureConfig()  # each option's default


@placed
def capture(
    model: ModelArg,
    data: Annotated[Optional[list[str]], typer.Option("--data", help="Text file, directory of .txt/.jsonl, .jsonl with a 'text' field, or builtin:default (the default). Repeatable.")] = None,
    split: Annotated[Optional[list[int]], typer.Option("--split", help="Split layer S (repeatable: one pass serves several). Default: a built-in's measured split; otherwise half depth, 3/8 with QK-norm.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Also capture a chat-templated copy of each document (kept apart).")] = D.chat,
    chunk: Annotated[int, typer.Option("--chunk", help="Feed documents through the KV cache this many tokens at a time.")] = D.chunk,
    max_length: Annotated[Optional[int], typer.Option("--max-length", help="Truncate documents to this many tokens (default: the model's context).")] = D.max_length,
    held_out: Annotated[int, typer.Option("--held-out", help="Documents kept out of the statistics for scoring.")] = D.held_out,
    held_out_rows: Annotated[int, typer.Option("--held-out-rows", help="Rows sampled from the held-out documents.")] = D.held_out_rows,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the held-out choice.")] = D.seed,
    outlier_ratio: Annotated[float, typer.Option("--outlier-ratio", help="Rows whose split state is above this many times their chunk's median norm are not fitted, and the fill runs such rows exactly (0: every row is fitted; the fill then keeps the default ratio, 4).")] = D.outlier_ratio,
    product_dtype: Annotated[str, typer.Option("--product-dtype", help="Per-chunk products on the device: float32 (TF32 off) or float64. Totals are float64 either way.")] = D.product_dtype,
    earlier: Annotated[Optional[str], typer.Option("--earlier", help="Offsets k, like 2,7,13: the maps may read the earlier states h_(S-k) besides each split's h_S (maps from earlier states; solve picks which). Default: none.")] = None,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow the model's own Python code (off unless given).")] = D.trust_remote_code,
    checkpoint_every: Annotated[Optional[float], typer.Option("--checkpoint-every", help=f"Seconds between resumable checkpoints (0: after every document). Default: {CHECKPOINT_EVERY:g}, or less often where writing them would take more than a tenth of the run.")] = None,
) -> None:
    """Run MODEL over calibration text and accumulate the ridge statistics (resumable; torchrun shards it)."""
    from ridgefill.capture import capture as run

    out = output()
    cfg = CaptureConfig(splits=tuple(split or D.splits), chat=chat, chunk=chunk, max_length=max_length,
                        held_out=held_out, held_out_rows=held_out_rows, seed=seed, product_dtype=product_dtype,
                        outlier_ratio=outlier_ratio, earlier=offsets(earlier, "--earlier") or (),
                        trust_remote_code=trust_remote_code)
    art, cached = run(store(), model, list(data or DEFAULT_DATA), cfg, out, checkpoint_every, place=place)
    if art is None:  # a torchrun rank other than 0: rank 0 reports
        return
    s = art.manifest["summary"]
    if not cached:
        out.info(f"{s['calibration_documents']} documents, {s['calibration_tokens']} tokens, splits "
                 f"{', '.join(map(str, s['splits']))}, {s['held_out_rows']} held-out rows, "
                 f"{s['forward_tokens_per_s']} tok/s; documents truncated at {s['max_length']} tokens "
                 f"({s['max_length_from']}): {s['truncated_documents']}")
    done(out, "capture", art, cached)
