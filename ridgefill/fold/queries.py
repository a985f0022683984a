"""The model side of the fold: a context's keys/values and the reference queries that attend to them.

The fold (docs/method.md#reference-queries, docs/cache.md) compacts one context's KV cache per (layer, KV head) and fits
the compact cache on *reference queries*, the queries the model itself sends to that context (fold paper §2, §A.1).
This module runs the prefills and captures, for every attention layer `l`:

    cc = context_cache(lm, ids)                     # ids [N] -> cc.keys[l], cc.values[l]: [kv_heads, N, hd]
    rq = reference_queries(lm, ids, source="repeat")
    fit, held = rq.layers[l]                        # [kv_heads, m_fit * group, hd], [kv_heads, m_held * group, hd]
    manifest["queries"] = rq.counts()

How it captures. A forward pre-hook on each layer's `self_attn` reads the `hidden_states` and `position_embeddings`
the decoder layer passes in and recomputes q, k, v with the module's own q_proj / q_norm, k_proj / k_norm, v_proj
and the rotate-half RoPE the module applies (`Adapter.apply_rope`, the same elementwise formula), on the same
input, so the result is what the attention multiplies (tests/test_fold_queries.py checks it against the module's
output before o_proj). Keys are returned for all N rows, also on sliding-window layers whose stock cache keeps only
the last window - 1. Only the decoder (`adapter.base`) runs, not the LM head: Gemma's 262K-word head over 4K rows
would be 4 GB of logits. Queries are kept only for the requested rows, so memory is
`layers * rows * heads * head_dim * 4` bytes (Gemma 3 270M, 2K rows: 18 * 2048 * 4 * 256 * 4 = 151 MB).

Query sources:

- "context": the context prefill's own queries, rows 0..N-1.
- "repeat" (default, as in the fold paper's §A.1): a second prefill that asks the model to repeat the context. Its ids are
  spliced, not re-tokenized: `context ids + instruction ids + answer ids`, with the context at positions 0..N-1
  exactly as in the context prefill, so the answer rows' queries are queries against the very cache
  `context_cache` returns. With a chat template the instruction ids are the template's text between the user
  content and the start of the assistant reply (rendered with a sentinel in place of the context and
  `add_generation_prompt=True`), e.g. "\\n\\nRepeat the text above exactly.<|im_end|>\\n<|im_start|>assistant\\n";
  the template's opening (BOS, system prompt, user-turn marker) is left out, because it would have to precede
  the context and shift it off positions 0..N-1. Without a template: "\\n\\nRepeat the text above exactly.\\n\\n".
  The answer is the context ids again, minus a leading BOS (a second BOS mid-sequence is not what a model
  would write). The reference queries are those of the answer rows.

Pooling (docs/method.md#reference-queries): query head `h` belongs to KV head `h // group`, `group = heads // kv_heads`
(transformers' repeat_kv order). Row order within a KV head is token-major: row `i * group + j` is query head
`g * group + j` at the i-th selected token, tokens in ascending position. Fit and held-out shares are chosen by
token, so each token's `group` rows stay together.

torch is imported inside the functions (and numpy at module level): `import ridgefill.fold.queries` stays cheap.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.models.hooks import attention_inputs
from ridgefill.models.kinds import ATTENTION

SOURCES = ("repeat", "context")
INSTRUCTION = "Repeat the text above exactly."
PLAIN_SEPARATOR = "\n\n"  # around the instruction when the tokenizer has no chat template
DEFAULT_HOLDOUT = 0.2
DEFAULT_CAP = 4096  # query tokens; covers a whole 2K-4K context (the fold paper's §A.1 uses all of it), ~300 MB at most
_SENTINEL = "\ue000ridgefill-context\ue000"  # a private-use marker no template produces on its own


# -- pure helpers ------------------------------------------------------------------------------------------


def pool_heads(q, num_kv_heads: int):
    """Pool per KV head: q [rows, heads, hd] -> [kv_heads, rows * group, hd].

    Row `i * group + j` of KV head `g` is query head `g * group + j` at row `i` (token-major)."""
    rows, heads, hd = q.shape
    group = heads // num_kv_heads
    q = q.reshape(rows, num_kv_heads, group, hd)  # head h = g * group + j
    q = q.permute(1, 0, 2, 3)  # [kv_heads, rows, group, hd]
    return q.reshape(num_kv_heads, rows * group, hd)


def split_tokens(tokens, *, holdout: float, cap: int | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Choose query tokens and split them into (fit, held), both sorted ascending and disjoint.

    With more than `cap` tokens, `cap` of them are drawn first (without replacement); then a random
    `round(holdout * n)` of the n kept tokens (at least 1 when holdout > 0 and n > 1, at most n - 1) are held out.
    One `numpy.random.default_rng(seed)` draws both, so the result depends only on (tokens, holdout, cap, seed)."""
    _check_split(holdout, cap)
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    rng = np.random.default_rng(seed)
    if cap is not None and tokens.size > cap:
        tokens = np.sort(rng.choice(tokens, size=cap, replace=False))
    n = int(tokens.size)
    n_held = int(round(holdout * n))
    if holdout > 0 and n > 1:
        n_held = max(1, n_held)
    n_held = max(0, min(n_held, n - 1))
    perm = rng.permutation(n)
    return np.sort(tokens[perm[n_held:]]), np.sort(tokens[perm[:n_held]])


