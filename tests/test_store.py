"""Artifact store: ids, atomic commit, cache hits, verify, gc; deterministic tensor files."""

import json

import numpy as np
import pytest

from ridgefill.artifacts import Store, recipe_id
from ridgefill.formats import safetensors
from ridgefill.errors import BadInput, RidgefillError
from conftest import quiet


def test_recipe_id_is_canonical():
    assert recipe_id({"a": 1, "b": [1, 2]}) == recipe_id({"b": [1, 2], "a": 1})
    assert recipe_id({"a": 1}) != recipe_id({"a": 2})
    import hashlib

    assert recipe_id({"b": 1, "a": "x"}) == hashlib.sha256(b'{"a":"x","b":1}').hexdigest()[:16]


def test_build_commit_cache_and_verify(tmp_path):
    st = Store(tmp_path)
    recipe = {"stage": "capture", "x": 1}
    assert st.cached("capture", recipe) is None
    with st.build("capture", recipe) as b:
        (b.path / "a.bin").write_bytes(b"hello")
        art = b.commit(summary={"n": 1})
    assert art.path == tmp_path / "capture" / recipe_id(recipe)
    man = json.loads((art.path / "artifact.json").read_text())
    assert man["files"]["a.bin"]["bytes"] == 5 and man["recipe"] == recipe
    assert st.cached("capture", recipe).id == art.id
    assert st.get(art.id[:6]).path == art.path
    assert st.get(f"capture/{art.id}").id == art.id
    (art.path / "a.bin").write_bytes(b"hellO")
    assert st.problems(art) == ["a.bin: sha256 mismatch"]
    assert st.cached("capture", recipe) is None  # damaged: not a cache hit
    with pytest.raises(RidgefillError, match="damaged"):
        st.verify(art)
    assert st.gc(dry_run=True) == [art.path]
    st.gc()
    assert not art.path.exists()


def test_failed_build_leaves_nothing(tmp_path):
    st = Store(tmp_path)
    with pytest.raises(ValueError):
        with st.build("solve", {"stage": "solve"}) as b:
            (b.path / "x").write_text("partial")
            raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []  # no temporary folder, no lock file, not even the stage's folder


def test_get_refusals(tmp_path):
    st = Store(tmp_path)
    with pytest.raises(BadInput, match="no artifact 'abc'"):
        st.get("abc")
    for i in range(2):
        with st.build("capture", {"i": i}) as b:
            b.commit()
    with pytest.raises(BadInput, match="is a capture artifact, not solve"):
        st.get(recipe_id({"i": 0}), stage="solve")


def test_tensors_deterministic_and_readable(tmp_path):
    rng = np.random.default_rng(0)
    a = {"b": rng.normal(size=(3, 4)).astype(np.float32), "a": np.arange(5, dtype=np.int64),
         "c": safetensors.BF16(np.array([0x3F80, 0x4000], dtype=np.uint16))}
    one = safetensors.encode(a, {"z": "1", "y": "2"})
    two = safetensors.encode(dict(reversed(list(a.items()))), {"y": "2", "z": "1"})
    assert one == two
    assert len(one[8:8 + int.from_bytes(one[:8], "little")]) % 8 == 0
    p = tmp_path / "t.safetensors"
    safetensors.save(p, a, {"z": "1"})
    from safetensors.torch import load_file

    back = load_file(str(p))
    np.testing.assert_array_equal(back["b"].numpy(), a["b"])
    assert back["c"].float().tolist() == [1.0, 2.0]
    got, meta = safetensors.load(p)
    np.testing.assert_array_equal(got["a"], a["a"])
    assert meta == {"z": "1"}
    safetensors.save_zst(tmp_path / "t.zst", {"a": a["b"]})
    np.testing.assert_array_equal(safetensors.load_zst(tmp_path / "t.zst")[0]["a"], a["b"])


