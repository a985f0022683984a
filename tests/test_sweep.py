"""`ridgefill sweep` on a tiny model: one capture for every split; the adaptive search (bisection, sequential rule)
and the exhaustive sweep recommend the same (split, configuration); every needle outcome equals an independent
prefill; configurations beside their controls; timing rounds; resuming; reuse of a capture; the refusals."""

import json
import time

import numpy as np
import pytest
import torch

from ridgefill.artifacts import Store
from ridgefill.sweep import SweepConfig, sweep
from ridgefill.sweep.config import default_splits, parse_splits
from ridgefill.errors import BadInput
from clirun import cli_here
from conftest import SMALL_CHAIN, quiet

SMALL = ["--length", "600", "--tail", "48", "--scored", "16", "--needles", "16", "--documents", "2"]
CFG = SweepConfig(splits=(1, 2, 3), length=600, tail=48, scored=16, needles=16, documents=2)
# The sweeps measure 600-token prompts, so they run the tiny llama's weights with a context of 1024 (ridgefill refuses a
# length past a model's context); the capture cuts documents at 256 tokens, as the tiny llama's own context would.
CAPTURE = {"chunk": 64, "held_out": 1, "max_length": 256}


def key_budget(monkeypatch):
    """The random tiny model has no key tokens (no token loses 2 nats without its context), so no key ΔNLL is
    measured and every split would be over budget on it: here the plain arms at split 1 are over on key ΔNLL and
    everything else within, so the needles decide splits 2 and 3, and the configurations are measured at split 1."""
    from ridgefill.sweep import documents

    monkeypatch.setattr(documents, "over_budget",
                        lambda job, figures, cfg: "key ΔNLL" if job in ((1, "ridgefill"), (1, "identity")) else None)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweepdata")
    for i in range(5):
        (d / f"d{i}.txt").write_text(f"document {i}: " + "the cat sat on the mat and looked around. " * (8 + i))
    return d


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_llama_1k, data):
    """The adaptive and the exhaustive sweep of the same model, settings and capture, and the wall and CPU seconds
    each call took."""
    mp = pytest.MonkeyPatch()
    key_budget(mp)
    try:
        st = Store(tmp_path_factory.mktemp("sweep") / "store")
        arts, spent = {}, {}
        for mode in ("adaptive", "exhaustive"):
            from dataclasses import replace

            cfg = replace(CFG, exhaustive=mode == "exhaustive")
            wall, cpu = time.perf_counter(), time.process_time()
            art, cached = sweep(st, str(tiny_llama_1k), cfg, quiet(), data=[str(data)],
                                capture_args=CAPTURE)
            spent[mode] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
            assert not cached
            arts[mode] = (art, json.loads(art.file("sweep.json").read_text()))
    finally:
        mp.undo()
    return st, arts, spent


def test_parse_splits():
    assert parse_splits("8-12", 30) == (8, 9, 10, 11, 12)
    assert parse_splits("8-24:4", 30) == (8, 12, 16, 20, 24)
    assert parse_splits("16, 8,12-13,8", 30) == (8, 12, 13, 16)
    for bad, msg in (("8-", "is not a split"), ("a", "is not a split"), ("12-8", "is empty"), ("8-12:0", "at least 1"),
                     ("0-4", "'0-4' starts at split 0; a split is a layer 1 or deeper")):
        with pytest.raises(BadInput, match=msg):
            parse_splits(bad, 30)
    # a range is checked against the model before it is expanded: one short line, whatever its length
    for text in ("1-200000", "1-1000000000", "2-1000000000:7"):
        with pytest.raises(BadInput) as e:
            parse_splits(text, 30)
        assert str(e.value) == (f"--splits: '{text}' reaches past the model's last split 29 (the model has 30 "
                                "layers; use 1..29)")
    assert default_splits(30) == (8, 10, 12, 14, 16, 18, 20, 22) and len(default_splits(18)) == 8


