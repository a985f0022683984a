"""`ridgefill solve`: fit the maps of one split from a capture, choosing alpha on held-out rows.

The steps, each a function below: check the grid, build the recipe (cached: done), decompose the capture's moments,
choose the maps on the held-out rows (solve/choose.py), the protected-token table, a hybrid's terminal-state
offsets (with --state-data), the report, and the artifact (solve/artifact.py's files)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture.stats import scale_x
from ridgefill.capture import artifact as captured
from ridgefill.errors import BadInput
from ridgefill.output import Output
from ridgefill.runtime.rows import OUTLIER_RATIO, fit_exact_norm
from ridgefill.solve import artifact
from ridgefill.solve.config import INPUT_MAPS, KV_MAPS, SolveConfig, check_config
from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose

if TYPE_CHECKING:
    from ridgefill.solve.choose import Fit

FORMAT_VERSION = 7  # 2: the grid is extended past an open edge (ridge.search); 3: the protected-token table;
# 4: added tokens flagged special are special (never protected); 5: the exact-row norm (`exact_norm`); 6: the map kind
# (`maps`: input or key/value maps; the maps' metadata records each layer's and the model's KV heads and head_dim);
# 7: the exact-row norm is the capture's own outlier ratio x the held-out median (it was always 20x); maps from earlier
# states record them (`states`) and are wider, with unchanged ids for the rest


def _state_documents(cap: Artifact, kinds: list[str], split: int, paths: tuple[str, ...]) -> list:
    """The --state-data documents, or BadInput: a model without Gated DeltaNet layers above the split, or a document
    the capture used (the offsets are measured on text kept apart from the maps')."""
    from ridgefill.capture.corpus import read_corpus
    from ridgefill.models.kinds import LINEAR

    if LINEAR not in kinds[split:]:
        raise BadInput(f"--state-data: the terminal-state correction needs Gated DeltaNet layers above split "
                       f"{split}; this model has none")
    docs = read_corpus(list(paths)).documents
    used = {d["sha256"]: d["name"] for d in captured.documents(cap)}
    reused = [d.name for d in docs if d.sha256 in used]
    if reused:
        raise BadInput(f"--state-data must be kept apart from the capture's text; capture {cap.id} used "
                       f"{', '.join(reused[:3])}{' ...' if len(reused) > 3 else ''}")
    return docs


def solve(store: Store, capture_ref: str, cfg: SolveConfig, out: Output, *, model: str | None = None,
          place=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the solve of `cfg` (solve/config.py) on a capture. `model`: the captured model where it
    now is (default: where it was captured; must match it). `place` (a ridgefill.models.device.Where; default
    `where()`) is where the model that scores the held-out rows runs; its device kind and dtype go into the recipe
    (nothing for cpu / float32), and a warning says so when they differ from the capture's. cfg.alpha_per_layer:
    every late layer gets the alpha best for its own held-out score (ridge.search_per_layer), instead of one shared
    by all; the recipe records it only when on, so the default's id is what it always was. cfg.state_data:
    documents (capture's --data forms) kept apart from the capture's, on which the terminal-state offsets of a
    hybrid's filled Gated DeltaNet layers are measured with the solved maps, every `cfg.state_chunk` tokens
    (ridgefill.solve.state)."""
    from ridgefill.models.device import where

    place = place or where()
    check_config(cfg)
    alphas = sorted(set(cfg.alphas or DEFAULT_ALPHAS))
    cap = store.get(capture_ref, stage="capture")
    ref = captured.captured_model(cap, store, model)
    split = captured.pick_split(cap, cfg.split)
    state_docs = None
    if cfg.state_data:
        state_docs = _state_documents(cap, captured.captured_kinds(cap, store, ref), split, cfg.state_data)
    earlier = _earlier(cap, cfg)
    recipe = _recipe(cap, ref, split, alphas, cfg, place, state_docs, earlier)
    captured.warn_if_mixed(cap, place, out)
    if earlier and cfg.maps != KV_MAPS:
        out.warn(f"input maps from {1 + len(earlier)} states cost {1 + len(earlier)} whole hidden x hidden maps per "
                 "late layer and filled row; key/value maps from them cost a fraction of that (--maps kv)")
    hit = store.cached("solve", recipe)
    if hit is not None:
        return hit, True
    store.verify(cap)

    from ridgefill.solve.choose import choose_maps
    from ridgefill.solve.score import Scorer

    m = captured.load_stats(cap, split, cfg.chat_share, earlier=earlier)
    kinds = _map_kinds(cap, split, ref.num_layers, cfg.maps)
    kv = captured.load_stats(cap, split, cfg.chat_share, target=KV_MAPS, earlier=earlier) \
        if cfg.maps == KV_MAPS else None
    held = captured.load_heldout(cap)
    states = [split, *(split - k for k in earlier)]
    x_held = np.concatenate([held[f"hidden.{l}"] for l in states], axis=1)  # [R, d * len(states)]
    # the fill runs prefix rows above it exactly: the rows the capture left out of the fit, by the same ratio
    exact_norm = fit_exact_norm(x_held, cap.recipe.get("outlier_ratio") or OUTLIER_RATIO)
    scales = state_scales(m, len(states))
    if len(states) > 1:  # one ridge penalty over states of different sizes: each scaled to h_S's, folded back below
        col = np.repeat(scales, m.mean_x.shape[0] // len(states))
        m, x_held = scale_x(m, col), x_held * col
        kv = None if kv is None else scale_x(kv, col)
    t = time.perf_counter()
    # V^T Cxy of the inputs only where some late layer keeps an input map (a k d^3 product otherwise wasted)
    e = decompose(m, project=INPUT_MAPS in kinds.values())
    late = _late_maps(e, split, ref.num_layers, kinds, kv, captured.kv_layers(cap, split))
    eig_s = time.perf_counter() - t
    lm = captured.open_model(cap, store, ref, place)
    out.info(f"scoring on {place.describe()}")
    scorer = Scorer(lm.adapter, held, split, ref.num_layers, kinds, x=x_held)
    fit = choose_maps(late, scorer, alphas, cfg.metric, cfg.alpha_per_layer)
    if len(states) > 1:  # maps of the scaled states -> maps of the states themselves (W D on x = W (D x))
        fit = replace(fit, w=[w * col for w in fit.w])
    identity = scorer.score(None, None)
    protected = _protected(cap, lm)
    state = None
    if state_docs:
        state = _state_correction(lm, state_docs, scorer.layers, fit, split, cfg.state_chunk, exact_norm, out)
    solved = Solved(split=split, metric=cfg.metric, layers=scorer.layers, kinds=kinds,
                    kv_shape=(lm.adapter.num_kv_heads, lm.adapter.head_dim), fit=fit, identity=identity,
                    exact_norm=exact_norm, rows=int(m.n), held_out_rows=int(scorer.x.shape[0]), eig_s=eig_s,
                    protected=protected, state=state, states=states, state_scales=scales.tolist())
    return _write(store, recipe, cap, lm, solved), False


@dataclass(frozen=True)
class Protected:
    """The protected-token table (solve/protected.py) and its facts for the report."""

    table: np.ndarray
    facts: dict


@dataclass(frozen=True)
class StateCorrection:
    """A hybrid's terminal-state offsets measured with the solved maps, and the report's section on them."""

    offsets: dict
    chunk: int  # tokens between two measurements
    report: dict
    seconds: float


@dataclass(frozen=True)
class Solved:
    """What the solve found, before it is written."""

    split: int
    metric: str
    layers: list[int]  # the late layers, in the maps' order
    kinds: dict[int, str]  # per late layer: what its map predicts (INPUT_MAPS or KV_MAPS)
    kv_shape: tuple[int, int]  # the model's (KV heads, head_dim): a key/value map's rows are 2 * their product
    fit: Fit
    identity: dict  # the held-out scores of the identity fill (x_hat = h_S)
    exact_norm: float
    rows: int  # rows the capture fitted
    held_out_rows: int
    eig_s: float  # seconds of the eigendecomposition
    protected: Protected | None
    state: StateCorrection | None
    states: list[int]  # the layers whose inputs the maps read, side by side: the split, then the earlier ones
    state_scales: list[float]  # per state: its scale in the ridge fit (1 for h_S), folded into the maps


def _earlier(cap: Artifact, cfg: SolveConfig) -> tuple[int, ...]:
    """The offsets of the earlier states the maps read: --earlier, or every one the capture has; BadInput for one the
    capture has not or one below layer 0 at the split."""
    earlier = captured.captured_earlier(cap) if cfg.earlier is None else tuple(cfg.earlier)
    captured.state_index(cap, earlier, 1)  # refuses an offset the capture has not
    return earlier


def state_scales(m, n: int) -> np.ndarray:
    """Per state of the stacked x (n blocks of equal width): sqrt(tr C_00 / tr C_jj), which gives every earlier state
    the split state's spread, so that one ridge penalty (alpha x tr Cxx / d_in) weighs each alike; [n], 1 for h_S."""
    d = m.cxx.shape[0] // n
    tr = np.array([np.trace(m.cxx[j * d:(j + 1) * d, j * d:(j + 1) * d]) for j in range(n)])
    return np.sqrt(tr[0] / np.maximum(tr, 1e-300))


def _map_kinds(cap: Artifact, split: int, num_layers: int, maps: str) -> dict[int, str]:
    """Each late layer's map kind: `maps` for the attention layers whose keys and values the capture holds, input
    maps for the rest (Gated DeltaNet layers, which have no keys)."""
    attention = set(captured.kv_layers(cap, split)) if maps == KV_MAPS else set()
    return {l: KV_MAPS if l in attention else INPUT_MAPS for l in range(split, num_layers)}


def _late_maps(e, split: int, num_layers: int, kinds: dict[int, str], kv, kv_layers: list[int]):
    """kinds.late_maps over the late layers split..L-1."""
    from ridgefill.solve.kinds import late_maps

    layers = list(range(split, num_layers))
    return late_maps(e, layers, [kinds[l] for l in layers], kv, kv_layers)


def _recipe(cap: Artifact, ref, split: int, alphas: list[float], cfg: SolveConfig, place,
            state_docs: list | None, earlier: tuple[int, ...] = ()) -> dict:
    """What the solve's id covers: alpha_per_layer and the state data only when given."""
    recipe = {"stage": "solve", "version": FORMAT_VERSION, "capture": cap.id, "model": ref.fingerprint,
              "split": split, "alphas": alphas, "metric": cfg.metric, "maps": cfg.maps, "chat_share": cfg.chat_share,
              **place.recipe()}
    if cfg.alpha_per_layer:
        recipe["alpha_per_layer"] = True
    if earlier:
        recipe["earlier"] = list(earlier)
    if state_docs is not None:
        recipe["state"] = {"data": [d.sha256 for d in state_docs], "chunk": cfg.state_chunk}
    return recipe


def _protected(cap: Artifact, lm) -> Protected | None:
    """The protected-token table from the capture's token counts; None for a capture without them."""
    from ridgefill.solve.protected import protected_table, token_classes

    counts = captured.load_counts(cap)
    if counts is None:
        return None
    return Protected(*protected_table(counts, token_classes(lm.tokenizer, len(counts))))


def _state_correction(lm, docs: list, layers: list[int], fit: Fit, split: int, chunk: int, exact_norm: float,
                      out: Output) -> StateCorrection:
    """The terminal-state offsets of the filled Gated DeltaNet layers, measured on `docs` (cut as capture cuts)
    with the solved maps, every `chunk` tokens (ridgefill.solve.state)."""
    from ridgefill.capture.corpus import Corpus
    from ridgefill.solve.state import measure_offsets

    t = time.perf_counter()
    ids = captured.tokenize(lm.tokenizer, Corpus(docs, 0, 0), False, lm.context_length())["raw"]
    maps = {l: (fit.w[i], fit.b[i]) for i, l in enumerate(layers)}
    offsets, info = measure_offsets(lm, maps, split, ids, chunk, exact_norm, out)
    report = {"documents": [{"name": d.name, "sha256": d.sha256, "tokens": len(x)} for d, x in zip(docs, ids)],
              **info}
    return StateCorrection(offsets, chunk, report, time.perf_counter() - t)


def _report(solved: Solved) -> dict:
    """The solve's report.json: the search, the chosen maps' and the identity's scores, and the timings."""
    fit = solved.fit
    maps_s = fit.timings["maps_all_alphas_s"]
    report = {
        "split": solved.split, "metric": solved.metric, "alpha": fit.best["alpha"], "lambda": fit.best["lambda"],
        "grid": fit.grid, "extended": fit.extended,
        "fitted": fit.fitted, "identity": solved.identity, "rows": solved.rows, "held_out_rows": solved.held_out_rows,
        "exact_norm": solved.exact_norm,
        "timings": {"eig_s": solved.eig_s, "maps_all_alphas_s": maps_s, "grid_s": solved.eig_s + maps_s,
                    "scoring_s": fit.timings["scoring_s"]},
    }
    if solved.protected is not None:
        report["protected_tokens"] = solved.protected.facts
    if solved.state is not None:
        report["state_correction"] = solved.state.report
        report["timings"]["state_s"] = solved.state.seconds
    if fit.per_layer is not None:
        report["per_layer"] = fit.per_layer  # "alpha", "lambda" and "grid" above stay the shared search's
        report["timings"]["per_layer_s"] = fit.timings["per_layer_s"]
    report["maps"] = {str(l): k for l, k in solved.kinds.items()}
    if len(solved.states) > 1:
        report["states"] = solved.states
        report["state_scales"] = solved.state_scales
    return report


def _write(store: Store, recipe: dict, cap: Artifact, lm, solved: Solved) -> Artifact:
    """The solve artifact: the maps (their alphas and the exact-row norm in the metadata), the protected tokens,
    the state offsets, the report, and the manifest's summary."""
    fit, layers, per_layer = solved.fit, solved.layers, solved.fit.per_layer
    with store.build("solve", recipe) as build:
        meta = ({"alpha_per_layer": ",".join(f"{l}:{per_layer['alpha'][str(l)]!r}" for l in layers)}
                if per_layer else {"alpha": repr(fit.best["alpha"])})
        artifact.write_maps(build.path, layers, fit.w, fit.b,
                            {"split": str(solved.split), **meta, "exact_norm": repr(solved.exact_norm),
                             **artifact.kinds_metadata(solved.kinds, *solved.kv_shape),
                             **artifact.states_metadata(solved.states)})
        if solved.protected is not None:
            artifact.write_protected(build.path, solved.protected.table, solved.protected.facts["share"])
        if solved.state is not None:
            artifact.write_offsets(build.path, solved.state.offsets, solved.split, solved.state.chunk)
        write_json(build.path / artifact.REPORT, _report(solved))
        summary = {"split": solved.split, "alpha": fit.best["alpha"], "score": fit.best["score"],
                   "exact_norm": solved.exact_norm, "fitted": fit.fitted["mean"], "identity": solved.identity["mean"],
                   "layers": layers, **({"states": solved.states} if len(solved.states) > 1 else {})}
        if per_layer:
            summary["per_layer"] = {k: per_layer[k] for k in ("alpha", "lambda", "score", "shared_score")}
        return build.commit(info={"capture": cap.id, "model": cap.info["model"],
                                  "model_spec": cap.info["model_spec"], "placement": lm.placement()}, summary=summary)
