"""Tests for ridgefill.runtime: the reference fill runtime and its arms, on the tiny random models.

The references are computed independently of the runtime: the stock model's forward / generate, a truncated copy
of the stock model for the "nofill" arm, and maps fitted by least squares on the model's own hidden states.
"""

import copy
import re
import shutil
import time

import numpy as np
import pytest
import torch

from ridgefill.errors import BadInput
from ridgefill.runtime import (ARMS, OUTLIER_RATIO, SlotCache, ceiling, exact_run, fill_rows, greedy, norm_rows,
                               prefill, prefill_from, prefix_prefill, selects_from)
from conftest import TINY_FIXTURES
from tiny import TEXT as TINY_TEXT

ALL = list(TINY_FIXTURES)
# Gemma's tiny config has sliding_window=8, so a 20-row input slides; the hybrids have Gated DeltaNet layers on
# both sides of split 2.
MAIN = ["llama", "gemma3_text", "qwen3_next", "qwen3_5"]
pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def hidden_states(lm, ids):
    with torch.no_grad():
        return lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states  # L+1 x [1, N, d]


def fit_maps(hs, split, layers, rows):
    """Least-squares maps (numpy lstsq, min-norm when under-determined) from h_split to each late layer input."""
    x = hs[split][0, rows].double().numpy()
    xa = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    maps = {}
    for l in range(split, layers):
        y = hs[l][0, rows].double().numpy()
        coef = np.linalg.lstsq(xa, y, rcond=None)[0]  # [d + 1, d]
        maps[l] = (torch.tensor(coef[:-1].T, dtype=torch.float32), torch.tensor(coef[-1], dtype=torch.float32))
    return maps


def random_maps(lm, split, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = lm.adapter.hidden_size
    return {l: (torch.randn(d, d, generator=g) / d**0.5, torch.randn(d, generator=g))
            for l in range(split, lm.adapter.num_layers)}  # fmt: skip


def snapshot(cache):
    """Copies of every tensor a cache holds: keys and values, or a Gated DeltaNet layer's conv and recurrent states."""
    out = []
    for lay in cache.layers:
        if hasattr(lay, "recurrent_states"):
            out += [lay.conv_states[0].clone(), lay.recurrent_states[0].clone()]
        else:
            out += [lay.keys.clone(), lay.values.clone()]
    return out


def same(a, b, atol=0.0):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


def decode_logits(lm, cache, next_ids):
    """Feed next_ids one at a time through the stock model from `cache`; return the logits of each step."""
    out = []
    with torch.no_grad():
        for t in next_ids:
            o = lm.model(input_ids=torch.tensor([[int(t)]]), cache=cache, use_cache=True)
            cache = o.cache
            out.append(o.logits[0, -1].float())
    return torch.stack(out)


# -- 1. exact -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MAIN)
def test_exact_matches_forward_and_generate(arch, lm_of):
    lm = lm_of(arch)
    ids, T = tokens(20), 6
    start = time.perf_counter()
    res = prefill(lm, ids, "exact", split=2, tail=T)
    call = time.perf_counter() - start
    with torch.no_grad():
        ref = lm.model(input_ids=ids[None]).logits[0, -T:]
    assert res.logits.shape == (T, lm.model.config.vocab_size) and res.logits.dtype == torch.float32
    torch.testing.assert_close(res.logits, ref.float(), atol=1e-5, rtol=1e-5)
    # A wall-clock time, so a range: the prefill's own seconds, inside those of the call that made it (not
    # milliseconds, not a total carried over from another call)
    assert 0 < res.seconds <= call

    steps = 6
    with torch.no_grad():
        gen = lm.model.generate(ids[None], attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=steps,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:]  # fmt: skip
    # Greedy decoding continued from the runtime's cache.
    cache, nxt, ours = res.cache, int(res.logits[-1].argmax()), []
    with torch.no_grad():
        for _ in range(steps):
            ours.append(nxt)
            o = lm.model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache = o.cache
            nxt = int(o.logits[0, -1].argmax())
    assert ours == gen.tolist()


# -- 2. ridgefill with tail = N is exact ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL)
@pytest.mark.parametrize("split", [0, 2, 4])
def test_full_tail_equals_exact(arch, split, lm_of):
    lm = lm_of(arch)
    ids = tokens(20, seed=1)
    ex = prefill(lm, ids, "exact", split=split, tail=20)
    rf = prefill(lm, ids, "ridgefill", split=split, tail=20, maps=random_maps(lm, split))
    torch.testing.assert_close(rf.logits, ex.logits, atol=1e-5, rtol=1e-5)
    # The cache continues like the stock one (including Gemma's trimmed sliding-window layers).
    nxt = tokens(3, seed=2)
    torch.testing.assert_close(decode_logits(lm, rf.cache, nxt), decode_logits(lm, ex.cache, nxt), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


# -- 3. identity maps reproduce the identity arm --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL)
def test_identity_maps_equal_identity_arm(arch, lm_of):
    lm = lm_of(arch)
    ids, S, T = tokens(20, seed=3), 2, 5
    d = lm.adapter.hidden_size
    maps = {l: (torch.eye(d), torch.zeros(d)) for l in range(S, lm.adapter.num_layers)}
    rf = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps)
    idn = prefill(lm, ids, "identity", split=S, tail=T)
    torch.testing.assert_close(rf.logits, idn.logits, atol=1e-6, rtol=0)
    same(snapshot(rf.cache), snapshot(idn.cache), atol=1e-6)
    # ... and the fill really changes something: identity is not exact.
    ex = prefill(lm, ids, "exact", split=S, tail=T)
    assert (idn.logits - ex.logits).abs().max() > 1e-3


# -- 4. nofill against a truncated stock model ----------------------------------------------------------------------


def late_model(lm, split):
    """A copy of the stock model holding only layers split..L-1 (and their layer types)."""
    model = copy.deepcopy(lm.model)
    cfg = model.config
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types[split:])
    cfg.num_hidden_layers = cfg.num_hidden_layers - split
    base = model.model
    base.layers = torch.nn.ModuleList(list(base.layers[split:]))
    return model