def _check_split(holdout, cap) -> None:
    if not (isinstance(holdout, numbers.Real) and 0 <= holdout < 1):
        raise BadInput(f"holdout must be in [0, 1) (the held-out share of query tokens), got {holdout!r}")
    if cap is not None and not (isinstance(cap, (int, np.integer)) and not isinstance(cap, bool) and cap >= 1):
        raise BadInput(f"cap must be a positive number of query tokens or None, got {cap!r}")


def _context_ids(ids):
    import torch

    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise BadInput("the context is empty: reference queries need at least one context token")
    return ids


# -- the repeat prompt -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepeatPrompt:
    """[context] + [instruction] + [answer]: context ids at 0..N-1, answer row `answer_start + i` holds
    context id `answer_skip + i` (answer_skip is 1 when the context starts with BOS, else 0)."""

    ids: Any  # torch.LongTensor [P]
    context_len: int  # N
    answer_start: int  # first answer row; the instruction is rows N..answer_start-1
    answer_skip: int  # leading context ids not repeated in the answer
    template: str  # "chat" or "plain"

    def answer_row(self, token):
        """Row of the answer that repeats context token(s) `token` (>= answer_skip)."""
        return np.asarray(token, dtype=np.int64) - self.answer_skip + self.answer_start


def instruction_ids(tokenizer) -> tuple[list[int], str]:
    """The ids between the context and its repetition, and which form they take ("chat" or "plain")."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": _SENTINEL + "\n\n" + INSTRUCTION}],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception:  # noqa: BLE001 - a template that rejects a bare user turn: use the plain form
            text = None
        if isinstance(text, str) and text.count(_SENTINEL) == 1 and INSTRUCTION in text:
            between = text.split(_SENTINEL, 1)[1]
            return list(tokenizer(between, add_special_tokens=False)["input_ids"]), "chat"
    between = PLAIN_SEPARATOR + INSTRUCTION + PLAIN_SEPARATOR
    return list(tokenizer(between, add_special_tokens=False)["input_ids"]), "plain"


def repeat_prompt(tokenizer, ids) -> RepeatPrompt:
    """Splice the repeat prompt from ids (see the module docstring); nothing is re-tokenized."""
    import torch

    ids = _context_ids(ids)
    n = int(ids.numel())
    middle, template = instruction_ids(tokenizer)
    bos = getattr(tokenizer, "bos_token_id", None)
    skip = 1 if bos is not None and int(ids[0]) == int(bos) else 0
    if skip >= n:
        raise BadInput("the context holds only a BOS token: there is nothing to repeat")
    full = torch.cat([ids, torch.tensor(middle, dtype=torch.long), ids[skip:]])  # [N + len(middle) + N - skip]
    return RepeatPrompt(ids=full, context_len=n, answer_start=n + len(middle), answer_skip=skip, template=template)


# -- capture -------------------------------------------------------------------------------------------------


def attention_layers(adapter) -> list[int]:
    """Indices of the layers that attend (all of them on the models supported here)."""
    return [l for l, kind in enumerate(adapter.layer_kinds) if kind in ATTENTION]


def _heads(proj, hidden, head_dim: int, norm):
    """hidden [1, T, d] -> proj -> [T, heads, head_dim], then the per-head norm if any (as the module does)."""
    x = proj(hidden)[0]  # [T, heads * head_dim]
    x = x.view(x.shape[0], -1, head_dim)  # [T, heads, head_dim]
    return norm(x) if norm is not None else x


def capture(lm, ids, *, query_rows: Sequence[int] | None = None, keys: bool = False) -> dict[str, dict]:
    """One prefill of `ids` [T]; per attention layer l, what its attention multiplies.

    Returns {"queries": {l: [kv_heads, len(query_rows) * group, hd]} (pooled, rows in the given order),
    "keys": {l: [kv_heads, T, hd]}, "values": {l: [kv_heads, T, hd]}}, all float32 on the CPU; queries only
    when `query_rows` is given, keys/values only when `keys`. Keys and queries are post-norm and post-RoPE.
    """
    import torch

    ad = lm.adapter
    if any(ad.is_linear(l) for l in range(ad.num_layers)):
        raise BadInput("compact and fold handle attention-only models; this one has Gated DeltaNet layers, whose "
                       "recurrent state has no rows to compact")
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    rows = None if query_rows is None else torch.as_tensor(np.asarray(query_rows, dtype=np.int64))
    if rows is not None and rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < ids.numel()):
        raise BadInput(f"query rows must lie in 0..{ids.numel() - 1}")
    out = {"queries": {}, "keys": {}, "values": {}}

    def on_input(l, attn, hidden, rope):
        hd = ad.head_dim
        cos, sin = rope[0][0], rope[1][0]  # [T, hd] each (batch 1)
        if rows is not None:
            q_norm = getattr(attn, "q_norm", None) if ad.has_qk_norm else None
            q = ad.apply_rope(_heads(attn.q_proj, hidden, hd, q_norm), cos, sin)  # [T, heads, hd]
            out["queries"][l] = pool_heads(q[rows.to(q.device)].float().cpu(), ad.num_kv_heads)
        if keys:
            k = ad.apply_rope(_heads(attn.k_proj, hidden, hd, ad.k_norm(l)), cos, sin)  # [T, kv_heads, hd]
            v = _heads(attn.v_proj, hidden, hd, None)  # [T, kv_heads, hd]
            out["keys"][l] = k.transpose(0, 1).float().cpu().contiguous()  # [kv_heads, T, hd]
            out["values"][l] = v.transpose(0, 1).float().cpu().contiguous()

    with torch.inference_mode(), attention_inputs(ad, attention_layers(ad), on_input):
        ad.base(input_ids=ids[None].to(ad.device), use_cache=False)
    return out


# -- the two entry points ----------------------------------------------------------------------------------


@dataclass
class ContextCache:
    """The context's cache as the attention sees it, per attention layer l (float32, CPU)."""

    keys: dict[int, Any]  # l -> [kv_heads, N, hd], post k-norm, post-RoPE (all N rows, sliding layers too)
    values: dict[int, Any]  # l -> [kv_heads, N, hd]
    queries: dict[int, Any] | None  # l -> [kv_heads, len(query_rows) * group, hd], or None
    query_rows: list[int]
    seconds: float = 0.0


