"""Long-context quality of a release at its split: needles and ΔNLL at 4K to 32K tokens (figure "long_context").

    .venv/bin/python bench/long_context.py RELEASE [--model builtin:qwen2.5-coder-1.5b] [--dtype bfloat16]
        [--lengths 4096 16384 32768] [--needles 40 20 10] [--documents 8 4 1] [--tail 512] [--scored TAIL-1]
        [--bootstrap 10000] [--work FILE] [--threads N] [--quick] [--out FILE]

The sweep and eval measure a release at 2K-4K tokens; people serve prompts of 16K-128K. Per length N (each of
`--lengths`, with its own count of needle prompts and of documents per kind):

1. **Needles**: the sweep's needle prompts at N tokens (ridgefill.sweep.needles.needle_suite: rounds of eval's
   single, multi-key and multi-value needles through the chat template and as plain text, single needles in RULER's
   noise filler and real prose in turn, the others in prose, spread over eight depths of the filled prefix, the
   release's tail). Each prompt runs the exact model once, keeping the state entering the split; the fitted maps
   (`ridgefill`) and the identity fill (`identity`, x_hat = h_S) build only their late layers on it; the three
   answer by greedy decoding in one batch (evaluate.measure.fills, evaluate.needles.decode_and_score: eval's and
   the sweep's code). Per arm: accuracy; the drop against exact, paired by prompt (exact's points minus the arm's)
   with a 95 % bootstrap interval over the prompts; ridgefill minus identity, paired: the maps' edge.
2. **Documents**: N-token windows of long Python sources (the standard library's modules that the calibration
   corpus leaves out, evaluate.texts.long_documents(kind="code")) and of prose (the language-reference topics of
   pydoc, joined in order and cut into disjoint windows): ΔNLL against exact on the last `--scored` tokens (default:
   the exact tail's tokens but its first), on all tokens and on key tokens (whose exact loss rises by more than 2
   nats with the context cut to the tail), KL and top-1, per arm; pooled over the documents (token-weighted) with
   bootstrap intervals, and ridgefill minus identity, paired. At 32K one code window exists (turtle.py is the only
   module that long in Qwen2.5's tokens).

Every prompt's wall time is recorded (exact forward, fills and decoding together) so that counts can be planned.
Results are kept per prompt in `--work` (default bench/out/long_context-<model>.work.json): a stopped run resumes
where it was, as long as the release and settings are the same. Value: per length, the needle drop of the maps
against exact and their edge over identity, and the key-token ΔNLL of both. `--quick` runs tiny sizes (its numbers
mean nothing).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import OUT, Bench, Work, digest, parser, positive, release, short  # noqa: E402

ARMS = ("exact", "ridgefill", "identity")
FILLS = ("ridgefill", "identity")
DOC_KINDS = ("code", "prose")


def main() -> None:
    from ridgefill.formats.release import read_release

    ap = parser(__doc__)
    ap.add_argument("release", type=release)
    ap.add_argument("--model", default="builtin:qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tail", type=positive, default=None, help="default: the release's tail")
    args = length_arguments(ap, [4096, 16384, 32768], [40, 20, 10], [8, 4, 1])
    tail = args.tail or read_release(args.release).tail
    check_scored(ap, args, tail)

    with Bench("long_context", args, args.model) as bench:
        from dataclasses import replace

        from harness import load
        from ridgefill.artifacts import Store
        from ridgefill.evaluate.source import load_source
        from ridgefill.runtime import maps_on_devices

        _, lm = load(args.model, bench.store, dtype=args.dtype)
        src = load_source(Store(bench.store), str(args.release))
        src = replace(src, maps=maps_on_devices(lm, src.maps, range(src.split, lm.adapter.num_layers)))
        # --scored is part of a document's key, not of the settings: a run scoring more keeps the needles measured.
        settings = {"release": src.ident, "model": args.model, "dtype": args.dtype, "tail": tail, "split": src.split}
        work = Work(args.work or OUT / f"long_context-{short(args.model)}{'-quick' if args.quick else ''}.work.json",
                    settings)
        start = time.perf_counter()
        lengths = {}
        for n, needles, docs in zip(args.lengths, args.needles, args.documents):
            lengths[str(n)] = measure_length(lm, src, n, tail, needles, docs, args, work)
        def mean(v):  # a bootstrap's mean; None where nothing was measured (no prompt, no key token)
            return v["mean"] if isinstance(v, dict) else None

        value = {n: {"needle_drop_ridgefill": mean(f["needles"]["drop"]["ridgefill"]),
                     "edge_over_identity": mean(f["needles"]["ridgefill_minus_identity"]),
                     "key_dnll_ridgefill": mean(f["documents"]["all"]["ridgefill"]["dnll_key"]),
                     "key_dnll_identity": mean(f["documents"]["all"]["identity"]["dnll_key"])}
                 for n, f in lengths.items()}
        details = {"settings": settings | {"scored": args.scored}, "release": str(args.release), "lengths": lengths,
                   "ceiling": {n: ceiling(lm.adapter.num_layers, src.split, int(n), tail) for n in lengths},
                   "wall_s": round(time.perf_counter() - start, 1), "work": str(work.path)}
        details["table"] = table(details)
        print(details["table"], flush=True)
        bench.finish(value, details=details, checks={})


def length_arguments(ap, lengths: list[int], needles: list[int], documents: list[int]):
    """The options of a bench that measures needles and documents per prompt length (this one, map_ab.py), parsed:
    --lengths, --needles and --documents (one count, or one per length), --scored, --bootstrap, --work, --quick."""
    ap.add_argument("--lengths", type=positive, nargs="+", default=lengths)
    ap.add_argument("--needles", type=positive, nargs="+", default=needles, help="per length")
    ap.add_argument("--documents", type=int, nargs="+", default=documents, help="per length and document kind")
    ap.add_argument("--scored", type=positive, default=None, help="default: the tail less one")
    ap.add_argument("--bootstrap", type=positive, default=10000)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the bench runs")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.needles, args.documents, args.scored, args.bootstrap = [1024], [2], [1], 64, 200
    for name in ("needles", "documents"):
        given = getattr(args, name)
        if len(given) == 1:
            setattr(args, name, given * len(args.lengths))
        elif len(given) != len(args.lengths):
            ap.error(f"--{name}: one count, or one per length ({len(args.lengths)})")
    return args


def check_scored(ap, args, tail: int) -> None:
    """--scored defaults to the tail less one, and may not be more: the tail's rows predict its tokens after the
    first."""
    args.scored = args.scored or tail - 1
    if args.scored >= tail:
        ap.error(f"--scored {args.scored}: at most the tail less one ({tail - 1})")


def ceiling(layers: int, split: int, n: int, tail: int) -> float:
    """The compute ceiling L N / (S (N - T) + L T)."""
    return round(layers * n / (split * (n - tail) + layers * tail), 4)


def documents(lm, n: int, per_kind: int, calibration) -> list:
    """`per_kind` windows of n tokens of code (long stdlib modules, one window each, the first n tokens) and of prose
    (pydoc's topics joined in order, cut into disjoint windows), each checked against the calibration corpus."""
    from ridgefill.evaluate import texts

    docs = []
    code = texts.long_documents(lm.tokenizer, n, kind="code", limit=per_kind)
    if len(code) < per_kind:
        raise SystemExit(f"only {len(code)} standard-library modules have {n} tokens")
    docs += [("code", d.name, d.ids[:n], d.text) for d in code]
    topics = texts.haystack_documents("prose")
    joined = "\n\n".join(text for _, text in topics)
    ids = texts.special_prefix(lm.tokenizer) + list(lm.tokenizer(joined, add_special_tokens=False)["input_ids"])
    if len(ids) < per_kind * n:
        raise SystemExit(f"the prose holds {len(ids)} tokens: fewer than {per_kind} windows of {n}")
    docs += [("prose", f"pydoc_data.topics[{i * n}:{(i + 1) * n}]", ids[i * n:(i + 1) * n], None)
             for i in range(per_kind)]
    reused = texts.reused([(name, text) for _, name, _, text in docs if text is not None], calibration)
    if reused:
        raise SystemExit(f"evaluation documents were used for calibration: {', '.join(reused)}")
    return docs


def measure_length(lm, src, n: int, tail: int, needles: int, per_kind: int, args, work: Work) -> dict:
    import torch

    from ridgefill.evaluate.arms import plan
    from ridgefill.evaluate.measure import DocumentScore, fills
    from ridgefill.evaluate.needles import decode_and_score
    from ridgefill.runtime import exact_run
    from ridgefill.sweep.config import SweepConfig
    from ridgefill.sweep.needles import needle_suite

    arms = plan(ARMS)
    suite = needle_suite(lm, SweepConfig(length=n, long_length=0, tail=tail, needles=needles))
    rows = []
    for i, (hay, s) in enumerate(suite):
        key = f"{n}/needle/{digest(s.prompt_ids)}"  # by content: a run with other counts reuses what matches
        row = work.get(key)
        if row is None:
            t = time.perf_counter()
            run = exact_run(lm, torch.tensor(s.prompt_ids), splits=list(src.reads))
            res, _ = fills(lm, run, src, arms, tail, logits_rows=1)
            ok = decode_and_score(lm, s, [res[a] for a in ARMS])
            row = {"task": hay.task, "haystack": hay.haystack, "form": hay.form, "depth": s.depth,
                   "tokens": len(s.prompt_ids), "answers": s.answers,
                   "correct": dict(zip(ARMS, map(bool, ok))), "seconds": round(time.perf_counter() - t, 2)}
            work.put(key, row)
            del run, res
        rows.append(row)
        print(f"{n}: needle {i + 1}/{len(suite)} ({hay.label}, depth {s.depth}): "
              f"{' '.join(a + ('+' if row['correct'][a] else '-') for a in ARMS)} {row['seconds']} s", flush=True)
    drows = []
    for kind, name, ids, _ in documents(lm, n, per_kind, src.calibration):
        key = f"{n}/document/{name}/scored {args.scored}"
        row = work.get(key)
        if row is None:
            t = time.perf_counter()
            doc = DocumentScore(lm, torch.tensor(ids), tail, args.scored, splits=list(src.reads))
            res, _ = fills(lm, doc.run, src, arms[1:], tail, logits_rows=doc.keep)
            row = {"kind": kind, "name": name, "tokens": len(ids), "arms": {a: doc(res[a]) for a in FILLS},
                   "seconds": round(time.perf_counter() - t, 2)}
            work.put(key, row)
            del doc, res
        drows.append(row)
        f = row["arms"]
        print(f"{n}: document {name}: key ΔNLL ridgefill {f['ridgefill']['dnll_key']}, identity "
              f"{f['identity']['dnll_key']} ({f['ridgefill']['key_tokens']} key tokens) {row['seconds']} s", flush=True)
    return {"needles": needle_figures(rows, args), "documents": document_figures(drows, args),
            "needle_rows": rows, "document_rows": drows,
            "seconds_per_needle_prompt": round(sum(r["seconds"] for r in rows) / max(len(rows), 1), 1),
            "seconds_per_document": round(sum(r["seconds"] for r in drows) / max(len(drows), 1), 1)}


def needle_figures(rows: list[dict], args) -> dict:
    import numpy as np

    from ridgefill.numerics import paired_bootstrap
    from ridgefill.sweep.needles import FORMS, TASKS

    before = {"task": "single", "form": "chat"}  # what a row kept from before the mix was

    def pts(arm, sel=None, key="task"):
        return np.array([100.0 * r["correct"][arm] for r in rows if sel is None or r.get(key, before[key]) == sel])

    def boot(a, b):
        return paired_bootstrap(a, b, samples=args.bootstrap, seed=0) if len(a) else None

    out = {"prompts": len(rows), "accuracy": {a: float(pts(a).mean()) for a in ARMS},
           "drop": {a: boot(pts("exact"), pts(a)) for a in FILLS},
           "ridgefill_minus_identity": boot(pts("ridgefill"), pts("identity")),
           **{f"by_{key}": {h: {"prompts": int(len(pts("exact", h, key))),
                                "accuracy": {a: float(pts(a, h, key).mean()) for a in ARMS}
                                if len(pts("exact", h, key)) else None} for h in values}
              for key, values in (("task", TASKS), ("form", FORMS))}}
    return out


def document_figures(rows: list[dict], args) -> dict:
    import numpy as np

    from ridgefill.numerics import paired_bootstrap

    def pooled(sel, arm, metric, weight):
        got = [r for r in rows if sel in ("all", r["kind"]) and r["arms"][arm][metric] is not None]
        if not got:
            return None
        x = np.array([r["arms"][arm][metric] for r in got])
        w = np.array([r["arms"][arm][weight] for r in got], dtype=float)
        return paired_bootstrap(x, np.zeros(len(x)), samples=args.bootstrap, seed=0, weights=w)

    def edge(sel, metric, weight):
        got = [r for r in rows if sel in ("all", r["kind"]) and r["arms"]["ridgefill"][metric] is not None]
        if not got:
            return None
        x = np.array([r["arms"]["ridgefill"][metric] for r in got])
        y = np.array([r["arms"]["identity"][metric] for r in got])
        w = np.array([r["arms"]["ridgefill"][weight] for r in got], dtype=float)
        return paired_bootstrap(x, y, samples=args.bootstrap, seed=0, weights=w)

    out = {}
    for sel in ("all", *DOC_KINDS):
        out[sel] = {arm: {"dnll": pooled(sel, arm, "dnll", "tokens"), "dnll_key": pooled(sel, arm, "dnll_key",
                                                                                           "key_tokens"),
                          "kl": pooled(sel, arm, "kl", "tokens"), "top1": pooled(sel, arm, "top1", "tokens")}
                    for arm in FILLS}
        out[sel]["ridgefill_minus_identity"] = {"dnll": edge(sel, "dnll", "tokens"),
                                                "dnll_key": edge(sel, "dnll_key", "key_tokens")}
        out[sel]["documents"] = sum(1 for r in rows if sel in ("all", r["kind"]))
        out[sel]["key_tokens"] = sum(r["arms"]["ridgefill"]["key_tokens"] for r in rows if sel in ("all", r["kind"]))
    return out


def table(details: dict) -> str:
    def ci(v, scale=1.0, fmt="+.1f") -> str:
        if not isinstance(v, dict):
            return "–"
        return f"{v['mean'] * scale:{fmt}} [{v['low'] * scale:{fmt}}, {v['high'] * scale:{fmt}}]"

    lines = ["| length | ceiling | prompts | exact % | ridgefill %: drop [CI] | identity %: drop [CI] | "
             "ridgefill - identity [CI] | docs (key tokens) | key ΔNLL ridgefill [CI] | key ΔNLL identity [CI] | "
             "ΔNLL ridgefill | ΔNLL identity | s / prompt |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, f in details["lengths"].items():
        nd, dd = f["needles"], f["documents"]["all"]
        acc = nd["accuracy"]
        lines.append(
            f"| {int(n):,} | {details['ceiling'][n]:.2f} | {nd['prompts']} | {acc['exact']:.1f} | "
            f"{acc['ridgefill']:.1f}: {ci(nd['drop']['ridgefill'])} | {acc['identity']:.1f}: "
            f"{ci(nd['drop']['identity'])} | {ci(nd['ridgefill_minus_identity'])} | {dd['documents']} "
            f"({dd['key_tokens']}) | {ci(dd['ridgefill']['dnll_key'], fmt='.3f')} | "
            f"{ci(dd['identity']['dnll_key'], fmt='.3f')} | {ci(dd['ridgefill']['dnll'], fmt='.3f')} | "
            f"{ci(dd['identity']['dnll'], fmt='.3f')} | {f['seconds_per_needle_prompt']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
