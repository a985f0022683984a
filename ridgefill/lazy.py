"""A package's public names, each loaded from its module on first use (PEP 562), so that importing a package (or
one of its light modules, say an artifact reader) does not import its heavy ones.

    __getattr__, __all__ = exports(__name__, {"capture": "run", "CaptureConfig": "run"})
"""

from __future__ import annotations

from importlib import import_module


def exports(package: str, where: dict[str, str]):
    """(__getattr__, __all__) for `package`: name -> the submodule that defines it. A name must not be the name
    of a submodule too (an imported submodule would shadow it)."""

    def __getattr__(name: str):
        if name in where:
            return getattr(import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, sorted(where)
