"""`ridgefill solve`: fit the maps of one split from a capture, choosing alpha on held-out rows."""

from __future__ import annotations

import time

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts import tensors
from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.output import Output
from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose, lam, maps_at, maps_per_layer, search, search_per_layer

FORMAT_VERSION = 3  # 2: the grid is extended past an open edge (ridge.search); 3: the protected-token table
MAPS = "maps.safetensors"
REPORT = "report.json"
METRIC_CHOICES = ("kv", "input")


def check_model(cap: Artifact, store: Store, model: str | None):
    """The model to score with: the one captured, or `model` if it has the same fingerprint."""
    from ridgefill.models import resolve_model
    from ridgefill.models.spec import pinned_spec

    spec = model or pinned_spec(cap.info["model_spec"], cap.info["model"].get("revision"))
    ref = resolve_model(spec, store_root=store.root)
    if ref.fingerprint != cap.recipe["model"]:
        raise BadInput(
            f"capture {cap.id} was made with a different model ({cap.info['model']['name']}, fingerprint "
            f"{cap.recipe['model'][:12]}) than '{spec}' (fingerprint {ref.fingerprint[:12]})"
        )
    return ref


def open_model(cap: Artifact, store: Store, ref, place=None):
    """Load the captured model, with the capture's own trust_remote_code choice (from its recipe, which its id
    covers), where `place` says (a ridgefill.models.device.Where; default the CPU in float32)."""
    from ridgefill.models import load_model
    from ridgefill.models.device import Where

    place = place or Where()
    return load_model(ref, store_root=store.root, trust_remote_code=cap.recipe.get("trust_remote_code", False),
                      **place.load_args())


def warn_if_mixed(cap: Artifact, place, out: Output) -> None:
    """One warning line when the held-out rows were captured on another device kind or dtype than we score on."""
    from ridgefill.models.device import recorded, warn_mixed

    warn_mixed(out, f"capture {cap.id}", recorded(cap.recipe), place)


def _state_documents(cap: Artifact, split: int, paths: list[str], chunk: int) -> list:
    """The --state-data documents, or BadInput: a model without Gated DeltaNet layers above the split, a chunk
    below 1, or a document the capture used (the offsets are measured on text kept apart from the maps')."""
    import json

    from ridgefill.capture.corpus import read_corpus
    from ridgefill.capture.run import DOCS

    kinds = cap.info.get("layer_kinds") or {}
    if not any(kinds.get(str(l)) == "linear_attention" for l in range(split, cap.info["model"]["num_layers"])):
        raise BadInput(f"--state-data: the terminal-state correction needs Gated DeltaNet layers above split "
                       f"{split}; this model has none")
    if chunk < 1:
        raise BadInput(f"--state-chunk must be >= 1, got {chunk}")
    docs = read_corpus(list(paths)).documents
    used = {d["sha256"]: d["name"] for d in json.loads(cap.file(DOCS).read_text())}
    reused = [d.name for d in docs if d.sha256 in used]
    if reused:
        raise BadInput(f"--state-data must be kept apart from the capture's text; capture {cap.id} used "
                       f"{', '.join(reused[:3])}{' ...' if len(reused) > 3 else ''}")
    return docs


def load_extras(art: Artifact) -> tuple[dict | None, np.ndarray | None]:
    """A solve artifact's terminal-state offsets {layer: float32 [value heads, key dim, value dim]} and protected-
    token table (token ids), each None when it has none."""
    from ridgefill.solve.protected import PROTECTED
    from ridgefill.solve.state import STATE

    names = art.manifest.get("files") or {}
    offsets = None
    if STATE in names:
        offsets = {int(n.split(".")[1]): a for n, a in tensors.load(art.file(STATE))[0].items()}
    table = tensors.load(art.file(PROTECTED))[0]["token_ids"] if PROTECTED in names else None
    return offsets, table


