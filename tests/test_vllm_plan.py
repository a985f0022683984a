"""The vLLM fill plugin's engine-free parts (default CI, no engine): the per-token plan, the exact rows as attention
sequences, the prefix-cache block key, and the release an engine serves (read, refused, pulled from a Hub).

The plan is checked against brute force: positions walked one token at a time, a causal kernel simulated row by row,
and a prompt cut into chunks of every size giving the rows of the prompt prefilled whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ridgefill.engines.vllm import plan, served
from conftest import quiet

pytestmark = pytest.mark.usefixtures("one_thread")


def random_step(rng, requests: int):
    """A step as vLLM schedules it: per request a prompt length N, tokens already computed, and a run of scheduled
    positions (a chunk of the prompt, its rest, or decode tokens after it)."""
    prompt, done, q_len = [], [], []
    for _ in range(requests):
        n = int(rng.integers(1, 300))
        computed = int(rng.integers(0, n + 20))  # beyond n: decoding
        prompt.append(n)
        done.append(computed)
        q_len.append(int(rng.integers(1, 64)) if computed < n else int(rng.integers(1, 3)))
    qsl = np.concatenate([[0], np.cumsum(q_len)])
    seq = np.array(done) + np.array(q_len)
    return qsl, seq, np.array(prompt), np.array(done)


def brute_positions(qsl, seq):
    pos, owner = [], []
    for r in range(len(seq)):
        q = qsl[r + 1] - qsl[r]
        for i in range(q):
            pos.append(seq[r] - q + i)
            owner.append(r)
    return np.array(pos), np.array(owner)


def test_token_positions_and_prefix_rows_equal_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        qsl, seq, prompt, _ = random_step(rng, int(rng.integers(1, 7)))
        exact = rng.random(len(seq)) < 0.2
        tail, anchor = int(rng.integers(1, 40)), int(rng.integers(0, 3))
        pos, owner = plan.token_positions(qsl, seq)
        want_pos, want_owner = brute_positions(qsl, seq)
        assert pos.tolist() == want_pos.tolist() and owner.tolist() == want_owner.tolist()
        got = plan.prefix_rows(qsl, seq, prompt, exact, tail=tail, anchor=anchor)
        want = [not exact[o] and anchor <= p < prompt[o] - tail for p, o in zip(want_pos, want_owner)]
        assert got.tolist() == want


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 1000])
def test_a_prompt_in_chunks_plans_the_rows_of_the_whole_prompt(chunk):
    """The point of deciding per token: the prefix rows of a prompt scheduled in chunks of any size (here beside a
    decoding request) are the prefix rows of the prompt scheduled whole."""
    n, tail, anchor = 333, 50, 1
    whole = plan.prefix_rows([0, n], [n], [n], [False], tail=tail, anchor=anchor)
    seen = []
    for start in range(0, n, chunk):
        q = min(chunk, n - start)
        qsl = [0, 1, 1 + q]  # a decode token of another request first, then the chunk
        got = plan.prefix_rows(qsl, [50, start + q], [20, n], [False, False], tail=tail, anchor=anchor)
        assert not got[0]  # a decode token is never a prefix row
        seen.extend(got[1:].tolist())
    assert seen == whole.tolist()
    assert sum(seen) == n - tail - anchor


def test_a_step_that_reaches_no_prefix_skips_the_plan():
    """`reaches_prefix`, the plan's fast exit (a test per request): False only where `prefix_rows` holds no prefix row
    for any anchor and any requests served exactly; for a step of decodes and tails it is False."""
    rng = np.random.default_rng(1)
    skipped = 0
    for _ in range(400):
        qsl, seq, prompt, _ = random_step(rng, int(rng.integers(1, 7)))
        tail = int(rng.integers(1, 40))
        if plan.reaches_prefix(qsl, seq, prompt, tail=tail):
            pos, owner = brute_positions(qsl, seq)
            assert any(p < prompt[o] - tail for p, o in zip(pos, owner))  # some token below its N - T
            continue
        skipped += 1
        for anchor in (0, 1, 3):
            assert not plan.prefix_rows(qsl, seq, prompt, np.zeros(len(seq), bool), tail=tail, anchor=anchor).any()
    assert skipped > 20  # steps of decodes and tails only
    prompt = np.array([100, 30, 7])
    decodes = (np.arange(4), np.array([101, 40, 8]))  # one token each, past every prompt
    assert not plan.reaches_prefix(*decodes, prompt, tail=16)
    tails = ([0, 16, 20, 26], [100, 30, 7])  # each request's last 16 (or fewer) prompt rows
    assert not plan.reaches_prefix(*tails, prompt, tail=16)
    assert plan.reaches_prefix([0, 17, 21, 27], [100, 30, 7], prompt, tail=16)  # one row more: position 83 of 100


def test_protected_rows_are_a_table_lookup_equal_to_isin():
    """The ridgefill+protected rule as the plugin applies it on the device: a boolean table over the vocabulary
    (`rows.token_table`), indexed by the step's ids (`rows.protected_rows`), equal to torch.isin for ids in the
    vocabulary, int32 (vLLM's) or int64; an id outside the table (past it, or negative) is not protected."""
    import torch

    from ridgefill.runtime.rows import protected_rows, token_table

    rng = np.random.default_rng(2)
    vocab = 500
    protected = np.unique(rng.integers(0, vocab, 60))
    table = torch.as_tensor(token_table(protected, vocab))
    assert table.shape == (vocab,) and table.dtype == torch.bool and int(table.sum()) == len(protected)
    for dtype in (torch.int32, torch.int64):
        ids = torch.as_tensor(rng.integers(0, vocab, 3000), dtype=dtype)
        want = torch.isin(ids, torch.as_tensor(protected))
        assert torch.equal(protected_rows(ids, table), want)
    outside = torch.tensor([-3, -1, vocab, vocab + 7, int(protected[0])])
    assert protected_rows(outside, table).tolist() == [False, False, False, False, True]
    assert token_table(np.array([vocab + 2]), vocab).shape == (vocab + 3,)  # an id past `vocab` keeps its row
    empty = torch.as_tensor(token_table(np.zeros(0, np.int64), 0))
    assert protected_rows(torch.tensor([0, 5]), empty).tolist() == [False, False]


def simulate_kernel(runs: plan.Runs, qsl, seq):
    """What a causal varlen kernel gives each query row of `runs`: (its token index, the last key position it sees)."""
    out = []
    for s in range(runs.owner.size):
        rows = runs.rows[runs.query_start[s] : runs.query_start[s + 1]]
        m = len(rows)
        for i, row in enumerate(rows):
            out.append((int(row), int(runs.seq_lens[s] - m + i)))
    return out


def test_runs_let_every_exact_row_attend_to_exactly_the_positions_up_to_its_own():
    rng = np.random.default_rng(1)
    for _ in range(300):
        qsl, seq, _, _ = random_step(rng, int(rng.integers(1, 6)))
        exact = rng.random(qsl[-1]) < rng.choice([0.05, 0.3, 0.9, 1.0])
        runs = plan.runs(exact, qsl, seq)
        pos, owner = brute_positions(qsl, seq)
        assert runs.rows.tolist() == np.flatnonzero(exact).tolist()
        assert simulate_kernel(runs, qsl, seq) == [(int(r), int(pos[r])) for r in np.flatnonzero(exact)]
        for s in range(runs.owner.size):
            rows = runs.rows[runs.query_start[s] : runs.query_start[s + 1]]
            assert (np.diff(rows) == 1).all() and (owner[rows] == runs.owner[s]).all() and runs.last[s] == rows[-1]
        # maximal: two neighbouring runs of one request are never adjacent tokens
        for s in range(runs.owner.size - 1):
            nxt = runs.rows[runs.query_start[s + 1]]
            assert runs.owner[s] != runs.owner[s + 1] or nxt != runs.last[s] + 1
        assert runs.max_query_len == (max(np.diff(runs.query_start)) if runs.owner.size else 0)
    # a request all of whose tokens are exact keeps its own sequence
    qsl, seq = np.array([0, 5, 6]), np.array([105, 40])
    r = plan.runs(np.ones(6, bool), qsl, seq)
    assert r.query_start.tolist() == [0, 5, 6] and r.seq_lens.tolist() == [105, 40] and r.owner.tolist() == [0, 1]


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 7])
def test_groups_run_every_sequence_once_in_order_within_the_limit(limit):
    """Groups of at most `limit` sequences, in order, that together are the runs: each group a valid `Runs` whose
    rows attend to what the whole runs' rows do (simulated kernel), and no row attends to a row of a later group
    (the groups run one after another, so a later group's keys are not yet written)."""
    rng = np.random.default_rng(limit)
    for _ in range(200):
        qsl, seq, _, _ = random_step(rng, int(rng.integers(1, 6)))
        exact = rng.random(qsl[-1]) < rng.choice([0.05, 0.3, 0.9])
        whole = plan.runs(exact, qsl, seq)
        parts = plan.groups(whole, limit)
        assert all(0 < g.owner.size <= limit for g in parts) and sum(g.owner.size for g in parts) == whole.owner.size
        assert np.concatenate([g.rows for g in parts] or [whole.rows]).tolist() == whole.rows.tolist()
        assert sum((simulate_kernel(g, qsl, seq) for g in parts), []) == simulate_kernel(whole, qsl, seq)
        for g in parts:
            assert g.query_start[0] == 0 and g.query_start[-1] == g.rows.size
            assert (g.rows[g.query_start[1:] - 1] == g.last).all()
        pos, owner = brute_positions(qsl, seq)
        for i, g in enumerate(parts):  # every row of a later group of the same request sits at a later position
            for later in parts[i + 1 :]:
                for o in set(g.owner.tolist()) & set(later.owner.tolist()):
                    assert pos[g.rows[owner[g.rows] == o]].max() < pos[later.rows[owner[later.rows] == o]].min()
    with pytest.raises(ValueError, match="at least one sequence"):
        plan.groups(plan.runs(np.ones(3, bool), [0, 3], [3]), 0)


