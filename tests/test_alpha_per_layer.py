"""`solve --alpha-per-layer`: each late layer at the alpha best for its own held-out score.

The maps against plain float64 solves per layer, the per-layer search against brute force (pure and on the tiny
llama), the recipe ids (the default's unchanged), the release's fit fields, and per-layer >= shared, layer by
layer, on the same held-out rows.
"""

import json

import numpy as np
import pytest

from ridgefill.artifacts import Store
from ridgefill.formats import safetensors
from ridgefill.artifacts.store import recipe_id
from ridgefill.capture.artifact import load_heldout, load_stats
from ridgefill.capture.stats import moments_of
from ridgefill.solve.ridge import DEFAULT_ALPHAS, decompose, maps_at, maps_per_layer, search, search_per_layer
from clirun import cli
from conftest import ChainSpec, quiet

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------- the maps: pure math against float64 solves


def _rows(seed=0, n=240, dx=12, dy=9, k=4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dx)) * rng.uniform(0.05, 5, size=dx) + rng.normal(size=dx)  # [n, dx]
    ys = np.stack([x @ rng.normal(size=(dx, dy)) + rng.normal(size=dy) + rng.uniform(0.1, 3) * rng.normal(size=(n, dy))
                   for _ in range(k)])  # [k, n, dy]
    return x, ys


