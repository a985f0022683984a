"""Download a Hub model spec `owner/name[@revision]` into the Hugging Face cache, as transformers users expect.

`download_snapshot(spec, cache)` fetches, with `huggingface_hub.snapshot_download` into the normal cache
(`client.cache_dir()`: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), exactly what loading
the model needs and nothing else: `config.json`, `generation_config.json`, the tokenizer files
(`ridgefill.models.fingerprint.TOKENIZER_FILES`) and the safetensors weights (`*.safetensors`,
`*.safetensors.index.json`), all at the top level of the repo. Pickle formats (`*.bin`, `*.pt`, `*.pth`, `*.pkl`,
`*.ckpt`, ...) are never downloaded, and a repo without top-level safetensors weights is refused before any file is
fetched. Files already in the cache are not fetched again.

Offline, or when the Hub cannot be reached, a snapshot already in the cache is used as it is (as transformers
does); otherwise the failure is one line (`client.hub_errors`). The commit a revision resolves to is the name of
the snapshot folder, and that 40-hex sha is what `ModelRef.revision` records.
"""

from __future__ import annotations

from pathlib import Path

from ridgefill.errors import BadInput, RidgefillError
from ridgefill.hub import client

# What snapshot_download may fetch: huggingface_hub matches these with fnmatch, where `*` also crosses "/", so the
# top-level rule is the ignore pattern "*/*". The tokenizer patterns cover fingerprint.TOKENIZER_FILES.
ALLOW_PATTERNS = [
    "config.json", "generation_config.json",
    "*.safetensors", "*.safetensors.index.json",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "spiece.model",
    "chat_template.jinja", "chat_template.json", "*.tiktoken",
]  # fmt: skip
# Never fetched, even where an allow pattern would match (say `tokenizer.pt`): pickles, other frameworks' weights.
NEVER = ["*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt", "*.joblib", "*.h5", "*.msgpack", "*.npy", "*.npz"]
IGNORE_PATTERNS = ["*/*", *NEVER]


def has_safetensors(names) -> bool:
    """Whether top-level file names include safetensors weights."""
    return any("/" not in n and n.endswith(".safetensors") for n in names)


def download_snapshot(spec: str, cache: Path) -> tuple[str, Path]:
    """Fetch what loading `owner/name[@revision]` needs into `cache`; returns (repo_id, snapshot folder)."""
    repo_id, at, revision = spec.partition("@")
    if at and not revision:
        raise BadInput(f"'{spec}': empty revision after '@'")
    revision = revision or None
    endpoint, offline = client.endpoint(), client.offline()

    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

    token = client.token()
    where = f"{repo_id}@{revision}" if revision else repo_id
    unreachable: BaseException | None = None
    with client.hub_errors(repo_id, where, token, cache=cache, offline_now=offline, unreachable=lambda: unreachable), \
            client.session(offline):
        if not offline:
            # One look at the repo first, so that a repo without safetensors is refused before anything is fetched.
            # If that look fails, snapshot_download decides, as it does for transformers: an unknown revision is an
            # error, an unreachable Hub (or a refused look at a repo that is cached) falls back to the cache.
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
            else:
                names = [s.rfilename for s in info.siblings or []]
                if info.siblings is not None and not has_safetensors(names):
                    raise BadInput(_no_safetensors(repo_id, revision, info.sha))
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            endpoint=endpoint,
            token=token,
            local_files_only=offline or unreachable is not None,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    snapshot = Path(folder)
    if not client.COMMIT_SHA.match(snapshot.name):
        raise RidgefillError(f"{where}: the Hugging Face cache returned {snapshot}, which is not a commit snapshot")
    if not has_safetensors(p.name for p in snapshot.iterdir() if p.is_file()):
        raise BadInput(_no_safetensors(repo_id, revision, snapshot.name))
    return repo_id, snapshot


def _no_safetensors(repo_id: str, revision: str | None, sha: str | None) -> str:
    at = f"@{revision}" if revision else ""
    commit = f" (commit {sha[:12]})" if sha and sha != revision else ""
    return (f"{repo_id}{at}{commit} has no safetensors weights at the top level; ridgefill downloads only "
            "*.safetensors, never pickle files such as *.bin")
