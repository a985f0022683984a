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

FORMAT_VERSION = 6  # 2: single needles in noise filler; 3: nofill needles, "ridgefill+rows"; 4: row 0 exact;
# 5: arms built from one exact run per prompt, speed from one timed prefill per arm and length ("timing");
# 6: prefix rows whose split state is an outlier by norm (later sinks) run exactly
RESULTS = "results.json"
ARMS = ("exact", "ridgefill", "identity", "nofill", "ridgefill+rows")
DEFAULT_ARMS = ARMS[:4]  # "+rows" is optional (it costs another fill per sample)


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


def load_source(store: Store, source: str) -> MapsSource:
    """A release folder, or a solve / quantize artifact of the store."""
    import json

    from ridgefill.capture.run import DOCS
    from ridgefill.export import release

    p = Path(source)
    if (p / release.MANIFEST).is_file():
        manifest, maps = release.load_release(p)
        return MapsSource({l: (m["weight"], m["bias"]) for l, m in maps.items()}, int(manifest["split"]),
                          manifest["model"]["fingerprint"], "release:" + recipe_id(manifest["files"]),
                          frozenset(manifest.get("fit", {}).get("calibration_sha256", [])), p)
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
    return MapsSource(maps, split, art.info["model"]["fingerprint"], f"{art.stage}:{art.id}", calib, None)


def evaluate(store: Store, model: str, source: str, cfg: EvalConfig, out: Output, *, device: str = "auto",
             dtype: str = "auto", device_map=None, max_memory=None) -> tuple[Artifact, bool]:
    """Run (or find cached) the eval. device / dtype / device_map / max_memory: see ridgefill.models.device; the
    device kind and model dtype are part of the recipe (nothing is added for cpu / float32)."""
    from ridgefill.models import resolve_model
    from ridgefill.models.device import where

    place = where(device, dtype, device_map, max_memory)
    for a in cfg.arms:
        if a not in ARMS:
            raise BadInput(f"unknown arm '{a}' (choose from {', '.join(ARMS)})")
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
    suite = needle_suite(lm, cfg)
    results = {"split": src.split, "num_layers": ref.num_layers, "tail": cfg.tail,
               "documents": _documents(lm, src, cfg, out), "needles": _needles(lm, src, cfg, suite, out)}
    prompts = {}
    for s in suite:  # the first sample of each length
        prompts.setdefault(s.context_tokens, s.prompt_ids)
    results["timing"] = time_prefills(lm, src, cfg.arms, cfg.tail, prompts)
    results["summary"] = summarize(results, cfg)
    with store.build("eval", recipe) as build:
        write_json(build.path / RESULTS, results)
        art = build.commit(info={"model_spec": model, "source": source, "placement": lm.placement()},
                           summary=results["summary"])
    return art, False


def _fill_args(src: MapsSource, arm: str, tail: int, probe=None) -> dict:
    args = {"split": src.split, "tail": tail, "maps": src.maps if arm.startswith("ridgefill") else None}
    return args | ({"probe": probe} if arm == "ridgefill+rows" and probe is not None else {})


def _arms_from(lm, run, src: MapsSource, arms, tail: int, probe=None, logits_rows=None) -> dict:
    """Each arm's PrefillResult for one prompt, built from its exact run (`runtime.prefill_from`): the fill arms
    only run their late layers. "ridgefill+rows" picks its rows inside a prefill of its own."""
    from ridgefill.runtime import prefill
    from ridgefill.runtime.prefill import prefill_from

    res = {}
    for arm in arms:
        if arm == "exact":
            res[arm] = run.result(tail)
        elif arm == "ridgefill+rows":
            res[arm] = prefill(lm, run.ids, arm, logits_rows=logits_rows, **_fill_args(src, arm, tail, probe))
        else:
            res[arm] = prefill_from(lm, run, arm, logits_rows=logits_rows, **_fill_args(src, arm, tail))
    return res


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


def _documents(lm, src: MapsSource, cfg: EvalConfig, out: Output) -> list[dict]:
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
            fills = [a for a in cfg.arms if a != "exact"]
            res = _arms_from(lm, doc.run, src, fills, T, probe, logits_rows=doc.keep)
            rows.append({"name": d.name, "tokens": N, **{arm: doc(r) for arm, r in res.items()}})
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


def _needles(lm, src: MapsSource, cfg: EvalConfig, suite: list, out: Output) -> list[dict]:
    import torch

    from ridgefill.evaluate.needles import decode_and_score
    from ridgefill.runtime.prefill import exact_run

    rows = []
    with out.progress("needles", total=len(suite)) as bar:
        for i, s in enumerate(suite):
            run = exact_run(lm, torch.tensor(s.prompt_ids), splits=[src.split])  # shared by every arm
            row = {"task": s.task, "length": s.context_tokens, "depth": s.depth, "seed": s.seed,
                   "answers": s.answers}
            res = _arms_from(lm, run, src, cfg.arms, cfg.tail, logits_rows=1)
            row["correct"] = dict(zip(res, decode_and_score(lm, s, list(res.values()))))  # decoded in one batch
            rows.append(row)
            bar.update(i + 1, (i + 1) * len(s.prompt_ids), f"sample {i + 1}/{len(suite)}")
    return rows


def time_prefills(lm, src: MapsSource, arms, tail: int, prompts: dict) -> list[dict]:
    """The measured prefill speed: one real, timed `prefill` per arm and length ({length: prompt ids}), the arms
    interleaved within each length, so a slow spell of a shared machine does not favour one arm."""
    import torch

    from ridgefill.runtime import prefill

    rows = []
    for length, ids in sorted(prompts.items()):
        ids = torch.tensor(ids)
        rows.append({"length": length, "tokens": len(ids),
                     "seconds": {arm: prefill(lm, ids, arm, **_fill_args(src, arm, tail)).seconds for arm in arms}})
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
    ex = out["arms"]["exact"].get("prefill_s")
    if ex:
        for arm in cfg.arms:
            if arm != "exact" and "prefill_s" in out["arms"][arm]:
                out["arms"][arm]["speedup"] = ex / out["arms"][arm]["prefill_s"]
    out["ceiling_r"] = ceiling(longest, cfg.tail, results["split"], results["num_layers"])
    out["ceiling_speedup"] = 1 / out["ceiling_r"]
    return out


def manifest_summary(summary: dict, eval_id: str) -> dict:
    """The compact figures a release manifest and model card carry (the artifact keeps the rest)."""
    keep = ("needle", "dnll", "dnll_novel", "dnll_key", "kl", "top1", "prefill_s", "speedup")
    arms = {a: {k: round(v, 4) for k, v in s.items() if k in keep and v is not None} for a, s in summary["arms"].items()}
    return {"eval_id": eval_id, "samples": summary["samples"], "documents": summary["documents"],
            "ceiling_speedup": round(summary["ceiling_speedup"], 4), "arms": arms}
