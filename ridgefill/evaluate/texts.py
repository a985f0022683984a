"""Evaluation text that this machine's Python ships and that the built-in calibration corpus does not use.

Two sources, both read from the running interpreter's standard library (no network, nothing in the repo):

- prose: `pydoc_data/topics.py`, the language-reference topics that `help()` shows (79 English documents on
  CPython 3.11, about 465K characters), one document per topic in sorted topic order. It lives in a package
  directory, and the calibration corpus only reads top-level `*.py` files and license texts, so no file is shared.
- code: top-level standard-library modules whose file name is >= "d" (sorted, not starting with "_", at least
  2,000 bytes), minus any file `builtin_sources()` selects. The calibration corpus takes the first ~250K
  characters of the sorted top-level modules, which ends in the "c" names, so the two sets are disjoint by rule,
  and the explicit exclusion keeps them disjoint if that selection ever grows.

    haystack_documents()                 # [(name, text)], prose: the needle haystack
    haystack_documents("code")           # the held-out source files
    long_documents(tok, 4096)            # [EvalDocument] with >= 4096 tokens each, for the NLL metric
    prose_prompts(tok, 1536, 20)         # 20 prompts of exactly 1536 token ids, each from its own topic on
    check_disjoint(docs, {d.sha256 for d in read_corpus(["builtin:default"]).documents})

Document hashes are sha256 of the UTF-8 text, the same as `ridgefill.capture.corpus.Document.sha256`.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("prose", "code", "all")
CODE_FIRST = "d"  # code documents: top-level stdlib modules whose file name sorts at or after this
CODE_MIN_BYTES = 2_000


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def prose_documents() -> list[tuple[str, str]]:
    """The pydoc topics, sorted by topic name; empty if this Python does not ship them."""
    path = _stdlib() / "pydoc_data" / "topics.py"
    if not path.is_file():
        return []
    import ast

    # Parsed, not imported: the file is a single dict literal, and reading it this way cannot pick up a
    # different `pydoc_data` from sys.path.
    tree = ast.parse(path.read_text(encoding="utf-8"))
    topics = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
    if not isinstance(topics, dict):
        return []
    return [(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics) if topics[k].strip()]


def code_documents() -> list[tuple[str, str]]:
    """Top-level stdlib modules named >= "d", sorted, minus anything the calibration corpus selects."""
    from ridgefill.capture.corpus import builtin_sources

    calibration = {p.resolve() for p in builtin_sources()}
    out = []
    for p in sorted(_stdlib().glob("*.py")):
        if p.name.startswith("_") or p.name < CODE_FIRST or p.resolve() in calibration:
            continue
        if p.stat().st_size < CODE_MIN_BYTES:
            continue
        text = p.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            out.append((p.name, text))
    return out


def haystack_documents(kind: str = "prose") -> list[tuple[str, str]]:
    """Filler documents, in a fixed order: "prose" (default, the needle haystack), "code" or "all" (prose first)."""
    if kind not in KINDS:
        raise ValueError(f"unknown document kind {kind!r} (known: {', '.join(KINDS)})")
    docs: list[tuple[str, str]] = []
    if kind in ("prose", "all"):
        docs += prose_documents()
    if kind in ("code", "all"):
        docs += code_documents()
    if not docs:
        raise ValueError(f"no {kind} evaluation text found under {_stdlib()}")
    return docs


def prose_prompts(tokenizer, tokens: int, count: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `tokens` token ids of prose: prompt i is the prose documents from the
    i-th on (cycling), joined by blank lines, tokenized (with the tokenizer's special prefix) and cut."""
    docs = [text for _, text in haystack_documents("prose")]
    if count > len(docs):
        raise ValueError(f"{count} prompts asked for, from {len(docs)} prose documents")
    prompts = []
    for i in range(count):
        text, j = "", i
        while True:
            text += ("\n\n" if text else "") + docs[j % len(docs)]
            ids = tokenizer(text)["input_ids"]
            if len(ids) >= tokens:
                prompts.append(list(ids[:tokens]))
                break
            j += 1
            if j - i > len(docs):
                raise ValueError(f"the prose documents hold fewer than {tokens} tokens")
    return prompts


@dataclass(frozen=True)
class EvalDocument:
    name: str
    text: str
    sha256: str
    ids: list[int] = field(repr=False)  # the tokenizer's special prefix (e.g. BOS) + the text's tokens


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text on its own (e.g. [BOS]; [] for SmolLM2)."""
    probe = "Hello world"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return list(full[:i])
    return []


def long_documents(tokenizer, min_tokens: int, *, kind: str = "all", limit: int | None = None) -> list[EvalDocument]:
    """Documents with at least `min_tokens` tokens (special prefix included), in `haystack_documents(kind)`
    order, at most `limit` of them. `ids` holds the whole document; the caller takes windows of it."""
    prefix = special_prefix(tokenizer)
    out = []
    for name, text in haystack_documents(kind):
        # Every token covers at least one byte, so shorter texts cannot reach min_tokens: skip tokenizing them.
        if len(prefix) + len(text.encode("utf-8")) < min_tokens:
            continue
        ids = prefix + list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= min_tokens:
            out.append(EvalDocument(name, text, sha256_text(text), ids))
            if limit is not None and len(out) >= limit:
                break
    return out


def reused(docs, hashes) -> list[str]:
    """Names of the documents whose sha256 is in `hashes`. `docs`: (name, text) pairs, EvalDocuments or
    corpus Documents."""
    hashes = set(hashes)
    out = []
    for d in docs:
        name, text = (d.name, d.text) if hasattr(d, "text") else d
        if sha256_text(text) in hashes:
            out.append(name)
    return out


def check_disjoint(docs, hashes) -> None:
    """Raise ValueError if any document's sha256 is in `hashes` (e.g. the calibration corpus' hashes)."""
    bad = reused(docs, hashes)
    if bad:
        raise ValueError(f"{len(bad)} evaluation document(s) are in the calibration corpus: {', '.join(bad[:5])}")
