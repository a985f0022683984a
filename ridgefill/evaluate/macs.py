"""Multiply-accumulate (MAC) counts of a prefill, per arm: the paper's cost model for its reference runtime, which
counts every layer each row runs, attention over the context included, plus the maps and the row-selection probe.

    from ridgefill.evaluate.macs import model_shape, prefill_macs, result_macs
    shape = model_shape(lm.adapter)            # or a transformers config, or config.json as a dict
    prefill_macs(shape, n=4096, tail=512, split=12, arm="ridgefill", exact_rows=res.exact_rows)
    # {"total": ..., "layers": ..., "attention": ..., "maps": ..., "probe": ..., "head": ...}
    result_macs(shape, res)                    # the same for a PrefillResult (its arm, rows, split, tail)

What is counted: matrix products only, one MAC per multiply-add of a product; norms, RoPE, activations, softmax,
gates, residual adds, biases and the embedding lookup are not (they are O(d) per row, not O(d^2)).

- "layers": the linear projections each row runs through: attention's q/k/v/o (the hybrids' q_proj is twice as
  wide: it also computes the output gate), the MLP (gated: gate, up, down; a mixture-of-experts block: the router,
  `experts_per_token` experts and the shared expert with its gate), a Gated DeltaNet layer's input projections
  and out_proj, and the filled rows' k_proj/v_proj in late attention layers.
- "attention": what mixes rows. Attention: QK^T and AV over the keys each query row sees, that is
  (query, key) pairs x heads x 2 head_dim, with a key visible to a query when it is at or before it (and, on a
  sliding layer, less than `window` behind it) and present in the cache (in "nofill" the filled rows' slots are
  empty). Eager attention and the reference's masked calls compute every entry of the score matrix, masked ones
  too; this counts only the visible ones, as a causal kernel would. A Gated DeltaNet layer: per row, its depthwise
  causal convolution (conv_dim x kernel, conv_dim = 2 key_dim + value_dim) and the recurrent form of its gated delta
  rule, 3 x value_heads x key_head_dim x value_head_dim (the state readout S^T k, the rank-one update k d^T, the
  output S^T q; the state's decay is an elementwise scale and not counted). transformers' chunked form and fla's
  kernels do the same rule in a different order, with a different count.
- "maps": the ridge maps, d x d per filled row per late layer ("ridgefill" arms; "identity" has none), or, where
  `map_kinds` names a key/value map, d x 2 kv_heads x head_dim, and then the filled row runs no k_proj/v_proj (the
  map predicts what they would write); maps that read earlier states besides h_S (`states`) cost that many times
  more. In a sliding-window layer only the filled rows some query sees are written (docs/method.md), so only they
  are mapped.
- "probe" ("ridgefill+rows"): in every attention layer below the split, each probe row's query (q_proj, at its
  full width) and its scores against the keys it sees (QK^T only: the selection sums the softmax weights, no AV).
  The reference computes the probe's full probe x N score matrix and masks it; this counts the visible entries.
- "head": `logits_rows` rows through the LM head (d x vocab each).

Arms (as in ridgefill.runtime; N rows, split S, tail T, prefix P = N - T):

- "exact": every row runs every layer.
- Fill arms: layers 0..S-1 run all N rows. In late layers the exact rows and the tail (the query rows) run the
  whole layer; the other prefix rows (filled) get only k_proj and v_proj ("nofill": nothing). A late Gated
  DeltaNet layer runs its whole token mixer (input projections, convolution, recurrence, out_proj) over the
  filled rows too, from their predicted input, as the reference does; only its MLP is skipped for them
  ("nofill": the mixer runs over the query rows alone).
- `exact_rows`: every prefix row that runs every layer: the anchor, the rows above the exact-row norm, the selected
  rows and any asked for, which is what `PrefillResult.exact_rows` lists. A list gives their positions, and the
  count is exact. A number r means the first r positions (0..r-1, where the anchor is; at most the prefix). Other
  positions of the same count cost the same except for their own attention (a later exact row sees more keys, so
  the first rows give the least attention) and, on sliding layers, which filled rows are written. The default, 1,
  is the runtime's default anchor.

Not counted: the corrections (`corrections=`: the key/value projections of the first tail rows, twice, and a map
of them, per late attention layer; the "state" correction's gate projections).

Importing this module imports numpy, not torch: a count needs only the model's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.models.kinds import FULL, LINEAR, SLIDING
from ridgefill.runtime.rows import ANCHOR_ROWS, PROBE_ROWS, prefix_end, tail_fits

ARMS = ("exact", "ridgefill", "identity", "nofill", "ridgefill+rows")  # ridgefill.runtime.ARMS
PARTS = ("layers", "attention", "maps", "probe", "head")
# The architectures the fill runtime supports (ridgefill.models.adapters), by config model_type; the hybrids'
# attention layers are gated (q_proj computes the output gate beside the queries), Qwen3-Next has experts.
MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text", "qwen3_next", "qwen3_5_text")
GATED_ATTENTION = ("qwen3_next", "qwen3_5_text")


@dataclass(frozen=True)
class ModelShape:
    """What a MAC count needs of a model (`model_shape` reads it from a config)."""

    kinds: tuple[str, ...]  # per layer: FULL, SLIDING or LINEAR (ridgefill.models.kinds)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's width
    vocab: int
    window: int | None = None  # sliding layers' window (None: no sliding layers)
    gated_mlp: bool = True  # gate, up, down (else up, down)
    q_gate: bool = False  # q_proj also computes the attention output gate: 2 x heads x head_dim wide
    # Gated DeltaNet (LINEAR) layers
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0  # per key head
    linear_value_dim: int = 0  # per value head
    conv_kernel: int = 0
    # Mixture of experts: per layer, whether its MLP is a sparse block
    moe: tuple[bool, ...] = ()
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # 0: no shared expert (nor its gate)

    @property
    def layers(self) -> int:
        return len(self.kinds)

    def mixer(self, l: int) -> int:
        """MACs of layer l's token-mixer projections, per row (attention: q, k, v, o; Gated DeltaNet: its input
        projections q, k, v, z, b, a and out_proj)."""
        d = self.hidden
        if self.kinds[l] == LINEAR:
            kd, vd = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
            return d * (2 * kd + 2 * vd + 2 * self.linear_value_heads) + vd * d
        return d * self.q_width() + self.kv(l) + self.heads * self.head_dim * d

    def mlp(self, l: int) -> int:
        """MACs of layer l's MLP (or mixture-of-experts block), per row."""
        d = self.hidden
        if self.moe and self.moe[l]:
            shared = 3 * d * self.shared_intermediate + d if self.shared_intermediate else 0
            return d * self.experts + self.experts_per_token * 3 * d * self.expert_intermediate + shared
        return (3 if self.gated_mlp else 2) * d * self.intermediate

    def kv(self, l: int) -> int:
        """MACs of attention layer l's k_proj and v_proj, per row: what a filled row costs in a late layer."""
        return 2 * self.hidden * self.kv_heads * self.head_dim

    def q_width(self) -> int:
        """q_proj's output width (queries, and the output gate where there is one)."""
        return self.heads * self.head_dim * (2 if self.q_gate else 1)

    def pair(self) -> int:
        """MACs of one (query row, visible key) pair of an attention layer: QK^T and AV over every head."""
        return self.heads * 2 * self.head_dim

    def state(self, l: int) -> int:
        """MACs of Gated DeltaNet layer l's convolution and recurrence, per row (module docstring)."""
        kd, vd = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
        return (2 * kd + vd) * self.conv_kernel + 3 * self.linear_value_heads * self.linear_key_dim * \
            self.linear_value_dim  # fmt: skip

    def window_of(self, l: int) -> int | None:
        return self.window if self.kinds[l] == SLIDING and self.window else None


