"""Which prompt rows a fill runs exactly: the rules shared by the runtime, the vLLM fill plugin, the MAC count and
capture (the rows a map is fitted on are the rows the fill predicts).

The row rule. For a prompt of N rows, a tail of T and an anchor of A, the row at position p is

    a prefix row   if A <= p < N - T   (`is_prefix_row`) filled, unless a rule below runs it exactly
    an exact row   otherwise           the anchor, the tail (`prefix_end` onward), every token after the prompt

and a tail fits a prompt of N rows when 1 <= T <= N (`tail_fits`: T = N leaves no prefix row, an exact prefill).
The prefix rows the fill still runs exactly:

- The first `ANCHOR_ROWS` prompt rows: row 0 is the attention sink. Its split state is an outlier the fit leaves
  out (capture skips each document's first row), so a map's prediction for it is an extrapolation, and a filled
  sink can cost more than the whole fill saves.
- Rows above the exact-row norm (`norm_rows`): a prefix row whose split state's norm (float32) exceeds the
  release's `fit.exact_norm`. Some prompts grow a second attention sink after row 0: a row whose hidden state is
  two orders of magnitude larger than the rest (SmolLM2 at layers 12+: 40-180x the median), and Gemma 3's
  massive-activation rows (5-14x). Capture leaves rows above `OUTLIER_RATIO` x their chunk's median norm out of the
  fit; solve fixes the threshold the fill uses, the capture's ratio x the median norm of its held-out rows at the
  split (`fit_exact_norm`). The rule looks at one row at a time, so the rows it picks in a prompt's first p
  rows do not depend on the rows after them: an engine that prefills in chunks picks the same ones.
- "ridgefill+rows": the `ROW_SHARE` of prompt rows that receive the most attention from the probe rows (default the
  last `PROBE_ROWS`), summed over the heads of every layer below the split (`attention_received`).

Importing this module does not import torch or numpy (capture's configuration reads the constants, and the vLLM
fill plugin the rule).
"""

from __future__ import annotations

from ridgefill.models.kinds import SLIDING

# A split state above 4x the median norm is an outlier: capture does not fit it, the fill runs it exactly. Measured on
# three 4K-token eval documents: ordinary rows stay under 3.4x at layers 10-29 of SmolLM2 and 2-16 of Gemma 3; the
# outliers are the sinks (SmolLM2 from layer 12: 40-180x) and Gemma's massive-activation rows (5-14x at layers 5-15,
# 0.4 % of rows, mostly punctuation). A key/value map writes such a row's values far too long (its prediction is
# linear in the state, where the layer normalizes it first): with these rows filled, Gemma's key/value maps at split
# 11 cost 0.129 nats of ΔNLL; the same maps with them run exactly, 0.004 (input maps: 0.006 and 0.004).
OUTLIER_RATIO = 4.0
ANCHOR_ROWS = 1  # the first prompt row (the attention sink) runs every layer in every fill arm
ROW_SHARE, PROBE_ROWS = 0.1, 64  # "+rows": 10 % of the prompt, by attention from its last 64 rows
DEFAULT_TAIL = 512  # the exact tail (the last prompt rows, run through every layer) when none is given


def prefix_end(n, tail):
    """N - T, the first row of the exact tail: the prefix rows lie below it (`is_prefix_row`). Python ints or numpy
    arrays (elementwise); below 1 for a prompt no longer than its tail, which has no prefix row."""
    return n - tail


def is_prefix_row(pos, n, *, tail, anchor):
    """The row rule: whether position `pos` of a prompt of `n` rows is a prefix row, A <= p < N - T. Python ints
    (a bool) or numpy arrays, broadcast elementwise (a bool array)."""
    return (pos >= anchor) & (pos < prefix_end(n, tail))


def anchor_rows(n: int, *, tail: int, anchor: int) -> range:
    """The anchor's rows of a prompt of `n` rows: the first `anchor` positions that are below the tail."""
    return range(max(min(anchor, prefix_end(n, tail)), 0))


def tail_fits(tail, n: int) -> bool:
    """Whether `tail` is a tail for a prefill of `n` rows: an integer (not a bool) with 1 <= T <= N."""
    import numbers

    return isinstance(tail, numbers.Integral) and not isinstance(tail, bool) and 1 <= tail <= n


def fit_exact_norm(h, ratio: float = OUTLIER_RATIO) -> float:
    """The exact-row norm a release records (`fit.exact_norm`): `ratio` x the median L2 norm of the rows h [R, d]
    (a capture's held-out rows at the split). Norms in float64; the median of an even count is the mean of the two
    middle values (numpy's). ValueError for no rows or a median that is not positive and finite."""
    import numpy as np

    norms = np.linalg.norm(np.asarray(h, dtype=np.float64), axis=-1)  # [R]
    if norms.size == 0:
        raise ValueError("no rows to take the median norm of")
    norm = float(ratio * np.median(norms))
    if not (np.isfinite(norm) and norm > 0):
        raise ValueError(f"the median row norm gives an exact-row norm of {norm!r}, not a positive number")
    return norm


