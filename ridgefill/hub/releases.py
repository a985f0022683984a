"""Publish a release folder (`ridgefill-maps/2`, docs/format.md) on the Hugging Face Hub, and fetch one back.

`push(folder, repo_id)` verifies the folder with `ridgefill.formats.release.verify_release` (files, hashes and the facts
maps.safetensors records) before anything leaves the machine,
creates the repo (and the branch) if missing, and uploads the release as ONE commit: an addition for every
file of the release (the manifest's files, ridgefill.json, README.md) and a deletion for every remote file the
release no longer has (`.gitattributes` is kept: the Hub needs it). It is idempotent: the remote branch head
is listed (`list_repo_tree`) and compared with the folder by the hashes git itself keeps — the sha256 of an LFS
file's content (`lfs.sha256`), the git blob sha1 of a regular file (`blob_id`) — so byte-identical remote
content means no commit, whichever way the Hub chose to store each file. The commit names the listed head as
its parent, so a branch that moved in between is refused instead of overwritten.

`pull("owner/name[@rev]", out)` resolves the revision to a commit sha once, downloads ridgefill.json at that
commit, then exactly the files its manifest lists plus README.md (never `.gitattributes` or anything else),
into a temporary sibling folder; it verifies that folder (so a manifest edited on the Hub is refused like
a damaged file) and only then renames it to `out`. A folder fetched with `hf download` instead also verifies
(`release.verify_release` accepts the `.gitattributes` and `.cache/huggingface/` it leaves) and pushes back
unchanged. A fresh,
throw-away download cache is used each time, so what is verified is what the Hub serves now.

`locate_release(value)` is the one rule for naming a release wherever a release is named (eval, engine prefix, push,
the Python loader `load_release_maps`, RIDGEFILL_RELEASE, the bench scripts): `hf://owner/name[@rev]` is a Hub
release, pulled and verified once into `$RIDGEFILL_CACHE/releases` (`pull_cached`) and read from there after;
anything else is a folder, and a missing one is refused without a request (`release/x` typed in the wrong folder is
never fetched from whoever owns that name on the Hub).

huggingface_hub is imported inside the functions (`import ridgefill` stays light). Hub failures become one-line
errors through `ridgefill.hub.client.hub_errors`, the mapping model downloads use too (the token never appears in
a message). The offline rule is theirs as well: with `HF_HUB_OFFLINE` set and nothing cached a model download is
refused as bad input (exit 2), and push and pull, which keep no cache, are refused so before any request; a Hub
that cannot be reached is a failure (exit 1), and nothing is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from urllib.parse import quote

from ridgefill import environment
from ridgefill.errors import BadInput, RidgefillError
from ridgefill.formats import release
from ridgefill.hub import client
from ridgefill.hub.client import DEFAULT_REVISION, check_repo_id

KEEP_REMOTE = frozenset({release.GITATTRIBUTES})  # never deleted by push, never downloaded by pull
HUB = "hf://"  # the prefix that names a Hub release wherever a release is named; anything else is a folder
FORMS = "a release folder, or a Hub release hf://owner/name[@rev]"
CACHE_ENV = environment.RIDGEFILL_CACHE  # the root of the cache `locate_release` pulls Hub releases into


# ------------------------------------------------------------------------------------------------ push


def push(folder: str | Path, repo_id: str, *, revision: str = DEFAULT_REVISION, private: bool = False,
         commit_message: str | None = None, token: str | None = None, out=None) -> dict:
    """Upload a verified release folder as one commit; returns {repo, revision, commit, url, files, unchanged}.
    `folder` is named as everywhere (`locate_release`): a Hub release `hf://owner/name[@rev]` is pulled into the
    release cache and pushed from there (a copy to another repo); a missing folder is refused before any request."""
    folder = locate_release(os.fspath(folder), token=token)
    manifest = release.verify_release(folder)  # BadInput (exit 2) on the first problem; nothing sent yet
    check_repo_id(repo_id)
    _check_branch(revision)
    card = [release.CARD] if (folder / release.CARD).is_file() else []  # documentation: optional
    names = sorted([*manifest["files"], release.MANIFEST, *card])
    local = {name: _hashes(folder / name) for name in names}
    for name in manifest["files"]:  # a file changed since verify_release read it
        if local[name]["sha256"] != manifest["files"][name]:
            raise BadInput(f"{name}: changed while preparing the push (sha256 no longer matches {release.MANIFEST})")

    _check_online("push", f"{repo_id}@{revision}")

    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    token = client.token(token)
    if not token:
        raise RidgefillError("no Hub token: pass --token, set HF_TOKEN or run `hf auth login`")
    api = HfApi(endpoint=client.endpoint(), token=token)
    with client.hub_errors(repo_id, f"{repo_id}@{revision}", token, offline_now=client.offline()), \
            client.session(client.offline()):
        api.create_repo(repo_id, repo_type="model", private=True if private else None, exist_ok=True)
        if private and not getattr(api.repo_info(repo_id), "private", True) and out is not None:
            out.warn(f"{repo_id} already exists and is public; --private only applies when the repo is created")
        head = _branch_head(api, repo_id, revision)
        remote = _remote_files(api, repo_id, head)
        extra = sorted(p for p in remote if p not in local and p not in KEEP_REMOTE)
        if head is not None and not extra and all(_same(local[n], remote.get(n)) for n in names):
            return _pushed(api, repo_id, revision, head, names, unchanged=True, out=out)

        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in names]
        ops += [CommitOperationDelete(path_in_repo=p) for p in extra]
        info = api.create_commit(repo_id, ops, commit_message=commit_message or _default_message(manifest),
                                 revision=revision, parent_commit=head)
        sha = info.oid
        # What the Hub now holds must be what was verified (a file rewritten during the upload would not be).
        after = _remote_files(api, repo_id, sha)
        bad = [n for n in names if not _same(local[n], after.get(n))]
        if bad or any(p not in local and p not in KEEP_REMOTE for p in after):
            raise RidgefillError(f"commit {sha} on {repo_id} does not match the verified release "
                                 f"({', '.join(bad) or 'extra files'}); was the folder modified during the push?")
        return _pushed(api, repo_id, revision, sha, names, unchanged=sha == head, out=out, url=info.commit_url)


def _pushed(api, repo_id: str, revision: str, sha: str, names: list[str], *, unchanged: bool, out,
            url: str | None = None) -> dict:
    url = url or f"{api.endpoint}/{repo_id}/commit/{sha}"
    if out is not None:
        if unchanged:
            out.info(f"unchanged: {repo_id}@{revision} already at {sha}")
        else:
            out.info(f"[bold]push[/bold] {repo_id}@{revision}: {len(names)} file(s) in one commit")
        out.info(url)
    return {"repo": repo_id, "revision": revision, "commit": sha, "url": url, "files": names,
            "unchanged": unchanged}


def _branch_head(api, repo_id: str, revision: str) -> str | None:
    """The commit sha the branch points at, creating the branch (from the default branch) if it is missing."""
    refs = api.list_repo_refs(repo_id)
    branches = {b.name: b.target_commit for b in refs.branches}
    if revision in branches:
        return branches[revision]
    if revision in {t.name for t in refs.tags}:
        raise BadInput(f"--revision {revision} is a tag on {repo_id}; push needs a branch")
    if not branches:  # an empty repo: the commit itself creates the branch
        return None
    api.create_branch(repo_id, branch=revision, exist_ok=True)
    refs = api.list_repo_refs(repo_id)
    return {b.name: b.target_commit for b in refs.branches}[revision]


def _remote_files(api, repo_id: str, sha: str | None) -> dict:
    """{path: RepoFile} of every file at a commit (folders are listed through their files)."""
    if sha is None:
        return {}
    from huggingface_hub.hf_api import RepoFile

    return {f.path: f for f in api.list_repo_tree(repo_id, revision=sha, recursive=True) if isinstance(f, RepoFile)}


def _hashes(path: Path) -> dict:
    """size, sha256 and git blob sha1 of a file, in one read."""
    size = path.stat().st_size
    sha256, git = hashlib.sha256(), hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha256.update(block)
            git.update(block)
    return {"size": size, "sha256": sha256.hexdigest(), "git": git.hexdigest()}


def _same(local: dict, remote) -> bool:
    """Whether a remote RepoFile has exactly the local bytes: LFS files by their sha256, others by git sha1."""
    if remote is None:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == local["sha256"] and remote.lfs.size == local["size"]
    return remote.blob_id == local["git"]


def _default_message(manifest: dict) -> str:
    model = (manifest.get("model") or {}).get("name")
    split = manifest.get("split")
    what = ", ".join(x for x in (model, f"split {split}" if split is not None else None) if x)
    return f"Upload {release.FORMAT} release" + (f" ({what})" if what else "")


# ------------------------------------------------------------------------------------------------ pull


def parse_spec(spec: str) -> tuple[str, str]:
    """`owner/name[@rev]`, or `hf://owner/name[@rev]` as RIDGEFILL_RELEASE names one -> (repo_id, rev); rev defaults
    to main."""
    repo_id, at, rev = spec.removeprefix(HUB).partition("@")
    if at and not rev:
        raise BadInput(f"{spec!r}: empty revision after '@'")
    check_repo_id(repo_id)
    if at and client.revision_problem(rev):  # `..` would name the folder above refs/ in every cache keyed by it
        raise BadInput(f"{spec!r}: {client.revision_problem(rev)}")
    return repo_id, rev or DEFAULT_REVISION


def pull(spec: str, out_dir: Path, *, token: str | None = None, force: bool = False, out=None) -> dict:
    """Download a release into out_dir (verified, atomically); returns {repo, revision, commit, out, files}."""
    repo_id, revision = parse_spec(spec)
    out_dir = Path(out_dir)
    release.check_out_dir(out_dir)  # before any network: a mistyped --out fails fast
    _check_online("pull", f"{repo_id}@{revision}")

    from huggingface_hub import HfApi

    token = client.token(token)
    api = HfApi(endpoint=client.endpoint(), token=token)
    with client.hub_errors(repo_id, f"{repo_id}@{revision}", token, offline_now=client.offline()), \
            client.session(client.offline()):
        sha = api.repo_info(repo_id, revision=revision).sha
        where = f"{repo_id}@{revision}" + ("" if revision == sha else f" (commit {sha[:12]})")
        work = release.sibling(out_dir, "pull")  # a killed pull's is removed by the next (folder.recover)
        try:
            stage = work / "release"
            stage.mkdir()
            fetch = _fetcher(api, repo_id, sha, work / "cache", stage, token, where)
            if not fetch(release.MANIFEST):
                raise BadInput(f"{where}: no {release.MANIFEST} (not a ridgefill release)")
            names = _listed(stage / release.MANIFEST, where)
            for name in names:
                if not fetch(name):
                    raise BadInput(f"{name}: listed in {release.MANIFEST} but missing from {where}")
            fetch(release.CARD)  # documentation: optional, never hashed
            try:
                release.verify_release(stage)
            except BadInput as e:
                raise BadInput(f"{e}; pulled from {where}, nothing written to {out_dir}") from None
            files = sorted(p.name for p in stage.iterdir())
            unchanged = _place(stage, out_dir, force)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if out is not None:
        status = "unchanged, already there" if unchanged else f"{len(files)} file(s) verified"
        out.info(f"[bold]pull[/bold] {where} -> {out_dir}: {status}")
    return {"repo": repo_id, "revision": revision, "commit": sha, "out": str(out_dir), "files": files}


def pull_cached(spec: str, root: Path, *, token: str | None = None) -> Path:
    """A release from the Hub as a verified local folder kept under `root` (what a serving engine reads on every
    start): `<root>/<owner>--<name>/<commit>`, with `refs/<revision>` naming the commit a revision resolved to (the
    revision percent-encoded: one file per revision, so branches `a/b` and `a--b` never share one).
    Online, the revision is resolved (one request) and the folder pulled only when that commit is not there yet;
    with HF_HUB_OFFLINE set, or when the Hub cannot be reached, the commit the revision last resolved to is used.
    Nothing cached then: BadInput offline, RidgefillError for an unreachable Hub. The folder is verified by the
    caller's reader like any other; a copy found in the cache is verified here first, so that a damaged one (a
    file edited or cut short since it was pulled) is refused naming the folder to delete: the next run pulls it
    again. That costs one more pass over its files' hashes than the reader's own."""
    repo_id, revision = parse_spec(spec)
    home = Path(root) / repo_id.replace("/", "--")
    ref = home / "refs" / quote(revision, safe="")

    def cached() -> Path | None:
        sha = ref.read_text().strip() if ref.is_file() else revision if client.COMMIT_SHA.match(revision) else None
        return home / sha if sha and client.COMMIT_SHA.match(sha) and (home / sha / release.MANIFEST).is_file() \
            else None

    if client.offline():
        found = cached()
        if found is None:
            raise BadInput(f"{spec}: {client.offline_variable()} is set and the release is not cached in {home}")
        return _intact(found, spec)
    from huggingface_hub import HfApi

    token = client.token(token)
    api = HfApi(endpoint=client.endpoint(), token=token)
    try:
        with client.hub_errors(repo_id, f"{repo_id}@{revision}", token), client.session(False):
            sha = api.repo_info(repo_id, revision=revision).sha
    except RidgefillError as e:
        found = cached()
        if found is None or isinstance(e, BadInput):
            raise
        return _intact(found, spec)  # the Hub cannot be reached: the copy pulled before
    folder = home / sha
    if not (folder / release.MANIFEST).is_file():
        pull(f"{repo_id}@{sha}", folder, token=token, force=True)
    else:
        _intact(folder, spec)
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}")
    tmp.write_text(sha + "\n")
    os.replace(tmp, ref)
    return folder


def _intact(folder: Path, spec: str) -> Path:
    """`folder`, a release cache's copy of the Hub release `spec`, if it still verifies; else BadInput naming the
    folder to delete (the cache is ridgefill's own: nothing else in it is lost, and the next run pulls it again)."""
    try:
        release.verify_release(folder)
    except BadInput as e:
        raise BadInput(f"{e}; in {folder}, the cached copy of {HUB}{spec.removeprefix(HUB)}: delete that folder "
                       "and run again to pull it anew") from None
    return folder


def release_cache() -> Path:
    """Where Hub releases named `hf://...` are kept: `$RIDGEFILL_CACHE/releases` (~/.cache/ridgefill/releases)."""
    return Path(environment.get(CACHE_ENV)).expanduser() / "releases"


def name_problem(value: str) -> str | None:
    """Why `value` names no release, wherever one is named (a command's argument, RIDGEFILL_RELEASE): empty, blanks
    alone, or blanks around a name (a folder ' X' and a folder 'X' are two folders, and no Hub release has blanks:
    neither is guessed); None when it may name one."""
    if not value.strip():
        return f"empty; name {FORMS}"
    if value != value.strip():
        return f"{value!r} has blanks around it; name {FORMS} without them"
    return None


def locate_release(value: str, *, where: str | None = None, cache_root: Path | None = None,
                   token: str | None = None) -> Path:
    """The local folder that a release named by a user stands for, by one rule wherever a release is named (eval,
    engine prefix, push, the Python loader, RIDGEFILL_RELEASE, the bench scripts): `hf://owner/name[@rev]` is pulled
    and verified into `cache_root` (default `release_cache()`) by `pull_cached`, or found there; anything else is a
    folder as written (`~` expanded). A name with blanks around it is refused (`name_problem`), and so is a folder
    that does not exist, never looked up on the Hub (`release/x` typed in the wrong folder is not someone's repo),
    with the hf:// spelling suggested when it reads as owner/name. BadInput in one line starting with `where`
    (default: the value itself)."""
    label = where or value
    problem = name_problem(value)
    if problem is not None:
        raise BadInput(f"{label}: {problem}")
    if value.startswith(HUB):
        spec = value[len(HUB):]
        try:
            parse_spec(spec)  # the Hub's own rule for a repo id, before any request
        except BadInput:
            rev = spec.partition("@")[2]
            problem = client.revision_problem(rev) if rev else None
            raise BadInput(f"{label}: {problem or f'a Hub release is written {HUB}owner/name[@rev]'}") from None
        try:
            return pull_cached(spec, release_cache() if cache_root is None else Path(cache_root), token=token)
        except RidgefillError as e:
            if where is None:
                raise  # the message names the repo already
            raise type(e)(f"{where}: {e}") from None
    path = Path(value).expanduser()
    if not path.exists():
        looks_hub = value.count("/") == 1 and not value.startswith((".", "/", "~"))
        hint = f"; a Hub release is written {HUB}{value}" if looks_hub else ""
        raise BadInput(f"{label}: no such folder ({path.absolute()}){hint}")
    if not path.is_dir():
        raise BadInput(f"{label}: not a folder ({FORMS})")
    return path


def _fetcher(api, repo_id: str, sha: str, cache: Path, stage: Path, token, where: str):
    """fetch(name) downloads one file of the pinned commit into the stage; False when the Hub has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    def fetch(name: str) -> bool:
        try:
            path = hf_hub_download(repo_id, name, revision=sha, cache_dir=cache, token=token,
                                   endpoint=api.endpoint)
        except EntryNotFoundError:
            return False
        except HfHubHTTPError:
            raise
        except OSError as e:
            if "onsistency check failed" in str(e):  # the body's size differs from the Hub's metadata
                raise BadInput(f"{name}: downloaded size does not match the Hub's record for it in {where}") from None
            raise
        os.replace(os.path.realpath(path), stage / name)  # the blob leaves the throw-away cache
        return True

    return fetch


def _listed(manifest_path: Path, where: str) -> list[str]:
    """The manifest's file names, checked to be safe to download before any of them is fetched."""
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{release.MANIFEST}: invalid JSON in {where} ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise BadInput(f"{release.MANIFEST}: 'files' must be a non-empty object in {where}")
    for name in files:
        if not release.is_bare_name(name) or name in release.UNHASHED or name in KEEP_REMOTE:
            raise BadInput(f"{release.MANIFEST}: files entry {name!r} is not a release file name (in {where})")
    return sorted(files)


def _place(stage: Path, out_dir: Path, force: bool) -> bool:
    """Rename the verified stage to out_dir; True if out_dir already held exactly these files (left alone). Under
    `release.out_lock`, as export's copy: a pull or export into the same --out at once waits and then sees it."""
    with release.out_lock(out_dir):
        if out_dir.is_dir() and any(out_dir.iterdir()):
            if release.same_files(out_dir, stage, [p.name for p in stage.iterdir()]):
                return True
            if not force:
                raise BadInput(f"--out {out_dir} holds a different release; pass --force to replace it")
        release.move_into_place(stage, out_dir)  # swap, with the old folder restored if the rename fails
    return False


def _check_online(command: str, where: str) -> None:
    """push and pull talk to the Hub and keep no cache: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) refuses them
    before any request, as bad input (exit 2) -- the user's own setting forbids what was asked, and running again
    changes nothing -- where an unreachable Hub is a failure (exit 1)."""
    if client.offline():
        var = client.offline_variable()
        raise BadInput(f"{where}: {var} is set, and {command} needs the Hub at {client.endpoint()} ({command} keeps "
                       f"no cache); unset {var} to {command}")


def _check_branch(revision: str) -> None:
    if client.revision_problem(revision) or revision.startswith("refs/") or client.COMMIT_SHA.match(revision):
        raise BadInput(f"--revision {revision!r}: push needs a branch name")