def test_adaptive_and_exhaustive_recommend_the_same(both):
    """Same recommendation, fewer needle prompts; the adaptive one measures no needle where key ΔNLL decides."""
    _, arts, _ = both
    (ad_art, ad), (_, ex) = arts["adaptive"], arts["exhaustive"]
    assert (ad["mode"], ex["mode"]) == ("adaptive", "exhaustive")
    for k in ("split", "configuration", "tail"):
        assert ad["recommended"][k] == ex["recommended"][k]
    assert ad["search"]["ridgefill"]["edge"] == ex["search"]["ridgefill"]["edge"] == 2
    assert ad["recommended"]["split"] is not None
    # The prompts each job was measured on, counted by hand. The random model's exact forward answers no needle, so
    # every pair is (wrong, wrong): no early look decides (within at 12 prompts needs P(Binomial(12, 0.2) = 0) =
    # 0.069 below 0.05), and every job measured runs to the last look, all 18 prompts (16 asked: 3 rounds of 6).
    # Exhaustive: every split and arm, and every configuration and control at split 1 (rows, rows:tail, kscale,
    # protected, protected:tail).
    # Adaptive: split 1 is over on key ΔNLL (no needle there), bisection measures 2 and 3 side by side (the last
    # open splits), and of the configurations only +kscale (the highest ceiling, within; test below).
    plain = [f"{s}/{a}" for s in (1, 2, 3) for a in ("ridgefill", "identity")]
    confs = ["1/ridgefill+rows", "1/ridgefill+rows:tail", "1/ridgefill+kscale", "1/ridgefill+protected",
             "1/ridgefill+protected:tail"]
    assert ex["cost"]["needle_prompts"] == {job: 18 for job in plain + confs}
    assert ad["cost"]["needle_prompts"] == {job: 18 for job in plain[2:] + ["1/ridgefill+kscale"]}
    # Each prompt's exact forward runs once, in the needle pass, which keeps its early layers; the configuration
    # pass (one pass of 18 prompts in both modes) reads them back for every prompt instead of running them again.
    for res in (ad, ex):
        assert (res["cost"]["exact_forwards"], res["cost"]["early_layers_read_back"]) == (18, 18)
        assert res["cost"]["prompts_with_exact_answer"] == 18 and res["exact"]["needle"] == 0.0
    # adaptive: split 1 is over on key ΔNLL (no needle there), and bisection visits 2 first
    assert not any(k.startswith("1/ridgefill") and not k.startswith("1/ridgefill+") for k in ad["cost"]["needle_prompts"])
    assert ad["search"]["ridgefill"]["measured"][0] == 2
    e1 = next(e for e in ad["splits"] if e["split"] == 1)
    assert e1["arms"]["ridgefill"]["verdict"] == "over" and e1["arms"]["ridgefill"]["decided"] == "key ΔNLL"
    assert e1["arms"]["ridgefill"]["needle"] is None
    summary = ad_art.manifest["summary"]
    assert summary["recommended"] == ad["recommended"]["split"] and summary["mode"] == "adaptive"
    assert summary["needle_prompts"] == ad["cost"]["needle_prompts"]
    assert ad["rule"]["looks"] == [12, 18] and ex["rule"]["looks"] == [18]  # 16 prompts: 3 whole rounds of 6


