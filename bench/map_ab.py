"""Releases against each other on the same long prompts (figure "map_ab"): needles and ΔNLL, paired.

    .venv/bin/python bench/map_ab.py NAME=RELEASE NAME=RELEASE ... [--model builtin:qwen2.5-coder-1.5b]
        [--dtype float32] [--lengths 4096 16384] [--needles 24 8] [--documents 2 1] [--tail 512]
        [--bootstrap 10000] [--work FILE] [--threads N] [--quick] [--out FILE]

An A/B of map designs (a split, maps from earlier states, ...) needs each design measured on the same prompts:
per prompt one exact forward, keeping the states entering every release's split and the earlier layers its maps
read, and each release's fill built on it (`runtime.prefill_from`, as eval and `bench/long_context.py` build
theirs). Per length N: long_context.py's needle prompts (the sweep's mix: eval's single, multi-key and
multi-value needles, chat and plain prompts, prose and noise haystacks, eight depths) answered by exact and by
every release, greedy, in one batch; and its N-token code and prose windows, each release's ΔNLL against exact on
the last `--scored` tokens (all, key tokens), KL and top-1. Figures per release: accuracy and the drop against
exact, paired by prompt with a 95 % bootstrap interval, by task; pooled key-token and plain ΔNLL with intervals;
and every pair of releases against each other (the first minus the second, paired). Each release's cost per
filled row and late layer (its maps' multiply-accumulates) and its compute ceiling at N are in the table.

Results are kept per prompt in `--work` (default bench/out/map_ab-<model>.work.json) under the releases' content
ids: a stopped run resumes, and a run with another set of releases reuses the exact answers it shares.
"""

from __future__ import annotations

import sys
import time
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import OUT, Bench, Work, digest, parser, positive, release, short  # noqa: E402
from long_context import ceiling, check_scored, documents, length_arguments  # noqa: E402


