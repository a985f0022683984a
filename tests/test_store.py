"""Artifact store: ids, atomic commit, cache hits, verify, gc; deterministic tensor files."""

import json

import numpy as np
import pytest

from ridgefill.artifacts import Store, recipe_id
from ridgefill.artifacts import tensors
from ridgefill.errors import BadInput, RidgefillError


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
    assert list((tmp_path / "solve").iterdir()) == []


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
         "c": tensors.BF16(np.array([0x3F80, 0x4000], dtype=np.uint16))}
    one = tensors.encode(a, {"z": "1", "y": "2"})
    two = tensors.encode(dict(reversed(list(a.items()))), {"y": "2", "z": "1"})
    assert one == two
    assert len(one[8:8 + int.from_bytes(one[:8], "little")]) % 8 == 0
    p = tmp_path / "t.safetensors"
    tensors.save(p, a, {"z": "1"})
    from safetensors.torch import load_file

    back = load_file(str(p))
    np.testing.assert_array_equal(back["b"].numpy(), a["b"])
    assert back["c"].float().tolist() == [1.0, 2.0]
    got, meta = tensors.load(p)
    np.testing.assert_array_equal(got["a"], a["a"])
    assert meta == {"z": "1"}
    tensors.save_zst(tmp_path / "t.zst", {"a": a["b"]})
    np.testing.assert_array_equal(tensors.load_zst(tmp_path / "t.zst")[0]["a"], a["b"])


def test_tensors_refuse_garbage(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\xff" * 16)
    with pytest.raises(BadInput, match="bad.safetensors: not a safetensors file"):
        tensors.load(p)
