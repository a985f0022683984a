"""Key/value maps in the reference runtime: a late attention layer's map predicts its keys (before RoPE and QK-norm)
and values directly; Gated DeltaNet layers keep input maps. Checked against the exact prefill with maps that
interpolate the prompt's own rows (least squares, fewer rows than d + 1: exact), against the keys written by hand, and
by the refusals of a map whose kind or width is wrong."""

import numpy as np
import pytest
import torch

from ridgefill.errors import BadInput
from ridgefill.runtime import exact_run, prefill
from test_runtime import ALL, decode_logits, hidden_states, tokens


def kv_targets(lm, hs, l, rows):
    """Layer l's keys before its key norm and its values, side by side, from its true input at `rows`: [R, 2kv]."""
    k, v = lm.adapter.kv_raw(l, hs[l][0, rows])
    return torch.cat([k.reshape(len(rows), -1), v.reshape(len(rows), -1)], 1).double().numpy()


def fit_kv_maps(lm, hs, split, rows):
    """Least-squares maps from h_split onto each late layer's target (numpy lstsq, min-norm when under-determined):
    keys and values for attention layers, the input for Gated DeltaNet layers. ({layer: (W, b)}, {layer: kind})."""
    ad = lm.adapter
    x = hs[split][0, rows].double().numpy()
    xa = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    maps, kinds = {}, {}
    for l in range(split, ad.num_layers):
        kinds[l] = "input" if ad.is_linear(l) else "kv"
        y = hs[l][0, rows].double().numpy() if ad.is_linear(l) else kv_targets(lm, hs, l, rows)
        coef = np.linalg.lstsq(xa, y, rcond=None)[0]  # [d + 1, d_out]
        maps[l] = (torch.tensor(coef[:-1].T, dtype=torch.float32), torch.tensor(coef[-1], dtype=torch.float32))
    return maps, kinds


