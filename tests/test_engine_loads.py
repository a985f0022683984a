"""The vLLM connector's rules without vLLM (ridgefill/engines/vllm/loads.py): which file a request may name, what the
server refuses before it claims a request's positions, the blocks a failed load spoils, the KV heads of a
tensor-parallel rank. Default CI; the connector in vLLM is tests/test_engines.py's and
tests/test_vllm_connector.py's."""

from __future__ import annotations

import hashlib
import os

import pytest

from ridgefill.engines.vllm import loads
from ridgefill.errors import RidgefillError

FP = "a" * 64
SERVED = loads.Served(layers=4, kv_heads=2, head_dim=32, fingerprints=frozenset({FP, "b" * 64}))


@pytest.fixture
def cache_dir(tmp_path):
    root = tmp_path / "caches"
    (root / "doc").mkdir(parents=True)
    (root / "doc" / "cache.safetensors").write_bytes(b"cache bytes")
    (tmp_path / "elsewhere.safetensors").write_bytes(b"other bytes")
    return root


def facts_of(**over):
    """A FactsCache whose header reader returns these facts (counting its calls)."""
    calls = []

    def read(path):
        calls.append(path)
        return loads.Facts(**({"positions": 100, "fingerprint": FP, "layers": 4, "kv_heads": 2, "head_dim": 32,
                               "sha256": ""} | over))  # fmt: skip

    cache = loads.FactsCache(read)
    cache.calls = calls
    return cache


def target(cache_dir, named, *, prompt=120, salt=None, prefix_caching=True, facts=None):
    return loads.target({loads.PARAM: named} if named is not ... else {}, prompt, salt, cache_dir=cache_dir,
                        served=SERVED, facts=facts or facts_of(), prefix_caching=prefix_caching)  # fmt: skip


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_good_request_claims_the_caches_positions(cache_dir):
    path = cache_dir / "doc" / "cache.safetensors"
    for named in ("doc/cache.safetensors", str(path), "doc/../doc/cache.safetensors"):
        t = target(cache_dir, named, salt=sha(path))
        assert t == loads.Target(str(path.resolve()), 100), named
    assert target(cache_dir, "doc/cache.safetensors", prefix_caching=False) == loads.Target(str(path.resolve()), 100)
    assert target(cache_dir, ...) is None  # no cache named: vLLM serves it as usual


@pytest.mark.parametrize("named, says", [
    ("../elsewhere.safetensors", "outside the connector's cache_dir"),
    ("/etc/passwd", "outside the connector's cache_dir"),
    ("doc/nope.safetensors", "no such cache file under the connector's cache_dir"),
    ("doc", "no such cache file"),
    ("", "'ridgefill_cache' must name a file under the connector's cache_dir"),
    (7, "'ridgefill_cache' must name a file"),
])  # fmt: skip
def test_names_outside_the_folder_or_missing_are_refused(cache_dir, named, says):
    t = target(cache_dir, named, prompt=120)
    assert t.problem is not None and says in t.problem, t
    assert t.stop == 119  # claims every prompt position but the last: their blocks fail, and so does the request


def test_a_link_out_of_the_folder_is_refused(cache_dir):
    os.symlink(cache_dir.parent / "elsewhere.safetensors", cache_dir / "link.safetensors")
    assert "outside the connector's cache_dir" in target(cache_dir, "link.safetensors").problem


@pytest.mark.parametrize("over, salt, says", [
    ({"fingerprint": "c" * 64}, "ok", "a cache for another model (fingerprint cccccccccccc; the served model is "
                                      "aaaaaaaaaaaa or bbbbbbbbbbbb)"),
    ({"layers": 3}, "ok", "the cache has 3 layers, the served model 4"),
    ({"kv_heads": 4}, "ok", "the cache has 4 KV heads, the served model 2"),
    ({"head_dim": 64}, "ok", "the cache has 64 head size, the served model 32"),
    ({"positions": 120}, "ok", "the cache holds 120 positions but the prompt has 120 tokens"),
    ({}, None, "no cache_salt while prefix caching is on"),
    ({}, "f" * 64, "a cache_salt that is not the cache's sha256 while prefix caching is on"),
])  # fmt: skip
def test_what_the_server_refuses(cache_dir, over, salt, says):
    path = cache_dir / "doc" / "cache.safetensors"
    t = target(cache_dir, "doc/cache.safetensors", salt=sha(path) if salt == "ok" else salt, facts=facts_of(**over))
    assert t.problem == f"doc/cache.safetensors: {says}" or t.problem.startswith(f"doc/cache.safetensors: {says}")
    assert t.stop == 119