def test_a_request_is_served_exactly_by_its_own_parameters():
    class Params:
        def __init__(self, **kw):
            self.prompt_logprobs, self.prompt_logprob_token_ids = kw.get("lp"), kw.get("ids")

    assert plan.served_exactly(None)  # a pooling request: no sampling parameters
    assert plan.served_exactly(Params(lp=0)) and plan.served_exactly(Params(lp=-1))
    assert plan.served_exactly(Params(ids=[5]))
    assert not plan.served_exactly(Params())


def test_prefix_rows_in_block_counts_the_blocks_prefix_rows():
    for n in (1, 16, 100, 129, 300):
        for tail in (1, 16, 64):
            for start in range(0, 320, 32):
                end = start + 32
                want = sum(p < n - tail for p in range(start, end))
                assert plan.prefix_rows_in_block(n, start, end, tail=tail, exact_request=False) == want
                assert plan.prefix_rows_in_block(n, start, end, tail=tail, exact_request=True) == 0


class _Params:
    def __init__(self, prompt_logprobs=None):
        self.prompt_logprobs = prompt_logprobs


class _Request:
    def __init__(self, n, prompt_logprobs=None):
        self.num_prompt_tokens, self.sampling_params = n, _Params(prompt_logprobs)


class _Fill:
    def __init__(self, sha, tail=16):
        self.sha256, self.tail = sha, tail