def context_cache(lm, ids, *, query_rows: Sequence[int] | None = None) -> ContextCache:
    """Prefill the context ids [N] and return its keys and values per attention layer.

    `query_rows` (e.g. `range(N)`) also returns the context's own pooled queries at those rows, in that order,
    for the price of one q_proj per layer."""
    start = time.perf_counter()
    ids = _context_ids(ids)
    got = capture(lm, ids, query_rows=query_rows, keys=True)
    return ContextCache(
        keys=got["keys"],
        values=got["values"],
        queries=got["queries"] if query_rows is not None else None,
        query_rows=[int(r) for r in query_rows] if query_rows is not None else [],
        seconds=time.perf_counter() - start,
    )


@dataclass
class ReferenceQueries:
    """Pooled reference queries per attention layer, split by token into fit and held-out shares."""

    layers: dict[int, tuple[Any, Any]]  # l -> (fit [kv, m_fit * group, hd], held [kv, m_held * group, hd])
    source: str
    fit_tokens: list[int]  # context positions (0..N-1) whose queries are in `fit`, ascending
    held_tokens: list[int]
    group: int  # query heads per KV head: rows per token
    context_len: int
    prompt_len: int  # length of the prefill the queries came from
    template: str | None = None  # repeat source: "chat" or "plain"
    seconds: float = 0.0

    def counts(self) -> dict:
        """What the artifact manifest records about the queries (docs/cache.md#manifests)."""
        return {
            "source": self.source,
            "template": self.template,
            "context_tokens": self.context_len,
            "prompt_tokens": self.prompt_len,
            "tokens": len(self.fit_tokens) + len(self.held_tokens),
            "fit": len(self.fit_tokens),
            "held": len(self.held_tokens),
            "group": self.group,
        }


