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

Every `checkpoint_every` seconds the totals, the current block's partial statistics and the position reached go
to `.work-<id>/state.safetensors` (capture/checkpoint.py): between documents, or between two chunks of a long one,
with the model's cache there (capture/kvstate.py); after a crash (even `kill -9`) the same command resumes there,
inside the document if it stopped in one (a torchrun run at its last finished round), and writes statistics
byte-identical to an uninterrupted run.
The artifact's files are capture/artifact.py's; units and blocks, capture/units.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.capture import artifact
from ridgefill.capture.checkpoint import State, concat
from ridgefill.capture.corpus import read_corpus, split_held_out
from ridgefill.capture.dist import World
from ridgefill.capture.forward import PRODUCT_DTYPES
from ridgefill.capture.stats import Moments, merge_into
from ridgefill.capture.units import SKIP_FIRST, Unit, blocks as make_blocks, make_units
from ridgefill.errors import BadInput
from ridgefill.output import Output
from ridgefill.runtime.rows import OUTLIER_RATIO

FORMAT_VERSION = 3  # 2: whole documents through the KV cache (was: independent windows), blocks, float32 products;
# 3: rows whose split state is an outlier by norm are not fitted


@dataclass(frozen=True)
class CaptureConfig:
    splits: tuple[int, ...] = ()  # empty: the model's default split
    chat: bool = False
    chunk: int = 1024  # tokens per forward through the KV cache
    max_length: int | None = None  # truncate documents; None: the model's context
    held_out: int = 4
    held_out_rows: int = 2048
    seed: int = 0
    product_dtype: str = "float32"  # the per-chunk centred products (totals are float64 either way)
    trust_remote_code: bool = False
    outlier_ratio: float = OUTLIER_RATIO  # rows whose split state exceeds this x their chunk's median norm: not fitted


def capture(
    store: Store,
    model: str,
    data: list[str],
    cfg: CaptureConfig,
    out: Output,
    checkpoint_every: float = 30.0,
    after_unit: Callable[[int], None] | None = None,
    *,
    place=None,
    after_chunk: Callable[[int, int], None] | None = None,
) -> tuple[Artifact | None, bool]:
    """Run (or find cached) the capture. Returns the artifact and whether it was a cache hit. `place` (a
    ridgefill.models.device.Where; default: `where()`, the first GPU or the CPU) is where the model runs; the recipe
    records its device kind and dtype.

    `after_unit(i)` and `after_chunk(i, pos)` (tests) are called after unit i, and after each of its chunks with the
    position reached in its document, once any checkpoint due there is written (a single process only).

    Under torchrun every rank calls this; rank 0 returns the artifact, the others return (None, cached)."""
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where

    world = World()
    if cfg.chunk < 2:
        raise BadInput(f"--chunk must be at least 2 tokens (got {cfg.chunk})")
    if cfg.max_length is not None and cfg.max_length < 2:
        raise BadInput(f"--max-length must be at least 2 tokens (got {cfg.max_length})")
    if cfg.held_out_rows < 0:
        raise BadInput("--held-out-rows must be >= 0")
    if not (cfg.outlier_ratio == 0 or cfg.outlier_ratio > 1):
        raise BadInput(f"the outlier ratio must be 0 (off) or above 1, got {cfg.outlier_ratio}")
    if cfg.product_dtype not in PRODUCT_DTYPES:
        raise BadInput(f"unknown product dtype '{cfg.product_dtype}' (choose {' or '.join(PRODUCT_DTYPES)})")
    place = place or where()
    if place.device_map is not None and world.distributed:
        raise BadInput("--device-map cannot be combined with torchrun: every rank would spread its own copy of the "
                       "model over the same devices (use one process, or --device per rank)")
    if world.distributed and place.kind == "cuda":
        place = replace(place, device=f"cuda:{world.local_rank}")  # one GPU per local rank
    world.start()
    try:
        corpus = read_corpus(data)  # the text is checked before the model is resolved (which may write the store)
        calib, held = split_held_out(corpus.documents, cfg.held_out, cfg.seed)
        with world.rank0_first():  # a hub download or a GGUF assembly happens once, on rank 0
            ref = resolve_model(model, store_root=store.root)
        splits = tuple(sorted(set(cfg.splits))) or (ref.default_split,)
        for s in splits:
            if not 0 < s < ref.num_layers:
                raise BadInput(f"split {s} is out of range: the model has {ref.num_layers} layers (use 1..{ref.num_layers - 1})")
        if cfg.max_length is not None and ref.context_length and cfg.max_length > ref.context_length:
            raise BadInput(f"--max-length {cfg.max_length} is longer than the model's context ({ref.context_length} "
                           "positions)")
        if corpus.replaced:
            out.warn(f"{corpus.files_with_replacements} file(s) had non-UTF-8 bytes; {corpus.replaced} replaced with U+FFFD")
        recipe = {
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
            # The id covers the model's own code being allowed (solve, quantize and fold load with it); only
            # when on, so the ids of other captures are unchanged.
            **({"trust_remote_code": True} if cfg.trust_remote_code else {}),
        }
        from ridgefill.artifacts import recipe_id

        world.agree("capture id", recipe_id(recipe))
        hit = store.cached("capture", recipe) if world.writer else None
        if world.broadcast_int(int(hit is not None)):
            world.close()
            return hit, True
        result = _run(store, model, data, ref, corpus, calib, held, splits, recipe, cfg, place, world, out,
                      checkpoint_every, after_unit, after_chunk)
    except BaseException:
        world.close(failed=True)
        raise
    world.close()
    return result


