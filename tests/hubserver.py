"""A small Hugging Face Hub-compatible HTTP server for the push/pull tests (no network, no new dependencies).

It implements, for model repos, the endpoints that `huggingface_hub`'s own client code calls for
`create_repo`, `repo_info`, `list_repo_refs`, `create_branch`, `list_repo_tree`, `create_commit` (preupload,
README YAML validation, the git-LFS batch/upload/verify protocol, the NDJSON commit) and `hf_hub_download`
(HEAD + GET on /resolve/, with the headers the client requires). Everything is kept in memory and served
back, so tests can assert on what arrived:

    hub = HubServer(tokens={"hf_write": Token("alice", orgs=("acme",))})
    with hub:                       # two listeners: the Hub API and a "CDN" on another origin
        env["HF_ENDPOINT"] = hub.url
        ...
        hub.read("acme/maps", "maps.safetensors")   # stored bytes at a revision
        hub.history("acme/maps")                     # commit shas of a branch, newest first
        hub.requests                                 # every request: server, method, path, headers, body

Storage is git-shaped: a commit maps paths to entries {oid (git blob sha1), size, lfs sha256}; regular file
contents and LFS pointer files are git objects keyed by their git sha1, LFS contents live in a per-repo LFS
store keyed by sha256 (served by the CDN listener through signed URLs, as the Hub serves them from S3).
Commit shas are real git commit ids over real git tree objects, and every commit is kept, so an old sha can
still be resolved and downloaded. New repos start with the Hub's system "initial commit" holding
`.gitattributes`; preupload answers "lfs" for paths it marks `filter=lfs` (and for binary or >= 10 MiB
files), "regular" otherwise. Xet is not offered: clients must run with HF_HUB_DISABLE_XET=1.

Model downloads (`snapshot_download`: repo info with `sha` and `siblings`, the recursive tree listing with LFS
metadata, then HEAD + GET per file) use the same endpoints. Access follows the Hub: a private repo is invisible
(401 anonymous, 404 with a token of another namespace); a gated repo (`create_repo(..., gated=True)`) shows its
info and file listing to anyone, but its files answer 401 `GatedRepo` without a token and 403 `GatedRepo` to a
user who was not granted access (`grant`); its own namespace always has access. `tag` adds a tag.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_THRESHOLD = 10 * 1024 * 1024
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in ("*.7z", "*.bin", "*.ckpt", "*.gguf", "*.gz", "*.h5", "*.npy", "*.npz", "*.onnx", "*.pt",
                    "*.pth", "*.safetensors", "*.tar", "*.zip", "*.zst")
).encode()


@dataclass(frozen=True)
class Token:
    """Who a bearer token belongs to: the user, the organisations they may write to, and the token's role."""

    user: str
    orgs: tuple[str, ...] = ()
    write: bool = True


@dataclass(frozen=True)
class Entry:
    oid: str  # git blob sha1 of the stored object (the content, or the LFS pointer file)
    size: int  # size of the file's content
    lfs: str | None = None  # sha256 of the content for an LFS file
    pointer_size: int | None = None


@dataclass
class Commit:
    sha: str
    parent: str | None
    files: dict[str, Entry]
    summary: str
    description: str
    author: str
    date: float


@dataclass
class Repo:
    id: str
    private: bool
    created: float
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    objects: dict[str, bytes] = field(default_factory=dict)  # git sha1 -> bytes
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes (verified LFS uploads)
    gated: bool = False  # files need a granted user (info and listings stay public, as on the Hub)
    granted: set[str] = field(default_factory=set)  # users granted access to a gated repo


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.body = body or {}


