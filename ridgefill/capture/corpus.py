"""Reading calibration text: `.txt` files, directories of them, `.jsonl` with a `text` field, and the
built-in corpus `builtin:default`, assembled from real text that this machine's packages ship.

Documents keep the order they are given in (directories sorted), so the statistics' summation order, and
with it every byte of the capture, is fixed by the input.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ridgefill.errors import BadInput

BUILTIN = "builtin:default"
TEXT_SUFFIXES = (".txt", ".jsonl")
LICENSES = Path("/usr/share/common-licenses")
# Python standard library sources: fixed selection by sorted name and size, so it is reproducible.
STDLIB_CHARS = 250_000
STDLIB_MAX_FILE = 40_000
# Superseded license versions that are near-copies of a newer one: left out so that a held-out license is
# never a near-duplicate of a calibration one.
SUPERSEDED = {"GFDL-1.2", "GPL-1", "LGPL-2"}


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    sha256: str


@dataclass(frozen=True)
class Corpus:
    documents: list[Document]
    replaced: int  # characters decoded with U+FFFD
    files_with_replacements: int

    @property
    def digest(self) -> str:
        """sha256 of the ordered document hashes: the corpus' identity in a recipe."""
        return hashlib.sha256("\n".join(d.sha256 for d in self.documents).encode()).hexdigest()


def _doc(name: str, text: str) -> Document:
    return Document(name, text, hashlib.sha256(text.encode("utf-8")).hexdigest())


def decode_text(raw: bytes) -> tuple[str, int]:
    """(text, characters replaced): a file's bytes as UTF-8, each byte sequence that is not replaced with U+FFFD (the
    caller warns when any was: capture's corpus, an engine prompt, a compact context)."""
    text = raw.decode("utf-8", errors="replace")
    if "\ufffd" not in text:
        return text, 0
    # Count only what the decoder replaced, not U+FFFD characters that were in the file already.
    return text, text.count("\ufffd") - raw.count("\ufffd".encode())


def builtin_sources() -> list[Path]:
    """Prose (the license texts Debian ships) then source code (Python's standard library)."""
    prose = []
    if LICENSES.is_dir():
        seen = set()
        for p in sorted(LICENSES.iterdir()):
            real = p.resolve()
            if real.is_file() and real not in seen and real.name not in SUPERSEDED:
                seen.add(real)
                prose.append(real)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code, total = [], 0
    for p in sorted(stdlib.glob("*.py")):
        size = p.stat().st_size
        if p.name.startswith("_") or not 2_000 <= size <= STDLIB_MAX_FILE:
            continue
        code.append(p)
        total += size
        if total >= STDLIB_CHARS:
            break
    if not prose:  # machines without Debian's license texts: the stdlib's own LICENSE is prose too
        prose = [stdlib / "LICENSE.txt"]
    return prose + code


def read_corpus(paths: list[str]) -> Corpus:
    """The documents of `--data` paths (files, folders searched for text files, or `builtin`), in order. A document
    is named by what the path holds, never by how it was typed: a file by its name, a file found in a folder by the
    folder's name and its path inside it (`data/sub/a.txt` whether the folder was given as `data`, `./data` or an
    absolute path), a JSON Lines record by its file's name and line."""
    docs: list[Document] = []
    replaced = files_bad = 0
    for spec in paths:
        if spec == BUILTIN:
            files = builtin_sources()
        else:
            p = Path(spec)
            if not p.exists():
                raise BadInput(f"data path '{spec}' does not exist")
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES) if p.is_dir() else [p]
        for f in files:
            text, bad = decode_text(f.read_bytes())
            if bad:
                replaced += bad
                files_bad += 1
            name = f.name if spec == BUILTIN or f == p else f"{p.resolve().name}/{f.relative_to(p).as_posix()}"
            if f.suffix == ".jsonl":
                docs += _jsonl(name, text)
            else:
                docs.append(_doc(name, text))
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise BadInput("no documents with text in: " + ", ".join(paths))
    return Corpus(docs, replaced, files_bad)


def _jsonl(name: str, text: str) -> list[Document]:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise BadInput(f"{name} line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise BadInput(f"{name} line {i}: no string 'text' field")
        out.append(_doc(f"{name}:{i}", obj["text"]))
    return out


def split_held_out(docs: list[Document], n: int, seed: int) -> tuple[list[int], list[int]]:
    """Indices of calibration and held-out documents. Held-out: the first n by sha256(seed, doc hash),
    so the choice is fixed by the content and the seed, not by the order or the names."""
    if n < 0:
        raise BadInput("--held-out must be >= 0")
    if n >= len(docs):
        raise BadInput(f"--held-out {n} leaves no calibration documents (the corpus has {len(docs)})")
    key = lambda i: hashlib.sha256(f"{seed}:{docs[i].sha256}".encode()).hexdigest()  # noqa: E731
    held = set(sorted(range(len(docs)), key=key)[:n])
    return [i for i in range(len(docs)) if i not in held], sorted(held)
