"""The fill's corrections (ridgefill.runtime.corrections): the math against brute force in float64, the runtime's
corrected caches against the uncorrected ones, and the refusals."""

import numpy as np
import pytest
import torch

from ridgefill.errors import BadInput
from ridgefill.runtime import prefill
from ridgefill.runtime.corrections import apply_kv, check_corrections, filled_share, kv_params

pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def random_maps(lm, split, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = lm.adapter.hidden_size
    return {l: (torch.eye(d) + 0.3 * torch.randn(d, d, generator=g) / d**0.5, 0.1 * torch.randn(d, generator=g))
            for l in range(split, lm.adapter.num_layers)}  # fmt: skip


# -- the math ----------------------------------------------------------------------------------------------------


def test_filled_share_is_the_product_of_later_gates():
    rng = np.random.default_rng(0)
    g = -rng.exponential(0.3, size=(9, 3))  # log decays <= 0, per row and value head
    filled = np.array([0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=bool)
    w = np.array([[np.prod(np.exp(g[t + 1 :, h])) for h in range(3)] for t in range(9)])  # product of later gates
    want = w[filled].sum(0) / w.sum(0)
    got = filled_share(torch.tensor(g), torch.tensor(filled)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.all(filled_share(torch.tensor(g), torch.zeros(9, dtype=torch.bool)).numpy() == 0)


def _decayed_sum(g, updates):
    """The state of a recurrence without the delta rule's erase term: S_t = exp(g_t) S_{t-1} + u_t."""
    s = np.zeros(updates.shape[1:])
    for t in range(len(g)):
        s = np.exp(g[t])[:, None, None] * s + updates[t]
    return s


def test_state_correction_removes_a_constant_shift_exactly():
    """If the fill shifts every filled row's update by the same delta, the offset measured with every row filled
    (exact state - filled state), scaled by the filled rows' share at the end of another prefix, removes the shift
    from that prefix's state exactly, whichever rows are exact; another scale leaves part of it."""
    rng = np.random.default_rng(1)
    P, H, dk, dv = 12, 2, 3, 4
    g = -rng.exponential(0.2, size=(P, H))
    u = rng.normal(size=(P, H, dk, dv))
    delta = rng.normal(size=(H, dk, dv))
    offset = _decayed_sum(g, u) - _decayed_sum(g, u + delta)  # measured with every row filled (share 1)
    for filled in (np.arange(P) % 3 != 0, np.arange(P) >= 4, np.ones(P, bool)):
        exact_state = _decayed_sum(g, u)
        filled_state = _decayed_sum(g, u + delta * filled[:, None, None, None])
        share = filled_share(torch.tensor(g), torch.tensor(filled)).numpy()
        np.testing.assert_allclose(filled_state + share[:, None, None] * offset, exact_state, atol=1e-12)
        if not filled.all():
            assert np.abs(filled_state + offset - exact_state).max() > 1e-3  # unscaled, it overshoots


def test_kv_params_by_brute_force():
    rng = np.random.default_rng(2)
    kt, vt, kp, vp = (rng.normal(size=(7, 2, 5)) for _ in range(4))
    got = kv_params(("vscale", "kscale", "kshift"), *(torch.tensor(a, dtype=torch.float32) for a in (kt, vt, kp, vp)))
    vs = (np.linalg.norm(vt, axis=-1) / np.linalg.norm(vp, axis=-1)).mean(0)
    ks = (np.linalg.norm(kt, axis=-1) / np.linalg.norm(kp, axis=-1)).mean(0)
    shift = (kt - kp * ks[None, :, None]).mean(0)  # measured on the rescaled predictions
    np.testing.assert_allclose(got["vscale"].numpy(), vs, rtol=1e-5)
    np.testing.assert_allclose(got["kscale"].numpy(), ks, rtol=1e-5)
    np.testing.assert_allclose(got["kshift"].numpy(), shift, atol=1e-5)
    k, v = (torch.tensor(rng.normal(size=(3, 2, 5)), dtype=torch.float32) for _ in range(2))
    k2, v2 = apply_kv(got, k, v)
    np.testing.assert_allclose(k2.numpy(), k.numpy() * ks[None, :, None] + shift[None], atol=1e-5)
    np.testing.assert_allclose(v2.numpy(), v.numpy() * vs[None, :, None], atol=1e-5)


# -- in the runtime ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_kv_corrections_in_the_runtime(arch, lm_of):
    """The corrected cache is the uncorrected one with the per-head scales / shift applied to the filled rows only;
    the scales come from the first tail rows' keys and values from their true input in that run (recorded by
    hooks on the layers) and from the map's prediction for them."""
    lm = lm_of(arch)
    ad = lm.adapter
    ids, S, T, m = tokens(30, seed=5), 2, 10, 4
    maps = random_maps(lm, S, seed=6)
    plain = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps)
    with torch.no_grad():
        hs = lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    attn = [l for l in range(S, ad.num_layers) if not ad.is_linear(l)]
    filled = slice(1, 30 - T)  # row 0 is exact
    for which in (("vscale",), ("kscale",), ("kshift",)):
        seen = {}
        hooks = [ad.layers[l].register_forward_pre_hook(
            lambda mod, args, kw, l=l: seen.__setitem__(l, (args[0] if args else kw["hidden_states"])[0].clone()),
            with_kwargs=True) for l in attn]  # fmt: skip
        try:
            res = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, corrections=which,
                          correction_rows=m)  # fmt: skip
        finally:
            for h in hooks:
                h.remove()
        for l in attn:
            W, b = maps[l]
            k_t, v_t = ad.kv(l, seen[l][1 : 1 + m])  # the query rows: row 0, then the tail
            k_p, v_p = ad.kv(l, hs[S][0, 30 - T : 30 - T + m] @ W.T + b)
            a, p = res.cache.layers[l], plain.cache.layers[l]
            if which == ("vscale",):
                scale = (v_t.norm(dim=-1) / v_p.norm(dim=-1)).mean(0)
                torch.testing.assert_close(a.values[0, :, filled], p.values[0, :, filled] * scale[:, None, None])
                torch.testing.assert_close(a.keys[0, :, filled], p.keys[0, :, filled])
            elif which == ("kscale",):
                scale = (k_t.norm(dim=-1) / k_p.norm(dim=-1)).mean(0)  # RoPE is a rotation: scaling commutes
                torch.testing.assert_close(a.keys[0, :, filled], p.keys[0, :, filled] * scale[:, None, None])
            else:
                shift = (k_t - k_p).mean(0)  # [kv_heads, hd], before RoPE: rotated at each filled position
                cos, sin = ad.rotary(torch.arange(1, 30 - T), layer=l)
                moved = ad.apply_rope(shift[None].expand(30 - T - 1, -1, -1), cos, sin).transpose(0, 1)
                torch.testing.assert_close(a.keys[0, :, filled], p.keys[0, :, filled] + moved, atol=1e-5, rtol=1e-5)
            if l == attn[0]:  # the tail's own keys and values: unchanged until it has read corrected rows
                torch.testing.assert_close(a.keys[0, :, 30 - T :], p.keys[0, :, 30 - T :])
                torch.testing.assert_close(a.values[0, :, 30 - T :], p.values[0, :, 30 - T :])
        assert not torch.allclose(res.logits, plain.logits)


def test_state_correction_in_the_runtime(lm_of):
    """The corrected state is the uncorrected one plus share x offset, with the share computed by brute force from
    the gates of the rows the state ran over (row 0 exact, the others filled from the maps)."""
    lm = lm_of("qwen3_next")
    ad = lm.adapter
    ids, S, T = tokens(30, seed=9), 2, 8
    maps = random_maps(lm, S, seed=10)
    g = torch.Generator().manual_seed(11)
    offsets = {2: torch.randn(4, 8, 8, generator=g)}  # layer 2: 4 value heads, key and value dim 8
    plain = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps)
    # The correction lands at the end of the prefix; the tail then runs on from there. Compare the prefix alone:
    # a prompt whose tail is its last row, with the correction measured at the end of the prefix.
    with torch.no_grad():
        hs = lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    W, b = maps[2]
    x = hs[2][0, : 30 - T].clone()
    x[1:] = hs[S][0, 1 : 30 - T] @ W.T + b
    gdn, norm = ad.layers[2].linear_attn, ad.layers[2].input_layernorm
    with torch.no_grad():
        a = gdn.in_proj_ba(norm(x)).view(30 - T, 2, 4)[..., 2:].reshape(30 - T, 4)  # per key head: b b a a
        gates = (-gdn.A_log.exp() * torch.nn.functional.softplus(a + gdn.dt_bias)).double().numpy()
    w = np.exp(np.cumsum(gates[::-1], axis=0)[::-1] - gates)
    share = w[1:].sum(0) / w.sum(0)
    fixed = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, corrections=("state",),
                    state_offsets=offsets)  # fmt: skip
    assert not torch.allclose(fixed.logits, plain.logits)
    # Replay: the uncorrected state at the end of the prefix, plus share x offset, then the tail: equals the fix.
    from transformers import DynamicCache

    from ridgefill.runtime.layers import Layers

    layers, states = Layers(lm), DynamicCache(config=lm.model.config)
    with torch.no_grad():
        layers.mix(2, x[None], states)
        states.layers[2].recurrent_states[0] += torch.tensor(share, dtype=torch.float32)[None, :, None, None] * offsets[2]
        layers.mix(2, hs[2][0, 30 - T :][None], states)
    torch.testing.assert_close(fixed.cache.layers[2].recurrent_states[0], states.layers[2].recurrent_states[0],
                               atol=1e-5, rtol=1e-5)  # fmt: skip


