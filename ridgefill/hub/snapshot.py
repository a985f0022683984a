"""Download a Hub model spec `owner/name[@revision]` into the Hugging Face cache, as transformers users expect.

`download_snapshot(spec, cache)` fetches, with `huggingface_hub.snapshot_download` into the normal cache
(`client.cache_dir()`: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), exactly what loading
the model needs and nothing else: `config.json`, `generation_config.json`, the tokenizer files
(`ridgefill.models.fingerprint.TOKENIZER_FILES`) and ONE set of safetensors weights, all at the top level of the
repo, chosen from the repo's file list the way transformers chooses what it loads (`weight_selection`):

  1. `model.safetensors`, if the repo has it;
  2. else, with `model.safetensors.index.json`: that index (fetched first), then exactly the shard files its
     `weight_map` names;
  3. else every top-level `*.safetensors`.

So a repo that holds sharded weights and also a `consolidated.safetensors` (Mistral's repos do) downloads the
weights once, not twice. Pickle formats (`*.bin`, `*.pt`, `*.pth`, `*.pkl`, `*.ckpt`, ...) are never downloaded,
and a repo without top-level safetensors weights is refused before any file is fetched. Files already in the cache
are not fetched again.

Offline (`HF_HUB_OFFLINE=1`), or when the Hub cannot be reached, a snapshot already in the cache is used as it is
(as transformers does); the same selection is made from the file list huggingface_hub cached with the snapshot and
the cached index, so a snapshot is complete when it holds what an online download fetches. Otherwise the failure
is one line (`client.hub_errors`): nothing (or only part of the snapshot) cached while `HF_HUB_OFFLINE` is set is
bad input (exit 2), the same while the Hub cannot be reached is a failure (exit 1). The commit a revision resolves
to is the name of the snapshot folder, and that 40-hex sha is what `ModelRef.revision` records.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

from ridgefill.errors import BadInput, RidgefillError
from ridgefill.hub import client

SINGLE = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME
INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
# What snapshot_download may fetch besides the weights: huggingface_hub matches these with fnmatch, where `*` also
# crosses "/", so the top-level rule is the ignore pattern "*/*". The tokenizer patterns cover
# fingerprint.TOKENIZER_FILES.
FILE_PATTERNS = [
    "config.json", "generation_config.json",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "spiece.model",
    "chat_template.jinja", "chat_template.json", "*.tiktoken",
]  # fmt: skip
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
# The outer bound of what is ever fetched. A download narrows the weights to the exact files `weight_selection`
# names; these broad patterns are only used when no file list is known (a cache that has none).
ALLOW_PATTERNS = [*FILE_PATTERNS, *WEIGHT_PATTERNS]
# Never fetched, even where an allow pattern would match (say `tokenizer.pt`): pickles, other frameworks' weights.
NEVER = ["*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt", "*.joblib", "*.h5", "*.msgpack", "*.npy", "*.npz"]
IGNORE_PATTERNS = ["*/*", *NEVER]


def has_safetensors(names) -> bool:
    """Whether top-level file names include safetensors weights."""
    return any("/" not in n and n.endswith(".safetensors") for n in names)


def weight_selection(names, read_index, where: str) -> list[str]:
    """The weight files to fetch (and load), from a repo's (or a snapshot folder's) file names, in transformers'
    order of preference: `model.safetensors`; else the index and the shards its weight_map names (`read_index()`
    returns the index's path, fetching it if need be); else every top-level `*.safetensors`."""
    top = {n for n in names if "/" not in n}
    if SINGLE in top:
        return [SINGLE]
    if INDEX in top:
        return [INDEX, *shard_names(read_index(), where)]
    return sorted(n for n in top if n.endswith(".safetensors"))


def shard_names(index: Path, where: str) -> list[str]:
    """The distinct files a `model.safetensors.index.json` maps the tensors to, checked to be top-level
    `*.safetensors` names."""
    try:
        doc = json.loads(Path(index).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{where}: {INDEX} is not valid JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInput(f"{where}: {INDEX} has no weight_map naming the shard files")
    shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
    bad = [v for v in weight_map.values() if not isinstance(v, str)]
    bad += [s for s in shards if "/" in s or "\\" in s or s.startswith(".") or not s.endswith(".safetensors")]
    if bad:
        raise BadInput(f"{where}: {INDEX} maps a tensor to {bad[0]!r}, which is not a top-level *.safetensors file")
    return shards


def download_snapshot(spec: str, cache: Path) -> tuple[str, Path]:
    """Fetch what loading `owner/name[@revision]` needs into `cache`; returns (repo_id, snapshot folder)."""
    repo_id, at, revision = spec.partition("@")
    if at and not revision:
        raise BadInput(f"'{spec}': empty revision after '@'")
    if at and client.revision_problem(revision):  # `..` would name a folder outside the cache's refs/
        raise BadInput(f"'{spec}': {client.revision_problem(revision)}")
    revision = revision or None
    endpoint, offline = client.endpoint(), client.offline()

    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

    token = client.token()
    where = f"{repo_id}@{revision}" if revision else repo_id
    unreachable: BaseException | None = None
    info = sha = None
    with client.hub_errors(repo_id, where, token, cache=cache, offline_now=offline, unreachable=lambda: unreachable), \
            client.session(offline):
        if not offline:
            # One look at the repo first: a repo without safetensors is refused before anything is fetched, and its
            # file list chooses the weights. If that look fails, snapshot_download decides, as it does for
            # transformers: an unknown revision is an error, an unreachable Hub (or a refused look at a repo that
            # is cached) falls back to the cache.
            try:
                info = HfApi(endpoint=endpoint, token=token).repo_info(repo_id, revision=revision)
            except RevisionNotFoundError:
                raise
            except HfHubHTTPError:
                pass
            except Exception as e:
                if client.network_cause(e) is None:
                    raise
                unreachable = e
        sha = info.sha if info is not None else None
        if info is not None and info.siblings is not None and sha:
            names = [s.rfilename for s in info.siblings]
            if not has_safetensors(names):
                raise BadInput(_no_safetensors(repo_id, revision, sha))
            label = _label(repo_id, revision, sha)
            weights = weight_selection(names, lambda: Path(hf_hub_download(  # at the commit the look resolved
                repo_id, INDEX, revision=sha, cache_dir=cache, endpoint=endpoint, token=token)), label)
            unlisted = [w for w in weights if w not in names]
            if unlisted:
                raise BadInput(f"{label}: {INDEX} names {unlisted[0]}, which is not in the repo")
        else:
            weights = _cached_selection(repo_id, revision, cache, where)
        allow = ALLOW_PATTERNS if weights is None else [*FILE_PATTERNS, *(glob.escape(w) for w in weights)]
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            endpoint=endpoint,
            token=token,
            local_files_only=offline or unreachable is not None,
            allow_patterns=allow,
            ignore_patterns=IGNORE_PATTERNS,
        )
    snapshot = Path(folder)
    if not client.COMMIT_SHA.match(snapshot.name):
        raise RidgefillError(f"{where}: the Hugging Face cache returned {snapshot}, which is not a commit snapshot")
    if sha and snapshot.name != sha:  # the branch moved between the look and the download
        raise RidgefillError(f"{where} moved from commit {sha[:12]} to {snapshot.name[:12]} during the download; "
                             "run again")
    present = [p.name for p in snapshot.iterdir() if p.is_file()]  # is_file follows the cache's symlinks
    if not has_safetensors(present):
        raise BadInput(_no_safetensors(repo_id, revision, snapshot.name))
    # Without a cached file list (an older cache), a snapshot cut short keeps only some shards: what the folder's
    # own index names must all be there.
    label = _label(repo_id, revision, snapshot.name)
    missing = [w for w in weight_selection(present, lambda: snapshot / INDEX, label) if w not in present]
    if missing:  # online, snapshot_download fetched everything asked or raised: this is the cache alone
        raise client.incomplete(where, cache, offline, missing[0])
    return repo_id, snapshot


def _cached_selection(repo_id: str, revision: str | None, cache: Path, where: str) -> list[str] | None:
    """The weight selection made from what the cache knows of the repo (no network): the file list huggingface_hub
    keeps with a snapshot, and the snapshot's index. None when the cache has no file list (then every pattern is
    allowed: without a list, huggingface_hub cannot tell a snapshot is incomplete, and fetches nothing)."""
    from huggingface_hub import get_cached_repo_tree, try_to_load_from_cache
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    rev = revision or client.DEFAULT_REVISION
    try:
        names = [f.path for f in get_cached_repo_tree(repo_id, revision=rev, cache_dir=cache)]
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None

    def cached_index() -> Path:
        path = try_to_load_from_cache(repo_id, INDEX, cache_dir=cache, revision=rev)
        if not isinstance(path, str):  # the listed index is not cached: let snapshot_download call it incomplete
            raise _NoIndex
        return Path(path)

    try:
        return weight_selection(names, cached_index, where)
    except _NoIndex:
        return None


class _NoIndex(Exception):
    pass


def _label(repo_id: str, revision: str | None, sha: str | None) -> str:
    at = f"@{revision}" if revision else ""
    commit = f" (commit {sha[:12]})" if sha and sha != revision else ""
    return f"{repo_id}{at}{commit}"


def _no_safetensors(repo_id: str, revision: str | None, sha: str | None) -> str:
    return (f"{_label(repo_id, revision, sha)} has no safetensors weights at the top level; ridgefill downloads only "
            "*.safetensors, never pickle files such as *.bin")