def named(text: str) -> tuple[str, Path]:
    name, sep, folder = text.partition("=")
    if not sep or not name:
        raise ValueError(f"expected NAME=RELEASE, got {text!r}")
    return name, release(folder)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("releases", type=named, nargs="+", metavar="NAME=RELEASE")
    ap.add_argument("--model", default="builtin:qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    ap.add_argument("--tail", type=positive, default=512)
    args = length_arguments(ap, [4096, 16384], [24, 8], [2, 1])
    names = [n for n, _ in args.releases]
    if len(set(names)) != len(names) or "exact" in names:
        ap.error("release names must be distinct, and not 'exact'")
    check_scored(ap, args, args.tail)

    with Bench("map_ab", args, args.model) as bench:
        from dataclasses import replace

        from harness import load
        from ridgefill.artifacts import Store
        from ridgefill.evaluate.source import load_source
        from ridgefill.runtime import maps_on_devices

        _, lm = load(args.model, bench.store, dtype=args.dtype)
        L = lm.adapter.num_layers
        srcs = {}
        for name, folder in args.releases:
            src = load_source(Store(bench.store), str(folder))
            srcs[name] = replace(src, maps=maps_on_devices(lm, src.maps, range(src.split, L)))
        settings = {"model": args.model, "dtype": args.dtype, "tail": args.tail}
        work = Work(args.work or OUT / f"map_ab-{short(args.model)}{'-quick' if args.quick else ''}.work.json",
                    settings)
        start = time.perf_counter()
        lengths = {str(n): measure_length(lm, srcs, n, needles, docs, args, work)
                   for n, needles, docs in zip(args.lengths, args.needles, args.documents)}
        facts = {name: {"release": str(folder), "ident": srcs[name].ident, "split": srcs[name].split,
                        "states": list(srcs[name].reads), "macs_per_filled_row": macs_per_row(srcs[name], L),
                        "ceiling": {n: ceiling(L, srcs[name].split, int(n), args.tail) for n in lengths}}
                 for name, folder in args.releases}
        value = {n: {name: {"needle_drop": mean(f["needles"]["drop"][name]),
                            "key_dnll": mean(f["documents"]["all"][name]["dnll_key"])} for name in names}
                 for n, f in lengths.items()}
        details = {"settings": settings | {"scored": args.scored}, "releases": facts, "lengths": lengths,
                   "wall_s": round(time.perf_counter() - start, 1), "work": str(work.path)}
        details["table"] = table(details, names)
        print(details["table"], flush=True)
        bench.finish(value, details=details, checks={})


def mean(v):
    return v["mean"] if isinstance(v, dict) else None


def macs_per_row(src, num_layers: int) -> dict:
    """Multiply-accumulates of a filled row's maps, per late layer on average and in all: d_in x d_out per map."""
    sizes = [int(w.shape[0]) * int(w.shape[1]) for l, (w, _) in sorted(src.maps.items()) if l >= src.split]
    return {"per_layer": round(sum(sizes) / max(len(sizes), 1)), "total": sum(sizes)}


def measure_length(lm, srcs: dict, n: int, needles: int, per_kind: int, args, work: Work) -> dict:
    import torch

    from ridgefill.evaluate.arms import plan
    from ridgefill.evaluate.measure import DocumentScore, fills
    from ridgefill.evaluate.needles import decode_and_score
    from ridgefill.runtime import exact_run
    from ridgefill.sweep.config import SweepConfig
    from ridgefill.sweep.needles import needle_suite

    fill = plan(("ridgefill",))
    reads = sorted({l for s in srcs.values() for l in s.reads})
    suite = needle_suite(lm, SweepConfig(length=n, long_length=0, tail=args.tail, needles=needles))
    rows = []
    for i, (hay, s) in enumerate(suite):
        key = f"{n}/needle/{digest(s.prompt_ids)}"
        row = work.get(key) or {"task": hay.task, "haystack": hay.haystack, "form": hay.form, "depth": s.depth,
                                "tokens": len(s.prompt_ids), "correct": {}, "seconds": {}}
        todo = ["exact"] * ("exact" not in row["correct"]) + [m for m in srcs if srcs[m].ident not in row["correct"]]
        if todo:
            t = time.perf_counter()
            run = exact_run(lm, torch.tensor(s.prompt_ids), splits=reads)
            made = [run.result(args.tail) if m == "exact" else
                    fills(lm, run, srcs[m], fill, args.tail, logits_rows=1)[0]["ridgefill"] for m in todo]
            ok = decode_and_score(lm, s, made)
            for m, right in zip(todo, ok):
                row["correct"]["exact" if m == "exact" else srcs[m].ident] = bool(right)
            row["seconds"][",".join(todo)] = round(time.perf_counter() - t, 2)
            work.put(key, row)
            del run, made
        rows.append(row)
        print(f"{n}: needle {i + 1}/{len(suite)} ({hay.label}, depth {s.depth}): exact"
              f"{'+' if row['correct']['exact'] else '-'} "
              + " ".join(m + ("+" if row["correct"][srcs[m].ident] else "-") for m in srcs), flush=True)
    drows = []
    calibration = frozenset().union(*(s.calibration for s in srcs.values()))
    for kind, name, ids, _ in documents(lm, n, per_kind, calibration):
        key = f"{n}/document/{name}/tail {args.tail}/scored {args.scored}"
        row = work.get(key) or {"kind": kind, "name": name, "tokens": len(ids), "arms": {}, "seconds": {}}
        todo = [m for m in srcs if srcs[m].ident not in row["arms"]]
        if todo:
            t = time.perf_counter()
            doc = DocumentScore(lm, torch.tensor(ids), args.tail, args.scored, splits=reads)
            for m in todo:
                res, _ = fills(lm, doc.run, srcs[m], fill, args.tail, logits_rows=doc.keep)
                row["arms"][srcs[m].ident] = doc(res["ridgefill"])
            row["seconds"][",".join(todo)] = round(time.perf_counter() - t, 2)
            work.put(key, row)
            del doc
        drows.append(row)
        print(f"{n}: document {name}: key ΔNLL " + ", ".join(
            f"{m} {row['arms'][srcs[m].ident]['dnll_key']}" for m in srcs), flush=True)
    idents = {m: s.ident for m, s in srcs.items()}
    return {"needles": needle_figures(rows, idents, args), "documents": document_figures(drows, idents, args),
            "needle_rows": rows, "document_rows": drows}


def needle_figures(rows: list[dict], idents: dict, args) -> dict:
    import numpy as np

    from ridgefill.numerics import paired_bootstrap
    from ridgefill.sweep.needles import TASKS

    def pts(who, task=None):
        key = "exact" if who == "exact" else idents[who]
        return np.array([100.0 * r["correct"][key] for r in rows if task is None or r["task"] == task])

    def boot(a, b):
        return paired_bootstrap(a, b, samples=args.bootstrap, seed=0) if len(a) else None

    who = ["exact", *idents]
    return {"prompts": len(rows), "accuracy": {w: float(pts(w).mean()) for w in who},
            "drop": {m: boot(pts("exact"), pts(m)) for m in idents},
            "pairs": {f"{a} - {b}": boot(pts(a), pts(b)) for a, b in combinations(idents, 2)},
            "by_task": {t: {"prompts": int(len(pts("exact", t))),
                            "accuracy": {w: float(pts(w, t).mean()) for w in who} if len(pts("exact", t)) else None}
                        for t in TASKS}}


def document_figures(rows: list[dict], idents: dict, args) -> dict:
    import numpy as np

    from ridgefill.numerics import paired_bootstrap

    def values(sel, m, metric, weight):
        got = [r for r in rows if sel in ("all", r["kind"]) and r["arms"][idents[m]][metric] is not None]
        return (np.array([r["arms"][idents[m]][metric] for r in got]),
                np.array([r["arms"][idents[m]][weight] for r in got], dtype=float), got)

    def pooled(sel, m, metric, weight):
        x, w, got = values(sel, m, metric, weight)
        return paired_bootstrap(x, np.zeros(len(x)), samples=args.bootstrap, seed=0, weights=w) if got else None

    def pair(sel, a, b, metric, weight):
        x, w, got = values(sel, a, metric, weight)
        y, _, _ = values(sel, b, metric, weight)
        return paired_bootstrap(x, y, samples=args.bootstrap, seed=0, weights=w) if got and len(y) == len(x) else None

    out = {}
    for sel in ("all", "code", "prose"):
        out[sel] = {m: {"dnll": pooled(sel, m, "dnll", "tokens"), "dnll_key": pooled(sel, m, "dnll_key", "key_tokens"),
                        "kl": pooled(sel, m, "kl", "tokens"), "top1": pooled(sel, m, "top1", "tokens")}
                    for m in idents}
        out[sel]["pairs"] = {f"{a} - {b}": {"dnll": pair(sel, a, b, "dnll", "tokens"),
                                            "dnll_key": pair(sel, a, b, "dnll_key", "key_tokens")}
                             for a, b in combinations(idents, 2)}
        out[sel]["documents"] = sum(1 for r in rows if sel in ("all", r["kind"]))
    return out


def table(details: dict, names: list[str]) -> str:
    def ci(v, fmt="+.1f") -> str:
        if not isinstance(v, dict):
            return "–"
        return f"{v['mean']:{fmt}} [{v['low']:{fmt}}, {v['high']:{fmt}}]"

    lines = ["| length | release | split | states | MACs / filled row / layer | ceiling | needles | accuracy % | "
             "drop [CI] | single / multikey / multivalue % | key ΔNLL [CI] | ΔNLL [CI] |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for n, f in details["lengths"].items():
        nd, dd = f["needles"], f["documents"]["all"]
        lines.append(f"| {int(n):,} | exact | | | | 1.00 | {nd['prompts']} | {nd['accuracy']['exact']:.1f} | | "
                     + " / ".join(f"{t['accuracy']['exact']:.0f}" if t["accuracy"] else "–"
                                  for t in nd["by_task"].values()) + " | | |")
        for m in names:
            r = details["releases"][m]
            tasks = " / ".join(f"{t['accuracy'][m]:.0f}" if t["accuracy"] else "–" for t in nd["by_task"].values())
            lines.append(f"| {int(n):,} | {m} | {r['split']} | {','.join(map(str, r['states']))} | "
                         f"{r['macs_per_filled_row']['per_layer']:,} | {r['ceiling'][n]:.2f} | {nd['prompts']} | "
                         f"{nd['accuracy'][m]:.1f} | {ci(nd['drop'][m])} | {tasks} | "
                         f"{ci(dd[m]['dnll_key'], '.3f')} | {ci(dd[m]['dnll'], '.3f')} |")
        for pair, v in nd["pairs"].items():
            lines.append(f"| {int(n):,} | {pair} | | | | | | | {ci(v)} | | "
                         f"{ci(dd['pairs'][pair]['dnll_key'], '+.3f')} | {ci(dd['pairs'][pair]['dnll'], '+.3f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
