"""`ridgefill sweep`: measure several split layers side by side and recommend the one to ship (docs/sweep.md).

One capture pass serves every split (or a capture that has them). Each split is solved and quantized as a release
would be, then measured against the exact model on text never used for calibration:
- held-out K/V cosine of the fitted maps and of the identity fill (from solve);
- ΔNLL on all, novel and key tokens of long documents, at `length` tokens with the last `scored` scored;
- single-needle retrieval in RULER's noise filler, `samples` prompts of `length` tokens whose needle lies in the
  filled prefix (the same prompts at every split, so the differences are paired), by greedy decoding;
- the compute ceiling at `length` and `tail`, and the prefill speed-up measured at `length`: one timed prefill per
  arm and split, interleaved.
Each split's maps are loaded as eval loads a source (`evaluate.source.load_source`) and measured with eval's code
(`evaluate.measure`): every prompt gets one exact forward that keeps the hidden state entering every split, and
each (split, arm) only runs its late layers on top of it. The figures per split are eval's
(`evaluate.summary.summarize`), the recommendation and the table / plot are `sweep.report`'s.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture.artifact import calibration_hashes
from ridgefill.errors import BadInput
from ridgefill.evaluate.arms import Arm
from ridgefill.evaluate.measure import Checkpoint, eval_documents, fills, measure_documents, measure_needles
from ridgefill.evaluate.source import load_source
from ridgefill.output import Output
from ridgefill.sweep.artifact import PLOT, RESULT, TABLE

FORMAT_VERSION = 2  # 2: later sinks (outlier rows) run exactly and are not fitted
ARMS = ("ridgefill", "identity")
ARM_PLAN = [Arm(a) for a in ARMS]
DEFAULT_SPLITS = 8  # evenly spaced over the middle half of the layers
NEEDLE_DEPTHS = 8  # the single-needle samples spread over this many depths of the filled prefix
DECODE_BATCH = 9  # prefills decoded together (exact + 4 splits x 2 arms): one batched forward per step


@dataclass(frozen=True)
class SweepConfig:
    splits: tuple[int, ...] | str = ()  # empty: DEFAULT_SPLITS evenly spaced over layers L/4 .. 3L/4; or --splits text
    length: int = 4096
    tail: int = 512
    samples: int = 40  # single-needle prompts (at least 40: a 30-point difference is then significant)
    documents: int = 4
    scored: int = 256
    max_needle_drop: float = 10.0  # points below exact
    max_key_dnll: float = 0.5  # nats
    quantize: bool = True  # measure the int8 maps a release ships (False: the float maps)
    alpha_per_layer: bool = False
    seed: int = 0
    bootstrap: int = 10000


def split_ranges(text: str) -> list[tuple[int, int, int]]:
    """'8-24' (a range), '8-24:2' (a range with a step), '8,12,16' or a mix ('8-12,16') -> [(first, last, step)],
    checked but not expanded; BadInput for what is not one, a split 0 (never one: the fill needs an early layer),
    a step below 1 or an empty range."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise BadInput(f"--splits: '{part}' is not a split, a range A-B or A-B:STEP (e.g. 8-24, 8-24:2, 8,12,16)")
        a, b, step = int(m[1]), int(m[2] or m[1]), int(m[3] or 1)
        if step < 1:
            raise BadInput(f"--splits: the step in '{part}' must be at least 1")
        if b < a:
            raise BadInput(f"--splits: the range '{part}' is empty")
        if a < 1:
            raise BadInput(f"--splits: '{part}' starts at split 0; a split is a layer 1 or deeper")
        out.append((a, b, step))
    return out


def parse_splits(text: str, num_layers: int) -> tuple[int, ...]:
    """The splits `text` names (`split_ranges`) for a model of `num_layers` layers: every range is checked against
    the model before it is expanded, so a range past the last layer is one short refusal, whatever its length."""
    ranges = split_ranges(text)
    for a, b, step in ranges:
        if b >= num_layers:
            part = f"{a}-{b}" + (f":{step}" if step != 1 else "") if a != b else str(a)
            raise BadInput(f"--splits: '{part}' reaches past the model's last split {num_layers - 1} (the model has "
                           f"{num_layers} layers; use 1..{num_layers - 1})")
    return tuple(sorted({s for a, b, step in ranges for s in range(a, b + 1, step)}))


