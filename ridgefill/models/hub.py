"""Download a Hub model spec `owner/name[@revision]` into the Hugging Face cache, as transformers users expect.

`download_snapshot(spec)` fetches, with `huggingface_hub.snapshot_download` into the normal cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), exactly what loading the model needs and
nothing else: `config.json`, `generation_config.json`, the tokenizer files (`spec.TOKENIZER_FILES`) and the
safetensors weights (`*.safetensors`, `*.safetensors.index.json`), all at the top level of the repo. Pickle
formats (`*.bin`, `*.pt`, `*.pth`, `*.pkl`, `*.ckpt`, ...) are never downloaded, and a repo without top-level
safetensors weights is refused before any file is fetched. Files already in the cache are not fetched again.

The environment is read when a spec is resolved, not when huggingface_hub is imported (its `constants` module
freezes the variables at import): `HF_ENDPOINT` and the cache folder are passed explicitly, `HF_TOKEN` is read
by `get_token()` at call time, and `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) decides here whether the Hub is
contacted at all. Offline, or when the Hub cannot be reached, a snapshot already in the cache is used as it is
(as transformers does); otherwise the failure is one line. The commit a revision resolves to is the name of the
snapshot folder, and that 40-hex sha is what `ModelRef.revision` records.

Refusals (BadInput, exit 2) name the repo and what to do: a repo that does not exist (or is private and the
token cannot see it), a gated repo without access, a refused token, an unknown revision, no safetensors weights,
offline without a cached snapshot. An unreachable Hub with nothing cached is a failure (exit 1) naming the
endpoint. The token is never printed or written: it is scrubbed from every message.

huggingface_hub is imported inside the functions (`import ridgefill` stays light).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

from ridgefill.errors import BadInput, RidgefillError
from ridgefill.export.hub import _network_cause  # one reading of transport failures for push, pull and downloads

DEFAULT_ENDPOINT = "https://huggingface.co"
# What snapshot_download may fetch: huggingface_hub matches these with fnmatch, where `*` also crosses "/", so the
# top-level rule is the ignore pattern "*/*". The tokenizer patterns cover spec.TOKENIZER_FILES.
ALLOW_PATTERNS = [
    "config.json", "generation_config.json",
    "*.safetensors", "*.safetensors.index.json",
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "spiece.model",
    "chat_template.jinja", "chat_template.json", "*.tiktoken",
]  # fmt: skip
# Never fetched, even where an allow pattern would match (say `tokenizer.pt`): pickles, other frameworks' weights.
NEVER = ["*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt", "*.joblib", "*.h5", "*.msgpack", "*.npy", "*.npz"]
IGNORE_PATTERNS = ["*/*", *NEVER]
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub.constants.ENDPOINT is frozen at import)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as it is now, with huggingface_hub's notion of true."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def has_safetensors(names) -> bool:
    """Whether top-level file names include safetensors weights."""
    return any("/" not in n and n.endswith(".safetensors") for n in names)


def download_snapshot(spec: str, cache: Path) -> tuple[str, Path]:
    """Fetch what loading `owner/name[@revision]` needs into `cache`; returns (repo_id, snapshot folder)."""
    repo_id, at, revision = spec.partition("@")
    if at and not revision:
        raise BadInput(f"'{spec}': empty revision after '@'")
    revision = revision or None
    endpoint, offline = hub_endpoint(), hub_offline()

    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

    token = _token()
    where = f"{repo_id}@{revision}" if revision else repo_id
    unreachable: BaseException | None = None
    with _errors(spec, repo_id, where, endpoint, cache, token, offline, lambda: unreachable), _hub_state(offline):
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
                if _network_cause(e) is None:
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
    if not COMMIT_SHA.match(snapshot.name):
        raise RidgefillError(f"{where}: the Hugging Face cache returned {snapshot}, which is not a commit snapshot")
    if not has_safetensors(p.name for p in snapshot.iterdir() if p.is_file()):
        raise BadInput(_no_safetensors(repo_id, revision, snapshot.name))
    return repo_id, snapshot


def _no_safetensors(repo_id: str, revision: str | None, sha: str | None) -> str:
    at = f"@{revision}" if revision else ""
    commit = f" (commit {sha[:12]})" if sha and sha != revision else ""
    return (f"{repo_id}{at}{commit} has no safetensors weights at the top level; ridgefill downloads only "
            "*.safetensors, never pickle files such as *.bin")


def _token() -> str | None:
    """The token huggingface_hub would send (HF_TOKEN, then `hf auth login`'s file); used to scrub messages."""
    from huggingface_hub import get_token

    try:
        return get_token()
    except Exception:  # e.g. a failed OIDC exchange: let the request itself report it
        return None


@contextlib.contextmanager
def _hub_state(offline: bool):
    """Make huggingface_hub see HF_HUB_OFFLINE as it is now, and draw its bars only on a terminal.

    `constants.HF_HUB_OFFLINE` is read from the environment once, at import; every request checks it. Progress
    bars follow ridgefill's rule for its own progress (plain in CI logs); an explicit
    HF_HUB_DISABLE_PROGRESS_BARS wins. Both are restored afterwards.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = offline
    toggle = (constants.HF_HUB_DISABLE_PROGRESS_BARS is None and not are_progress_bars_disabled()
              and not _stderr_is_terminal())
    if toggle:
        disable_progress_bars()
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
        if toggle:
            enable_progress_bars()


def _stderr_is_terminal() -> bool:
    """Whether progress may be drawn on stderr: a terminal, and no -q/--quiet."""
    from ridgefill.output import is_quiet

    if is_quiet():
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _first_line(e: BaseException) -> str:
    text = (getattr(e, "server_message", None) or str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def _errors(spec: str, repo_id: str, where: str, endpoint: str, cache: Path, token: str | None, offline: bool,
            unreachable):
    """Turn huggingface_hub failures into one-line ridgefill errors that never contain the token."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    def clean(msg: str) -> str:
        return msg.replace(token, "***") if token else msg

    login = "set HF_TOKEN or run `hf auth login`"
    try:
        yield
    except RidgefillError as e:
        raise type(e)(clean(str(e))) from None
    except RevisionNotFoundError:
        raise BadInput(f"{where}: revision not found on {endpoint}") from None
    except GatedRepoError as e:
        if e.response is not None and e.response.status_code == 403:
            raise BadInput(f"{repo_id} is a gated repository on {endpoint} and the token's account has no access "
                           f"to it: request access at {endpoint}/{repo_id}") from None
        raise BadInput(f"{repo_id} is a gated repository on {endpoint}: request access at {endpoint}/{repo_id}, "
                       f"then {login}") from None
    except RepositoryNotFoundError:
        if token:
            raise BadInput(f"{repo_id}: repository not found on {endpoint}, or the token has no access to it") from None
        raise BadInput(f"{repo_id}: repository not found on {endpoint}; if it is private, {login}") from None
    except IncompleteSnapshotError:
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub at {endpoint} cannot be reached"
        raise BadInput(f"{where}: the cached snapshot in {cache} is incomplete and {why}; run again with network "
                       "access to finish the download") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        if offline:
            raise BadInput(f"{where} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
                           "unset HF_HUB_OFFLINE to download it") from None
        cause = unreachable() or _network_cause(e) or e
        raise RidgefillError(f"cannot reach the Hub at {endpoint} ({type(cause).__name__}: "
                             f"{clean(_first_line(cause))}) and {where} is not in the local Hugging Face cache "
                             f"({cache})") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise BadInput(f"{repo_id}: the Hub at {endpoint} refused the token (401: {clean(_first_line(e))}); "
                           f"{login} with a valid token") from None
        if status == 403:
            raise BadInput(f"{repo_id}: the Hub at {endpoint} refused access (403: {clean(_first_line(e))}); "
                           f"check the token's permissions ({login})") from None
        raise RidgefillError(f"Hub error {status} at {endpoint} for {where}: {clean(_first_line(e))}") from None
    except HFValidationError as e:
        raise BadInput(f"'{spec}': {clean(_first_line(e))}") from None
    except Exception as e:
        cause = _network_cause(e)
        if cause is not None:
            raise RidgefillError(f"cannot reach the Hub at {endpoint} ({type(cause).__name__}: "
                                 f"{clean(_first_line(cause))}) while downloading {where}") from None
        if type(e).__module__.startswith("huggingface_hub"):
            raise RidgefillError(f"Hub client error at {endpoint} for {where}: {type(e).__name__}: "
                                 f"{clean(_first_line(e))}") from None
        raise
