"""The fill's plan for one serving-engine step, decided token by token (docs/engines.md, "Serving a release with
vLLM"). numpy only: the engine-free part of the vLLM plugin, unit-tested without an engine.

An engine step schedules, for each request, a run of consecutive positions: a whole prompt, one chunk of it, the
rest of a prompt whose start came from the prefix cache, or decode tokens. For a request whose prompt has N tokens,
a release with a tail of T and an anchor of A rows, a scheduled token at position p is

    a prefix row   if A <= p < N - T   filled, unless the exact-row rule runs it (decided on its own split state)
    an exact row   otherwise           the anchor, the tail, and every token after the prompt (decode)

(the row rule of `ridgefill.runtime.rows`, the reference runtime's own)

and a request served exactly (one that asks for prompt log-probabilities, which need every row's logits) has no
prefix rows. Whether a row fills depends only on its position, N and its own split state, never on how the prompt
was cut into steps: a prompt prefilled in one step, in chunks of any size, beside other requests, or again after
preemption writes the same keys and values as the reference runtime's prefill of the whole prompt.

The late layers run only the exact rows. An attention kernel takes, per sequence, a contiguous run of query rows
whose last row sits at the sequence's last key, so the exact rows of a step become `Runs`: each maximal run of
consecutive scheduled tokens of one request that are exact is a sequence of its own (the request's block table
row, `seq_len` = its last position + 1), so that every exact row attends to exactly the positions before it,
filled or not.

`prefix_rows_in_block` is the plan's part of a prefix-cache block's identity: how many of the block's rows were
prefix rows of the request that computed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ridgefill.runtime.rows import is_prefix_row, prefix_end


def token_positions(query_start: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, request) of every scheduled token: query_start [R + 1] (token offsets of each request's rows),
    seq_lens [R] (each request's length once this step's tokens are in). Both int64 [num_tokens]."""
    query_start = np.asarray(query_start, np.int64)
    q_lens = np.diff(query_start)
    owner = np.repeat(np.arange(q_lens.shape[0]), q_lens)
    first = np.asarray(seq_lens, np.int64) - q_lens  # the position of each request's first scheduled token
    return np.arange(query_start[-1]) - query_start[owner] + first[owner], owner


def prefix_rows(query_start, seq_lens, prompt_lens, exact_requests, *, tail: int, anchor: int) -> np.ndarray:
    """bool [num_tokens]: the scheduled tokens that are prefix rows (A <= p < N - T) of a request not served
    exactly. The exact-row rule, applied afterwards on the split state, may still run some of them exactly."""
    pos, owner = token_positions(query_start, seq_lens)
    n = np.asarray(prompt_lens, np.int64)[owner]
    return is_prefix_row(pos, n, tail=tail, anchor=anchor) & ~np.asarray(exact_requests, bool)[owner]


def reaches_prefix(query_start, seq_lens, prompt_lens, *, tail: int) -> bool:
    """Whether some request's scheduled run starts below its N - T: a test per request, not per token, that lets a
    step of decodes and tails skip the plan. False: `prefix_rows` is all False, whatever the anchor and whichever
    requests are served exactly; True: it may hold a prefix row (`prefix_rows` decides)."""
    first = np.asarray(seq_lens, np.int64) - np.diff(np.asarray(query_start, np.int64))  # each run's first position
    return bool((first < prefix_end(np.asarray(prompt_lens, np.int64), tail)).any())


@dataclass(frozen=True)
class Runs:
    """The exact rows of a step as attention sequences (all int64 numpy arrays)."""

    rows: np.ndarray  # [Q] the exact rows' token indices, ascending
    query_start: np.ndarray  # [S + 1] offsets of each sequence's rows in `rows`
    seq_lens: np.ndarray  # [S] each sequence's last position + 1: the keys its last row attends to
    owner: np.ndarray  # [S] the request (block table row) each sequence belongs to
    last: np.ndarray  # [S] the token index of each sequence's last row

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start).max()) if self.owner.size else 0


def runs(exact: np.ndarray, query_start, seq_lens) -> Runs:
    """The exact rows (exact: bool [num_tokens]) as attention sequences: each maximal run of consecutive tokens of
    one request. A request all of whose scheduled tokens are exact keeps its own sequence unchanged."""
    pos, owner = token_positions(query_start, seq_lens)
    rows = np.flatnonzero(np.asarray(exact, bool))
    starts = np.ones(rows.shape, bool)  # a run starts where the rows or the request break
    starts[1:] = (np.diff(rows) != 1) | (owner[rows[1:]] != owner[rows[:-1]])
    first = np.flatnonzero(starts)
    ends = np.append(first[1:], rows.shape[0])  # exclusive, in `rows`
    last = rows[ends - 1] if rows.size else rows
    return Runs(rows=rows, query_start=np.append(first, rows.shape[0]).astype(np.int64),
                seq_lens=pos[last] + 1, owner=owner[last], last=last)  # fmt: skip


def groups(r: Runs, limit: int) -> list[Runs]:
    """`r` cut into consecutive groups of at most `limit` sequences each, in order: what the late layers run one
    after another when a step's runs outnumber the sequences the attention backend has room for. Every row of a
    group attends only to positions before it, which are filled rows (written before any group runs) or exact rows
    of an earlier sequence of its request, in this group or an earlier one: the groups run in position order, each
    through every late layer, so each writes its keys and values before a later group reads them."""
    if limit < 1:
        raise ValueError(f"a group holds at least one sequence, not {limit}")
    out = []
    for a in range(0, r.owner.size, limit):
        b = min(a + limit, r.owner.size)
        lo, hi = r.query_start[a], r.query_start[b]
        out.append(Runs(rows=r.rows[lo:hi], query_start=r.query_start[a : b + 1] - lo, seq_lens=r.seq_lens[a:b],
                        owner=r.owner[a:b], last=r.last[a:b]))  # fmt: skip
    return out


def served_exactly(sampling_params) -> bool:
    """Whether a request is served exactly (no prefix rows): one that asks for prompt log-probabilities, which need
    every prompt row's logits, and a request without sampling parameters (a pooling request). Read from the
    request's own parameters wherever it is decided (the worker's plan, the scheduler's block hashes), so that every
    time it is scheduled, after preemption too, it is decided the same way."""
    if sampling_params is None:
        return True
    return (getattr(sampling_params, "prompt_logprobs", None) is not None
            or getattr(sampling_params, "prompt_logprob_token_ids", None) is not None)  # fmt: skip


def prefix_rows_in_block(prompt_len: int, start: int, end: int, *, tail: int, exact_request: bool) -> int:
    """How many of the rows start..end-1 of a request's cache block were prefix rows for it (the leading ones: the
    rows below N - T). Two requests whose blocks agree in this count, their tokens and everything before them (a
    prefix-cache block hash chains its parent's) wrote the same keys and values there: the anchor and the
    exact-row rule decide the same rows for both."""
    if exact_request:
        return 0
    return int(min(max(prefix_end(prompt_len, tail) - start, 0), end - start))