def default_splits(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in np.round(np.linspace(num_layers / 4, 3 * num_layers / 4, DEFAULT_SPLITS))}))


def check_splits(cfg: SweepConfig, num_layers: int) -> tuple[int, ...]:
    """The splits to measure for a model of `num_layers` layers: `cfg.splits` (a list, or the --splits text), or
    DEFAULT_SPLITS of them. BadInput names the first problem."""
    if isinstance(cfg.splits, str):
        return parse_splits(cfg.splits, num_layers)
    splits = tuple(sorted(set(cfg.splits))) if cfg.splits else default_splits(num_layers)
    bad = [s for s in splits if not 0 < s < num_layers]
    if bad:
        raise BadInput(f"split(s) {', '.join(map(str, bad[:8]))}{' ...' if len(bad) > 8 else ''} out of range: the "
                       f"model has {num_layers} layers (use 1..{num_layers - 1})")
    return splits


def check_config(cfg: SweepConfig) -> None:
    """What can be checked without the model; BadInput names the first problem (before anything is resolved)."""
    if isinstance(cfg.splits, str):
        split_ranges(cfg.splits)
    for name in ("max_needle_drop", "max_key_dnll"):
        v = getattr(cfg, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise BadInput(f"--{name.replace('_', '-')} must be a number >= 0 (got {v})")
    if not 0 < cfg.scored < cfg.tail:
        raise BadInput(f"need 0 < --scored ({cfg.scored}) < --tail ({cfg.tail})")
    if cfg.length <= cfg.tail:
        raise BadInput(f"--length ({cfg.length}) must be longer than --tail ({cfg.tail}): the fill skips the rows "
                       "before the tail")
    if cfg.samples < 1 or cfg.documents < 1:
        raise BadInput("--samples and --documents must be at least 1")


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
) -> tuple[Artifact, bool]:
    """Run (or find cached) the sweep. `capture_ref`: a capture artifact that has every split (else one capture of
    `data` with these splits, `capture_args` being further CaptureConfig fields). `solve_args`: further `solve`
    arguments (alphas, metric, chat_share) for every split. `place` (a ridgefill.models.device.Where; default
    `where()`) is where every stage runs the model, `capture_place` where the capture does if elsewhere. Returns
    (artifact, cached)."""
    from ridgefill.capture import CaptureConfig, capture
    from ridgefill.quantize import quantize
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where
    from ridgefill.solve import solve

    place = place or where()
    check_config(cfg)
    cap = store.get(capture_ref, stage="capture") if capture_ref is not None else None
    ref = resolve_model(model, store_root=store.root, expect=cap.recipe["model"] if cap else None)
    splits = check_splits(cfg, ref.num_layers)
    cfg = replace(cfg, splits=splits)
    if cap is not None:
        if cap.recipe["model"] != ref.fingerprint:
            raise BadInput(f"capture {cap.id} was made with a different model (fingerprint {cap.recipe['model'][:12]}) "
                           f"than '{model}' ({ref.fingerprint[:12]})")
        missing = [s for s in splits if s not in cap.recipe["splits"]]
        if missing:
            flags = " ".join(f"--split {s}" for s in splits)
            raise BadInput(f"capture {cap.id} lacks split(s) {', '.join(map(str, missing))} (it has "
                           f"{', '.join(map(str, cap.recipe['splits']))}): capture them with `ridgefill capture "
                           f"{model} {flags}`, or sweep its own splits")
    else:
        cap_cfg = CaptureConfig(**{**(capture_args or {}), "splits": splits})
        cap, _ = capture(store, model, list(data or ["builtin:default"]), cap_cfg, out, place=capture_place or place)
    fits = []
    for s in splits:
        out.info(f"[bold]split {s}[/bold]: solve{' + quantize' if cfg.quantize else ''}")
        sol, _ = solve(store, cap.id, out, **(solve_args or {}), split=s, alpha_per_layer=cfg.alpha_per_layer,
                       place=place)
        q = quantize(store, sol.id, out, place=place)[0] if cfg.quantize else None
        fits.append((s, sol, q))
    recipe = {"stage": "sweep", "version": FORMAT_VERSION, "model": ref.fingerprint, "capture": cap.id,
              "maps": {str(s): (q or sol).id for s, sol, q in fits},
              **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}, **place.recipe()}
    hit = store.cached("sweep", recipe)
    if hit is not None:
        return hit, True

    from ridgefill.models import load_model
    from ridgefill.runtime import maps_on_devices

    with store.build("sweep", recipe) as build:  # the lock: one process measures this sweep
        lm = load_model(ref, store_root=store.root, trust_remote_code=cap.recipe.get("trust_remote_code", False),
                        **place.load_args())
        out.info(f"model on {place.describe()}")
        sources = {}
        for s, sol, q in fits:  # each split's maps as eval loads them, on the model's devices
            src = load_source(store, (q or sol).id)
            sources[s] = replace(src, maps=maps_on_devices(lm, src.maps, range(s, ref.num_layers)))
        done = Checkpoint(build.work)
        if done.rows["documents"] or done.rows["needles"]:
            out.info(f"resuming: {len(done.rows['documents'])} documents and {len(done.rows['needles'])} needle "
                     f"prompts measured before")
        docs = _documents(lm, cfg, sources, calibration_hashes(cap), out, done)
        needles = _needles(lm, cfg, sources, out, done)
        timing = _timing(lm, cfg, sources, needles["prompt"], out)
        result = _result(model, ref.num_layers, cfg, fits, docs, needles, timing)
        from ridgefill.sweep.report import plot, recommend, retrieval_edge, write_markdown

        rec = recommend(result)
        result["recommended"] = rec
        result["retrieval"] = retrieval_edge(result)
        write_json(build.path / RESULT, result)
        plot(result, rec, build.path / PLOT)
        (build.path / TABLE).write_text(write_markdown(result, rec) + "\n" + result["retrieval"]["line"] + "\n")
        summary = {"recommended": rec["split"], "reason": rec["reason"], "qualifying": rec["qualifying"],
                   "retrieval": result["retrieval"]["line"], "splits": list(splits), "capture": cap.id,
                   "maps": recipe["maps"], "exact_needle": result["exact"]["needle"]}
        art = build.commit(info={"model_spec": model, "placement": lm.placement()}, summary=summary)
    return art, False


