"""`ridgefill capture`: one pass of the model over calibration text, accumulating ridge statistics.

Each document is one unit of work, fed chunk by chunk through the model's KV cache (capture/forward.py), so
every row keeps its whole left context; the document's first row (an attention sink with outsized
activations) is left out of the fit, and so is any later row whose state at a split is an outlier by norm
(more than `outlier_ratio` x the median of its chunk's rows: a second sink, which the fill runs exactly). `max_length` truncates documents (default: the model's context).

Units are grouped into blocks that depend on the input alone (contiguous, balanced by tokens). A block's
statistics are merged from empty, unit by unit and chunk by chunk, and the blocks are merged into the totals in
block order. Under torchrun the ranks compute blocks round-robin and rank 0 merges them in that same order
(capture/dist.py), so the artifact is the same bytes whatever the number of processes.

Every `checkpoint_every` seconds the totals, the current block's partial statistics and the position reached go
to `.work-<id>/state.safetensors` (one file, written by rename); after a crash (even `kill -9`) the same command
resumes there (a torchrun run at its last finished round) and writes statistics byte-identical to an
uninterrupted run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts import tensors
from ridgefill.capture.corpus import Corpus, read_corpus, split_held_out
from ridgefill.capture.dist import World
from ridgefill.capture.forward import PRODUCT_DTYPES
from ridgefill.capture.stats import Moments, merge, merge_into
from ridgefill.errors import BadInput
from ridgefill.output import Output

FORMAT_VERSION = 3  # 2: whole documents through the KV cache (was: independent windows), blocks, float32 products;
# 3: rows whose split state is an outlier by norm are not fitted
SKIP_FIRST = 1  # a document's first row is an attention sink with outsized activations: not fitted
OUTLIER_RATIO = 20.0  # the fill runtime's rule (runtime.OUTLIER_RATIO): rows above 20x the median norm are sinks
MAX_BLOCKS = 64  # blocks of work; a torchrun world keeps at most this many ranks busy
STATS = "stats.safetensors"
HELDOUT = "heldout.safetensors.zst"
COUNTS = "token_counts.safetensors"
DOCS = "documents.json"
STATE = "state.safetensors"


@dataclass(frozen=True)
class CaptureConfig:
    splits: tuple[int, ...] = ()  # empty: the model's default split
    chat: bool = False
    chunk: int = 1024  # tokens per forward through the KV cache
    max_length: int | None = None  # truncate documents; None: the model's context
    held_out: int = 4
    held_out_rows: int = 2048
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (the recipe records the kind)
    dtype: str = "auto"  # model dtype: auto | float32 | bfloat16 | float16
    product_dtype: str = "float32"  # the per-chunk centred products (totals are float64 either way)
    device_map: str | dict | None = None  # "auto" (or from Python a {module: place} dict): accelerate spreads the model
    max_memory: tuple[str, ...] = ()  # with device_map: DEVICE=SIZE
    trust_remote_code: bool = False
    outlier_ratio: float = OUTLIER_RATIO  # rows whose split state exceeds this x their chunk's median norm: not fitted


@dataclass
class Unit:
    doc: int
    variant: str  # "raw" | "chat"
    tokens: int
    held: bool
    keep: list[int] = field(default_factory=list)  # held-out rows kept (document positions)


def capture(
    store: Store,
    model: str,
    data: list[str],
    cfg: CaptureConfig,
    out: Output,
    checkpoint_every: float = 30.0,
    after_unit: Callable[[int], None] | None = None,
) -> tuple[Artifact | None, bool]:
    """Run (or find cached) the capture. Returns the artifact and whether it was a cache hit.

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
    if cfg.device_map is not None and world.distributed:
        raise BadInput("--device-map cannot be combined with torchrun: every rank would spread its own copy of the "
                       "model over the same devices (use one process, or --device per rank)")
    place = where(cfg.device, cfg.dtype, cfg.device_map, list(cfg.max_memory) or None)
    if world.distributed and place.kind == "cuda":
        place = replace(place, device=f"cuda:{world.local_rank}")  # one GPU per local rank
    world.start()
    try:
        with world.rank0_first():  # a hub download or a GGUF assembly happens once, on rank 0
            ref = resolve_model(model, store_root=store.root)
        splits = tuple(sorted(set(cfg.splits))) or (ref.default_split,)
        for s in splits:
            if not 0 < s < ref.num_layers:
                raise BadInput(f"split {s} is out of range: the model has {ref.num_layers} layers (use 1..{ref.num_layers - 1})")
        corpus = read_corpus(data)
        if corpus.replaced:
            out.warn(f"{corpus.files_with_replacements} file(s) had non-UTF-8 bytes; {corpus.replaced} replaced with U+FFFD")
        calib, held = split_held_out(corpus.documents, cfg.held_out, cfg.seed)
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
                      checkpoint_every, after_unit)
    except BaseException:
        world.close(failed=True)
        raise
    world.close()
    return result


