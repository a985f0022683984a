"""The environment variables the package reads are ridgefill/environment.py's table: no module reads one around
it, every entry is read somewhere, and docs/cli.md's "Environment" table is the table."""

import re
from pathlib import Path

from ridgefill import environment

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ridgefill"


def _sources():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "environment.py"]


def test_no_module_reads_the_environment_around_the_table():
    """os.environ / os.getenv / a literal typer envvar appear only in environment.py."""
    around = re.compile(r"\benviron\b|\bgetenv\b|\bputenv\b|envvar=[\"']")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources()
            for i, line in enumerate(p.read_text().splitlines(), 1) if around.search(line)]  # fmt: skip
    assert hits == []


def test_every_variable_in_the_table_is_read_by_its_name():
    names = [v.name for v in environment.VARIABLES]
    assert len(names) == len(set(names))
    assert all(getattr(environment, n) == n for n in names)
    code = "\n".join(p.read_text() for p in _sources())
    unread = [n for n in names if not re.search(rf"\b(environment|e)\.{n}\b", code)]
    assert unread == []


def test_get_reads_now_with_the_default_for_unset_or_empty(monkeypatch):
    monkeypatch.delenv("RIDGEFILL_CACHE", raising=False)
    assert environment.get("RIDGEFILL_CACHE") == "~/.cache/ridgefill"
    monkeypatch.setenv("RIDGEFILL_CACHE", "")
    assert environment.get("RIDGEFILL_CACHE") == "~/.cache/ridgefill" and environment.raw("RIDGEFILL_CACHE") == ""
    monkeypatch.setenv("RIDGEFILL_CACHE", "/c")
    assert environment.get("RIDGEFILL_CACHE") == "/c"
    for read in (environment.get, environment.raw):
        try:
            read("RIDGEFILL_NOT_A_VARIABLE")
        except KeyError:
            continue
        raise AssertionError(f"{read.__name__} read a variable the table lacks")


def test_docs_environment_table_is_the_table():
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text[text.index("\n## Environment\n"):]
    section = section[:section.index("\n## ", 1)]
    assert environment.markdown() in section
    listed = re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.M)
    assert listed == [v.name for v in environment.VARIABLES]