@pytest.mark.parametrize("arch", MAIN + ["qwen3"])
@pytest.mark.parametrize("split,tail", [(2, 6), (1, 12), (3, 20)])
def test_nofill_equals_truncated_stock_model(arch, split, tail, lm_of):
    lm = lm_of(arch)
    ids = tokens(20, seed=4)
    n, prefix = 20, 20 - tail
    res = prefill(lm, ids, "nofill", split=split, tail=tail, anchor=0)  # row 0 dropped like every prefix row
    hs = hidden_states(lm, ids)
    late = late_model(lm, split)
    with torch.no_grad():
        ref = late(inputs_embeds=hs[split][:, prefix:], position_ids=torch.arange(prefix, n)[None],
                   use_cache=False).logits[0]  # fmt: skip
    torch.testing.assert_close(res.logits, ref.float(), atol=1e-5, rtol=1e-5)
    if tail < n:  # the prefix matters in the exact model
        ex = prefill(lm, ids, "exact", split=split, tail=tail)
        assert (ex.logits - res.logits).abs().max() > 1e-3


@pytest.mark.parametrize("arch", MAIN)
def test_nofill_decodes_like_a_longer_prefill(arch, lm_of):
    """Each decoded token sees what a nofill prefill with that token in its tail sees: the written slots only."""
    lm = lm_of(arch)
    ids, S, T = tokens(20, seed=12), 2, 6
    res = prefill(lm, ids, "nofill", split=S, tail=T)
    assert isinstance(res.cache, SlotCache) and res.cache.next_position == 20
    nxt = tokens(3, seed=13)
    for i, t in enumerate(nxt):
        step = res.cache.step(int(t))
        longer = prefill(lm, torch.cat([ids, nxt[: i + 1]]), "nofill", split=S, tail=T + i + 1)
        torch.testing.assert_close(step, longer.logits[-1], atol=1e-5, rtol=1e-5)
    assert res.cache.next_position == 23


def test_nofill_greedy_with_no_early_layers_is_the_tail_alone(lm_of):
    """At split 0 nothing of the prefix reaches the tail: greedy decoding equals the stock model's on the tail
    (RoPE depends on relative positions only)."""
    lm = lm_of("llama")
    ids, T = tokens(20, seed=14), 7
    res = prefill(lm, ids, "nofill", split=0, tail=T)
    with torch.no_grad():
        ref = lm.model.generate(ids[None, -T:], max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, T:].tolist()  # fmt: skip
    assert greedy(lm, res, 6) == ref


# -- 5. fitted maps -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL)
def test_interpolating_maps_reproduce_exact(arch, lm_of):
    """With fewer prefix rows than d + 1, least squares fits the true late-layer inputs exactly: the fill then writes
    the true keys/values (at the right positions, through the right norms and RoPE) and must match exact."""
    lm = lm_of(arch)
    ids, S, T, n = tokens(20, seed=5), 1, 6, 20
    hs = hidden_states(lm, ids)
    maps = fit_maps(hs, S, lm.adapter.num_layers, list(range(n - T)))
    ex = prefill(lm, ids, "exact", split=S, tail=T)
    rf = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps)
    idn = prefill(lm, ids, "identity", split=S, tail=T)
    err = (rf.logits - ex.logits).abs().max()
    assert err < 1e-3, err
    assert (idn.logits - ex.logits).abs().max() > 100 * err
    # The fill's cache continues decoding like the exact one.
    nxt = tokens(3, seed=6)
    torch.testing.assert_close(decode_logits(lm, rf.cache, nxt), decode_logits(lm, ex.cache, nxt), atol=1e-3,
                               rtol=1e-3)  # fmt: skip


