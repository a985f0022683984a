"""Solve, quantize, export and verify on a tiny random llama, through the real CLI entry point."""

import json

import numpy as np
import pytest

from ridgefill.artifacts import Store
from ridgefill.formats import safetensors
from ridgefill.capture.artifact import load_heldout, load_stats
from ridgefill.solve.config import SolveConfig
from ridgefill.solve.ridge import direct_solve
from clirun import cli
from conftest import ChainSpec, quiet

TEXTS = [("The rain in Spain stays mainly in the plain. " * 9), ("import os\nprint(os.getcwd())\n" * 12),
         ("We hold these truths to be self-evident. " * 10), ("while True:\n    x = x + 1\n" * 11),
         ("To be, or not to be, that is the question. " * 8), ("a = [i * i for i in range(9)]\n" * 10)]




# This module's chain (conftest's `tiny_chain`): the texts above, split 2, solved on three alphas; no release (the
# tests make theirs through the CLI).
SOLVE_CHAIN = ChainSpec(texts=tuple(TEXTS), chunk=48, held_out=2, held_out_rows=64, alphas=(1e-4, 0.01, 1.0),
                        release=False)


@pytest.fixture(scope="module")
def chain(tiny_chain):
    c = tiny_chain(SOLVE_CHAIN)
    return {"tmp": c.tmp, "store": c.store.root, "cap": c.cap, "sol": c.sol, "data": c.data}


def _kv_brute(model, l, x):
    """k = k_proj(rmsnorm(x)), v = v_proj(rmsnorm(x)) from the raw weights, float64."""
    layer = model.model.layers[l]
    g = layer.input_layernorm.weight.detach().double().numpy()
    eps = layer.input_layernorm.variance_epsilon
    xn = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g
    k = xn @ layer.self_attn.k_proj.weight.detach().double().numpy().T
    v = xn @ layer.self_attn.v_proj.weight.detach().double().numpy().T
    hd = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // model.config.num_attention_heads
    return k.reshape(len(x), -1, hd), v.reshape(len(x), -1, hd)


def _cos(a, b):
    return ((a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))).mean()