def fit_rows(skip_first, exact_norm, what: str = "the release") -> dict:
    """The fill options that follow from how maps were fitted (a release's `fit.skip_first_rows` and
    `fit.exact_norm`, or a capture's and a solve's): the first `skip_first` rows, which the fit left out, run
    exactly (`anchor`), and so does every prefix row whose split-state norm exceeds `exact_norm`. BadInput naming
    `what` for values that are not such numbers."""
    from ridgefill.errors import BadInput

    if not (isinstance(skip_first, int) and not isinstance(skip_first, bool) and skip_first >= 0):
        raise BadInput(f"{what}: 'fit.skip_first_rows' is {skip_first!r}, not a number of rows")
    if not is_norm(exact_norm):
        raise BadInput(f"{what}: 'fit.exact_norm' is {exact_norm!r}, not a positive norm")
    return {"anchor": skip_first, "exact_norm": float(exact_norm)}


def is_norm(value) -> bool:
    """Whether `value` can be an exact-row norm: a positive, finite number (not a bool)."""
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def norm_rows(h, norm: float | None):
    """The exact-row rule, row by row: rows of h [n, d] whose L2 norm, computed in float32, exceeds `norm`: [n]
    bool (all False when norm is None). A row's verdict depends on that row alone."""
    import torch

    norms = h.float().norm(dim=-1)  # [n] float32
    if norm is None:
        return torch.zeros(norms.shape, dtype=torch.bool, device=norms.device)
    return norms > norm


def token_table(protected, vocab: int):
    """The protected-token rule as a lookup table: bool numpy [max(vocab, largest id + 1)], True at each id of
    `protected` (non-negative token ids, as a release's table holds them)."""
    import numpy as np

    ids = np.asarray(protected, dtype=np.int64).reshape(-1)
    table = np.zeros(max(int(vocab), int(ids.max()) + 1 if ids.size else 0, 1), dtype=bool)  # never empty
    table[ids] = True
    return table


def protected_rows(ids, table):
    """The rows of ids [n] (a torch integer tensor) whose token is protected: table[ids], [n] bool on ids' device,
    with `table` [V] bool there (`token_table`). A gather, so no host synchronization (torch.isin sorts, which on
    CUDA waits for the device, once the step has more than a few tokens); an id outside the table is not
    protected."""
    inside = (ids >= 0) & (ids < table.shape[0])
    return table[ids.clamp(0, table.shape[0] - 1)] & inside


def with_norm_rows(rows: list[int], h_split, prefix: int, norm: float | None) -> list[int]:
    """`rows` plus the prefix rows (< prefix) whose split state h_split [N, d] is above the exact-row norm
    (`norm_rows`)."""
    import torch

    if norm is None or prefix < 1:
        return rows
    found = torch.nonzero(norm_rows(h_split[:prefix], norm)).flatten().tolist()
    return sorted(set(rows) | set(found))


def outlier_rows(h, ratio: float = OUTLIER_RATIO):
    """Capture's rule for the rows it leaves out of the fit: rows of h [n, d] (one chunk) whose norm exceeds `ratio`
    x the chunk's median row norm: [n] bool (all False when ratio is 0). Not the fill's rule (`norm_rows`)."""
    import torch

    norms = h.float().norm(dim=-1)
    if not ratio or norms.numel() == 0:
        return torch.zeros(norms.shape, dtype=torch.bool, device=norms.device)
    return norms > ratio * norms.median()


def attention_received(ad, l, x, pos, keys, window):
    """Attention each key slot receives from the rows x [P, d] at positions pos [P] in layer l, summed over
    heads and rows: [n] float32. keys [1, kv_heads, n, head_dim] hold the layer's post-RoPE keys."""
    import torch

    kind = ad.layer_kinds[l]
    q = ad.q(l, x)  # on the layer's device, like keys
    pos = pos.to(q.device)
    cos, sin = ad._rope_module_call(x.to(q.device), pos[None], kind)
    q = ad.apply_rope(q, cos[0], sin[0]).float()  # [P, heads, hd]
    k = keys[0].to(q.device).float().repeat_interleave(ad.num_heads // ad.num_kv_heads, dim=0)  # [heads, n, hd]
    scores = ad.attention_scaling(l) * torch.einsum("phd,hnd->hpn", q, k)  # [heads, P, n]
    kv = torch.arange(k.shape[1], device=k.device)[None, :]
    allowed = kv <= pos[:, None]
    if kind == SLIDING and window:
        allowed &= pos[:, None] - kv < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1).sum(dim=(0, 1))


def most_attended(received, prefix: int, count: int) -> list[int]:
    """The `count` prefix rows that received the most attention ([n] from `attention_received`); ties: earlier
    position first."""
    import torch

    order = torch.argsort(-received[:prefix], stable=True)
    return order[: min(count, prefix)].tolist()
