"""The package's layering, read from the source (nothing is imported): the import graph between ridgefill's
top-level packages follows one declared order, bottom to top, so it has no cycle; no module reaches into another
package's `run` module (the stage itself) or imports a private name from another module.

    python tests/test_layering.py        # prints the graph, each package with the packages it imports
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ridgefill"
# Bottom to top: a package may import only the ones before it. errors, output, numerics, lazy and memory hold no
# ridgefill imports; formats reads and writes files; hub talks to the Hub; models loads them; runtime is the fill; then the
# stages in pipeline order (sweep measures splits with eval's code; fold stands apart); recipe runs the chain; cli
# parses and prints. engines (connectors for serving engines) has its place before it exists.
ORDER = ["environment", "errors", "output", "numerics", "lazy", "memory", "artifacts", "formats", "hub", "models",
         "runtime", "capture", "solve", "quantize", "export", "evaluate", "sweep", "fold", "engines", "recipe", "cli",
         "__main__"]  # environment: the table of variables read, below everything


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts, ast.parse(path.read_text(), str(path))


def _imports(tree):
    """(imported module, [names]) for every absolute ridgefill import, at any depth (lazy imports count)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("ridgefill"):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ridgefill."):
                    yield a.name, []


def _top(parts) -> str:
    return parts[0] if len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for _, parts, tree in _modules():
        if parts == ("__init__",):
            continue
        me = _top(parts)
        for module, names in _imports(tree):
            others = [module.split(".")[1]] if "." in module else [n for n in names if n != "__version__"]
            edges[me].update(o for o in others if o != me)
    return edges


def test_every_package_has_a_place_in_the_order():
    tops = {_top(parts) for _, parts, _ in _modules() if parts != ("__init__",)}
    assert tops <= set(ORDER), f"packages without a place in ORDER: {sorted(tops - set(ORDER))}"


def test_imports_only_go_down_the_declared_order():
    up = [f"{a} -> {b}" for a, bs in sorted(graph().items()) for b in sorted(bs) if ORDER.index(b) >= ORDER.index(a)]
    assert not up, "imports against the declared order (so a cycle is possible): " + ", ".join(up)


def test_no_module_imports_another_packages_run_module_or_a_private_name():
    bad = []
    for path, parts, tree in _modules():
        me = ".".join(("ridgefill",) + parts)
        for module, names in _imports(tree):
            pieces = module.split(".")
            if len(pieces) > 2 and pieces[1] != parts[0] and pieces[-1] == "run":
                bad.append(f"{me} imports {module}")
            bad += [f"{me} imports {module}.{n}" for n in names
                    if n.startswith("_") and not n.endswith("__") and module != me]
    assert not bad, "; ".join(bad)


# Modules that other code reads without running a model: importing them must not import torch or transformers.
LIGHT = ["ridgefill.formats.release", "ridgefill.formats.safetensors", "ridgefill.formats.cache",
         "ridgefill.formats.gguf", "ridgefill.numerics", "ridgefill.hub.releases", "ridgefill.runtime",
         "ridgefill.runtime.rows", "ridgefill.capture", "ridgefill.capture.artifact", "ridgefill.solve.artifact",
         "ridgefill.quantize.artifact", "ridgefill.evaluate.run", "ridgefill.sweep.run", "ridgefill.recipe"]


def test_readers_and_configurations_stay_light():
    code = (f"import importlib, sys\nfor m in {LIGHT!r}: importlib.import_module(m)\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_public_name_of_a_package_is_also_one_of_its_modules():
    """A package's lazy export (ridgefill.lazy) named like one of its modules would be shadowed by that module once
    it is imported: `from ridgefill.runtime import prefill` must always be the function."""
    import importlib

    for init in sorted(PACKAGE.rglob("__init__.py")):
        package = ".".join(("ridgefill",) + init.parent.relative_to(PACKAGE).parts)
        modules = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        clash = set(getattr(importlib.import_module(package), "__all__", ())) & modules
        assert not clash, f"{package} exports {sorted(clash)}, which are also its modules"


def test_the_graph_printed_is_the_one_tested(capsys):
    main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(graph()) and all(" -> " in line for line in lines)


def main() -> None:
    edges = graph()
    for name in sorted(edges, key=ORDER.index):
        print(f"{name:10} -> {' '.join(sorted(edges[name], key=ORDER.index))}")


if __name__ == "__main__":
    sys.exit(main())
