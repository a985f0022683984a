"""`ridgefill solve CAPTURE`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ridgefill.cli.common import DEFAULT_STORE, DebugOpt, JsonOpt, StoreOpt, done, output, store


def solve(
    capture: Annotated[str, typer.Argument(help="Capture artifact id (or unique prefix).")],
    model: Annotated[Optional[str], typer.Option("--model", help="Model to score with (default: the captured one; must match it).")] = None,
    split: Annotated[Optional[int], typer.Option("--split", help="Which captured split to solve.")] = None,
    alpha: Annotated[Optional[list[float]], typer.Option("--alpha", help="Alpha grid (repeatable). Default 1e-5 ... 1.")] = None,
    metric: Annotated[str, typer.Option("--metric", help="Held-out selection metric: kv (K/V cosine) or input (input cosine).")] = "kv",
    chat_share: Annotated[Optional[float], typer.Option("--chat-share", help="Weight of chat-template rows when the capture has them.")] = None,
    store_root: StoreOpt = DEFAULT_STORE,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Fit ridge maps for every late layer over the alpha grid; choose alpha on held-out rows."""
    from rich.table import Table

    from ridgefill.solve.run import solve as run

    out = output(json)
    art, cached = run(store(store_root), capture, out, model=model, split=split, alphas=alpha, metric=metric,
                      chat_share=chat_share)
    s = art.manifest["summary"]
    t = Table(title=f"split {s['split']}: alpha {s['alpha']:g} (held-out means)")
    for c in ("fill", "K cos", "V cos", "input cos", "rel. sq. err", "expl. var"):
        t.add_column(c)
    for name in ("fitted", "identity"):
        m = s[name]
        t.add_row(name, *(f"{m[k]:.4f}" for k in ("k_cosine", "v_cosine", "input_cosine", "rel_se", "explained_var")))
    out.table(t)
    done(out, "solve", art, cached)
