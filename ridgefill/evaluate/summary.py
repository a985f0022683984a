"""Eval's figures from its measured rows: per arm needle accuracy, ΔNLL on all / novel / key tokens, KL, top-1 and
prefill speed, with paired bootstrap intervals against exact and between the arms a correction, selector or control
changes (`summarize`); and the compact figures a release manifest and model card carry (`manifest_summary`).
Sweep summarizes each split with the same function."""

from __future__ import annotations

import numpy as np

def summarize(results: dict, cfg) -> dict:
    """Per arm: needle accuracy (points), ΔNLL on all / novel / key tokens, KL, top-1, prefill time; paired
    bootstrap intervals for each arm minus exact and for ridgefill minus identity. `cfg`: an EvalConfig (its arms,
    lengths, tail, seed and bootstrap samples)."""
    from ridgefill.numerics import paired_bootstrap
    from ridgefill.runtime import ceiling, ceiling_speedup

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
    out["ceiling_speedup"] = ceiling_speedup(longest, cfg.tail, results["split"], results["num_layers"])
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


def _pairs(results: dict, cfg, boot, nan) -> dict:
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
