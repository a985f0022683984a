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

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture.artifact import calibration_hashes
from ridgefill.errors import BadInput
from ridgefill.evaluate.arms import Arm, parse_arm
from ridgefill.evaluate.measure import Checkpoint, eval_documents, fills, measure_documents
from ridgefill.evaluate.source import load_source
from ridgefill.formats.release.names import CONFIGURATIONS
from ridgefill.output import Output
from ridgefill.runtime.rows import DEFAULT_TAIL
from ridgefill.sweep.artifact import PLOT, RESULT, TABLE
from ridgefill.sweep.search import Bisection, bisect_arms, run_pass
from ridgefill.sweep.sequential import GROUP, TOLERANCE, WITHIN_FACTOR, Rule

FORMAT_VERSION = 4  # 2: later sinks (outlier rows) run exactly; 3: needles by bisection and a sequential rule, in
# noise and prose haystacks; quality configurations beside their controls; timing in rounds; multiply-accumulates
# 4: an adaptive sweep measures only the configurations that can change the recommendation, by ceiling; 5: later
# sinks by each split's exact-row norm (solve format 5), row by row, instead of 20x the prompt prefix's median
ARMS = ("ridgefill", "identity")
ARM_PLAN = [Arm(a) for a in ARMS]
CONFIGS = CONFIGURATIONS[1:]  # the quality configurations a release can record, beyond the plain fill
CONTROL = {"ridgefill+rows": "ridgefill+rows:tail", "ridgefill+kscale": None,  # the equal-cost control of each
           "ridgefill+protected": "ridgefill+protected:tail"}
CONFIG_SPLITS = 2  # configurations are measured at this many candidates just shallower than the maps' edge
HAYSTACKS = ("noise", "prose")  # the single needles' two haystacks, half the prompts each
DEFAULT_SPLITS = 8  # evenly spaced over the middle half of the layers
NEEDLE_DEPTHS = 8  # the single-needle samples spread over this many depths of the filled prefix
DECODE_BATCH = 9  # prefills decoded together: one batched forward per step
KEEP_EARLY_BYTES = 16 << 30  # the most disk the early layers kept between needle passes take (on CPU; see EarlyCaches)


@dataclass(frozen=True)
class SweepConfig:
    splits: tuple[int, ...] | str = ()  # empty: DEFAULT_SPLITS evenly spaced over layers L/4 .. 3L/4; or --splits text
    length: int = 4096
    tail: int = DEFAULT_TAIL
    samples: int = 40  # single-needle prompts (at least 40: a 30-point difference is then significant)
    documents: int = 4
    scored: int = 256
    max_needle_drop: float = 10.0  # points below exact
    max_key_dnll: float = 0.5  # nats
    quantize: bool = True  # measure the int8 maps a release ships (False: the float maps)
    alpha_per_layer: bool = False
    seed: int = 0
    bootstrap: int = 10000
    exhaustive: bool = False  # every split and arm on every prompt (no bisection, no sequential rule)
    configurations: bool = True  # measure +rows, +kscale, +protected beside their controls near the edge
    repeats: int = 3  # timing rounds


@dataclass(frozen=True)
class Names:
    """How the user named the sweep's settings, for messages: the command's flags (`--max-needle-drop`), or a
    recipe's [sweep] keys (`recipe [sweep]: max_needle_drop`)."""

    prefix: str = ""  # before the whole message
    flags: bool = True

    def __call__(self, key: str) -> str:
        return "--" + key.replace("_", "-") if self.flags else key


FLAGS = Names()
RECIPE_KEYS = Names("recipe [sweep]: ", flags=False)


def split_ranges(text: str, names: Names = FLAGS) -> list[tuple[int, int, int]]:
    """'8-24' (a range), '8-24:2' (a range with a step), '8,12,16' or a mix ('8-12,16') -> [(first, last, step)],
    checked but not expanded; BadInput for what is not one, a split 0 (never one: the fill needs an early layer),
    a step below 1 or an empty range."""
    at = f"{names.prefix}{names('splits')}"
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise BadInput(f"{at}: '{part}' is not a split, a range A-B or A-B:STEP (e.g. 8-24, 8-24:2, 8,12,16)")
        a, b, step = int(m[1]), int(m[2] or m[1]), int(m[3] or 1)
        if step < 1:
            raise BadInput(f"{at}: the step in '{part}' must be at least 1")
        if b < a:
            raise BadInput(f"{at}: the range '{part}' is empty")
        if a < 1:
            raise BadInput(f"{at}: '{part}' starts at split 0; a split is a layer 1 or deeper")
        out.append((a, b, step))
    return out


def parse_splits(text: str, num_layers: int, names: Names = FLAGS) -> tuple[int, ...]:
    """The splits `text` names (`split_ranges`) for a model of `num_layers` layers: every range is checked against
    the model before it is expanded, so a range past the last layer is one short refusal, whatever its length."""
    ranges = split_ranges(text, names)
    for a, b, step in ranges:
        if b >= num_layers:
            part = f"{a}-{b}" + (f":{step}" if step != 1 else "") if a != b else str(a)
            raise BadInput(f"{names.prefix}{names('splits')}: '{part}' reaches past the model's last split "
                           f"{num_layers - 1} (the model has {num_layers} layers; use 1..{num_layers - 1})")
    return tuple(sorted({s for a, b, step in ranges for s in range(a, b + 1, step)}))


def default_splits(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in np.round(np.linspace(num_layers / 4, 3 * num_layers / 4, DEFAULT_SPLITS))}))