def test_needle_outcomes_equal_independent_prefills(both, tiny_llama_1k):
    """Every needle outcome recorded (exact and each (split, arm)) is what an independent prefill of that arm and a
    greedy decode give; the suite holds eval's three tasks in both prompt forms."""
    from ridgefill.evaluate.arms import parse_arm
    from ridgefill.evaluate.needles import score_answer
    from ridgefill.models import load_model, resolve_model
    from ridgefill.quantize.artifact import float_maps
    from ridgefill.runtime import greedy, prefill
    from ridgefill.sweep.needles import needle_suite

    st, arts, _ = both
    _, res = arts["adaptive"]
    lm = load_model(resolve_model(str(tiny_llama_1k), store_root=st.root), store_root=st.root)
    suite = needle_suite(lm, CFG)
    assert len(suite) == 18 and {(k.task, k.form) for k, _ in suite[:6]} == {
        (t, f) for t in ("single", "multikey", "multivalue") for f in ("chat", "plain")}
    assert [(r["task"], r["haystack"], r["form"], r["length"]) for r in res["needles"]] == [
        tuple(k) for k, _ in suite][: len(res["needles"])]
    maps = {e["split"]: float_maps(st.get(e["quantize"])) for e in res["splits"]}
    text = lambda smp, r: lm.tokenizer.decode(greedy(lm, r, smp.max_new_tokens), skip_special_tokens=True)  # noqa: E731
    checked = 0
    for row in res["needles"][:6]:  # one of each task and form
        _, smp = suite[row["index"]]
        ids = torch.tensor(smp.prompt_ids)
        assert row["exact"] == score_answer(smp, text(smp, prefill(lm, ids, "exact", split=0, tail=48)))
        for job, ok in row["arms"].items():
            split, name = job.split("/", 1)
            arm = parse_arm(name)
            if arm.selector or arm.corrections:
                continue  # eval's own tests check those arms against prefills
            r = prefill(lm, ids, arm.base, split=int(split), tail=48, maps=maps[int(split)] if arm.base == "ridgefill"
                        else None)
            assert ok == score_answer(smp, text(smp, r)), (row["index"], job)
            checked += 1
    assert checked >= 4


def test_configurations_beside_their_controls(both):
    """At the split just shallower than the maps' edge, +rows, +kscale (a Llama has no QK-norm) and +protected,
    each with its control, their ceilings from the rows they add, and the beats-control judgement. The exhaustive
    sweep measures every one; the adaptive one only what can change the recommendation, highest ceiling first."""
    _, arts, _ = both
    for mode in ("adaptive", "exhaustive"):
        res = arts[mode][1]
        e1 = next(e for e in res["splits"] if e["split"] == 1)
        confs = e1["configurations"]
        assert set(confs) == {"ridgefill+rows", "ridgefill+kscale", "ridgefill+protected"}
        rows = confs["ridgefill+rows"]
        assert rows["control"]["arm"] == "ridgefill+rows:tail" and rows["control"]["tail"] == 48 + round(rows["extra_rows"])
        assert rows["extra_rows"] > 0
        assert rows["ceiling_speedup"] == pytest.approx(4 * 600 / (1 * (600 - rows["control"]["tail"]) + 4 * rows["control"]["tail"]))
        assert confs["ridgefill+kscale"]["control"]["arm"] == "ridgefill" and confs["ridgefill+kscale"]["extra_rows"] == 0
        measured = ["ridgefill+kscale"] if mode == "adaptive" else list(confs)
        plain_ceiling = next(e for e in res["splits"] if e["split"] == 2)["ceiling_speedup"]  # the maps' edge
        reasons = set()
        for name, c in confs.items():
            pairs = [(r["exact"], r["arms"][f"1/{name}"]) for r in res["needles"] if f"1/{name}" in r["arms"]]
            assert c["figures"]["needle_n"] == len(pairs)
            if name in measured:
                assert len(pairs) > 0
                assert c["verdict"] == "within"  # no key ΔNLL here, and the random model answers no needle
            else:
                # no key ΔNLL to tell a configuration from its control: it cannot beat it, so only the control (a
                # longer tail) could be a candidate, and +kscale, of higher ceiling, is within budget already
                assert len(pairs) == 0 and c["verdict"] is None and c["beats_control"] is False
                assert c["decided"] == "not measured: its key ΔNLL (–) is not below its control's (–), so it cannot beat it"
                assert c["control"]["verdict"] is None
                k, bar = confs["ridgefill+kscale"]["ceiling_speedup"], plain_ceiling
                assert c["ceiling_speedup"] < k
                why = (f"not measured: its ceiling x{c['ceiling_speedup']:.2f} is not above the plain fill's x{bar:.2f}"
                       if c["ceiling_speedup"] <= bar else
                       f"not measured: a candidate of higher ceiling (x{k:.2f}) is within budget")
                assert c["control"]["decided"] == why
                reasons.add(why.split(" ")[3])
                assert not any(f"1/{name}" in key for key in res["cost"]["needle_prompts"])
        # +kscale's control is the plain fill at split 1, over budget: it beats it; the others' controls (a longer
        # tail) are as good, with no key ΔNLL to tell them apart.
        assert confs["ridgefill+kscale"]["beats_control"] is True
        assert reasons == ({"ceiling", "candidate"} if mode == "adaptive" else set())  # both reasons are met here
        if mode == "exhaustive":
            assert confs["ridgefill+rows"]["beats_control"] is False
            assert confs["ridgefill+rows"]["control"]["verdict"] == "within"
        rec = res["recommended"]
        assert (rec["split"], rec["configuration"], rec["tail"], rec["kind"]) == (1, "ridgefill+kscale", 48, "configuration")
        kinds = {(c["split"], c["configuration"], c["kind"]) for c in rec["candidates"]}
        assert (2, "ridgefill", "plain") in kinds
        assert ((1, "ridgefill", "longer tail") in kinds) == (mode == "exhaustive")
        assert all(not e["configurations"] for e in res["splits"] if e["split"] != 1)


