"""Maps from earlier states (capture --earlier, solve --earlier, release format ridgefill-maps/3): the maps read
[h_S; h_l1; ...] side by side. Capture's moments against a plain forward, the solve's maps against a float64 ridge
with a penalty per state, the runtime against the exact model, the release's facts and every refusal."""

import json
import shutil

import numpy as np
import pytest
import torch

from ridgefill.artifacts import Store
from ridgefill.capture.artifact import DOCS, STATS, load_heldout, load_stats
from ridgefill.capture.run import CaptureConfig, capture
from ridgefill.capture.stats import Moments
from ridgefill.errors import BadInput
from ridgefill.export import export
from ridgefill.export.config import ExportConfig
from ridgefill.formats import release, safetensors
from ridgefill.runtime import exact_run, prefill, prefill_from
from ridgefill.solve import solve
from ridgefill.solve.artifact import load_maps
from ridgefill.solve.config import SolveConfig
from clirun import cli, cli_here
from conftest import quiet
from test_capture import TEXTS, assert_moments_close, brute_force
from test_runtime import MAIN, hidden_states, tokens

ALPHAS = (1e-3, 1e-1)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_llama):
    """The tiny llama captured at splits 2 and 3 with the earlier states h_{S-2} and h_{S-1} (in that order), solved
    at split 2 with both, with neither, and with h_{S-1} alone; a plain capture of the same text beside it."""
    tmp = tmp_path_factory.mktemp("earlier")
    data = tmp / "data"
    data.mkdir()
    for i, t in enumerate(TEXTS):
        (data / f"doc{i}.txt").write_text(t)
    store = Store(tmp / "store")
    cfg = dict(chunk=32, held_out=2, held_out_rows=40)
    cap, _ = capture(store, str(tiny_llama), [str(data)], CaptureConfig(splits=(2, 3), earlier=(2, 1), **cfg),
                     quiet(), checkpoint_every=0)
    plain, _ = capture(store, str(tiny_llama), [str(data)], CaptureConfig(splits=(2,), **cfg), quiet(),
                       checkpoint_every=0)
    sols = {e: solve(store, cap.id, SolveConfig(split=2, alphas=ALPHAS, earlier=e), quiet())[0]
            for e in (None, (), (1,))}
    sols["plain"] = solve(store, plain.id, SolveConfig(split=2, alphas=ALPHAS), quiet())[0]
    return {"tmp": tmp, "data": data, "store": store, "cap": cap, "plain": plain, "sol": sols, "model": tiny_llama}


def test_capture_stacks_the_earlier_states_as_a_plain_forward_does(chain):
    """Each split's moments have x = [h_S; h_{S-2}; h_{S-1}] (the offsets' order), as one-shot forwards give them;
    the held-out rows keep every layer the solve reads; the recipe and the statistics record the offsets."""
    cap = chain["cap"]
    arrays, meta = safetensors.load(cap.file(STATS))
    calib = [i for i, d in enumerate(json.loads(cap.file(DOCS).read_text())) if d["role"] == "calibration"]
    texts = [(chain["data"] / f"doc{i}.txt").read_text() for i in range(len(TEXTS))]
    want = brute_force(chain["model"], texts, calib, (2, 3), earlier=(2, 1))
    for s in (2, 3):
        got = Moments.from_arrays(arrays, f"raw.split{s}")
        assert got.cxx.shape == (3 * 64, 3 * 64)
        assert_moments_close(got, want[s], 1e-5)
    assert cap.recipe["earlier"] == [2, 1] and meta["earlier"] == "2,1" and cap.manifest["summary"]["earlier"] == [2, 1]
    assert "earlier" not in chain["plain"].recipe  # a capture without them keeps the id it always had
    held = load_heldout(cap)
    assert {f"hidden.{l}" for l in range(4)} <= set(held)  # h_0 and h_1 too: split 2's earlier states
    # a subset of the states is the matching blocks, in the order asked for
    sub = load_stats(cap, 2, earlier=(1,))
    full = load_stats(cap, 2)
    idx = np.r_[0:64, 128:192]
    np.testing.assert_array_equal(sub.cxx, full.cxx[np.ix_(idx, idx)])
    np.testing.assert_array_equal(sub.cxy, full.cxy[:, idx])
    with pytest.raises(BadInput, match=r"--earlier 5: capture .* has no such earlier state \(it has offsets 2, 1"):
        load_stats(cap, 2, earlier=(5,))


