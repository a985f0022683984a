"""Tests for ridgefill.fold.queries: context keys/values and reference queries, on the tiny random models.

References are independent of the module: the stock DynamicCache from `model(ids, use_cache=True)`, keys rebuilt
from `output_hidden_states` through `Adapter.kv` + RoPE, and the attention module's own output before o_proj
(captured by a hook), recomputed in float64 from the captured queries, keys and values.
"""

import copy

import numpy as np
import pytest
import torch

from ridgefill.errors import BadInput
from ridgefill.fold.queries import (
    INSTRUCTION,
    capture,
    context_cache,
    pool_heads,
    reference_queries,
    repeat_prompt,
    split_tokens,
)
from conftest import TINY_FIXTURES

ALL = [a for a in TINY_FIXTURES if a not in ("qwen3_next", "qwen3_5")]  # compact and fold refuse the hybrids
N = 20  # Gemma's tiny config has sliding_window=8, so 20 rows slide
pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def stock_cache(lm, ids):
    with torch.no_grad():
        out = lm.model(input_ids=ids[None], use_cache=True)
    cache = getattr(out, "cache", None)  # transformers 5 names it `cache`, 4.x `past_key_values`
    return cache if cache is not None else out.past_key_values


# -- keys and values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL)
def test_context_cache_equals_stock_cache_and_recomputation(lm_of, arch):
    lm = lm_of(arch)
    ad = lm.adapter
    ids = tokens(N)
    cc = context_cache(lm, ids)
    cache = stock_cache(lm, ids)
    with torch.no_grad():
        hs = lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states  # L+1 x [1, N, d]
    window = lm.model.config.sliding_window if arch == "gemma3_text" else None
    assert sorted(cc.keys) == list(range(ad.num_layers))
    for l in range(ad.num_layers):
        keys, values = cc.keys[l], cc.values[l]
        assert keys.shape == values.shape == (ad.num_kv_heads, N, ad.head_dim)
        assert keys.dtype == values.dtype == torch.float32
        stock_k, stock_v = cache.layers[l].keys[0], cache.layers[l].values[0]  # [kv, kept, hd]
        kept = stock_k.shape[1]
        if ad.layer_kinds[l] == "sliding_attention":
            assert kept == window - 1 < N  # the stock cache dropped old rows; we still return all N
        else:
            assert kept == N
        torch.testing.assert_close(keys[:, N - kept :], stock_k.float(), rtol=0, atol=0)
        torch.testing.assert_close(values[:, N - kept :], stock_v.float(), rtol=0, atol=0)
        # All N rows against an independent path: input norm, k_proj, k_norm (Adapter.kv), then RoPE.
        k, v = ad.kv(l, hs[l][0])  # [N, kv, hd]
        cos, sin = ad.rotary(torch.arange(N), layer=l)
        torch.testing.assert_close(keys, ad.apply_rope(k, cos, sin).transpose(0, 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values, v.transpose(0, 1), rtol=1e-5, atol=1e-6)


# -- queries -----------------------------------------------------------------------------------------------


def unpool(pooled, heads):
    """[kv, rows * group, hd] -> [rows, heads, hd], inverting pool_heads's documented order."""
    kv, m, hd = pooled.shape
    group = heads // kv
    return pooled.reshape(kv, m // group, group, hd).permute(1, 0, 2, 3).reshape(m // group, heads, hd)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_queries_reproduce_attention_output(lm_of, arch):
    """softmax(s q k^T + mask) v from the captured q, k, v equals the module's output before o_proj."""
    lm = lm_of(arch)
    ad = lm.adapter
    assert getattr(lm.model.config, "attn_logit_softcapping", None) is None
    ids = tokens(N, seed=1)
    attn_out = {}
    handles = [
        ad.attn(l).o_proj.register_forward_pre_hook(lambda m, args, l=l: attn_out.__setitem__(l, args[0][0]))
        for l in range(ad.num_layers)
    ]
    try:
        with torch.no_grad():
            lm.model(input_ids=ids[None])
    finally:
        for h in handles:
            h.remove()
    cc = context_cache(lm, ids, query_rows=range(N))
    group = ad.num_heads // ad.num_kv_heads
    pos = torch.arange(N)
    kinds = set()
    for l in range(ad.num_layers):
        q = unpool(cc.queries[l], ad.num_heads).double()  # [N, heads, hd]
        allowed = pos[None, :] <= pos[:, None]
        if ad.layer_kinds[l] == "sliding_attention":
            allowed &= pos[:, None] - pos[None, :] < lm.model.config.sliding_window
        kinds.add(ad.layer_kinds[l])
        for h in range(ad.num_heads):
            k, v = cc.keys[l][h // group].double(), cc.values[l][h // group].double()  # [N, hd]
            logits = ad.attention_scaling(l) * q[:, h] @ k.T  # [N, N]
            logits = logits.masked_fill(~allowed, float("-inf"))
            expect = torch.softmax(logits, dim=-1) @ v  # [N, hd]
            got = attn_out[l][:, h * ad.head_dim : (h + 1) * ad.head_dim].double()
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    if arch == "gemma3_text":
        assert kinds == {"full_attention", "sliding_attention"}


def test_pool_heads_order():
    rows, heads, kv, hd = 3, 6, 2, 4
    q = torch.zeros(rows, heads, hd)
    for t in range(rows):
        for h in range(heads):
            q[t, h] = 100 * h + t
    pooled = pool_heads(q, kv)
    group = heads // kv
    assert pooled.shape == (kv, rows * group, hd)
    for g in range(kv):
        for t in range(rows):
            for j in range(group):
                assert torch.all(pooled[g, t * group + j] == 100 * (g * group + j) + t)
    torch.testing.assert_close(unpool(pooled, heads), q, rtol=0, atol=0)


def test_capture_rows_are_the_requested_positions(lm_of):
    lm = lm_of("qwen2")
    ids = tokens(N, seed=2)
    every = capture(lm, ids, query_rows=range(N))["queries"]
    some = capture(lm, ids, query_rows=[7, 2, 15])["queries"]
    group = lm.adapter.num_heads // lm.adapter.num_kv_heads
    for l, q in some.items():
        full = every[l].reshape(lm.adapter.num_kv_heads, N, group, -1)
        torch.testing.assert_close(q, full[:, [7, 2, 15]].reshape(q.shape), rtol=0, atol=0)


# -- the repeat prompt -------------------------------------------------------------------------------------


def test_repeat_prompt_chat_layout(lm_of):
    tok = lm_of("llama").tokenizer
    ids = tokens(N, seed=3)
    p = repeat_prompt(tok, ids)
    assert p.template == "chat" and p.answer_skip == 0 and p.context_len == N
    assert torch.equal(p.ids[:N], ids)
    assert torch.equal(p.ids[p.answer_start :], ids)
    between = tok.decode(p.ids[N : p.answer_start].tolist())
    assert between == "\n\n" + INSTRUCTION + "</s><|assistant|>"  # the tiny template's reply opener
    assert np.array_equal(p.answer_row([0, 5]), [p.answer_start, p.answer_start + 5])


def test_repeat_prompt_plain_and_bos(lm_of):
    tok = copy.deepcopy(lm_of("llama").tokenizer)
    tok.chat_template = None
    ids = torch.cat([torch.tensor([tok.bos_token_id]), tokens(N - 1, seed=4)])
    p = repeat_prompt(tok, ids)
    assert p.template == "plain" and p.answer_skip == 1
    assert torch.equal(p.ids[:N], ids)
    assert torch.equal(p.ids[p.answer_start :], ids[1:])  # the answer does not repeat BOS
    assert tok.decode(p.ids[N : p.answer_start].tolist()) == "\n\n" + INSTRUCTION + "\n\n"
    with pytest.raises(BadInput, match="only a BOS"):
        repeat_prompt(tok, ids[:1])


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_repeat_queries_attend_to_the_context_cache(lm_of, arch):
    """The repeat prefill's keys at 0..N-1 are the context cache's, and its answer rows' queries are the ones
    reference_queries returns (fit and held, in token order)."""
    lm = lm_of(arch)
    ids = tokens(N, seed=5)
    p = repeat_prompt(lm.tokenizer, ids)
    cc = context_cache(lm, ids)
    rq = reference_queries(lm, ids, source="repeat", holdout=0.25, seed=3)
    assert rq.prompt_len == p.ids.numel() and rq.template == p.template
    rows = p.answer_row(rq.fit_tokens + rq.held_tokens)
    direct = capture(lm, p.ids, query_rows=rows, keys=True)
    m_fit = len(rq.fit_tokens) * rq.group
    for l, (fit, held) in rq.layers.items():
        torch.testing.assert_close(direct["keys"][l][:, :N], cc.keys[l], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(direct["values"][l][:, :N], cc.values[l], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fit, direct["queries"][l][:, :m_fit], rtol=0, atol=0)
        torch.testing.assert_close(held, direct["queries"][l][:, m_fit:], rtol=0, atol=0)


# -- splits, counts, refusals ------------------------------------------------------------------------------


def test_split_tokens_disjoint_deterministic_capped():
    fit, held = split_tokens(np.arange(100), holdout=0.2, cap=None, seed=0)
    assert len(fit) == 80 and len(held) == 20 and not set(fit) & set(held)
    assert sorted(set(fit) | set(held)) == list(range(100))
    assert list(fit) == sorted(fit) and list(held) == sorted(held)
    again = split_tokens(np.arange(100), holdout=0.2, cap=None, seed=0)
    assert np.array_equal(again[0], fit) and np.array_equal(again[1], held)
    other = split_tokens(np.arange(100), holdout=0.2, cap=None, seed=1)
    assert not np.array_equal(other[1], held)
    fit, held = split_tokens(np.arange(100), holdout=0.2, cap=30, seed=0)
    assert len(fit) + len(held) == 30 and len(held) == 6 and not set(fit) & set(held)
    assert split_tokens([4], holdout=0.5, cap=None, seed=0)[1].size == 0  # the only token is fitted
    assert split_tokens(np.arange(3), holdout=0.1, cap=None, seed=0)[1].size == 1  # holdout > 0 holds one
    assert split_tokens(np.arange(10), holdout=0.0, cap=None, seed=0)[1].size == 0


@pytest.mark.parametrize("source", ["context", "repeat"])
def test_reference_queries_shapes_counts(lm_of, source):
    lm = lm_of("qwen3")
    ad = lm.adapter
    ids = tokens(N, seed=6)
    rq = reference_queries(lm, ids, source=source, holdout=0.3, cap=10, seed=7)
    group = ad.num_heads // ad.num_kv_heads
    assert rq.counts() == {
        "source": source,
        "template": "chat" if source == "repeat" else None,
        "context_tokens": N,
        "prompt_tokens": rq.prompt_len,
        "tokens": 10,
        "fit": 7,
        "held": 3,
        "group": group,
    }
    assert not set(rq.fit_tokens) & set(rq.held_tokens)
    assert sorted(rq.layers) == list(range(ad.num_layers))
    for fit, held in rq.layers.values():
        assert fit.shape == (ad.num_kv_heads, 7 * group, ad.head_dim) and fit.dtype == torch.float32
        assert held.shape == (ad.num_kv_heads, 3 * group, ad.head_dim)
    again = reference_queries(lm, ids, source=source, holdout=0.3, cap=10, seed=7)
    assert again.fit_tokens == rq.fit_tokens and again.held_tokens == rq.held_tokens
    if source == "context":  # the context source reads rows 0..N-1 of the context prefill
        cc = context_cache(lm, ids, query_rows=rq.fit_tokens)
        for l, (fit, _) in rq.layers.items():
            torch.testing.assert_close(fit, cc.queries[l], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "echo"}, "unknown query source 'echo' \\(choose one of: repeat, context\\)"),
        ({"holdout": 1.0}, "holdout must be in \\[0, 1\\)"),
        ({"holdout": -0.1}, "holdout must be in \\[0, 1\\)"),
        ({"cap": 0}, "cap must be a positive number of query tokens or None"),
        ({"ids": []}, "the context is empty"),
    ],
)
def test_reference_queries_refusals(lm_of, kwargs, message):
    lm = lm_of("llama")
    ids = kwargs.pop("ids", tokens(N))
    with pytest.raises(BadInput, match=message):
        reference_queries(lm, ids, **kwargs)


def test_repeat_prompt_longer_than_the_model_refused(lm_of):
    lm = lm_of("llama")
    ids = tokens(lm.model.config.max_position_embeddings // 2 + 10)
    with pytest.raises(BadInput, match="more than the model's 256 positions"):
        reference_queries(lm, ids, source="repeat")
