"""`ridgefill eval`: run the fill arms against the exact model and gate a release (docs/method.md#measuring-a-release).

Two measurements, both on text never used for calibration:
- long documents: ΔNLL against exact on the scored stretch (the last `scored` tokens), on all, novel and key
  tokens, KL(exact || arm) and top-1 agreement; key tokens are those whose exact loss rises by more than 2 nats
  when the context is cut to the tail alone;
- filled-region needle retrieval: RULER-style samples whose needles all lie in the filled prefix, greedy
  decoding from each arm's cache, exact match.
Paired bootstrap intervals per document / per sample; measured prefill time per arm against the ceiling r.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ridgefill.artifacts import Artifact, Store, recipe_id
from ridgefill.artifacts.store import write_json
from ridgefill.errors import BadInput
from ridgefill.output import Output

FORMAT_VERSION = 7  # 2: single needles in noise filler; 3: nofill needles, "ridgefill+rows"; 4: row 0 exact;
# 5: arms built from one exact run per prompt, speed from one timed prefill per arm and length ("timing");
# 6: prefix rows whose split state is an outlier by norm (later sinks) run exactly; 7: corrections, selectors and
# their controls (evaluate/arms.py), paired comparisons ("pairs")
RESULTS = "results.json"
DEFAULT_ARMS = ("exact", "ridgefill", "identity", "nofill")  # the rest are asked for by name (evaluate/arms.py)


@dataclass(frozen=True)
class EvalConfig:
    arms: tuple[str, ...] = DEFAULT_ARMS
    tail: int = 512
    lengths: tuple[int, ...] = (2048, 4096)
    depths: tuple[float, ...] = (0.25, 0.5)
    tasks: tuple[str, ...] = ("single", "multikey", "multivalue")
    samples: int = 1  # per (length, depth, task) cell
    documents: int = 4
    doc_tokens: int = 2048
    scored: int = 256
    seed: int = 0
    bootstrap: int = 10000


@dataclass(frozen=True)
class MapsSource:
    maps: dict  # {layer: (W float32 [d, d], b float32 [d])}
    split: int
    fingerprint: str  # the model the maps were fitted on
    ident: str  # content identity for the recipe
    calibration: frozenset  # calibration document sha256s
    release_dir: Path | None
    state_offsets: dict | None = None  # a hybrid's terminal-state offsets {layer: float32 array}
    protected: frozenset | None = None  # the protected-token table: token ids


def load_source(store: Store, source: str) -> MapsSource:
    """A release folder, or a solve / quantize artifact of the store."""
    import json

    from ridgefill.capture.run import DOCS
    from ridgefill.export import release

    p = Path(source)
    if (p / release.MANIFEST).is_file():
        manifest, maps = release.load_release(p)
        table = release.load_protected(p, manifest)
        return MapsSource({l: (m["weight"], m["bias"]) for l, m in maps.items()}, int(manifest["split"]),
                          manifest["model"]["fingerprint"], "release:" + recipe_id(manifest["files"]),
                          frozenset(manifest.get("fit", {}).get("calibration_sha256", [])), p,
                          release.load_state_offsets(p, manifest), None if table is None else frozenset(table))
    art = store.get(source)
    if art.stage not in ("solve", "quantize"):
        raise BadInput(f"artifact {art.id} is a {art.stage} artifact; eval takes a release folder, solve or quantize artifact")
    if art.stage == "quantize":
        from ridgefill.export.quantize import decoded_maps

        maps = decoded_maps(art)  # with the artifact's own group size
    else:
        from ridgefill.solve.run import load_maps

        maps = load_maps(art)
    cap = store.upstream(art, "capture")
    docs = json.loads(cap.file(DOCS).read_text())
    calib = frozenset(d["sha256"] for d in docs if d["role"] == "calibration")
    split = int(art.manifest["summary"]["split"])
    from ridgefill.solve.run import load_extras

    offsets, table = load_extras(art if art.stage == "solve" else store.upstream(art, "solve"))
    return MapsSource(maps, split, art.info["model"]["fingerprint"], f"{art.stage}:{art.id}", calib, None, offsets,
                      None if table is None else frozenset(table))


def evaluate(store: Store, model: str, source: str, cfg: EvalConfig, out: Output, *, device: str = "auto",
             dtype: str = "auto", device_map=None, max_memory=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the eval. device / dtype / device_map / max_memory: see ridgefill.models.device; the
    device kind and model dtype are part of the recipe (nothing is added for cpu / float32)."""
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where

    from ridgefill.evaluate.arms import plan

    place = where(device, dtype, device_map, max_memory)
    arms = plan(cfg.arms)
    cfg = replace(cfg, arms=tuple(a.name for a in arms))
    from ridgefill.evaluate.needles import TASKS

    bad = [t for t in cfg.tasks if t not in TASKS]
    if bad:
        raise BadInput(f"unknown needle task(s) {', '.join(bad)} (choose from {', '.join(TASKS)})")
    if not all(0 <= d <= 1 for d in cfg.depths):
        raise BadInput(f"needle depths must lie in [0, 1], got {list(cfg.depths)}")
    if "exact" not in cfg.arms:
        raise BadInput("--arms must include exact: every figure is measured against it")
    if not 0 < cfg.scored < cfg.tail or cfg.tail >= min(cfg.lengths + (cfg.doc_tokens,)):
        raise BadInput(f"need 0 < scored ({cfg.scored}) < tail ({cfg.tail}) < every length and --doc-tokens")
    src = load_source(store, source)
    for a in arms:
        if "state" in a.corrections and src.state_offsets is None:
            raise BadInput(f"arm '{a.name}' needs terminal-state offsets, and '{source}' has none "
                           "(measure them with solve --state-data)")
        if a.selector == "protected" and src.protected is None:
            raise BadInput(f"arm '{a.name}' needs a protected-token table, and '{source}' has none")
    ref = resolve_model(model, store_root=store.root)
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