def _ridge_per_state(m: Moments, states: int, alpha: float):
    """Brute force: the ridge fit with a penalty of its own per state, lambda / c_j^2 on state j, c_j^2 = tr C_00 /
    tr C_jj and lambda = alpha x tr(D C D) / d_in (the penalty that scaling every state to h_S's spread gives): one
    float64 solve of the normal equations per layer."""
    d = m.cxx.shape[0] // states
    tr = np.array([np.trace(m.cxx[j * d:(j + 1) * d, j * d:(j + 1) * d]) for j in range(states)])
    c2 = np.repeat(tr[0] / tr, d)
    lam = alpha * np.sum(c2 * np.diag(m.cxx)) / m.cxx.shape[0]
    a = m.cxx + lam * np.diag(1.0 / c2)
    w = np.stack([np.linalg.solve(a, m.cxy[i]).T for i in range(m.cxy.shape[0])])  # [k, dy, dx]
    return w, m.mean_y - w @ m.mean_x


def test_the_solve_is_a_ridge_with_one_penalty_per_state(chain):
    """The maps read [h_2; h_0; h_1] (layers, recorded) and are the float64 ridge fit with each state's own penalty;
    `--earlier none` on the same capture gives the plain capture's maps; the exact-row norm is the capture's ratio x
    the median norm of what the maps read."""
    cap, sols = chain["cap"], chain["sol"]
    for earlier, states in ((None, [2, 0, 1]), ((1,), [2, 1])):
        sol = sols[earlier]
        summary = sol.manifest["summary"]
        assert summary["states"] == states and sol.recipe["earlier"] == [2 - l for l in states[1:]]
        m = load_stats(cap, 2, earlier=earlier)
        w, b = _ridge_per_state(m, len(states), summary["alpha"])
        got = load_maps(sol)
        for i, l in enumerate((2, 3)):
            assert got[l][0].shape == (64, 64 * len(states))
            np.testing.assert_allclose(got[l][0], w[i], rtol=0, atol=2e-5 * np.abs(w[i]).max())
            np.testing.assert_allclose(got[l][1], b[i], rtol=0, atol=2e-5 * np.abs(b[i]).max() + 1e-6)
        held = load_heldout(cap)
        x = np.concatenate([held[f"hidden.{l}"] for l in states], axis=1).astype(np.float64)
        assert summary["exact_norm"] == pytest.approx(4.0 * np.median(np.linalg.norm(x, axis=1)), rel=1e-12)
    # key/value maps: the same penalties on the key/value moments of the same stacked rows
    kv_sol, _ = solve(chain["store"], cap.id, SolveConfig(split=2, alphas=ALPHAS, maps="kv"), quiet())
    w, b = _ridge_per_state(load_stats(cap, 2, target="kv"), 3, kv_sol.manifest["summary"]["alpha"])
    got = load_maps(kv_sol)
    for i, l in enumerate((2, 3)):
        np.testing.assert_allclose(got[l][0], w[i], rtol=0, atol=2e-5 * np.abs(w[i]).max())
    none, plain = load_maps(sols[()]), load_maps(sols["plain"])
    assert "states" not in sols[()].manifest["summary"] and "earlier" not in sols[()].recipe
    for l in (2, 3):
        np.testing.assert_allclose(none[l][0], plain[l][0], rtol=0, atol=1e-4 * np.abs(plain[l][0]).max())
    # input maps from several states say what they cost; key/value maps and h_S alone do not
    run = ["solve", cap.id, "--split", "2", "--alpha", "0.001", "--alpha", "0.1", "--store", chain["store"].root]
    r = cli_here(*run, "-q")
    assert r.returncode == 0 and r.stdout.strip() == sols[None].id
    assert r.stderr.strip().splitlines() == [
        "Warning: input maps from 3 states cost 3 whole hidden x hidden maps per late layer and filled row; key/value "
        "maps from them cost a fraction of that (--maps kv)"]
    for extra in (["--maps", "kv"], ["--earlier", "none"]):
        r = cli_here(*run, *extra, "-q")
        assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_release_of_earlier_states_is_format_3_and_fills_as_its_maps_say(chain, lm_of, tmp_path):
    """export writes ridgefill-maps/3 with `states`; the reader gives them to the runtime, whose fill equals a
    prefill with the same maps and states passed by hand, and prefill_from from an exact run that kept them; a
    plain solve's release stays /2."""
    store, sols = chain["store"], chain["sol"]
    _, _, out = export(store, sols[None].id, ExportConfig(tail=8), quiet(), out_dir=tmp_path / "rel")
    manifest = json.loads((out / release.MANIFEST).read_text())
    assert manifest["format"] == "ridgefill-maps/3" and manifest["states"] == [2, 0, 1]
    rel = release.read_release(out)
    assert rel.states == (2, 0, 1) and rel.fill_options()["states"] == (2, 0, 1)
    _, _, plain = export(store, sols[()].id, ExportConfig(tail=8), quiet(), out_dir=tmp_path / "plain")
    assert json.loads((plain / release.MANIFEST).read_text())["format"] == "ridgefill-maps/2"
    assert "states" not in release.read_release(plain).fill_options()

    from ridgefill.runtime import load_release_maps

    lm = lm_of("llama")
    rm = load_release_maps(lm, out)
    ids = tokens(40, seed=3)
    got = prefill(lm, ids, rm.arm, **rm.options())
    by_hand = prefill(lm, ids, "ridgefill", split=2, tail=8, maps={l: rm.maps[l] for l in (2, 3)}, anchor=1,
                      exact_norm=rm.exact_norm, states=(2, 0, 1))
    torch.testing.assert_close(got.logits, by_hand.logits, rtol=0, atol=0)
    run = exact_run(lm, ids, splits=[0, 1, 2], logits_rows=8)
    torch.testing.assert_close(prefill_from(lm, run, rm.arm, **rm.options()).logits, got.logits, rtol=1e-5,
                               atol=1e-5)
    # the earlier states really are read: the same maps given the states in another order fill otherwise
    other = prefill(lm, ids, "ridgefill", split=2, tail=8, maps={l: rm.maps[l] for l in (2, 3)}, anchor=1,
                    exact_norm=rm.exact_norm, states=(2, 1, 0))
    assert (other.logits - got.logits).abs().max() > 1e-3