def _run(store, model, data, ref, corpus, calib, held, splits, recipe, cfg, place, world, out, checkpoint_every,
         after_unit):
    from ridgefill.capture.forward import chunk_moments, document_chunks, exact_float32, release_workspace
    from ridgefill.models import load_model
    from ridgefill.runtime.prefill import outlier_rows

    t0 = time.perf_counter()
    if ref.is_gguf:
        from ridgefill.models.load import gguf_cache_dir

        with world.rank0_first():  # the dequantized GGUF cache is written once, by rank 0; then all load at once
            gguf_cache_dir(ref, store_root=store.root)
    lm = load_model(ref, store_root=store.root, trust_remote_code=cfg.trust_remote_code, **place.load_args())
    load_s = time.perf_counter() - t0
    max_length = cfg.max_length or model_context(lm)
    ids = _tokenize(lm.tokenizer, corpus, cfg.chat, max_length)
    units = _units(ids, calib, held, cfg)
    blocks = _blocks(units)
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

    def run_unit(u: Unit, part: dict, held_rows: dict) -> dict:
        """Feed one document; merge its chunks into `part` (per (variant, split)); collect kept rows."""
        nonlocal t_fwd, tokens_done, units_run
        units_run += 1
        t = time.perf_counter()
        doc_ids = ids[u.variant][u.doc]
        for start, hs in document_chunks(lm, doc_ids, layers, cfg.chunk, in_device):
            rows = len(hs[lo])
            if u.held:
                keep = [p - start for p in u.keep if start <= p < start + rows]
                if keep:
                    for l in layers:
                        held_rows[f"hidden.{l}"].append(hs[l][keep].float().cpu().numpy())
                    held_rows["doc"].append(np.full(len(keep), u.doc, dtype=np.int32))
                    held_rows["pos"].append(np.asarray(keep, dtype=np.int32) + start)
                continue
            skip = SKIP_FIRST if start == 0 else 0
            if rows - skip < 1:
                continue
            for s in splits:
                x = hs[s][skip:]  # [n, d]
                ys = [hs[l][skip:] for l in range(s, ref.num_layers)]  # k x [n, d]
                sinks = outlier_rows(x, cfg.outlier_ratio)
                if sinks.any():
                    x, ys = x[~sinks], [y[~sinks] for y in ys]
                part[(u.variant, s)] = merge_into(part[(u.variant, s)], chunk_moments(x, ys, cfg.product_dtype))
        t_fwd += time.perf_counter() - t
        tokens_done += u.tokens
        return part

    def new_held() -> dict:
        return {k: [] for k in held_like}

    with store.build("capture", recipe) if world.writer else _NoBuild(recipe) as build, exact_float32():
        state = _State.load(build.work, build.id, keys, empty, world) if world.writer else _State(empty())
        state.next_block = world.broadcast_int(state.next_block)
        if world.distributed:  # a torchrun run restarts the unfinished block from its beginning
            state.drop_partial(empty(), blocks)
        resumed_at = state.next_unit  # 0 for a fresh run; units before it come from the checkpoint
        if resumed_at and world.writer:
            out.info(f"resuming capture {build.id} at unit {resumed_at}/{len(units)} "
                     f"(block {state.next_block + 1} of {len(blocks)})")
        last_ckpt = time.perf_counter()

        def checkpoint(force: bool = False) -> None:
            nonlocal last_ckpt
            if world.writer and (force or checkpoint_every <= 0 or time.perf_counter() - last_ckpt >= checkpoint_every):
                state.save(build.work, build.id)
                last_ckpt = time.perf_counter()

        with (out if world.writer else Output(quiet=True)).progress("capture", total=len(units)) as bar:
            if not world.distributed:
                for b in range(state.next_block, len(blocks)):
                    for i in range(max(blocks[b][0], state.next_unit), blocks[b][1]):
                        held_rows = new_held()
                        run_unit(units[i], state.part, held_rows)
                        state.add_held(held_rows, partial=True)
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
                        mine = ([part[k] for k in keys], _concat(held_rows))
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
        _write_counts(build.path / COUNTS, ids["raw"], calib, _vocab_size(lm))
        _write_docs(build.path / DOCS, corpus, ids, calib, held)
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
        info = {"model_spec": model, "model": _model_info(ref),
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


def _model_info(ref) -> dict:
    return {"name": ref.name, "revision": ref.revision, "model_type": ref.model_type,
            "num_layers": ref.num_layers, "hidden_size": ref.hidden_size, "fingerprint": ref.fingerprint}


def _vocab_size(lm) -> int:
    return max(len(lm.tokenizer), int(getattr(lm.model.config, "vocab_size", 0) or 0))


def model_context(lm) -> int | None:
    """The model's context in tokens (its text config's max_position_embeddings), or None when it says none."""
    return int(getattr(lm.model.config.get_text_config(), "max_position_embeddings", 0) or 0) or None


def _tokenize(tok, corpus: Corpus, chat: bool, max_length: int | None) -> dict[str, list]:
    """Token ids per document as int32 arrays (4 bytes a token: the only thing that grows with the corpus),
    truncated to `max_length`; "full_length" keeps each raw document's untruncated length for the report."""
    cut = lambda x: np.asarray(x[:max_length] if max_length else x, dtype=np.int32)  # noqa: E731
    raw = [tok(d.text, add_special_tokens=True)["input_ids"] for d in corpus.documents]
    ids = {"raw": [cut(x) for x in raw], "full_length": [len(x) for x in raw]}
    if chat:
        if not getattr(tok, "chat_template", None):
            raise BadInput("--chat: the model's tokenizer has no chat template")
        ids["chat"] = []
        for d in corpus.documents:
            enc = tok.apply_chat_template([{"role": "user", "content": d.text}], tokenize=True)
            ids["chat"].append(cut(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return ids


def _units(ids: dict[str, list], calib: list[int], held: list[int], cfg: CaptureConfig) -> list[Unit]:
    """Calibration documents (raw, then chat), then held-out documents (raw): one unit each."""
    units = [Unit(doc, v, len(ids[v][doc]), False) for v in ("raw", "chat") if v in ids for doc in calib]
    units = [u for u in units if u.tokens > SKIP_FIRST]
    # Held-out rows: an even share per document, evenly spaced over its usable rows (never row 0).
    if held and cfg.held_out_rows:
        quota = -(-cfg.held_out_rows // len(held))  # ceil
        for doc in held:
            n = len(ids["raw"][doc])
            if n <= SKIP_FIRST:
                continue
            take = np.unique(np.linspace(SKIP_FIRST, n - 1, num=min(quota, n - SKIP_FIRST)).round().astype(int))
            units.append(Unit(doc, "raw", n, True, [int(p) for p in take]))
    return units


def _blocks(units: list[Unit]) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of units, about equal in tokens, at most MAX_BLOCKS: fixed by the input."""
    total = sum(u.tokens for u in units)
    count = min(MAX_BLOCKS, len(units))
    if count == 0:
        return []
    # Unit i goes to the block its token midpoint falls in.
    edges, before = [], 0
    for u in units:
        edges.append(min(count - 1, int((before + u.tokens / 2) * count / total)))
        before += u.tokens
    blocks, start = [], 0
    for i in range(1, len(units) + 1):
        if i == len(units) or edges[i] != edges[i - 1]:
            blocks.append((start, i))
            start = i
    return blocks


def _concat(held_rows: dict) -> dict[str, np.ndarray]:
    """{key: list of row arrays} -> {key: one array}; the lists collapse in place, so saving a checkpoint again
    copies nothing it copied before (peak memory must not grow with the checkpoints a long run writes)."""
    for k, v in held_rows.items():
        if len(v) > 1:
            held_rows[k] = [np.concatenate(v)]
    return {k: v[0] for k, v in held_rows.items() if v}


class _State:
    """Totals over finished blocks, the current block's partial statistics, held-out rows; saved exactly."""

    def __init__(self, total: dict):
        self.total = total  # {(variant, split): Moments} over blocks < next_block
        self.part = {k: Moments.empty(len(m.yy), len(m.mean_x), m.mean_y.shape[1]) for k, m in total.items()}  # same shapes
        self.held: dict[str, list[np.ndarray]] = {}  # rows of finished blocks
        self.part_held: dict[str, list[np.ndarray]] = {}  # rows of the current block
        self.next_block = 0
        self.next_unit = 0

    @classmethod
    def load(cls, work: Path, run_id: str, keys, empty, world: World) -> "_State":
        st = cls(empty())
        f = work / STATE
        if f.is_file():
            arrays, meta = tensors.load(f)
            if meta.get("id") == run_id:
                for v, s in keys:
                    st.total[(v, s)] = Moments.from_arrays(arrays, f"total.{v}.split{s}")
                    st.part[(v, s)] = Moments.from_arrays(arrays, f"part.{v}.split{s}")
                for name in arrays:
                    for prefix, into in (("held.", st.held), ("partheld.", st.part_held)):
                        if name.startswith(prefix):
                            into[name.removeprefix(prefix)] = [arrays[name]]
                st.next_block, st.next_unit = int(meta["next_block"]), int(meta["next_unit"])
        return st

    def drop_partial(self, empty: dict, blocks) -> None:
        self.part, self.part_held = empty, {}
        self.next_unit = blocks[self.next_block - 1][1] if self.next_block else 0

    def add_held(self, rows: dict[str, list[np.ndarray]], partial: bool) -> None:
        into = self.part_held if partial else self.held
        for k, v in rows.items():
            if v:
                into.setdefault(k, []).extend(v)

    def finish_block(self, empty: dict) -> None:
        for k, m in self.part.items():
            self.total[k] = merge_into(self.total[k], m)
        self.add_held(self.part_held, partial=False)
        self.part, self.part_held = empty, {}
        self.next_block += 1

    def held_rows(self) -> int:
        return int(sum(len(a) for a in self.held.get("doc", [])))

    def _arrays(self, which: dict) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        for (v, s), m in which.items():
            arrays.update(m.to_arrays(f"{v}.split{s}"))
        return arrays

    def save(self, work: Path, run_id: str) -> None:
        work.mkdir(parents=True, exist_ok=True)
        arrays = {f"total.{k}": a for k, a in self._arrays(self.total).items()}
        arrays |= {f"part.{k}": a for k, a in self._arrays(self.part).items()}
        arrays |= {f"held.{k}": a for k, a in _concat(self.held).items()}
        arrays |= {f"partheld.{k}": a for k, a in _concat(self.part_held).items()}
        meta = {"id": run_id, "next_block": str(self.next_block), "next_unit": str(self.next_unit)}
        tensors.save(work / STATE, arrays, meta)

    def write_outputs(self, path: Path, splits, layers, num_layers) -> None:
        variants = list(dict.fromkeys(v for v, _ in self.total))
        meta = {"splits": ",".join(map(str, splits)), "variants": ",".join(variants), "num_layers": str(num_layers)}
        tensors.save(path / STATS, self._arrays(self.total), meta)
        held = _concat(self.held)
        if held:
            tensors.save_zst(path / HELDOUT, held, {"layers": ",".join(map(str, layers))})


def _write_counts(path: Path, raw: list[np.ndarray], calib: list[int], vocab: int) -> None:
    counts = np.zeros(vocab, dtype=np.int64)
    for i in calib:
        counts += np.bincount(np.asarray(raw[i], dtype=np.int64), minlength=vocab)[:vocab]
    tensors.save(path, {"counts": counts})


def _write_docs(path: Path, corpus: Corpus, ids, calib, held) -> None:
    from ridgefill.artifacts.store import write_json

    role = {i: "calibration" for i in calib} | {i: "held_out" for i in held}
    write_json(path, [{"name": d.name, "sha256": d.sha256, "tokens": len(ids["raw"][i]), "role": role[i]}
                      for i, d in enumerate(corpus.documents)])


def load_stats(art: Artifact, split: int, chat_share: float | None = None) -> Moments:
    """The capture's moments for one split; raw and chat statistics mixed by `chat_share`."""
    from ridgefill.capture.stats import mix

    arrays, meta = tensors.load(art.file(STATS))
    splits = [int(s) for s in meta["splits"].split(",")]
    if split not in splits:
        raise BadInput(f"capture {art.id} has no split {split} (it has {', '.join(map(str, splits))})")
    raw = Moments.from_arrays(arrays, f"raw.split{split}")
    if "chat" not in meta["variants"].split(","):
        if chat_share not in (None, 0.0):
            raise BadInput(f"--chat-share: capture {art.id} has no chat statistics (capture with --chat)")
        return raw
    chat = Moments.from_arrays(arrays, f"chat.split{split}")
    if chat_share is None:
        return merge(raw, chat)
    if not 0.0 <= chat_share <= 1.0:
        raise BadInput("--chat-share must be between 0 and 1")
    return mix(raw, chat, chat_share)


def load_heldout(art: Artifact) -> dict[str, np.ndarray]:
    if not art.file(HELDOUT).is_file():
        raise BadInput(f"capture {art.id} has no held-out rows (capture with --held-out N, N >= 1)")
    arrays, _ = tensors.load_zst(art.file(HELDOUT))
    return arrays
