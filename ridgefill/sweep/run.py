"""`ridgefill sweep`: measure several split layers side by side and recommend the (split, configuration) to ship
(docs/sweep.md).

One capture serves every split (or a capture that has them all). Each split is solved and quantized as a release
would be, loaded as eval loads a source (`evaluate.source.load_source`), and measured against the exact model on
text never used for calibration, phase by phase (`measure`):

1. documents (documents.py): ΔNLL, KL and top-1 of the fitted maps and the identity fill on all, novel and key
   tokens of `documents` long documents of `length` tokens, the last `scored` scored; a (split, arm) over budget on
   one of them (key-token ΔNLL, and what a gate given limits) is over without a needle.
2. needles (needles.py, search.py): retrieval on at most `needles` prompts drawn in rounds of the release gate's
   kinds (eval's single, multi-key and multi-value needles, through the chat template and as plain text, at
   `length` tokens and at `long_length` where the context holds it), their needles in the filled prefix, the same
   prompts in the same order at every split (so the differences are paired), answered by greedy decoding. Each
   arm's shallowest split within budget is found by bisection, each (split, arm) visited drawing prompts until a
   sequential rule fixed in advance decides (sequential.py); `exhaustive` measures every split and arm on every
   prompt instead.
3. configurations (configurations.py): at the splits just shallower than the fitted maps' edge, +rows, +kscale and
   +protected, each beside its equal-cost control, measured only where they can change the recommendation. On the
   CPU the needle pass keeps its prompts' early layers on disk for this pass (early.py).
4. the result (result.py) and the recommendation (report.py): the (split, configuration) of the highest compute
   ceiling within budget, and what the fitted maps earn over the identity fill.
5. timing (timing.py): `repeats` rounds of real prefills of the first needle prompt, exact and the fitted maps at
   every split (and the recommendation), interleaved, giving the measured speed-ups beside the compute ceiling.

Every prompt gets one exact forward that keeps the hidden state entering every split; each (split, arm) runs only
its late layers on top of it (`evaluate.measure`). The build's work folder keeps every document row and needle
outcome as it is measured, so a stopped sweep resumes where it was.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture.artifact import calibration_hashes
from ridgefill.errors import BadInput
from ridgefill.evaluate.arms import Arm
from ridgefill.evaluate.measure import Checkpoint
from ridgefill.evaluate.source import load_source
from ridgefill.output import Output
from ridgefill.sweep import configurations, documents
from ridgefill.sweep.artifact import ARMS, PLOT, RESULT, TABLE
from ridgefill.sweep.config import (FLAGS, Names, Setup, SweepConfig, check_config, check_context, check_splits,
                                    recorded)
from ridgefill.sweep.early import KEEP_EARLY_BYTES, EarlyCaches, keeps_early
from ridgefill.sweep.needles import NeedleMemo, Prompts, mix_of, needle_suite
from ridgefill.sweep.result import assemble
from ridgefill.sweep.search import find_edges, rule_of
from ridgefill.sweep.timing import Clock, add_speeds, ceiling_at, rounds

FORMAT_VERSION = 5  # 2: later sinks (outlier rows) run exactly; 3: needles by bisection and a sequential rule, in
# noise and prose haystacks; quality configurations beside their controls; timing in rounds; multiply-accumulates;
# 4: an adaptive sweep measures only the configurations that can change the recommendation, by ceiling; 5: the
# needles are eval's three tasks in both prompt forms, at a long length too, and a gate's thresholds join the budget.


def sweep(
    store: Store,
    model: str,
    cfg: SweepConfig,
    out: Output,
    *,
    data: list[str] | None = None,
    capture_ref: str | None = None,
    capture_args: dict | None = None,
    solve_args: dict | None = None,
    place=None,
    capture_place=None,
    names: Names = FLAGS,
) -> tuple[Artifact, bool]:
    """Run (or find cached) the sweep. `capture_ref`: a capture artifact that has every split (else one capture of
    `data` with these splits, `capture_args` being further CaptureConfig fields). `solve_args`: further SolveConfig
    fields (maps, alphas, metric, chat_share) for every split. `place` (a ridgefill.models.device.Where; default
    `where()`) is where every stage runs the model, `capture_place` where the capture does if elsewhere. `names`:
    how refusals name the settings (a recipe's keys, or the command's flags). Returns (artifact, cached)."""
    from ridgefill.capture import CaptureConfig, capture
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where

    place = place or where()
    check_config(cfg, names)
    cap = store.get(capture_ref, stage="capture") if capture_ref is not None else None
    ref = resolve_model(model, store_root=store.root, expect=cap.recipe["model"] if cap else None)
    cfg = replace(cfg, splits=check_splits(cfg, ref.num_layers, names))
    if cap is not None:
        _check_capture(cap, model, ref.fingerprint, cfg.splits)
    check_context(cfg, ref.context_length, names)  # before any capture
    if cap is None:
        cap_cfg = CaptureConfig(**{**(capture_args or {}), "splits": cfg.splits})
        cap, _ = capture(store, model, list(data or ["builtin:default"]), cap_cfg, out, place=capture_place or place)
    clock = Clock()
    fits = _fits(store, cap, cfg, out, solve_args or {}, place)
    recipe = {"stage": "sweep", "version": FORMAT_VERSION, "model": ref.fingerprint, "capture": cap.id,
              "maps": {str(s): (q or sol).id for s, sol, q in fits}, **recorded(cfg), **place.recipe()}
    hit = store.cached("sweep", recipe)
    if hit is not None:
        return hit, True
    with store.build("sweep", recipe) as build:  # the lock: one process measures this sweep
        setup = _setup(store, ref, cap, cfg, fits, place, out, build.work)
        clock.lap("solve")  # with quantize and loading the model
        result = measure(setup, model, fits)
        result["cost"]["seconds"] = {**clock.laps, **result["cost"]["seconds"]}
        _write(build.path, result)
        art = build.commit(info={"model_spec": model, "placement": setup.lm.placement()},
                           summary=_summary(result, cap.id, recipe["maps"]))
    return art, False


def measure(setup: Setup, model: str, fits: list) -> dict:
    """The sweep's measurements on a loaded model, phase by phase (the module docstring) -> the result, sweep.json.
    `fits`: [(split, solve artifact, quantize artifact or None)]."""
    from ridgefill.sweep.report import advantage, recommend

    cfg, clock, done = setup.cfg, Clock(), Checkpoint(setup.work)
    plain = documents.measure(setup, setup.splits, [Arm(a) for a in ARMS], done, "documents")
    clock.lap("documents")
    keep = configurations.kept_splits(setup.splits, plain.over) if cfg.configurations and keeps_early(setup.lm) else ()
    keep = sorted({l for s in keep for l in setup.sources[s].reads})  # with the earlier states maps may read
    early = EarlyCaches(setup.work, setup.lm, keep, KEEP_EARLY_BYTES)
    mix = mix_of(setup.lm, cfg)
    prompts = Prompts(setup, needle_suite(setup.lm, cfg, mix), NeedleMemo(setup.work), early)
    rule = rule_of(cfg, mix)
    edges = find_edges(setup.splits, ARMS, plain.over, rule, prompts.measure, cfg.exhaustive, setup.out)
    clock.lap("needles")
    edge = edges.search["ridgefill"]["edge"]
    near = configurations.config_splits(setup.splits, edge)
    bar = ceiling_at(cfg, edge, setup.layers) if edge is not None else None  # the plain recommendation's ceiling
    configs = (configurations.measure(setup, near, edges.verdicts, bar, prompts, rule, done)
               if near and cfg.configurations else {})
    early.clear()
    clock.lap("configurations")
    result = assemble(setup, model, fits, plain, edges, configs, prompts, rule)
    result["recommended"] = recommend(result)
    result["advantage"] = advantage(result)
    result["identity_edge"] = result["advantage"]["identity"]
    result["timing"] = rounds(setup, prompts.suite[0][1].prompt_ids, result["recommended"])
    add_speeds(result)
    clock.lap("timing")
    result["cost"]["seconds"] = clock.laps
    return result


def _check_capture(cap: Artifact, model: str, fingerprint: str, splits: tuple[int, ...]) -> None:
    """Refuse a capture of another model, or one that lacks a split to measure (naming the command that adds it)."""
    if cap.recipe["model"] != fingerprint:
        raise BadInput(f"capture {cap.id} was made with a different model (fingerprint {cap.recipe['model'][:12]}) "
                       f"than '{model}' ({fingerprint[:12]})")
    missing = [s for s in splits if s not in cap.recipe["splits"]]
    if missing:
        flags = " ".join(f"--split {s}" for s in splits)
        raise BadInput(f"capture {cap.id} lacks split(s) {', '.join(map(str, missing))} (it has "
                       f"{', '.join(map(str, cap.recipe['splits']))}): capture them with `ridgefill capture "
                       f"{model} {flags}`, or sweep its own splits")


def _fits(store: Store, cap: Artifact, cfg: SweepConfig, out: Output, solve_args: dict, place) -> list:
    """Each split solved (and quantized, unless `cfg.quantize` is off) as a release would be: [(split, solve
    artifact, quantize artifact or None)]. Ordinary artifacts: a release made later at a measured split reuses them."""
    from ridgefill.quantize import quantize
    from ridgefill.solve import solve
    from ridgefill.solve.config import SolveConfig

    fits = []
    for s in cfg.splits:
        out.info(f"[bold]split {s}[/bold]: solve{' + quantize' if cfg.quantize else ''}")
        sol, _ = solve(store, cap.id, SolveConfig(**{**solve_args, "split": s, "alpha_per_layer": cfg.alpha_per_layer}),
                       out, place=place)
        q = quantize(store, sol.id, out, place=place)[0] if cfg.quantize else None
        fits.append((s, sol, q))
    return fits


def _setup(store: Store, ref, cap: Artifact, cfg: SweepConfig, fits: list, place, out: Output, work) -> Setup:
    """Load the model where `place` says, and each split's maps as eval loads them, onto the model's devices."""
    from ridgefill.models import load_model
    from ridgefill.runtime import maps_on_devices

    lm = load_model(ref, store_root=store.root, trust_remote_code=cap.recipe.get("trust_remote_code", False),
                    **place.load_args())
    out.info(f"model on {place.describe()}")
    sources = {}
    for s, sol, q in fits:
        src = load_source(store, (q or sol).id)
        sources[s] = replace(src, maps=maps_on_devices(lm, src.maps, range(s, ref.num_layers)))
    return Setup(lm=lm, cfg=cfg, sources=sources, calib=calibration_hashes(cap), out=out, work=Path(work))


def _write(folder: Path, result: dict) -> None:
    """The artifact's files: the result, its plot and its table (artifact.py)."""
    from ridgefill.sweep.plot import plot
    from ridgefill.sweep.report import write_markdown

    write_json(folder / RESULT, result)
    plot(result, folder / PLOT)
    (folder / TABLE).write_text(write_markdown(result))


def _summary(result: dict, capture_id: str, maps: dict) -> dict:
    """The manifest's summary: what a recipe with split = "auto" and the command read without opening sweep.json."""
    rec = result["recommended"]
    return {"recommended": rec["split"], "configuration": rec["configuration"], "tail": rec["tail"],
            "reason": rec["reason"], "mode": result["mode"], "splits": [e["split"] for e in result["splits"]],
            "capture": capture_id, "maps": maps, "exact_needle": result["exact"]["needle"],
            "identity_edge": result["identity_edge"], "advantage": result["advantage"],
            "needle_prompts": result["cost"]["needle_prompts"]}
