"""A local Hugging Face Hub-compatible HTTP server for tests.

It speaks the endpoints the real ``huggingface_hub`` client uses to create a
repo and a branch, preupload, upload LFS objects (the basic transfer), commit
(NDJSON), read repo info and trees, and resolve/download files, with the
headers the client reads (X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size,
X-Error-Code). Tokens carry a user and the namespaces they may write; private
repos are readable only by their owner. Faults (429 with Retry-After, 5xx) can
be queued per route to exercise retries. Xet is not offered: clients must run
with HF_HUB_DISABLE_XET=1 so they use the LFS protocol.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".model", ".pt")
LFS_MIN_SIZE = 10 << 20


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Entry:
    size: int
    git_oid: str
    data: bytes | None = None  # regular files
    lfs_oid: str | None = None  # LFS files: their sha256, content in the LFS store


@dataclass
class Commit:
    sha: str
    parent: str | None
    message: str
    files: dict[str, Entry]


@dataclass
class Repo:
    repo_id: str
    owner: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, rev: str) -> Commit | None:
        sha = self.branches.get(rev, rev)
        return self.commits.get(sha)

    def history(self, branch: str = "main") -> list[Commit]:
        out, sha = [], self.branches.get(branch)
        while sha:
            out.append(self.commits[sha])
            sha = self.commits[sha].parent
        return out


class HubState:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.tokens: dict[str, dict] = {}  # token -> {"user": str, "write": set of namespaces}
        self.faults: list[tuple[re.Pattern, int, dict]] = []  # (METHOD path pattern, status, headers), consumed in order
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        self.lock = threading.Lock()
        self._n = 0

    def add_token(self, token: str, user: str, write: tuple[str, ...] | None = None) -> None:
        self.tokens[token] = {"user": user, "write": set(write if write is not None else (user,))}

    def fail(self, pattern: str, status: int, times: int = 1, headers: dict | None = None) -> None:
        for _ in range(times):
            self.faults.append((re.compile(pattern), status, headers or {}))

    def new_sha(self, seed: str) -> str:
        self._n += 1
        return hashlib.sha1(f"{seed}:{self._n}".encode()).hexdigest()

    def commit(self, repo: Repo, branch: str, message: str, files: dict[str, Entry]) -> Commit:
        parent = repo.branches.get(branch)
        c = Commit(self.new_sha(repo.repo_id + message), parent, message, files)
        repo.commits[c.sha] = c
        repo.branches[branch] = c.sha
        return c


class HubServer:
    def __init__(self):
        self.state = HubState()
        state = self.state

        class Handler(_Handler):
            hub = state

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        Handler.base = self.url
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Error(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class _Handler(BaseHTTPRequestHandler):
    hub: HubState
    base: str
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # --- plumbing ---------------------------------------------------------------------------

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _user(self, required: bool = False) -> str | None:
        auth = self.headers.get("Authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else None
        if token is None:
            if required:
                raise _Error(401, "Invalid credentials in Authorization header")
            return None
        info = self.hub.tokens.get(token)
        if info is None:
            raise _Error(401, "Invalid credentials in Authorization header")
        return info["user"]

    def _can_write(self, namespace: str) -> None:
        user = self._user(required=True)
        if namespace not in self.hub.tokens[self.headers["Authorization"][7:]]["write"]:
            raise _Error(403, f"You don't have the rights to create a model under the namespace \"{namespace}\" ({user})")

    def _repo(self, repo_id: str, write: bool = False) -> Repo:
        repo = self.hub.repos.get(repo_id)
        if write:
            self._can_write(repo_id.split("/")[0])
        user = self._user()
        if repo is None or (repo.private and user != repo.owner and not write):
            raise _Error(401 if user is None else 404, "Repository not found", "RepoNotFound")
        return repo

    def _commit(self, repo: Repo, rev: str) -> Commit:
        c = repo.resolve(unquote(rev))
        if c is None:
            raise _Error(404, f"Revision Not Found for url: {rev}", "RevisionNotFound")
        return c

    def _dispatch(self) -> None:
        path = urlsplit(self.path).path
        with self.hub.lock:
            self.hub.requests.append((self.command, path, dict(self.headers)))
            for i, (pattern, status, headers) in enumerate(self.hub.faults):
                if pattern.search(f"{self.command} {path}"):
                    del self.hub.faults[i]
                    self._body()
                    return self._json(status, {"error": "injected fault"}, headers)
        try:
            for method, pattern, fn in ROUTES:
                if method == self.command or (method == "GET" and self.command == "HEAD"):
                    m = re.fullmatch(pattern, path)
                    if m:
                        with self.hub.lock:
                            return fn(self, *m.groups())
            raise _Error(404, f"no route for {self.command} {path}")
        except _Error as e:
            headers = dict(e.headers)
            if e.code:
                headers["X-Error-Code"] = e.code
            headers["X-Error-Message"] = e.message
            self._json(e.status, {"error": e.message}, headers)

    do_GET = do_HEAD = do_POST = do_PUT = _dispatch

    # --- routes -----------------------------------------------------------------------------

    def create_repo(self) -> None:
        body = json.loads(self._body() or b"{}")
        ns = body.get("organization") or self._user(required=True)
        self._can_write(ns)
        repo_id = f"{ns}/{body['name']}"
        if repo_id in self.hub.repos:
            return self._json(409, {"error": "You already created this model repo", "url": f"{self.base}/{repo_id}"})
        private = body.get("visibility", "private" if body.get("private") else "public") == "private"
        repo = self.hub.repos[repo_id] = Repo(repo_id, self._user(), private)
        attrs = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.gguf filter=lfs diff=lfs merge=lfs -text\n"
        self.hub.commit(repo, "main", "initial commit", {".gitattributes": Entry(len(attrs), git_blob_sha(attrs), attrs)})
        self._json(200, {"url": f"{self.base}/{repo_id}", "name": repo_id, "id": repo_id})

    def create_branch(self, repo_id: str, branch: str) -> None:
        repo = self._repo(repo_id, write=True)
        branch = unquote(branch)
        if branch in repo.branches:
            return self._json(409, {"error": f"Reference already exists: refs/heads/{branch}"})
        body = json.loads(self._body() or b"{}")
        start = self._commit(repo, body.get("startingPoint") or "main")
        repo.branches[branch] = start.sha
        self._json(200, {})

    def repo_info(self, repo_id: str, rev: str | None = None) -> None:
        repo = self._repo(repo_id)
        c = self._commit(repo, rev or "main")
        self._json(200, {"id": repo_id, "author": repo.owner, "sha": c.sha, "private": repo.private, "tags": [], "downloads": 0, "likes": 0,
                         "siblings": [{"rfilename": p} for p in sorted(c.files)]})

    def validate_yaml(self) -> None:
        import yaml

        content = json.loads(self._body()).get("content", "")
        m = re.match(r"---\n(.*?)\n---\n", content, re.S)
        try:
            yaml.safe_load(m.group(1) if m else "")
        except yaml.YAMLError as e:
            return self._json(400, {"errors": [{"message": str(e)}]})
        self._json(200, {"errors": [], "warnings": []})

    def preupload(self, repo_id: str, rev: str) -> None:
        repo = self._repo(repo_id, write=True)
        c = self._commit(repo, rev)
        out = []
        for f in json.loads(self._body())["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_SIZE
            e = c.files.get(f["path"])
            oid = None if e is None else (e.lfs_oid if e.lfs_oid else e.git_oid)
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": out, "commitOid": c.sha})

    def lfs_batch(self, repo_id: str) -> None:
        self._repo(repo_id, write=True)
        body = json.loads(self._body())
        objects = []
        for o in body["objects"]:
            item = {"oid": o["oid"], "size": o["size"]}
            if o["oid"] not in self.hub.lfs:
                item["actions"] = {"upload": {"href": f"{self.base}/lfs-upload/{o['oid']}"}, "verify": {"href": f"{self.base}/lfs-verify/{o['oid']}"}}
            objects.append(item)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(), content_type="application/vnd.git-lfs+json")

    def lfs_upload(self, oid: str) -> None:
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            raise _Error(400, "the uploaded bytes do not match the oid")
        self.hub.lfs[oid] = data
        self._json(200, {})

    def lfs_verify(self, oid: str) -> None:
        body = json.loads(self._body())
        if oid not in self.hub.lfs or len(self.hub.lfs[oid]) != body.get("size"):
            raise _Error(404, "object not found")
        self._json(200, {"success": True})

    def commit(self, repo_id: str, rev: str) -> None:
        repo = self._repo(repo_id, write=True)
        rev = unquote(rev)
        head = self._commit(repo, rev)
        files = dict(head.files)
        header = None
        for line in self._body().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, v = item["key"], item["value"]
            if key == "header":
                header = v
                if v.get("parentCommit") and v["parentCommit"] != head.sha:
                    raise _Error(412, "A commit has happened since the parent commit")
            elif key == "file":
                data = base64.b64decode(v["content"])
                files[v["path"]] = Entry(len(data), git_blob_sha(data), data)
            elif key == "lfsFile":
                if v["oid"] not in self.hub.lfs:
                    raise _Error(422, f"LFS object {v['oid']} was never uploaded")
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{v['oid']}\nsize {v['size']}\n".encode()
                files[v["path"]] = Entry(v["size"], git_blob_sha(pointer), lfs_oid=v["oid"])
            elif key == "deletedFile":
                files.pop(v["path"], None)
            else:
                raise _Error(400, f"unknown commit operation {key}")
        if header is None:
            raise _Error(400, "the commit has no header")
        if rev not in repo.branches:
            raise _Error(400, "can only commit to a branch")
        c = self.hub.commit(repo, rev, header.get("summary", ""), files)
        self._json(200, {"success": True, "commitOid": c.sha, "commitUrl": f"{self.base}/{repo_id}/commit/{c.sha}", "pullRequestUrl": None})

    def tree(self, repo_id: str, rev: str, prefix: str | None = None) -> None:
        repo = self._repo(repo_id)
        c = self._commit(repo, rev)
        out = []
        for p, e in sorted(c.files.items()):
            if prefix and not p.startswith(prefix.rstrip("/") + "/"):
                continue
            item = {"type": "file", "oid": e.git_oid, "size": e.size, "path": p}
            if e.lfs_oid:
                item["lfs"] = {"oid": e.lfs_oid, "size": e.size, "pointerSize": 130}
            out.append(item)
        self._json(200, out)

    def resolve(self, repo_id: str, rev: str, path: str) -> None:
        repo = self._repo(repo_id)
        c = self._commit(repo, rev)
        e = c.files.get(unquote(path))
        if e is None:
            raise _Error(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": c.sha})
        data = self.hub.lfs[e.lfs_oid] if e.lfs_oid else e.data
        headers = {"X-Repo-Commit": c.sha, "ETag": f'"{e.lfs_oid or e.git_oid}"', "Accept-Ranges": "bytes"}
        if e.lfs_oid:
            headers.update({"X-Linked-Etag": f'"{e.lfs_oid}"', "X-Linked-Size": str(e.size)})
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if m and self.command == "GET":
            start, end = int(m.group(1)), int(m.group(2) or len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(206, data[start:end + 1], headers, "application/octet-stream")
        self._send(200, data, headers, "application/octet-stream")


_R = r"([^/]+/[^/]+)"
ROUTES = [
    ("POST", r"/api/repos/create", _Handler.create_repo),
    ("POST", r"/api/validate-yaml", _Handler.validate_yaml),
    ("POST", rf"/api/models/{_R}/branch/([^/]+)", _Handler.create_branch),
    ("POST", rf"/api/models/{_R}/preupload/([^/]+)", _Handler.preupload),
    ("POST", rf"/api/models/{_R}/commit/([^/]+)", _Handler.commit),
    ("POST", rf"/{_R}\.git/info/lfs/objects/batch", _Handler.lfs_batch),
    ("PUT", r"/lfs-upload/([0-9a-f]{64})", _Handler.lfs_upload),
    ("POST", r"/lfs-verify/([0-9a-f]{64})", _Handler.lfs_verify),
    ("GET", rf"/api/models/{_R}", _Handler.repo_info),
    ("GET", rf"/api/models/{_R}/revision/([^/]+)", _Handler.repo_info),
    ("GET", rf"/api/models/{_R}/tree/([^/]+)", _Handler.tree),
    ("GET", rf"/api/models/{_R}/tree/([^/]+)/(.+)", _Handler.tree),
    ("GET", rf"/{_R}/resolve/([^/]+)/(.+)", _Handler.resolve),
]
