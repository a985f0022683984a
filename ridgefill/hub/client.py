"""What every conversation with the Hugging Face Hub shares: where it is, whether to go there, the token, the
progress bars, and the one mapping of its failures to one-line ridgefill errors (`hub_errors`).

The environment is read when a command runs, not when huggingface_hub is imported (its `constants` module freezes
the variables at import): `HF_ENDPOINT` is passed explicitly, `HF_TOKEN` is read by `get_token()` at call time,
and `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) decides here whether the Hub is contacted at all. The token is
never printed or written: it is scrubbed from every message.

Failures, for model downloads, push and pull alike (exit code in brackets):
- a missing repo, revision or gated access, a refused token (401) or access (403), a snapshot that is not (or
  only partly) cached while HF_HUB_OFFLINE is set (push and pull keep no cache: HF_HUB_OFFLINE alone refuses
  them) [2]: what was asked, or the user's own setting, must change;
- an unreachable Hub (with nothing, or only part of the snapshot, cached, for a model download), the Hub's other
  errors, a branch that moved during a push or a download [1]: the same command may work when it is run again.

huggingface_hub is imported inside the functions (`import ridgefill` stays light).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

from ridgefill import environment
from ridgefill.errors import BadInput, RidgefillError

DEFAULT_ENDPOINT = environment.DEFAULTS[environment.HF_ENDPOINT]
DEFAULT_REVISION = "main"
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# A revision as git allows a ref name (git check-ref-format), which is what the Hub accepts: no part of it that is
# empty or starts with "." (so never "." or ".."), no "..", "@{" or part ending ".lock", no blank, control character or
# ~^:?*[\, not "@" alone. A revision is also a path under every cache keyed by it (huggingface_hub's refs/<rev>,
# ridgefill's release cache), which these rules keep inside its folder.
REVISION = re.compile(r"(?!@\Z)(?!.*(?:\.\.|@\{|//|/\.|\.lock(?:/|\Z)))(?![./])[^\x00-\x20~^:?*\[\\\x7f]+(?<![./])\Z")
LOGIN = "set HF_TOKEN or run `hf auth login`"
_TRUE = {"1", "ON", "YES", "TRUE"}


def endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub.constants.ENDPOINT is frozen at import)."""
    return environment.get(environment.HF_ENDPOINT).rstrip("/")


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as it is now, with huggingface_hub's notion of true."""
    value = environment.get(environment.HF_HUB_OFFLINE) or environment.get(environment.TRANSFORMERS_OFFLINE)
    return value.upper() in _TRUE


def offline_variable() -> str:
    """The variable that makes `offline()` true, for messages: HF_HUB_OFFLINE unless only TRANSFORMERS_OFFLINE is."""
    hub, transformers = environment.HF_HUB_OFFLINE, environment.TRANSFORMERS_OFFLINE
    return hub if environment.get(hub) or not environment.get(transformers) else transformers


def token(given: str | None = None) -> str | None:
    """The token to send: `given`, else what huggingface_hub would send (HF_TOKEN, then `hf auth login`'s file)."""
    if given:
        return given
    from huggingface_hub import get_token

    try:
        return get_token()
    except Exception:  # e.g. a failed OIDC exchange: let the request itself report it
        return None


def cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub.constants freezes HF_HUB_CACHE
    when it is first imported; reading the variables here, same precedence, lets a caller change them later)."""
    e = environment
    hf_home = e.get(e.HF_HOME) or os.path.join(e.get(e.XDG_CACHE_HOME), "huggingface")
    cache = e.get(e.HF_HUB_CACHE) or e.get(e.HUGGINGFACE_HUB_CACHE) or os.path.join(hf_home, "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.match(repo_id or "") or ".." in repo_id or "--" in repo_id or repo_id.endswith((".git", ".")):
        raise BadInput(f"{repo_id!r} is not a Hub repo id (OWNER/NAME)")


def revision_problem(revision: str) -> str | None:
    """Why `revision` cannot name a Hub revision (`REVISION`), as a phrase; None when it can."""
    if isinstance(revision, str) and REVISION.match(revision):
        return None
    return f"{revision!r} is not a revision name (a branch, tag or commit sha, as git spells a ref)"


@contextlib.contextmanager
def session(offline_now: bool = False):
    """huggingface_hub as ridgefill wants it for the duration: HF_HUB_OFFLINE as it is now (`constants.
    HF_HUB_OFFLINE` is read once, at import, and checked by every request), and its transfer bars only where
    ridgefill draws its own progress (a terminal, no -q); an explicit HF_HUB_DISABLE_PROGRESS_BARS wins. Both are
    restored afterwards."""
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = offline_now
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


def network_cause(e: BaseException | None) -> BaseException | None:
    """The transport failure (no connection, timeout, DNS) in an exception's chain, from httpx/httpx2/requests
    or the standard library; None if there is none."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, ConnectionError) or names & {"TransportError", "Timeout", "ConnectTimeout"}:
            return e
        e = e.__cause__ or e.__context__
    return None


