"""What running row 0 (the attention sink) exactly is worth (figure "anchor"): each fill arm with the sink filled
(anchor 0) and exact (anchor 1, the runtime's default), on eval's own texts.

    .venv/bin/python bench/anchor_check.py MODEL RELEASE_DIR [--documents 8] [--doc-tokens 2048] [--needles 4]
        [--length 2048] [--tail 512] [--no-norm-rows] [--store DIR] [--out FILE]

Documents: KL(exact || arm) and top-1 agreement over the last 256 tail tokens' predictions, and the token-weighted
ΔNLL against exact, as `eval` computes them. Needles: single needles in noise filler, placed in the filled region,
answered by greedy decoding from each arm's cache (exact is the reference). The capture leaves each document's
first row out of the fit, so a map's prediction for row 0 is an extrapolation; this measures what that costs.
The runtime also runs exactly every prefix row whose split state's norm exceeds the release's exact-row norm
(`fit.exact_norm`), which usually catches the sink as well: `--no-norm-rows` turns that rule off, so that anchor 0
really fills row 0. Value: each arm's mean KL; the details have top-1, ΔNLL and needle accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench, load, parser, positive, release  # noqa: E402

SCORED = 256  # tail tokens whose predictions are compared


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("release", type=release)
    ap.add_argument("--documents", type=positive, default=8)
    ap.add_argument("--doc-tokens", type=positive, default=2048)
    ap.add_argument("--needles", type=positive, default=4, help="samples per depth (depths 0.1, 0.3, 0.5)")
    ap.add_argument("--length", type=positive, default=2048)
    ap.add_argument("--tail", type=positive, default=512)
    ap.add_argument("--no-norm-rows", action="store_true",
                    help="run no prefix row exactly for its norm (default: those above the release's exact-row norm)")
    args = ap.parse_args()
    if not SCORED < args.tail < min(args.doc_tokens, args.length):
        ap.error(f"need {SCORED} < --tail ({args.tail}) < --doc-tokens and --length")

    with Bench("anchor", args, args.model) as bench:
        import numpy as np
        import torch

        from ridgefill.evaluate import metrics, texts
        from ridgefill.evaluate.needles import build_suite, noise_haystack, score_answer
        from ridgefill.runtime import greedy, load_release_maps, prefill

        _, lm = load(args.model, bench.store)
        rel = load_release_maps(lm, args.release)
        T, K = args.tail, SCORED
        exact_norm = None if args.no_norm_rows else rel.exact_norm
        arms = [("ridgefill", 1), ("ridgefill", 0), ("identity", 1), ("identity", 0)]
        name = lambda arm, a: f"{arm}/anchor{a}"  # noqa: E731

        def run(ids, arm, anchor):
            return prefill(lm, ids, arm, split=rel.split, tail=T, maps=rel.maps if arm == "ridgefill" else None,
                           anchor=anchor, exact_norm=exact_norm)

        docs = texts.long_documents(lm.tokenizer, args.doc_tokens, limit=args.documents)
        calib = set(rel.manifest.get("fit", {}).get("calibration_sha256", []))
        reused = texts.reused([(d.name, d.text) for d in docs], calib)
        if reused:
            raise SystemExit(f"anchor_check.py: error: evaluation text was used for calibration: {', '.join(reused)}")
        per: dict = {name(*a): {"kl": [], "top1": [], "dnll": []} for a in arms}
        for d in docs:
            ids = torch.tensor(d.ids[: args.doc_tokens])
            targets = ids[-K:].numpy()
            pick = slice(T - K - 1, T - 1)
            le = prefill(lm, ids, "exact", split=rel.split, tail=T).logits[pick].float().cpu().numpy()
            nll_e = metrics.token_nll(le, targets)
            for arm, a in arms:
                la = run(ids, arm, a).logits[pick].float().cpu().numpy()
                r = per[name(arm, a)]
                r["kl"].append(float(metrics.kl_exact_arm(le, la).mean()))
                r["top1"].append(float(metrics.top1_agree(le, la).mean()))
                r["dnll"].append(float((metrics.token_nll(la, targets) - nll_e).mean()))
            print(f"document {d.name}: " + ", ".join(f"{k} KL {v['kl'][-1]:.3f}" for k, v in per.items()),
                  file=sys.stderr)

        chat = bool(getattr(lm.tokenizer, "chat_template", None))
        suite = build_suite(lm.tokenizer, lengths=(args.length,), depths=(0.1, 0.3, 0.5), tasks=("single",),
                            samples=args.needles, seed=0, tail=T, chat=chat, haystack=noise_haystack())
        suite = [s for s in suite if s.in_filled_region(T)]
        correct: dict = {"exact": []} | {name(*a): [] for a in arms}
        for s in suite:
            ids = torch.tensor(s.prompt_ids)
            for key, arm, a in [("exact", "exact", 1)] + [(name(*x), *x) for x in arms]:
                res = run(ids, arm, a)
                text = lm.tokenizer.decode(greedy(lm, res, s.max_new_tokens), skip_special_tokens=True)
                correct[key].append(bool(score_answer(s, text)))
            counts = ", ".join(f"{k} {sum(v)}" for k, v in correct.items())
            print(f"needle {len(correct['exact'])}/{len(suite)}: {counts}", file=sys.stderr)

        means = {k: {m: float(np.mean(v)) for m, v in r.items()} for k, r in per.items()}
        details = {"release": str(args.release), "split": rel.split, "tail": T, "scored": K,
                   "exact_norm": exact_norm, "documents": len(docs), "doc_tokens": args.doc_tokens,
                   "needle_samples": len(suite), "needle_length": args.length, "arms": means,
                   "needle_pct": {k: 100.0 * float(np.mean(v)) if v else None for k, v in correct.items()}}
        bench.finish({k: float(f"{v['kl']:.4g}") for k, v in means.items()}, details=details)


if __name__ == "__main__":
    main()