@pytest.mark.parametrize("arch", MAIN)
def test_maps_that_read_an_earlier_state_alone_reproduce_exact(arch, lm_of):
    """Maps [0 | 0 | W] that interpolate every late layer's input from h_1 alone (fewer prefix rows than d + 1) make
    the fill write the true keys and values, and match exact, only when the runtime hands the maps h_1 in the last
    block of [h_2; h_0; h_1]; the order (2, 1, 0) puts h_0 there and does not."""
    lm = lm_of(arch)
    ids, S, T, n = tokens(20, seed=5), 2, 6, 20
    hs = hidden_states(lm, ids)
    d, L = lm.adapter.hidden_size, lm.adapter.num_layers
    x = hs[1][0, : n - T].double().numpy()
    xa = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    maps = {}
    for l in range(S, L):
        coef = np.linalg.lstsq(xa, hs[l][0, : n - T].double().numpy(), rcond=None)[0]  # [d + 1, d]
        w = np.concatenate([np.zeros((d, 2 * d)), coef[:-1].T], axis=1)
        maps[l] = (torch.tensor(w, dtype=torch.float32), torch.tensor(coef[-1], dtype=torch.float32))
    ex = prefill(lm, ids, "exact", split=S, tail=T)
    rf = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, states=(2, 0, 1))
    swapped = prefill(lm, ids, "ridgefill", split=S, tail=T, maps=maps, states=(2, 1, 0))
    err = (rf.logits - ex.logits).abs().max()
    assert err < 1e-3, err
    assert (swapped.logits - ex.logits).abs().max() > 100 * err


def test_runtime_refusals(lm_of):
    lm = lm_of("llama")
    ids = tokens(20)
    d = lm.adapter.hidden_size
    maps = {l: (torch.zeros(d, 2 * d), torch.zeros(d)) for l in (2, 3)}
    for states, message in (((1, 0), "states must be the split 2 then distinct layers below it, got [1, 0]"),
                            ((2, 2), "states must be the split 2 then distinct layers below it, got [2, 2]"),
                            ((2, 3), "states must be the split 2 then distinct layers below it, got [2, 3]")):
        with pytest.raises(BadInput, match=f"^{message}$".replace("[", r"\[").replace("]", r"\]")):
            prefill(lm, ids, "ridgefill", split=2, tail=4, maps=maps, states=states)
    with pytest.raises(BadInput, match=r"layer 2's input map is \(64, 128\), expected \(64, 192\) for this model and "
                                       r"3 states"):
        prefill(lm, ids, "ridgefill", split=2, tail=4, maps=maps, states=(2, 0, 1))
    run = exact_run(lm, ids, splits=[2])
    with pytest.raises(BadInput, match=r"the exact run kept no state for earlier layer\(s\) \[0\] the maps read "
                                       r"\(it has \[2\]\)"):
        prefill_from(lm, run, "ridgefill", split=2, tail=4, maps=maps, states=(2, 0))


