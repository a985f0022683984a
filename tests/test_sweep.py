"""`ridgefill sweep` on a tiny model: one capture for every split, figures equal to independent prefills per
split and arm, the recommendation, the artifact's files, reuse of a capture, and the refusals."""

import json

import pytest
import torch

from ridgefill.artifacts import Store
from ridgefill.sweep import SweepConfig, sweep
from ridgefill.sweep.run import default_splits, parse_splits
from ridgefill.errors import BadInput
from ridgefill.output import Output
from clirun import cli_here
from conftest import SMALL_CHAIN

SMALL = ["--length", "600", "--tail", "48", "--scored", "16", "--samples", "6", "--documents", "2"]
CFG = SweepConfig(splits=(1, 2, 3), length=600, tail=48, scored=16, samples=6, documents=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweepdata")
    for i in range(5):
        (d / f"d{i}.txt").write_text(f"document {i}: " + "the cat sat on the mat and looked around. " * (8 + i))
    return d


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_llama, data):
    st = Store(tmp_path_factory.mktemp("sweep") / "store")
    art, cached = sweep(st, str(tiny_llama), CFG, Output(quiet=True), data=[str(data)],
                        capture_args={"chunk": 64, "held_out": 1})
    assert not cached
    return st, art, json.loads(art.file("sweep.json").read_text())


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


def test_sweep_figures_equal_independent_prefills(swept, tiny_llama):
    """Every (split, arm) figure comes from its own maps and equals what an independent prefill of that arm gives:
    needle answers by greedy decoding, document ΔNLL; one capture serves every split."""
    from ridgefill.evaluate import metrics, texts
    from ridgefill.evaluate.needles import score_answer
    from ridgefill.sweep.run import needle_suite
    from ridgefill.quantize.artifact import float_maps as _maps_of
    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import greedy, prefill

    st, art, res = swept
    assert [e["split"] for e in res["splits"]] == [1, 2, 3]
    caps = {st.get(e["solve"]).recipe["capture"] for e in res["splits"]}
    assert caps == {art.recipe["capture"]} and st.get(art.recipe["capture"]).recipe["splits"] == [1, 2, 3]
    lm = load_model(resolve_model(str(tiny_llama), store_root=st.root), store_root=st.root)
    suite = needle_suite(lm, CFG)
    assert len(suite) == len(res["needles"]) == 6 and len({s.depth for s in suite}) == 6
    docs = texts.long_documents(lm.tokenizer, 600, limit=2)
    for e in res["splits"]:
        s, k = e["split"], str(e["split"])
        assert st.get(e["quantize"]).stage == "quantize"
        maps = _maps_of(st.get(e["quantize"]))
        fill = lambda arm: {"split": s, "tail": 48, "maps": maps if arm == "ridgefill" else None}  # noqa: E731
        for smp, row in zip(suite, res["needles"]):
            for arm in ("ridgefill", "identity"):
                text = lm.tokenizer.decode(greedy(lm, prefill(lm, torch.tensor(smp.prompt_ids), arm, **fill(arm)),
                                                  smp.max_new_tokens), skip_special_tokens=True)
                assert row[k][arm] == score_answer(smp, text), (s, arm)
        pick = slice(48 - 16 - 1, 48 - 1)
        for d, row in zip(docs, res["documents_detail"]):
            ids = torch.tensor(d.ids[:600])
            le = prefill(lm, ids, "exact", split=0, tail=48).logits[pick].numpy()
            la = prefill(lm, ids, "ridgefill", **fill("ridgefill")).logits[pick].numpy()
            dnll = float((metrics.token_nll(la, ids[-16:].numpy()) - metrics.token_nll(le, ids[-16:].numpy())).mean())
            assert row[k]["ridgefill"]["dnll"] == pytest.approx(dnll, abs=1e-4)
        exact_hits = [r["exact"] for r in res["needles"]]
        assert e["arms"]["ridgefill"]["needle_minus_exact"]["mean"] == pytest.approx(
            100 * (sum(r[k]["ridgefill"] for r in res["needles"]) - sum(exact_hits)) / 6)
        assert e["ceiling_speedup"] == pytest.approx(4 * 600 / (s * (600 - 48) + 4 * 48))
        assert e["arms"]["ridgefill"]["prefill_s"] > 0 and e["arms"]["identity"]["speedup"] > 0


# -- the recommendation, read independently ----------------------------------------------------------------------


def figures_from_rows(res: dict) -> dict:
    """{split: (needle points below exact, key-token ΔNLL or None)} of the fitted arm, from the result's raw rows:
    needle accuracy is the share of needle rows answered, key ΔNLL the key-token-weighted mean of the documents'."""
    rows, docs = res["needles"], res["documents_detail"]
    exact = 100 * sum(r["exact"] for r in rows) / len(rows)
    out = {}
    for e in res["splits"]:
        k = str(e["split"])
        needle = 100 * sum(r[k]["ridgefill"] for r in rows) / len(rows)
        keys = sum(d[k]["ridgefill"]["key_tokens"] for d in docs)
        key = sum(d[k]["ridgefill"]["dnll_key"] * d[k]["ridgefill"]["key_tokens"] for d in docs
                  if d[k]["ridgefill"]["key_tokens"]) / keys if keys else None
        out[e["split"]] = (exact - needle, key)
    return out


