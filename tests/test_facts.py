"""Facts written in one place and repeated by examples and docs agree with that place: each built-in's shipped split
(`Builtin.split`) and the default tail (`runtime.rows.DEFAULT_TAIL`)."""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

import pytest

from ridgefill.models.spec import BUILTINS
from ridgefill.runtime.rows import DEFAULT_TAIL

ROOT = Path(__file__).resolve().parent.parent
TITLES = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M",
          "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct"}  # the rows of docs/sweep.md's "What the built-ins ship"
README_RESULTS = "qwen2.5-coder-1.5b"  # the one built-in whose results table the README shows
SHIPPED = sorted(name for name, b in BUILTINS.items() if b.split is not None)  # the built-ins with a chosen split


def test_every_builtin_with_a_split_has_a_results_title():
    assert set(TITLES) == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(set(BUILTINS) - set(SHIPPED)))
def test_a_builtin_without_a_split_yet_claims_none(name):
    """A built-in whose split the sweep has not chosen yet claims none: its recipe, if any, has the sweep choose
    (`split = "auto"`, no splits of its own), and it has no gate or results."""
    recipe = ROOT / "examples" / "recipes" / f"{name}.toml"
    if recipe.exists():
        table = tomllib.loads(recipe.read_text())
        assert table["solve"]["split"] == "auto" and "splits" not in table["capture"]
    assert not (ROOT / "examples" / "gates" / f"{name}.toml").exists()
    assert name not in TITLES


def table_rows(text: str) -> list[list[str]]:
    """The cells of the first markdown table in `text`, by row (the header and rule left out)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def readme_results(readme: str) -> list[list[str]]:
    """The README's "Results at a glance" table, the one built-in it shows."""
    section = readme.split("## Results at a glance", 1)[1].split("\n## ", 1)[0]
    return table_rows(section.split(f"**{TITLES[README_RESULTS]}**", 1)[1])


def shipped_table(page: str) -> dict[str, list[str]]:
    """docs/sweep.md's "What the built-ins ship" table by built-in title: each row's cells after the first."""
    section = page.split("### What the built-ins ship", 1)[1].split("\n#", 1)[0]
    return {row[0]: row[1:] for row in table_rows(section)}


@pytest.mark.parametrize("name", SHIPPED)
def test_recipe_uses_the_shipped_split_and_only_points_to_why(name):
    path = ROOT / "examples" / "recipes" / f"{name}.toml"
    recipe = tomllib.loads(path.read_text())
    assert recipe["capture"]["splits"] == [BUILTINS[name].split]
    assert recipe["export"]["tail"] == DEFAULT_TAIL
    # the comment on `splits` names where the split is written, and says nothing more about it (no second account
    # of why, which would drift from the README's)
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("splits"))
    assert "Builtin.split" in lines[at], lines[at]
    assert not lines[at + 1].lstrip().startswith("#"), f"{path.name}: a comment continues the splits line"


@pytest.mark.parametrize("name", SHIPPED)
def test_gate_header_names_the_shipped_split(name):
    text = (ROOT / "examples" / "gates" / f"{name}.toml").read_text()
    splits = re.findall(r"split \((\d+) of \d+", text)
    assert splits == [str(BUILTINS[name].split)] and "Builtin.split" in text


def test_results_ship_the_builtin_split():
    readme = (ROOT / "README.md").read_text()
    shipped = [r for r in readme_results(readme) if r[0].startswith("**shipped**")]
    assert len(shipped) == 1 and shipped[0][1] == str(BUILTINS[README_RESULTS].split), shipped
    table = shipped_table((ROOT / "docs" / "sweep.md").read_text())
    assert {title: row[0] for title, row in table.items()} == {
        TITLES[name]: str(BUILTINS[name].split) for name in SHIPPED}, table
    # every "ships at N" in the README and the docs is a built-in's split
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    said = {(p.name, int(n)) for p in docs for n in re.findall(r"ships at (?:split )?(\d+)", p.read_text())}
    assert said and {n for _, n in said} <= {BUILTINS[name].split for name in SHIPPED}, said


def test_readme_python_example_is_the_tested_one():
    """The README shows docs/runtime.md's example, which tests/test_docs_runtime.py runs: the same text, not a copy
    that could drift."""
    block = re.compile(r"^```python\n(.*?)^```$", flags=re.S | re.M)
    readme, page = (block.findall((ROOT / p).read_text()) for p in ("README.md", "docs/runtime.md"))
    assert len(readme) == 1 and readme == page