def needle_suite(lm, cfg: SweepConfig) -> list:
    """`samples` single needles at `length` tokens, spread over NEEDLE_DEPTHS depths of the filled prefix."""
    from ridgefill.evaluate.needles import build_suite, noise_haystack

    top = (cfg.length - cfg.tail) / cfg.length  # the filled prefix ends here
    depths = tuple(round(float(x), 4) for x in np.linspace(0.05, top * 0.9, NEEDLE_DEPTHS))
    per = -(-cfg.samples // len(depths))
    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    try:
        suite = build_suite(lm.tokenizer, lengths=(cfg.length,), depths=depths, tasks=("single",), samples=per,
                            seed=cfg.seed, tail=cfg.tail, chat=chat, haystack=noise_haystack())
    except ValueError as e:
        raise BadInput(f"needles: {e}") from None
    suite = [s for s in suite if s.in_filled_region(cfg.tail)]
    # every depth in turn, so that any first `samples` cover them all
    order = sorted(range(len(suite)), key=lambda i: (i % per, i // per))
    suite = [suite[i] for i in order][: cfg.samples]
    if len(suite) < cfg.samples:
        raise BadInput(f"only {len(suite)} needle prompts of {cfg.length} tokens have their needle before the tail")
    return suite


def _documents(lm, cfg: SweepConfig, sources: dict, calib, out: Output, done: Checkpoint) -> list[dict]:
    """Per document: {"name", "tokens", split: {arm: doc_summary}}."""
    docs = eval_documents(lm, cfg.length, cfg.documents, calib)
    row = lambda name, tokens, per: {"name": name, "tokens": tokens, **{str(s): p[0] for s, p in per.items()}}  # noqa: E731
    return measure_documents(lm, docs, cfg.length, sources, ARM_PLAN, cfg.tail, cfg.scored, out, row=row,
                             seed=cfg.seed, done=done)


def _needles(lm, cfg: SweepConfig, sources: dict, out: Output, done: Checkpoint) -> dict:
    """{"rows": [{"depth", "seed", "tokens", "exact": bool, split: {arm: bool}}], "prompt": the first prompt's ids};
    the prefills decoded DECODE_BATCH at a time."""
    suite = needle_suite(lm, cfg)

    def jobs(run):
        one = lambda src, arm: fills(lm, run, src, [arm], cfg.tail, logits_rows=1)[0][arm.name]  # noqa: E731
        todo = [(None, "exact", lambda: run.result(cfg.tail))]
        todo += [(s, arm.name, lambda src=src, arm=arm: one(src, arm)) for s, src in sources.items() for arm in ARM_PLAN]
        return todo, None

    def row(s, correct, _):
        return {"depth": s.depth, "seed": s.seed, "tokens": len(s.prompt_ids), "exact": correct[None]["exact"],
                **{str(sp): correct[sp] for sp in sources}}

    status = lambda rows: f" · exact {sum(r['exact'] for r in rows)}/{len(rows)}"  # noqa: E731
    rows = measure_needles(lm, suite, list(sources), jobs, out, row=row, batch=DECODE_BATCH, done=done,
                           status=status)
    return {"rows": rows, "prompt": suite[0].prompt_ids}


def _timing(lm, cfg: SweepConfig, sources: dict, prompt: list[int], out: Output) -> dict:
    """One real, timed prefill of `prompt` per arm and split, the splits in turn; exact is timed before, halfway and
    after them and its median kept, so that a slow spell of a shared machine cannot land on the reference alone."""
    import statistics

    import torch

    from ridgefill.runtime import ExactRun, prefill

    ids = torch.tensor(prompt)
    out.info(f"timing: one prefill of {len(prompt)} tokens per arm and split")
    exact = lambda: prefill(lm, ids, "exact", split=0, tail=cfg.tail).seconds  # noqa: E731
    run = ExactRun(ids=ids.to(lm.adapter.device), logits=None, cache=None, states={}, seconds=0.0)
    runs, secs = [exact()], {}
    for i, (s, src) in enumerate(sources.items()):
        if i == len(sources) // 2:
            runs.append(exact())
        res, _ = fills(lm, run, src, ARM_PLAN, cfg.tail, timed=True)
        secs |= {f"{s}/{arm}": r.seconds for arm, r in res.items()}
    runs.append(exact())
    return {"length": len(prompt), "seconds": {"exact": statistics.median(runs), **secs}, "exact_runs": runs}


def _result(model: str, num_layers: int, cfg: SweepConfig, fits, docs, needles, timing) -> dict:
    """The sweep's result (sweep/report.py documents its shape); each split's figures are eval's summary."""
    from ridgefill.evaluate import EvalConfig
    from ridgefill.evaluate.summary import summarize

    ecfg = EvalConfig(arms=("exact", *ARMS), tail=cfg.tail, lengths=(timing["length"],), seed=cfg.seed,
                      bootstrap=cfg.bootstrap)
    entries = []
    for s, sol, q in fits:
        k = str(s)
        res = {"split": s, "num_layers": num_layers, "tail": cfg.tail,
               "documents": [{"name": d["name"], "tokens": d["tokens"], **d[k]} for d in docs],
               "needles": [{"length": r["tokens"], "depth": r["depth"],
                            "correct": {"exact": r["exact"], **r[k]}} for r in needles["rows"]],
               "timing": [{"length": timing["length"], "seconds": {"exact": timing["seconds"]["exact"],
                                                                   **{a: timing["seconds"][f"{k}/{a}"] for a in ARMS}}}]}
        summ = summarize(res, ecfg)
        rep = sol.manifest["summary"]
        entries.append({"split": s, "alpha": rep["alpha"], "solve": sol.id, "quantize": q.id if q else None,
                        "ceiling_speedup": summ["ceiling_speedup"],
                        "heldout": {"fitted": _kv(rep["fitted"]), "identity": _kv(rep["identity"])},
                        "arms": {a: summ["arms"][a] for a in ARMS},
                        "ridgefill_minus_identity": summ.get("ridgefill_minus_identity")})
    exact = [100.0 * r["exact"] for r in needles["rows"]]
    return {"model": model, "num_layers": num_layers, "length": cfg.length, "tail": cfg.tail,
            "samples": len(exact), "documents": len(docs),
            "budget": {"max_needle_drop": cfg.max_needle_drop, "max_key_dnll": cfg.max_key_dnll},
            "exact": {"needle": float(np.mean(exact)), "prefill_s": timing["seconds"]["exact"]},
            "splits": entries, "needles": needles["rows"], "documents_detail": docs, "timing": timing}


def _kv(scores: dict) -> dict:
    return {"k_cosine": scores["k_cosine"], "v_cosine": scores["v_cosine"]}