def _forged(src, tmp_path, edit):
    """A copy of release `src` whose manifest `edit` changes, re-hashed as a forger would: the facts inside
    maps.safetensors are rewritten to match (release.write_release with the decoded maps)."""
    rel = release.read_release(src)
    manifest = {k: v for k, v in rel.manifest.items() if k not in ("files", "format", "projector")}
    edit(manifest)
    out = tmp_path / "forged"
    shutil.rmtree(out, ignore_errors=True)
    maps = {l: {"weight": m["weight"], "bias": m["bias"]} for l, m in rel.maps.items()}
    try:
        release.write_release(out, maps, manifest, "", weight_dtype="f32")
    except ValueError as e:
        return str(e)
    return None


def test_the_format_refuses_states_that_do_not_fit(chain, tmp_path):
    """Rule 12 for /3: `states` the split first, then distinct layers below it; /2 holds none; every map
    hidden_size x len(states) wide. The writer refuses what the reader would."""
    _, _, out = export(chain["store"], chain["sol"][None].id, ExportConfig(tail=8), quiet(), out_dir=tmp_path / "rel")
    cases = [
        (lambda m: m.update(states=[2, 2, 1]), "'states' is [2, 2, 1], expected [split, earlier layers...]"),
        (lambda m: m.update(states=[1, 0, 2]), "'states' is [1, 0, 2], expected"),
        (lambda m: m.update(states=[2, 0, 5]), "'states' is [2, 0, 5], expected"),
        (lambda m: m.update(states=[2] + [0] * 10**6), "'states' is"),
        (lambda m: m.update(states=[2, 1]),
         "layer 2 map has shape [64, 192], expected [64, 128] (an input map: model.hidden_size rows and "
         "model.hidden_size x 2 columns (one per state))"),
        (lambda m: m.pop("states"), "layer 2 map has shape [64, 192], expected [64, 64]"),
    ]
    for edit, message in cases:
        problem = _forged(out, tmp_path, edit)
        assert problem is not None and message in problem, (message, problem)
    # the reader: a /2 manifest naming states, hashed as a forger would
    rel = release.read_release(out)
    forged = tmp_path / "v2"
    shutil.copytree(out, forged)
    manifest = json.loads((forged / release.MANIFEST).read_text())
    manifest["format"] = "ridgefill-maps/2"
    (forged / release.MANIFEST).write_text(json.dumps(manifest))
    r = cli("verify", forged)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert rel.states == (2, 0, 1)


def test_gguf_export_of_maps_from_earlier_states_is_layout_3(chain, tmp_path):
    """The GGUF of a /3 release is layout ridgefill-maps-gguf/3 (a /2 reader refuses it rather than apply the maps
    to h_S alone), its facts the release's, `states` among them, and its maps d x 3 wide."""
    from ridgefill.formats.gguf import load_gguf

    sol = chain["sol"][None]
    r = cli("export", sol.id, "--format", "gguf", "--out", tmp_path / "maps.gguf", "--store", chain["store"].root)
    assert r.returncode == 0, r.stderr
    facts, maps = load_gguf(tmp_path / "maps.gguf")
    assert facts["format"] == "ridgefill-maps/3" and facts["states"] == [2, 0, 1]
    assert {m["weight"].shape for m in maps.values()} == {(64, 192)}
    from gguf import GGUFReader

    kv = GGUFReader(tmp_path / "maps.gguf").fields
    assert kv["ridgefill.gguf.format"].contents() == "ridgefill-maps-gguf/3"


def test_solve_refuses_an_earlier_state_the_capture_has_not(chain):
    r = cli("solve", chain["plain"].id, "--earlier", "1", "--store", chain["store"].root)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"Error: --earlier 1: capture {chain['plain'].id} has no such earlier state (it has "
                                "none; capture with --earlier)")


def test_the_vllm_plugin_reads_what_a_release_of_earlier_states_says(chain, tmp_path):
    """The plugin's view of a /3 release: the earlier layers its compiled early part keeps, in the release's order,
    and its start-up line says what the exact-row rule reads (engine agreement: tests/test_vllm_plugin_tiny.py)."""
    from ridgefill.engines.vllm import served

    _, _, out = export(chain["store"], chain["sol"][None].id, ExportConfig(tail=8), quiet(), out_dir=tmp_path / "rel")
    fill = served.load(out)
    assert fill.earlier == (0, 1) and fill.split == 2
    assert "exact rows: the first 1, the tail, the states entering layers 2, 0, 1 above norm" in fill.describe()