def pick_split(cap: Artifact, split: int | None) -> int:
    splits = cap.recipe["splits"]
    if split is None:
        if len(splits) > 1:
            raise BadInput(f"capture {cap.id} has splits {', '.join(map(str, splits))}: pass --split")
        return splits[0]
    if split not in splits:
        raise BadInput(f"capture {cap.id} has no split {split} (it has {', '.join(map(str, splits))})")
    return split


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
    device: str = "auto",
    dtype: str = "auto",
    device_map=None,
    max_memory=None,
) -> tuple[Artifact, bool]:
    """Run (or find cached) the solve. device / dtype / device_map / max_memory place the model that scores the
    held-out rows (ridgefill.models.device); its device kind and dtype go into the recipe (nothing for cpu /
    float32), and a warning says so when they differ from the capture's. alpha_per_layer: every late layer gets
    the alpha best for its own held-out score (ridge.search_per_layer), instead of one shared by all; the recipe
    records it only when on, so the default's id is what it always was. state_data: documents (capture's --data
    forms) kept apart from the capture's, on which the terminal-state offsets of a hybrid's filled Gated DeltaNet
    layers are measured with the solved maps, every `state_chunk` tokens (ridgefill.solve.state)."""
    from ridgefill.capture.run import load_heldout, load_stats
    from ridgefill.models.device import where

    place = where(device, dtype, device_map, max_memory)
    alphas = sorted(set(alphas or DEFAULT_ALPHAS))
    for a in alphas:
        if not a > 0 or not np.isfinite(a):
            raise BadInput(f"alpha must be > 0 (got {a:g})")
    if metric not in METRIC_CHOICES:
        raise BadInput(f"--metric must be one of {', '.join(METRIC_CHOICES)} (got '{metric}')")
    cap = store.get(capture_ref, stage="capture")
    ref = check_model(cap, store, model)
    split = pick_split(cap, split)
    recipe = {"stage": "solve", "version": FORMAT_VERSION, "capture": cap.id, "model": ref.fingerprint,
              "split": split, "alphas": alphas, "metric": metric, "chat_share": chat_share, **place.recipe()}
    if alpha_per_layer:
        recipe["alpha_per_layer"] = True
    state_docs = None
    if state_data:
        state_docs = _state_documents(cap, split, state_data, state_chunk)
        recipe["state"] = {"data": [d.sha256 for d in state_docs], "chunk": state_chunk}
    warn_if_mixed(cap, place, out)
    hit = store.cached("solve", recipe)
    if hit is not None:
        return hit, True
    store.verify(cap)

    from ridgefill.solve.score import Scorer, objective

    m = load_stats(cap, split, chat_share)
    held = load_heldout(cap)
    t = time.perf_counter()
    e = decompose(m)
    t_eig = time.perf_counter() - t
    lm = open_model(cap, store, ref, place)
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
    from ridgefill.capture.run import COUNTS
    from ridgefill.solve.protected import protected_table, token_classes

    table = table_facts = None
    if COUNTS in (cap.manifest.get("files") or {}):  # every capture writes them; a hand-built one may not
        counts = tensors.load(cap.file(COUNTS))[0]["counts"]
        table, table_facts = protected_table(counts, token_classes(lm.tokenizer, len(counts)))
    offsets = None
    if state_docs:
        from ridgefill.capture.corpus import Corpus
        from ridgefill.capture.run import _tokenize, model_context
        from ridgefill.solve.state import measure_offsets

        t = time.perf_counter()
        ids = _tokenize(lm.tokenizer, Corpus(state_docs, 0, 0), False, model_context(lm))["raw"]  # as capture cuts
        fit = {l: (w[i], b[i]) for i, l in enumerate(layers)}
        offsets, info = measure_offsets(lm, fit, split, ids, state_chunk, out)
        state_report = {"documents": [{"name": d.name, "sha256": d.sha256, "tokens": len(x)}
                                      for d, x in zip(state_docs, ids)], **info}  # fmt: skip
        t_state = time.perf_counter() - t
    report = {
        "split": split, "metric": metric, "alpha": best["alpha"], "lambda": best["lambda"], "grid": grid,
        "extended": extended,
        "fitted": fitted, "identity": identity, "rows": int(m.n), "held_out_rows": int(scorer.x.shape[0]),
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
        arrays = {}
        for i, l in enumerate(layers):
            arrays[f"layer.{l}.weight"] = w[i].astype(np.float32)  # [d_out, d_in]
            arrays[f"layer.{l}.bias"] = b[i].astype(np.float32)  # [d_out]
        meta = ({"alpha_per_layer": ",".join(f"{l}:{per_layer['alpha'][str(l)]!r}" for l in layers)}
                if per_layer else {"alpha": repr(best["alpha"])})
        tensors.save(build.path / MAPS, arrays, {"split": str(split), **meta})
        if table is not None:
            from ridgefill.solve.protected import PROTECTED

            tensors.save(build.path / PROTECTED, {"token_ids": table}, {"share": repr(table_facts["share"])})
        if offsets is not None:
            from ridgefill.solve.state import STATE, offset_name

            tensors.save(build.path / STATE, {offset_name(l): o for l, o in offsets.items()},
                         {"split": str(split), "chunk": str(state_chunk)})
        write_json(build.path / REPORT, report)
        summary = {"split": split, "alpha": best["alpha"], "score": best["score"],
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


def per_layer_lines(report: dict) -> list[str]:
    """For people, when the alphas are per layer: their range and the held-out score against the shared alpha's
    (one line), and one line per layer whose own search went past the grid's edge."""
    p = report.get("per_layer")
    if not p:
        return []
    lo, hi = min(p["alpha"].values()), max(p["alpha"].values())
    d = p["score"] - p["shared_score"]
    lines = [f"per-layer alphas {lo:g} .. {hi:g} over {len(p['alpha'])} layers: held-out score {p['score']:.4f} "
             f"vs {p['shared_score']:.4f} with the shared alpha {report['alpha']:g} ({d:+.4f})"]
    past = sorted({x["layer"] for x in p["extended"]})
    if p["layer_scorings"]:
        lines.append(f"layer{'s' * (len(past) != 1)} {', '.join(map(str, past))}: alpha at the grid's edge, "
                     f"searched on alone ({p['layer_scorings']} single-layer scoring"
                     f"{'s' * (p['layer_scorings'] != 1)}; report.json per_layer.extended)")
    return lines


def extension_lines(report: dict) -> list[str]:
    """One line per grid edge that solve extended, for people: how far, and why it stopped."""
    from ridgefill.solve.ridge import ALPHA_LIMITS

    why = {"turned": "the score turned", "flat": "the score stopped improving",
           "limit": f"reached the limit {ALPHA_LIMITS[0]:g} .. {ALPHA_LIMITS[1]:g}", "steps": "reached the step limit"}
    return [f"alpha at the grid's edge: extended to {x['to']:g} ({x['steps']} step{'s' * (x['steps'] != 1)}; "
            f"{why[x['stopped']]})" for x in report.get("extended", [])]


def load_maps(art: Artifact) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    arrays, _ = tensors.load(art.file(MAPS))
    layers = sorted({int(k.split(".")[1]) for k in arrays})
    return {l: (arrays[f"layer.{l}.weight"], arrays[f"layer.{l}.bias"]) for l in layers}