def test_the_salt_is_checked_only_with_prefix_caching(cache_dir):
    t = target(cache_dir, "doc/cache.safetensors", salt="f" * 64, prefix_caching=False)
    assert t.problem is None and t.stop == 100


def test_facts_are_read_once_per_file_version(cache_dir):
    path = cache_dir / "doc" / "cache.safetensors"
    facts = facts_of()
    first = facts.get(path)
    assert first.sha256 == sha(path) and facts.get(path) is first and len(facts.calls) == 1
    path.write_bytes(b"new cache bytes")  # another size: another version
    second = facts.get(path)
    assert second.sha256 == sha(path) != first.sha256 and len(facts.calls) == 2


def test_a_one_token_prompt_with_a_bad_cache_claims_nothing(cache_dir):
    t = target(cache_dir, "nope", prompt=1)
    assert t.problem and t.stop == 0


def test_failed_blocks_are_the_blocks_of_the_loaded_positions():
    blocks = [7, 3, 9, 12, 5]
    for start in range(0, 80):
        for stop in range(start, 80):
            want = {blocks[p // 16] for p in range(start, stop)}
            assert loads.failed_blocks(blocks, 16, start, stop) == want, (start, stop)


@pytest.mark.parametrize("total, world", [(1, 1), (2, 1), (4, 2), (8, 4), (2, 4), (1, 8), (4, 8), (3, 3)])
def test_rank_heads_follow_vllms_sharding(total, world):
    """vLLM's QKVParallelLinear: world divides total, H/world heads per rank; else world/total replicas of each
    head, rank r holding head r // replicas."""
    covered = []
    for rank in range(world):
        got = loads.rank_heads(total, rank, world)
        if total >= world:
            want = list(range(rank * total // world, (rank + 1) * total // world))
        else:
            want = [rank // (world // total)]
        assert list(range(total))[got] == want
        covered += want
    assert sorted(set(covered)) == list(range(total))


@pytest.mark.parametrize("total, rank, world, says", [(3, 0, 2, "3 KV heads do not split over 2 ranks"),
                                                      (3, 0, 4, "4 ranks do not replicate 3 KV heads"),
                                                      (2, 2, 2, "rank 2 of 2")])  # fmt: skip
def test_rank_heads_refuses_what_vllm_cannot_shard(total, rank, world, says):
    with pytest.raises(ValueError, match=says):
        loads.rank_heads(total, rank, world)


def test_cache_path_refuses_with_ridgefill_errors(cache_dir):
    with pytest.raises(RidgefillError, match="outside"):
        loads.cache_path(cache_dir, "../elsewhere.safetensors")
    assert loads.cache_path(cache_dir, "doc/cache.safetensors") == (cache_dir / "doc" / "cache.safetensors").resolve()


@pytest.mark.parametrize("total, world", [(2, 1), (2, 2), (8, 4), (2, 4)])
def test_rank_map_rows_give_each_rank_its_heads_keys_and_values(total, world):
    """Cut to each rank's rows, a key/value map predicts exactly that rank's slice of the whole map's keys and values
    (per head, brute force over a map whose rows are numbered), and the ranks together hold every row."""
    import numpy as np

    head_dim = 3
    width = 2 * total * head_dim
    whole = np.arange(width)  # row r predicts: keys of head r // head_dim, or values of head (r - width/2) // head_dim
    seen = set()
    for rank in range(world):
        heads = loads.rank_heads(total, rank, world)
        rows = loads.rank_map_rows(heads, width, head_dim)
        keys = [h * head_dim + j for h in range(heads.start, heads.stop) for j in range(head_dim)]
        assert list(whole[rows]) == keys + [width // 2 + r for r in keys]
        seen |= set(rows)
    assert seen == set(range(width))
