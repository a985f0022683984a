"""The plain-cache check of `ridgefill fold` (issue: "a folded cache runs on stock attention").

The folded cache is loaded into transformers' own `DynamicCache` and a question that follows the context is fed
through the stock model, one token at a time, at positions N, N+1, ... after the original context length: no
bias, no custom mask (a single new token attends to every cached entry, which is what a compacted cache means).
Arms: **full** (the context's whole cache, stock path), **am** (the biased compacted cache: it needs a logit bias,
so it runs on the reference runtime `SlotCache`), **fold** (stock path), **drop** (stock path, beta removed,
values refit). Figures: per-token KL(full || arm) over the full arm's greedy answer (teacher-forced), and each
arm's own greedy answer. The fold also runs on `SlotCache` with no bias (its reference computation): its greedy
tokens through the stock path must be the same, or the fold fails (`RidgefillError`, exit 1) before anything
is written: a folded cache that stock attention does not run as computed is not a plain cache.
"""

from __future__ import annotations

import numpy as np

from ridgefill.errors import RidgefillError
from ridgefill.numerics import log_softmax
from ridgefill.output import Output


class _Stock:
    """Stock decoding from a DynamicCache built from per-layer keys/values, at positions from `next_position`."""

    def __init__(self, lm, layers: list[dict], next_position: int):
        import torch
        from transformers import DynamicCache

        ad = lm.adapter
        self.lm, self.p = lm, next_position
        self.cache = DynamicCache(config=lm.model.config)
        for l, d in enumerate(layers):  # each layer's cache on the device that layer computes on
            dev = ad.layer_device(l)
            k = torch.as_tensor(d["keys"], dtype=ad.dtype).to(dev)[None]  # [1, kv_heads, n, hd]
            self.cache.update(k, torch.as_tensor(d["values"], dtype=ad.dtype).to(dev)[None], l)

    def step(self, token: int):
        import torch

        dev = self.lm.adapter.device
        with torch.inference_mode():
            o = self.lm.model(input_ids=torch.tensor([[token]], device=dev), position_ids=torch.tensor([[self.p]], device=dev),
                              cache=self.cache, use_cache=True)  # fmt: skip
        self.cache, self.p = o.cache, self.p + 1
        return o.logits[0, -1].float()


def _layers(cache: dict, n_layers: int, bias: bool) -> list[dict]:
    out = []
    for l in range(n_layers):
        d = cache[l]
        out.append({"keys": d["keys"], "values": d["values"], "positions": d["positions"],
                    "bias": d.get("beta") if bias else None})  # fmt: skip
    return out


def _run(make, question: list[int], forced: list[int] | None, max_new: int, eos) -> tuple[list[int], np.ndarray | None]:
    """Feed the question; then either the forced answer (returning the logits that predict each of its tokens,
    [len(forced), vocab]) or greedy tokens (returning them)."""
    c = make()
    for t in question:
        logits = c.step(t)
    if forced is not None:
        rows = [logits.float().cpu().numpy()]
        for t in forced[:-1]:
            rows.append(c.step(t).float().cpu().numpy())
        return forced, np.stack(rows)
    toks = []
    nxt = int(logits.argmax())
    while len(toks) < max_new and nxt != eos:
        toks.append(nxt)
        nxt = int(c.step(nxt).argmax())
    return toks, None


def plain_cache_check(lm, ids, cc, biased: dict, folded: dict, drop: dict, cfg, out: Output) -> dict:
    from ridgefill.runtime import SlotCache

    n, L = int(len(ids)), lm.adapter.num_layers
    full = {l: {"keys": cc.keys[l].cpu().numpy(), "values": cc.values[l].cpu().numpy(),
                "positions": np.broadcast_to(np.arange(n), cc.keys[l].shape[:2])} for l in range(L)}  # fmt: skip
    makers = {
        "full": lambda: _Stock(lm, _layers(full, L, False), n),
        "am": lambda: SlotCache(lm, _layers(biased, L, True), n),
        "fold": lambda: _Stock(lm, _layers(folded, L, False), n),
        "drop": lambda: _Stock(lm, _layers(drop, L, False), n),
        "fold_reference": lambda: SlotCache(lm, _layers(folded, L, False), n),
    }
    tok = lm.tokenizer
    question = list(tok(cfg.question, add_special_tokens=False)["input_ids"])
    eos = tok.eos_token_id
    out.info(f"plain-cache check: a {len(question)}-token question after the {n}-token context, {cfg.answer_tokens}-token answers")
    answer, _ = _run(makers["full"], question, None, cfg.answer_tokens, eos)
    if not answer:  # the model ends at once: score the end-of-sequence token itself
        answer = [eos]
    result = {"question": cfg.question, "question_tokens": len(question), "context_tokens": n, "arms": {}}
    full_lp = None
    with out.progress("check", total=len(makers)) as bar:
        for i, (arm, make) in enumerate(makers.items()):
            _, logits = _run(make, question, answer, 0, eos)
            lp = log_softmax(logits)
            own = answer if arm == "full" else _run(make, question, None, cfg.answer_tokens, eos)[0]
            row = {"answer": tok.decode(own, skip_special_tokens=True), "answer_ids": own,
                   "answer_matches_full": own == answer}
            if arm == "full":
                full_lp = lp
            else:
                row["kl"] = float(np.mean(np.sum(np.exp(full_lp) * (full_lp - lp), axis=-1)))
                row["top1"] = float(np.mean(lp.argmax(-1) == full_lp.argmax(-1)))
            if arm == "fold_reference":
                row["max_logprob_diff_vs_fold"] = float(np.abs(lp - result["arms"]["fold"]["_lp"]).max())
            result["arms"][arm] = row | ({"_lp": lp} if arm == "fold" else {})
            bar.update(i + 1, None, arm)
    result["arms"]["fold"].pop("_lp")
    stock, ref = result["arms"]["fold"], result["arms"]["fold_reference"]
    result["fold_stock_equals_reference"] = stock["answer_ids"] == ref["answer_ids"]
    if not result["fold_stock_equals_reference"]:
        raise RidgefillError(f"the folded cache answers {stock['answer']!r} through the stock attention path but "
                             f"{ref['answer']!r} through the reference computation (SlotCache; largest log-prob "
                             f"difference {ref['max_logprob_diff_vs_fold']:.3g}): it is not a plain cache; nothing "
                             f"written")  # fmt: skip
    return result