def _run(store, model, data, ref, corpus, calib, held, splits, recipe, cfg, place, world, out, checkpoint_every,
         after_unit, after_chunk):
    from ridgefill.capture import kvstate
    from ridgefill.capture.forward import (document_chunks, exact_float32, fitted_moments, new_cache,
                                           release_workspace)
    from ridgefill.models import load_model

    t0 = time.perf_counter()
    if ref.is_gguf:
        from ridgefill.models.load import gguf_cache_dir

        with world.rank0_first():  # the dequantized GGUF cache is written once, by rank 0; then all load at once
            gguf_cache_dir(ref, store_root=store.root)
    lm = load_model(ref, store_root=store.root, trust_remote_code=cfg.trust_remote_code, **place.load_args())
    load_s = time.perf_counter() - t0
    max_length = cfg.max_length or lm.context_length()
    ids = artifact.tokenize(lm.tokenizer, corpus, cfg.chat, max_length)
    units = make_units(ids, calib, held, cfg.held_out_rows)
    blocks = make_blocks(units)
    lo = min(splits)
    layers = list(range(lo, ref.num_layers))  # every input we need: split states and late-layer inputs
    variants = ("raw", "chat") if cfg.chat else ("raw",)
    keys = [(v, s) for v in variants for s in splits]
    d = ref.hidden_size
    empty = lambda: {kv: Moments.empty(ref.num_layers - kv[1], d, d) for kv in keys}  # noqa: E731
    held_like = {f"hidden.{l}": ((d,), np.float32) for l in layers} | {"doc": ((), np.int32), "pos": ((), np.int32)}
    in_device = lm.adapter.device  # the embeddings' (execution) device
    t_fwd = 0.0
    tokens_done = 0
    units_run = 0  # documents this process fed through the model

    def run_unit(u: Unit, part: dict, held_rows: dict, first: int = 0, cache=None, on_chunk=None) -> dict:
        """Feed one document (from token `first`, with `cache` as it was there, when resumed inside it); merge its
        chunks into `part` (per (variant, split)); collect kept rows into `held_rows`. `on_chunk(pos, cache)` after
        each chunk, `pos` the position reached."""
        nonlocal t_fwd, tokens_done, units_run
        units_run += 1
        t = time.perf_counter()
        doc_ids = ids[u.variant][u.doc]
        if cache is None:
            cache = new_cache(lm)
        for start, hs in document_chunks(lm, doc_ids, layers, cfg.chunk, in_device, first=first, cache=cache):
            rows = len(hs[lo])
            if u.held:
                keep = [p - start for p in u.keep if start <= p < start + rows]
                if keep:
                    for l in layers:
                        held_rows.setdefault(f"hidden.{l}", []).append(hs[l][keep].float().cpu().numpy())
                    held_rows.setdefault("doc", []).append(np.full(len(keep), u.doc, dtype=np.int32))
                    held_rows.setdefault("pos", []).append(np.asarray(keep, dtype=np.int32) + start)
            else:
                fitted = fitted_moments(hs, start, splits, ref.num_layers, cfg.outlier_ratio, cfg.product_dtype)
                for s, m in fitted.items():
                    part[(u.variant, s)] = merge_into(part[(u.variant, s)], m)
            del hs
            if on_chunk is not None:
                t_fwd += time.perf_counter() - t
                on_chunk(start + rows, cache)
                t = time.perf_counter()
        t_fwd += time.perf_counter() - t
        tokens_done += u.tokens - first
        return part

    def new_held() -> dict:
        return {k: [] for k in held_like}

    with store.build("capture", recipe) if world.writer else _NoBuild(recipe) as build, exact_float32():
        state = State.load(build.work, build.id, keys, empty, world) if world.writer else State(empty())
        state.next_block = world.broadcast_int(state.next_block)
        if world.distributed:  # a torchrun run restarts the unfinished block from its beginning
            state.drop_partial(empty(), blocks)
        resumed_at = state.next_unit  # 0 for a fresh run; units before it come from the checkpoint
        if (resumed_at or state.doc_pos) and world.writer:
            inside = (f", inside its document at token {state.doc_pos} of {units[resumed_at].tokens}"
                      if state.doc_pos else "")
            out.info(f"resuming capture {build.id} at unit {resumed_at}/{len(units)} "
                     f"(block {state.next_block + 1} of {len(blocks)}){inside}")
        last_ckpt = time.perf_counter()

        def checkpoint(force: bool = False) -> None:
            nonlocal last_ckpt
            if world.writer and (force or checkpoint_every <= 0 or time.perf_counter() - last_ckpt >= checkpoint_every):
                state.save(build.work, build.id)
                last_ckpt = time.perf_counter()

        not_saved: list[str] = []  # why this model's cache cannot be saved (then checkpoints fall between documents)

        def inside_document(i: int):
            """The per-chunk step of unit i: a checkpoint with the document's position and cache when one is due
            (`checkpoint_every` > 0; with 0 they fall after every document only), then `after_chunk`."""

            def on_chunk(pos: int, cache) -> None:
                nonlocal last_ckpt
                if (0 < checkpoint_every <= time.perf_counter() - last_ckpt and pos < units[i].tokens
                        and not not_saved):
                    try:
                        snap = kvstate.snapshot(cache)
                    except kvstate.NotSaved as e:
                        not_saved.append(str(e))
                        out.warn(f"capture checkpoints fall between documents only: the model's cache cannot be "
                                 f"saved inside one ({e})")
                    else:
                        state.doc_pos, state.doc_cache = pos, snap
                        try:
                            state.save(build.work, build.id)
                        finally:
                            state.doc_pos, state.doc_cache = 0, None
                        last_ckpt = time.perf_counter()
                if after_chunk is not None:
                    after_chunk(i, pos)

            return on_chunk

        with (out if world.writer else Output(quiet=True)).progress("capture", total=len(units)) as bar:
            if not world.distributed:
                for b in range(state.next_block, len(blocks)):
                    for i in range(max(blocks[b][0], state.next_unit), blocks[b][1]):
                        first, cache = 0, None
                        if state.doc_pos:  # resumed inside unit i: its document continues from the checkpoint
                            first = state.doc_pos
                            cache = kvstate.restore(lm, state.doc_cache, lambda: new_cache(lm), str(build.work))
                            state.doc_pos, state.doc_cache = 0, None
                        # the document's held-out rows go straight to the block's, so a checkpoint inside it has them
                        run_unit(units[i], state.part, state.part_held, first, cache, inside_document(i))
                        state.next_unit = i + 1
                        if i + 1 == blocks[b][1]:
                            state.finish_block(empty())
                        bar.update(i + 1, tokens_done, f"doc {i + 1}/{len(units)} · block {b + 1}/{len(blocks)}")
                        checkpoint()
                        if after_unit is not None:
                            after_unit(i)
            else:
                W = world.size
                for first in range(state.next_block, len(blocks), W):
                    b = first + world.rank
                    mine = None
                    if b < len(blocks):
                        part, held_rows = empty(), new_held()
                        for i in range(*blocks[b]):
                            run_unit(units[i], part, held_rows)
                        mine = ([part[k] for k in keys], concat(held_rows))
                        world.fault_point(b)
                    if world.writer:  # merge this round's blocks in block order, one in memory at a time
                        for r in range(min(W, len(blocks) - first)):
                            moments, held_rows = mine if r == 0 else world.recv_block(
                                r, [state.total[k] for k in keys], held_like)
                            for k, m in zip(keys, moments):
                                state.total[k] = merge_into(state.total[k], m)
                            state.add_held({k: [a] for k, a in held_rows.items()}, partial=False)
                        state.next_block = min(first + W, len(blocks))
                        state.next_unit = blocks[state.next_block - 1][1]
                        bar.update(state.next_unit, tokens_done * W, f"block {state.next_block}/{len(blocks)} · {W} ranks")
                        checkpoint()
                    elif mine is not None:
                        world.send_block(*mine)
                world.barrier()
        release_workspace()
        if not world.writer:
            return None, False
        state.write_outputs(build.path, splits, layers, ref.num_layers)
        artifact.write_counts(build.path, ids["raw"], calib, _vocab_size(lm))
        artifact.write_documents(build.path, corpus, ids, calib, held)
        n_calib_tokens = int(sum(len(ids["raw"][i]) for i in calib))
        truncated = [i for i in range(len(corpus.documents)) if ids["full_length"][i] > len(ids["raw"][i])]
        summary = {
            "splits": list(splits),
            "rows": {f"{v}.split{s}": int(state.total[(v, s)].n) for v, s in keys},
            "calibration_documents": len(calib),
            "calibration_tokens": n_calib_tokens,
            "held_out_documents": len(held),
            "held_out_rows": int(state.held_rows()),
            "max_length": max_length,
            "max_length_from": "--max-length" if cfg.max_length else "the model's context",
            "truncated_documents": len(truncated),
            "longest_document": int(max(ids["full_length"])),
            "blocks": len(blocks),
            "units": len(units),
            # this run: where it started (0, or the checkpoint it resumed from) and the documents it fed through
            # the model (under torchrun every unit from there is computed once, by one of the ranks)
            "resumed_at_unit": resumed_at,
            "units_computed": units_run if not world.distributed else len(units) - resumed_at,
            "processes": world.size,
            "forward_tokens_per_s": round(tokens_done / t_fwd, 1) if t_fwd else None,
        }
        info = {"model_spec": model, "model": artifact.model_info(ref),
                "data": data, "num_layers": ref.num_layers, "hidden_size": d, "layers": layers,
                "layer_kinds": {str(i): k for i, k in enumerate(lm.adapter.layer_kinds)},
                "placement": lm.placement()}
        art = build.commit(info=info, summary=summary, timings={"model_load_s": round(load_s, 3), "forward_s": round(t_fwd, 3)})
    return art, False


class _NoBuild:
    """What a rank other than 0 has instead of a Build: an id and nothing on disk."""

    def __init__(self, recipe: dict):
        from ridgefill.artifacts import recipe_id

        self.id, self.work = recipe_id(recipe), None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _vocab_size(lm) -> int:
    return max(len(lm.tokenizer), int(getattr(lm.model.config, "vocab_size", 0) or 0))
