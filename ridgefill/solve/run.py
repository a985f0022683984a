"""`ridgefill solve`: fit the maps of one split from a capture, choosing alpha on held-out rows."""

from __future__ import annotations

import time

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture import artifact as captured
from ridgefill.errors import BadInput
from ridgefill.output import Output
from ridgefill.runtime.rows import fit_exact_norm
from ridgefill.solve import artifact
from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose, lam, maps_at, maps_per_layer, search, search_per_layer

FORMAT_VERSION = 5  # 2: the grid is extended past an open edge (ridge.search); 3: the protected-token table;
# 4: added tokens flagged special are special (never protected); 5: the exact-row norm (`exact_norm`)
METRIC_CHOICES = ("kv", "input")


def _state_documents(cap: Artifact, kinds: list[str], split: int, paths: list[str], chunk: int) -> list:
    """The --state-data documents, or BadInput: a model without Gated DeltaNet layers above the split, a chunk
    below 1, or a document the capture used (the offsets are measured on text kept apart from the maps')."""
    from ridgefill.capture.corpus import read_corpus
    from ridgefill.models.kinds import LINEAR

    if LINEAR not in kinds[split:]:
        raise BadInput(f"--state-data: the terminal-state correction needs Gated DeltaNet layers above split "
                       f"{split}; this model has none")
    if chunk < 1:
        raise BadInput(f"--state-chunk must be >= 1, got {chunk}")
    docs = read_corpus(list(paths)).documents
    used = {d["sha256"]: d["name"] for d in captured.documents(cap)}
    reused = [d.name for d in docs if d.sha256 in used]
    if reused:
        raise BadInput(f"--state-data must be kept apart from the capture's text; capture {cap.id} used "
                       f"{', '.join(reused[:3])}{' ...' if len(reused) > 3 else ''}")
    return docs


def solve(
    store: Store,
    capture_ref: str,
    out: Output,
    model: str | None = None,
    split: int | None = None,
    alphas: list[float] | None = None,
    metric: str = "kv",
    chat_share: float | None = None,
    alpha_per_layer: bool = False,
    *,
    state_data: list[str] | None = None,
    state_chunk: int = 2048,
    place=None,
) -> tuple[Artifact, bool]:
    """Run (or find cached) the solve. `place` (a ridgefill.models.device.Where; default `where()`) is where the
    model that scores the held-out rows runs; its device kind and dtype go into the recipe (nothing for cpu /
    float32), and a warning says so when they differ from the capture's. alpha_per_layer: every late layer gets
    the alpha best for its own held-out score (ridge.search_per_layer), instead of one shared by all; the recipe
    records it only when on, so the default's id is what it always was. state_data: documents (capture's --data
    forms) kept apart from the capture's, on which the terminal-state offsets of a hybrid's filled Gated DeltaNet
    layers are measured with the solved maps, every `state_chunk` tokens (ridgefill.solve.state)."""
    from ridgefill.models.device import where

    place = place or where()
    alphas = sorted(set(alphas or DEFAULT_ALPHAS))
    for a in alphas:
        if not a > 0 or not np.isfinite(a):
            raise BadInput(f"alpha must be > 0 (got {a:g})")
    if metric not in METRIC_CHOICES:
        raise BadInput(f"--metric must be one of {', '.join(METRIC_CHOICES)} (got '{metric}')")
    cap = store.get(capture_ref, stage="capture")
    ref = captured.captured_model(cap, store, model)
    split = captured.pick_split(cap, split)
    recipe = {"stage": "solve", "version": FORMAT_VERSION, "capture": cap.id, "model": ref.fingerprint,
              "split": split, "alphas": alphas, "metric": metric, "chat_share": chat_share, **place.recipe()}
    if alpha_per_layer:
        recipe["alpha_per_layer"] = True
    state_docs = None
    if state_data:
        state_docs = _state_documents(cap, captured.captured_kinds(cap, store, ref), split, state_data, state_chunk)
        recipe["state"] = {"data": [d.sha256 for d in state_docs], "chunk": state_chunk}
    captured.warn_if_mixed(cap, place, out)
    hit = store.cached("solve", recipe)
    if hit is not None:
        return hit, True
    store.verify(cap)

    from ridgefill.solve.score import Scorer, objective

    m = captured.load_stats(cap, split, chat_share)
    held = captured.load_heldout(cap)
    exact_norm = fit_exact_norm(held[f"hidden.{split}"])  # the fill runs prefix rows above it exactly
    t = time.perf_counter()
    e = decompose(m)
    t_eig = time.perf_counter() - t
    lm = captured.open_model(cap, store, ref, place)
    out.info(f"scoring on {place.describe()}")
    scorer = Scorer(lm.adapter, held, split, ref.num_layers)

    t_maps, t_score = 0.0, 0.0
    scored = {}  # alpha -> the full scores (per layer too), for alpha_per_layer

    def score_at(a: float) -> dict:
        nonlocal t_maps, t_score
        t = time.perf_counter()
        w, b = maps_at(e, a)
        t_maps += time.perf_counter() - t
        t = time.perf_counter()
        s = scorer.score(w, b)
        t_score += time.perf_counter() - t
        scored[a] = s
        return {"alpha": a, "lambda": lam(a, e), "score": objective(s, metric), **s["mean"]}

    grid, best, extended = search(alphas, score_at)  # past an open edge the grid goes on (ridge.search)
    layers = scorer.layers
    per_layer = None
    if alpha_per_layer:
        t = time.perf_counter()
        w, b, per_layer = fit_per_layer(e, scorer, alphas, scored, best, metric)
        fitted = scorer.score(w, b)
        per_layer = {**per_layer, "score": objective(fitted, metric)}
        t_per = time.perf_counter() - t
    else:
        w, b = maps_at(e, best["alpha"])
        fitted = scorer.score(w, b)
    identity = scorer.score(None, None)
    from ridgefill.solve.protected import protected_table, token_classes

    table = table_facts = None
    counts = captured.load_counts(cap)
    if counts is not None:
        table, table_facts = protected_table(counts, token_classes(lm.tokenizer, len(counts)))
    offsets = None
    if state_docs:
        from ridgefill.capture.corpus import Corpus
        from ridgefill.solve.state import measure_offsets

        t = time.perf_counter()
        ids = captured.tokenize(lm.tokenizer, Corpus(state_docs, 0, 0), False, lm.context_length())["raw"]  # as capture cuts
        fit = {l: (w[i], b[i]) for i, l in enumerate(layers)}
        offsets, info = measure_offsets(lm, fit, split, ids, state_chunk, exact_norm, out)
        state_report = {"documents": [{"name": d.name, "sha256": d.sha256, "tokens": len(x)}
                                      for d, x in zip(state_docs, ids)], **info}  # fmt: skip
        t_state = time.perf_counter() - t
    report = {
        "split": split, "metric": metric, "alpha": best["alpha"], "lambda": best["lambda"], "grid": grid,
        "extended": extended,
        "fitted": fitted, "identity": identity, "rows": int(m.n), "held_out_rows": int(scorer.x.shape[0]),
        "exact_norm": exact_norm,
        "timings": {"eig_s": t_eig, "maps_all_alphas_s": t_maps, "grid_s": t_eig + t_maps,
                    "scoring_s": t_score},
    }
    if table is not None:
        report["protected_tokens"] = table_facts
    if offsets is not None:
        report["state_correction"] = state_report
        report["timings"]["state_s"] = t_state
    if per_layer is not None:
        report["per_layer"] = per_layer  # "alpha", "lambda" and "grid" above stay the shared search's
        report["timings"]["per_layer_s"] = t_per  # choosing the alphas, their maps and scoring those
    with store.build("solve", recipe) as build:
        meta = ({"alpha_per_layer": ",".join(f"{l}:{per_layer['alpha'][str(l)]!r}" for l in layers)}
                if per_layer else {"alpha": repr(best["alpha"])})
        artifact.write_maps(build.path, layers, w, b, {"split": str(split), **meta, "exact_norm": repr(exact_norm)})
        if table is not None:
            artifact.write_protected(build.path, table, table_facts["share"])
        if offsets is not None:
            artifact.write_offsets(build.path, offsets, split, state_chunk)
        write_json(build.path / artifact.REPORT, report)
        summary = {"split": split, "alpha": best["alpha"], "score": best["score"], "exact_norm": exact_norm,
                   "fitted": fitted["mean"], "identity": identity["mean"], "layers": layers}
        if per_layer:
            summary["per_layer"] = {k: per_layer[k] for k in ("alpha", "lambda", "score", "shared_score")}
        art = build.commit(info={"capture": cap.id, "model": cap.info["model"], "model_spec": cap.info["model_spec"],
                                 "placement": lm.placement()}, summary=summary)
    return art, False


