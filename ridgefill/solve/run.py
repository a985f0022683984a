"""`ridgefill solve`: fit the maps of one split from a capture, choosing alpha on held-out rows."""

from __future__ import annotations

import time

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts import tensors
from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.output import Output
from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose, lam, maps_at, search

FORMAT_VERSION = 2  # 2: the grid is extended past an open edge (ridge.search)
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
    *,
    device: str = "auto",
    dtype: str = "auto",
    device_map=None,
    max_memory=None,
) -> tuple[Artifact, bool]:
    """Run (or find cached) the solve. device / dtype / device_map / max_memory place the model that scores the
    held-out rows (ridgefill.models.device); its device kind and dtype go into the recipe (nothing for cpu /
    float32), and a warning says so when they differ from the capture's."""
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

    def score_at(a: float) -> dict:
        nonlocal t_maps, t_score
        t = time.perf_counter()
        w, b = maps_at(e, a)
        t_maps += time.perf_counter() - t
        t = time.perf_counter()
        s = scorer.score(w, b)
        t_score += time.perf_counter() - t
        return {"alpha": a, "lambda": lam(a, e), "score": objective(s, metric), **s["mean"]}

    grid, best, extended = search(alphas, score_at)  # past an open edge the grid goes on (ridge.search)
    w, b = maps_at(e, best["alpha"])
    fitted = scorer.score(w, b)
    identity = scorer.score(None, None)
    layers = scorer.layers
    report = {
        "split": split, "metric": metric, "alpha": best["alpha"], "lambda": best["lambda"], "grid": grid,
        "extended": extended,
        "fitted": fitted, "identity": identity, "rows": int(m.n), "held_out_rows": int(scorer.x.shape[0]),
        "timings": {"eig_s": t_eig, "maps_all_alphas_s": t_maps, "grid_s": t_eig + t_maps,
                    "scoring_s": t_score},
    }
    with store.build("solve", recipe) as build:
        arrays = {}
        for i, l in enumerate(layers):
            arrays[f"layer.{l}.weight"] = w[i].astype(np.float32)  # [d_out, d_in]
            arrays[f"layer.{l}.bias"] = b[i].astype(np.float32)  # [d_out]
        tensors.save(build.path / MAPS, arrays, {"split": str(split), "alpha": repr(best["alpha"])})
        write_json(build.path / REPORT, report)
        summary = {"split": split, "alpha": best["alpha"], "score": best["score"],
                   "fitted": fitted["mean"], "identity": identity["mean"], "layers": layers}
        art = build.commit(info={"capture": cap.id, "model": cap.info["model"], "model_spec": cap.info["model_spec"],
                                 "placement": lm.placement()}, summary=summary)
    return art, False


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
