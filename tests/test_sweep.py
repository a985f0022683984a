"""`ridgefill sweep` on a tiny model: one capture for every split, figures equal to independent prefills per
split and arm, the recommendation, the artifact's files, reuse of a capture, and the refusals."""

import json

import pytest
import torch

from ridgefill.artifacts import Store
from ridgefill.capture.run import CaptureConfig, capture
from ridgefill.sweep.run import SweepConfig, default_splits, parse_splits, sweep
from ridgefill.errors import BadInput
from ridgefill.output import Output
from clirun import cli_here

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
    assert parse_splits("8-12") == (8, 9, 10, 11, 12)
    assert parse_splits("8-24:4") == (8, 12, 16, 20, 24)
    assert parse_splits("16, 8,12-13,8") == (8, 12, 13, 16)
    for bad, msg in (("8-", "is not a split"), ("a", "is not a split"), ("12-8", "is empty"), ("8-12:0", "at least 1")):
        with pytest.raises(BadInput, match=msg):
            parse_splits(bad)
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


def test_sweep_artifact_recommends_and_plots(swept):
    from ridgefill.sweep.report import recommend

    st, art, res = swept
    assert sorted(p.name for p in art.path.iterdir() if p.name != "artifact.json") == ["sweep.json", "sweep.md", "sweep.png"]
    assert art.file("sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["recommended"] == recommend(res) and art.manifest["summary"]["recommended"] == res["recommended"]["split"]
    md = art.file("sweep.md").read_text()
    assert all(f"| {s} " in md or f"|{s}|" in md.replace(" ", "") for s in (1, 2, 3))


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
    (["--splits", "2,9"], "split(s) 9 out of range: the model has 4 layers"),
    (["--splits", "1-3", "--max-needle-drop", "-1"], "--max-needle-drop must be a number >= 0"),
    (["--splits", "1-3", "--max-key-dnll", "-0.5"], "--max-key-dnll must be a number >= 0"),
    (["--splits", "1-3", "--length", "40"], "--length (40) must be longer than --tail (48)"),
])
def test_sweep_refusals(tmp_path, tiny_llama, args, msg):
    st = tmp_path / "store"
    r = cli_here("sweep", tiny_llama, *SMALL, *args, "--store", st)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    assert not (st / "capture").exists() and not (st / "sweep").exists()


def test_sweep_refuses_a_capture_without_the_splits(tmp_path, tiny_llama, data):
    st = Store(tmp_path / "store")
    cap, _ = capture(st, str(tiny_llama), [str(data)], CaptureConfig(splits=(1, 2), chunk=64, held_out=1), Output(quiet=True))
    r = cli_here("sweep", tiny_llama, "--splits", "1-3", *SMALL, "--capture", cap.id, "--store", st.root)
    assert r.returncode == 2, r.stderr
    assert f"capture {cap.id} lacks split(s) 3 (it has 1, 2)" in r.stderr and "--split 1 --split 2 --split 3" in r.stderr
    assert not (st.root / "solve").exists() and not (st.root / "sweep").exists()


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