def reference_queries(
    lm,
    ids,
    source: str = "repeat",
    holdout: float = DEFAULT_HOLDOUT,
    cap: int | None = DEFAULT_CAP,
    seed: int = 0,
) -> ReferenceQueries:
    """Reference queries for the context ids [N] from `source` ("repeat" or "context"), split fit / held-out.

    Query tokens are context positions: for "context" all of 0..N-1, for "repeat" the repeated ones
    (answer_skip..N-1). `split_tokens` caps and splits them (same tokens for every layer and head); the
    queries are read at those positions of the context prefill, or at the answer rows repeating them.
    """
    if source not in SOURCES:
        raise BadInput(f"unknown query source '{source}' (choose one of: {', '.join(SOURCES)})")
    _check_split(holdout, cap)
    start = time.perf_counter()
    ids = _context_ids(ids)
    n = int(ids.numel())
    if source == "repeat":
        prompt = repeat_prompt(lm.tokenizer, ids)
        prefill, template = prompt.ids, prompt.template
        tokens = np.arange(prompt.answer_skip, n)
        to_rows = prompt.answer_row
    else:
        prefill, template = ids, None
        tokens = np.arange(n)
        to_rows = np.asarray
    limit = lm.context_length()
    if limit and prefill.numel() > limit:
        raise BadInput(
            f"the {source} prefill has {prefill.numel()} tokens, more than the model's {limit} positions "
            "(use a shorter context or source 'context')"
        )
    fit, held = split_tokens(tokens, holdout=holdout, cap=cap, seed=seed)
    chosen = np.concatenate([fit, held])
    got = capture(lm, prefill, query_rows=to_rows(chosen))["queries"]
    group = lm.adapter.num_heads // lm.adapter.num_kv_heads
    m_fit = len(fit) * group
    layers = {}
    for l, q in got.items():  # q [kv, (m_fit + m_held) * group, hd]; token-major, so the split is a slice
        layers[l] = (q[:, :m_fit].contiguous(), q[:, m_fit:].contiguous())
    return ReferenceQueries(
        layers=layers,
        source=source,
        fit_tokens=[int(t) for t in fit],
        held_tokens=[int(t) for t in held],
        group=group,
        context_len=n,
        prompt_len=int(prefill.numel()),
        template=template,
        seconds=time.perf_counter() - start,
    )