def git_sha1(kind: str, data: bytes) -> str:
    return hashlib.sha1(f"{kind} {len(data)}\0".encode() + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _tree_sha(files: dict[str, Entry]) -> str:
    """The git tree id of a flat {path: entry} map (nested trees built from the paths)."""
    children: dict[str, dict] = {}
    blobs: dict[str, str] = {}
    for path, entry in files.items():
        head, _, rest = path.partition("/")
        if rest:
            children.setdefault(head, {})[rest] = entry
        else:
            blobs[head] = entry.oid
    items = [(name, b"100644", oid) for name, oid in blobs.items()]
    items += [(name, b"40000", _tree_sha(sub)) for name, sub in children.items()]
    # git orders tree entries by name, a subtree's name compared as if it ended with "/"
    items.sort(key=lambda it: it[0].encode() + (b"/" if it[1] == b"40000" else b""))
    return git_sha1("tree", b"".join(mode + b" " + name.encode() + b"\0" + bytes.fromhex(oid)
                                     for name, mode, oid in items))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))


class HubServer:
    def __init__(self, tokens: dict[str, Token] | None = None, page_size: int = 1000):
        self.tokens = dict(tokens or {})
        self.page_size = page_size
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict] = []
        self.lock = threading.RLock()
        self._secret = os.urandom(16)
        self._pending: dict[tuple[str, str], bytes] = {}  # (repo, sha256) -> bytes PUT to the CDN, not yet verified
        self._servers: list[ThreadingHTTPServer] = []

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> "HubServer":
        for role in ("hub", "cdn"):
            handler = type(f"{role.title()}Handler", (_Handler,), {"hub": self, "role": role})
            srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            self._servers.append(srv)
        self.url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self._servers[1].server_address[1]}"
        return self

    def stop(self) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        self._servers.clear()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --------------------------------------------------------------------------------- helpers for tests

    def repo(self, repo_id: str) -> Repo:
        return self.repos[repo_id]

    def resolve(self, repo_id: str, revision: str = "main") -> Commit:
        repo = self.repos[repo_id]
        return repo.commits[self._resolve(repo, revision)]

    def history(self, repo_id: str, branch: str = "main") -> list[str]:
        """Commit shas reachable from a branch head, newest first."""
        with self.lock:
            repo, out = self.repos[repo_id], []
            sha: str | None = repo.branches[branch]
            while sha is not None:
                out.append(sha)
                sha = repo.commits[sha].parent
            return out

    def read(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        """The stored bytes of a file at a revision (what a download would serve)."""
        with self.lock:
            repo = self.repos[repo_id]
            entry = repo.commits[self._resolve(repo, revision)].files[path]
            return repo.lfs[entry.lfs] if entry.lfs else repo.objects[entry.oid]

    def tamper(self, repo_id: str, path: str, change, revision: str = "main") -> None:
        """Replace the stored bytes of a file by `change(bytes)` without touching any metadata (oid, size,
        ETag): storage corruption, or a malicious mirror."""
        with self.lock:
            repo = self.repos[repo_id]
            entry = repo.commits[self._resolve(repo, revision)].files[path]
            store, key = (repo.lfs, entry.lfs) if entry.lfs else (repo.objects, entry.oid)
            store[key] = change(store[key])

    def create_repo(self, repo_id: str, private: bool = False, gated: bool = False) -> Repo:
        """A new repo holding the Hub's system commit (what POST /api/repos/create does)."""
        with self.lock:
            repo = Repo(repo_id, private=private, created=time.time(), gated=gated)
            self.repos[repo_id] = repo
            self._commit(repo, "main", {".gitattributes": self._store_regular(repo, DEFAULT_GITATTRIBUTES)},
                         "initial commit", "", "system")
            return repo

    def put_files(self, repo_id: str, files: dict[str, bytes | None], branch: str = "main",
                  message: str = "server-side edit") -> str:
        """Commit directly (bypassing HTTP), storing each file the way an upload would (LFS when
        .gitattributes says so or it is binary, regular otherwise); None deletes a file."""
        with self.lock:
            repo = self.repos[repo_id]
            new = dict(repo.commits[repo.branches[branch]].files)
            for path, data in files.items():
                if data is None:
                    del new[path]
                elif self._wants_lfs(repo, new, path, len(data), data[:512]):
                    repo.lfs[hashlib.sha256(data).hexdigest()] = data
                    new[path] = self._store_lfs(repo, hashlib.sha256(data).hexdigest())
                else:
                    new[path] = self._store_regular(repo, data)
            return self._commit(repo, branch, new, message, "", "server")

    def grant(self, repo_id: str, user: str) -> None:
        """Give a user access to a gated repo (what accepting its conditions does)."""
        with self.lock:
            self.repos[repo_id].granted.add(user)

    def tag(self, repo_id: str, name: str, revision: str = "main") -> str:
        """Tag the commit a revision resolves to; returns that commit's sha."""
        with self.lock:
            repo = self.repos[repo_id]
            sha = self._resolve(repo, revision)
            repo.tags[name] = sha
            return sha

    def requests_since(self, n: int) -> list[dict]:
        with self.lock:
            return list(self.requests[n:])

    # ------------------------------------------------------------------------------------------ internals

    def _resolve(self, repo: Repo, rev: str) -> str:
        if rev in repo.branches:
            return repo.branches[rev]
        if rev in repo.tags:
            return repo.tags[rev]
        if rev in repo.commits:
            return rev
        raise HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _store_regular(self, repo: Repo, data: bytes) -> Entry:
        oid = git_sha1("blob", data)
        repo.objects[oid] = data
        return Entry(oid=oid, size=len(data))

    def _store_lfs(self, repo: Repo, sha256: str) -> Entry:
        """The entry of an LFS file whose content is already in the LFS store: git keeps its pointer file."""
        pointer = lfs_pointer(sha256, len(repo.lfs[sha256]))
        oid = self._store_regular(repo, pointer).oid
        return Entry(oid=oid, size=len(repo.lfs[sha256]), lfs=sha256, pointer_size=len(pointer))

    def _wants_lfs(self, repo: Repo, files: dict[str, Entry], path: str, size: int, sample: bytes) -> bool:
        """The Hub's upload-mode rule: LFS for paths .gitattributes marks filter=lfs, binary or large files."""
        entry = files.get(".gitattributes")
        attrs = b"" if entry is None else repo.objects[entry.oid]
        patterns = [line.split()[0] for line in attrs.decode(errors="replace").splitlines()
                    if "filter=lfs" in line.split()[1:]]
        name = path.rsplit("/", 1)[-1]
        return (size >= LFS_THRESHOLD or b"\0" in sample
                or any(fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(path, pat) for pat in patterns))

    def _commit(self, repo: Repo, branch: str, files: dict[str, Entry], summary: str, description: str,
                author: str) -> str:
        parent = repo.branches.get(branch)
        now = time.time()
        message = summary + (f"\n\n{description}" if description else "")
        body = f"tree {_tree_sha(files)}\n" + (f"parent {parent}\n" if parent else "")
        body += f"author {author} <{author}@hub.local> {int(now)} +0000\n"
        body += f"committer {author} <{author}@hub.local> {int(now)} +0000\n\n{message}\n"
        sha = git_sha1("commit", body.encode())
        repo.commits[sha] = Commit(sha, parent, dict(files), summary, description, author, now)
        repo.branches[branch] = sha
        return sha

    def _sign(self, path: str) -> str:
        return hmac.new(self._secret, path.encode(), hashlib.sha256).hexdigest()

    def _signed(self, path: str) -> str:
        return f"{self.cdn_url}{path}?X-Signature={self._sign(path)}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stalls
    hub: HubServer
    role: str

    def log_message(self, format, *args):  # silence the default stderr access log
        pass

    # One entry point for every method: read the request, log it, route it, answer.
    def do_GET(self):
        self._handle()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def _handle(self) -> None:
        split = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        self.body = self._read_body()
        self.segments = [unquote(s) for s in split.path.split("/")[1:]]
        with self.hub.lock:
            self.hub.requests.append({"server": self.role, "method": self.command, "path": unquote(split.path),
                                      "query": dict(self.query), "body": self.body,
                                      "headers": {k.lower(): v for k, v in self.headers.items()}})
        try:
            with self.hub.lock:
                status, body, headers = (self._route_hub() if self.role == "hub" else self._route_cdn())
        except HttpError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            status, body = e.status, json.dumps({"error": e.message, **e.body}).encode()
            headers.setdefault("Content-Type", "application/json")
        self._send(status, body, headers)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes, headers: dict) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, data, status: int = 200, headers: dict | None = None):
        return status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})}

    def _payload(self) -> dict:
        try:
            return json.loads(self.body or b"{}")
        except ValueError:
            raise HttpError(400, "Invalid JSON body") from None

    # -------------------------------------------------------------------------------------------- auth

    def _user(self) -> Token | None:
        auth = self.headers.get("Authorization")
        if auth is None:
            return None
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or token not in self.hub.tokens:
            raise HttpError(401, "Invalid credentials in Authorization header")
        return self.hub.tokens[token]

    def _readable(self, repo_id: str) -> Repo:
        user = self._user()
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self._may_write_ns(user, repo_id)):
            # The Hub does not reveal private repos: 401 when anonymous, 404 otherwise.
            raise HttpError(401 if user is None else 404, "Repository not found", "RepoNotFound")
        return repo

    def _may_write_ns(self, user: Token | None, repo_id: str) -> bool:
        ns = repo_id.split("/")[0]
        return user is not None and (ns == user.user or ns in user.orgs)

    def _downloadable(self, repo_id: str) -> Repo:
        """A repo whose files may be downloaded: readable, and for a gated repo, granted (the Hub's answers)."""
        user = self._user()
        repo = self._readable(repo_id)
        if repo.gated and not (self._may_write_ns(user, repo_id) or (user is not None and user.user in repo.granted)):
            if user is None:
                raise HttpError(401, f"Access to model {repo_id} is restricted. You must have access to it and be "
                                     "authenticated to access it. Please log in.", "GatedRepo")
            raise HttpError(403, f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                                 f"Visit {self.hub.url}/{repo_id} to ask for access.", "GatedRepo")
        return repo

    def _writable(self, repo_id: str) -> Repo:
        user = self._user()
        if user is None:
            raise HttpError(401, "You must be authenticated to write to a repository")
        repo = self._readable(repo_id)
        if not (user.write and self._may_write_ns(user, repo_id)):
            raise HttpError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    # ------------------------------------------------------------------------------------------ routing

    def _route_hub(self):
        s, m = self.segments, self.command
        if s == ["api", "repos", "create"] and m == "POST":
            return self._create_repo()
        if s == ["api", "validate-yaml"] and m == "POST":
            return self._validate_yaml()
        if len(s) >= 4 and s[:2] == ["api", "models"]:
            repo_id, rest = f"{s[2]}/{s[3]}", s[4:]
            if not rest and m == "GET":
                return self._info(repo_id, "main")
            if len(rest) == 2 and rest[0] == "revision" and m == "GET":
                return self._info(repo_id, rest[1])
            if rest == ["refs"] and m == "GET":
                return self._refs(repo_id)
            if len(rest) == 2 and rest[0] == "branch" and m == "POST":
                return self._create_branch(repo_id, rest[1])
            if len(rest) >= 2 and rest[0] == "tree" and m == "GET":
                return self._tree(repo_id, rest[1], "/".join(rest[2:]))
            if len(rest) == 2 and rest[0] == "preupload" and m == "POST":
                return self._preupload(repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "commit" and m == "POST":
                return self._commit(repo_id, rest[1])
        if len(s) == 6 and s[1].endswith(".git") and s[2:5] == ["info", "lfs", "objects"] and m == "POST":
            repo_id = f"{s[0]}/{s[1][:-4]}"
            if s[5] == "batch":
                return self._lfs_batch(repo_id)
            if s[5] == "verify":
                return self._lfs_verify(repo_id)
        if len(s) >= 5 and s[2] == "resolve" and m in ("GET", "HEAD"):
            return self._resolve_file(f"{s[0]}/{s[1]}", s[3], "/".join(s[4:]))
        if len(s) == 4 and s[2] == "commit" and m == "GET":
            repo = self._readable(f"{s[0]}/{s[1]}")
            c = repo.commits.get(s[3])
            if c is None:
                raise HttpError(404, "Commit not found", "RevisionNotFound")
            return self._json({"id": c.sha, "parent": c.parent, "summary": c.summary, "files": sorted(c.files)})
        raise HttpError(404, f"No route for {m} {self.path}")

    def _route_cdn(self):
        s, m = self.segments, self.command
        path = "/" + "/".join(quote(x, safe="") for x in s)
        if not hmac.compare_digest(self.query.get("X-Signature", ""), self.hub._sign(path)):
            raise HttpError(403, "Signature does not match")
        if len(s) == 4 and s[0] == "upload" and m == "PUT":
            self.hub._pending[(f"{s[1]}/{s[2]}", s[3])] = self.body
            return 200, b"", {"ETag": f'"{hashlib.md5(self.body).hexdigest()}"'}
        if len(s) == 4 and s[0] == "blobs" and m in ("GET", "HEAD"):
            data = self.hub.repos[f"{s[1]}/{s[2]}"].lfs[s[3]]
            return self._content(data, {"ETag": f'"{s[3]}"', "Content-Type": "application/octet-stream"})
        raise HttpError(404, f"No route for {m} {self.path}")

    # ------------------------------------------------------------------------------------------- repos

    def _create_repo(self):
        user = self._user()
        if user is None:
            raise HttpError(401, "You must be authenticated to create a repository")
        p = self._payload()
        if p.get("type") not in (None, "model"):
            raise HttpError(400, "Only model repos are served here")
        name, ns = p.get("name"), p.get("organization") or user.user
        if not name:
            raise HttpError(400, "Missing name")
        repo_id = f"{ns}/{name}"
        if not (user.write and self._may_write_ns(user, repo_id)):
            raise HttpError(403, f"You don't have the rights to create a model under the namespace \"{ns}\"")
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            raise HttpError(409, "You already created this model repo", body={"url": url})
        # the Hub's system commit: every new repo starts with a .gitattributes tracking binary formats in LFS
        self.hub.create_repo(repo_id, private=p.get("visibility") == "private" or bool(p.get("private")))
        return self._json({"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})

    def _info(self, repo_id: str, rev: str):
        repo = self._readable(repo_id)
        sha = self.hub._resolve(repo, rev)
        c = repo.commits[sha]
        return self._json({
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": repo_id.split("/")[0], "sha": sha, "private": repo.private, "disabled": False,
            "gated": "manual" if repo.gated else False, "downloads": 0, "likes": 0, "tags": [],
            "createdAt": _iso(repo.created),
            "lastModified": _iso(c.date), "siblings": [{"rfilename": p} for p in sorted(c.files)],
        })

    def _refs(self, repo_id: str):
        repo = self._readable(repo_id)

        def refs(d: dict, kind: str) -> list:
            return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": sha} for n, sha in sorted(d.items())]

        return self._json({"branches": refs(repo.branches, "heads"), "tags": refs(repo.tags, "tags"),
                           "converts": [], "pullRequests": []})

    def _create_branch(self, repo_id: str, branch: str):
        repo = self._writable(repo_id)
        if not branch or branch.startswith("refs/") or ".." in branch:
            raise HttpError(400, f"Invalid reference for a branch: {branch}")
        if branch in repo.branches:
            raise HttpError(409, f"Reference refs/heads/{branch} already exists")
        repo.branches[branch] = self.hub._resolve(repo, self._payload().get("startingPoint") or "main")
        return self._json({})

    def _tree(self, repo_id: str, rev: str, path: str):
        repo = self._readable(repo_id)
        files = repo.commits[self.hub._resolve(repo, rev)].files
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        prefix = f"{path}/" if path else ""
        if path and not any(p.startswith(prefix) for p in files):
            raise HttpError(404, f"{path} does not exist on {rev}", "EntryNotFound")
        entries: dict[str, dict] = {}
        for p in sorted(files):
            if not p.startswith(prefix):
                continue
            parts = p[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                if recursive or depth == 1:
                    d = prefix + "/".join(parts[:depth])
                    sub = {q[len(d) + 1:]: e for q, e in files.items() if q.startswith(d + "/")}
                    entries.setdefault(d, {"type": "directory", "oid": _tree_sha(sub), "size": 0, "path": d})
            if recursive or len(parts) == 1:
                e = files[p]
                item = {"type": "file", "oid": e.oid, "size": e.size, "path": p}
                if e.lfs:
                    item["lfs"] = {"oid": e.lfs, "size": e.size, "pointerSize": e.pointer_size}
                entries[p] = item
        items = [entries[k] for k in sorted(entries)]
        start = int(self.query.get("cursor", 0))
        page, headers = items[start:start + self.hub.page_size], {}
        if start + self.hub.page_size < len(items):
            q = "&".join(f"{k}={v}" for k, v in self.query.items() if k != "cursor")
            nxt = f"{self.hub.url}{urlsplit(self.path).path}?{q}&cursor={start + self.hub.page_size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        return self._json(page, headers=headers)

    # ---------------------------------------------------------------------------------------- uploading

    def _validate_yaml(self):
        import yaml

        content = self._payload().get("content", "")
        if content.startswith("---"):
            end = content.find("\n---", 3)
            if end < 0:
                return self._json({"errors": [{"message": "unterminated YAML front matter"}]}, 400)
            try:
                meta = yaml.safe_load(content[3:end])
            except yaml.YAMLError as e:
                return self._json({"errors": [{"message": f"invalid YAML: {e}"}]}, 400)
            if meta is not None and not isinstance(meta, dict):
                return self._json({"errors": [{"message": "metadata must be a YAML mapping"}]}, 400)
        return self._json({"errors": [], "warnings": []})

    def _preupload(self, repo_id: str, rev: str):
        repo = self._writable(repo_id)
        files = repo.commits[self.hub._resolve(repo, rev)].files
        out = []
        for f in self._payload().get("files", []):
            path, size = f["path"], int(f["size"])
            lfs = self.hub._wants_lfs(repo, files, path, size, base64.b64decode(f.get("sample", "")))
            existing = files.get(path)
            oid = None if existing is None else (existing.lfs or existing.oid)
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return self._json({"files": out, "commitOid": repo.branches.get(rev)})

    def _lfs_batch(self, repo_id: str):
        repo = self._writable(repo_id)
        p = self._payload()
        if p.get("operation") != "upload":
            raise HttpError(400, "only uploads are served by this batch endpoint")
        objects = []
        for o in p.get("objects", []):
            oid, size = o["oid"], int(o["size"])
            item = {"oid": oid, "size": size, "authenticated": True}
            if oid not in repo.lfs:
                ns, name = (quote(x, safe="") for x in repo_id.split("/"))
                path = f"/upload/{ns}/{name}/{oid}"
                item["actions"] = {
                    "upload": {"href": self.hub._signed(path), "expires_in": 900},
                    "verify": {"href": f"{self.hub.url}/{repo_id}.git/info/lfs/objects/verify"},
                }
            objects.append(item)
        return self._json({"transfer": "basic", "objects": objects},
                          headers={"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_verify(self, repo_id: str):
        repo = self._writable(repo_id)
        p = self._payload()
        oid, size = p.get("oid"), p.get("size")
        data = self.hub._pending.pop((repo_id, oid), None)
        if data is None:
            if oid in repo.lfs:
                return self._json({"message": "already present"})
            raise HttpError(404, f"LFS object {oid} was not uploaded")
        if len(data) != size or hashlib.sha256(data).hexdigest() != oid:
            raise HttpError(422, f"LFS object {oid}: uploaded bytes do not match oid/size")
        repo.lfs[oid] = data
        return self._json({"message": "ok"})

    def _commit(self, repo_id: str, rev: str):
        repo = self._writable(repo_id)
        if rev not in repo.branches:
            raise HttpError(404, f"Invalid rev id: {rev} (commits go to a branch)", "RevisionNotFound")
        try:
            lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        except ValueError:
            raise HttpError(400, "Invalid NDJSON body") from None
        if not lines or lines[0].get("key") != "header":
            raise HttpError(400, "The first line must be the commit header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent is not None and parent != repo.branches[rev]:
            raise HttpError(412, "A commit has happened since. Please refresh and try again.")
        if not header.get("summary"):
            raise HttpError(400, "Empty commit summary")
        files = dict(repo.commits[repo.branches[rev]].files)
        for op in lines[1:]:
            key, v = op.get("key"), op.get("value", {})
            path = v.get("path", "")
            if not path or path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
                raise HttpError(400, f"Invalid path: {path!r}")
            if key == "file":
                if v.get("encoding") != "base64":
                    raise HttpError(400, f"{path}: unsupported encoding {v.get('encoding')!r}")
                files[path] = self.hub._store_regular(repo, base64.b64decode(v["content"]))
            elif key == "lfsFile":
                oid = v.get("oid")
                if v.get("algo") != "sha256" or oid not in repo.lfs:
                    raise HttpError(422, f"{path}: LFS object {oid} is not in the LFS store (upload it first)")
                if "size" in v and int(v["size"]) != len(repo.lfs[oid]):
                    raise HttpError(422, f"{path}: LFS size does not match the stored object")
                files[path] = self.hub._store_lfs(repo, oid)
            elif key == "deletedFile":
                if path not in files:
                    raise HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del files[path]
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                gone = [p for p in files if p.startswith(prefix)]
                if not gone:
                    raise HttpError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in gone:
                    del files[p]
            else:
                raise HttpError(400, f"Unknown commit operation {key!r}")
        sha = self.hub._commit(repo, rev, files, header["summary"], header.get("description") or "",
                               self._user().user)
        return self._json({"success": True, "commitOid": sha, "commitUrl": f"{self.hub.url}/{repo_id}/commit/{sha}",
                           "hookOutput": ""})

    # -------------------------------------------------------------------------------------- downloading

    def _resolve_file(self, repo_id: str, rev: str, path: str):
        repo = self._downloadable(repo_id)
        sha = self.hub._resolve(repo, rev)
        entry = repo.commits[sha].files.get(path)
        if entry is None:
            raise HttpError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": sha})
        if entry.lfs:
            # LFS content is served by the CDN (another origin) through a signed URL; the metadata the client
            # needs travels on this redirect: X-Linked-Etag (sha256) and X-Linked-Size.
            ns, name = repo_id.split("/")
            loc = self.hub._signed(f"/blobs/{quote(ns, safe='')}/{quote(name, safe='')}/{entry.lfs}")
            return 302, b"", {"Location": loc, "X-Repo-Commit": sha, "ETag": f'"{entry.oid}"',
                              "X-Linked-Etag": f'"{entry.lfs}"', "X-Linked-Size": entry.size}
        data = repo.objects[entry.oid]
        return self._content(data, {"ETag": f'"{entry.oid}"', "X-Repo-Commit": sha,
                                    "Content-Type": "text/plain; charset=utf-8"})

    def _content(self, data: bytes, headers: dict):
        headers = {"Accept-Ranges": "bytes", **headers}
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and self.command == "GET":
            a, _, b = rng[6:].partition("-")
            start, end = int(a or 0), (int(b) if b else len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return 206, data[start:end + 1], headers
        return 200, data, headers