def fit_per_layer(e, scorer, alphas: list[float], scored: dict, best: dict, metric: str):
    """Maps with each late layer at its own best alpha (ridge.search_per_layer over its own held-out objective,
    reusing every score the shared search made), and the report's `per_layer` section but its "score":
    {"alpha", "lambda": {layer: value}, "shared_score", "shared_fitted" (the shared best's full scores),
    "layers": {layer: {"score", "shared_score", "grid"}}, "extended": [{"layer", "edge", "to", "steps",
    "stopped"}], "layer_scorings" (single-layer scorings past the shared grid)}."""
    from ridgefill.solve.score import layer_objective

    layers = scorer.layers
    own = {a: [layer_objective(s["layers"][str(l)], metric) for l in layers] for a, s in scored.items()}
    extra = 0

    def score_layer(i: int, a: float) -> float:
        nonlocal extra
        extra += 1
        w, b = maps_per_layer(e, [a], [i])  # [1, dy, dx], [1, dy]
        return layer_objective(scorer.layer_scores(layers[i], scorer.x @ w[0].T + b[0]), metric)

    chosen = search_per_layer(alphas, own, score_layer)
    w, b = maps_per_layer(e, [c["alpha"] for c in chosen])
    section = {
        "alpha": {str(l): c["alpha"] for l, c in zip(layers, chosen)},
        "lambda": {str(l): lam(c["alpha"], e) for l, c in zip(layers, chosen)},
        "shared_score": best["score"], "shared_fitted": scored[best["alpha"]],
        "layers": {str(l): {"score": c["score"], "shared_score": own[best["alpha"]][i], "grid": c["grid"]}
                   for i, (l, c) in enumerate(zip(layers, chosen))},
        "extended": [{"layer": l, **x} for l, c in zip(layers, chosen) for x in c["extended"]],
        "layer_scorings": extra,
    }
    return w, b, section
