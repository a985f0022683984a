"""The vLLM connector's rules, without vLLM (ridgefill.engines.vllm applies them; docs/engines.md, "The vLLM
connector"): which cache file a request may name, what the server checks of it before it claims its positions,
which blocks a failed load spoils, and which KV heads a tensor-parallel rank writes.

A request names its cache by `kv_transfer_params = {"ridgefill_cache": PATH}`, PATH relative to the connector's
`cache_dir` (or absolute and inside it). The server accepts it when the file is a cache for the served model, holds
fewer positions than the prompt and, with prefix caching on, the request's `cache_salt` is the file's sha256 (so a
block filled from one cache is never another request's prefix hit unless its bytes are the same). Anything else is
the request's own problem: the connector claims its positions and reports their blocks as failed loads, so vLLM
ends that request with an error and serves the others.

Imports: numpy, the standard library and ridgefill's numpy-only file formats and hashing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ridgefill.artifacts import sha256_file
from ridgefill.errors import RidgefillError

PARAM = "ridgefill_cache"


@dataclass(frozen=True)
class Served:
    """What a cache must match: the served model's layer count, KV heads and head size (all ranks together), and
    the fingerprints it answers to (its own, and the source's a `ridgefill engine model` marker records)."""

    layers: int
    kv_heads: int
    head_dim: int
    fingerprints: frozenset[str]


@dataclass(frozen=True)
class Facts:
    """A cache file as the server saw it: positions held, model fingerprint, layer shape, bytes' sha256."""

    positions: int
    fingerprint: str
    layers: int
    kv_heads: int
    head_dim: int
    sha256: str


@dataclass(frozen=True)
class Target:
    """A request's load: the positions its cache fills (stop = P), or, for a cache the server refuses, the prompt
    positions below the last (whose blocks then fail, ending the request) and the problem."""

    path: str
    stop: int
    problem: str | None = None


def cache_path(cache_dir: Path, named) -> Path:
    """The file a request names, resolved inside `cache_dir`; RidgefillError naming the problem otherwise."""
    root = Path(os.path.realpath(cache_dir))
    path = Path(os.path.realpath(root / named))
    if path != root and root not in path.parents:
        raise RidgefillError(f"outside the connector's cache_dir ({root})")
    if not path.is_file():
        raise RidgefillError("no such cache file under the connector's cache_dir")
    return path


class FactsCache:
    """`Facts` of cache files, read once per file version (path, size, mtime, inode): the header, and the sha256
    of the bytes, which a large cache takes a while to hash."""

    def __init__(self, read_facts):
        self._read = read_facts  # path -> Facts without sha256 (the header's)
        self._seen: dict = {}

    def get(self, path: Path) -> Facts:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in self._seen:
            facts = self._read(path)
            self._seen = {k: v for k, v in self._seen.items() if k[0] != key[0]}  # an older version of the file
            self._seen[key] = Facts(**{**facts.__dict__, "sha256": sha256_file(path)})
        return self._seen[key]


def target(request_params: dict | None, prompt_tokens: int, salt: str | None, *, cache_dir: Path, served: Served,
           facts: FactsCache, prefix_caching: bool) -> Target | None:
    """A request's load, or None when it names no cache. Free of side effects but for `facts`' memo."""
    named = (request_params or {}).get(PARAM)
    if named is None:
        return None
    refused = max(prompt_tokens - 1, 0)
    if not isinstance(named, str) or not named:
        return Target("", refused, f"'{PARAM}' must name a file under the connector's cache_dir, got {named!r}")
    try:
        path = cache_path(cache_dir, named)
        f = facts.get(path)
    except (OSError, RidgefillError) as exc:
        return Target(named, refused, f"{named}: {exc}")
    problem = _problem(f, prompt_tokens, salt, served, prefix_caching)
    if problem:
        return Target(str(path), refused, f"{named}: {problem}")
    return Target(str(path), f.positions)


def _problem(f: Facts, prompt_tokens: int, salt, served: Served, prefix_caching: bool) -> str | None:
    if f.fingerprint not in served.fingerprints:
        served_as = " or ".join(sorted(x[:12] for x in served.fingerprints))
        return f"a cache for another model (fingerprint {f.fingerprint[:12]}; the served model is {served_as})"
    for what, have, want in (("layers", f.layers, served.layers), ("KV heads", f.kv_heads, served.kv_heads),
                             ("head size", f.head_dim, served.head_dim)):
        if have != want:
            return f"the cache has {have} {what}, the served model {want}"
    if f.positions >= prompt_tokens:
        return (f"the cache holds {f.positions} positions but the prompt has {prompt_tokens} tokens; at least one "
                f"must be left for the engine")
    if prefix_caching and salt != f.sha256:
        what = "no cache_salt" if not salt else "a cache_salt that is not the cache's sha256"
        return f"{what} while prefix caching is on (ridgefill.engines.request.vllm_request sets it)"
    return None


def failed_blocks(block_ids, block_size: int, start: int, stop: int) -> set[int]:
    """The blocks holding positions start..stop-1 of a request whose blocks are `block_ids`."""
    if stop <= start:
        return set()
    return set(block_ids[start // block_size : (stop - 1) // block_size + 1])


def rank_heads(total: int, rank: int, world: int) -> slice:
    """The KV heads tensor-parallel rank `rank` of `world` holds of `total`, as vLLM's QKVParallelLinear shards
    them: total/world each when world divides total, else (fewer heads than ranks) head rank*total//world,
    replicated on world/total ranks."""
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}")
    if total >= world:
        if total % world:
            raise ValueError(f"{total} KV heads do not split over {world} ranks")
        n = total // world
        return slice(rank * n, (rank + 1) * n)
    if world % total:
        raise ValueError(f"{world} ranks do not replicate {total} KV heads evenly")
    first = rank * total // world
    return slice(first, first + 1)


def rank_map_rows(heads: slice, width: int, head_dim: int) -> list[int]:
    """The rows of a key/value map [width = 2 * KV heads * head_dim, d] (keys of every KV head, then their values)
    that a tensor-parallel rank holding KV heads `heads` (`rank_heads`) keeps: those heads' keys, then the same
    heads' values, the layout of the rank's own key and value rows."""
    half = width // 2
    keys = list(range(heads.start * head_dim, heads.stop * head_dim))
    return keys + [half + r for r in keys]


def rank_input_rows(width: int, rank: int, world: int) -> slice:
    """The output rows of an input map [width = d, d] that tensor-parallel rank `rank` of `world` holds, as vLLM's
    ColumnParallelLinear shards a layer's output: the rank's contiguous d / world rows."""
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}")
    if width % world:
        raise ValueError(f"a map of {width} rows does not split over {world} ranks")
    n = width // world
    return slice(rank * n, (rank + 1) * n)