def test_block_keys_carry_the_release_and_the_plan():
    from ridgefill.engines.vllm.plugin import block_key

    a, b = _Fill("a" * 64), _Fill("b" * 64)
    # the same prompt length and release: the same key; another release, another key
    assert block_key(a, _Request(200), 0, 32) == block_key(a, _Request(500), 0, 32)
    assert block_key(a, _Request(200), 0, 32) != block_key(b, _Request(200), 0, 32)
    # a block that holds the tail boundary of one request but not the other's: different keys
    assert block_key(a, _Request(200), 160, 192) != block_key(a, _Request(500), 160, 192)
    # a request served exactly (prompt log-probabilities) never shares a filled block
    assert block_key(a, _Request(200, prompt_logprobs=1), 0, 32) != block_key(a, _Request(200), 0, 32)
    assert block_key(a, _Request(200, prompt_logprobs=1), 0, 32) == block_key(a, _Request(10), 0, 32)


# ------------------------------------------------------------------------------------------------ the served release


@pytest.fixture(scope="module")
def chain(tiny_chain):
    return tiny_chain()


def test_served_release_reads_the_release_as_the_runtime_does(chain):
    from ridgefill.formats.release import load_release

    fill = served.load(chain.release)
    manifest, maps = load_release(chain.release)
    assert fill.split == manifest["split"] and fill.tail == manifest["tail_default"]
    assert fill.exact_norm == manifest["fit"]["exact_norm"] and fill.anchor == manifest["fit"]["skip_first_rows"]
    assert fill.sha256 == manifest["files"]["maps.safetensors"] and fill.protected is None
    assert sorted(fill.maps) == sorted(maps)
    for l, (W, b) in fill.maps.items():
        assert np.array_equal(W, maps[l]["weight"]) and np.array_equal(b, maps[l]["bias"])
    assert "split 2 of 4" in fill.describe()