def _fill_args(src: MapsSource, arm, tail: int) -> dict:
    """prefill / prefill_from arguments of a fill arm (an `arms.Arm`)."""
    args = {"split": src.split, "tail": tail, "maps": src.maps if arm.base == "ridgefill" else None}
    if arm.corrections:
        args["corrections"] = arm.corrections
        if "state" in arm.corrections:
            args["state_offsets"] = src.state_offsets
    return args


def _rows_rng(seed: int, ids) -> np.random.Generator:
    """The random control's generator for one prompt: a function of the eval seed and the prompt's tokens."""
    import hashlib

    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def _arms_from(lm, run, src: MapsSource, arms, tail: int, probe=None, logits_rows=None, seed: int = 0,
               timed: bool = False) -> tuple[dict, dict]:
    """Each arm's PrefillResult for one prompt, and the number of rows each selected-rows arm added.

    With `timed` every arm is a real, timed `prefill`; otherwise the arms are built from the prompt's exact run
    (`runtime.prefill_from`: the fill arms only run their late layers), but for "+rows", which picks its rows
    inside a prefill of its own. A selector's rows are the prefix rows it makes exact beyond the arm's own exact
    rows (row 0 and the outlier rows); its controls get as many: random filled rows, or a longer tail."""
    from ridgefill.runtime import prefill
    from ridgefill.runtime.prefill import prefill_from

    ids = run.ids
    n = int(ids.shape[0])

    def fill(arm, base: str, **extra):
        args = _fill_args(src, arm, tail) | extra
        if timed or base == "ridgefill+rows":
            return prefill(lm, ids, base, logits_rows=logits_rows, **args)
        return prefill_from(lm, run, base, logits_rows=logits_rows, **args)

    res, added, own = {}, {}, None
    for arm in arms:
        if arm.base == "exact":
            res[arm.name] = prefill(lm, ids, "exact", split=src.split, tail=tail, logits_rows=logits_rows) \
                if timed else run.result(tail)
            continue
        if arm.base == "nofill":
            res[arm.name] = fill(arm, "nofill")
            continue
        if arm.selector is None:
            res[arm.name] = fill(arm, arm.base)
            own = own or res[arm.name].exact_rows
            continue
        if own is None:  # the arm's own exact rows (row 0, the outliers), from a plain fill of this prompt
            from ridgefill.evaluate.arms import Arm

            own = fill(Arm("ridgefill"), "ridgefill").exact_rows
        if arm.control is None:
            if arm.selector == "rows":
                r = fill(arm, "ridgefill+rows", **({"probe": probe} if probe is not None else {}))
            else:
                prefix = ids[: n - tail].tolist()
                pick = [p for p, t in enumerate(prefix) if t in src.protected]
                r = fill(arm, "ridgefill", exact_rows=pick)
            added[arm.name] = sorted(set(r.exact_rows) - set(own))
            res[arm.name] = r
            continue
        count = len(added[arm.selected.name])
        if arm.control == "random":
            taken = set(own)
            free = np.array([p for p in range(n - tail) if p not in taken], dtype=np.int64)
            pick = sorted(_rows_rng(seed, ids.cpu()).choice(free, size=min(count, len(free)), replace=False).tolist())
            res[arm.name] = fill(arm, "ridgefill", exact_rows=pick)
        else:
            res[arm.name] = fill(arm, "ridgefill", tail=min(tail + count, n))
        added[arm.name] = count
    return res, {k: (len(v) if isinstance(v, list) else v) for k, v in added.items()}