def test_timing_rounds_and_macs(both, tiny_llama_1k, tmp_path):
    from ridgefill.evaluate.macs import model_shape, prefill_macs
    from ridgefill.models import load_model, resolve_model

    _, arts, spent = both
    for mode in ("adaptive", "exhaustive"):
        # Where this run's time went: the phases follow one another, each lap rounded to 0.01 s, within the sweep()
        # call. Wall-clock and CPU times, so only bounded: by the call's own clocks, which also count what comes
        # before the first phase (the capture, or finding it and the solves cached).
        secs = arts[mode][1]["cost"]["seconds"]
        assert set(secs) == {"solve", "documents", "needles", "configurations", "timing"}
        for clock in ("wall", "cpu"):
            assert 0 <= sum(v[clock] for v in secs.values()) <= spent[mode][clock] + 0.005 * len(secs)
        assert min(v[clock] for v in secs.values() for clock in ("wall", "cpu")) >= 0
    res = arts["adaptive"][1]
    # multiply-accumulates: evaluate/macs.py's counts (tested against the runtime's work in test_macs.py) at the
    # sweep's length and tail; a configuration's extra exact rows count beside the anchor row
    shape = model_shape(load_model(resolve_model(str(tiny_llama_1k), store_root=tmp_path), store_root=tmp_path).adapter)
    for e in res["splits"]:
        s = e["split"]
        exact = prefill_macs(shape, 600, 48, s, "exact")["total"]
        assert e["macs"] == {"exact": exact, "arm": prefill_macs(shape, 600, 48, s, "ridgefill", exact_rows=1)["total"]}
        for name, c in e["configurations"].items():
            base = "ridgefill+rows" if name == "ridgefill+rows" else "ridgefill"
            rows = 1 + round(c["extra_rows"])
            assert c["macs"] == {"exact": exact, "arm": prefill_macs(shape, 600, 48, s, base, exact_rows=rows)["total"]}
    t = res["timing"]
    assert t["repeats"] == 3 and len(t["rounds"]) == 3
    for r in t["rounds"]:
        assert set(r) >= {"exact"} | {f"{s}/ridgefill/48" for s in (1, 2, 3)}
    for e in res["splits"]:
        sp = e["speed"]
        runs = [r["exact"] / r[f"{e['split']}/ridgefill/48"] for r in t["rounds"]]
        assert sp["runs"] == runs and sp["median"] == sorted(runs)[1]
        assert (sp["low"], sp["high"]) == (min(runs), max(runs))
        assert sp["noise"] == (sp["median"] > e["ceiling_speedup"])