def test_served_release_refusals(chain, tmp_path, monkeypatch):
    from ridgefill.errors import BadInput

    monkeypatch.setenv(served.ENV, str(tmp_path / "missing"))
    with pytest.raises(BadInput, match="no such folder"):
        served.from_environment()
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="not a folder"):
        served.locate(str(tmp_path / "file"))
    monkeypatch.setenv(served.ENV, "")
    assert served.from_environment() is None  # empty: the engine runs untouched
    monkeypatch.setenv(served.ENV, "  ")  # looks unset and is not: refused, not served stock without a word
    with pytest.raises(BadInput) as e:
        served.from_environment()
    assert str(e.value) == ("RIDGEFILL_RELEASE is set to blanks ('  '): unset it to serve without the fill, or name "
                            "a release folder, or a Hub release hf://owner/name[@rev]")
    # a relative path typed in the wrong folder is a missing folder, never a Hub repo id
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as e:
        served.locate("release/smollm2-135m")
    assert str(e.value) == (f"RIDGEFILL_RELEASE=release/smollm2-135m: no such folder ({tmp_path}/release/smollm2-135m)"
                            "; a Hub release is written hf://release/smollm2-135m")
    for bad in ("hf://acme", "hf://acme/", "hf:///tiny", "hf://a/b/c"):
        with pytest.raises(BadInput, match=f"^RIDGEFILL_RELEASE={bad}: a Hub release is written hf://owner/name"):
            served.locate(bad)
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64}
    fill = served.load(chain.release)
    served.check_model(fill, config)  # the release's own model, no folder to fingerprint
    with pytest.raises(BadInput, match="'gemma3_text'; the fill runs in"):
        served.check_model(fill, config | {"model_type": "gemma3_text"})
    with pytest.raises(BadInput, match="layer"):
        served.check_model(fill, config | {"num_hidden_layers": 6})
    served.check_model(fill, config | {"num_attention_heads": 4, "num_key_value_heads": 2})  # its KV shape: 2 of 16
    with pytest.raises(BadInput, match="whose KV head count is 2; the served model's is 4$"):
        served.check_model(fill, config | {"num_attention_heads": 4, "num_key_value_heads": 4})
    with pytest.raises(BadInput, match="whose head size is 16; the served model's is 32$"):
        served.check_model(fill, config | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32})
    with pytest.raises(BadInput, match="fingerprint"):
        served.check_model(fill, config, chain.model.parent)  # a folder that is not the model
    # the config's context is no bound on the tail (rope scaling lets a server exceed it; the plugin checks the
    # served max_model_len); a protected-token table past the served vocabulary is refused, applied or not (the
    # chain's release is plain, and its solve made a table)
    top = int(fill.release.protected[-1])
    served.check_model(fill, config | {"max_position_embeddings": fill.tail, "vocab_size": top + 1})
    with pytest.raises(BadInput) as e:
        served.check_model(fill, config | {"vocab_size": top})
    assert str(e.value) == (f"RIDGEFILL_RELEASE={fill.folder}: the protected-token table holds token id {top}, past "
                            f"the vocabulary of 'the served model' ({top} tokens: ids 0..{top - 1})")