def model_shape(source) -> ModelShape:
    """The `ModelShape` of a model: from a `LoadedModel`, an adapter (`lm.adapter`), a transformers config, or a
    config.json read as a dict (a vision-language config's text part is used). BadInput for an architecture the
    fill runtime does not support."""
    source = getattr(source, "adapter", source)  # a LoadedModel
    cfg = getattr(source, "config", source)  # an adapter
    if isinstance(cfg, dict):
        cfg = cfg.get("text_config") or cfg
        get = cfg.get
    else:
        if hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()

        def get(key, default=None):
            return getattr(cfg, key, default)

    mtype = get("model_type")
    mtype = {"qwen3_5": "qwen3_5_text"}.get(mtype, mtype)
    if mtype not in MODEL_TYPES:
        raise BadInput(f"no MAC count for architecture '{mtype}' (supported: {', '.join(MODEL_TYPES)})")
    layers = int(get("num_hidden_layers"))
    kinds = tuple(get("layer_types", None) or [FULL] * layers)
    if len(kinds) != layers or not set(kinds) <= {FULL, SLIDING, LINEAR}:
        raise BadInput(f"layer kinds {sorted(set(kinds))} x {len(kinds)} do not fit a {layers}-layer model of "
                       f"attention and Gated DeltaNet layers")
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    experts = int(get("num_experts", 0) or 0) if mtype == "qwen3_next" else 0
    sparse = []
    if experts:
        step, dense = int(get("decoder_sparse_step", 1) or 1), set(get("mlp_only_layers", None) or [])
        sparse = [l not in dense and (l + 1) % step == 0 for l in range(layers)]
    window = get("sliding_window", None) if SLIDING in kinds else None
    linear = LINEAR in kinds
    return ModelShape(
        kinds=kinds, hidden=hidden, heads=heads, kv_heads=int(get("num_key_value_heads", None) or heads),
        head_dim=int(get("head_dim", None) or hidden // heads), intermediate=int(get("intermediate_size")),
        vocab=int(get("vocab_size")), window=int(window) if window else None, q_gate=mtype in GATED_ATTENTION,
        linear_key_heads=int(get("linear_num_key_heads")) if linear else 0,
        linear_value_heads=int(get("linear_num_value_heads")) if linear else 0,
        linear_key_dim=int(get("linear_key_head_dim")) if linear else 0,
        linear_value_dim=int(get("linear_value_head_dim")) if linear else 0,
        conv_kernel=int(get("linear_conv_kernel_dim")) if linear else 0,
        moe=tuple(sparse), experts=experts, experts_per_token=int(get("num_experts_per_tok", 0) or 0) if experts else 0,
        expert_intermediate=int(get("moe_intermediate_size", 0) or 0) if experts else 0,
        shared_intermediate=int(get("shared_expert_intermediate_size", 0) or 0) if experts else 0,
    )  # fmt: skip


def prefill_macs(shape: ModelShape, n: int, tail: int, split: int, arm: str, exact_rows=ANCHOR_ROWS,
                 logits_rows: int = 1, probe=PROBE_ROWS, map_kinds: dict | None = None, states: int = 1) -> dict:
    """MACs of a prefill of `n` rows with `arm` at `split` and `tail` (module docstring): {"total", "layers",
    "attention", "maps", "probe", "head"}, Python ints. `exact_rows`: the fill arms' exact prefix rows, as
    positions or as a count (the first ones); `probe`: "ridgefill+rows"'s probe rows, as positions or as a count
    (the last ones, the runtime's default 64); `logits_rows`: the last rows that get logits (0..tail); `map_kinds`:
    {layer: "input" | "kv"} (a layer it does not name: an input map); `states`: how many states the maps read side
    by side (1: h_S; maps from earlier states read more, and each costs d x d_out more per filled row)."""
    L = shape.layers
    if arm not in ARMS:
        raise BadInput(f"unknown arm '{arm}' (choose one of: {', '.join(ARMS)})")
    if not (n >= 1 and tail_fits(tail, n) and 0 <= split <= L):
        raise BadInput(f"a prefill needs n >= 1, 1 <= tail <= n and 0 <= split <= {L} (got n={n}, tail={tail}, "
                       f"split={split})")
    if not 0 <= logits_rows <= tail:
        raise BadInput(f"logits_rows must be in 0..{tail} (the tail), got {logits_rows}")
    prefix = prefix_end(n, tail)
    rows = _positions(exact_rows, prefix, "exact_rows", first=True) if arm != "exact" else None
    macs = dict.fromkeys(PARTS, 0)
    every = np.arange(n)
    for l in range(L if arm == "exact" else split):  # every row runs the layer
        macs["layers"] += n * (shape.mixer(l) + shape.mlp(l))
        macs["attention"] += n * shape.state(l) if shape.kinds[l] == LINEAR else \
            shape.pair() * _visible(every, None, shape.window_of(l))  # fmt: skip
    if arm == "ridgefill+rows":
        probes = _positions(probe, n, "probe", first=False)
        for l in range(split):
            if shape.kinds[l] != LINEAR:
                macs["probe"] += len(probes) * shape.hidden * shape.q_width()
                macs["probe"] += shape.heads * shape.head_dim * _visible(probes, None, shape.window_of(l))
    if arm != "exact":
        queries = np.concatenate([rows, np.arange(prefix, n)])
        filled = np.setdiff1d(np.arange(prefix), rows) if arm != "nofill" else every[:0]
        for l in range(split, L):
            q = len(queries)
            if shape.kinds[l] == LINEAR:  # the whole mixer over the filled rows too; the MLP for the queries
                written = filled
                mixed = q + len(written)
                macs["layers"] += mixed * shape.mixer(l) + q * shape.mlp(l)
                macs["attention"] += mixed * shape.state(l)
            else:
                window = shape.window_of(l)
                written = _seen(filled, queries, window, n) if window else filled
                kv_map = arm.startswith("ridgefill") and (map_kinds or {}).get(l) == "kv"  # predicts what k/v_proj write
                macs["layers"] += q * (shape.mixer(l) + shape.mlp(l)) + (0 if kv_map else len(written) * shape.kv(l))
                # Every prefix row at or before a query is in the cache (exact or filled), except in "nofill"
                keys = queries if arm == "nofill" else None
                macs["attention"] += shape.pair() * _visible(queries, keys, window)
            if arm.startswith("ridgefill"):
                kv_map = (map_kinds or {}).get(l) == "kv"
                macs["maps"] += len(written) * states * shape.hidden * (
                    2 * shape.kv_heads * shape.head_dim if kv_map else shape.hidden)
    macs["head"] = logits_rows * shape.hidden * shape.vocab
    return {"total": sum(macs.values()), **macs}


def result_macs(shape: ModelShape, result, logits_rows: int = 1, probe=PROBE_ROWS,
                map_kinds: dict | None = None, states: int = 1) -> dict:
    """`prefill_macs` of a `PrefillResult` (ridgefill.runtime): its arm, rows, split, tail and exact rows."""
    rows = list(result.exact_rows) if result.arm != "exact" else []
    return prefill_macs(shape, result.num_rows, result.tail, result.split, result.arm, exact_rows=rows,
                        logits_rows=logits_rows, probe=probe, map_kinds=map_kinds, states=states)


def _positions(spec, limit: int, what: str, first: bool) -> np.ndarray:
    """Sorted distinct positions in 0..limit-1 from a list, or from a count: the first or the last min(spec, limit)
    (as the runtime takes its anchor rows and its default probe)."""
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        if spec < 0:
            raise BadInput(f"{what}: a count of rows must not be negative, got {spec}")
        spec = min(int(spec), limit)
        return np.arange(spec) if first else np.arange(limit - spec, limit)
    pos = np.unique(np.asarray(list(spec), dtype=np.int64))
    if pos.size and not (pos[0] >= 0 and pos[-1] < limit):
        raise BadInput(f"{what} must be positions in 0..{limit - 1}")
    return pos


def _visible(queries: np.ndarray, keys: np.ndarray | None, window: int | None) -> int:
    """Sum over query positions q of the keys j <= q (q - j < window, if any) among `keys` (None: every position).
    `keys` sorted."""
    q = queries.astype(np.int64)
    if keys is None:
        seen = q + 1 if not window else np.minimum(q + 1, window)
    else:
        seen = np.searchsorted(keys, q, side="right")
        if window:
            seen = seen - np.searchsorted(keys, q - window, side="right")
    return int(seen.sum())


def _seen(filled: np.ndarray, queries: np.ndarray, window: int, n: int) -> np.ndarray:
    """The filled rows a sliding layer writes: those less than `window` before the next query row (queries sorted,
    never filled)."""
    nxt = np.searchsorted(queries, filled)
    ahead = np.concatenate([queries, [n + window]])[nxt]
    return filled[ahead - filled < window]
