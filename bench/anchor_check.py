"""What running row 0 (the attention sink) exactly is worth: each fill arm with the sink filled (anchor 0) and
exact (anchor 1, the runtime's default), on eval's own texts, written as JSON.

    .venv/bin/python bench/anchor_check.py MODEL RELEASE_DIR [--store ridgefill-artifacts] [--documents 8]
        [--doc-tokens 2048] [--needles 4] [--length 2048] [--tail 512] [--out bench/out/anchor.json]

Documents: KL(exact || arm) and top-1 agreement over the last 256 tokens' predictions, and the token-weighted
ΔNLL against exact, as `eval` computes them. Needles: single needles in noise filler, placed in the filled region,
answered by greedy decoding from each arm's cache (exact is the reference). The capture leaves each document's
first row out of the fit, so a map's prediction for row 0 is an extrapolation; this measures what that costs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("release", type=Path)
    ap.add_argument("--store", type=Path, default=Path("ridgefill-artifacts"))
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--needles", type=int, default=4, help="samples per depth (depths 0.1, 0.3, 0.5)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--out", type=Path, default=Path("bench/out/anchor.json"))
    args = ap.parse_args()

    import sys

    import numpy as np
    import torch

    from ridgefill.evaluate import metrics, texts
    from ridgefill.evaluate.needles import build_suite, noise_haystack, score_answer
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import greedy, load_release_maps, prefill

    torch.set_num_threads(max(1, torch.get_num_threads()))
    lm = load_model(resolve_model(args.model, store_root=args.store), store_root=args.store)
    rel = load_release_maps(lm, args.release)
    T, K = args.tail, 256
    arms = [("ridgefill", 1), ("ridgefill", 0), ("identity", 1), ("identity", 0)]
    name = lambda arm, a: f"{arm}/anchor{a}"  # noqa: E731

    docs = texts.long_documents(lm.tokenizer, args.doc_tokens, limit=args.documents)
    calib = set(rel.manifest.get("fit", {}).get("calibration_sha256", []))
    assert not texts.reused([(d.name, d.text) for d in docs], calib), "evaluation text was used for calibration"
    per: dict = {name(*a): {"kl": [], "top1": [], "dnll": []} for a in arms}
    for d in docs:
        ids = torch.tensor(d.ids[: args.doc_tokens])
        targets = ids[-K:].numpy()
        pick = slice(T - K - 1, T - 1)
        le = prefill(lm, ids, "exact", split=rel.split, tail=T).logits[pick].float().cpu().numpy()
        nll_e = metrics.token_nll(le, targets)
        for arm, a in arms:
            la = prefill(lm, ids, arm, split=rel.split, tail=T, maps=rel.maps if arm == "ridgefill" else None,
                         anchor=a).logits[pick].float().cpu().numpy()
            r = per[name(arm, a)]
            r["kl"].append(float(metrics.kl_exact_arm(le, la).mean()))
            r["top1"].append(float(metrics.top1_agree(le, la).mean()))
            r["dnll"].append(float((metrics.token_nll(la, targets) - nll_e).mean()))
        print(f"document {d.name}: " + ", ".join(f"{k} KL {v['kl'][-1]:.3f}" for k, v in per.items()), file=sys.stderr)

    chat = bool(getattr(lm.tokenizer, "chat_template", None))
    suite = build_suite(lm.tokenizer, lengths=(args.length,), depths=(0.1, 0.3, 0.5), tasks=("single",),
                        samples=args.needles, seed=0, tail=T, chat=chat, haystack=noise_haystack())
    suite = [s for s in suite if s.in_filled_region(T)]
    correct: dict = {"exact": []} | {name(*a): [] for a in arms}
    for s in suite:
        ids = torch.tensor(s.prompt_ids)
        for key, arm, a in [("exact", "exact", 1)] + [(name(*x), *x) for x in arms]:
            res = prefill(lm, ids, arm, split=rel.split, tail=T, maps=rel.maps if arm == "ridgefill" else None,
                          anchor=a)
            text = lm.tokenizer.decode(greedy(lm, res, s.max_new_tokens), skip_special_tokens=True)
            correct[key].append(bool(score_answer(s, text)))
        print(f"needle {len(correct['exact'])}/{len(suite)}: " + ", ".join(f"{k} {sum(v)}" for k, v in correct.items()),
              file=sys.stderr)

    result = {"model": args.model, "release": str(args.release), "split": rel.split, "tail": T,
              "documents": len(docs), "doc_tokens": args.doc_tokens, "needle_samples": len(suite),
              "needle_length": args.length,
              "arms": {k: {m: float(np.mean(v)) for m, v in r.items()} for k, r in per.items()},
              "needle_pct": {k: 100.0 * float(np.mean(v)) if v else None for k, v in correct.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
