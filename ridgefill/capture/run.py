"""`ridgefill capture`: one pass of the model over calibration text, accumulating ridge statistics.

Each document is one unit of work, fed chunk by chunk through the model's KV cache (capture/forward.py), so
every row keeps its whole left context; the document's first row (an attention sink with outsized
activations) is left out of the fit, and so is any later row whose state at a split is an outlier by norm
(more than `outlier_ratio` x the median of its chunk's rows: a second sink, which the fill runs exactly by the
solve's exact-row norm). `max_length` truncates documents (default: the model's context).

Units are grouped into blocks that depend on the input alone (contiguous, balanced by tokens). A block's
statistics are merged from empty, unit by unit and chunk by chunk, and the blocks are merged into the totals in
block order. Under torchrun the ranks compute blocks round-robin and rank 0 merges them in that same order
(capture/dist.py), so the artifact is the same bytes whatever the number of processes.

Every `checkpoint_every` seconds (by default 30, or less often where writing a checkpoint would take more than a
tenth of the run: config.checkpoint_due) the totals, the current block's partial statistics and the position reached go
to `.work-<id>/state.safetensors` (capture/checkpoint.py): between documents, or between two chunks of a long one,
with the model's cache there (capture/kvstate.py); after a crash (even `kill -9`) the same command resumes there,
inside the document if it stopped in one (a torchrun run at its last finished round), and writes statistics
byte-identical to an uninterrupted run.
The run itself (load, plan, feed, checkpoint, write) is capture/runner.py's; the artifact's files are
capture/artifact.py's; units and blocks, capture/units.py's; the settings (`CaptureConfig`) and defaults,
capture/config.py's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ridgefill.artifacts import Artifact, Store
from ridgefill.capture.config import CaptureConfig, check_config
from ridgefill.capture.corpus import read_corpus, split_held_out
from ridgefill.capture.dist import World
from ridgefill.capture.runner import Hooks, Job, Runner
from ridgefill.capture.units import SKIP_FIRST
from ridgefill.errors import BadInput
from ridgefill.output import Output

FORMAT_VERSION = 4  # 2: whole documents through the KV cache (was: independent windows), blocks, float32 products;
# 3: rows whose split state is an outlier by norm are not fitted; 4: the late attention layers' keys and values are
# fitted too (key/value maps: stats.safetensors' `<variant>.split<S>.kv.*`)


def capture(
    store: Store,
    model: str,
    data: list[str],
    cfg: CaptureConfig,
    out: Output,
    checkpoint_every: float | None = None,
    after_unit: Callable[[int], None] | None = None,
    *,
    place=None,
    after_chunk: Callable[[int, int], None] | None = None,
    after_load: Callable | None = None,
    after_plan: Callable | None = None,
) -> tuple[Artifact | None, bool]:
    """Run (or find cached) the capture. Returns the artifact and whether it was a cache hit. `place` (a
    ridgefill.models.device.Where; default: `where()`, the first GPU or the CPU) is where the model runs; the recipe
    records its device kind and dtype.

    Observation points (capture/runner.py's Hooks; tests, bench/rss_bench.py): `after_unit(i)` and
    `after_chunk(i, pos)` are called after unit i, and after each of its chunks with the position reached in its
    document, once any checkpoint due there is written (a single process only); `after_load(lm)` once the model is
    loaded, `after_plan(ids, units)` once the corpus is tokenized and cut into units.

    Under torchrun every rank calls this; rank 0 returns the artifact, the others return (None, cached)."""
    from ridgefill.artifacts import recipe_id
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where

    world = World()
    check_config(cfg)
    place = _placement(place or where(), world)
    world.start()
    try:
        corpus = read_corpus(data)  # the text is checked before the model is resolved (which may write the store)
        calib, held = split_held_out(corpus.documents, cfg.held_out, cfg.seed)
        with world.rank0_first():  # a hub download or a GGUF assembly happens once, on rank 0
            ref = resolve_model(model, store_root=store.root)
        splits = _splits(cfg, ref)
        if corpus.replaced:
            out.warn(f"{corpus.files_with_replacements} file(s) had non-UTF-8 bytes; {corpus.replaced} replaced with U+FFFD")
        recipe = _recipe(cfg, ref, corpus, splits, place)
        world.agree("capture id", recipe_id(recipe))
        hit = store.cached("capture", recipe) if world.writer else None
        if world.broadcast_int(int(hit is not None)):
            world.close()
            return hit, True
        job = Job(store=store, model=model, data=data, ref=ref, corpus=corpus, calib=calib, held=held, splits=splits,
                  recipe=recipe, cfg=cfg, place=place, world=world, out=out, checkpoint_every=checkpoint_every)
        hooks = Hooks(after_load=after_load, after_plan=after_plan, after_unit=after_unit, after_chunk=after_chunk)
        result = Runner(job, hooks).run()
    except BaseException:
        world.close(failed=True)
        raise
    world.close()
    return result


def _placement(place, world: World):
    """Where this process runs the model: `place`, on GPU `local_rank` under torchrun; BadInput for --device-map
    under torchrun."""
    if place.device_map is not None and world.distributed:
        raise BadInput("--device-map cannot be combined with torchrun: every rank would spread its own copy of the "
                       "model over the same devices (use one process, or --device per rank)")
    if world.distributed and place.kind == "cuda":
        place = replace(place, device=f"cuda:{world.local_rank}")  # one GPU per local rank
    return place


def _splits(cfg: CaptureConfig, ref) -> tuple[int, ...]:
    """The splits to capture (sorted, distinct; the model's default when none is given), checked against the model,
    and --max-length against its context."""
    splits = tuple(sorted(set(cfg.splits))) or (ref.default_split,)
    for s in splits:
        if not 0 < s < ref.num_layers:
            raise BadInput(f"split {s} is out of range: the model has {ref.num_layers} layers (use 1..{ref.num_layers - 1})")
        if cfg.earlier and s - max(cfg.earlier) < 0:
            raise BadInput(f"--earlier {max(cfg.earlier)} reaches below layer 0 at split {s} (the deepest earlier "
                           f"state there is h_0, offset {s})")
    if cfg.max_length is not None and ref.context_length and cfg.max_length > ref.context_length:
        raise BadInput(f"--max-length {cfg.max_length} is longer than the model's context ({ref.context_length} "
                       "positions)")
    return splits


def _recipe(cfg: CaptureConfig, ref, corpus, splits: tuple[int, ...], place) -> dict:
    """What the capture's id covers."""
    return {
        "stage": "capture",
        "version": FORMAT_VERSION,
        "model": ref.fingerprint,
        "data": corpus.digest,
        "splits": list(splits),
        "chat": cfg.chat,
        "chunk": cfg.chunk,
        "max_length": cfg.max_length,
        "held_out": cfg.held_out,
        "held_out_rows": cfg.held_out_rows,
        "seed": cfg.seed,
        "device": place.kind,
        "dtype": place.dtype,
        "product_dtype": cfg.product_dtype,
        "skip_first": SKIP_FIRST,
        "outlier_ratio": cfg.outlier_ratio,
        **({"earlier": list(cfg.earlier)} if cfg.earlier else {}),  # only when given: other ids are unchanged
        # The id covers the model's own code being allowed (solve, quantize and fold load with it); only
        # when on, so the ids of other captures are unchanged.
        **({"trust_remote_code": True} if cfg.trust_remote_code else {}),
    }