def _ridge_from_rows(x, y, alpha):
    """min ||W xc - yc||^2 + lambda ||W||_F^2 from the centred rows, lambda = alpha * trace(Xc^T Xc) / dx."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    g = xc.T @ xc
    wt = np.linalg.solve(g + alpha * np.trace(g) / x.shape[1] * np.eye(x.shape[1]), xc.T @ yc)  # [dx, dy]
    return wt.T, y.mean(0) - wt.T @ x.mean(0)


def test_maps_per_layer_match_a_float64_solve_per_layer():
    x, ys = _rows()
    e = decompose(moments_of(x, ys))
    alphas = [1e-4, 0.3, 1e-2, 3.0]
    w, b = maps_per_layer(e, alphas)
    assert w.shape == (4, 9, 12) and b.shape == (4, 9)
    for i, a in enumerate(alphas):
        wr, br = _ridge_from_rows(x, ys[i], a)
        np.testing.assert_allclose(w[i], wr, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(b[i], br, rtol=1e-9, atol=1e-12)
    # a subset of the layers, in any order
    w2, b2 = maps_per_layer(e, [3.0, 1e-5], index=[3, 1])
    for j, (i, a) in enumerate([(3, 3.0), (1, 1e-5)]):
        wr, br = _ridge_from_rows(x, ys[i], a)
        np.testing.assert_allclose(w2[j], wr, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(b2[j], br, rtol=1e-8, atol=1e-12)
    # one alpha for every layer: maps_at's maps
    w3, b3 = maps_per_layer(e, [0.01] * 4)
    wa, ba = maps_at(e, 0.01)
    np.testing.assert_allclose(w3, wa, rtol=1e-13, atol=0)
    np.testing.assert_allclose(b3, ba, rtol=1e-13, atol=1e-14)
    with pytest.raises(ValueError, match="^3 alphas for 4 layers$"):
        maps_per_layer(e, [1e-3] * 3)


# ---------------------------------------------------------------- the search: pure, against brute force

PEAKS = (-2.5, -7.0, 0.8)  # log10 of each layer's best alpha: inside the grid, below it, above it


def _layer_score(i: int, a: float) -> float:
    return 0.9 - 0.01 * (np.log10(a) - PEAKS[i]) ** 2


def test_search_per_layer_is_each_layers_own_argmax_and_scores_only_what_it_needs():
    k = len(PEAKS) + 1  # and a flat layer: every alpha ties

    def score(i, a):
        return 0.5 if i == k - 1 else _layer_score(i, a)

    shared_grid, _, _ = search(DEFAULT_ALPHAS, lambda a: {"score": float(np.mean([score(i, a) for i in range(k)]))})
    scored = {g["alpha"]: [score(i, g["alpha"]) for i in range(k)] for g in shared_grid}
    calls = []

    def score_layer(i, a):
        assert a not in scored and (i, a) not in calls  # only what the shared grid lacks, each once
        calls.append((i, a))
        return score(i, a)

    chosen = search_per_layer(DEFAULT_ALPHAS, scored, score_layer)
    assert len(chosen) == k
    for i, c in enumerate(chosen):
        alone, _, ext = search(DEFAULT_ALPHAS, lambda a: {"score": score(i, a)})
        assert c["extended"] == ext  # search's own rules, on this layer's score
        tried = sorted(set(scored) | {a for j, a in calls if j == i})
        assert [g["alpha"] for g in c["grid"]] == tried
        assert {g["alpha"] for g in alone} <= set(tried)
        brute = max(tried, key=lambda a: (score(i, a), -a))  # ties: the smaller alpha
        assert (c["alpha"], c["score"]) == (brute, score(i, brute))
    assert chosen[0]["alpha"] == 3e-3 and chosen[0]["extended"] == []  # bracketed inside the grid: nothing new
    assert not any(i == 0 for i, _ in calls)
    assert chosen[1]["alpha"] == 1e-7 and chosen[1]["extended"][0]["stopped"] == "turned"
    assert chosen[2]["alpha"] == 10.0 and chosen[2]["extended"] == [{"edge": "high", "to": 32.0, "steps": 3,
                                                                        "stopped": "turned"}]
    # the flat layer: both edges tie, one step past each stays flat, and the tie goes to the smallest alpha
    assert chosen[3]["extended"] == [{"edge": "low", "to": 3.2e-6, "steps": 1, "stopped": "flat"},
                                     {"edge": "high", "to": 3.2, "steps": 1, "stopped": "flat"}]
    assert chosen[3]["alpha"] == 3.2e-6


# ---------------------------------------------------------------- solve on the tiny llama, end to end

TEXTS = ["A river bends around the old mill and slows down. " * 9, "for n in range(12):\n    total += n * n\n" * 10,
         "Every morning the baker lights the oven before dawn. " * 8, "names = sorted(set(words), key=len)\n" * 12,
         "The committee met twice and agreed on nothing at all. " * 7, "if x > 0:\n    y = x // 2\n" * 11]
SPLIT = 1  # late layers 1, 2, 3 of the 4-layer tiny llama


# This module's chain (conftest's `tiny_chain`): the texts above at split 1, solved with the shared alpha on the
# default grid; no release.
APL_CHAIN = ChainSpec(texts=tuple(TEXTS), splits=(SPLIT,), chunk=48, held_out=2, held_out_rows=64, alphas=None,
                      release=False)


@pytest.fixture(scope="module")
def solved(tiny_chain):
    """A capture of the tiny llama at split 1, solved with the shared alpha through the library (the chain's solve)
    and with --alpha-per-layer through the CLI (on the CPU, as the chain's), on the default grid."""
    from ridgefill.solve.artifact import REPORT

    c = tiny_chain(APL_CHAIN)
    store, cap, shared = c.store, c.cap, c.sol
    r = cli("solve", cap.id, "--store", store.root, "--alpha-per-layer", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    per = store.get(json.loads(r.stdout)["id"], stage="solve")
    return {"tmp": c.tmp, "store": store, "cap": cap, "per": per, "shared": shared, "stderr": r.stderr,
            "stdout": json.loads(r.stdout), "rep": json.loads(per.file(REPORT).read_text()),
            "shared_rep": json.loads(shared.file(REPORT).read_text())}


def _kv_brute(model, l, x):
    """k = k_proj(rmsnorm(x)), v = v_proj(rmsnorm(x)) from the raw weights, float64 [R, kv_heads, head_dim]."""
    layer = model.model.layers[l]
    g = layer.input_layernorm.weight.detach().double().numpy()
    xn = x / np.sqrt((x**2).mean(-1, keepdims=True) + layer.input_layernorm.variance_epsilon) * g
    k = xn @ layer.self_attn.k_proj.weight.detach().double().numpy().T
    v = xn @ layer.self_attn.v_proj.weight.detach().double().numpy().T
    return k.reshape(len(x), -1, model.config.head_dim), v.reshape(len(x), -1, model.config.head_dim)


def _cos(a, b):
    return ((a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))).mean()


def test_each_layer_gets_the_argmax_of_its_own_brute_force_score(solved, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    rep, p = solved["rep"], solved["rep"]["per_layer"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    layers = list(range(SPLIT, model.config.num_hidden_layers))
    m = load_stats(solved["cap"], SPLIT)
    held = load_heldout(solved["cap"])
    x = held[f"hidden.{SPLIT}"].astype(np.float64)
    assert sorted(p["alpha"], key=int) == sorted(p["lambda"], key=int) == [str(l) for l in layers]
    grid_alphas = {g["alpha"] for g in rep["grid"]}
    for i, l in enumerate(layers):
        tried = [g["alpha"] for g in p["layers"][str(l)]["grid"]]
        assert grid_alphas <= set(tried)  # every alpha the shared search scored, and the layer's own extension
        brute = {}
        for a in tried:  # this layer's own score, from a plain float64 solve per layer and the raw weights
            wr, br = _layer_solve(m, i, a)
            kp, vp = _kv_brute(model, l, x @ wr.T + br)
            kt, vt = _kv_brute(model, l, held[f"hidden.{l}"].astype(np.float64))
            brute[a] = (_cos(kp, kt) + _cos(vp, vt)) / 2
        for g in p["layers"][str(l)]["grid"]:
            assert g["score"] == pytest.approx(brute[g["alpha"]], abs=2e-5), (l, g["alpha"])
        assert p["alpha"][str(l)] == max(brute, key=lambda a: (brute[a], -a)), l
        assert p["lambda"][str(l)] == pytest.approx(p["alpha"][str(l)] * np.trace(m.cxx) / m.cxx.shape[0], rel=1e-12)
    # the layers do want different alphas here: the split layer's own input (the identity) wants the least
    assert len(set(p["alpha"].values())) == len(layers) and p["alpha"][str(SPLIT)] < 1e-5
    # the maps written are each layer's at its own alpha
    arrays, meta = safetensors.load(solved["per"].file("maps.safetensors"))
    for i, l in enumerate(layers):
        wr, br = _layer_solve(m, i, p["alpha"][str(l)])
        np.testing.assert_allclose(arrays[f"layer.{l}.weight"], wr, rtol=1e-4, atol=1e-4 * np.abs(wr).max())
        np.testing.assert_allclose(arrays[f"layer.{l}.bias"], br, rtol=1e-4, atol=1e-4 * np.abs(br).max())
    assert meta["alpha_per_layer"] == ",".join(f"{l}:{p['alpha'][str(l)]!r}" for l in layers) and "alpha" not in meta


def _layer_solve(m, i, alpha):
    """Layer i's map by a plain float64 linear solve of (Cxx + lambda I) W^T = Cxy_i."""
    d = m.cxx.shape[0]
    wt = np.linalg.solve(m.cxx + alpha * np.trace(m.cxx) / d * np.eye(d), m.cxy[i])  # [dx, dy]
    return wt.T, m.mean_y[i] - wt.T @ m.mean_x


def test_per_layer_beats_or_ties_the_shared_alpha_layer_by_layer_on_the_same_rows(solved):
    from ridgefill.solve.score import layer_objective, objective

    rep, shared = solved["rep"], solved["shared_rep"]
    p = rep["per_layer"]
    # the shared search inside the per-layer solve is the shared solve's, on the same held-out rows
    assert (rep["alpha"], rep["grid"], rep["extended"]) == (shared["alpha"], shared["grid"], shared["extended"])
    assert p["shared_fitted"] == shared["fitted"] and rep["held_out_rows"] == shared["held_out_rows"]
    assert p["shared_score"] == objective(shared["fitted"], "kv")
    gained = 0
    for l, fit in rep["fitted"]["layers"].items():
        own, other = layer_objective(fit, "kv"), layer_objective(shared["fitted"]["layers"][l], "kv")
        assert own == p["layers"][l]["score"] and other == p["layers"][l]["shared_score"]
        assert own >= other, l
        gained += own > other
    assert gained == 2  # layers 1 and 2 move off the shared alpha; layer 3 keeps it
    assert p["score"] == objective(rep["fitted"], "kv")
    assert p["score"] >= p["shared_score"] and p["score"] > p["shared_score"] + 1e-3
    # what people see
    lo, hi = min(p["alpha"].values()), max(p["alpha"].values())
    assert (f"per-layer alphas {lo:g} .. {hi:g} over 3 layers: held-out score {p['score']:.4f} vs "
            f"{p['shared_score']:.4f} with the shared alpha {rep['alpha']:g} (+") in solved["stderr"]
    assert "split 1, per-layer alpha: fitted (identity) per late layer" in solved["stderr"]
    assert solved["stdout"]["summary"]["per_layer"] == {k: p[k] for k in ("alpha", "lambda", "score", "shared_score")}
    assert "per_layer" not in shared and "per_layer" not in solved["shared"].manifest["summary"]


def test_default_recipe_id_is_unchanged_and_the_flag_changes_it(solved):
    from ridgefill.solve.config import SolveConfig
    from ridgefill.solve.run import solve

    cap, shared, per = solved["cap"], solved["shared"], solved["per"]
    # the default recipe holds no per-layer key (nor --state-data's `state`): only the format version (7 since
    # solve takes the exact-row norm from the capture's outlier ratio) tells it from what solve wrote before per-layer
    # alphas existed
    before = {"stage": "solve", "version": 7, "capture": cap.id, "model": cap.recipe["model"], "split": SPLIT,
              "alphas": sorted(DEFAULT_ALPHAS), "metric": "kv", "maps": "input", "chat_share": None}
    assert shared.recipe == before and shared.id == recipe_id(before)
    assert per.recipe == {**before, "alpha_per_layer": True} and per.id == recipe_id(per.recipe) != shared.id
    # both are cache hits, under their own ids; alpha_per_layer=False is the default
    assert solve(solved["store"], cap.id, SolveConfig(alpha_per_layer=False), quiet()) == (shared, True)
    assert solve(solved["store"], cap.id, SolveConfig(alpha_per_layer=True), quiet())[0].id == per.id


def test_release_records_the_per_layer_alphas(solved):
    rep, p = solved["rep"], solved["rep"]["per_layer"]
    out = {}
    for name, art in (("per", solved["per"]), ("shared", solved["shared"])):
        out[name] = solved["tmp"] / f"release-{name}"
        r = cli("export", art.id, "--out", out[name], "--store", solved["store"].root)
        assert r.returncode == 0, r.stderr
        assert cli("verify", out[name]).returncode == 0
    man = json.loads((out["per"] / "ridgefill.json").read_text())
    assert man["fit"]["alpha_per_layer"] == p["alpha"] and man["fit"]["lambda_per_layer"] == p["lambda"]
    assert "alpha" not in man["fit"] and "lambda" not in man["fit"]  # no single alpha made these maps
    assert man["heldout"]["fitted"] == {k: round(v, 6) for k, v in rep["fitted"]["mean"].items()}
    from ridgefill.formats.release import load_release

    facts, _ = load_release(out["per"])
    assert facts["fit"]["alpha_per_layer"] == p["alpha"]
    lo, hi = min(p["alpha"].values()), max(p["alpha"].values())
    card = (out["per"] / "README.md").read_text()
    assert "- Fit: alpha per layer " in card and f"{lo:g}" in card and f"{hi:g}" in card
    shared = json.loads((out["shared"] / "ridgefill.json").read_text())
    srep = solved["shared_rep"]
    assert (shared["fit"]["alpha"], shared["fit"]["lambda"]) == (srep["alpha"], srep["lambda"])
    assert not {"alpha_per_layer", "lambda_per_layer"} & set(shared["fit"])


def test_a_default_release_keeps_its_fit_fields(tmp_path):
    """The hand-made chain (no per_layer in its report): the fit is what export always wrote, key for key."""
    from fakestore import fake_chain

    from ridgefill.export.build import export
    from ridgefill.export.config import ExportConfig

    st = Store(tmp_path / "store")
    ids = fake_chain(st.root)
    export(st, ids["solve"], ExportConfig(), quiet(), out_dir=tmp_path / "rel")
    fit = json.loads((tmp_path / "rel" / "ridgefill.json").read_text())["fit"]
    assert fit == {"alpha": 1e-3, "lambda": 0.5, "rows": 59, "documents": 1, "tokens": 60,
                   "calibration_sha256": ["a" * 64], "capture_id": ids["capture"], "solve_id": ids["solve"],
                   "skip_first_rows": 1, "outlier_ratio": None, "exact_norm": 812.5, "chat": False,
                   "chat_share": None}  # a capture from before capture's rule; the solve's exact-row norm