def test_quantize_scores_the_maps_on_what_they_read(chain, tmp_path):
    """quantize re-scores the float maps on the held-out [h_2; h_0; h_1] (the solve's own score, which reading h_2
    alone could not give: the widths would not even multiply) and its int8 maps export as a /3 release."""
    from ridgefill.quantize import quantize

    sol = chain["sol"][None]
    q, _ = quantize(chain["store"], sol.id, quiet())
    assert q.manifest["summary"]["score_float"] == pytest.approx(sol.manifest["summary"]["score"], abs=1e-9)
    assert abs(q.manifest["summary"]["score_int8"] - q.manifest["summary"]["score_float"]) < 0.01
    _, _, out = export(chain["store"], q.id, ExportConfig(tail=8), quiet(), out_dir=tmp_path / "int8")
    rel = release.read_release(out)
    assert rel.format == "ridgefill-maps/3" and rel.manifest["projector"]["dtype"] == "int8"
    assert {m["weight"].shape for m in rel.maps.values()} == {(64, 192)}


def test_a_sweep_over_a_capture_of_earlier_states(tmp_path, tiny_llama_1k, monkeypatch):
    """A sweep whose capture stacks earlier states solves every split's maps from them, keeps the states they read
    in its exact runs, and records for each needle what an independent prefill of that split's maps and states
    decodes."""
    from dataclasses import replace

    from ridgefill.evaluate.needles import score_answer
    from ridgefill.evaluate.source import load_source
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import greedy
    from ridgefill.sweep import sweep
    from ridgefill.sweep.needles import needle_suite
    from test_sweep import CAPTURE, CFG, key_budget

    key_budget(monkeypatch)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(5):
        (data / f"d{i}.txt").write_text(f"document {i}: " + "the cat sat on the mat and looked around. " * (8 + i))
    st = Store(tmp_path / "store")
    cfg = replace(CFG, splits=(2, 3))
    art, _ = sweep(st, str(tiny_llama_1k), cfg, quiet(), data=[str(data)], capture_args={**CAPTURE, "earlier": (1, 2)})
    res = json.loads(art.file("sweep.json").read_text())
    srcs = {e["split"]: load_source(st, e["quantize"]) for e in res["splits"]}
    assert {s: src.states for s, src in srcs.items()} == {2: (2, 1, 0), 3: (3, 2, 1)}
    lm = load_model(resolve_model(str(tiny_llama_1k), store_root=st.root), store_root=st.root)
    suite = needle_suite(lm, cfg)
    checked = 0
    for row in res["needles"][:6]:
        _, smp = suite[row["index"]]
        for job, ok in row["arms"].items():
            split, name = job.split("/", 1)
            if name != "ridgefill":
                continue
            src = srcs[int(split)]
            r = prefill(lm, torch.tensor(smp.prompt_ids), "ridgefill", split=src.split, tail=cfg.tail, maps=src.maps,
                        map_kinds=src.map_kinds, anchor=src.anchor, exact_norm=src.exact_norm, states=src.states)
            text = lm.tokenizer.decode(greedy(lm, r, smp.max_new_tokens), skip_special_tokens=True)
            assert ok == score_answer(smp, text), (row["index"], job)
            checked += 1
    assert checked >= 4
    # `ridgefill sweep --earlier 1`: the solves read the states named, some of the capture's (one round of needles)
    base = ["sweep", tiny_llama_1k, "--splits", "2,3", "--length", "600", "--tail", "48", "--scored", "16",
            "--needles", "1", "--documents", "1", "--no-configurations", "--capture", art.recipe["capture"],
            "--store", st.root]
    r = cli_here(*base, "--earlier", "1", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(st.get(json.loads(r.stdout)["id"], stage="sweep").file("sweep.json").read_text())
    assert {e["split"]: load_source(st, e["quantize"]).states for e in got["splits"]} == {2: (2, 1), 3: (3, 2)}
    listed = sorted(p.name for p in (st.root / "sweep").iterdir())
    r = cli_here(*base, "--earlier", "0")
    assert r.returncode == 2 and r.stderr.strip() == ("Error: --earlier must be distinct offsets >= 1 (the states "
                                                      "h_{S-k}), got 0")
    assert sorted(p.name for p in (st.root / "sweep").iterdir()) == listed  # nothing written
