"""`ridgefill capture`: one pass of the model over calibration text, accumulating ridge statistics.

Work is cut into units (one window of one document, raw or chat-templated). After each unit the unit's
moments are merged into the running totals in a fixed order, so the result depends only on the input.
Every `checkpoint_every` seconds the totals and the index of the next unit go to `.work-<id>/state`, one
file written by rename; after a crash (even `kill -9`) the same command resumes from there and finishes
with statistics byte-identical to an uninterrupted run, counting no unit twice.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts import tensors
from ridgefill.capture.corpus import Corpus, read_corpus, split_held_out
from ridgefill.capture.stats import Moments, merge, moments_of
from ridgefill.errors import BadInput
from ridgefill.output import Output

FORMAT_VERSION = 1
SKIP_FIRST = 1  # the first row of every window is an attention sink with outsized activations: not fitted
STATS = "stats.safetensors"
HELDOUT = "heldout.safetensors.zst"
COUNTS = "token_counts.safetensors"
DOCS = "documents.json"


@dataclass(frozen=True)
class CaptureConfig:
    splits: tuple[int, ...] = ()  # empty: the model's default split
    chat: bool = False
    max_tokens: int = 1024
    held_out: int = 4
    held_out_rows: int = 2048
    seed: int = 0
    dtype: str = "float32"
    trust_remote_code: bool = False


@dataclass
class Unit:
    doc: int
    variant: str  # "raw" | "chat"
    start: int
    end: int
    held: bool
    keep: list[int] = field(default_factory=list)  # held-out rows kept (window positions)


def capture(
    store: Store,
    model: str,
    data: list[str],
    cfg: CaptureConfig,
    out: Output,
    checkpoint_every: float = 30.0,
    after_unit: Callable[[int], None] | None = None,
) -> tuple[Artifact, bool]:
    """Run (or find cached) the capture. Returns the artifact and whether it was a cache hit."""
    from ridgefill.models import resolve_model

    if cfg.max_tokens < 2:
        raise BadInput("--max-tokens must be at least 2")
    if cfg.held_out_rows < 0:
        raise BadInput("--held-out-rows must be >= 0")
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
        **{k: v for k, v in asdict(cfg).items() if k not in ("splits", "trust_remote_code")},
        "splits": list(splits),
        "skip_first": SKIP_FIRST,
    }
    hit = store.cached("capture", recipe)
    if hit is not None:
        return hit, True

    from ridgefill.models import load_model

    t0 = time.perf_counter()
    lm = load_model(ref, store_root=store.root, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    load_s = time.perf_counter() - t0
    ids = _tokenize(lm.tokenizer, corpus, cfg.chat)
    units = _units(ids, calib, held, cfg)
    lo = min(splits)
    layers = list(range(lo, ref.num_layers))  # every input we need: split states and late-layer inputs
    d = ref.hidden_size

    with store.build("capture", recipe) as build:
        state = _State.resume(build.work, build.id, splits, ref.num_layers, d, cfg.chat, layers)
        if state.next_unit:
            out.info(f"resuming capture {build.id} at unit {state.next_unit}/{len(units)}")
        t_fwd, last_ckpt = 0.0, time.perf_counter()
        tokens_done = 0
        with out.progress("capture", total=len(units)) as bar:
            for i in range(state.next_unit, len(units)):
                u = units[i]
                t = time.perf_counter()
                hs = _forward(lm, ids[u.variant][u.doc][u.start : u.end], layers)
                t_fwd += time.perf_counter() - t
                state.add(u, hs, splits, lo)
                state.next_unit = i + 1
                tokens_done += u.end - u.start
                bar.update(i + 1, tokens_done, f"unit {i + 1}/{len(units)} · doc {u.doc + 1}/{len(corpus.documents)}")
                if time.perf_counter() - last_ckpt >= checkpoint_every or checkpoint_every <= 0:
                    state.save(build.work, build.id)
                    last_ckpt = time.perf_counter()
                if after_unit is not None:
                    after_unit(i)
        state.write_outputs(build.path, splits, layers, ref.num_layers)
        _write_counts(build.path / COUNTS, ids["raw"], calib, _vocab_size(lm))
        _write_docs(build.path / DOCS, corpus, ids, calib, held)
        n_calib_tokens = int(sum(len(ids["raw"][i]) for i in calib))
        summary = {
            "splits": list(splits),
            "rows": {f"{v}.split{s}": int(state.moments[v][s].n) for v in state.moments for s in splits},
            "calibration_documents": len(calib),
            "calibration_tokens": n_calib_tokens,
            "held_out_documents": len(held),
            "held_out_rows": int(state.held_rows()),
            "forward_tokens_per_s": round(tokens_done / t_fwd, 1) if t_fwd else None,
        }
        info = {"model_spec": model, "trust_remote_code": cfg.trust_remote_code, "model": _model_info(ref),
                "data": data, "num_layers": ref.num_layers, "hidden_size": d, "layers": layers,
                "layer_kinds": {str(i): k for i, k in enumerate(lm.adapter.layer_kinds)}}
        art = build.commit(info=info, summary=summary, timings={"model_load_s": round(load_s, 3), "forward_s": round(t_fwd, 3)})
    return art, False


def _model_info(ref) -> dict:
    return {"name": ref.name, "revision": ref.revision, "model_type": ref.model_type,
            "num_layers": ref.num_layers, "hidden_size": ref.hidden_size, "fingerprint": ref.fingerprint}


def _vocab_size(lm) -> int:
    return max(len(lm.tokenizer), int(getattr(lm.model.config, "vocab_size", 0) or 0))


def _tokenize(tok, corpus: Corpus, chat: bool) -> dict[str, list[np.ndarray]]:
    """Token ids per document as int32 arrays (4 bytes a token: the only thing that grows with the corpus)."""
    ids32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    texts = [d.text for d in corpus.documents]
    ids = {"raw": [ids32(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]}
    if chat:
        if not getattr(tok, "chat_template", None):
            raise BadInput("--chat: the model's tokenizer has no chat template")
        ids["chat"] = []
        for t in texts:
            enc = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)
            ids["chat"].append(ids32(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return ids


def _units(ids: dict[str, list[np.ndarray]], calib: list[int], held: list[int], cfg: CaptureConfig) -> list[Unit]:
    units = []
    for held_phase, docs in ((False, calib), (True, held)):
        for variant in ids:
            if held_phase and variant != "raw":
                continue  # held-out rows are scored on raw text only
            for doc in docs:
                n = len(ids[variant][doc])
                for start in range(0, n, cfg.max_tokens):
                    end = min(n, start + cfg.max_tokens)
                    if end - start > SKIP_FIRST:
                        units.append(Unit(doc, variant, start, end, held_phase))
    # Held-out rows: an even share per document, evenly spaced over its usable rows.
    held_units = [u for u in units if u.held]
    if held_units and cfg.held_out_rows:
        quota = -(-cfg.held_out_rows // len(held))  # ceil
        for doc in held:
            mine = [u for u in held_units if u.doc == doc]
            rows = [(u, p) for u in mine for p in range(SKIP_FIRST, u.end - u.start)]
            take = np.unique(np.linspace(0, len(rows) - 1, num=min(quota, len(rows))).round().astype(int)) if rows else []
            for j in take:
                u, p = rows[j]
                u.keep.append(p)
    return [u for u in units if not u.held or u.keep]


def _forward(lm, token_ids: np.ndarray, layers: list[int]) -> dict[int, np.ndarray]:
    """Inputs of `layers` for one window, as float32 numpy [seq, d]."""
    import torch

    from ridgefill.capture.hooks import StopForward, layer_inputs

    x = torch.from_numpy(token_ids.astype(np.int64))[None]  # [1, seq]
    with torch.inference_mode(), layer_inputs(lm.adapter.layers, layers) as seen:
        try:
            lm.adapter.base(input_ids=x, use_cache=False)
        except StopForward:
            pass
    return {l: seen[l][0].float().numpy() for l in layers}


class _State:
    """Running totals plus held-out rows; saved and restored exactly (float64, one file)."""

    def __init__(self, splits, num_layers, d, chat, layers):
        variants = ("raw", "chat") if chat else ("raw",)
        self.moments = {v: {s: Moments.empty(num_layers - s, d, d) for s in splits} for v in variants}
        self.held: dict[str, list[np.ndarray]] = {f"hidden.{l}": [] for l in layers}
        self.held.update(doc=[], pos=[])
        self.next_unit = 0

    @classmethod
    def resume(cls, work: Path, run_id: str, splits, num_layers, d, chat, layers) -> "_State":
        st = cls(splits, num_layers, d, chat, layers)
        f = work / "state.safetensors"
        if f.is_file():
            arrays, meta = tensors.load(f)
            if meta.get("id") == run_id:
                for v in st.moments:
                    for s in splits:
                        st.moments[v][s] = Moments.from_arrays(arrays, f"{v}.split{s}")
                for k in st.held:
                    if f"held.{k}" in arrays:
                        st.held[k] = [arrays[f"held.{k}"]]
                st.next_unit = int(meta["next_unit"])
        return st

    def add(self, u: Unit, hs: dict[int, np.ndarray], splits, lo: int) -> None:
        if u.held:
            if u.keep:
                for l, h in hs.items():
                    self.held[f"hidden.{l}"].append(h[u.keep])
                self.held["doc"].append(np.full(len(u.keep), u.doc, dtype=np.int32))
                self.held["pos"].append(np.asarray(u.keep, dtype=np.int32) + u.start)
            return
        for s in splits:
            x = hs[s][SKIP_FIRST:]  # [n, d]
            ys = np.stack([hs[l][SKIP_FIRST:] for l in range(s, s + len(self.moments[u.variant][s].yy))])  # [k, n, d]
            self.moments[u.variant][s] = merge(self.moments[u.variant][s], moments_of(x, ys))

    def held_rows(self) -> int:
        return int(sum(len(a) for a in self.held["doc"]))

    def _arrays(self) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        for v, per in self.moments.items():
            for s, m in per.items():
                arrays.update(m.to_arrays(f"{v}.split{s}"))
        return arrays

    def _held_arrays(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v) for k, v in self.held.items() if v}

    def save(self, work: Path, run_id: str) -> None:
        work.mkdir(parents=True, exist_ok=True)
        arrays = self._arrays()
        arrays.update({f"held.{k}": a for k, a in self._held_arrays().items()})
        tensors.save(work / "state.safetensors", arrays, {"id": run_id, "next_unit": str(self.next_unit)})

    def write_outputs(self, path: Path, splits, layers, num_layers) -> None:
        meta = {"splits": ",".join(map(str, splits)), "variants": ",".join(self.moments), "num_layers": str(num_layers)}
        tensors.save(path / STATS, self._arrays(), meta)
        held = self._held_arrays()
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