def test_tensors_refuse_garbage(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\xff" * 16)
    with pytest.raises(BadInput, match=r"^bad.safetensors: not a readable safetensors file \(header length \d+ does not fit the file\)$"):
        safetensors.load(p)


# --- an edited artifact.json is caught on read -------------------------------------------------------------------


def _edit_manifest(art, change):
    p = art.path / "artifact.json"
    man = json.loads(p.read_text())
    change(man)
    p.write_text(json.dumps(man, indent=2))


CAPTURE_RECIPE = {"stage": "capture", "version": 1, "model": "f" * 64, "splits": [2], "chat": False}


@pytest.mark.parametrize("edit", ["trust_remote_code", "split"])
def test_edited_recipe_is_refused_on_read(tmp_path, edit, capsys):
    """A recipe changed in artifact.json (switching on the model's own code, or another split) no longer hashes
    to the id it lies under: get refuses it, verify reports it, cached rebuilds it, gc removes it."""
    st = Store(tmp_path)
    with st.build("capture", CAPTURE_RECIPE) as b:
        (b.path / "a.bin").write_bytes(b"hello")
        art = b.commit()
    change = {"trust_remote_code": lambda m: m["recipe"].update(trust_remote_code=True),
              "split": lambda m: m["recipe"].update(splits=[3])}[edit]
    _edit_manifest(art, change)
    edited = dict(CAPTURE_RECIPE, **({"trust_remote_code": True} if edit == "trust_remote_code" else {"splits": [3]}))
    want = (f"artifact capture/{art.id}: artifact.json's recipe hashes to {recipe_id(edited)}, not its id {art.id}; "
            "the store was edited")
    for ref in (art.id, art.id[:6], f"capture/{art.id}", str(art.path)):
        with pytest.raises(RidgefillError, match=want) as e:
            st.get(ref, stage="capture")
        assert type(e.value) is RidgefillError and e.value.exit_code == 1
    assert st.problems(art) == [f"artifact.json's recipe hashes to {recipe_id(edited)}, not its id {art.id}"]
    with pytest.raises(RidgefillError, match="is damaged: artifact.json's recipe hashes to"):
        st.verify(art)
    # The real recipe's next run is a miss: it builds again (the id stands for that recipe) and replaces it.
    capsys.readouterr()
    assert st.cached("capture", CAPTURE_RECIPE) is None
    assert capsys.readouterr().err == (f"ridgefill: capture/{art.id} is damaged (artifact.json's recipe hashes to "
                                       f"{recipe_id(edited)}, not its id {art.id}); building it again\n")
    with st.build("capture", CAPTURE_RECIPE) as b:
        (b.path / "a.bin").write_bytes(b"hello")
        b.commit()
    assert st.get(art.id).recipe == CAPTURE_RECIPE and st.cached("capture", CAPTURE_RECIPE) is not None
    assert sorted(p.name for p in (tmp_path / "capture").iterdir()) == [art.id]
    _edit_manifest(art, change)
    assert st.gc() == [art.path] and not art.path.exists()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(stage="solve"), "artifact.json: stage 'solve', but it lies under capture/"),
    (lambda m: m.update(format="ridgefill-artifact/9"),
     "artifact.json: format 'ridgefill-artifact/9' is not 'ridgefill-artifact/1'"),
    (lambda m: m.update(id="0" * 16), "artifact.json: id 0000000000000000 does not match directory"),
    (lambda m: m.pop("recipe"), "artifact.json: no recipe"),
])
def test_edited_manifest_fields_are_refused(tmp_path, edit, message):
    st = Store(tmp_path)
    with st.build("capture", CAPTURE_RECIPE) as b:
        art = b.commit()
    _edit_manifest(art, edit)
    with pytest.raises(RidgefillError, match=message):
        st.get(art.id)
    assert message in "; ".join(st.problems(st.get(art.id, check=False)))


def test_unreadable_manifest_is_listed_and_refused(tmp_path):
    st = Store(tmp_path)
    with st.build("capture", CAPTURE_RECIPE) as b:
        art = b.commit()
    (art.path / "artifact.json").write_text("{not json")
    assert [a.id for a in st.all()] == [art.id]  # still listed, so that verify and gc see it
    with pytest.raises(RidgefillError, match=r"artifact.json: unreadable \(JSONDecodeError\)"):
        st.get(art.id)
    assert st.gc() == [art.path]


