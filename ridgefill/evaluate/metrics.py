"""Release-gate metrics: pure functions on numpy arrays (no I/O, no model, no torch).

Per document (seed paper 000, section 3.1): the arm's loss against the exact model's on the scored stretch,
split into all tokens, *novel* tokens (not inside any ``run``-token window that already occurred earlier in
the document) and *key* tokens (the exact loss rises by more than 2 nats when the context is cut to the tail
alone); KL(exact || arm) and top-1 agreement. Across documents (or needle samples): paired bootstrap
intervals. For needle tasks: RULER's string-match rule.

Conventions: ``T`` scored positions, ``V`` vocabulary size, ``N`` document length in tokens. Logits at
position ``t`` predict ``targets[t]``. Every loss is in nats, computed in float64. Delta NLL is
``arm - exact`` (positive = the arm is worse).
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from ridgefill import numerics
from ridgefill.numerics import paired_bootstrap  # re-exported: eval and sweep summaries use it from here

__all__ = [
    "log_softmax",
    "token_nll",
    "kl_exact_arm",
    "top1_agree",
    "novel_mask",
    "key_mask",
    "doc_summary",
    "paired_bootstrap",
    "exact_match",
    "normalize_text",
]


def _logits2d(logits, name: str = "logits") -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"{name} must have shape [T, V] with V >= 1, got {x.shape}")
    if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise ValueError(f"{name} must be real numbers, got dtype {x.dtype}")
    return x.astype(np.float64, copy=False)


def log_softmax(logits) -> np.ndarray:
    """Row-wise log-softmax in float64, stabilised by the row maximum (`numerics.log_softmax`).

    logits: [T, V] any real dtype  ->  [T, V] float64.
    """
    return numerics.log_softmax(_logits2d(logits))  # [T, V]


def token_nll(logits, targets) -> np.ndarray:
    """Negative log-likelihood of each target token, in nats.

    logits: [T, V] float (row t predicts targets[t]); targets: [T] int in [0, V)  ->  [T] float64.
    """
    lp = log_softmax(logits)  # [T, V]
    t = np.asarray(targets)
    if t.ndim != 1 or t.shape[0] != lp.shape[0]:
        raise ValueError(f"targets must have shape [{lp.shape[0]}], got {t.shape}")
    if t.size and not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"targets must be integers, got dtype {t.dtype}")
    t = t.astype(np.int64, copy=False)
    if t.size and (t.min() < 0 or t.max() >= lp.shape[1]):
        raise ValueError(f"targets must lie in [0, {lp.shape[1]})")
    return -lp[np.arange(lp.shape[0]), t]  # [T]


def _pair(logits_exact, logits_arm) -> tuple[np.ndarray, np.ndarray]:
    a = _logits2d(logits_exact, "logits_exact")
    b = _logits2d(logits_arm, "logits_arm")
    if a.shape != b.shape:
        raise ValueError(f"logits_exact {a.shape} and logits_arm {b.shape} differ in shape")
    return a, b


def kl_exact_arm(logits_exact, logits_arm) -> np.ndarray:
    """KL(p_exact || p_arm) per position, in nats: sum_v p_e(v) (log p_e(v) - log p_a(v)).

    logits_exact, logits_arm: [T, V]  ->  [T] float64 (>= 0; terms with p_e(v) = 0 count 0).
    """
    a, b = _pair(logits_exact, logits_arm)
    lpe, lpa = log_softmax(a), log_softmax(b)  # [T, V] each
    pe = np.exp(lpe)  # [T, V]
    with np.errstate(invalid="ignore"):
        terms = np.where(pe > 0, pe * (lpe - lpa), 0.0)  # [T, V]
    kl = np.sum(terms, axis=1)  # [T]
    return np.maximum(kl, 0.0)  # clip round-off below zero


def top1_agree(logits_exact, logits_arm) -> np.ndarray:
    """Whether the arm's most likely token equals the exact model's (ties: lowest index, as np.argmax).

    logits_exact, logits_arm: [T, V]  ->  [T] bool.
    """
    a, b = _pair(logits_exact, logits_arm)
    return np.argmax(a, axis=1) == np.argmax(b, axis=1)  # [T]


def novel_mask(tokens, start: int, run: int = 8) -> np.ndarray:
    """Novel-token mask on the scored stretch ``tokens[start:]``.

    Window ``j`` is ``tokens[j:j+run]`` (only full windows, ``0 <= j <= N - run``). It is a *repeat* when the
    same sequence occurs at some ``j' < j`` (the earlier occurrence may overlap window ``j``, and windows may
    start before ``start``). Token ``i`` is novel when no repeat window covers it (``j <= i < j + run``).
    A document shorter than ``run`` has no windows, so every token is novel.

    tokens: [N] int; 0 <= start <= N; run >= 1  ->  [N - start] bool (entry k is token start + k).
    O(N log N) in windows (one sort of the [N - run + 1, run] window matrix).
    """
    t = np.asarray(tokens)
    if t.ndim != 1:
        raise ValueError(f"tokens must have shape [N], got {t.shape}")
    if t.size and not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {t.dtype}")
    n = int(t.shape[0])
    start, run = int(start), int(run)
    if run < 1:
        raise ValueError(f"run must be >= 1, got {run}")
    if not 0 <= start <= n:
        raise ValueError(f"start must lie in [0, {n}], got {start}")
    covered = np.zeros(n, dtype=bool)  # [N]
    nw = n - run + 1  # number of full windows
    if nw >= 2:
        win = np.lib.stride_tricks.sliding_window_view(t.astype(np.int64, copy=False), run)  # [nw, run]
        # Stable lexicographic sort of the windows: equal windows end up adjacent, in increasing j.
        order = np.lexsort(win.T[::-1])  # [nw]; last key is the primary one, so column 0 leads
        s = win[order]  # [nw, run]
        same_as_prev = np.zeros(nw, dtype=bool)  # [nw], in sorted order
        same_as_prev[1:] = np.all(s[1:] == s[:-1], axis=1)
        repeat = np.zeros(nw, dtype=bool)  # [nw], by window start j
        repeat[order] = same_as_prev  # not the first of its group (stable sort => an earlier j' exists)
        # Mark [j, j + run) for every repeat window with a difference array.
        diff = np.zeros(n + 1, dtype=np.int64)  # [N + 1]
        js = np.nonzero(repeat)[0]
        np.add.at(diff, js, 1)
        np.add.at(diff, js + run, -1)
        covered = np.cumsum(diff[:n]) > 0  # [N]
    return ~covered[start:]  # [N - start]


def key_mask(nll_full, nll_tail_only, threshold: float = 2.0) -> np.ndarray:
    """Key tokens: the exact loss rises by more than ``threshold`` nats when the context is cut to the tail.

    nll_full: [T] exact NLL with the whole context; nll_tail_only: [T] exact NLL with only the tail  ->
    [T] bool, ``nll_tail_only - nll_full > threshold`` (NaN compares False).
    """
    f = np.asarray(nll_full, dtype=np.float64)
    t = np.asarray(nll_tail_only, dtype=np.float64)
    if f.ndim != 1 or f.shape != t.shape:
        raise ValueError(f"nll_full {f.shape} and nll_tail_only {t.shape} must be equal [T] shapes")
    with np.errstate(invalid="ignore"):
        return (t - f) > float(threshold)  # [T]


def _mean_or_none(x: np.ndarray) -> float | None:
    return float(np.mean(x)) if x.size else None


def doc_summary(nll_exact, nll_arm, kl, top1, novel, key) -> dict:
    """Summary of one document's scored stretch for one arm.

    nll_exact, nll_arm, kl: [T] float; top1, novel, key: [T] bool  ->  dict with
      ``tokens``, ``novel_tokens``, ``key_tokens`` (counts, int);
      ``nll_exact``, ``nll_arm`` (mean NLL on all tokens);
      ``dnll``, ``dnll_novel``, ``dnll_key`` (mean of nll_arm - nll_exact on all / novel / key tokens);
      ``kl`` (mean KL(exact || arm)); ``top1`` (top-1 agreement rate).
    Every mean is a plain float, or None when its set of tokens is empty (T = 0 or an empty mask).
    """
    e = np.asarray(nll_exact, dtype=np.float64)
    a = np.asarray(nll_arm, dtype=np.float64)
    k = np.asarray(kl, dtype=np.float64)
    arrays = {"nll_arm": a, "kl": k, "top1": np.asarray(top1), "novel": np.asarray(novel), "key": np.asarray(key)}
    if e.ndim != 1:
        raise ValueError(f"nll_exact must have shape [T], got {e.shape}")
    for name, x in arrays.items():
        if x.shape != e.shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {e.shape}")
    masks = {}
    for name in ("top1", "novel", "key"):
        x = arrays[name]
        if x.dtype != bool:
            raise ValueError(f"{name} must be a bool array, got dtype {x.dtype}")
        masks[name] = x
    d = a - e  # [T]
    return {
        "tokens": int(e.size),
        "novel_tokens": int(masks["novel"].sum()),
        "key_tokens": int(masks["key"].sum()),
        "nll_exact": _mean_or_none(e),
        "nll_arm": _mean_or_none(a),
        "dnll": _mean_or_none(d),
        "dnll_novel": _mean_or_none(d[masks["novel"]]),
        "dnll_key": _mean_or_none(d[masks["key"]]),
        "kl": _mean_or_none(k),
        "top1": _mean_or_none(masks["top1"].astype(np.float64)),
    }


_WS = re.compile(r"\s+")


def normalize_text(s: str) -> str:
    """Lower-case, collapse every whitespace run to one space, strip the ends."""
    return _WS.sub(" ", str(s)).strip().lower()


def exact_match(answer: str, expected: str | Sequence[str]) -> bool:
    """RULER's string-match rule: True when every expected string occurs in the answer.

    Both sides are normalised (case, whitespace runs; see ``normalize_text``) before the substring test.
    ``expected`` is one string or a list of strings; an empty list, or an expected string that is empty after
    normalisation, raises ValueError (it would match anything).
    """
    refs = [expected] if isinstance(expected, str) else list(expected)
    if not refs:
        raise ValueError("expected must name at least one string")
    ans = normalize_text(answer)
    out = True
    for r in refs:
        if not isinstance(r, str):
            raise ValueError(f"expected strings must be str, got {type(r).__name__}")
        nr = normalize_text(r)
        if not nr:
            raise ValueError("an expected string is empty")
        out = out and (nr in ans)
    return out
