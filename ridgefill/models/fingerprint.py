"""Model fingerprints: the 64 hex digits that stand for a model in every stage id. They depend on content, never on
location:

    GGUF file            sha256(canonical JSON {"gguf": sha256 of the file})
    directory / Hub      sha256(canonical JSON {"config":    sha256 of config.json,
                                                "tokenizer": files_sha256 of the top-level tokenizer files,
                                                "weights":   {file name: sha256 of the file}})

`files_sha256` streams `name NUL size NUL bytes` of each file in name order. The weight files are the top-level
`*.safetensors` files, or, for a local directory that has none, its `*.bin` / `*.pt` / `*.pth` files (what
transformers would load). A Hub snapshot and a plain copy of the same files get the same fingerprint; only the
way the weights' sha256 is obtained differs:

  * Hub snapshot: in the Hugging Face cache each snapshot file is a symlink to `blobs/<name>`, and the blob of
    an LFS file is named by the sha256 the Hub keeps for it (64 hex). That name is used as the weight file's
    sha256, so gigabytes are not re-read (the same trust transformers puts in the cache). A blob whose name is not
    a 64-hex sha256 (a git sha1 for a non-LFS file, or a cache without symlinks) is hashed. config.json and the
    tokenizer files are small and always hashed.
  * Local files (directory weights, GGUF files): hashed once, then remembered in `<store>/models/fingerprints.json`
    (`FileHashCache`), keyed by the file's resolved absolute path with its size, mtime_ns and inode. A file whose
    size, mtime or inode changed is hashed again. The cache lives in the store because `resolve_model` is always
    given one, the store is where ridgefill already keeps derived model data (`<store>/models/`), and deleting
    the store forgets it; it is rewritten atomically (temp file + os.replace) and a damaged or unwritable one is
    ignored: it only ever saves time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

from ridgefill.artifacts.store import canonical_json, sha256_file
from ridgefill.errors import BadInput

# Files that make up a tokenizer / the weights in a transformers directory (top level only: sub-folders such as
# onnx/ or original/ hold other formats that transformers does not load).
TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|spiece\.model"
    r"|chat_template\.(jinja|json)|.*\.tiktoken)$"
)
WEIGHT_FILES = re.compile(r"^.*\.(safetensors|bin|pt|pth)$")
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
FINGERPRINT_CACHE = "fingerprints.json"  # in <store>/models/


def canonical_sha256(obj) -> str:
    """sha256 of canonical JSON (sorted keys, no spaces), the house rule for ids and fingerprints."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def files_sha256(paths: list[Path]) -> str:
    """sha256 over files in name order: for each, `name NUL size NUL` then its bytes (so boundaries count)."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode("utf-8"))
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def weight_files(path: Path) -> list[Path]:
    """The weights transformers would load from a directory: top-level *.safetensors, else *.bin / *.pt / *.pth."""
    files = [p for p in path.iterdir() if p.is_file() and WEIGHT_FILES.match(p.name)]  # is_file follows symlinks
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    return sorted(safetensors or files, key=lambda p: p.name)


def _fingerprint(path: Path, weight_sha256) -> str:
    files = [p for p in path.iterdir() if p.is_file()]
    weights = weight_files(path)
    if not weights:
        raise BadInput(f"model directory '{path}' has no weight files (*.safetensors or *.bin)")
    return canonical_sha256(
        {
            "config": sha256_file(path / "config.json"),
            "tokenizer": files_sha256([p for p in files if TOKENIZER_FILES.match(p.name)]),
            "weights": {p.name: weight_sha256(p) for p in weights},
        }
    )


def dir_fingerprint(path: Path, hashes: FileHashCache | None = None) -> str:
    """Fingerprint of a transformers directory: config, tokenizer files and weight files, not their location.

    Weight files are hashed through `hashes` (re-read only when their size, mtime or inode changed)."""
    hashes = hashes or FileHashCache(None)
    return _fingerprint(path, hashes.sha256)


def hub_fingerprint(snapshot: Path, hashes: FileHashCache | None = None) -> str:
    """Fingerprint of a Hugging Face cache snapshot: as `dir_fingerprint`, with each weight file's sha256 taken
    from the name of the blob it links to when that name is a sha256 (the Hub's own LFS hash)."""
    hashes = hashes or FileHashCache(None)

    def weight_sha256(p: Path) -> str:
        blob = os.path.basename(os.path.realpath(p))
        return blob if p.is_symlink() and SHA256_NAME.match(blob) else hashes.sha256(p)

    return _fingerprint(snapshot, weight_sha256)


def gguf_fingerprint(path: Path, hashes: FileHashCache | None = None) -> str:
    """Fingerprint of a GGUF file: it holds config, tokenizer and weights in one."""
    hashes = hashes or FileHashCache(None)
    return canonical_sha256({"gguf": hashes.sha256(path)})


class FileHashCache:
    """sha256 of local files, remembered across runs in a small JSON file (or in memory only, when path is None).

    An entry is keyed by the file's resolved absolute path and holds its size, mtime_ns, inode and sha256; it is
    used only while all three still match. A file is remembered only if it did not change while being hashed and
    its mtime is more than RACY_S seconds old: a write within the file system's timestamp granularity of the hash
    could otherwise keep its old mtime (git's "racy" rule). `save()` merges the new entries into what is on disk
    now, drops entries of files that no longer exist, and replaces the file atomically.
    """

    VERSION = 1
    RACY_S = 2.0

    def __init__(self, path: Path | None, *, remembered: bool = True):
        self.path = path
        self._entries: dict | None = None if remembered else {}
        self._new: dict[str, dict] = {}
        self._forget: set[str] = set()  # hashed again but too new to remember: drop what was remembered
        self.reused = False  # whether a remembered hash was returned

    def fresh(self) -> "FileHashCache":
        """The same cache file, with every file hashed again (what is hashed now replaces what was remembered)."""
        return FileHashCache(self.path, remembered=False)

    def sha256(self, file: Path) -> str:
        real = os.path.realpath(file)
        before = os.stat(real)
        known = self._load().get(real)
        if known is not None and _stat_key(before).items() <= known.items() and SHA256_NAME.match(
                str(known.get("sha256"))):
            self.reused = True
            return known["sha256"]
        digest = sha256_file(Path(real))
        after = os.stat(real)
        if _stat_key(after) == _stat_key(before) and time.time_ns() - after.st_mtime_ns > self.RACY_S * 1e9:
            self._new[real] = {**_stat_key(after), "sha256": digest}
        else:
            self._forget.add(real)
        return digest

    def _load(self) -> dict:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        files = doc.get("files") if isinstance(doc, dict) and doc.get("version") == self.VERSION else None
        return {k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}

    def save(self) -> None:
        if self.path is None or not (self._new or self._forget):
            return
        entries = {**self._read(), **self._new}
        entries = {k: v for k, v in entries.items() if os.path.exists(k) and k not in self._forget - set(self._new)}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": self.VERSION, "files": entries}, indent=1, sort_keys=True) + "\n",
                           encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only store: hashing again next time is the only cost
        finally:
            tmp.unlink(missing_ok=True)
        self._entries, self._new, self._forget = entries, {}, set()


def _stat_key(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