def check_splits(cfg: SweepConfig, num_layers: int, names: Names = FLAGS) -> tuple[int, ...]:
    """The splits to measure for a model of `num_layers` layers: `cfg.splits` (a list, or the --splits text), or
    DEFAULT_SPLITS of them. BadInput names the first problem."""
    if isinstance(cfg.splits, str):
        return parse_splits(cfg.splits, num_layers, names)
    splits = tuple(sorted(set(cfg.splits))) if cfg.splits else default_splits(num_layers)
    bad = [s for s in splits if not 0 < s < num_layers]
    if bad:
        raise BadInput(f"{names.prefix}split(s) {', '.join(map(str, bad[:8]))}{' ...' if len(bad) > 8 else ''} out of "
                       f"range: the model has {num_layers} layers (use 1..{num_layers - 1})")
    return splits


def check_context(cfg: SweepConfig, context: int | None, names: Names = FLAGS) -> None:
    """Refuse prompts longer than the model's context (`context` positions; None: the model states none)."""
    if context and cfg.length > context:
        raise BadInput(f"{names.prefix}{names('length')} {cfg.length} is longer than the model's context ({context} "
                       "positions)")


def check_config(cfg: SweepConfig, names: Names = FLAGS) -> None:
    """What can be checked without the model; BadInput names the first problem (before anything is resolved), by
    the name the user gave it (`names`: the command's flags, or a recipe's [sweep] keys)."""
    at = names.prefix
    if isinstance(cfg.splits, str):
        split_ranges(cfg.splits, names)
    else:
        bad = [s for s in cfg.splits if s < 1]
        if bad:
            raise BadInput(f"{at}{names('splits')}: {bad[0]} is not a split; a split is a layer 1 or deeper")
    for name in ("max_needle_drop", "max_key_dnll"):
        v = getattr(cfg, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise BadInput(f"{at}{names(name)} must be a number >= 0 (got {v})")
    if not 0 < cfg.scored < cfg.tail:
        raise BadInput(f"{at}need 0 < {names('scored')} ({cfg.scored}) < {names('tail')} ({cfg.tail})")
    if cfg.length <= cfg.tail:
        raise BadInput(f"{at}{names('length')} ({cfg.length}) must be longer than {names('tail')} ({cfg.tail}): the "
                       "fill skips the rows before the tail")
    for name in ("samples", "documents", "bootstrap"):  # a budget measured on nothing would pass anything
        if getattr(cfg, name) < 1:
            raise BadInput(f"{at}{names(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.repeats < 3:
        raise BadInput(f"{at}{names('repeats')} must be at least 3 (a median and an interval need three timings), got "
                       f"{cfg.repeats}")
    if cfg.seed < 0:
        raise BadInput(f"{at}{names('seed')} must be at least 0 (numpy's generators take no negative seed), got "
                       f"{cfg.seed}")


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
    `data` with these splits, `capture_args` being further CaptureConfig fields). `solve_args`: further `solve`
    arguments (alphas, metric, chat_share) for every split. `place` (a ridgefill.models.device.Where; default
    `where()`) is where every stage runs the model, `capture_place` where the capture does if elsewhere. `names`:
    how refusals name the settings (a recipe's keys, or the command's flags). Returns (artifact, cached)."""
    from ridgefill.capture import CaptureConfig, capture
    from ridgefill.quantize import quantize
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where
    from ridgefill.solve import solve

    place = place or where()
    check_config(cfg, names)
    cap = store.get(capture_ref, stage="capture") if capture_ref is not None else None
    ref = resolve_model(model, store_root=store.root, expect=cap.recipe["model"] if cap else None)
    splits = check_splits(cfg, ref.num_layers, names)
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
    check_context(cfg, ref.context_length, names)  # before any capture
    if cap is None:
        cap_cfg = CaptureConfig(**{**(capture_args or {}), "splits": splits})
        cap, _ = capture(store, model, list(data or ["builtin:default"]), cap_cfg, out, place=capture_place or place)
    fits, clock = [], _Clock()
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
        clock.lap("solve")  # with quantize and loading the model
        result = Measurement(lm, cfg, sources, fits, calibration_hashes(cap), out, build.work).run(model)
        result["cost"]["seconds"] = {**clock.laps, **result["cost"]["seconds"]}
        from ridgefill.sweep.report import plot, write_markdown

        write_json(build.path / RESULT, result)
        plot(result, build.path / PLOT)
        (build.path / TABLE).write_text(write_markdown(result))
        rec = result["recommended"]
        summary = {"recommended": rec["split"], "configuration": rec["configuration"], "tail": rec["tail"],
                   "reason": rec["reason"], "mode": result["mode"], "splits": list(splits), "capture": cap.id,
                   "maps": recipe["maps"], "exact_needle": result["exact"]["needle"],
                   "identity_edge": result["identity_edge"], "advantage": result["advantage"],
                   "needle_prompts": result["cost"]["needle_prompts"]}
        art = build.commit(info={"model_spec": model, "placement": lm.placement()}, summary=summary)
    return art, False


def needle_suite(lm, cfg: SweepConfig) -> list[tuple[str, object]]:
    """`samples` single needles at `length` tokens as (haystack, sample): half in RULER's noise filler ("noise"),
    half in real prose ("prose", eval's haystack documents), alternating, each half spread over NEEDLE_DEPTHS
    depths of the filled prefix in turn, so that any first prompts cover both haystacks and every depth."""
    from ridgefill.evaluate.needles import build_suite, noise_haystack
    from ridgefill.evaluate.texts import haystack_documents

    top = (cfg.length - cfg.tail) / cfg.length  # the filled prefix ends here
    depths = tuple(round(float(x), 4) for x in np.linspace(0.05, top * 0.9, NEEDLE_DEPTHS))
    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    halves = {}
    for kind, want in zip(HAYSTACKS, (cfg.samples - cfg.samples // 2, cfg.samples // 2)):
        per = -(-want // len(depths))
        hay = noise_haystack() if kind == "noise" else haystack_documents()
        try:
            suite = build_suite(lm.tokenizer, lengths=(cfg.length,), depths=depths, tasks=("single",), samples=per,
                                seed=cfg.seed, tail=cfg.tail, chat=chat, haystack=hay)
        except ValueError as e:
            raise BadInput(f"needles ({kind} haystack): {e}") from None
        suite = [s for s in suite if s.in_filled_region(cfg.tail)]
        order = sorted(range(len(suite)), key=lambda i: (i % per, i // per))  # every depth in turn
        halves[kind] = [suite[i] for i in order][:want]
        if len(halves[kind]) < want:
            raise BadInput(f"only {len(halves[kind])} needle prompts of {cfg.length} tokens in the {kind} haystack "
                           "have their needle before the tail")
    out = []
    for i in range(max(len(h) for h in halves.values())):
        out += [(kind, halves[kind][i]) for kind in HAYSTACKS if i < len(halves[kind])]
    return out


class NeedleMemo:
    """Every needle outcome measured so far, in `<work>/needles.json` (rewritten by rename after each prompt): exact's
    answer per prompt, each (prompt, split, arm)'s, and the rows a selector added. A stopped sweep resumes where it
    was, and a job already measured on a prompt is never measured again."""

    def __init__(self, work):
        self.path = Path(work) / "needles.json"
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {"exact": {}, "arms": {}, "added": {}}

    @staticmethod
    def key(i: int, split: int, arm: str) -> str:
        return f"{i}/{split}/{arm}"

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, sort_keys=True))
        os.replace(tmp, self.path)


class Measurement:
    """One sweep's measurements on a loaded model: documents, the needle search, configurations and timing."""

    def __init__(self, lm, cfg: SweepConfig, sources: dict, fits, calib, out: Output, work):
        self.lm, self.cfg, self.sources, self.fits, self.calib, self.out = lm, cfg, sources, fits, calib, out
        self.work = Path(work)
        self.L = lm.adapter.num_layers
        self.splits = sorted(sources)
        self.done = Checkpoint(self.work)
        self.memo = NeedleMemo(self.work)
        self.rule = Rule(budget=cfg.max_needle_drop / 100.0, samples=cfg.samples,
                         group=cfg.samples if cfg.exhaustive else GROUP)
        self.forwards = 0  # exact forwards over needle prompts in this process (for the cost report)
        self.reused = 0  # needle prompts whose early layers were read back (EarlyCaches), not run again
        self.early = EarlyCaches(self.work, lm, (), 0)

    # ------------------------------------------------------------------------------------------- the whole run

    def run(self, model: str) -> dict:
        from ridgefill.sweep.report import advantage, recommend

        cfg = self.cfg
        clock = _Clock()
        docs = self._documents(self.splits, ARM_PLAN, "documents")
        figs = {(s, a): _doc_figures(docs, s, a, self) for s in self.splits for a in ARMS}
        key_over = {k: self._key_over(k, f) for k, f in figs.items()}
        clock.lap("documents")
        self.suite = needle_suite(self.lm, cfg)
        keep = self._kept_splits(key_over) if cfg.configurations and _keeps_early(self.lm) else ()
        self.early = EarlyCaches(self.work, self.lm, keep, KEEP_EARLY_BYTES)
        jobs = {}
        if cfg.exhaustive:
            self.out.info(f"needles: every split and arm on all {cfg.samples} prompts (--exhaustive)")
            jobs = run_pass([(s, a) for s in self.splits for a in ARMS], self.rule, self._measure)
            verdicts = {k: ("over" if key_over[k] or d.verdict == "over" else "within") for k, (d, _) in jobs.items()}
            search = {a: {"edge": _edge([s for s in self.splits if verdicts[(s, a)] == "within"], self.splits),
                          "measured": list(self.splits)} for a in ARMS}
        else:
            bis = {a: Bisection(self.splits, known={s: "over" for s in self.splits if key_over[(s, a)]}) for a in ARMS}
            self.out.info(f"needles: bisection over splits {', '.join(map(str, self.splits))}, sequential rule "
                          f"(looks at {', '.join(map(str, self.rule.looks))} prompts)")
            bis, jobs = bisect_arms(bis, self.rule, self._measure)
            verdicts = {(s, a): v for a, b in bis.items() for s, v in b.inferred().items()}
            search = {a: {"edge": b.edge, "measured": b.measured} for a, b in bis.items()}
        how = {k: _decided(k, key_over, jobs, search) for k in verdicts}
        clock.lap("needles")
        edge = search["ridgefill"]["edge"]
        near = _config_splits(self.splits, edge)
        bar = _ceiling_speedup(cfg.length, cfg.tail, edge, self.L) if edge is not None else None
        configs = self._configurations(near, verdicts, bar) if near and cfg.configurations else {}
        self.early.clear()
        clock.lap("configurations")
        result = self._result(model, docs, figs, verdicts, how, jobs, search, configs)
        result["recommended"] = recommend(result)
        result["advantage"] = advantage(result)
        result["identity_edge"] = result["advantage"]["identity"]
        result["timing"] = self._timing(result)
        _speeds(result)
        clock.lap("timing")
        result["cost"]["seconds"] = clock.laps
        return result

    def _kept_splits(self, key_over: dict) -> tuple[int, ...]:
        """The splits the configuration pass may measure at: those just shallower than any split the needles may
        find as the fitted maps' edge (one not over on key ΔNLL), or than none."""
        edges = [s for s in self.splits if not key_over[(s, "ridgefill")]] + [None]
        return tuple(sorted({c for e in edges for c in _config_splits(self.splits, e)}))

    def _key_over(self, job, figs: dict) -> bool:
        """Whether (split, arm) is over budget on key-token ΔNLL alone (a figure not measured is over)."""
        return not _key_within(figs, self.cfg)

    # ------------------------------------------------------------------------------------------------- documents

    def _documents(self, splits, arms, kind: str) -> list[dict]:
        """Per document: {"name", "tokens", split: {arm: doc_summary}, "added": {split: {arm: rows}}}."""
        docs = eval_documents(self.lm, self.cfg.length, self.cfg.documents, self.calib)

        def row(name, tokens, per):
            return {"name": name, "tokens": tokens, **{str(s): p[0] for s, p in per.items()},
                    "added": {str(s): p[1] for s, p in per.items()}}

        return measure_documents(self.lm, docs, self.cfg.length, {s: self.sources[s] for s in splits}, arms,
                                 self.cfg.tail, self.cfg.scored, self.out, row=row, seed=self.cfg.seed,
                                 done=self.done, kind=kind)

    # --------------------------------------------------------------------------------------------------- needles

    def _measure(self, i: int, jobs) -> tuple[bool, dict]:
        """Prompt i's outcome for each job (split, arm), from the memo or measured now (one exact forward for all)."""
        import torch

        from ridgefill.evaluate.needles import decode_and_score
        from ridgefill.runtime import exact_run

        memo, data = self.memo, self.memo.data
        kind, sample = self.suite[i]
        todo = [(s, a) for s, a in jobs if memo.key(i, s, a) not in data["arms"]]
        if todo or str(i) not in data["exact"]:
            splits = sorted({s for s, _ in todo})
            ids = torch.tensor(sample.prompt_ids)
            known = str(i) in data["exact"]  # exact's answer is kept: the fills need only the layers below them
            run = self.early.load(i, ids, splits) if known else None
            if run is not None:
                self.reused += 1
            elif known and _attention_only(self.lm):
                run = early_run(self.lm, ids, splits)
                self.forwards += 1
            else:
                run = exact_run(self.lm, ids, splits=sorted(set(splits) | set(self.early.splits)))
                self.forwards += 1
                self.early.save(i, run)
            made, names = [], []
            if str(i) not in data["exact"]:
                made.append(run.result(self.cfg.tail))
                names.append(None)
            for s in splits:
                want = [a for t, a in todo if t == s]
                arms = _with_selected(want)  # a control's selected arm counts its rows; only the jobs are decoded
                res, added = fills(self.lm, run, self.sources[s], arms, self.cfg.tail, logits_rows=1,
                                   seed=self.cfg.seed, counted={a.name for a in arms} - set(want))
                for a in want:
                    made.append(res[a])
                    names.append((s, a))
                for a, n in added.items():
                    data["added"][memo.key(i, s, a)] = n
            ok = []
            for at in range(0, len(made), DECODE_BATCH):
                ok += decode_and_score(self.lm, sample, made[at : at + DECODE_BATCH])
            for name, right in zip(names, ok):
                if name is None:
                    data["exact"][str(i)] = bool(right)
                else:
                    data["arms"][memo.key(i, *name)] = bool(right)
            memo.save()
            del run, made
        got = {(s, a): data["arms"][memo.key(i, s, a)] for s, a in jobs}
        line = ", ".join(f"{a}@{s}" for s, a in jobs)
        self.out.info(f"  prompt {i + 1} ({kind}): exact {'✓' if data['exact'][str(i)] else '✗'} · "
                      + " ".join(f"{a}@{s} {'✓' if got[(s, a)] else '✗'}" for s, a in jobs) if len(line) < 200 else
                      f"  prompt {i + 1} ({kind}): {len(jobs)} jobs")
        return data["exact"][str(i)], got

    # ------------------------------------------------------------------------------------------ configurations

    def _configurations(self, near: list[int], verdicts: dict, bar: float | None) -> dict:
        """The quality configurations at the splits `near` (just shallower than the fitted maps' edge), each beside
        its equal-cost control. -> {(split, name): {"figures", "verdict", "decided", "control": {...},
        "beats_control", "why"}}. `bar`: the plain recommendation's ceiling (None: no split is within).

        Key ΔNLL first, on documents. Then the needles, of every configuration and control not over on it in an
        exhaustive sweep; an adaptive one measures only what can change the recommendation (`_config_groups`), in
        order of ceiling, and stops at the first that is within budget: every later one has a lower ceiling."""
        names = [c for c in CONFIGS if c != "ridgefill+kscale" or _kscale_applies(self.lm, min(near))]
        names = [c for c in names if c != "ridgefill+protected" or all(self.sources[s].protected for s in near)]
        if not names:
            return {}
        arms = _with_selected([parse_arm(c) for c in names] + [parse_arm(CONTROL[c]) for c in names if CONTROL[c]])
        self.out.info(f"configurations at split{'s' if len(near) > 1 else ''} {', '.join(map(str, near))}: "
                      + ", ".join(a.name for a in arms))
        docs = self._documents(near, arms, "configuration_documents")
        figs = {(s, a.name): _doc_figures(docs, s, a.name, self) for s in near for a in arms}
        key_over = {k: self._key_over(k, f) for k, f in figs.items()}
        groups = self._config_groups(near, names, figs, key_over)
        got, skipped = {}, {}
        if self.cfg.exhaustive:  # every configuration and control not over on key ΔNLL, side by side
            want = [(s, a) for s in near for c in names for a in (c, CONTROL[c]) if a and not key_over[(s, a)]]
            got = run_pass(list(dict.fromkeys(want)), self.rule, self._measure)
        else:
            skipped = {j: why for g in groups for j, why in g["skip"].items()}
            best = None
            for g in sorted(groups, key=lambda g: (-g["ceiling"], -g["split"])):
                if bar is not None and g["ceiling"] <= bar + TOLERANCE:
                    why = f"not measured: its ceiling x{g['ceiling']:.2f} is not above the plain fill's x{bar:.2f}"
                elif best is not None and g["ceiling"] < best - TOLERANCE:
                    why = f"not measured: a candidate of higher ceiling (x{best:.2f}) is within budget"
                else:
                    res = run_pass(g["jobs"], self.rule, self._measure) if g["jobs"] else {}
                    got.update(res)
                    if any(d.verdict == "within" for d, _ in res.values()):
                        best = g["ceiling"] if best is None else max(best, g["ceiling"])
                    continue
                skipped.update({j: why for j in g["jobs"]})
        out = {}
        for s in near:
            for c in names:
                entry = {"figures": figs[(s, c)], **_verdict((s, c), key_over, got, skipped),
                         "pairs": _pairs_of(got, (s, c))}
                ctl = CONTROL[c]
                if ctl:
                    entry["control"] = {"arm": ctl, "figures": figs[(s, ctl)], **_verdict((s, ctl), key_over, got, skipped),
                                        "pairs": _pairs_of(got, (s, ctl))}
                else:  # a correction costs no rows: its control is the plain fill at the same split
                    entry["control"] = {"arm": "ridgefill", "figures": None, "verdict": verdicts[(s, "ridgefill")],
                                        "decided": "the plain fill at this split"}
                entry["beats_control"], entry["why"] = _beats(entry, got, (s, c), (s, ctl) if ctl else None)
                entry["extra_rows"] = self._extra_rows(s, c)
                out[(s, c)] = entry
        return out

    def _config_groups(self, near, names, figs, key_over) -> list[dict]:
        """What an adaptive sweep may measure of each configuration: {"split", "name", "ceiling" (with the rows it
        adds on the documents), "jobs", "skip": {job: why not measured}}. A configuration beside a control it
        cannot beat (the control is within key ΔNLL with a key ΔNLL as low) is not measured: its control alone is,
        as a longer tail. Every group in which something is within budget is a candidate at its ceiling (a
        configuration or control within is a candidate: a control beaten is the configuration's win)."""
        cfg = self.cfg
        groups = []
        for s in near:
            for c in names:
                ctl = CONTROL[c]
                jobs, skip = [], {}
                key = figs[(s, c)].get("dnll_key")
                if not key_over[(s, c)]:
                    ctl_key = figs[(s, ctl)].get("dnll_key") if ctl else None
                    if ctl and not key_over[(s, ctl)] and (key is None or ctl_key is None or key >= ctl_key):
                        f = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
                        skip[(s, c)] = (f"not measured: its key ΔNLL ({f(key)}) is not below its control's "
                                        f"({f(ctl_key)}), so it cannot beat it")
                    else:
                        jobs.append((s, c))
                if ctl and not key_over[(s, ctl)]:
                    jobs.append((s, ctl))
                rows = round(self._extra_rows(s, c))
                ceiling = _ceiling_speedup(cfg.length, min(cfg.tail + rows, cfg.length), s, self.L)
                groups.append({"split": s, "name": c, "ceiling": ceiling, "jobs": jobs, "skip": skip})
        return groups

    def _extra_rows(self, split: int, arm: str) -> float:
        """The mean number of prefix rows a configuration runs exactly beyond the plain fill's, over the needle
        prompts it was measured on (else the documents)."""
        if arm == "ridgefill+kscale":
            return 0.0
        vals = [v for k, v in self.memo.data["added"].items() if k.split("/", 1)[1] == f"{split}/{arm}"]
        if not vals:
            vals = [d["added"][str(split)][arm] for d in self.done.rows.get("configuration_documents", [])
                    if arm in d.get("added", {}).get(str(split), {})]
        return float(np.mean(vals)) if vals else 0.0

    # ------------------------------------------------------------------------------------------------ timing

    def _timing(self, result: dict) -> dict:
        """`repeats` rounds of real, timed prefills of the first needle prompt: exact, then the fitted maps at every
        split (and the recommended configuration at its split), the order reversed every other round, so that a
        slow spell of a shared machine lands on every arm alike. Per arm the speed-up of each round is exact's
        time in that round over the arm's."""
        import torch

        from ridgefill.runtime import ExactRun, prefill

        cfg = self.cfg
        prompt = self.suite[0][1].prompt_ids
        ids = torch.tensor(prompt)
        rec = result["recommended"]
        arms = [(s, parse_arm("ridgefill"), cfg.tail) for s in self.splits]
        if rec["split"] is not None and (rec["configuration"] != "ridgefill" or rec["tail"] != cfg.tail):
            arms.append((rec["split"], parse_arm(rec["configuration"]), rec["tail"]))
        self.out.info(f"timing: {cfg.repeats} rounds of {len(arms) + 1} prefills of {len(prompt)} tokens")
        run = ExactRun(ids=ids.to(self.lm.adapter.device), logits=None, cache=None, states={}, seconds=0.0)
        rounds = []
        for r in range(cfg.repeats):
            secs = {"exact": prefill(self.lm, ids, "exact", split=0, tail=cfg.tail, logits_rows=1).seconds}
            for s, arm, tail in (arms if r % 2 == 0 else arms[::-1]):
                res, _ = fills(self.lm, run, self.sources[s], _with_selected([arm]), tail, timed=True, logits_rows=1,
                               seed=cfg.seed)
                secs[f"{s}/{arm.name}/{tail}"] = res[arm.name].seconds
            rounds.append(secs)
        return {"length": len(prompt), "repeats": cfg.repeats, "rounds": rounds}

    # ------------------------------------------------------------------------------------------------ result

    def _result(self, model, docs, figs, verdicts, how, jobs, search, configs) -> dict:
        cfg = self.cfg
        exact = self.memo.data["exact"]
        measured = sorted(int(i) for i in exact)
        by_suite = {k: [exact[str(i)] for i in measured if self.suite[i][0] == k] for k in HAYSTACKS}
        entries = []
        for s, sol, q in self.fits:
            rep = sol.manifest["summary"]
            arms = {}
            for a in ARMS:
                arms[a] = {**figs[(s, a)], **self._needle_figures(jobs.get((s, a))), "verdict": verdicts[(s, a)],
                           "decided": how[(s, a)]}
            entry = {"split": s, "alpha": rep["alpha"], "solve": sol.id, "quantize": q.id if q else None,
                     "ceiling_speedup": _ceiling_speedup(cfg.length, cfg.tail, s, self.L),
                     "heldout": {"fitted": _kv(rep["fitted"]), "identity": _kv(rep["identity"])},
                     "macs": self._macs(s, "ridgefill", 0), "arms": arms, "configurations": {}}
            for (cs, name), c in configs.items():
                if cs != s:
                    continue
                extra = c["extra_rows"]
                tail = cfg.tail + round(extra)
                conf = {"figures": {**c["figures"], **self._needle_figures(c["pairs"])},
                        "verdict": c["verdict"], "decided": c["decided"],
                        "extra_rows": extra, "ceiling_speedup": _ceiling_speedup(cfg.length, min(tail, cfg.length), s, self.L),
                        "beats_control": c["beats_control"], "why": c["why"],
                        "control": {**{k: v for k, v in c["control"].items() if k != "pairs"},
                                    "tail": tail if CONTROL[name] else cfg.tail}}
                if CONTROL[name]:
                    conf["control"]["figures"] = {**(c["control"]["figures"] or {}),
                                                  **self._needle_figures(c["control"]["pairs"])}
                conf["macs"] = self._macs(s, name, extra)
                entry["configurations"][name] = conf
            entries.append(entry)
        cost = {"needle_prompts": {f"{s}/{a}": len(p) for (s, a), (_, p) in sorted(self._all_jobs(jobs).items())},
                "prompts_with_exact_answer": len(measured), "exact_forwards": self.forwards,
                "early_layers_read_back": self.reused}
        return {"model": model, "num_layers": self.L, "length": cfg.length, "tail": cfg.tail, "samples": cfg.samples,
                "documents": cfg.documents, "mode": "exhaustive" if cfg.exhaustive else "adaptive",
                "budget": {"max_needle_drop": cfg.max_needle_drop, "max_key_dnll": cfg.max_key_dnll},
                "rule": {"alpha": self.rule.alpha, "group": self.rule.group, "within_factor": WITHIN_FACTOR,
                         "looks": list(self.rule.looks), "level": self.rule.level, "bounds": self.rule.bounds()},
                "exact": {"needle": 100.0 * float(np.mean([exact[str(i)] for i in measured])) if measured else None,
                          "needle_by_suite": {k: [sum(v), len(v)] for k, v in by_suite.items()}},
                "splits": entries, "search": search, "cost": cost,
                "needles": [{"index": i, "haystack": self.suite[i][0], "depth": self.suite[i][1].depth,
                             "exact": exact[str(i)],
                             "arms": {k.split("/", 1)[1]: v for k, v in self.memo.data["arms"].items()
                                      if int(k.split("/", 1)[0]) == i}} for i in measured],
                "documents_detail": docs}

    def _all_jobs(self, jobs: dict) -> dict:
        out = dict(jobs)
        for k in self.memo.data["arms"]:
            i, s, a = k.split("/", 2)
            out.setdefault((int(s), a), (None, self._job_pairs((int(s), a))))
        return out

    def _job_pairs(self, job) -> list:
        """The (exact right, arm right) pairs measured for a job, in prompt order."""
        s, a = job
        data = self.memo.data
        idx = sorted(int(k.split("/", 1)[0]) for k in data["arms"] if k.split("/", 1)[1] == f"{s}/{a}")
        return [(data["exact"][str(i)], data["arms"][self.memo.key(i, s, a)]) for i in idx]

    def _needle_figures(self, job) -> dict:
        """Needle figures of one job's prompts: accuracy, exact's on the same prompts, per haystack, and the paired
        bootstrap interval of (arm - exact) in points. Empty for a job never measured."""
        from ridgefill.numerics import paired_bootstrap

        if job is None:
            return {"needle": None, "needle_n": 0}
        pairs = job[1] if isinstance(job, tuple) else job
        if not pairs:
            return {"needle": None, "needle_n": 0}
        e = np.array([100.0 * x for x, _ in pairs])
        a = np.array([100.0 * y for _, y in pairs])
        n = len(pairs)
        kinds = [self.suite[i][0] for i in range(n)]
        suites = {k: [int(sum(a[j] > 0 for j in range(n) if kinds[j] == k)), kinds.count(k)] for k in HAYSTACKS}
        return {"needle": float(a.mean()), "needle_exact": float(e.mean()), "needle_n": n, "needle_by_suite": suites,
                "needle_minus_exact": paired_bootstrap(a, e, samples=self.cfg.bootstrap, seed=self.cfg.seed)}

    def _macs(self, split: int, arm: str, extra: float) -> dict | None:
        """Multiply-accumulates of exact and of the arm at `length` (evaluate/macs.py); None where not counted."""
        from ridgefill.evaluate.macs import model_shape, prefill_macs

        cfg = self.cfg
        shape = model_shape(self.lm.adapter)
        base = "ridgefill+rows" if arm == "ridgefill+rows" else "ridgefill"
        rows = 1 + round(extra)
        return {"exact": prefill_macs(shape, cfg.length, cfg.tail, split, "exact")["total"],
                "arm": prefill_macs(shape, cfg.length, cfg.tail, split, base, exact_rows=rows)["total"]}


# ---------------------------------------------------------------------------------------------------- helpers


class _Clock:
    """CPU and wall seconds of each phase of this process's run (a resumed sweep counts only what it did again)."""

    def __init__(self):
        self.laps: dict = {}
        self._cpu, self._wall = time.process_time(), time.perf_counter()

    def lap(self, name: str) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        self.laps[name] = {"cpu": round(cpu - self._cpu, 2), "wall": round(wall - self._wall, 2)}
        self._cpu, self._wall = cpu, wall


def early_run(lm, ids, splits):
    """The exact forward of `ids` up to the deepest of `splits` only, as an `ExactRun` without logits: its cache
    holds the layers below that split and its states the hidden state entering each split, which is all a fill at
    those splits takes from it (`runtime.prefill_from`). For a prompt whose exact answer is already known."""
    import torch

    from ridgefill.models.hooks import StopForward, layer_inputs
    from ridgefill.runtime import ExactRun
    from transformers import DynamicCache

    ad = lm.adapter
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(ad.device)
    cache = DynamicCache(config=lm.model.config)
    layers = list(ad.layers) + [ad.base.norm]
    with torch.no_grad(), layer_inputs(layers, sorted(splits), stop=True) as seen:
        try:
            lm.model(input_ids=ids[None], use_cache=True, cache=cache, logits_to_keep=1)
        except StopForward:
            pass
    return ExactRun(ids=ids, logits=None, cache=cache, states={s: seen[s][0] for s in splits}, seconds=0.0)


class EarlyCaches:
    """The early layers of needle prompts' exact runs, kept on disk from the first pass over a prompt for the later
    ones (`<work>/early/<prompt>.safetensors`, removed once the configuration pass is done).

    A prompt's first exact forward also keeps the hidden state entering each of `splits` (the splits the
    configuration pass may measure at) and is saved up to the deepest of them: the keys and values of the layers
    below it, and those states. A later pass at some of those splits reads them back instead of running the early
    layers again (`early_run`). On a CPU that is the cheaper way: for a 4K-token SmolLM2 prompt, saving layers 0-21
    and four states (168 MB) costs up to 2 s of CPU (mostly the kernel's fresh pages for the file), reading them
    back 0.05 s, while running 18 layers again costs 5.6 s. The runs read back are the ones saved, so the fills
    built on them are bit-identical. The file is a cache snapshot as capture checkpoints write it
    (`capture.kvstate`, cut at the deepest split) with the states beside it. Only where `_keeps_early` (the model
    on the CPU, a cache of keys and values alone) and within `limit` bytes (and half the free disk); a prompt not
    kept is run again, as before."""

    def __init__(self, work, lm, splits, limit: int):
        import shutil

        self.dir, self.lm = Path(work) / "early", lm
        self.splits = tuple(sorted(splits))
        self.depth = max(self.splits, default=0)
        here = next(p for p in (self.dir, *self.dir.parents) if p.exists())
        self.limit = min(limit, shutil.disk_usage(here).free // 2) if self.splits else 0
        self.used = sum(p.stat().st_size for p in self.dir.glob("*.safetensors")) if self.dir.is_dir() else 0

    def _path(self, i: int) -> Path:
        return self.dir / f"{i}.safetensors"

    def save(self, i: int, run) -> bool:
        """Keep prompt i's run (an exact run holding the states entering `splits`); False where it is not kept."""
        from ridgefill.capture import kvstate
        from ridgefill.formats import safetensors

        if not self.splits or self._path(i).is_file():
            return False
        try:
            snap = kvstate.snapshot(run.cache, layers=self.depth)
        except kvstate.NotSaved:
            return False
        tensors = snap.tensors | {f"state.{s}": kvstate.lazy(run.states[s]) for s in self.splits}
        size = sum(t.nbytes for t in tensors.values())
        if self.used + size > self.limit:
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        layout = json.dumps(snap.layout, separators=(",", ":"), sort_keys=True)
        safetensors.save_streamed(self._path(i), tensors, {"cache": layout})  # (via a temporary file)
        self.used += size
        return True

    def load(self, i: int, ids, splits):
        """Prompt i's early layers as an `ExactRun` without logits (as `early_run` gives), for fills at `splits`;
        None where they were not kept."""
        import torch
        from transformers import DynamicCache

        from ridgefill.capture import kvstate
        from ridgefill.formats import safetensors
        from ridgefill.runtime import ExactRun

        if not self.splits or not set(splits) <= set(self.splits) or not self._path(i).is_file():
            return None
        f, ad = safetensors.LazyFile(self._path(i)), self.lm.adapter
        snap = kvstate.Snapshot(json.loads(f.metadata["cache"]),
                                {n: f.lazy(n) for n in f.names if n.startswith(kvstate.PREFIX)})
        cache = kvstate.restore(self.lm, snap, lambda: DynamicCache(config=self.lm.model.config), str(self.dir))
        states = {s: kvstate.tensor(f[f"state.{s}"], ad.layer_device(s)) for s in splits}
        return ExactRun(ids=torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(ad.device), logits=None, cache=cache,
                        states=states, seconds=0.0)

    def clear(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        self.used = 0


def _keeps_early(lm) -> bool:
    """Whether the sweep keeps early layers on disk (EarlyCaches): a cache of keys and values alone, every layer on
    the CPU, where reading them back costs far less than running them again (an accelerator runs them faster than
    a disk gives them back)."""
    ad = lm.adapter
    return _attention_only(lm) and all(ad.layer_device(l).type == "cpu" for l in range(ad.num_layers))


def _attention_only(lm) -> bool:
    """A model whose cache is keys and values alone (no recurrent states), which `early_run` can cut."""
    from ridgefill.models.kinds import FULL, SLIDING

    return set(lm.adapter.layer_kinds) <= {FULL, SLIDING}


def _with_selected(arms) -> list[Arm]:
    """`arms` with, before each control, the selected-rows arm it matches in cost (`fills` counts its rows)."""
    out: list[Arm] = []
    for a in arms:
        a = parse_arm(a) if isinstance(a, str) else a
        if a.control and a.selected not in out:
            out.append(a.selected)
        if a not in out:
            out.append(a)
    return out


def _doc_figures(docs: list[dict], split: int, arm: str, m: "Measurement") -> dict:
    """The long-document figures of one (split, arm): eval's summary of the documents alone."""
    from ridgefill.evaluate import EvalConfig
    from ridgefill.evaluate.summary import summarize

    k = str(split)
    rows = [{"name": d["name"], "tokens": d["tokens"], arm: d[k][arm]} for d in docs if arm in d.get(k, {})]
    if not rows:
        return {}
    ecfg = EvalConfig(arms=("exact", arm), tail=m.cfg.tail, lengths=(m.cfg.length,), seed=m.cfg.seed,
                      bootstrap=m.cfg.bootstrap)
    summ = summarize({"split": split, "num_layers": m.L, "tail": m.cfg.tail, "documents": rows, "needles": []}, ecfg)
    return {k: v for k, v in summ["arms"][arm].items() if k.startswith(("dnll", "kl", "top1"))}


def _key_within(figs: dict, cfg: SweepConfig) -> bool:
    v = figs.get("dnll_key")
    return v is not None and v <= cfg.max_key_dnll + TOLERANCE


def _edge(within: list[int], splits: list[int]) -> int | None:
    """The shallowest split from which every deeper candidate is within budget (exhaustive measurements)."""
    edge = None
    for s in reversed(splits):
        if s not in within:
            break
        edge = s
    return edge


def _decided(job, key_over: dict, jobs: dict, search: dict) -> str:
    if key_over[job]:
        return "key ΔNLL"
    if job in jobs:
        d = jobs[job][0]
        return f"needles, {d.n} prompts" + (" (sequential rule)" if d.early else "")
    s, arm = job
    edge = search[arm]["edge"]
    return f"implied: {'within from split ' + str(edge) if edge is not None and s >= edge else 'over below the edge'}"


def _pairs_of(got: dict, job) -> list:
    """The pairs a job's decision rests on ([] for a job decided on key ΔNLL)."""
    return got[job][1] if job in got else []


def _verdict(job, key_over: dict, got: dict, skipped: dict) -> dict:
    if key_over[job]:
        return {"verdict": "over", "decided": "key ΔNLL"}
    if job not in got:
        return {"verdict": None, "decided": skipped.get(job, "not measured")}
    d = got[job][0]
    return {"verdict": d.verdict, "decided": f"needles, {d.n} prompts" + (" (sequential rule)" if d.early else "")}


def _beats(entry: dict, got: dict, job, control) -> tuple[bool, str]:
    """Whether a configuration within budget beats its equal-cost control: the control is over budget, or the
    configuration has the lower key-token ΔNLL and answers at least as many of the needles both were measured on."""
    if entry["verdict"] is None:
        return False, entry["decided"]
    if entry["verdict"] != "within":
        return False, "over budget"
    ctl = entry["control"]
    if ctl["verdict"] == "over":
        return True, f"its control ({ctl['arm']}) is over budget"
    if ctl["verdict"] is None:
        return False, f"its control ({ctl['arm']}) was not measured"
    if control is None:
        return False, "the plain fill at this split is within budget too"
    ours, theirs = got[job][1], got[control][1]
    n = min(len(ours), len(theirs))
    a, b = sum(y for _, y in ours[:n]), sum(y for _, y in theirs[:n])
    ka, kb = entry["figures"].get("dnll_key"), ctl["figures"].get("dnll_key")
    f = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    if a >= b and ka is not None and kb is not None and ka < kb:
        return True, f"key ΔNLL {f(ka)} < {f(kb)}, needles {a} ≥ {b} of {n}"
    return False, f"its control is as good (key ΔNLL {f(kb)} vs {f(ka)}, needles {b} vs {a} of {n})"


def _config_splits(splits: list[int], edge: int | None) -> list[int]:
    """The candidates just shallower than the fitted maps' edge (or the deepest, when no split is within)."""
    below = [s for s in splits if edge is None or s < edge]
    return below[-CONFIG_SPLITS:]


def _kscale_applies(lm, split: int) -> bool:
    """+kscale rescales keys, which a QK-norm renormalizes: only for models without one above the split."""
    from ridgefill.runtime.corrections import plan

    if lm.adapter.has_qk_norm:
        return False
    try:
        plan(lm.adapter, "ridgefill", split, ("kscale",), None, DEFAULT_TAIL)
    except BadInput:
        return False
    return True


def _speeds(result: dict) -> None:
    """The measured speed-ups from the timing rounds: per split (the fitted maps) and for the recommendation, the
    median and [min, max] over the rounds of exact's time over the arm's, flagged as noise where the median exceeds
    the compute ceiling (a prefill cannot beat the work it skips: such a figure is the machine, not the fill)."""
    t, tail = result["timing"], result["tail"]

    def speed(key: str, ceiling_speedup: float) -> dict | None:
        runs = [r["exact"] / r[key] for r in t["rounds"] if r.get(key)]
        if not runs:
            return None
        med = float(np.median(runs))
        return {"median": med, "low": float(min(runs)), "high": float(max(runs)), "runs": runs,
                "noise": med > ceiling_speedup}

    for e in result["splits"]:
        e["speed"] = speed(f"{e['split']}/ridgefill/{tail}", e["ceiling_speedup"])
    rec = result["recommended"]
    if rec["split"] is not None:
        rec["speed"] = speed(f"{rec['split']}/{rec['configuration']}/{rec['tail']}", rec["ceiling_speedup"])


def _ceiling_speedup(n: int, tail: int, split: int, layers: int) -> float:
    """1 / r, r = (S (N - T) + L T) / (L N): the speed-up if only the layer-rows run counted (runtime.ceiling)."""
    return layers * n / (split * (n - tail) + layers * tail)


def _kv(scores: dict) -> dict:
    return {"k_cosine": scores["k_cosine"], "v_cosine": scores["v_cosine"]}