def test_recipe_copied_under_another_id_is_refused(tmp_path):
    """An artifact directory copied (or renamed) under another recipe's id."""
    import shutil

    st = Store(tmp_path)
    with st.build("capture", CAPTURE_RECIPE) as b:
        art = b.commit()
    other = dict(CAPTURE_RECIPE, splits=[3])
    shutil.copytree(art.path, tmp_path / "capture" / recipe_id(other))
    _edit_manifest(st.get(recipe_id(other), check=False), lambda m: m.update(id=recipe_id(other)))
    with pytest.raises(RidgefillError, match=f"recipe hashes to {art.id}, not its id {recipe_id(other)}"):
        st.get(recipe_id(other))
    assert st.cached("capture", other) is None


# --- trust_remote_code is part of what the id covers -----------------------------------------------------------


class _Spy(Store):
    """Records the recipe a stage asks the cache for and answers with a hit, so nothing is loaded."""

    def cached(self, stage, recipe):
        self.seen = recipe
        return "HIT"


def test_trust_remote_code_enters_capture_and_compact_recipes(tmp_path, tiny_llama):
    from ridgefill.capture.run import CaptureConfig, capture
    from ridgefill.fold.compaction import CompactConfig, compact

    (tmp_path / "d.txt").write_text("one two three four five six seven eight nine ten. " * 20)
    (tmp_path / "ctx.txt").write_text("alpha beta gamma delta. " * 20)
    ids = {}
    for trust in (False, True):
        spy = _Spy(tmp_path / "store")
        cfg = CaptureConfig(splits=(2,), held_out=0, trust_remote_code=trust)
        assert capture(spy, str(tiny_llama), [str(tmp_path / "d.txt")], cfg, quiet()) == ("HIT", True)
        assert spy.seen.get("trust_remote_code", False) is trust
        assert ("trust_remote_code" in spy.seen) is trust  # off: the key is absent, so existing ids stay as they were
        ids[trust] = recipe_id(spy.seen)
        spy = _Spy(tmp_path / "store")
        assert compact(spy, str(tiny_llama), tmp_path / "ctx.txt", CompactConfig(), quiet(),
                       trust_remote_code=trust) == ("HIT", True)
        assert spy.seen.get("trust_remote_code", False) is trust and ("trust_remote_code" in spy.seen) is trust
    assert ids[False] != ids[True]


class _Loaded(Exception):
    pass


@pytest.fixture
def load_spy(monkeypatch):
    """Replaces load_model: records its trust_remote_code and stops the stage there."""
    import ridgefill.models

    seen = []

    def fake(ref, **kw):
        seen.append(kw.get("trust_remote_code"))
        raise _Loaded()

    monkeypatch.setattr(ridgefill.models, "load_model", fake)
    return seen


@pytest.mark.parametrize("where", ["recipe", "info"])
def test_solve_and_fold_take_trust_remote_code_from_the_recipe(tmp_path, tiny_llama, load_spy, where):
    """solve and fold load the model with the trust_remote_code of the capture's / compact's recipe (covered by its
    id); an `info` saying otherwise (unhashed, editable) is ignored."""
    from ridgefill.fold.run import FoldConfig, fold
    from ridgefill.models import resolve_model
    from ridgefill.capture.artifact import open_model

    st = Store(tmp_path / "store")
    ref = resolve_model(str(tiny_llama), store_root=st.root)
    extra = {"trust_remote_code": True} if where == "recipe" else {}
    info = {"model_spec": str(tiny_llama), "model": {"name": ref.name, "revision": None}}
    info_extra = {"trust_remote_code": True} if where == "info" else {}
    with st.build("capture", {**CAPTURE_RECIPE, "model": ref.fingerprint, **extra}) as b:
        cap = b.commit(info={**info, **info_extra})
    with pytest.raises(_Loaded):
        open_model(st.get(cap.id), st, ref)
    comp_recipe = {"stage": "compact", "version": 1, "model": ref.fingerprint, "budget": 0.25, "dtype": "float32",
                   "source": "self", "holdout": 0.25, "cap": 64, "seed": 0, **extra}
    with st.build("compact", comp_recipe) as b:
        comp = b.commit(info={**info, **info_extra})
    with pytest.raises(_Loaded):
        fold(st, comp.id, FoldConfig(), quiet())
    assert load_spy == [where == "recipe"] * 2


