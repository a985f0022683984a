"""`ridgefill compact MODEL --context FILE` and `ridgefill fold COMPACT`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import ModelArg, done, output, placed, store


@placed
def compact(
    model: ModelArg,
    context: Annotated[Path, typer.Option("--context", help="Text file: the context whose cache is compacted.")],
    budget: Annotated[float, typer.Option("--budget", help="Share of the context's keys kept per layer and KV head.")] = 0.1,
    source: Annotated[str, typer.Option("--source", help="Reference queries: repeat (a prefill repeating the context) or context.")] = "repeat",
    holdout: Annotated[float, typer.Option("--holdout", help="Held-out share of query tokens (scored, never fitted).")] = 0.2,
    cap: Annotated[int, typer.Option("--cap", help="At most this many query tokens (subsampled with --seed).")] = 4096,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    cache_dtype: Annotated[str, typer.Option("--cache-dtype", help="Cache dtype: bfloat16, float16 or float32.")] = "bfloat16",
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow the model's own code.")] = False,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """Compact a context's KV cache Attention-Matching style: top keys, fitted logit biases, refit values."""
    from ridgefill.fold import CompactConfig
    from ridgefill.fold import compact as run

    out = output()
    cfg = CompactConfig(budget=budget, source=source, holdout=holdout, cap=cap, seed=seed, dtype=cache_dtype)
    art, cached = run(store(), model, context, cfg, out, trust_remote_code=trust_remote_code, place=place)
    s = art.manifest["summary"]
    out.info(f"{s['context_tokens']} context tokens, {s['kept_per_head']} keys kept per head in layers "
             f"{s['compacted_layers']}; median held-out output error of the biased cache {s['am_held_median']:.4f}")
    done(out, "compact", art, cached)


@placed
def fold(
    compact_id: Annotated[str, typer.Argument(help="Compact artifact id (or unique prefix).")],
    rho: Annotated[float, typer.Option("--rho", help="Ridge on the query covariance (times trace/d).")] = 1e-3,
    question: Annotated[Optional[str], typer.Option("--question", help="Text after the context for the plain-cache check.")] = None,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", help="Greedy answer length of the check.")] = 24,
    model: Annotated[Optional[str], typer.Option("--model", help="The compact's model from another place (same fingerprint).")] = None,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """Fold the biases of a compacted cache into its keys: a plain cache that stock attention runs."""
    from rich.table import Table

    from ridgefill.fold import ARMS, FoldConfig
    from ridgefill.fold import fold as run

    out = output()
    cfg = FoldConfig(rho=rho, answer_tokens=answer_tokens, **({"question": question} if question is not None else {}))
    art, cached = run(store(), compact_id, cfg, out, model=model, place=place)
    s = art.manifest["summary"]
    t = Table(title=f"fold {art.id}: median output error vs the full cache ({s['heads']} heads); answer KL")
    for c in ("arm", "fit", "held-out", "worst (layer/head)", "KL", "answer = full"):
        t.add_column(c, justify="right")
    for arm in ARMS:
        w = s["worst"][arm]
        chk = s["check"].get(arm, {})
        t.add_row(arm, f"{s['median'][arm + '_fit']:.4f}", f"{s['median'][arm + '_held']:.4f}",
                  f"{w['error']:.4f} ({w['layer']}/{w['head']})", f"{chk['kl']:.4f}" if "kl" in chk else "–",
                  str(chk.get("answer_matches_full", "–")))
    out.table(t)
    out.info(f"q.u on held-out queries: median mean {s['median']['qu_mean_held']:.3f}, median spread "
             f"{s['median']['qu_std_held']:.3f}; fold within noise of AM on {s['fold_within_noise_of_am']}/{s['heads']} "
             f"heads, better than drop on {s['fold_better_than_drop']}/{s['heads']}; stock path equals the "
             f"reference computation: {s['fold_stock_equals_reference']}")
    done(out, "fold", art, cached)
