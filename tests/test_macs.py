"""MAC counts of a prefill (ridgefill.evaluate.macs) against the work the real runtime does, counted by brute force.

`Count` instruments a tiny model while `prefill` runs, without reading the formulas:

- every torch.nn.Linear: rows x in_features x out_features, from the input it is called on (lm_head: "head"; the
  q_proj calls inside the row-selection probe: "probe"; everything else: "layers"), and a mixture of experts' router
  (rows x its weight) and experts (each routed (row, expert) pair x that expert's weights);
- attention: the (head, query, key) entries each scaled_dot_product_attention call leaves unmasked (its boolean or
  additive mask, or is_causal), x (query + value head_dim);
- the probe: the finite entries of the scores the selection's softmax reads, x head_dim (QK^T);
- the maps: torch's FlopCounterMode around each prediction (matmul FLOPs / 2);
- a Gated DeltaNet layer: the rows its mixer is called on, x the per-row cost of its convolution and recurrence
  (the one place where the per-row figure is the module's stated formula; the rows are measured).
"""

import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from ridgefill.errors import BadInput
from ridgefill.evaluate.macs import ARMS, PARTS, model_shape, prefill_macs, result_macs
from ridgefill.runtime import ceiling, prefill

MAIN = ["llama", "gemma3_text", "qwen3_next", "qwen3_5"]
pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def random_maps(lm, split, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = lm.adapter.hidden_size
    return {l: (torch.randn(d, d, generator=g) / d**0.5, torch.randn(d, generator=g))
            for l in range(split, lm.adapter.num_layers)}  # fmt: skip


class Count:
    """Brute-force MAC counts of what runs on `lm` inside the `with` block (module docstring), by part."""

    def __init__(self, lm, monkeypatch):
        self.lm, self.mp = lm, monkeypatch
        self.macs = dict.fromkeys(PARTS, 0)
        self.in_probe = False

    def __enter__(self):
        from ridgefill.runtime import fill

        self.handles = []
        for name, mod in self.lm.model.named_modules():
            kind = type(mod).__name__
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_hook(self._linear(name == "lm_head")))
            elif kind.endswith("TopKRouter"):
                self.handles.append(mod.register_forward_hook(self._router))
            elif kind.endswith("Experts"):
                self.handles.append(mod.register_forward_hook(self._experts))
            elif kind.endswith("GatedDeltaNet"):
                self.handles.append(mod.register_forward_pre_hook(self._delta, with_kwargs=True))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        self.mp.setattr(torch.nn.functional, "scaled_dot_product_attention", self._sdpa(sdpa))
        self.mp.setattr(fill, "_predicted", self._maps(fill._predicted))
        self.mp.setattr(fill, "attention_received", self._probe(fill.attention_received))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.mp.undo()

    def add(self, part, macs):
        self.macs[part] += int(macs)

    def _linear(self, head):
        def hook(mod, args, out):
            rows = args[0].numel() // mod.in_features
            part = "head" if head else "probe" if self.in_probe else "layers"
            self.add(part, rows * mod.in_features * mod.out_features)
        return hook

    def _router(self, mod, args, out):
        self.add("layers", args[0].numel() // mod.weight.shape[1] * mod.weight.numel())

    def _experts(self, mod, args, out):
        index = args[1]  # [rows, experts per token]
        pairs = int((index < mod.num_experts).sum())
        self.add("layers", pairs * (mod.gate_up_proj[0].numel() + mod.down_proj[0].numel()))

    def _delta(self, mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        per_row = mod.conv_dim * mod.conv_kernel_size + 3 * mod.num_v_heads * mod.head_k_dim * mod.head_v_dim
        self.add("attention", h.shape[1] * per_row)

    def _sdpa(self, real):
        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
            b, h, q, e = query.shape
            k = key.shape[-2]
            if attn_mask is not None:
                assert not is_causal
                allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min
                entries = allowed.expand(b, h, q, k).sum()
            elif is_causal:
                entries = b * h * torch.ones(q, k, dtype=torch.bool).tril().sum()
            else:
                entries = b * h * q * k
            self.add("attention", entries * (e + value.shape[-1]))
            return real(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)
        return sdpa

    def _maps(self, real):
        def predicted(*args, **kwargs):
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as flops:
                out = real(*args, **kwargs)
            self.add("maps", flops.get_total_flops() // 2)
            return out
        return predicted

    def _probe(self, real):
        def received(ad, l, x, pos, keys, window):
            softmax = torch.Tensor.softmax

            def counted(scores, *a, **kw):  # [heads, probe rows, slots], the masked entries -inf
                self.add("probe", int(torch.isfinite(scores).sum()) * keys.shape[-1])
                return softmax(scores, *a, **kw)

            self.in_probe = True
            self.mp.setattr(torch.Tensor, "softmax", counted)
            try:
                return real(ad, l, x, pos, keys, window)
            finally:
                self.mp.setattr(torch.Tensor, "softmax", softmax)
                self.in_probe = False
        return received


def counted(lm, monkeypatch, ids, arm, **options):
    with Count(lm, monkeypatch) as c:
        res = prefill(lm, ids, arm, **options)
    return res, {"total": sum(c.macs.values()), **c.macs}


CASES = [  # n, tail, split, extra exact rows, logits rows
    (20, 4, 2, [], 1),
    (30, 6, 1, [5, 11], 3),
    (30, 3, 3, [9], 1),
]


@pytest.mark.parametrize("arch", MAIN)
def test_counts_equal_the_runtime_work(arch, lm_of, monkeypatch):
    """Every arm, several shapes, each part of the count: equal to the brute-force count of the runtime's work."""
    lm = lm_of(arch)
    shape = model_shape(lm.adapter)
    for n, tail, split, rows, keep in CASES:
        ids, maps = tokens(n, seed=n + split), random_maps(lm, split)
        for arm in ARMS:
            opts = dict(split=split, tail=tail, logits_rows=keep)
            if arm.startswith("ridgefill"):
                opts["maps"] = maps
            if arm != "exact":
                opts["exact_rows"] = rows
            probe = 64  # the runtime's default: the last 64 rows (here all)
            if arm == "ridgefill+rows" and split == 1:
                probe = list(range(n - 7, n))
                opts.update(probe=probe, row_share=0.2)
            res, truth = counted(lm, monkeypatch, ids, arm, **opts)
            if arm == "ridgefill+rows":
                assert len(res.exact_rows) > len(set(rows) | {0})  # the selection added rows
            want = prefill_macs(shape, n, tail, split, arm, exact_rows=res.exact_rows, logits_rows=keep, probe=probe)
            assert want == truth, (arch, n, tail, split, arm)
            assert result_macs(shape, res, logits_rows=keep, probe=probe) == want


@pytest.mark.parametrize("arch", MAIN)
def test_key_value_maps_count_equal_the_runtime_work(arch, lm_of, monkeypatch):
    """With key/value maps (on every late attention layer; a Gated DeltaNet layer keeps its input map) a filled row
    costs the map's d x 2 kv_heads x head_dim and no k_proj/v_proj: the count equals the runtime's work, counted by
    brute force, and its maps part is d x 2kv / (d x d) of the input maps' on the attention layers."""
    lm = lm_of(arch)
    ad, shape = lm.adapter, model_shape(lm.adapter)
    n, tail, split = 30, 6, 1
    g = torch.Generator().manual_seed(5)
    d, w = ad.hidden_size, ad.kv_width
    kinds = {l: "input" if ad.is_linear(l) else "kv" for l in range(split, ad.num_layers)}
    maps = {l: (torch.randn(w if k == "kv" else d, d, generator=g) / d**0.5, torch.randn(w if k == "kv" else d,
                                                                                      generator=g))
            for l, k in kinds.items()}  # fmt: skip
    res, truth = counted(lm, monkeypatch, tokens(n, seed=3), "ridgefill", split=split, tail=tail, maps=maps,
                         map_kinds=kinds, logits_rows=1)
    want = prefill_macs(shape, n, tail, split, "ridgefill", exact_rows=res.exact_rows, map_kinds=kinds)
    assert want == truth
    assert result_macs(shape, res, map_kinds=kinds) == want
    plain = prefill_macs(shape, n, tail, split, "ridgefill", exact_rows=res.exact_rows)
    attention = [l for l, k in kinds.items() if k == "kv"]
    assert plain["layers"] - want["layers"] == sum(plain_written(shape, res, l) * shape.kv(l) for l in attention)


def plain_written(shape, res, l) -> int:
    """How many filled rows late layer l writes in `res` (a sliding layer: those some query sees)."""
    from ridgefill.evaluate.macs import _seen

    import numpy as np

    prefix = res.num_rows - res.tail
    queries = np.concatenate([np.asarray(res.exact_rows, dtype=np.int64), np.arange(prefix, res.num_rows)])
    filled = np.setdiff1d(np.arange(prefix), res.exact_rows)
    window = shape.window_of(l)
    return len(_seen(filled, queries, window, res.num_rows) if window else filled)


def test_sliding_layers_count_only_the_rows_they_write(lm_of, monkeypatch):
    """Gemma (window 8): a long prompt slides, and a mid-prefix exact row makes a sliding layer write the filled rows
    just before it; the brute-force count sees the same number of k/v projections and maps."""
    lm = lm_of("gemma3_text")
    shape = model_shape(lm.adapter)
    n, tail, split = 40, 4, 2
    maps = random_maps(lm, split)
    res, truth = counted(lm, monkeypatch, tokens(n, seed=3), "ridgefill", split=split, tail=tail, maps=maps,
                         exact_rows=[17], logits_rows=1)
    assert res.exact_rows == [0, 17]
    assert prefill_macs(shape, n, tail, split, "ridgefill", exact_rows=[0, 17]) == truth
    # One sliding late layer (2) writes rows 10..16 and 29..35 (7 + 7), one full layer (3) all 34 filled rows.
    d = shape.hidden
    assert truth["maps"] == (14 + 34) * d * d


def test_row_count_means_the_first_rows(lm_of):
    shape = model_shape(lm_of("gemma3_text").adapter)
    for arm in ARMS:
        assert prefill_macs(shape, 40, 5, 2, arm, exact_rows=3) == \
            prefill_macs(shape, 40, 5, 2, arm, exact_rows=[0, 1, 2])  # fmt: skip
    assert prefill_macs(shape, 40, 5, 2, "ridgefill") == prefill_macs(shape, 40, 5, 2, "ridgefill", exact_rows=[0])


def test_model_shape_from_adapter_config_and_json(lm_of):
    import json

    for arch in MAIN:
        lm = lm_of(arch)
        shape = model_shape(lm.adapter)
        assert model_shape(lm) == shape == model_shape(lm.model.config)
        assert model_shape(json.loads(lm.model.config.to_json_string())) == shape
        assert shape.kinds == tuple(lm.adapter.layer_kinds) and shape.layers == lm.adapter.num_layers
    assert model_shape(lm_of("gemma3_text").adapter).window == 8
    assert model_shape(lm_of("qwen3_next").adapter).moe == (False, True, False, True)
    with pytest.raises(BadInput, match="no MAC count for architecture 'bert'"):
        model_shape({"model_type": "bert"})


def one_layer(shape, l):
    return replace(shape, kinds=shape.kinds[l : l + 1], moe=shape.moe[l : l + 1])


@pytest.mark.parametrize("arch", MAIN)
def test_exact_is_the_sum_over_layers(arch, lm_of):
    shape = model_shape(lm_of(arch).adapter)
    n, tail = 50, 5
    whole = prefill_macs(shape, n, tail, 0, "exact", logits_rows=2)
    head = whole["head"]
    assert head == 2 * shape.hidden * shape.vocab
    parts = [prefill_macs(one_layer(shape, l), n, tail, 0, "exact", logits_rows=2) for l in range(shape.layers)]
    assert whole["total"] == head + sum(p["total"] - head for p in parts)
    assert whole["maps"] == whole["probe"] == 0
    # A fill with no late layers is the exact prefill (plus the probe, for "+rows")
    for arm in ARMS[1:]:
        fill = prefill_macs(shape, n, tail, shape.layers, arm, exact_rows=[0, 7], logits_rows=2)
        assert fill["total"] - fill["probe"] == whole["total"]
        assert (fill["probe"] > 0) == (arm == "ridgefill+rows")


def test_fill_approaches_the_ceiling():
    """Uniform layers, wide ones and a short prompt (attention, maps and the filled rows' k/v projections small beside
    a layer): the fill's share of exact's work approaches `ceiling`. Without the filled rows' k/v projections the
    layers' share is the ceiling exactly."""
    L, d = 30, 8192
    shape = model_shape({"model_type": "llama", "num_hidden_layers": L, "hidden_size": d, "num_attention_heads": 64,
                         "num_key_value_heads": 1, "intermediate_size": 4 * d, "vocab_size": 1000})
    for n, tail, split in ((64, 16, 12), (128, 32, 20), (100, 100, 7)):
        exact = prefill_macs(shape, n, tail, split, "exact")
        r = ceiling(n, tail, split, L)
        for arm in ("identity", "nofill", "ridgefill"):
            fill = prefill_macs(shape, n, tail, split, arm, exact_rows=0)
            filled_kv = 0 if arm == "nofill" else (n - tail) * (L - split) * shape.kv(0)
            assert (fill["layers"] - filled_kv) / exact["layers"] == pytest.approx(r, rel=1e-12)
            assert fill["total"] / exact["total"] == pytest.approx(r, rel=0.02 if arm != "ridgefill" else 0.1)
        # the maps cost about d^2 per filled row and late layer: a sixth of such a layer
        assert prefill_macs(shape, n, tail, split, "ridgefill", exact_rows=0)["maps"] == \
            (n - tail) * (L - split) * d * d  # fmt: skip


def test_arms_and_refusals(lm_of):
    from ridgefill.runtime import ARMS as RUNTIME_ARMS

    assert ARMS == RUNTIME_ARMS
    shape = model_shape(lm_of("llama").adapter)
    with pytest.raises(BadInput, match="unknown arm"):
        prefill_macs(shape, 10, 2, 1, "ridgefill+vscale")
    with pytest.raises(BadInput, match="exact_rows must be positions in 0..7"):
        prefill_macs(shape, 10, 2, 1, "ridgefill", exact_rows=[8])
    with pytest.raises(BadInput, match="a count of rows must not be negative"):
        prefill_macs(shape, 10, 2, 1, "ridgefill", exact_rows=-1)
    # A count is at most the prefix, as the runtime's anchor: a whole prefix of exact rows
    assert prefill_macs(shape, 10, 2, 1, "ridgefill", exact_rows=9) == \
        prefill_macs(shape, 10, 2, 1, "ridgefill", exact_rows=list(range(8)))  # fmt: skip
    with pytest.raises(BadInput, match="logits_rows"):
        prefill_macs(shape, 10, 2, 1, "ridgefill", logits_rows=3)
    with pytest.raises(BadInput, match="split"):
        prefill_macs(shape, 10, 2, 5, "exact")
    # the runtime's tail bound (rows.tail_fits): an integer 1..n, not a bool or a float that passes the comparison
    for tail in (True, 2.0, 0, 11):
        with pytest.raises(BadInput, match=re.escape(f"a prefill needs n >= 1, 1 <= tail <= n and 0 <= split <= 4 "
                                                     f"(got n=10, tail={tail}, split=1)")):
            prefill_macs(shape, 10, tail, 1, "ridgefill")


def test_import_does_not_import_torch():
    code = "import sys, ridgefill.evaluate.macs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_smollm2_example_in_docs_method():
    """docs/method.md, "Multiply-accumulate counts": SmolLM2-135M (its config) at N = 4096, T = 512, S = 20."""
    shape = model_shape({"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                         "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152})
    g = {arm: prefill_macs(shape, 4096, 512, 20, arm, exact_rows=[0]) for arm in ("exact", "ridgefill", "identity",
                                                                                   "nofill")}
    giga = {arm: round(m["total"] / 1e9) for arm, m in g.items()}
    assert giga == {"exact": 725, "ridgefill": 544, "identity": 532, "nofill": 503}
    assert round(g["exact"]["attention"] / 1e9) == 290 and round(g["ridgefill"]["maps"] / 1e9) == 12
    assert round(g["ridgefill"]["total"] / g["exact"]["total"], 2) == 0.75
    assert round(ceiling(4096, 512, 20, 30), 2) == 0.71