# --- the artifacts commands ----------------------------------------------------------------------------------------


def test_artifacts_ls_rounds_for_people_and_commands_report_a_damaged_manifest(tmp_path):
    from clirun import cli

    st = Store(tmp_path)
    score = 0.8950877450239008
    with st.build("solve", {"stage": "solve", "capture": "c" * 16, "split": 2}) as b:
        sol = b.commit(summary={"split": 2, "alpha": 3e-05, "score": score, "fitted": {"kv": 0.9}})
    with st.build("capture", CAPTURE_RECIPE) as b:
        cap = b.commit(summary={"splits": [2]})
    import os

    r = cli("artifacts", "ls", "--store", tmp_path, env=dict(os.environ, COLUMNS="160"))  # a terminal's width
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stderr.splitlines() if sol.id in line)
    assert "│ alpha 3e-05, score 0.8951, split 2 │" in row and str(score) not in r.stderr
    r = cli("artifacts", "ls", "--store", tmp_path, "--json")
    arts = {a["id"]: a for a in json.loads(r.stdout)["artifacts"]}
    assert arts[sol.id]["summary"]["score"] == score and arts[sol.id]["damaged"] == []  # exact in JSON

    _edit_manifest(cap, lambda m: m["recipe"].update(trust_remote_code=True))
    edited = recipe_id(dict(CAPTURE_RECIPE, trust_remote_code=True))
    bad = f"artifact.json's recipe hashes to {edited}, not its id {cap.id}"
    r = cli("artifacts", "ls", "--store", tmp_path, "--json")
    assert {a["id"]: a["damaged"] for a in json.loads(r.stdout)["artifacts"]} == {sol.id: [], cap.id: [bad]}
    r = cli("artifacts", "verify", "--store", tmp_path)
    assert r.returncode == 1 and f"damaged capture/{cap.id}: {bad}" in r.stderr and f"ok solve/{sol.id}" in r.stderr
    r = cli("artifacts", "verify", cap.id, "--store", tmp_path)
    assert r.returncode == 1 and bad in r.stderr
    r = cli("artifacts", "show", cap.id, "--store", tmp_path, "--json")  # shown, with a warning
    assert r.returncode == 0 and json.loads(r.stdout)["recipe"]["trust_remote_code"] is True and bad in r.stderr


def test_upstream_artifacts_are_found_through_the_hashed_recipe_not_info(tmp_path):
    """`info` is not covered by the id: pointing a quantize artifact's info at another chain changes nothing that
    export, eval's loader or quantize's calibration mean read."""
    from fakestore import fake_chain

    from ridgefill.evaluate.source import load_source
    from ridgefill.export.build import export
    from ridgefill.export.config import ExportConfig
    from ridgefill.solve.artifact import calibration_mean

    a, b = fake_chain(tmp_path), fake_chain(tmp_path, d_in=192)
    st = Store(tmp_path)
    q = st.get(a["quantize"])
    path = q.path / "artifact.json"
    man = json.loads(path.read_text())
    man["info"].update(solve=b["solve"], capture=b["capture"])
    path.write_text(json.dumps(man))
    q = st.get(a["quantize"])
    assert st.upstream(q, "solve").id == a["solve"] and st.upstream(q, "capture").id == a["capture"]
    assert calibration_mean(st, st.get(a["solve"])).shape == (160,)
    art, _, _ = export(st, a["quantize"], ExportConfig(), quiet())
    manifest = json.loads((art.path / "ridgefill.json").read_text())
    assert (manifest["fit"]["solve_id"], manifest["fit"]["capture_id"]) == (a["solve"], a["capture"])
    assert load_source(st, a["quantize"]).calibration == frozenset({"a" * 64})
    with pytest.raises(BadInput, match="was not made from a compact artifact"):
        st.upstream(q, "compact")