def eval_documents(lm, tokens: int, count: int, calibration) -> list:
    """`count` evaluation documents with at least `tokens` tokens, none of them used for calibration (BadInput)."""
    from ridgefill.evaluate import texts

    docs = texts.long_documents(lm.tokenizer, tokens, limit=count)
    if len(docs) < count:
        raise BadInput(f"only {len(docs)} evaluation documents have {tokens} tokens")
    reused = texts.reused([(d.name, d.text) for d in docs], calibration)
    if reused:
        raise BadInput(f"evaluation documents were used for calibration: {', '.join(reused)}")
    return docs


class DocumentScore:
    """One document's exact side: its exact run (keeping the states entering `splits`, for the arms to build on),
    the exact loss on the last `scored` tokens, and which of them are key and novel. Calling it with an arm's
    PrefillResult (logits of the last `keep` rows) gives that arm's `metrics.doc_summary`."""

    def __init__(self, lm, ids, tail: int, scored: int, splits=()):
        from ridgefill.evaluate import metrics
        from ridgefill.runtime.prefill import exact_run

        n, self.keep, self.pick = len(ids), scored + 1, slice(0, scored)  # the first K of the last K+1 rows
        self.targets = ids[n - scored :].numpy()  # predict the scored tokens
        self.run = exact_run(lm, ids, splits=splits, logits_rows=self.keep)
        self.exact = _host(self.run.logits[self.pick])
        self.nll = metrics.token_nll(self.exact, self.targets)
        cut = exact_run(lm, ids[n - tail :], logits_rows=self.keep)  # the context cut to the tail
        self.key = metrics.key_mask(self.nll, metrics.token_nll(_host(cut.logits[self.pick]), self.targets))
        self.novel = metrics.novel_mask(ids.numpy(), n - scored)

    def __call__(self, res) -> dict:
        from ridgefill.evaluate import metrics

        la = _host(res.logits[self.pick])
        return metrics.doc_summary(self.nll, metrics.token_nll(la, self.targets), metrics.kl_exact_arm(self.exact, la),
                                   metrics.top1_agree(self.exact, la), self.novel, self.key)


def _documents(lm, src: MapsSource, cfg: EvalConfig, arms, out: Output) -> list[dict]:
    import torch

    from ridgefill.runtime.prefill import PROBE_ROWS

    docs = eval_documents(lm, cfg.doc_tokens, cfg.documents, src.calibration)
    T, K = cfg.tail, cfg.scored
    rows = []
    with out.progress("documents", total=len(docs)) as bar:
        for i, d in enumerate(docs):
            ids = torch.tensor(d.ids[: cfg.doc_tokens])
            N = len(ids)
            doc = DocumentScore(lm, ids, T, K, splits=[src.split])  # its exact run is shared by every arm
            probe = range(N - K - PROBE_ROWS, N - K)  # "+rows": the stretch just before the scored tokens
            fills = [a for a in arms if a.base != "exact"]
            res, added = _arms_from(lm, doc.run, src, fills, T, probe, logits_rows=doc.keep, seed=cfg.seed)
            rows.append({"name": d.name, "tokens": N, **{arm: doc(r) for arm, r in res.items()},
                         **({"rows_added": added} if added else {})})
            bar.update(i + 1, (i + 1) * N, f"doc {i + 1}/{len(docs)}")
    return rows