def first_line(e: BaseException) -> str:
    text = (getattr(e, "server_message", None) or str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


def incomplete(where: str, cache: Path | None, offline_now: bool, missing: str | None = None) -> RidgefillError:
    """A cached snapshot that lacks files it needs: bad input while HF_HUB_OFFLINE is set (the user's setting must
    change), a failure when the Hub cannot be reached (the same command works once it answers)."""
    what = f"{where}: the cached snapshot in {cache} is incomplete" + (f" ({missing} is missing)" if missing else "")
    if offline_now:
        return BadInput(f"{what} and HF_HUB_OFFLINE is set; run again with network access to finish the download")
    return RidgefillError(f"{what} and the Hub at {endpoint()} cannot be reached; run again when it answers to finish "
                          "the download")


@contextlib.contextmanager
def hub_errors(repo_id: str, where: str, token: str | None, *, cache: Path | None = None,
               offline_now: bool = False, unreachable=lambda: None):
    """Turn huggingface_hub and transport failures into one-line ridgefill errors that never contain the token.

    `where` names what was asked for (`owner/name` or `owner/name@rev`); `cache` is the Hugging Face cache a
    download reads when the Hub cannot be reached; `unreachable()` the transport failure seen before the one being
    mapped, if any (a download that fell back to the cache)."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    at = endpoint()

    def clean(msg: str) -> str:
        return msg.replace(token, "***") if token else msg

    try:
        yield
    except RidgefillError as e:
        raise type(e)(clean(str(e))) from None
    except RevisionNotFoundError:
        raise BadInput(f"{where}: revision not found on {at}") from None
    except GatedRepoError as e:
        if e.response is not None and e.response.status_code == 403:
            raise BadInput(f"{repo_id} is a gated repository on {at} and the token's account has no access to it: "
                           f"request access at {at}/{repo_id}") from None
        raise BadInput(f"{repo_id} is a gated repository on {at}: request access at {at}/{repo_id}, then "
                       f"{LOGIN}") from None
    except RepositoryNotFoundError:
        if token:
            raise BadInput(f"{repo_id}: repository not found on {at}, or the token has no access to it") from None
        raise BadInput(f"{repo_id}: repository not found on {at}; if it is private, {LOGIN}") from None
    except IncompleteSnapshotError:
        raise incomplete(where, cache, offline_now) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        cached = f" and {where} is not in the local Hugging Face cache ({cache})" if cache is not None else ""
        if offline_now:
            if cache is None:
                raise BadInput(f"{where}: {offline_variable()} is set, and this needs the Hub at {at}; unset it "
                               "to go on") from None
            raise BadInput(f"{where} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
                           "unset HF_HUB_OFFLINE to download it") from None
        cause = unreachable() or network_cause(e) or e
        raise RidgefillError(f"cannot reach the Hub at {at} ({type(cause).__name__}: {clean(first_line(cause))})"
                             f"{cached}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise BadInput(f"{repo_id}: the Hub at {at} refused the token (401: {clean(first_line(e))}); {LOGIN} "
                           "with a valid token") from None
        if status == 403:
            raise BadInput(f"{repo_id}: the Hub at {at} refused access (403: {clean(first_line(e))}); check the "
                           f"token's permissions ({LOGIN})") from None
        if status == 412:
            raise RidgefillError(f"{where} moved while pushing; run push again") from None
        raise RidgefillError(f"Hub error {status} at {at} for {where}: {clean(first_line(e))}") from None
    except HFValidationError as e:
        raise BadInput(f"'{where}': {clean(first_line(e))}") from None
    except Exception as e:
        cause = network_cause(e)
        if cause is not None:
            raise RidgefillError(f"cannot reach the Hub at {at} ({type(cause).__name__}: "
                                 f"{clean(first_line(cause))}) for {where}") from None
        if type(e).__module__.startswith("huggingface_hub"):
            raise RidgefillError(f"Hub client error at {at} for {where}: {type(e).__name__}: "
                                 f"{clean(first_line(e))}") from None
        raise