def test_served_release_refuses_a_damaged_release(chain, tmp_path):
    import shutil

    from ridgefill.errors import BadInput

    bad = tmp_path / "release"
    shutil.copytree(chain.release, bad)
    data = bytearray((bad / "maps.safetensors").read_bytes())
    data[-1] ^= 1
    (bad / "maps.safetensors").write_bytes(bytes(data))
    with pytest.raises(BadInput, match="maps.safetensors"):
        served.load(bad)
    (bad / "maps.safetensors").unlink()
    with pytest.raises(BadInput, match="maps.safetensors"):
        served.load(bad)


def test_served_release_refuses_configurations_a_chunked_prefill_cannot_apply(chain, tmp_path):
    from ridgefill.errors import BadInput
    from ridgefill.export import export
    from ridgefill.export.config import ExportConfig

    out = tmp_path / "rows"
    export(chain.store, chain.sol.id, ExportConfig(configuration="ridgefill+rows"), quiet(), out_dir=out)
    with pytest.raises(BadInput, match="configuration ridgefill\\+rows needs the whole prompt's tail"):
        served.load(out)


def test_served_release_is_pulled_from_a_hub_once_then_read_from_the_cache(chain, tmp_path):
    """RIDGEFILL_RELEASE=hf://owner/name: pulled and verified into $RIDGEFILL_CACHE, then reused; offline, or with the
    Hub unreachable, the cached copy; nothing cached and the Hub unreachable: one line naming the endpoint. The same
    name without hf:// is a folder, and the Hub never hears of it."""
    from clirun import cli
    from hubserver import HubServer, Token

    token = "hf_rfWRITE_served_0123456789abcdef"
    code = ("import json, sys; from ridgefill.engines.vllm import served; from ridgefill.errors import RidgefillError\n"
            "try:\n    f = served.from_environment()\n"
            "    print(json.dumps({'folder': str(f.folder), 'sha': f.sha256, 'line': f.describe()}))\n"
            "except RidgefillError as e:\n    print(json.dumps({'error': str(e), 'code': e.exit_code}))")

    def served_in(env):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    with HubServer(tokens={token: Token("alice", orgs=("acme",))}) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1", HF_TOKEN=token,
                   RIDGEFILL_CACHE=str(tmp_path / "cache"), RIDGEFILL_RELEASE="hf://acme/tiny")  # fmt: skip
        r = cli("push", chain.release, "--repo", "acme/tiny", env=env)
        assert r.returncode == 0, r.stderr
        first = served_in(env)
        assert "error" not in first, first
        assert first["sha"] == served.load(chain.release).sha256
        assert first["folder"].startswith(str(tmp_path / "cache" / "releases" / "acme--tiny"))
        assert first["line"].startswith(f"release hf://acme/tiny, pulled into {first['folder']} (maps ")
        n = len(hub.requests)
        assert served_in(env) == first
        assert not [r for r in hub.requests_since(n) if "/resolve/" in r["path"]]  # nothing downloaded again
        assert served_in(env | {"HF_HUB_OFFLINE": "1"}) == first
        missing = served_in(env | {"RIDGEFILL_RELEASE": "hf://acme/nothing"})
        assert missing["code"] == 2 and "acme/nothing" in missing["error"]
        n = len(hub.requests)
        bare = served_in(env | {"RIDGEFILL_RELEASE": "acme/tiny"})  # no such folder here: refused, not fetched
        assert bare["code"] == 2 and "no such folder" in bare["error"] and "hf://acme/tiny" in bare["error"]
        assert not hub.requests_since(n)
    gone = served_in(env)  # the server is down: the copy pulled before
    assert gone == first
    fresh = served_in(env | {"RIDGEFILL_CACHE": str(tmp_path / "empty")})
    assert fresh["code"] == 1 and hub.url in fresh["error"]