def _host(logits):
    """Logits (float32, on the model's head device) as a float32 numpy array on the host."""
    return logits.float().cpu().numpy()


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
    import torch

    from ridgefill.evaluate.needles import decode_and_score
    from ridgefill.runtime.prefill import exact_run

    rows = []
    with out.progress("needles", total=len(suite)) as bar:
        for i, s in enumerate(suite):
            run = exact_run(lm, torch.tensor(s.prompt_ids), splits=[src.split])  # shared by every arm
            row = {"task": s.task, "length": s.context_tokens, "depth": s.depth, "seed": s.seed,
                   "answers": s.answers}
            res, added = _arms_from(lm, run, src, arms, cfg.tail, logits_rows=1, seed=cfg.seed)
            row["correct"] = dict(zip(res, decode_and_score(lm, s, list(res.values()))))  # decoded in one batch
            if added:
                row["rows_added"] = added
            rows.append(row)
            bar.update(i + 1, (i + 1) * len(s.prompt_ids), f"sample {i + 1}/{len(suite)}")
    return rows


def time_prefills(lm, src: MapsSource, arms, tail: int, prompts: dict, seed: int = 0) -> list[dict]:
    """The measured prefill speed: one real, timed `prefill` per arm and length ({length: prompt ids}), the arms
    interleaved within each length, so a slow spell of a shared machine does not favour one arm."""
    import torch

    from ridgefill.runtime.prefill import ExactRun

    rows = []
    for length, ids in sorted(prompts.items()):
        ids = torch.tensor(ids).to(lm.adapter.device)
        run = ExactRun(ids=ids, logits=None, cache=None, states={}, seconds=0.0)  # timed: every arm prefills
        res, _ = _arms_from(lm, run, src, arms, tail, seed=seed, timed=True, logits_rows=1)
        rows.append({"length": length, "tokens": len(ids), "seconds": {a: r.seconds for a, r in res.items()}})
    return rows


def summarize(results: dict, cfg: EvalConfig) -> dict:
    """Per arm: needle accuracy (points), ΔNLL on all / novel / key tokens, KL, top-1, prefill time; paired
    bootstrap intervals for each arm minus exact and for ridgefill minus identity."""
    from ridgefill.evaluate.metrics import paired_bootstrap
    from ridgefill.runtime import ceiling

    docs, needles = results["documents"], results["needles"]
    boot = lambda a, b, w=None: paired_bootstrap(np.asarray(a, float), np.asarray(b, float), samples=cfg.bootstrap,  # noqa: E731
                                                 seed=cfg.seed, weights=None if w is None else np.asarray(w, float))
    nan = lambda x: np.nan if x is None else x  # noqa: E731
    out: dict = {"arms": {}, "samples": len(needles), "documents": len(docs)}
    acc = {a: [100.0 * n["correct"][a] for n in needles] for a in cfg.arms if needles and a in needles[0]["correct"]}
    longest = max(cfg.lengths)
    for arm in cfg.arms:
        s: dict = {}
        if arm in acc:
            s["needle"] = float(np.mean(acc[arm]))
            if arm != "exact":
                s["needle_minus_exact"] = boot(acc[arm], acc["exact"])
        secs = [t["seconds"][arm] for t in results.get("timing", []) if t["length"] == longest]
        if secs:
            s["prefill_s"] = float(np.mean(secs))
        if arm != "exact":
            for key, w in (("dnll", "tokens"), ("dnll_novel", "novel_tokens"), ("dnll_key", "key_tokens")):
                vals = [nan(d[arm][key]) for d in docs]
                weights = [d[arm][w] for d in docs]
                s[key] = float(np.nansum(np.multiply(vals, weights)) / max(sum(weights), 1)) if sum(weights) else None
                if sum(weights):
                    s[key + "_ci"] = boot(vals, np.zeros(len(vals)), weights)
            s["kl"] = float(np.mean([d[arm]["kl"] for d in docs]))
            s["top1"] = float(np.mean([d[arm]["top1"] for d in docs]))
        out["arms"][arm] = s
    if "ridgefill" in acc and "identity" in acc:
        out["ridgefill_minus_identity"] = {"needle": boot(acc["ridgefill"], acc["identity"])}
        if "ridgefill" in cfg.arms and "identity" in cfg.arms:
            out["ridgefill_minus_identity"]["dnll_key"] = boot(
                [nan(d["ridgefill"]["dnll_key"]) for d in docs], [nan(d["identity"]["dnll_key"]) for d in docs],
                [d["ridgefill"]["key_tokens"] for d in docs]) if any(d["ridgefill"]["key_tokens"] for d in docs) else None
    for arm in cfg.arms:  # the rows a selector (or its control) added, as a share of the prompt
        added = [(r["rows_added"][arm], n) for r, n in _prompts(results) if arm in r.get("rows_added", {})]
        if added:
            out["arms"][arm]["rows_added"] = float(np.mean([a / n for a, n in added]))
    out["pairs"] = _pairs(results, cfg, boot, nan)
    ex = out["arms"]["exact"].get("prefill_s")
    if ex:
        for arm in cfg.arms:
            if arm != "exact" and "prefill_s" in out["arms"][arm]:
                out["arms"][arm]["speedup"] = ex / out["arms"][arm]["prefill_s"]
    out["ceiling_r"] = ceiling(longest, cfg.tail, results["split"], results["num_layers"])
    out["ceiling_speedup"] = 1 / out["ceiling_r"]
    return out


