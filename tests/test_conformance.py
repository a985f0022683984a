"""The release format's conformance corpus (examples/reader/conformance.py): every valid and invalid folder gets its
expected verdict from `ridgefill verify`, from the loader, and from the independent second reader written from
docs/format.md alone (examples/reader/ridgefill_reader.py), each refusal naming the file and field at fault."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clirun import cli_here
from ridgefill.errors import BadInput
from ridgefill.formats.release import load_release

READER_DIR = Path(__file__).resolve().parents[1] / "examples" / "reader"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, READER_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


conformance = _module("conformance")
second = _module("ridgefill_reader")
CASES = {c.name: c for c in conformance.CASES}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    conformance.generate(out)
    return out


def _agrees(name: str, message: str | None) -> None:
    case = CASES[name]
    if case.verdict == "ok":
        assert message is None, f"{name}: refused a valid release: {message}"
        return
    assert message is not None, f"{name}: accepted a folder that breaks rule {case.rule}"
    assert "\n" not in message
    assert message.startswith(f"{case.file}: "), f"{name}: {message!r} does not name {case.file}"
    for text in case.names:
        assert text in message, f"{name}: {message!r} does not name {text}"


def test_the_corpus_covers_every_rule_with_at_least_40_cases(corpus):
    expected = json.loads((corpus / "expected.json").read_text())
    assert len(expected) >= 40 and set(expected) == set(CASES)
    assert {e["rule"] for e in expected.values()} == set(range(14))
    assert sum(e["verdict"] == "ok" for e in expected.values()) >= 10
    assert sorted(p.name for p in corpus.iterdir()) == sorted([*expected, "expected.json"])


def test_the_corpus_holds_both_formats_and_both_map_kinds(corpus):
    """Valid /1 releases (written as before /2, layers not tied to the split) and valid /2 ones: all-kv int8 and f32,
    a hybrid with input maps on its Gated DeltaNet layers and a kv map between them; rules 11 and 12 broken in
    both."""
    formats, kinds = {}, {}
    for name, case in CASES.items():
        m = json.loads((corpus / name / "ridgefill.json").read_text()) if case.verdict == "ok" else None
        if m is not None:
            formats.setdefault(m["format"], []).append(name)
            kinds[name] = second.map_kinds(m)
    assert len(formats["ridgefill-maps/1"]) >= 15 and len(formats["ridgefill-maps/2"]) >= 5
    assert kinds["valid-int8"] == {2: "input", 12: "input", 13: "input"}  # /1: input maps, 2..13 not all there
    assert kinds["valid-v2-kv-int8"] == kinds["valid-v2-kv-f32"] == {9: "kv", 10: "kv", 11: "kv"}
    assert kinds["valid-v2-mixed-hybrid"] == {9: "input", 10: "kv", 11: "input"}
    broken = {(c.rule, json.loads((corpus / n / "ridgefill.json").read_text()).get("format")) for n, c in
              CASES.items() if c.rule in (11, 12) and (corpus / n / "ridgefill.json").is_file()}
    assert broken == {(r, f) for r in (11, 12)
                      for f in ("ridgefill-maps/1", "ridgefill-maps/2", "ridgefill-maps/3")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify(corpus, name):
    r = cli_here("verify", corpus / name)
    if CASES[name].verdict == "ok":
        assert r.returncode == 0, r.stderr
        _agrees(name, None)
    else:
        assert r.returncode == 2 and r.stdout == ""
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
        _agrees(name, lines[0].removeprefix("Error: "))


@pytest.mark.parametrize("name", sorted(CASES))
def test_loader_and_second_reader(corpus, name):
    try:
        manifest, maps = load_release(corpus / name)
        ours = None
    except BadInput as e:
        ours = str(e)
    _agrees(name, ours)
    try:
        their_manifest, their_maps = second.read_release(corpus / name)
        theirs = None
    except second.Refused as e:
        theirs = str(e)
    _agrees(name, theirs)
    if ours is None:  # both decoded the maps: bit for bit the same
        assert their_manifest == manifest and sorted(their_maps) == sorted(maps)
        for layer, (w, b) in their_maps.items():
            np.testing.assert_array_equal(w, maps[layer]["weight"])
            np.testing.assert_array_equal(b, maps[layer]["bias"])
            assert w.dtype == b.dtype == np.float32


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.verdict != "ok"))
def test_the_engine_refuses_what_verify_refuses(corpus, name):
    """The vLLM plugin reads RIDGEFILL_RELEASE with the same reader (`served.load`): each refused case stops it at
    startup with the reader's own line (the plugin prints it after `ridgefill: `)."""
    from ridgefill.engines.vllm import served

    with pytest.raises(BadInput) as e:
        served.load(corpus / name)
    assert "\n" not in str(e.value)
    _agrees(name, str(e.value))


def test_the_scripts_run_as_documented(corpus, tmp_path):
    """`conformance.py OUT` writes the corpus; `ridgefill_reader.py FOLDER` prints its verdict (exit 0 or 2)."""
    out = subprocess.run([sys.executable, READER_DIR / "conformance.py", tmp_path / "c"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "c" / "expected.json").read_text()) == json.loads(
        (corpus / "expected.json").read_text())
    for name, code in (("valid-int8", 0), ("fact-edited", 2)):
        r = subprocess.run([sys.executable, READER_DIR / "ridgefill_reader.py", corpus / name], capture_output=True,
                           text=True)
        assert r.returncode == code, r.stdout + r.stderr
        assert r.stdout.startswith("ok: 3 layers" if code == 0 else "refused: ridgefill.json: 'split'")


def test_the_second_reader_imports_no_ridgefill():
    source = (READER_DIR / "ridgefill_reader.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines()
               if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "hashlib", "json", "math", "os", "re", "stat", "struct", "sys", "pathlib",
                       "numpy", "typing", "dataclasses"}, imports