class _Stub:
    """An adapter's layer plan, for check_corrections: num_layers and which are Gated DeltaNet."""

    def __init__(self, linear):
        self.num_layers, self._linear = len(linear), linear

    def is_linear(self, l):
        return self._linear[l]


def test_correction_refusals(lm_of):
    assert check_corrections(_Stub([False] * 4), 2, ["kshift", "vscale"]) == ("vscale", "kshift")
    with pytest.raises(BadInput, match="^unknown correction 'vrescale' \\(choose from vscale, kscale, kshift, state\\)$"):
        check_corrections(_Stub([False] * 4), 2, ["vrescale"])
    with pytest.raises(BadInput, match="^correction 'vscale' needs attention layers above split 2; this model has none$"):
        check_corrections(_Stub([False, False, True, True]), 2, ["vscale"])
    lm = lm_of("llama")
    with pytest.raises(BadInput, match="^the terminal-state correction needs Gated DeltaNet layers above split 2; "):
        prefill(lm, tokens(20), "ridgefill", split=2, tail=5, maps=random_maps(lm, 2), corrections=("state",))
    hyb = lm_of("qwen3_next")
    maps = random_maps(hyb, 2)
    with pytest.raises(BadInput, match=r"^terminal-state offsets cover layers \[\], but the Gated DeltaNet layers "):
        prefill(hyb, tokens(20), "ridgefill", split=2, tail=5, maps=maps, corrections=("state",))
    with pytest.raises(BadInput, match=r"^terminal-state offset of layer 2 has shape \[4, 8, 4\], but the layer's "):
        prefill(hyb, tokens(20), "ridgefill", split=2, tail=5, maps=maps, corrections=("state",),
                state_offsets={2: torch.zeros(4, 8, 4)})
    with pytest.raises(BadInput, match="^corrections apply to the fill arms, not 'nofill'$"):
        prefill(lm, tokens(20), "nofill", split=2, tail=5, corrections=("vscale",))