def _prompts(results: dict):
    """(row, prompt length) of every document and needle sample."""
    for d in results["documents"]:
        yield d, d["tokens"]
    for n in results["needles"]:
        yield n, n["length"]


def comparisons(arm_names) -> list[tuple[str, str]]:
    """The paired comparisons eval reports, (arm, against): each corrected arm against the same arm without its
    corrections, each selected-rows arm against the arm without the selector, and each control against the
    selected-rows arm it matches in cost."""
    from dataclasses import replace as with_

    from ridgefill.evaluate.arms import parse_arm

    names = list(arm_names)
    pairs = []
    for name in names:
        a = parse_arm(name)
        if a.control:
            against = a.selected.name
        elif a.selector:
            against = with_(a, selector=None).name
        elif a.corrections:
            against = with_(a, corrections=()).name
        else:
            continue
        if against in names:
            pairs.append((name, against))
    return pairs


def _pairs(results: dict, cfg: EvalConfig, boot, nan) -> dict:
    """Paired bootstrap intervals of arm minus arm (`comparisons`): needle points per sample, ΔNLL on novel and key
    tokens per document (token-weighted)."""
    docs, needles = results["documents"], results["needles"]
    out = {}
    for a, b in comparisons(cfg.arms):
        pair: dict = {}
        if needles and a in needles[0]["correct"] and b in needles[0]["correct"]:
            pair["needle"] = boot([100.0 * n["correct"][a] for n in needles], [100.0 * n["correct"][b] for n in needles])
        for key, w in (("dnll_novel", "novel_tokens"), ("dnll_key", "key_tokens")):
            weights = [d[a][w] for d in docs] if docs and a in docs[0] else []
            if sum(weights):
                pair[key] = boot([nan(d[a][key]) for d in docs], [nan(d[b][key]) for d in docs], weights)
        out[f"{a} - {b}"] = pair
    return out


def manifest_summary(summary: dict, eval_id: str) -> dict:
    """The compact figures a release manifest and model card carry (the artifact keeps the rest)."""
    keep = ("needle", "dnll", "dnll_novel", "dnll_key", "kl", "top1", "prefill_s", "speedup", "rows_added")
    arms = {a: {k: round(v, 4) for k, v in s.items() if k in keep and v is not None} for a, s in summary["arms"].items()}
    from ridgefill.evaluate.arms import parse_arm

    validated = sorted({c for a in summary["arms"] for c in parse_arm(a).corrections})
    return {"eval_id": eval_id, "samples": summary["samples"], "documents": summary["documents"],
            "ceiling_speedup": round(summary["ceiling_speedup"], 4), "arms": arms, "corrections": validated}
