"""What the engine tests compare an engine with: the reference runtime's greedy answer after a prefill and its own
top-2 margin at every position, and how far an engine's outputs are from it (test_engines.py, test_vllm_plugin*.py,
bench/vllm_agreement.py)."""

from __future__ import annotations

import numpy as np

NEAR_TIE = 0.05  # nats: the reference's own top-2 margin below which parting ways is a near-tie


def margin(logits) -> float:
    """The log-probability margin of the top-1 token over the second."""
    lp = logits.double().log_softmax(-1)
    top = lp.topk(2).values
    return float(top[0] - top[1])


def reference_path(lm, first_logits, cache, start: int, new: int):
    """The reference's greedy answer (`new` tokens + the next top-1) and its top-2 margin at each position, decoded
    one token at a time by the stock model on a copy of `cache` (positions start, start+1, ...)."""
    import torch

    from ridgefill.runtime.cache import cache_copy

    answer = [int(first_logits.argmax())]
    rows = [first_logits.float()]
    c = cache_copy(cache, len(cache.layers))
    with torch.no_grad():
        for _ in range(new):  # one token at a time: greedy must see its own previous choice
            o = lm.model(input_ids=torch.tensor([[answer[-1]]]), position_ids=torch.tensor([[start]]), cache=c)
            c, start = o.cache, start + 1
            rows.append(o.logits[0, -1].float())
            answer.append(int(rows[-1].argmax()))
    return answer, [margin(r) for r in rows]


def reference(lm, ids, arm: str, new: int, **options) -> dict:
    """The reference's greedy answer (`new` tokens) and margins after a prefill of the whole prompt, and its exact
    prefix rows."""
    import torch

    from ridgefill.runtime import prefill

    res = prefill(lm, torch.tensor(ids), arm, **options)
    answer, margins = reference_path(lm, res.logits[-1], res.cache, len(ids), new)
    return {"top1": answer, "margin": margins, "exact_rows": len(res.exact_rows)}


def agreement(outputs: list, refs: dict) -> dict:
    """Each output against the reference of its prompt: first token, first margin, greedy answer."""
    firsts = ties = misses = greedy = 0
    worst = 0.0
    for out in outputs:
        ref = refs[out["prompt"]]
        (t1, l1), (_, l2) = out["top2"][0]
        if t1 == ref["top1"][0]:
            firsts += 1
            worst = max(worst, abs((l1 - l2) - ref["margin"][0]))
        tokens, want = out["tokens"], ref["top1"][: len(out["tokens"])]
        if tokens == want:
            greedy += 1
            continue
        part = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
        if ref["margin"][part] < NEAR_TIE:
            ties += 1
        else:
            misses += 1
    return {"prompts": len(outputs), "first_token_equal": firsts, "first_margin_max_diff": worst,
            "greedy_equal": greedy, "near_ties": ties, "misses": misses}  # fmt: skip


def distance(outputs: list, refs: dict) -> dict:
    """How far an engine's outputs are from references: first tokens and greedy answers equal, and the first-token
    margin's and every step's margin's absolute differences (mean and max, the steps up to each answer's first
    difference)."""
    first, steps = [], []
    for out in outputs:
        ref = refs[out["prompt"]]
        for i, ((t1, l1), (_, l2)) in enumerate(out["top2"]):
            if out["tokens"][:i] != ref["top1"][:i] or t1 != ref["top1"][i]:
                break
            (first if i == 0 else steps).append(abs((l1 - l2) - ref["margin"][i]))
    fig = agreement(outputs, refs)
    return {"first_token_equal": fig["first_token_equal"], "greedy_equal": fig["greedy_equal"],
            "first_margin_mean_diff": float(np.mean(first)), "first_margin_max_diff": float(np.max(first)),
            "margin_mean_diff": float(np.mean(first + steps)), "margin_max_diff": float(np.max(first + steps))}
