"""capture's --data reading (ridgefill/capture/corpus.py): what documents are, and how they are named."""

from __future__ import annotations

import json

import pytest

from ridgefill.capture.corpus import read_corpus
from ridgefill.errors import BadInput


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("first document")
    (d / "sub" / "b.txt").write_text("second document")
    (d / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n" + json.dumps({"text": "fourth"}) + "\n")
    (d / "skip.bin").write_bytes(b"\0\1")
    return d


def test_documents_are_named_by_what_the_path_holds_not_how_it_was_typed(data, monkeypatch):
    """`data`, `./data/`, an absolute path and `.` from inside give the same names, so one capture id (which
    covers the text alone) always holds the same documents.json."""
    monkeypatch.chdir(data.parent)
    want = [("data/a.txt", "first document"), ("data/c.jsonl:1", "third"), ("data/c.jsonl:2", "fourth"),
            ("data/sub/b.txt", "second document")]
    for spec in ("data", "./data/", str(data), "data/sub/.."):
        assert [(d.name, d.text) for d in read_corpus([spec]).documents] == want, spec
    monkeypatch.chdir(data)
    assert [d.name for d in read_corpus(["."]).documents] == [n for n, _ in want]
    assert [d.name for d in read_corpus([str(data / "sub" / "b.txt")]).documents] == ["b.txt"]
    assert [d.name for d in read_corpus(["sub/b.txt"]).documents] == ["b.txt"]


def test_missing_and_empty_data_are_refused(tmp_path):
    with pytest.raises(BadInput, match="^data path 'nope' does not exist$"):
        read_corpus(["nope"])
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(BadInput, match="^no documents with text in: "):
        read_corpus([str(tmp_path / "empty.txt")])
