"""Which prompt rows a fill runs exactly: the rules shared by the runtime and by capture (the rows a map is fitted
on are the rows the fill predicts).

- The first `ANCHOR_ROWS` prompt rows: row 0 is the attention sink. Its split state is an outlier the fit leaves
  out (capture skips each document's first row), so a map's prediction for it is an extrapolation, and a filled
  sink can cost more than the whole fill saves.
- Outlier rows (`outlier_rows`): a prefix row whose split state is more than `OUTLIER_RATIO` x the median row
  norm. Some prompts grow a second attention sink after row 0: a row whose hidden state is two orders of magnitude
  larger than the rest (SmolLM2 at layers 12+: 40-170x the median, while ordinary rows stay under 13x on both
  built-ins). Capture leaves these rows out of the fit and the fill runs them exactly, by this one rule.
- "ridgefill+rows": the `ROW_SHARE` of prompt rows that receive the most attention from the probe rows (default the
  last `PROBE_ROWS`), summed over the heads of every layer below the split (`attention_received`).

Importing this module does not import torch (capture's configuration reads the constants).
"""

from __future__ import annotations

from ridgefill.models.kinds import SLIDING

OUTLIER_RATIO = 20.0  # a prefix row whose split state is 20x the median norm (another sink) runs every layer
ANCHOR_ROWS = 1  # the first prompt row (the attention sink) runs every layer in every fill arm
ROW_SHARE, PROBE_ROWS = 0.1, 64  # "+rows": 10 % of the prompt, by attention from its last 64 rows


def fit_rows(skip_first, outlier_ratio, what: str = "the release") -> dict:
    """The fill options that follow from how maps were fitted (a release's `fit.skip_first_rows` and
    `fit.outlier_ratio`, or a capture's): the rows the fit left out run exactly, the first `skip_first` (`anchor`)
    and the outliers by `outlier_ratio` (`outliers`; null: the fit kept them, so 0). BadInput naming `what` for
    values that are not such numbers."""
    from ridgefill.errors import BadInput

    if not (isinstance(skip_first, int) and not isinstance(skip_first, bool) and skip_first >= 0):
        raise BadInput(f"{what}: 'fit.skip_first_rows' is {skip_first!r}, not a number of rows")
    if outlier_ratio is not None and not (isinstance(outlier_ratio, (int, float)) and not isinstance(
            outlier_ratio, bool) and (outlier_ratio == 0 or outlier_ratio > 1)):
        raise BadInput(f"{what}: 'fit.outlier_ratio' is {outlier_ratio!r}, not null, 0 or a ratio above 1")
    return {"anchor": skip_first, "outliers": float(outlier_ratio or 0)}


def outlier_rows(h, ratio: float = OUTLIER_RATIO):
    """Rows of h [n, d] whose norm exceeds `ratio` x the median row norm: [n] bool (all False when ratio is 0)."""
    import torch

    norms = h.float().norm(dim=-1)
    if not ratio or norms.numel() == 0:
        return torch.zeros(norms.shape, dtype=torch.bool, device=norms.device)
    return norms > ratio * norms.median()


def with_outliers(rows: list[int], h_split, prefix: int, outliers: float) -> list[int]:
    """`rows` plus the prefix rows whose split state h_split [N, d] is an outlier by norm (`outlier_rows`)."""
    import torch

    if not outliers or prefix < 1:
        return rows
    found = torch.nonzero(outlier_rows(h_split[:prefix], outliers)).flatten().tolist()
    return sorted(set(rows) | set(found))


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
