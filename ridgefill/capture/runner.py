"""One capture run whose recipe is known and not cached: load the model, tokenize the corpus and plan the units,
feed them (one process in order, or torchrun's round-robin blocks), checkpoint, and write the artifact.

    Runner(Job(...), Hooks(...)).run()       # capture/run.py's `capture` builds the Job after checking its inputs

`Job` is what the run works from, fixed before it starts; `Runner` holds what the run builds up, as attributes:
the model and the plan (`load`, `plan`), the resumable `state` (capture/checkpoint.py) and the `build` it writes
into, and this process's counters (forward seconds, tokens and units fed, the last checkpoint's time). What the
run guarantees (blocks merged in block order, resumable anywhere, the same bytes whatever the processes) is
capture/run.py's docstring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.capture import artifact, forward, kvstate  # forward.* looked up at call time: tests replace them
from ridgefill.capture.checkpoint import State, concat
from ridgefill.capture.config import checkpoint_due
from ridgefill.capture.corpus import Corpus
from ridgefill.capture.dist import World
from ridgefill.capture.stats import INPUT, KV, Moments, merge_into
from ridgefill.capture.units import Unit, blocks as make_blocks, make_units
from ridgefill.output import Output

if TYPE_CHECKING:
    from ridgefill.capture.config import CaptureConfig


@dataclass(frozen=True)
class Job:
    """What one capture run works from, all resolved and checked by `capture` before the run starts."""

    store: Store
    model: str  # the model as given (the artifact's info records it)
    data: list[str]  # the --data arguments as given
    ref: Any  # the resolved model (ridgefill.models.ModelRef)
    corpus: Corpus
    calib: list[int]  # calibration documents (indices into corpus.documents)
    held: list[int]  # held-out documents
    splits: tuple[int, ...]  # sorted, distinct
    recipe: dict
    cfg: CaptureConfig
    place: Any  # where the model runs (ridgefill.models.device.Where)
    world: World
    out: Output
    checkpoint_every: float | None  # seconds; 0: after every document (none inside one); None: config.checkpoint_due


@dataclass(frozen=True)
class Hooks:
    """Observation points of a run (tests, bench/rss_bench.py), each optional. `after_load(lm)` once the model is
    loaded and `after_plan(ids, units)` once the corpus is tokenized ({variant: [ids per document]}, as
    artifact.tokenize gives) and cut into units, in every process; `after_unit(i)` after unit i and
    `after_chunk(i, pos)` after each of its chunks (`pos`: the position reached in its document), once any
    checkpoint due there is written, in a single process only."""

    after_load: Callable[[Any], None] | None = None
    after_plan: Callable[[dict, list[Unit]], None] | None = None
    after_unit: Callable[[int], None] | None = None
    after_chunk: Callable[[int, int], None] | None = None


class Runner:
    """One run of a Job: `run()` returns (the artifact, False) on rank 0 and (None, False) on the others."""

    def __init__(self, job: Job, hooks: Hooks = Hooks()):
        self.job, self.hooks = job, hooks
        self.cfg = job.cfg
        # What this process did (the summary and timings report it).
        self.load_s = 0.0
        self.forward_s = 0.0  # feeding documents, checkpoints inside them left out
        self.tokens_done = 0
        self.units_run = 0  # documents fed through the model
        self.resumed_at = 0  # the unit this run started at (0, or the checkpoint's)
        self.last_checkpoint = 0.0  # perf_counter time of the last checkpoint (or of the start)
        self.save_s = 0.0  # how long the last checkpoint took to write
        self.not_saved: str | None = None  # why the cache cannot be saved (then checkpoints fall between documents)

    # -- the steps, in order -------------------------------------------------------------------------------

    def run(self) -> tuple[Artifact | None, bool]:
        job, world = self.job, self.job.world
        self.load()
        self.plan()
        building = job.store.build("capture", job.recipe) if world.writer else _NoBuild(job.recipe)
        with building as build, forward.exact_float32():
            self.build = build
            self.state = self.start_state()
            self.last_checkpoint = time.perf_counter()
            with (job.out if world.writer else Output(quiet=True)).progress("capture", total=len(self.units)) as bar:
                if world.distributed:
                    self.run_rounds(bar)
                else:
                    self.run_in_order(bar)
            forward.release_workspace()
            if not world.writer:
                return None, False
            return self.write(), False

    def load(self) -> None:
        """Load the model (a GGUF's dequantized cache is written once, by rank 0; then every rank loads it)."""
        from ridgefill.models import load_model

        job = self.job
        t0 = time.perf_counter()
        if job.ref.is_gguf:
            from ridgefill.models.load import gguf_cache_dir

            with job.world.rank0_first():
                gguf_cache_dir(job.ref, store_root=job.store.root, dtype=job.place.dtype)
        self.lm = load_model(job.ref, store_root=job.store.root, trust_remote_code=self.cfg.trust_remote_code,
                             **job.place.load_args())
        self.load_s = time.perf_counter() - t0
        self.in_device = self.lm.adapter.device  # the embeddings' (execution) device
        if self.hooks.after_load is not None:
            self.hooks.after_load(self.lm)

    def plan(self) -> None:
        """Tokenize the corpus, cut it into units and blocks (capture/units.py), and fix the layers read and the
        statistics' keys."""
        job, cfg = self.job, self.cfg
        self.max_length = cfg.max_length or self.lm.context_length()
        self.ids = artifact.tokenize(self.lm.tokenizer, job.corpus, cfg.chat, self.max_length)
        self.units = make_units(self.ids, job.calib, job.held, cfg.held_out_rows)
        self.blocks = make_blocks(self.units)
        self.lo = min(job.splits)
        late = range(self.lo, job.ref.num_layers)
        # every input needed: split states, late-layer inputs, the earlier states stacked under a split's
        self.layers = sorted(set(late) | {s - k for s in job.splits for k in cfg.earlier})
        variants = ("raw", "chat") if cfg.chat else ("raw",)
        ad = self.lm.adapter
        # the late attention layers: their keys and values are fitted too (key/value maps), for every split below one
        self.kv_layers = [l for l in late if not ad.is_linear(l)]
        self.kv_width = ad.kv_width
        self.kv_of = forward.key_value_targets(ad)
        self.keys = [(v, s, t) for v in variants for s in job.splits
                     for t in ((INPUT, KV) if any(l >= s for l in self.kv_layers) else (INPUT,))]
        d = job.ref.hidden_size
        self.held_like = ({f"hidden.{l}": ((d,), np.float32) for l in self.layers}
                          | {"doc": ((), np.int32), "pos": ((), np.int32)})  # one held-out row's arrays
        if self.hooks.after_plan is not None:
            self.hooks.after_plan(self.ids, self.units)

    def start_state(self) -> State:
        """The state to start from: rank 0 reads this id's checkpoint, if any (else empty), and the others learn its
        block; under torchrun the unfinished block restarts from its beginning."""
        world, build = self.job.world, self.build
        state = State.load(build.work, build.id, self.keys, self.empty, world) if world.writer else State(self.empty())
        state.next_block = world.broadcast_int(state.next_block)
        if world.distributed:
            state.drop_partial(self.empty(), self.blocks)
        self.resumed_at = state.next_unit
        if (self.resumed_at or state.doc_pos) and world.writer:
            inside = (f", inside its document at token {state.doc_pos} of {self.units[self.resumed_at].tokens}"
                      if state.doc_pos else "")
            self.job.out.info(f"resuming capture {build.id} at unit {self.resumed_at}/{len(self.units)} "
                              f"(block {state.next_block + 1} of {len(self.blocks)}){inside}")
        return state

    def run_in_order(self, bar) -> None:
        """A single process: every unit from the checkpoint on, in order, into the current block's partial
        statistics, which join the totals when the block's last unit is done; checkpoints between and inside
        documents."""
        state, units, blocks = self.state, self.units, self.blocks
        for b in range(state.next_block, len(blocks)):
            for i in range(max(blocks[b][0], state.next_unit), blocks[b][1]):
                first, cache = self.resume_inside()
                # the document's held-out rows go straight to the block's, so a checkpoint inside it has them
                self.feed(units[i], state.part, state.part_held, first=first, cache=cache, index=i)
                state.next_unit = i + 1
                if i + 1 == blocks[b][1]:
                    state.finish_block(self.empty())
                bar.update(i + 1, self.tokens_done, f"doc {i + 1}/{len(units)} · block {b + 1}/{len(blocks)}")
                self.checkpoint()
                if self.hooks.after_unit is not None:
                    self.hooks.after_unit(i)

    def run_rounds(self, bar) -> None:
        """torchrun: in round j, rank r computes block j*W + r from empty; rank 0 merges the round's blocks
        (capture/dist.py)."""
        world = self.job.world
        for first in range(self.state.next_block, len(self.blocks), world.size):
            mine = self.compute_block(first + world.rank)
            if world.writer:
                self.merge_round(first, mine, bar)
            elif mine is not None:
                world.send_block(*mine)
        world.barrier()

    def write(self) -> Artifact:
        """Rank 0: the statistics, held-out rows, token counts and document list, then the manifest."""
        job, state, build, ids = self.job, self.state, self.build, self.ids
        state.write_outputs(build.path, job.splits, self.layers, job.ref.num_layers, self.kv_layers, self.cfg.earlier)
        artifact.write_counts(build.path, ids["raw"], job.calib, _vocab_size(self.lm))
        artifact.write_documents(build.path, job.corpus, ids, job.calib, job.held)
        return build.commit(info=self.info(), summary=self.summary(),
                            timings={"model_load_s": round(self.load_s, 3), "forward_s": round(self.forward_s, 3)})

    # -- one document ----------------------------------------------------------------------------------------

    def empty(self) -> dict[tuple[str, int, str], Moments]:
        """Empty statistics per (variant, split, target): what a block is merged from. The inputs of every late
        layer (d wide), or the keys and values of every late attention layer (`kv_width` wide)."""
        d, num_layers = self.job.ref.hidden_size, self.job.ref.num_layers
        dx = d * (1 + len(self.cfg.earlier))  # the split state, and the earlier states stacked under it

        def one(s: int, target: str) -> Moments:
            if target == INPUT:
                return Moments.empty(num_layers - s, dx, d)
            return Moments.empty(sum(l >= s for l in self.kv_layers), dx, self.kv_width)

        return {key: one(key[1], key[2]) for key in self.keys}

    def feed(self, u: Unit, part: dict, held_rows: dict, *, first: int = 0, cache=None,
             index: int | None = None) -> None:
        """Feed unit `u`'s document (from token `first`, with `cache` as it was there, when resumed inside it): a
        calibration document's chunks merge into `part` (per (variant, split)), a held-out one's kept rows go to
        `held_rows`. With `index` (a single process), `between_chunks` runs after each chunk, outside the
        forward's time."""
        self.units_run += 1
        t = time.perf_counter()
        if cache is None:
            cache = forward.new_cache(self.lm)
        doc_ids = self.ids[u.variant][u.doc]
        chunks = forward.document_chunks(self.lm, doc_ids, self.layers, self.cfg.chunk, self.in_device, first=first,
                                         cache=cache)
        for start, hs in chunks:
            rows = len(hs[self.lo])
            if u.held:
                self.keep_rows(u, start, hs, held_rows)
            else:
                self.fit_rows(u, start, hs, part)
            del hs
            if index is not None:
                self.forward_s += time.perf_counter() - t
                self.between_chunks(index, start + rows, cache)
                t = time.perf_counter()
        self.forward_s += time.perf_counter() - t
        self.tokens_done += u.tokens - first

    def fit_rows(self, u: Unit, start: int, hs: dict, part: dict) -> None:
        """Merge one chunk's fitted rows (sink and outliers left out: forward.fitted_moments) into `part`."""
        cfg = self.cfg
        fitted = forward.fitted_moments(hs, start, self.job.splits, self.job.ref.num_layers, cfg.outlier_ratio,
                                        cfg.product_dtype, self.kv_layers, self.kv_of, cfg.earlier)
        for (s, target), m in fitted.items():
            part[(u.variant, s, target)] = merge_into(part[(u.variant, s, target)], m)

    def keep_rows(self, u: Unit, start: int, hs: dict, held_rows: dict) -> None:
        """Append the held-out rows of one chunk that `u` keeps (every layer read, their document and position)."""
        rows = len(hs[self.lo])
        keep = [p - start for p in u.keep if start <= p < start + rows]
        if keep:
            for l in self.layers:
                held_rows.setdefault(f"hidden.{l}", []).append(hs[l][keep].float().cpu().numpy())
            held_rows.setdefault("doc", []).append(np.full(len(keep), u.doc, dtype=np.int32))
            held_rows.setdefault("pos", []).append(np.asarray(keep, dtype=np.int32) + start)

    def resume_inside(self) -> tuple[int, Any]:
        """(first token, cache) for the unit about to run: (0, None), unless the checkpoint stopped inside it; then
        its position and the cache restored from the checkpoint, which the state then lets go of."""
        state = self.state
        if not state.doc_pos:
            return 0, None
        first = state.doc_pos
        cache = kvstate.restore(self.lm, state.doc_cache, partial(forward.new_cache, self.lm), str(self.build.work))
        state.doc_pos, state.doc_cache = 0, None
        return first, cache

    # -- checkpoints ---------------------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Between documents (or rounds): save the state when one is due (`checkpoint_every` seconds since the
        last, or every time with 0). Only rank 0 writes."""
        if self.job.world.writer and (self.per_document() or self.due()):
            self.save()

    def per_document(self) -> bool:
        """--checkpoint-every 0: a checkpoint after every document, and none inside one."""
        return self.job.checkpoint_every is not None and self.job.checkpoint_every <= 0

    def due(self) -> bool:
        return checkpoint_due(time.perf_counter() - self.last_checkpoint, self.job.checkpoint_every, self.save_s)

    def save(self) -> None:
        t = time.perf_counter()
        self.state.save(self.build.work, self.build.id)
        self.last_checkpoint = time.perf_counter()
        self.save_s = self.last_checkpoint - t

    def between_chunks(self, i: int, pos: int, cache) -> None:
        """After a chunk of unit i: a checkpoint with the document's position and cache when one is due
        (`checkpoint_every` > 0; with 0 they fall after every document only), then `after_chunk`."""
        due = not self.per_document() and self.due()
        if due and pos < self.units[i].tokens and self.not_saved is None:
            self.checkpoint_inside(pos, cache)
        if self.hooks.after_chunk is not None:
            self.hooks.after_chunk(i, pos)

    def checkpoint_inside(self, pos: int, cache) -> None:
        """Save the state with the document's position and the model's cache there; a cache that cannot be saved
        (kvstate.NotSaved) is said once, and checkpoints fall between documents from then on."""
        try:
            snap = kvstate.snapshot(cache)
        except kvstate.NotSaved as e:
            self.not_saved = str(e)
            self.job.out.warn(f"capture checkpoints fall between documents only: the model's cache cannot be saved "
                              f"inside one ({e})")
            return
        state = self.state
        state.doc_pos, state.doc_cache = pos, snap
        try:
            self.save()
        finally:
            state.doc_pos, state.doc_cache = 0, None

    # -- torchrun --------------------------------------------------------------------------------------------

    def compute_block(self, b: int) -> tuple[list[Moments], dict[str, np.ndarray]] | None:
        """Block b from empty: (its statistics in `keys` order, its held-out rows); None past the last block."""
        if b >= len(self.blocks):
            return None
        part, held_rows = self.empty(), {k: [] for k in self.held_like}
        for i in range(*self.blocks[b]):
            self.feed(self.units[i], part, held_rows)
        mine = ([part[k] for k in self.keys], concat(held_rows))
        self.job.world.fault_point(b)
        return mine

    def merge_round(self, first: int, mine, bar) -> None:
        """Rank 0: merge the round's blocks (its own, then each rank's as received) into the totals in block order,
        one in memory at a time; then a checkpoint."""
        world, state, blocks, W = self.job.world, self.state, self.blocks, self.job.world.size
        for r in range(min(W, len(blocks) - first)):
            moments, held_rows = mine if r == 0 else world.recv_block(r, [state.total[k] for k in self.keys],
                                                                      self.held_like)
            for k, m in zip(self.keys, moments):
                state.total[k] = merge_into(state.total[k], m)
            state.add_held({k: [a] for k, a in held_rows.items()}, partial=False)
        state.next_block = min(first + W, len(blocks))
        state.next_unit = blocks[state.next_block - 1][1]
        bar.update(state.next_unit, self.tokens_done * W, f"block {state.next_block}/{len(blocks)} · {W} ranks")
        self.checkpoint()

    # -- the manifest --------------------------------------------------------------------------------------------

    def summary(self) -> dict:
        job, cfg, ids, world = self.job, self.cfg, self.ids, self.job.world
        truncated = [i for i in range(len(job.corpus.documents)) if ids["full_length"][i] > len(ids["raw"][i])]
        return {
            "splits": list(job.splits),
            **({"earlier": list(cfg.earlier)} if cfg.earlier else {}),
            "rows": {f"{v}.split{s}": int(self.state.total[(v, s, t)].n) for v, s, t in self.keys if t == INPUT},
            "calibration_documents": len(job.calib),
            "calibration_tokens": int(sum(len(ids["raw"][i]) for i in job.calib)),
            "held_out_documents": len(job.held),
            "held_out_rows": int(self.state.held_rows()),
            "max_length": self.max_length,
            "max_length_from": "--max-length" if cfg.max_length else "the model's context",
            "truncated_documents": len(truncated),
            "longest_document": int(max(ids["full_length"])),
            "blocks": len(self.blocks),
            "units": len(self.units),
            # this run: where it started (0, or the checkpoint it resumed from) and the documents it fed through
            # the model (under torchrun every unit from there is computed once, by one of the ranks)
            "resumed_at_unit": self.resumed_at,
            "units_computed": self.units_run if not world.distributed else len(self.units) - self.resumed_at,
            "processes": world.size,
            "forward_tokens_per_s": round(self.tokens_done / self.forward_s, 1) if self.forward_s else None,
        }

    def info(self) -> dict:
        job = self.job
        return {"model_spec": job.model, "model": artifact.model_info(job.ref), "data": job.data,
                "num_layers": job.ref.num_layers, "hidden_size": job.ref.hidden_size, "layers": self.layers,
                "layer_kinds": {str(i): k for i, k in enumerate(self.lm.adapter.layer_kinds)},
                "placement": self.lm.placement()}


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