def test_the_sweeps_ceilings_are_the_runtimes_correctly_rounded(both):
    """Every compute ceiling in sweep.json is `runtime.ceiling_speedup`: (L N) / (S (N - T) + L T) as one correctly
    rounded division (checked against the exact fraction), which 1 / `ceiling` (two roundings) misses by one ulp
    for some (N, T, S, L); a configuration's extra exact rows count as tail rows."""
    from fractions import Fraction
    from math import ulp

    from ridgefill.runtime import ceiling, ceiling_speedup

    def exact(n, t, s, layers):  # the fraction, rounded once
        return float(Fraction(layers * n, s * (n - t) + layers * t))

    grid = [(n, t, s, layers) for layers in (4, 18, 30) for n in (600, 1024, 4096) for t in range(0, n + 1, n // 24)
            for s in range(layers + 1) if s * (n - t) + layers * t]
    assert all(ceiling_speedup(*g) == exact(*g) for g in grid)
    assert all(abs(1 / ceiling(*g) - exact(*g)) <= ulp(exact(*g)) for g in grid)
    assert any(1 / ceiling(*g) != exact(*g) for g in grid)  # why the sweep does not divide 1 by `ceiling`
    assert ceiling_speedup(600, 12, 1, 4) == 3.7735849056603774 != 1 / ceiling(600, 12, 1, 4)
    assert ceiling_speedup(100, 0, 0, 10) == float("inf")
    with pytest.raises(BadInput, match="ceiling needs"):
        ceiling_speedup(10, 11, 1, 4)
    for mode in ("adaptive", "exhaustive"):
        for e in both[1][mode][1]["splits"]:
            assert e["ceiling_speedup"] == exact(600, 48, e["split"], 4)
            for c in e["configurations"].values():
                assert c["ceiling_speedup"] == exact(600, min(48 + round(c["extra_rows"]), 600), e["split"], 4)


def test_sweep_artifact_files_and_table(both, tmp_path):
    from ridgefill.sweep.plot import plot

    _, arts, _ = both
    art, res = arts["adaptive"]
    assert sorted(p.name for p in art.path.iterdir() if p.name != "artifact.json") == ["sweep.json", "sweep.md", "sweep.png"]
    md = art.file("sweep.md").read_text()
    assert md.startswith(f"**sweep {res['model']} (adaptive): length 600, tail 48; exact needle")
    assert f"Recommendation: {res['recommended']['reason']}" in md
    assert f"What the maps earn: {res['advantage']['line']}" in md
    png = art.file("sweep.png").read_bytes()
    assert plot(res, tmp_path / "same.png").read_bytes() == png


def test_sweep_cli_is_cached_and_reuses_a_capture(both, tiny_llama_1k):
    st, arts, _ = both
    art = arts["adaptive"][0]
    cap = art.recipe["capture"]
    r = cli_here("sweep", tiny_llama_1k, "--splits", "1-3", *SMALL, "--capture", cap, "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["id"] == art.id and out["cached"] is True
    assert "recommended" in r.stderr and "sweep.png" in r.stderr and "what the maps earn" in r.stderr


def test_map_kinds_side_by_side(both, tiny_llama_1k, monkeypatch):
    """--maps input,kv: the input sweep is the one already made (cached), a kv sweep runs on the same capture with
    key/value maps, and the comparison holds each kind's own figures and their needle answers paired prompt by
    prompt; the kv fill does fewer multiply-accumulates, so at equal ceilings kv is the kind to ship."""
    from ridgefill.solve.artifact import load_map_kinds

    key_budget(monkeypatch)
    st, arts, _ = both
    art, res = arts["adaptive"]
    r = cli_here("sweep", tiny_llama_1k, "--splits", "1-3", *SMALL, "--capture", art.recipe["capture"], "--maps",
                 "input,kv", "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["sweeps"]["input"]["id"], got["sweeps"]["input"]["cached"]) == (art.id, True)
    kv = st.get(got["sweeps"]["kv"]["id"], stage="sweep")
    kv_res = json.loads(kv.file("sweep.json").read_text())
    assert kv.recipe["capture"] == art.recipe["capture"] == got["capture"] and not got["sweeps"]["kv"]["cached"]
    for e in kv_res["splits"]:
        kinds = load_map_kinds(st.get(e["solve"], stage="solve"))
        assert set(kinds.values()) == {"kv"} and sorted(kinds) == list(range(e["split"], 4))
    comp = got["comparison"]
    assert comp["kinds"] == ["input", "kv"] and [x["split"] for x in comp["splits"]] == [1, 2, 3]
    for row in comp["splits"]:
        s = row["split"]
        for kind, rr in (("input", res), ("kv", kv_res)):
            e = next(x for x in rr["splits"] if x["split"] == s)
            assert row[kind]["dnll_key"] == e["arms"]["ridgefill"].get("dnll_key")
            assert row[kind]["verdict"] == e["arms"]["ridgefill"]["verdict"]
            assert row[kind]["macs_ratio"] == e["macs"]["arm"] / e["macs"]["exact"]
        assert row["kv"]["macs_ratio"] < row["input"]["macs_ratio"]
        answers = [{n["index"]: n["arms"][f"{s}/ridgefill"] for n in rr["needles"] if f"{s}/ridgefill" in n["arms"]}
                   for rr in (res, kv_res)]
        common = sorted(set(answers[0]) & set(answers[1]))
        assert row["paired"]["kv"]["n"] == len(common)
        if common:
            assert row["paired"]["kv"]["mean"] == pytest.approx(
                100.0 * np.mean([answers[1][i] - answers[0][i] for i in common]))
    rec = {k: rr["recommended"] for k, rr in (("input", res), ("kv", kv_res))}
    ceil = {k: v["ceiling_speedup"] if v["split"] is not None else -1.0 for k, v in rec.items()}
    want = None if max(ceil.values()) < 0 else "kv" if ceil["kv"] >= ceil["input"] else "input"  # kv: fewer MACs
    assert comp["choice"]["maps"] == want and (want is None or comp["choice"]["split"] == rec[want]["split"])
    assert "map kind to ship:" in r.stderr


DEPRECATED = "samples is deprecated: it is now {} (the same number); the old name goes in the next release"


def test_needles_is_the_setting_samples_was(both, tiny_llama_1k):
    """--needles counts the single-needle prompts in all (eval's --samples counts per cell). --samples, its old
    name, still works for one release, with one deprecation line; both at once are refused with one line (exit 2).
    The artifact's recipe and sweep.json keep the key `samples`: the same sweep, whichever name set it, and the
    same id as before the rename."""
    st, arts, _ = both
    art, res = arts["adaptive"]
    assert art.recipe["samples"] == res["samples"] == 16 and "needles" not in art.recipe  # (res["needles"]: outcomes)
    new = ["sweep", tiny_llama_1k, "--splits", "1-3", *SMALL, "--capture", art.recipe["capture"], "--store", st.root,
           "--json"]
    old = ["--samples" if a == "--needles" else a for a in new]
    assert "--needles" not in old
    r = cli_here(*old)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["id"] == art.id and json.loads(r.stdout)["cached"] is True
    assert [line for line in r.stderr.splitlines() if "deprecated" in line] == [
        "Warning: --" + DEPRECATED.format("--needles")]
    r = cli_here(*new)
    assert r.returncode == 0 and "deprecated" not in r.stderr and json.loads(r.stdout)["id"] == art.id
    r = cli_here(*new, "--samples", "16")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("Error: --samples and --needles are the same setting; give only --needles (--samples is its "
                        "old name)\n")
    r = cli_here("sweep", "--help")
    assert r.returncode == 0 and "--needles" in r.stdout and "--samples" not in r.stdout


def test_a_recipes_sweep_table_takes_needles_and_the_old_samples(tmp_path, capsys):
    from ridgefill.recipe import load_recipe

    head = 'model = "x"\n[solve]\nsplit = "auto"\n[sweep]\n'
    warned = "Warning: recipe [sweep]: " + DEPRECATED.format("needles") + "\n"
    for name, table, err in (("new", "needles = 24\n", ""), ("old", "samples = 24\n", warned)):
        (tmp_path / f"{name}.toml").write_text(head + table)
        assert load_recipe(tmp_path / f"{name}.toml").sweep == SweepConfig(needles=24)
        assert capsys.readouterr().err == err
    (tmp_path / "both.toml").write_text(head + "samples = 24\nneedles = 24\n")
    with pytest.raises(BadInput) as e:
        load_recipe(tmp_path / "both.toml")
    assert str(e.value) == ("recipe [sweep]: samples and needles are the same setting; give only needles (samples is "
                            "its old name)")
    r = cli_here("release", tmp_path / "both.toml", "--store", tmp_path / "store")
    assert r.returncode == 2 and r.stderr == f"Error: {e.value}\n"


@pytest.mark.parametrize("args, msg", [
    (["--splits", "3-1"], "the range '3-1' is empty"),
    (["--splits", "2,9"], "--splits: '9' reaches past the model's last split 3 (the model has 4 layers; use 1..3)"),
    (["--splits", "0"], "--splits: '0' starts at split 0; a split is a layer 1 or deeper"),
    (["--splits", "1-3", "--max-needle-drop", "-1"], "--max-needle-drop must be a number >= 0"),
    (["--splits", "1-3", "--max-key-dnll", "-0.5"], "--max-key-dnll must be a number >= 0"),
    (["--splits", "1-3", "--length", "40"], "--length (40) must be longer than --tail (48)"),
    (["--splits", "1-3", "--seed", "-1"], "--seed must be at least 0 (numpy's generators take no negative seed), got -1"),
    (["--splits", "1-3", "--repeats", "2"], "--repeats must be at least 3"),
    (["--splits", "1-3", "--needles", "0"], "--needles must be at least 1, got 0"),
    (["--splits", "1-3"], "--length 600 is longer than the model's context (256 positions)"),  # the tiny llama's
])
def test_sweep_refusals(tmp_path, tiny_llama, args, msg):
    st = tmp_path / "store"
    r = cli_here("sweep", tiny_llama, *SMALL, *args, "--store", st)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    assert not st.exists()  # a refusal writes nothing, not even the store's fingerprint cache


def test_sweep_refuses_a_capture_without_the_splits(tiny_chain, tiny_llama):
    c = tiny_chain(SMALL_CHAIN)  # conftest's small chain: a capture at split 2 only, and its solve
    st = c.store
    before = sorted(p.name for p in (st.root / "solve").iterdir())
    r = cli_here("sweep", tiny_llama, "--splits", "1-3", *SMALL, "--capture", c.cap.id, "--store", st.root)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"Error: capture {c.cap.id} lacks split(s) 1, 3 (it has 2): capture them with `ridgefill "
                        f"capture {tiny_llama} --split 1 --split 2 --split 3`, or sweep its own splits\n")
    assert sorted(p.name for p in (st.root / "solve").iterdir()) == before and not (st.root / "sweep").exists()




def test_a_stopped_sweep_resumes_where_it_was(tmp_path, tiny_llama_1k, data, both, monkeypatch):
    """Killed after three needle prompts, the sweep keeps every outcome in .work-<id>/needles.json; the next run
    measures no prompt twice and gives the uninterrupted sweep's artifact."""
    from ridgefill.sweep.needles import NeedleMemo

    key_budget(monkeypatch)
    st = Store(tmp_path / "store")
    real_save, saves = NeedleMemo.save, []

    def save_then_die(self):
        real_save(self)
        saves.append(1)
        if len(saves) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(NeedleMemo, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        sweep(st, str(tiny_llama_1k), CFG, quiet(), data=[str(data)], capture_args=CAPTURE)
    work = list((st.root / "sweep").glob(".work-*"))
    assert len(work) == 1
    saved = json.loads((work[0] / "needles.json").read_text())
    assert len(saved["exact"]) == 3

    monkeypatch.setattr(NeedleMemo, "save", real_save)
    art, cached = sweep(st, str(tiny_llama_1k), CFG, quiet(), data=[str(data)], capture_args=CAPTURE)
    assert not cached and not work[0].exists()
    res, want = json.loads(art.file("sweep.json").read_text()), both[1]["adaptive"][1]
    assert art.id == both[1]["adaptive"][0].id
    assert res["needles"] == want["needles"] and res["cost"]["needle_prompts"] == want["cost"]["needle_prompts"]
    # three prompts were measured before the stop: this run made the remaining exact forwards only
    assert res["cost"]["exact_forwards"] == want["cost"]["exact_forwards"] - 3


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3"])
def test_a_fill_from_the_early_run_equals_one_from_the_whole_forward(fixture, request, tmp_path):
    """A prompt whose exact answer is known runs the exact model only up to the deepest split the fills need: the
    fills built on it give the same logits and caches as on the whole forward."""
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import exact_run, prefill_from
    from ridgefill.sweep.early import early_run

    path = request.getfixturevalue(fixture)
    lm = load_model(resolve_model(str(path), store_root=tmp_path), store_root=tmp_path)
    ids = torch.randint(5, 200, (96,), generator=torch.Generator().manual_seed(0))
    full, early = exact_run(lm, ids, splits=[1, 2]), early_run(lm, ids, [1, 2])
    assert set(early.states) == {1, 2}
    for split in (1, 2):
        a = prefill_from(lm, full, "identity", split=split, tail=24)
        b = prefill_from(lm, early, "identity", split=split, tail=24)
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=0)


def test_kscale_is_measured_only_without_a_qk_norm(tiny_llama, tiny_gemma3, tmp_path):
    """+kscale rescales the filled keys, which a QK-norm (Gemma 3) renormalizes away: the sweep leaves it out there."""
    from ridgefill.models import load_model, resolve_model
    from ridgefill.sweep.configurations import kscale_applies

    lms = {p: load_model(resolve_model(str(p), store_root=tmp_path), store_root=tmp_path) for p in (tiny_llama, tiny_gemma3)}
    assert kscale_applies(lms[tiny_llama], 1) is True
    assert lms[tiny_gemma3].adapter.has_qk_norm and kscale_applies(lms[tiny_gemma3], 1) is False


@pytest.mark.parametrize("fixture,dtype", [("tiny_llama", "float32"), ("tiny_gemma3", "float32"),
                                           ("tiny_llama", "bfloat16")])
def test_early_layers_read_back_give_the_fills_of_the_whole_forward(fixture, dtype, request, tmp_path):
    """The early layers a sweep keeps on disk between needle passes (EarlyCaches), read back, give bit for bit the
    fills of the exact run they were saved from, "+rows" included (it selects from the keys below the split; on
    Gemma the sliding layers keep a window and their count of rows), in bfloat16 too. Splits not kept, or a run
    past the disk limit, are not read back: the sweep runs the early layers again."""
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import exact_run, prefill_from, selects_from
    from ridgefill.sweep.early import EarlyCaches

    path = request.getfixturevalue(fixture)
    lm = load_model(resolve_model(str(path), store_root=tmp_path), store_root=tmp_path, dtype=dtype)
    ids = torch.randint(5, 200, (96,), generator=torch.Generator().manual_seed(0))
    full = exact_run(lm, ids, splits=[1, 2, 3])
    keep = EarlyCaches(tmp_path / "work", lm, (1, 2), 1 << 30)
    assert keep.save(0, full) and not keep.save(0, full)  # kept once
    assert keep.load(0, ids, [3]) is None and keep.load(1, ids, [1]) is None
    back = keep.load(0, ids, [1, 2])
    assert set(back.states) == {1, 2} and back.logits is None
    assert all(back.states[s].dtype == full.states[s].dtype == getattr(torch, dtype) for s in (1, 2))
    arms = ["identity", "ridgefill+rows"] if selects_from(lm, full, 2) else ["identity"]
    assert (fixture == "tiny_llama") == ("ridgefill+rows" in arms)
    for split in (1, 2):
        for arm in arms:
            opts = {"split": split, "tail": 24}
            if arm == "ridgefill+rows":
                opts |= {"maps": _identity_maps(lm, split), "probe": range(40, 72), "row_share": 0.1}
            a, b = prefill_from(lm, full, arm, **opts), prefill_from(lm, back, arm, **opts)
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
            assert a.exact_rows == b.exact_rows
            for la, lb in zip(a.cache.layers, b.cache.layers):
                torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=0)
                assert getattr(la, "cumulative_length", None) == getattr(lb, "cumulative_length", None)
    small = EarlyCaches(tmp_path / "small", lm, (1, 2), 1000)
    assert not small.save(0, full) and small.load(0, ids, [1]) is None and not (tmp_path / "small").exists()
    keep.clear()
    assert not (tmp_path / "work" / "early").exists() and keep.load(0, ids, [1]) is None


def _identity_maps(lm, split):
    d = lm.adapter.hidden_size
    return {l: (torch.eye(d).numpy(), torch.zeros(d).numpy()) for l in range(split, lm.adapter.num_layers)}
