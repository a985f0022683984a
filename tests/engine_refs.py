"""What the engine tests compare an engine with: the reference runtime's greedy answer after a prefill and its own
top-2 margin at every position (test_engines.py, test_vllm_plugin.py)."""

from __future__ import annotations


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