def check_choice_and_maps(sol, rep, m, scores: dict, layers) -> None:
    """The solve's grid scores are the brute-force `scores` {alpha: score}, its alpha their best, and its maps the
    plain ridge solve of the moments `m` at that alpha."""
    grid = {g["alpha"]: g["score"] for g in rep["grid"]}
    for a in scores:
        assert grid[a] == pytest.approx(scores[a], abs=2e-5)
    assert rep["alpha"] == max(scores, key=scores.get)
    arrays, _ = safetensors.load(sol.file("maps.safetensors"))
    w, b = direct_solve(m, rep["alpha"])
    for i, l in enumerate(layers):
        np.testing.assert_allclose(arrays[f"layer.{l}.weight"], w[i], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(arrays[f"layer.{l}.bias"], b[i], rtol=1e-4, atol=1e-5)


def test_solve_maps_and_choice_match_brute_force(chain, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    store = Store(chain["store"])
    sol = store.get(chain["sol"].id, stage="solve")
    rep = json.loads(sol.file("report.json").read_text())
    m = load_stats(chain["cap"], 2)
    held = load_heldout(chain["cap"])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    L = model.config.num_hidden_layers
    x = held["hidden.2"].astype(np.float64)
    scores = {}
    for alpha in (1e-4, 0.01, 1.0):
        w, b = direct_solve(m, alpha)
        ks, vs = [], []
        for i, l in enumerate(range(2, L)):
            y = held[f"hidden.{l}"].astype(np.float64)
            kp, vp = _kv_brute(model, l, x @ w[i].T + b[i])
            kt, vt = _kv_brute(model, l, y)
            ks.append(_cos(kp, kt))
            vs.append(_cos(vp, vt))
        scores[alpha] = (np.mean(ks) + np.mean(vs)) / 2
    check_choice_and_maps(sol, rep, m, scores, range(2, L))
    # the identity fill scores layer S (whose input is h_S itself) perfectly
    assert rep["identity"]["layers"]["2"]["k_cosine"] == pytest.approx(1.0, abs=1e-6)
    # the exact-row norm: the capture's outlier ratio (4, the default) x the median L2 norm of the held-out rows at
    # the split (64 rows: the mean of the two middle ones), recorded in maps.safetensors, the report and the summary
    assert store.upstream(sol, "capture").recipe["outlier_ratio"] == 4.0
    norms = np.sqrt((x ** 2).sum(axis=1))
    mid = np.sort(norms)[len(norms) // 2 - 1 : len(norms) // 2 + 1]
    want = 4.0 * float(np.median(norms))
    assert len(norms) % 2 == 0 and want == pytest.approx(4.0 * mid.mean(), rel=1e-15)
    recorded = float(safetensors.read_header(sol.file("maps.safetensors"))[1]["exact_norm"])
    assert recorded == pytest.approx(want, rel=1e-12)
    assert rep["exact_norm"] == sol.manifest["summary"]["exact_norm"] == recorded


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_key_value_maps_match_brute_force(tiny_chain, fixture):
    """solve --maps kv: per late layer a [2 * kv_heads * head_dim, d] map of the split state onto the layer's keys
    (before RoPE and QK-norm) and values, the ridge solution of the capture's key/value moments (a plain solve per
    alpha); alpha chosen on the mean cosine of the keys it writes (through the key norm on QK-norm models) and values
    against the true ones, from the raw weights in float64."""
    import torch
    from transformers import AutoModelForCausalLM

    from ridgefill.solve import solve
    from ridgefill.solve.artifact import load_kv_shape, load_map_kinds

    c = tiny_chain(ChainSpec(model=fixture, texts=tuple(TEXTS), chunk=48, held_out=2, held_out_rows=64,
                             alphas=(1e-4, 0.01, 1.0), release=False))
    sol, cached = solve(c.store, c.cap.id, SolveConfig(alphas=(1e-4, 0.01, 1.0), maps="kv"), quiet())
    assert not cached and sol.id != c.sol.id and sol.recipe["maps"] == "kv"
    rep = json.loads(sol.file("report.json").read_text())
    m = load_stats(c.cap, 2, target="kv")
    held = load_heldout(c.cap)
    model = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    L, cfg = model.config.num_hidden_layers, model.config
    kv, hd = cfg.num_key_value_heads, cfg.head_dim
    x = held["hidden.2"].astype(np.float64)

    def key_norm(l, k):  # [R, heads, hd]: Qwen3's per-head RMSNorm, or nothing
        norm = getattr(model.model.layers[l].self_attn, "k_norm", None)
        if norm is None:
            return k
        g = norm.weight.detach().double().numpy()
        return k / np.sqrt((k**2).mean(-1, keepdims=True) + norm.variance_epsilon) * g

    scores = {}
    for alpha in (1e-4, 0.01, 1.0):
        w, b = direct_solve(m, alpha)  # [k, 2kv, d]
        assert w.shape == (L - 2, 2 * kv * hd, cfg.hidden_size)
        ks, vs = [], []
        for i, l in enumerate(range(2, L)):
            pred = x @ w[i].T + b[i]  # [R, 2kv]
            kp, vp = key_norm(l, pred[:, : kv * hd].reshape(len(x), kv, hd)), pred[:, kv * hd :].reshape(len(x), kv, hd)
            kt, vt = _kv_brute(model, l, held[f"hidden.{l}"].astype(np.float64))
            ks.append(_cos(kp, key_norm(l, kt)))
            vs.append(_cos(vp, vt))
        scores[alpha] = (np.mean(ks) + np.mean(vs)) / 2
    check_choice_and_maps(sol, rep, m, scores, range(2, L))
    assert load_map_kinds(sol) == {l: "kv" for l in range(2, L)} and load_kv_shape(sol) == (kv, hd)
    assert rep["maps"] == {str(l): "kv" for l in range(2, L)}
    assert load_map_kinds(c.sol) == {l: "input" for l in range(2, L)}  # the default: input maps


def test_solve_cli_equals_the_library_and_is_cached(chain, tmp_path):
    """The CLI's solve of the capture (in a store of its own; on the CPU, as the chain's) is the library's: same id,
    summary, maps and protected-token table; a second run is a cache hit."""
    store = _own_store(chain, tmp_path / "store").root
    args = ("solve", chain["cap"].id, "--store", store, "--alpha", "1e-4", "--alpha", "0.01", "--alpha", "1",
            "--device", "cpu", "--json")
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["id"], doc["cached"]) == (chain["sol"].id, False)
    assert doc["summary"] == chain["sol"].manifest["summary"]
    ours = Store(store).get(doc["id"])
    for name in ("maps.safetensors", "protected.safetensors"):
        assert ours.file(name).read_bytes() == chain["sol"].file(name).read_bytes(), name
    r = cli(*args)
    assert r.returncode == 0 and json.loads(r.stdout) == {**doc, "cached": True}


def test_solve_refusals(chain, tmp_path, tiny_qwen3):
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--alpha", "0")
    assert (r.returncode, r.stderr.strip()) == (2, "Error: --alpha must be > 0 (got 0)")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--alpha", "-1e-3")
    assert (r.returncode, r.stderr.strip()) == (2, "Error: --alpha must be > 0 (got -0.001)")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--model", tiny_qwen3)
    assert r.returncode == 2
    assert r.stderr.startswith(f"Error: capture {chain['cap'].id} was made with a different model")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--split", "3")
    assert (r.returncode, r.stderr.strip()) == (2, f"Error: capture {chain['cap'].id} has no split 3 (it has 2)")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--state-data", chain["data"])
    assert (r.returncode, r.stderr.strip()) == (2, "Error: --state-data: the terminal-state correction needs Gated "
                                                   "DeltaNet layers above split 2; this model has none")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--maps", "keys")
    assert (r.returncode, r.stderr.strip()) == (2, "Error: --maps must be one of input, kv, got 'keys'")
    r = cli("solve", chain["cap"].id, "--store", chain["store"], "--maps", "kv", "--metric", "input")
    assert (r.returncode, r.stderr.strip()) == (2, "Error: --metric input scores predicted layer inputs, and key/value "
                                                   "maps predict none: use --metric kv with --maps kv")
    assert len(list((chain["store"] / "solve").iterdir())) == 1  # nothing new written


def test_quantize_export_verify(chain):
    store = chain["store"]
    r = cli("quantize", chain["sol"].id, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)
    assert q["summary"]["max_rel_error_worst"] < 1 / 127
    assert abs(q["summary"]["score_int8"] - q["summary"]["score_float"]) < 1e-2
    out = chain["tmp"] / "release"
    r = cli("export", q["id"], "--out", out, "--store", store, "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "maps.safetensors", "protected.safetensors",
                                                     "ridgefill.json"]
    man = json.loads((out / "ridgefill.json").read_text())
    assert man["format"] == "ridgefill-maps/2" and man["split"] == 2 and man["projector"]["dtype"] == "int8"
    assert man["layers"] == [{"index": l, "kind": "full_attention", "map": "input"} for l in (2, 3)]
    assert (man["model"]["num_kv_heads"], man["model"]["head_dim"]) == (2, man["model"]["hidden_size"] // 4)
    assert man["fit"]["exact_norm"] == chain["sol"].manifest["summary"]["exact_norm"] > 0  # the solve's, via quantize
    r = cli("verify", out)
    assert r.returncode == 0, r.stderr
    # the release decodes to the quantized maps
    from ridgefill.formats.release import load_release

    _, maps = load_release(out)
    sol = Store(store).get(chain["sol"].id)
    w = safetensors.load(sol.file("maps.safetensors"))[0]["layer.3.weight"]
    assert np.abs(maps[3]["weight"] - w).max() <= np.abs(w).max() / 127
    # re-export into the same folder: identical, nothing to do; a second export is a cache hit
    r = cli("export", q["id"], "--out", out, "--store", store, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cached"] is True


def test_key_value_maps_quantize_export_verify(tiny_chain, tmp_path):
    """A key/value solve through quantize and export: an int8 ridgefill-maps/2 release whose layers say "kv", whose
    maps are [2 * kv_heads * head_dim, d] and decode to the float maps within int8's error; its held-out score after
    quantization is scored as key/value maps."""
    from ridgefill.formats.release import read_release
    from ridgefill.solve import solve

    c = tiny_chain(ChainSpec(texts=tuple(TEXTS), chunk=48, held_out=2, held_out_rows=64, alphas=(1e-4, 0.01, 1.0),
                             release=False))
    sol, _ = solve(c.store, c.cap.id, SolveConfig(alphas=(1e-4, 0.01, 1.0), maps="kv"), quiet())
    r = cli("quantize", sol.id, "--store", c.store.root, "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)
    assert abs(q["summary"]["score_int8"] - q["summary"]["score_float"]) < 1e-2
    assert q["summary"]["score_float"] == pytest.approx(sol.manifest["summary"]["score"], abs=1e-7)  # float32 maps
    out = tmp_path / "release"
    r = cli("export", q["id"], "--out", out, "--store", c.store.root)
    assert r.returncode == 0, r.stderr
    assert cli("verify", out).returncode == 0
    rel = read_release(out)
    assert [x["map"] for x in rel.manifest["layers"]] == ["kv", "kv"]
    float_maps = safetensors.load(sol.file("maps.safetensors"))[0]
    for l in (2, 3):
        w = float_maps[f"layer.{l}.weight"]
        assert rel.maps[l]["weight"].shape == w.shape == (2 * 2 * 16, 64)
        assert np.abs(rel.maps[l]["weight"] - w).max() <= np.abs(w).max() / 127


@pytest.fixture(scope="module")
def verified_release(chain):
    """A release folder of the chain's maps that verifies, made here (not left over from another test)."""
    q = json.loads(cli("quantize", chain["sol"].id, "--store", chain["store"], "--json").stdout)
    out = chain["tmp"] / "release-to-damage"
    r = cli("export", q["id"], "--out", out, "--store", chain["store"])
    assert r.returncode == 0, r.stderr
    assert cli("verify", out).returncode == 0
    return out


@pytest.mark.parametrize("damage, message", [
    ("missing", "maps.safetensors: listed in ridgefill.json but missing from"),
    ("extra", "notes.txt: in the release folder but not listed in ridgefill.json"),
    ("altered", "maps.safetensors: sha256 mismatch"),
    ("dotdot", "ridgefill.json: files entry '../x' is not a bare file name inside the release folder"),
])
def test_verify_refusals(verified_release, tmp_path, damage, message):
    import shutil

    d = tmp_path / "rel"
    shutil.copytree(verified_release, d)
    if damage == "missing":
        (d / "maps.safetensors").unlink()
    elif damage == "extra":
        (d / "notes.txt").write_text("hi")
    elif damage == "altered":
        b = bytearray((d / "maps.safetensors").read_bytes())
        b[-1] ^= 1
        (d / "maps.safetensors").write_bytes(bytes(b))
    else:
        man = json.loads((d / "ridgefill.json").read_text())
        man["files"]["../x"] = "0" * 64
        (d / "ridgefill.json").write_text(json.dumps(man))
    r = cli("verify", d)
    assert r.returncode == 2
    assert r.stderr.startswith("Error: " + message), r.stderr


def test_export_never_replaces_a_folder_that_is_not_a_release(chain, tmp_path):
    q = json.loads(cli("quantize", chain["sol"].id, "--store", chain["store"], "--json").stdout)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    r = cli("export", q["id"], "--out", precious, "--force", "--store", chain["store"])
    assert (r.returncode, r.stderr.strip()) == (2, f"Error: --out {precious} exists, is not empty and is not a release folder")
    assert (precious / "thesis.tex").read_text() == "years of work"


# ---------------------------------------------------------------- the alpha grid past its edge, end to end


def _constructed_capture(store: Store, like, seed: int = 0):
    """A capture artifact made by hand with the recipe and info of `like` (so the tiny llama scores it), whose
    best alpha lies below the default grid: a split state with a spread spectrum (std 1 .. 1e-3 over 64
    directions), layer 3's input a noisy linear function of it in which every direction matters alike, and few
    calibration rows, so that some shrinkage helps and 1e-5 is already too much."""
    from ridgefill.capture.artifact import DOCS, HELDOUT, STATS
    from ridgefill.capture.stats import moments_of

    rng = np.random.default_rng(seed)
    d, n, r = 64, 100, 256
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    s = 10 ** np.linspace(0, -3, d)
    draw = lambda m: (rng.normal(size=(m, d)) * s) @ q.T  # noqa: E731
    a = rng.normal(size=(d, d)) @ np.diag(1 / s) @ q.T / np.sqrt(d)
    c = rng.normal(size=d)
    x = draw(n)
    ys = np.stack([x, x @ a.T + c + 0.3 * rng.normal(size=(n, d))])  # inputs of layers 2 (= the split state) and 3
    xh = draw(r).astype(np.float32)
    held = {"hidden.2": xh, "hidden.3": (xh.astype(np.float64) @ a.T + c).astype(np.float32),
            "doc": np.zeros(r, np.int32), "pos": np.arange(1, r + 1, dtype=np.int32)}
    recipe = {**like.recipe, "data": f"constructed-{seed}"}
    with store.build("capture", recipe) as b:
        safetensors.save(b.path / STATS, moments_of(x, ys).to_arrays("raw.split2"),
                     {"splits": "2", "variants": "raw", "num_layers": "4"})
        safetensors.save_zst(b.path / HELDOUT, held, {"layers": "2,3"})
        (b.path / DOCS).write_text(json.dumps([]))
        return b.commit(info=like.info, summary=like.manifest.get("summary", {}))


def _brute_scores(model, m, held, alphas, layers):
    """Held-out K/V score of the maps of each alpha, from a plain linear solve and the raw weights (float64)."""
    x = held["hidden.2"].astype(np.float64)
    out = {}
    for alpha in alphas:
        w, b = direct_solve(m, alpha)
        ks, vs = [], []
        for i, l in enumerate(layers):
            kp, vp = _kv_brute(model, l, x @ w[i].T + b[i])
            kt, vt = _kv_brute(model, l, held[f"hidden.{l}"].astype(np.float64))
            ks.append(_cos(kp, kt))
            vs.append(_cos(vp, vt))
        out[alpha] = (np.mean(ks) + np.mean(vs)) / 2
    return out


def test_solve_extends_the_grid_below_its_edge(chain, tiny_llama, tmp_path):
    """Default grid: the best alpha lies below 1e-5. Solve goes on past the edge until the score turns, marks the
    added alphas, chooses the best of them; a brute-force scan agrees where the optimum is."""
    import torch
    from transformers import AutoModelForCausalLM

    from ridgefill.solve.artifact import REPORT
    from ridgefill.solve.run import solve

    store = Store(tmp_path / "store")
    cap = _constructed_capture(store, chain["cap"])
    sol, cached = solve(store, cap.id, SolveConfig(), quiet(), model=str(tiny_llama))
    assert not cached
    rep = json.loads(sol.file(REPORT).read_text())
    given = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0]
    alphas = [g["alpha"] for g in rep["grid"]]
    assert alphas == sorted(alphas) and [g["alpha"] for g in rep["grid"] if not g["extended"]] == given
    added = [g["alpha"] for g in rep["grid"] if g["extended"]]
    assert added and max(added) < 1e-5  # extended below the grid only
    assert rep["extended"] == [{"edge": "low", "to": min(added), "steps": len(added), "stopped": "turned"}]
    assert rep["alpha"] < 1e-5 and rep["alpha"] in added and rep["alpha"] != min(added)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    m = load_stats(cap, 2)
    held = load_heldout(cap)
    brute = _brute_scores(model, m, held, alphas, [2, 3])
    for g in rep["grid"]:  # every scored alpha, given or added, against brute force
        assert g["score"] == pytest.approx(brute[g["alpha"]], abs=2e-5), g["alpha"]
    assert max(brute, key=brute.get) == rep["alpha"]
    assert brute[min(added)] < brute[rep["alpha"]] - 1e-5  # the last step really turned
    assert max((brute[a] for a in given)) < brute[rep["alpha"]] - 1e-3  # the given grid alone chose worse
    # a dense scan (8 per decade) finds its optimum between the chosen alpha's neighbours on the extended grid
    dense = _brute_scores(model, m, held, list(10 ** np.linspace(-9, -4, 41)), [2, 3])
    i = alphas.index(rep["alpha"])
    assert alphas[i - 1] <= max(dense, key=dense.get) <= alphas[i + 1]
    # the maps written are the chosen alpha's
    w, b = direct_solve(m, rep["alpha"])
    arrays, _ = safetensors.load(sol.file("maps.safetensors"))
    np.testing.assert_allclose(arrays["layer.3.weight"], w[1], rtol=1e-4, atol=1e-4 * np.abs(w[1]).max())
    # what people see: the added rows marked, and one line naming the extension
    from ridgefill.cli.solve import grid_table
    from ridgefill.cli.solve import extension_lines

    assert extension_lines(rep) == [f"alpha at the grid's edge: extended to {min(added):g} ({len(added)} steps; "
                                    "the score turned)"]
    from rich.console import Console

    con = Console(width=200, record=True)
    con.print(grid_table(rep))
    text = con.export_text()
    assert text.count("(extended)") == len(added) and f"{rep['alpha']:g} (extended) *" in text


def _own_store(chain, root) -> Store:
    """A store of this test's own holding a copy of the chain's capture."""
    import shutil

    shutil.copytree(chain["cap"].path, root / "capture" / chain["cap"].id)
    return Store(root)


def test_solve_runs_no_direct_solve(chain, tmp_path, monkeypatch):
    """The plain per-alpha solve is the tests' and bench's reference; the user's solve never runs it."""
    import ridgefill.solve.ridge as ridge
    import ridgefill.solve.run as run

    def boom(*a, **k):
        raise AssertionError("solve ran direct_solve")

    monkeypatch.setattr(ridge, "direct_solve", boom)
    monkeypatch.setattr(run, "direct_solve", boom, raising=False)
    sol, cached = run.solve(_own_store(chain, tmp_path / "store"), chain["cap"].id, SolveConfig(alphas=(1e-3, 1e-2)),
                            quiet())
    assert not cached
    assert "direct_solve_one_alpha_s" not in json.loads(sol.file("report.json").read_text())["timings"]


def test_protected_token_table(chain, tiny_llama, verified_release):
    """The solve's protected-token table follows the rule from the capture's counts (brute force: every eligible
    type, rarest first, while the occurrences stay within 25 % of the eligible ones), and the release ships it."""
    from transformers import AutoTokenizer

    from ridgefill.capture.artifact import COUNTS
    from ridgefill.formats.release import load_protected, verify_release
    from ridgefill.solve.protected import ELIGIBLE, token_class

    st = Store(chain["store"])
    sol = st.get(chain["sol"].id, stage="solve")
    got = safetensors.load(sol.file("protected.safetensors"))[0]["token_ids"]
    counts = safetensors.load(chain["cap"].file(COUNTS))[0]["counts"]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    eligible = [i for i in range(len(counts)) if i not in special
                and token_class(tok.convert_tokens_to_string([tok.convert_ids_to_tokens(i)])) in ELIGIBLE]
    total, vocab = int(counts.sum()), len(counts)
    rarest = sorted(eligible, key=lambda i: (np.log((counts[i] + 1) / (total + vocab)), i))
    budget, used, want = 0.25 * sum(int(counts[i]) for i in eligible), 0, []
    for i in rarest:
        used += int(counts[i])
        if used > budget:
            break
        want.append(i)
    assert got.tolist() == sorted(want) and 0 < len(want) < len(eligible)
    assert any(counts[i] > 0 for i in want)  # seen types too, not only the unseen ones
    rel = verified_release
    assert load_protected(rel, verify_release(rel)).tolist() == got.tolist()


def test_added_special_tokens_are_special(tiny_llama):
    """Added tokens flagged special (as SmolLM2's `<file_sep>` ... `<empty_output>`, ids 3-16, are) are never
    eligible for the protected-token table, like the named special tokens; an added token not flagged is text."""
    from transformers import AutoTokenizer

    from ridgefill.solve.protected import token_classes

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.add_tokens(["<file_sep>", "<jupyter_code>"], special_tokens=True)
    tok.add_tokens(["Zebrafish"])
    ids = tok.convert_tokens_to_ids(["<file_sep>", "<jupyter_code>", "Zebrafish"])
    classes = token_classes(tok, len(tok))
    assert [classes[i] for i in ids] == ["special", "special", "cap_piece"]
    assert all(classes[i] == "special" for i in tok.all_special_ids)


@pytest.mark.parametrize("piece, cls", [(" The", "cap_word_start"), (" the", "lower_word_start"), ("The", "cap_piece"),
                                        ("ing", "lower_piece"), (" x2", "mixed"), ("'t", "mixed"), (" 42", "number"),
                                        ("3.14", "digits_punct"), (" ,", "punct"), ("\n ", "space"), (" ïve", "lower_word_start")])
def test_token_classes(piece, cls):
    from ridgefill.solve.protected import token_class

    assert token_class(piece) == cls