@pytest.mark.parametrize("arch", ALL)
def test_interpolating_kv_maps_reproduce_exact(arch, lm_of):
    """Key/value maps that fit the prompt's own prefix rows exactly make the fill write the true keys (through the
    key norm and RoPE at their positions) and values: its logits and its cache's next steps are exact's."""
    lm = lm_of(arch)
    ids, S, T, n = tokens(20, seed=5), 1, 6, 20
    hs = hidden_states(lm, ids)
    maps, kinds = fit_kv_maps(lm, hs, S, list(range(n - T)))
    assert any(k == "kv" for k in kinds.values())
    ex = prefill(lm, ids, "exact", split=S, tail=T)
    rf = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, map_kinds=kinds)
    err = (rf.logits - ex.logits).abs().max()
    assert err < 1e-3, err
    idn = prefill(lm, ids, "identity", split=S, tail=T)
    assert (idn.logits - ex.logits).abs().max() > 100 * err
    nxt = tokens(3, seed=6)
    torch.testing.assert_close(decode_logits(lm, rf.cache, nxt), decode_logits(lm, ex.cache, nxt), atol=1e-3,
                               rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_filled_keys_and_values_are_the_maps_output(arch, lm_of):
    """With random key/value maps, each filled row of a late layer holds k = RoPE(k_norm(M h_S + c)[:kv]) and
    v = (M h_S + c)[kv:], computed here from the split state in float64 with the model's own norm and rotary tables."""
    lm = lm_of(arch)
    ad = lm.adapter
    ids, S, T, n = tokens(24, seed=7), 2, 5, 24
    g = torch.Generator().manual_seed(3)
    d, w = ad.hidden_size, ad.kv_width
    maps = {l: (torch.randn(w, d, generator=g) / d**0.5, torch.randn(w, generator=g)) for l in range(S, ad.num_layers)}
    kinds = {l: "kv" for l in maps}
    res = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, map_kinds=kinds, anchor=1)
    h = exact_run(lm, ids, splits=[S]).states[S].double()  # [N, d]: the early layers run every row exactly
    filled = [p for p in range(n - T) if p not in res.exact_rows]
    cos, sin = ad.rotary(filled)
    for l in maps:
        W, b = maps[l]
        pred = h[filled] @ W.double().T + b.double()  # [F, 2kv]
        k = pred[:, : w // 2].reshape(len(filled), ad.num_kv_heads, ad.head_dim)
        norm = ad.k_norm(l)
        if norm is not None:  # RMS over head_dim with the layer's own weight
            k = k / torch.sqrt(k.square().mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()
        k = ad.apply_rope(k, cos.double(), sin.double())
        v = pred[:, w // 2 :].reshape(len(filled), ad.num_kv_heads, ad.head_dim)
        got = res.cache.layers[l]
        torch.testing.assert_close(got.keys[0][:, filled].transpose(0, 1).double(), k, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(got.values[0][:, filled].transpose(0, 1).double(), v, atol=2e-4, rtol=2e-4)


def test_kv_map_refusals(lm_of):
    """A map whose width is not its kind's, an unknown kind, or a key/value map on a Gated DeltaNet layer is refused
    by its layer, before anything runs."""
    lm = lm_of("llama")
    ad = lm.adapter
    d, w, S = ad.hidden_size, ad.kv_width, 2
    assert w == d  # the tiny models' 2 KV heads of d / 4: the widths alone cannot tell the kinds apart
    ids = tokens(12)
    half = {l: (torch.zeros(w // 2, d), torch.zeros(w // 2)) for l in range(S, ad.num_layers)}
    says = r"^layer 2's {} map is \({}, {}\), expected \({}, {}\) for this model$"
    with pytest.raises(BadInput, match=says.format("kv", w // 2, d, w, d)):
        prefill(lm, ids, "ridgefill", split=S, tail=4, maps=half, map_kinds={l: "kv" for l in half})
    with pytest.raises(BadInput, match=says.format("input", w // 2, d, d, d)):
        prefill(lm, ids, "ridgefill", split=S, tail=4, maps=half)
    full = {l: (torch.zeros(w, d), torch.zeros(w)) for l in range(S, ad.num_layers)}
    with pytest.raises(BadInput, match=r"^map_kinds: layer 3 is 'keys', expected 'input' or 'kv'$"):
        prefill(lm, ids, "ridgefill", split=S, tail=4, maps=full, map_kinds={2: "kv", 3: "keys"})
    hybrid = lm_of("qwen3_next")
    had = hybrid.adapter
    maps = {l: (torch.zeros(had.kv_width, had.hidden_size), torch.zeros(had.kv_width))
            for l in range(2, had.num_layers)}
    with pytest.raises(BadInput, match=r"^map_kinds: layer 2 is a Gated DeltaNet layer, which needs an input map"):
        prefill(hybrid, ids, "ridgefill", split=2, tail=4, maps=maps, map_kinds={l: "kv" for l in maps})


def test_a_hybrid_key_value_release(tiny_chain, tmp_path, lm_of):
    """solve --maps kv on a hybrid: the attention layer gets a key/value map, the Gated DeltaNet layer keeps its input
    map; the release records both kinds, verifies, and the runtime applies it as its options say."""
    from ridgefill.formats.release import read_release
    from ridgefill.runtime import load_release_maps
    from ridgefill.solve import solve
    from ridgefill.solve.config import SolveConfig
    from ridgefill.solve.artifact import load_map_kinds
    from clirun import cli
    from conftest import ChainSpec, quiet

    c = tiny_chain(ChainSpec(model="tiny_qwen3_next", release=False))
    sol, _ = solve(c.store, c.cap.id, SolveConfig(alphas=(1e-3, 1e-1), maps="kv"), quiet())
    assert load_map_kinds(sol) == {2: "input", 3: "kv"}  # tiny qwen3_next: layers 0 and 2 are Gated DeltaNet
    out = tmp_path / "rel"
    r = cli("export", sol.id, "--out", out, "--store", c.store.root)
    assert r.returncode == 0, r.stderr
    rel = read_release(out)
    assert [(x["kind"], x["map"]) for x in rel.manifest["layers"]] == [("linear_attention", "input"),
                                                                       ("full_attention", "kv")]
    lm = lm_of("qwen3_next")
    applied = load_release_maps(lm, out)
    assert applied.map_kinds == {2: "input", 3: "kv"}
    ids = tokens(24, seed=9)
    res = prefill(lm, ids, applied.arm, **{**applied.options(), "tail": 6})
    assert torch.isfinite(res.logits).all() and res.exact_rows[:1] == [0]
    # the same fill with the maps' kinds spelled out
    same = prefill(lm, ids, "ridgefill", split=2, tail=6, maps=applied.maps, map_kinds={3: "kv"},
                   exact_norm=applied.exact_norm)
    torch.testing.assert_close(res.logits, same.logits, rtol=0, atol=0)


def test_a_format_1_release_is_still_applied(lm_of, tmp_path):
    """A `ridgefill-maps/1` folder, byte for byte as the writer wrote it before key/value maps (the conformance
    corpus's `write_v1`), still verifies and loads in the runtime, eval's source and an engine's fill: every map an
    input map, the anchor 1 it did not record, and the same prefill as its maps passed by hand."""
    from ridgefill.engines.vllm import served
    from ridgefill.evaluate.source import load_source
    from ridgefill.formats.release import read_release
    from ridgefill.runtime import load_release_maps
    from test_conformance import conformance
    from test_runtime import random_maps

    lm = lm_of("llama")
    ref, ad = lm.ref, lm.adapter
    maps = random_maps(lm, 2, seed=11)
    manifest = {"model": {"name": ref.name, "revision": None, "architecture": ref.model_type,
                          "num_layers": ad.num_layers, "hidden_size": ad.hidden_size, "fingerprint": ref.fingerprint},
                "split": 2, "tail_default": 5, "layers": [{"index": l, "kind": "full_attention"} for l in maps],
                "fit": {"exact_norm": 1e6}}
    folder = tmp_path / "old"
    conformance.write_v1(folder, {l: {"weight": W.numpy(), "bias": b.numpy()} for l, (W, b) in maps.items()},
                         manifest, "f32")
    rel = read_release(folder)
    assert (rel.format, dict(rel.map_kinds), rel.anchor) == ("ridgefill-maps/1", {2: "input", 3: "input"}, 1)
    applied = load_release_maps(lm, folder)
    assert applied.map_kinds == {2: "input", 3: "input"}
    ids = tokens(16, seed=12)
    got = prefill(lm, ids, applied.arm, **applied.options())
    want = prefill(lm, ids, "ridgefill", split=2, tail=5, maps=maps)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert load_source(None, str(folder)).map_kinds == {2: "input", 3: "input"}
    fill = served.load(folder)
    assert (fill.split, fill.tail, fill.anchor, fill.map_kinds) == (2, 5, 1, {2: "input", 3: "input"})


def test_the_map_kinds_are_the_release_formats():
    """solve's --maps choices (a light module, written again for the CLI) are the release format's map kinds, and so
    are capture's targets and the runtime's kinds."""
    from ridgefill.capture.stats import INPUT, KV
    from ridgefill.formats.release.names import MAP_KINDS
    from ridgefill.runtime.fill import INPUT_MAP, KV_MAP
    from ridgefill.solve.config import MAP_CHOICES

    assert MAP_CHOICES == MAP_KINDS == (INPUT, KV) == (INPUT_MAP, KV_MAP)