def rule(figures: dict, max_needle_drop: float, max_key_dnll: float) -> tuple:
    """The sweep's rule as docs/sweep.md and the README state it, written out here: a split is within budget when its
    fitted maps lose at most `max_needle_drop` points of needle accuracy against exact and their key-token ΔNLL is at
    most `max_key_dnll` nats, on the point estimates (a figure equal to its limit is within: 1e-9 of round-off is
    allowed; a figure that was not measured is not within); the recommendation is the shallowest split within
    budget, or none. figures: {split: (needle drop, key ΔNLL or None)}.
    -> (recommended split or None, [splits within budget, ascending], {split: [failing figures, sorted]})"""
    failing = {}
    for split, (drop, key) in sorted(figures.items()):
        failing[split] = sorted(name for name, value, limit in (("needle_drop", drop, max_needle_drop),
                                                                 ("dnll_key", key, max_key_dnll))
                                if value is None or value > limit + 1e-9)
    within = [split for split, bad in failing.items() if not bad]
    return (within[0] if within else None), within, failing


def test_sweep_artifact_recommends_and_plots(swept, tmp_path):
    """The recommendation is the rule's (read independently, on figures taken from the raw rows), on the measured
    result and on the same figures under other budgets; the table shows the result's figures cell by cell; the plot
    is the result's (the same figures give the same bytes, other figures other bytes)."""
    import copy
    import struct

    from ridgefill.sweep.report import plot, recommend

    st, art, res = swept
    assert sorted(p.name for p in art.path.iterdir() if p.name != "artifact.json") == ["sweep.json", "sweep.md", "sweep.png"]
    rec = res["recommended"]
    figs = figures_from_rows(res)
    for e in res["splits"]:  # the figures the rule reads are the rows'
        assert res["exact"]["needle"] - e["arms"]["ridgefill"]["needle"] == pytest.approx(figs[e["split"]][0], abs=1e-9)
        assert e["arms"]["ridgefill"]["dnll_key"] == figs[e["split"]][1]
    # The measured result: the random tiny model has no key tokens (no token loses 2 nats without its context), so
    # no split's key ΔNLL is measured and none is within budget; the needles are all missed, by exact too.
    assert res["budget"] == {"max_needle_drop": 10.0, "max_key_dnll": 0.5}
    split, within, failing = rule(figs, 10.0, 0.5)
    assert (split, within, failing) == (None, [], {1: ["dnll_key"], 2: ["dnll_key"], 3: ["dnll_key"]})
    assert (rec["split"], rec["qualifying"]) == (split, within)
    assert {c["split"]: sorted(c["failed"]) for c in rec["checks"]} == failing
    assert rec["reason"] == ("no split is within budget (needle at most 10 points below exact, key ΔNLL at most 0.5 "
                             "nats); even the deepest, split 3, fails: key ΔNLL not measured")
    summary = art.manifest["summary"]
    assert (summary["recommended"], summary["reason"], summary["qualifying"]) == (None, rec["reason"], [])
    assert summary["exact_needle"] == res["exact"]["needle"] == 0.0 and summary["retrieval"] == res["retrieval"]["line"]

    # The same figures with every scored token counted as a key token (key ΔNLL := |ΔNLL on all tokens|, a budget
    # being >= 0), under budgets at each split's own figure and below them all: the rule then recommends a split or
    # none, and `recommend` agrees every time.
    alt = copy.deepcopy(res)
    for e in alt["splits"]:
        e["arms"]["ridgefill"]["dnll_key"] = abs(e["arms"]["ridgefill"]["dnll"])
    alt_figs = {e["split"]: (figs[e["split"]][0], e["arms"]["ridgefill"]["dnll_key"]) for e in alt["splits"]}
    limits = sorted({key for _, key in alt_figs.values()})
    assert len(limits) == 3 and limits[0] > 0
    picked = set()
    for limit in [limits[0] / 2, *limits]:
        alt["budget"] = {"max_needle_drop": 0.0, "max_key_dnll": limit}
        want = rule(alt_figs, 0.0, limit)
        got = recommend(alt)
        assert (got["split"], got["qualifying"]) == want[:2], limit
        assert {c["split"]: sorted(c["failed"]) for c in got["checks"]} == want[2], limit
        picked.add(got["split"])
        if want[0] is not None:
            assert got["reason"].startswith(f"split {want[0]} is the shallowest within budget: needle 0.0 points "
                                            f"below exact (limit 0), key ΔNLL {alt_figs[want[0]][1]:.3f} nats (limit "
                                            f"{limit:g}); speed-up x")
    assert None in picked and len(picked) >= 2  # a budget none meets, and at least one split recommended

    # The table: a title, then one row per split with the result's figures and the check's verdict.
    md = art.file("sweep.md").read_text().splitlines()
    assert md[0] == (f"**sweep {res['model']}: exact needle 0.0 %, prefill {res['exact']['prefill_s']:.2f} s; length "
                     "600, tail 48, 6 needle samples, 2 documents**")
    rows = [line for line in md if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3
    for line, e in zip(rows, res["splits"]):
        rf, idn, held = e["arms"]["ridgefill"], e["arms"]["identity"], e["heldout"]
        ci = lambda a: f"[{a['needle_minus_exact']['low']:+.1f}, {a['needle_minus_exact']['high']:+.1f}]"  # noqa: E731
        assert line == (f"| {e['split']} ✗ | {rf['speedup']:.2f} ({e['ceiling_speedup']:.2f}) | "
                        f"{held['fitted']['k_cosine']:.3f} ({held['identity']['k_cosine']:.3f}) | "
                        f"{held['fitted']['v_cosine']:.3f} ({held['identity']['v_cosine']:.3f}) | "
                        f"{rf['needle']:.1f} {ci(rf)} | {idn['needle']:.1f} {ci(idn)} | – (–) | key ΔNLL not measured |")
    assert md[-3:] == [f"Recommendation: {rec['reason']}", "", res["retrieval"]["line"]]

    # The plot: 1100 x 450 pixels, and the plot of exactly this result and recommendation, byte for byte.
    png = art.file("sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR" and struct.unpack(">II", png[16:24]) == (1100, 450)
    assert plot(res, rec, tmp_path / "same.png").read_bytes() == png
    other = copy.deepcopy(res)
    other["splits"][0]["arms"]["ridgefill"]["needle"] = 50.0
    assert plot(other, rec, tmp_path / "other.png").read_bytes() != png


def test_sweep_cli_is_cached_and_reuses_a_capture(swept, tiny_llama):
    st, art, _ = swept
    cap = art.recipe["capture"]
    r = cli_here("sweep", tiny_llama, "--splits", "1-3", *SMALL, "--capture", cap, "--store", st.root, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["id"] == art.id and out["cached"] is True
    assert "recommended" in r.stderr and "sweep.png" in r.stderr


@pytest.mark.parametrize("args, msg", [
    (["--splits", "3-1"], "the range '3-1' is empty"),
    (["--splits", "2,9"], "--splits: '9' reaches past the model's last split 3 (the model has 4 layers; use 1..3)"),
    (["--splits", "0"], "--splits: '0' starts at split 0; a split is a layer 1 or deeper"),
    (["--splits", "1-3", "--max-needle-drop", "-1"], "--max-needle-drop must be a number >= 0"),
    (["--splits", "1-3", "--max-key-dnll", "-0.5"], "--max-key-dnll must be a number >= 0"),
    (["--splits", "1-3", "--length", "40"], "--length (40) must be longer than --tail (48)"),
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


def test_a_stopped_sweep_resumes_at_the_next_prompt(tmp_path, tiny_llama, data, swept, monkeypatch):
    """Killed after two needle prompts, the sweep keeps its rows in .work-<id>/rows.json; the next run measures only
    the prompts left and gives the uninterrupted sweep's figures."""
    import importlib

    from ridgefill.sweep import run as sw

    rt = importlib.import_module("ridgefill.runtime.api")  # the module the package exports exact_run from

    st = Store(tmp_path / "store")
    real_add, calls = sw.Checkpoint.add, []

    def add_then_die(self, kind, row):
        real_add(self, kind, row)
        if kind == "needles" and len(self.rows["needles"]) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(sw.Checkpoint, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        sweep(st, str(tiny_llama), CFG, Output(quiet=True), data=[str(data)], capture_args={"chunk": 64, "held_out": 1})
    work = list((st.root / "sweep").glob(".work-*"))
    assert len(work) == 1 and not list((st.root / "sweep").glob(".tmp-*"))
    saved = json.loads((work[0] / "rows.json").read_text())
    assert (len(saved["documents"]), len(saved["needles"])) == (2, 2)

    monkeypatch.setattr(sw.Checkpoint, "add", real_add)
    real_run = rt.exact_run
    monkeypatch.setattr(rt, "exact_run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    art, cached = sweep(st, str(tiny_llama), CFG, Output(quiet=True), data=[str(data)],
                        capture_args={"chunk": 64, "held_out": 1})
    assert not cached and len(calls) == 4  # the four needle prompts left, no document again
    assert not work[0].exists()
    res, want = json.loads(art.file("sweep.json").read_text()), swept[2]
    assert art.id == swept[1].id
    assert res["needles"] == want["needles"]
    for a, b in zip(res["documents_detail"], want["documents_detail"]):
        for k in ("1", "2", "3"):
            assert a[k]["ridgefill"]["dnll"] == pytest.approx(b[k]["ridgefill"]["dnll"], abs=1e-6)


def test_exact_is_timed_three_times(swept):
    _, _, res = swept
    runs = res["timing"]["exact_runs"]
    assert len(runs) == 3 and res["exact"]["prefill_s"] == sorted(runs)[1]
    assert set(res["timing"]["seconds"]) == {"exact"} | {f"{s}/{a}" for s in (1, 2, 3) for a in ("ridgefill", "identity")}