# Calibration text and a prompt, written for this test and held apart: the prompt shares no 8-token run with the
# calibration text. (On uniformly random tokens the tiny llama's layer-3 input is no more linearly predictable from
# h_2 than by h_2 itself: maps fitted on other random sequences do not beat the identity fill there.)
CALIBRATION = [
    TINY_TEXT[: len(TINY_TEXT) // 2],  # in two halves: each within the tiny models' 256 positions
    TINY_TEXT[len(TINY_TEXT) // 2 :],
    "A river runs under the old stone bridge while the birds sing in the trees. The miller opens his door, looks at "
    "the sky and says that rain will come before the evening. " * 2,
    "for i in range(10):\n    total = total + i * i\nprint(total)\n" * 3,
    "The committee met twice and agreed on nothing at all; the second meeting was shorter than the first, and the "
    "minutes were longer. " * 2,
]
PROMPT = ("The keeper of the lighthouse writes in her log every night: the wind, the ships that passed, the oil she "
          "burned. def log(entry):\n    book.append(entry)  # one line per night\nIn winter the nights are long and "
          "the entries are short. ")


def fit_maps_apart(lm, split, texts):
    """Least-squares maps (numpy, float64) from h_split to each late layer's input, fitted on `texts` (each a sequence
    of its own; row 0, the attention sink, left out as capture leaves it out). -> (maps, rows fitted)"""
    xs, ys = [], {l: [] for l in range(split, lm.adapter.num_layers)}
    for text in texts:
        hs = hidden_states(lm, torch.tensor(lm.tokenizer(text)["input_ids"]))
        xs.append(hs[split][0, 1:].double().numpy())
        for l in ys:
            ys[l].append(hs[l][0, 1:].double().numpy())
    x = np.concatenate(xs)
    xa = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    maps = {}
    for l, y in ys.items():
        coef = np.linalg.lstsq(xa, np.concatenate(y), rcond=None)[0]  # [d + 1, d]
        maps[l] = (torch.tensor(coef[:-1].T, dtype=torch.float32), torch.tensor(coef[-1], dtype=torch.float32))
    return maps, len(x)


@pytest.mark.parametrize("arch", MAIN)
def test_fitted_maps_beat_identity(arch, lm_of):
    """Maps fitted on calibration text held apart (about 880 rows for 65 unknowns per output: they cannot interpolate)
    fill a different prompt closer to exact than the identity fill does: on the logits of the tail, and on every
    late layer's keys and values of the filled rows."""
    lm = lm_of(arch)
    S, T = 2, 10
    maps, rows = fit_maps_apart(lm, S, CALIBRATION)
    assert rows > 10 * (lm.adapter.hidden_size + 1)
    ids = torch.tensor(lm.tokenizer(PROMPT)["input_ids"])
    n = len(ids)
    seen = {tuple(c[i : i + 8]) for c in (lm.tokenizer(t)["input_ids"] for t in CALIBRATION) for i in range(len(c) - 7)}
    assert n > 100 and not any(tuple(ids[i : i + 8].tolist()) in seen for i in range(n - 7))  # held apart
    ex = prefill(lm, ids, "exact", split=S, tail=T)
    rf = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps)
    idn = prefill(lm, ids, "identity", split=S, tail=T)
    assert (rf.logits - ex.logits).norm() < (idn.logits - ex.logits).norm()
    # where the fill writes: the late layers' cache entries of the filled prefix rows, against exact's
    filled = slice(1, n - T)  # row 0 runs exactly in every fill arm
    compared = 0
    for i, (e, a, b) in enumerate(zip(snapshot(ex.cache), snapshot(rf.cache), snapshot(idn.cache))):
        # keys / values [1, heads, N, head_dim] of a late layer above S (layer S's input is h_S itself, which both
        # fills write exactly) that keeps every row (a sliding window keeps only tail rows, exact in every arm; a
        # Gated DeltaNet layer holds states, not rows)
        if i // 2 > S and e.dim() == 4 and e.shape[2] == n:
            e, a, b = e[:, :, filled], a[:, :, filled], b[:, :, filled]
            assert (a - e).norm() < (b - e).norm(), (i // 2, "kv"[i % 2])
            compared += 1
    assert compared == 2  # layer 3's keys and values


# -- exact rows -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MAIN)
def test_exact_rows(arch, lm_of):
    lm = lm_of(arch)
    ids, S, T, n = tokens(20, seed=8), 1, 5, 20
    ex = prefill(lm, ids, "exact", split=S, tail=T)
    # All prefix rows exact: the fill is the exact model.
    allrows = prefill(lm, ids, "identity", split=S, tail=T, exact_rows=range(n - T))
    torch.testing.assert_close(allrows.logits, ex.logits, atol=1e-5, rtol=1e-5)
    # Some rows exact, the others filled with their true inputs (interpolating maps): still exact.
    hs = hidden_states(lm, ids)
    maps = fit_maps(hs, S, lm.adapter.num_layers, list(range(n - T)))
    some = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, exact_rows=[0, 3, 4, 11])
    assert (some.logits - ex.logits).abs().max() < 1e-3
    nxt = tokens(2, seed=9)
    torch.testing.assert_close(decode_logits(lm, some.cache, nxt), decode_logits(lm, ex.cache, nxt), atol=1e-3,
                               rtol=1e-3)  # fmt: skip
    # Exact rows change the result of a lossy fill.
    idn = prefill(lm, ids, "identity", split=S, tail=T)
    part = prefill(lm, ids, "identity", split=S, tail=T, exact_rows=[2, 9, 13])
    assert (part.logits - idn.logits).abs().max() > 1e-4


def attention_ranking(lm, ids, split, probe):
    """All rows, most attention received from `probe` rows first (summed over heads of layers < split; ties by
    position), from the eager model's own attention probabilities."""
    eager = copy.deepcopy(lm.model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        att = eager(input_ids=ids[None], output_attentions=True).attentions  # per attention layer [1, heads, N, N]
    # The hybrids' Gated DeltaNet layers have no attention probabilities: the list holds the attention layers only.
    att = dict(zip([l for l in range(lm.adapter.num_layers) if not lm.adapter.is_linear(l)], att))
    received = sum(att[l][0][:, probe].double().sum(dim=(0, 1)) for l in range(split) if l in att)
    return np.argsort(-received.numpy(), kind="stable").tolist()


@pytest.mark.parametrize("arch", MAIN)
def test_attention_selected_rows(arch, lm_of):
    lm = lm_of(arch)
    ids, S, T, n = tokens(40, seed=15), 2, 8, 40
    maps = random_maps(lm, S)
    res = prefill(lm, ids, "ridgefill+rows", split=S, tail=T, maps=maps, row_share=0.2, probe=range(30, 40), anchor=0)
    ranked = [r for r in attention_ranking(lm, ids, S, list(range(30, 40))) if r < n - T]  # prefix rows only
    assert res.exact_rows == sorted(ranked[:8])
    assert res.exact_rows != list(range(8))  # not just the first rows
    same = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, exact_rows=res.exact_rows, anchor=0)
    torch.testing.assert_close(res.logits, same.logits, atol=1e-6, rtol=1e-6)
    # Default probe: the last 64 rows (here all 40); default share 10 %.
    assert len(prefill(lm, ids, "ridgefill+rows", split=S, tail=T, maps=maps, anchor=0).exact_rows) == 4
    # With the default anchor, row 0 is exact besides the selected rows.
    ranked = [r for r in attention_ranking(lm, ids, S, list(range(n))) if r < n - T]
    assert prefill(lm, ids, "ridgefill+rows", split=S, tail=T, maps=maps).exact_rows == sorted({0, *ranked[:4]})


# -- the work is skipped --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MAIN)
def test_late_layers_run_only_tail_rows(arch, lm_of):
    lm = lm_of(arch)
    ids, S, T = tokens(20, seed=10), 2, 4
    seen = {}
    hooks = [lm.adapter.layers[l].mlp.register_forward_hook(
        lambda mod, args, out, l=l: seen.__setitem__(l, args[0].shape[-2])) for l in range(lm.adapter.num_layers)]
    try:
        prefill(lm, ids, "ridgefill", split=S, tail=T, maps=random_maps(lm, S), exact_rows=[7])
    finally:
        for h in hooks:
            h.remove()
    assert seen == {0: 20, 1: 20, 2: T + 2, 3: T + 2}  # the tail, row 7 and row 0 (the anchor)


@pytest.mark.parametrize("arch", MAIN)
@pytest.mark.parametrize("arm", ["ridgefill", "identity", "nofill"])
def test_row_0_runs_exactly_in_every_fill_arm(arch, arm, lm_of):
    """The first row (the attention sink, which the fit leaves out) is an exact row unless anchor=0: the default
    equals anchor=0 with exact_rows=[0], and differs from filling it."""
    lm = lm_of(arch)
    ids, S, T = tokens(20, seed=11), 2, 4
    maps = random_maps(lm, S) if arm == "ridgefill" else None
    res = prefill(lm, ids, arm, split=S, tail=T, maps=maps)
    assert res.exact_rows == [0]
    same = prefill(lm, ids, arm, split=S, tail=T, maps=maps, exact_rows=[0], anchor=0)
    torch.testing.assert_close(res.logits, same.logits, atol=0, rtol=0)
    filled = prefill(lm, ids, arm, split=S, tail=T, maps=maps, anchor=0)
    assert filled.exact_rows == [] and (filled.logits - res.logits).abs().max() > 1e-4
    with pytest.raises(BadInput, match="anchor must be a non-negative number of rows"):
        prefill(lm, ids, arm, split=S, tail=T, maps=maps, anchor=-1)


def norm_between(norms) -> float:
    """An exact-row norm for the rows' norms [n] (float64) that at least 3 and at most half of them exceed: the
    middle of the widest relative gap among the largest norms, so that no row lies within float32 round-off of it."""
    top = torch.sort(norms, descending=True).values
    k = max(range(3, len(top) // 2 + 1), key=lambda k: float(top[k - 1] / top[k]))  # top k above, the rest below
    assert float(top[k - 1] / top[k]) > 1 + 1e-4
    return float((top[k - 1] + top[k]) / 2)


@pytest.mark.parametrize("arch", MAIN)
@pytest.mark.parametrize("arm", ["ridgefill", "identity", "nofill"])
def test_rows_above_the_exact_norm_run_exactly(arch, arm, lm_of):
    """Prefix rows whose split state's norm exceeds `exact_norm` (brute force: float64 norms of the stock model's
    hidden states) join the exact rows, in prefill and prefill_from alike; the result equals naming those rows as
    exact rows with the rule off. A tiny random model has no real later sink, so a low norm makes some."""
    lm = lm_of(arch)
    ids, S, T = tokens(24, seed=31), 2, 6
    maps = random_maps(lm, S) if arm == "ridgefill" else None
    norms = hidden_states(lm, ids)[S][0, : 24 - T].double().norm(dim=-1)
    tau = norm_between(norms)
    want = sorted({0} | set(torch.nonzero(norms > tau).flatten().tolist()))
    assert 2 < len(want) < 24 - T
    res = prefill(lm, ids, arm, split=S, tail=T, maps=maps, exact_norm=tau)
    assert res.exact_rows == want
    same = prefill(lm, ids, arm, split=S, tail=T, maps=maps, exact_rows=want)
    torch.testing.assert_close(res.logits, same.logits, atol=0, rtol=0)
    run = exact_run(lm, ids, splits=[S], logits_rows=T)
    got = prefill_from(lm, run, arm, split=S, tail=T, maps=maps, exact_norm=tau)
    assert got.exact_rows == want == fill_rows(lm, run, arm, split=S, tail=T, maps=maps, exact_norm=tau)
    torch.testing.assert_close(got.logits, res.logits, atol=1e-4, rtol=1e-4)
    # Without a norm (the default) no row runs exactly for its norm; a norm above every row changes nothing.
    assert prefill(lm, ids, arm, split=S, tail=T, maps=maps).exact_rows == [0]
    assert prefill(lm, ids, arm, split=S, tail=T, maps=maps, exact_norm=float(norms.max()) * 2).exact_rows == [0]
    for bad in (-1, 0, True, float("inf"), float("nan"), "3"):
        with pytest.raises(BadInput, match=r"exact_norm must be None \(off\) or a positive norm"):
            prefill(lm, ids, arm, split=S, tail=T, maps=maps, exact_norm=bad)


@pytest.mark.parametrize("arch", MAIN)
def test_the_exact_rows_of_a_prefix_do_not_depend_on_later_rows(arch, lm_of):
    """The point of the rule: a row's verdict is its own. A chunked computation (the prompt fed 8 rows at a time,
    each chunk's rows judged as they arrive, from a forward of the rows so far) chooses the prefill's exact rows;
    a prompt and a longer one with the same start choose the same exact rows among their shared prefix rows, and
    so does `prefix_prefill`, which never sees the tail. (20x a prefix's median would move with the rows after.)"""
    lm = lm_of(arch)
    ids, S, T, n = tokens(40, seed=32), 2, 6, 40
    maps = random_maps(lm, S)
    tau = norm_between(hidden_states(lm, ids)[S][0, : n - T].double().norm(dim=-1))
    chunked = {0}
    for start in range(0, n - T, 8):
        end = min(start + 8, n - T)
        h = exact_run(lm, ids[:end], splits=[S]).states[S]  # the rows so far: what a chunk's rows can see
        chunked |= {start + i for i in torch.nonzero(norm_rows(h[start:end], tau)).flatten().tolist()}
    full = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, exact_norm=tau)
    assert full.exact_rows == sorted(chunked) and len(chunked) > 2
    for m in (14, 22, 30):
        short = prefill(lm, ids[:m], "ridgefill", split=S, tail=T, maps=maps, exact_norm=tau)
        assert short.exact_rows == [r for r in full.exact_rows if r < m - T]
        if arch in ("llama", "gemma3_text"):  # prefix_prefill fails on the hybrids (before this rule too)
            part = prefix_prefill(lm, ids[:m], "ridgefill", split=S, tail=T, maps=maps, exact_norm=tau)
            assert part.exact_rows == short.exact_rows


def test_the_exact_row_rule_against_brute_force():
    """`norm_rows`: a row runs exactly iff its L2 norm, in float32, exceeds the norm; against float64 numpy norms,
    for float32 and bfloat16 states, each row judged alone (the same verdict in any company)."""
    from ridgefill.runtime.rows import with_norm_rows

    rng = np.random.default_rng(5)
    h = (rng.standard_normal((300, 64)) * rng.uniform(0.1, 50.0, (300, 1))).astype(np.float32)  # [300, 64]
    for x in (torch.from_numpy(h), torch.from_numpy(h).bfloat16()):
        norms = np.linalg.norm(x.double().numpy(), axis=1)  # [300] float64
        tau = 1.5 * float(np.median(norms))
        assert np.abs(norms / tau - 1).min() > 1e-5  # no row within float32 round-off of the norm
        want = norms > tau
        assert 0 < want.sum() < 300
        assert np.array_equal(norm_rows(x, tau).numpy(), want)
        perm = torch.from_numpy(rng.permutation(300))
        assert np.array_equal(norm_rows(x[perm], tau).numpy(), want[perm.numpy()])
        assert all(bool(norm_rows(x[i : i + 1], tau)[0]) == want[i] for i in range(300))
        assert with_norm_rows([0, 7], x, 200, tau) == sorted({0, 7} | set(np.nonzero(want[:200])[0].tolist()))
    assert not norm_rows(torch.from_numpy(h), None).any()
    assert with_norm_rows([0], torch.from_numpy(h), 300, None) == [0]


def test_the_exact_row_norm_is_4x_the_median_norm():
    """`fit_exact_norm` (what solve records from the held-out rows): 4 x numpy's median of the float64 row norms
    (OUTLIER_RATIO, or the ratio given), the mean of the two middle ones for an even count."""
    from ridgefill.runtime.rows import fit_exact_norm

    rng = np.random.default_rng(6)
    for rows in (2047, 2048):
        x = (rng.standard_normal((rows, 48)) * rng.uniform(0.5, 2.0, (rows, 1))).astype(np.float32)
        norms = np.sqrt((x.astype(np.float64) ** 2).sum(axis=1))
        s = np.sort(norms)
        median = s[rows // 2] if rows % 2 else (s[rows // 2 - 1] + s[rows // 2]) / 2
        assert fit_exact_norm(x) == pytest.approx(4.0 * median, rel=1e-14)
        assert fit_exact_norm(x, 10.0) == pytest.approx(10.0 * median, rel=1e-14)
    for bad in (np.zeros((0, 4), np.float32), np.zeros((3, 4), np.float32)):
        with pytest.raises(ValueError):
            fit_exact_norm(bad)


def test_capture_leaves_out_rows_by_its_chunk_median():
    """Capture's own rule (which rows it leaves out of the fit): above 4x its chunk's median norm by default."""
    from ridgefill.capture.run import CaptureConfig
    from ridgefill.runtime.rows import outlier_rows

    h = torch.ones(9, 4)
    h[3] *= 25  # 25x the median norm
    h[5] *= 3.9
    h[7] *= 4.1
    assert torch.nonzero(outlier_rows(h)).flatten().tolist() == [3, 7]
    assert OUTLIER_RATIO == 4
    assert torch.nonzero(outlier_rows(h, 3)).flatten().tolist() == [3, 5, 7]
    assert not outlier_rows(h, 0).any()
    assert CaptureConfig().outlier_ratio == OUTLIER_RATIO


# -- eager attention ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MAIN)
def test_eager_attention_matches_sdpa(arch, lm_of):
    """Masks are built per attention implementation: boolean for sdpa, additive for eager."""
    lm = lm_of(arch)
    eager = copy.copy(lm)
    eager.model = copy.deepcopy(lm.model)
    eager.model.set_attn_implementation("eager")
    assert eager.model.config._attn_implementation == "eager"
    eager.adapter = type(lm.adapter)(eager.model)
    ids, S, T = tokens(20, seed=11), 2, 6
    for arm in ("identity", "nofill"):
        a = prefill(lm, ids, arm, split=S, tail=T)
        b = prefill(eager, ids, arm, split=S, tail=T)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    ex = prefill(eager, ids, "exact", split=S, tail=20)
    full = prefill(eager, ids, "identity", split=S, tail=20)
    torch.testing.assert_close(full.logits, ex.logits, atol=1e-5, rtol=1e-5)


# -- ceiling and refusals -------------------------------------------------------------------------------------------


def test_ceiling():
    assert ceiling(2048, 512, 12, 30) == pytest.approx(0.55)  # the example in docs/method.md, "Compute ceiling"
    assert ceiling(100, 100, 3, 10) == 1.0
    assert ceiling(100, 10, 10, 10) == 1.0
    assert ceiling(100, 0, 0, 10) == 0.0
    with pytest.raises(BadInput):
        ceiling(10, 11, 1, 4)


def test_refusals(lm_of):
    lm = lm_of("llama")
    ids = tokens(10)
    assert ARMS == ("exact", "ridgefill", "identity", "nofill", "ridgefill+rows")
    eye = {l: (torch.eye(64), torch.zeros(64)) for l in range(1, 4)}
    for kwargs in (
        dict(arm="bogus", split=1, tail=2),
        dict(arm="identity", split=1, tail=0),
        dict(arm="identity", split=1, tail=11),
        dict(arm="identity", split=5, tail=2),
        dict(arm="ridgefill", split=1, tail=2),  # no maps
        dict(arm="ridgefill", split=1, tail=2, maps={1: (torch.eye(64), torch.zeros(64))}),  # layers 2, 3 missing
        dict(arm="identity", split=1, tail=2, exact_rows=[8]),  # a tail row
        dict(arm="ridgefill+rows", split=1, tail=2, maps=eye, row_share=1.0),
        dict(arm="ridgefill+rows", split=1, tail=2, maps=eye, probe=[10]),
    ):
        with pytest.raises(BadInput):
            prefill(lm, ids, **kwargs)
    for tail in (True, 2.0):  # 1 <= tail <= 10 holds for both; neither is a number of rows
        says = f"tail must be in 1..10 (the number of input rows), got {tail!r}"
        with pytest.raises(BadInput, match=re.escape(says)):
            prefill(lm, ids, "identity", split=1, tail=tail)


def test_the_row_rule_against_brute_force(lm_of):
    """rows.py's rule, the one the runtime, the vLLM plan and the MAC count use: A <= p < N - T, the anchor's rows
    below the tail, a tail in 1..N; and the runtime's exact rows of a fill are the anchor's rows."""
    from ridgefill.runtime.rows import anchor_rows, is_prefix_row, prefix_end, tail_fits

    for n in range(0, 12):
        for tail in range(0, 14):
            assert tail_fits(tail, n) == (1 <= tail <= n)
            assert tail_fits(np.int64(tail), n) == (1 <= tail <= n)
            for anchor in range(0, 5):
                want = [p for p in range(n) if p >= anchor and p < n - tail]
                assert [p for p in range(n) if is_prefix_row(p, n, tail=tail, anchor=anchor)] == want
                pos = np.arange(n)
                assert np.flatnonzero(is_prefix_row(pos, np.full(n, n), tail=tail, anchor=anchor)).tolist() == want
                assert list(anchor_rows(n, tail=tail, anchor=anchor)) == [p for p in range(anchor) if p < n - tail]
                assert prefix_end(n, tail) == n - tail
    assert not tail_fits(True, 5) and not tail_fits(2.0, 5) and not tail_fits(None, 5)
    lm = lm_of("llama")
    for n, tail, anchor in ((10, 3, 4), (6, 3, 5), (4, 4, 1)):  # an anchor longer than the prefix stops at the tail
        res = prefill(lm, tokens(n), "identity", split=1, tail=tail, anchor=anchor)
        assert res.exact_rows == list(anchor_rows(n, tail=tail, anchor=anchor))


# -- maps from a release folder -------------------------------------------------------------------------------------


def write_tiny_release(lm, folder, maps, split, tail, layers=None, fit=None, protected=None):
    """A `ridgefill-maps/2` folder (f32 input maps) holding `maps` {l: (W, b)} for the loaded model `lm`, through the
    release writer itself; `layers` (default: the maps' keys) and `fit` go into the manifest, `protected` (token
    ids) into a protected-token table."""
    from ridgefill.formats.release import write_release

    ref, ad = lm.ref, lm.adapter
    manifest = {"model": {"name": ref.name, "revision": ref.revision, "architecture": ref.model_type,
                          "num_layers": ad.num_layers, "hidden_size": ad.hidden_size, "num_kv_heads": ad.num_kv_heads,
                          "head_dim": ad.head_dim, "fingerprint": ref.fingerprint},
                "split": split, "tail_default": tail,
                "layers": [{"index": l, "kind": ad.layer_kinds[l], "map": "input"} for l in sorted(layers or maps)],
                "fit": fit if fit is not None else {"exact_norm": 1e6, "skip_first_rows": 1}}  # no row is above it
    arrays = {l: {"weight": np.asarray(W, np.float32), "bias": np.asarray(b, np.float32)} for l, (W, b) in maps.items()}
    table = {} if protected is None else {"protected": np.array(protected, np.int32),
                                          "protected_facts": {"share": 0.25, "types": len(protected)}}
    return write_release(folder, arrays, manifest, "tiny release\n", weight_dtype="f32", **table)


def test_load_release_maps(lm_of, tmp_path):
    from ridgefill.runtime import ReleaseMaps, load_release_maps

    lm = lm_of("llama")
    maps = random_maps(lm, 1, seed=3)
    write_tiny_release(lm, tmp_path / "rel", maps, 1, 5)
    rel = load_release_maps(lm, tmp_path / "rel")
    assert isinstance(rel, ReleaseMaps) and (rel.split, rel.tail, rel.folder) == (1, 5, tmp_path / "rel")
    assert rel.manifest["model"]["fingerprint"] == lm.ref.fingerprint and sorted(rel.maps) == [1, 2, 3]
    for l, (W, b) in maps.items():  # f32 in the folder: the same numbers back, as float32 tensors
        assert rel.maps[l][0].dtype == torch.float32
        assert torch.equal(rel.maps[l][0], W) and torch.equal(rel.maps[l][1], b)
    ids = tokens(16, seed=4)
    a = prefill(lm, ids, "ridgefill", split=rel.split, tail=rel.tail, maps=rel.maps)
    b = prefill(lm, ids, "ridgefill", split=1, tail=5, maps=maps)
    assert torch.equal(a.logits, b.logits)


def test_a_release_prescribes_the_rows_its_fit_left_out(lm_of, tmp_path):
    """`rel.options()` carries the fit's rules: the first `fit.skip_first_rows` rows and the prefix rows above
    `fit.exact_norm` run exactly, as eval applies them too."""
    from ridgefill.evaluate.source import load_source
    from ridgefill.runtime import load_release_maps

    lm = lm_of("llama")
    maps, ids = random_maps(lm, 1, seed=3), tokens(24, seed=4)
    h = exact_run(lm, ids, splits=[1]).states[1]
    norms = h.float().norm(dim=-1)[:19]
    tau = float(norms.max()) * 0.999  # the largest row is just over it
    big = int(norms.argmax())
    for fit, anchor, rows in (({"skip_first_rows": 3, "exact_norm": tau}, 3, {0, 1, 2, big}),
                              ({"skip_first_rows": 1, "exact_norm": float(norms.max()) * 2}, 1, {0})):
        write_tiny_release(lm, tmp_path / "rel", maps, 1, 5, fit=fit)
        rel = load_release_maps(lm, tmp_path / "rel")
        assert (rel.anchor, rel.exact_norm) == (anchor, fit["exact_norm"])
        assert rel.options() == {"split": 1, "tail": 5, "maps": rel.maps, "map_kinds": {1: "input", 2: "input", 3: "input"},
                                 "anchor": anchor, "exact_norm": fit["exact_norm"]}
        res = prefill(lm, ids, "ridgefill", **rel.options())
        assert set(res.exact_rows) == rows
        src = load_source(None, str(tmp_path / "rel"))
        assert (src.anchor, src.exact_norm) == (anchor, fit["exact_norm"])
        shutil.rmtree(tmp_path / "rel")
    with pytest.raises(ValueError, match=re.escape("'fit.skip_first_rows' is \"1\", expected an integer >= 0")):
        write_tiny_release(lm, tmp_path / "rel", maps, 1, 5, fit={"skip_first_rows": "1", "exact_norm": 10.0})


def test_load_release_maps_refusals(lm_of, tmp_path):
    from ridgefill.runtime import load_release_maps

    llama, qwen = lm_of("llama"), lm_of("qwen2")
    write_tiny_release(qwen, tmp_path / "other", random_maps(qwen, 1), 1, 5)  # same shapes, another model
    with pytest.raises(BadInput, match=r"the maps were made for another model \(fingerprint [0-9a-f]{12}\)"):
        load_release_maps(llama, tmp_path / "other")
    maps = random_maps(llama, 1)
    # a ridgefill-maps/2 release covers split..L-1 with maps of the model's widths: such folders are never written
    with pytest.raises(ValueError, match=re.escape("'layers' has the indices [2, 3], expected 1..3 ascending")):
        write_tiny_release(llama, tmp_path / "short", {l: maps[l] for l in (2, 3)}, 1, 5)  # split 1, no layer 1
    with pytest.raises(ValueError, match=re.escape("'split' is 6, expected an integer from 1 to 3")):
        write_tiny_release(llama, tmp_path / "deep", maps, 6, 5)
    small = {l: (W[:32, :32], b[:32]) for l, (W, b) in maps.items()}
    with pytest.raises(ValueError, match=re.escape("layer 1 map has shape [32, 32], expected [64, 64]")):
        write_tiny_release(llama, tmp_path / "small", small, 1, 5)
    write_tiny_release(llama, tmp_path / "bad", maps, 1, 5)
    blob = (tmp_path / "bad" / "maps.safetensors").read_bytes()
    (tmp_path / "bad" / "maps.safetensors").write_bytes(blob[:-4] + bytes(4))  # a byte changed on disk
    with pytest.raises(BadInput, match="sha256"):
        load_release_maps(llama, tmp_path / "bad")
    vocab = llama.adapter.vocab_size  # a protected-token table of another tokenizer: an id past the vocabulary
    write_tiny_release(llama, tmp_path / "table", maps, 1, 5, protected=[3, vocab - 1])
    load_release_maps(llama, tmp_path / "table")
    write_tiny_release(llama, tmp_path / "past", maps, 1, 5, protected=[3, vocab])
    with pytest.raises(BadInput) as e:
        load_release_maps(llama, tmp_path / "past")
    assert str(e.value) == (f"{tmp_path / 'past'}: the protected-token table holds token id {vocab}, past the "
                            f"vocabulary of '{llama.ref.spec}' ({vocab} tokens: ids 0..{vocab - 1})")


def test_sliding_layers_fill_only_the_rows_a_query_sees(lm_of):
    """Gemma's sliding layers (window 8 here) write keys only for filled rows within a window of the next query row
    (an exact row or the tail); full layers fill every prefix row. Row 0 and row 5 are exact, the tail is 26..29."""
    lm = lm_of("gemma3_text")
    ids, S, T = tokens(30, seed=12), 2, 4
    assert lm.adapter.layer_kinds[2] == "sliding_attention" and lm.adapter.layer_kinds[3] == "full_attention"
    rows, kv = {}, lm.adapter.kv

    def spy(l, x):
        rows[l] = x.shape[0]
        return kv(l, x)

    lm.adapter.kv = spy
    try:
        res = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=random_maps(lm, S), exact_rows=[5])
    finally:
        del lm.adapter.kv
    assert res.exact_rows == [0, 5]
    assert rows == {2: len([*range(1, 5), *range(19, 26)]), 3: 26 - 2}


# -- shared exact work: exact_run + prefill_from ----------------------------------------------------------------------


def _same_cache(lm, a, b, nxt):
    """Two prefills' caches continue alike: the same logits for the same next tokens (stock model or SlotCache)."""
    if isinstance(a, SlotCache):
        for t in nxt:
            torch.testing.assert_close(a.step(int(t)), b.step(int(t)), atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(decode_logits(lm, a, nxt), decode_logits(lm, b, nxt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ALL)
def test_prefill_from_an_exact_run_equals_prefill(arch, lm_of):
    """Every fill arm at every split, built from one exact run, equals the arm's own prefill: logits, cache
    (decoding continues alike) and exact rows; the exact arm equals prefill's exact arm bit for bit. One run
    serves all of it, and building arms (and decoding from them) leaves the run as it was."""
    lm = lm_of(arch)
    L = lm.adapter.num_layers
    ids, T = tokens(20, seed=21), 6
    splits = list(range(L + 1))
    run = exact_run(lm, ids, splits=splits, logits_rows=T)
    ex = prefill(lm, ids, "exact", split=0, tail=T)
    assert torch.equal(run.logits, ex.logits)
    nxt = tokens(3, seed=22)
    _same_cache(lm, run.result(T).cache, ex.cache, nxt)
    maps = {S: random_maps(lm, S, seed=S) for S in splits}
    for S in splits:
        for arm in ("ridgefill", "identity", "nofill"):
            kw = dict(split=S, tail=T, maps=maps[S] if arm == "ridgefill" else None, exact_rows=[4])
            got, want = prefill_from(lm, run, arm, **kw), prefill(lm, ids, arm, **kw)
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
            assert got.exact_rows == want.exact_rows == [0, 4] == fill_rows(lm, run, arm, **kw)
            _same_cache(lm, got.cache, want.cache, nxt)
        # "+rows" selects its rows from the run's keys where every layer below the split kept them all
        kw = dict(split=S, tail=T, maps=maps[S], row_share=0.3, probe=[10, 11, 12, 13])
        if selects_from(lm, run, S):
            got, want = prefill_from(lm, run, "ridgefill+rows", **kw), prefill(lm, ids, "ridgefill+rows", **kw)
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
            assert got.exact_rows == want.exact_rows == fill_rows(lm, run, "ridgefill+rows", **kw)
            assert len(got.exact_rows) >= 6  # row 0 and the 30 % (6 of 20 rows) most attended from the probe rows
            _same_cache(lm, got.cache, want.cache, nxt)
        else:
            assert S > 0 and arch in ("gemma3_text", "qwen3_next", "qwen3_5")
            with pytest.raises(BadInput, match="sliding-window or Gated DeltaNet layer there"):
                prefill_from(lm, run, "ridgefill+rows", **kw)
    again = prefill_from(lm, run, "ridgefill", split=2, tail=T, maps=maps[2], logits_rows=1)
    torch.testing.assert_close(again.logits, prefill(lm, ids, "ridgefill", split=2, tail=T, maps=maps[2]).logits[-1:],
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(exact_run(lm, ids, splits=[], logits_rows=T).logits, run.logits)


def test_prefill_from_refusals(lm_of):
    lm = lm_of("llama")
    ids = tokens(12)
    run = exact_run(lm, ids, splits=[2])
    with pytest.raises(BadInput, match="kept no state for split 1"):
        prefill_from(lm, run, "identity", split=1, tail=4)
    with pytest.raises(BadInput, match="not 'exact' .use prefill"):
        prefill_from(lm, run, "exact", split=2, tail=4)
    with pytest.raises(BadInput, match="logits_rows must be in 1..4"):
        prefill_from(lm, run, "identity", split=2, tail=4, logits_rows=5)
    with pytest.raises(BadInput, match="out of range"):
        exact_run(lm, ids, splits=[lm.adapter.num_layers + 1])


@pytest.mark.parametrize("arch", MAIN)
def test_greedy_batch_equals_greedy_on_each(arch, lm_of):
    """Decoding several prefills in one batch gives each the tokens `greedy` gives it alone: as they stop at
    different steps (a stop rule, the token budget) and leave the batch, and with Gemma's sliding layers (window 8,
    so the caches slide while decoding). The prefills' own caches are left as they were."""
    from ridgefill.runtime import greedy_batch

    lm = lm_of(arch)
    S, T = 2, 6
    runs = [exact_run(lm, tokens(20, seed=k), splits=[S, 3]) for k in range(3)]
    make = lambda: [runs[0].result(T), runs[1].result(T), prefill_from(lm, runs[2], "identity", split=S, tail=T),  # noqa: E731
                    prefill_from(lm, runs[0], "ridgefill", split=3, tail=T, maps=random_maps(lm, 3, seed=4)),
                    prefill_from(lm, runs[1], "ridgefill", split=S, tail=T, maps=random_maps(lm, S, seed=5))]
    stop = lambda t: len(t) >= 1 + t[0] % 7  # noqa: E731
    for max_new, rule in ((12, None), (12, stop), (1, None)):
        batch = make()
        before = [snapshot(r.cache) for r in batch]
        got = greedy_batch(lm, batch, max_new, stop=rule)
        for r, was in zip(batch, before):
            same(snapshot(r.cache), was)  # not decoded into
        want = [greedy(lm, r, max_new, stop=rule) for r in make()]
        assert got == want and all(1 <= len(t) <= max_new for t in got)
        if rule is stop:
            assert len({len(t) for t in got}) > 1  # they left the batch at different steps


@pytest.mark.parametrize("arch", MAIN)
def test_decoding_cache_continues_like_the_stock_cache(arch, lm_of):
    """decoding_cache (rows written in place, room for one row, so it has to grow) continues a prefill exactly as
    the prefill's own DynamicCache does, and leaves that cache as it was."""
    from ridgefill.runtime.cache import decoding_cache

    lm = lm_of(arch)
    res = prefill(lm, tokens(20, seed=41), "ridgefill", split=2, tail=6, maps=random_maps(lm, 2, seed=6))
    before = snapshot(res.cache)
    nxt = tokens(5, seed=42)
    got = decode_logits(lm, decoding_cache(lm, [res.cache], room=1), nxt)
    same(snapshot(res.cache), before)
    torch.testing.assert_close(got, decode_logits(lm, copy.deepcopy(res.cache), nxt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_copied_linear_layers_count_their_own_rows(arch, lm_of):
    """transformers 5.25 counts a Gated DeltaNet layer's rows in a tensor (`cumulative_length_linear`) that decoding
    advances in place: a copy for decoding (`copy_layer`, the stacked layers of `decoding_cache`) has its own, so
    decoding from it leaves the original's count (and so the next copy's positions) as they were. Set here by hand
    where the installed transformers has no such count."""
    from ridgefill.runtime.cache import copy_layer, decoding_cache

    lm = lm_of(arch)
    res = prefill(lm, tokens(20, seed=41), "ridgefill", split=2, tail=6, maps=random_maps(lm, 2, seed=6))
    linear = [layer for layer in res.cache.layers if hasattr(layer, "recurrent_states")]
    assert linear
    for layer in linear:
        layer.cumulative_length_linear = torch.tensor(20)
    for copy_of in (copy_layer(linear[0]), decoding_cache(lm, [res.cache, res.cache], room=1).layers[
            res.cache.layers.index(linear[0])]):
        copy_of.cumulative_length_linear.add_(1)
        assert int(copy_of.cumulative_length_linear) == 21 and int(linear[0].cumulative_length_linear) == 20


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_fills_counts_a_controls_rows_without_its_fill(arch, lm_of):
    """`fills(counted=...)`: a selector arm wanted only for its row count gets no result, and its controls get the
    same rows and results as when the selector is built in full; "+rows" from the exact run where it kept every
    row's keys (llama), from a prefill of its own where a sliding layer did not (Gemma)."""
    from ridgefill.evaluate.arms import parse_arm
    from ridgefill.evaluate.measure import fills
    from ridgefill.evaluate.source import MapsSource
    from ridgefill.runtime import ExactRun

    lm = lm_of(arch)
    ids, S, T = tokens(40, seed=51), 2, 6
    run = exact_run(lm, ids, splits=[S], logits_rows=T)
    src = MapsSource(maps=random_maps(lm, S, seed=7), split=S, fingerprint="", ident="", calibration=frozenset(),
                     release_dir=None, protected=frozenset(int(t) for t in ids[5:9]), row_share=0.2)
    assert selects_from(lm, run, S) == (arch == "llama")
    for sel in ("ridgefill+rows", "ridgefill+protected"):
        arms = [parse_arm(sel), parse_arm(f"{sel}:tail")]
        full, n_full = fills(lm, run, src, arms, T)
        part, n_part = fills(lm, run, src, arms, T, counted={sel})
        assert n_part == n_full and n_full[sel] > 0 and sel not in part
        torch.testing.assert_close(part[f"{sel}:tail"].logits, full[f"{sel}:tail"].logits, atol=0, rtol=0)
        assert part[f"{sel}:tail"].tail == T + n_full[sel]
        # timed, as the sweep times a recommended control: every arm a prefill of its own, no exact run to build on
        bare = ExactRun(ids=run.ids, logits=None, cache=None, states={}, seconds=0.0)
        timed, n_timed = fills(lm, bare, src, arms, T, timed=True, counted={sel})
        assert n_timed == n_full and list(timed) == [f"{sel}:tail"]
