"""`ridgefill eval`: run the fill arms against the exact model and gate a release (docs/method.md#measuring-a-release).

Two measurements, both on text never used for calibration:
- long documents: ΔNLL against exact on the scored stretch (the last `scored` tokens), on all, novel and key
  tokens, KL(exact || arm) and top-1 agreement; key tokens are those whose exact loss rises by more than 2 nats
  when the context is cut to the tail alone;
- filled-region needle retrieval: RULER-style samples whose needles all lie in the filled prefix, greedy
  decoding from each arm's cache, exact match.
Paired bootstrap intervals per document / per sample; measured prefill time per arm against the ceiling r.
The measurements are evaluate/measure.py's (sweep uses them too), the figures evaluate/summary.py's; `record` writes
them into a release folder and checks the gate.

A release with a configuration other than the plain fill (docs/format.md) is measured as it is applied: with the
default arms, eval adds its configured arm (and the controls of a selector), and the gate judges that arm unless
the gate file names one. Arms given by name are measured as given.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.evaluate.artifact import RESULTS
from ridgefill.evaluate.config import DEFAULT_ARMS, EvalConfig
from ridgefill.evaluate.measure import eval_documents, measure_documents, measure_needles, time_prefills
from ridgefill.evaluate.source import MapsSource, load_source
from ridgefill.evaluate.summary import manifest_summary, summarize
from ridgefill.formats.release.names import protected_problem
from ridgefill.output import Output

FORMAT_VERSION = 8  # 2: single needles in noise filler; 3: nofill needles, "ridgefill+rows"; 4: row 0 exact;
# 5: arms built from one exact run per prompt, speed from one timed prefill per arm and length ("timing");
# 6: prefix rows whose split state is an outlier by norm (later sinks) run exactly; 7: corrections, selectors and
# their controls (evaluate/arms.py), paired comparisons ("pairs"); 8: those rows by the maps' exact-row norm, row by
# row, instead of 20x the prefix's median


def check(cfg: EvalConfig, configuration: str = "ridgefill") -> list:
    """The arms of `cfg` (evaluate/arms.py), with its other settings checked: BadInput names the first problem,
    before any model is loaded. `configuration`: the arm the release is applied with (`source.configuration_of`);
    with the default arms, it is measured too (with its selector's controls)."""
    from ridgefill.evaluate.arms import plan
    from ridgefill.evaluate.needles import TASKS

    arms = plan(configured_arms(cfg.arms, configuration))
    bad = [t for t in cfg.tasks if t not in TASKS]
    if bad:
        raise BadInput(f"unknown needle task(s) {', '.join(bad)} (choose from {', '.join(TASKS)})")
    if not all(0 <= d <= 1 for d in cfg.depths):
        raise BadInput(f"needle depths must lie in [0, 1], got {list(cfg.depths)}")
    if "exact" not in [a.name for a in arms]:
        raise BadInput("--arms must include exact: every figure is measured against it")
    if not 0 < cfg.scored < cfg.tail or cfg.tail >= min(cfg.lengths + (cfg.doc_tokens,)):
        raise BadInput(f"need 0 < scored ({cfg.scored}) < tail ({cfg.tail}) < every length and --doc-tokens")
    for name in ("--samples", "--documents", "bootstrap"):
        if getattr(cfg, name.strip("-")) < 1:  # a release gate measured on nothing would pass anything
            raise BadInput(f"{name} must be at least 1, got {getattr(cfg, name.strip('-'))}")
    if not (cfg.lengths and cfg.depths and cfg.tasks):
        raise BadInput("--lengths, --depths and --tasks need at least one value each")
    return arms


def configured_arms(arms, configuration: str) -> tuple[str, ...]:
    """The arms to measure: `arms`, plus the release's configured arm when `arms` are the default ones and the
    configuration is not the plain fill (so a plain release's eval is the one it always was)."""
    arms = tuple(arms)
    if arms == DEFAULT_ARMS and configuration not in arms:
        return arms + (configuration,)
    return arms


def evaluate(store: Store, model: str, source: str, cfg: EvalConfig, out: Output, *,
             place=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the eval. `place` (a ridgefill.models.device.Where; default `where()`) is where the model
    runs; its device kind and dtype are part of the recipe (nothing is added for cpu / float32). With the default
    arms, a configured release's arm is measured too (`configured_arms`: the recipe's arms say so)."""
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where

    place = place or where()
    check(cfg)
    src = load_source(store, source)
    arms = check(cfg, src.configuration)
    cfg = replace(cfg, arms=tuple(a.name for a in arms))
    for a in arms:
        if "state" in a.corrections and src.state_offsets is None:
            raise BadInput(f"arm '{a.name}' needs terminal-state offsets, and '{source}' has none "
                           "(measure them with solve --state-data)")
        if a.selector == "protected" and src.protected is None:
            raise BadInput(f"arm '{a.name}' needs a protected-token table, and '{source}' has none")
    ref = resolve_model(model, store_root=store.root, expect=src.fingerprint)
    if ref.fingerprint != src.fingerprint:
        raise BadInput(f"'{source}' was fitted on a different model (fingerprint {src.fingerprint[:12]}) "
                       f"than '{model}' ({ref.fingerprint[:12]})")
    recipe = {"stage": "eval", "version": FORMAT_VERSION, "model": ref.fingerprint, "maps": src.ident,
              **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}, **place.recipe()}
    hit = store.cached("eval", recipe)
    if hit is not None:
        return hit, True

    from ridgefill.models import load_model

    lm = load_model(ref, store_root=store.root, **place.load_args())
    out.info(f"model on {place.describe()}")
    from ridgefill.runtime import maps_on_devices

    src = replace(src, maps=maps_on_devices(lm, src.maps, range(src.split, ref.num_layers)))  # once, not per prefill
    _check_model(lm, src, source, model)
    _check_corrections(lm, src, arms)
    suite = needle_suite(lm, cfg)
    results = {"split": src.split, "num_layers": ref.num_layers, "tail": cfg.tail,
               "documents": _documents(lm, src, cfg, arms, out), "needles": _needles(lm, src, cfg, arms, suite, out)}
    prompts = {}
    for s in suite:  # the first sample of each length
        prompts.setdefault(s.context_tokens, s.prompt_ids)
    results["timing"] = time_prefills(lm, src, arms, cfg.tail, prompts, cfg.seed)
    results["summary"] = summarize(results, cfg)
    with store.build("eval", recipe) as build:
        write_json(build.path / RESULTS, results)
        art = build.commit(info={"model_spec": model, "source": source, "placement": lm.placement()},
                           summary=results["summary"])
    return art, False


def _check_model(lm, src: MapsSource, source: str, model: str) -> None:
    """Refuse, before anything is measured, a release the model cannot apply: the check every runtime makes of a
    release (`Release.check_model`: layer count, widths, KV heads and head size, a protected-token table within the
    vocabulary, maps within the range of the dtype); for a store artifact, fitted on this model, its protected-token
    table within the vocabulary."""
    ad = lm.adapter
    if src.release is not None:
        src.release.check_model(fingerprint=lm.ref.fingerprint, num_layers=ad.num_layers, hidden_size=ad.hidden_size,
                                num_kv_heads=ad.num_kv_heads, head_dim=ad.head_dim, vocab_size=ad.vocab_size,
                                name=model, where=source, dtype=lm.dtype)
    elif src.protected and ad.vocab_size is not None:
        problem = protected_problem(max(src.protected), ad.vocab_size, f"'{model}'")
        if problem is not None:
            raise BadInput(f"{source}: {problem}")


def _check_corrections(lm, src: MapsSource, arms) -> None:
    """Refuse, before anything is measured, a correction the model has no layers for, or terminal-state offsets
    that do not match its Gated DeltaNet layers."""
    from ridgefill.runtime.corrections import check_corrections

    for a in arms:
        if a.corrections:
            where = f"{src.release_dir}: " if src.release_dir is not None and "state" in a.corrections else ""
            try:
                check_corrections(lm.adapter, src.split, a.corrections, src.state_offsets)
            except BadInput as e:
                raise BadInput(f"arm '{a.name}': {where}{e}") from None


def _documents(lm, src: MapsSource, cfg: EvalConfig, arms, out: Output) -> list[dict]:
    """Per long document: {"name", "tokens", arm: doc_summary, ..., "rows_added" (selectors)}."""

    def row(name, tokens, per):
        scores, added = per[None]
        return {"name": name, "tokens": tokens, **scores, **({"rows_added": added} if added else {})}

    docs = eval_documents(lm, cfg.doc_tokens, cfg.documents, src.calibration)
    fills = [a for a in arms if a.base != "exact"]
    return measure_documents(lm, docs, cfg.doc_tokens, {None: src}, fills, cfg.tail, cfg.scored, out, row=row,
                             seed=cfg.seed)


def needle_suite(lm, cfg: EvalConfig) -> list:
    """The needle samples of `cfg` whose needles lie wholly in the filled prefix: single needles in RULER's noise
    filler, the other tasks in prose."""
    from ridgefill.evaluate.needles import build_suite, noise_haystack

    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    try:
        suite = []
        for tasks, hay in (([t for t in cfg.tasks if t == "single"], noise_haystack()),
                           ([t for t in cfg.tasks if t != "single"], None)):
            if tasks:
                suite += build_suite(lm.tokenizer, lengths=cfg.lengths, depths=cfg.depths, tasks=tuple(tasks),
                                     samples=cfg.samples, seed=cfg.seed, tail=cfg.tail, chat=chat, haystack=hay)
    except ValueError as e:  # e.g. a length too short for the question
        raise BadInput(f"needles: {e}") from None
    return [s for s in suite if s.in_filled_region(cfg.tail)]


def _needles(lm, src: MapsSource, cfg: EvalConfig, arms, suite: list, out: Output) -> list[dict]:
    """Per needle sample: {"task", "length", "depth", "seed", "answers", "correct": {arm: bool}, "rows_added"}; every
    arm's answer decoded in one batch."""
    from ridgefill.evaluate.measure import fills

    def jobs(run):
        res, added = fills(lm, run, src, arms, cfg.tail, logits_rows=1, seed=cfg.seed)
        return [(None, arm, r) for arm, r in res.items()], added

    def row(s, correct, added):
        return {"task": s.task, "length": s.context_tokens, "depth": s.depth, "seed": s.seed, "answers": s.answers,
                "correct": correct[None], **({"rows_added": added} if added else {})}

    return measure_needles(lm, suite, list(src.reads), jobs, out, row=row)


def record(source: str, art: Artifact, rules: dict | None, out: Output, keep: bool = True) -> dict | None:
    """What follows an eval, for the CLI and a recipe alike: a release folder records the figures (its manifest's
    `eval` and its model card, neither of them hashed) and still verifies -- unless `keep` is False (a Hub
    release's copy in the release cache, which stays the commit it was pulled from); then the gate's thresholds,
    if any, are checked, on the gate's arm or, when it names none, on the release's configured arm. Returns the
    gate's outcome {"passed", "failed": [lines], "arm"} (None without a gate); the caller exits 3 when it failed."""
    from ridgefill.evaluate.gate import check_gate, gate_arm
    from ridgefill.export.card import model_card
    from ridgefill.formats import release

    s = art.manifest["summary"]
    folder = Path(source)
    configured = release.PLAIN
    if (folder / release.MANIFEST).is_file() and not keep:
        configured = release.read_release(folder).configuration["arm"]
        out.info(f"eval summary not written into {folder}, the cached copy of a Hub release (`ridgefill pull` it into "
                 "a folder to keep the figures with it)")
    elif (folder / release.MANIFEST).is_file():
        release.write_eval(folder, manifest_summary(s, art.id), model_card)
        configured = release.read_release(folder).configuration["arm"]  # verifies it again
        out.info(f"eval summary written into {folder / release.MANIFEST} and {release.CARD}")
    if rules is None:
        return None
    failed = check_gate(s, rules, default_arm=configured)
    return {"passed": not failed, "failed": failed, "arm": gate_arm(rules, configured)}
