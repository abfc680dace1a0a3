"""A local HTTP server that answers like the Hugging Face Hub for a few model folders.

What it is: the stand-in for huggingface.co in tests and local demos, since no hub is
reachable from these machines. Point a client at it with ``HF_ENDPOINT`` and the real
huggingface_hub code runs unchanged: the same REST routes
(``GET /api/models/{repo}/revision/{rev}``, ``GET /api/models/{repo}/tree/{commit}``,
``HEAD``/``GET /{repo}/resolve/{commit}/{path}`` with byte ranges), the same headers
(``X-Repo-Commit``, ``ETag`` = git blob id or LFS sha256, ``X-Linked-Etag``/``X-Linked-Size``
for LFS files) and the same error signalling (``X-Error-Code`` ``RepoNotFound``,
``RevisionNotFound``, ``GatedRepo``, ``EntryNotFound`` on 401/403/404). A repository is
a local directory; its commit id is derived from its content, so editing a file makes
a new commit, as on the hub.

What it is not: a hub. No uploads, no xet storage, no redirects to a CDN, no pagination
(every tree fits in one page), one revision per branch name; it binds to 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

# Files the hub keeps in LFS; everything else is a plain git blob.
_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".onnx", ".msgpack")


@dataclass
class HubRepo:
    """One model repository: branch name -> folder, and who may read it."""

    revisions: dict[str, Path]
    gated: bool = False  # readable only with one of ``tokens``
    tokens: frozenset[str] = frozenset()
    # The next this-many requests for the repository get 503, as a hub outage does.
    unavailable_requests: int = 0

    def files(self, revision: str) -> dict[str, Path]:
        root = self.revisions[revision]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def commit(self, revision: str) -> str:
        digest = hashlib.sha1(revision.encode())
        for name, path in self.files(revision).items():
            digest.update(name.encode() + b"\0" + bytes.fromhex(file_hashes(path)[1]))
        return digest.hexdigest()


_HASHES: dict[tuple[str, int, int, int], tuple[str, str]] = {}
_HASHES_LOCK = threading.Lock()


def file_hashes(path: Path) -> tuple[str, str]:
    """(git blob id, sha256) of a file, remembered while its size, mtime and ctime stay the same.

    A hub answers these from its index; re-reading a model of hundreds of MiB on every
    request would make the stand-in, not the client under test, the slow part. An edited
    file changes its mtime and ctime, so a new commit is still seen at once.
    """
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _HASHES_LOCK:
        known = _HASHES.get(key)
    if known is None:
        blob = hashlib.sha1(b"blob %d\0" % st.st_size)
        sha = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                blob.update(chunk)
                sha.update(chunk)
        known = (blob.hexdigest(), sha.hexdigest())
        with _HASHES_LOCK:
            _HASHES[key] = known
    return known


@dataclass
class HubMirror:
    """A threaded HTTP server on 127.0.0.1 serving ``repos``; use as a context manager."""

    repos: dict[str, HubRepo]
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) as received
    _server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start() the mirror first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> HubMirror:
        mirror = self

        class Handler(_Handler):
            hub = mirror

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="hub-mirror", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubMirror:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def downloads(self) -> list[str]:
        """Paths fetched with GET from /resolve/ (file bodies), in order."""
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]


class _Handler(BaseHTTPRequestHandler):
    hub: HubMirror
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests read HubMirror.requests instead

    # ---- answers -------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(
            status,
            body,
            {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
        )

    def _json(self, value: Any) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    # ---- routing -------------------------------------------------------------

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, kind, revision = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
            repo = self._readable(repo_id)
            if repo is None:
                return
            branch = self._branch(repo, revision)
            if branch is None:
                return
            if kind == "revision":
                self._json(self._info(repo_id, repo, branch))
            else:
                self._json(self._tree(repo, branch))
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            repo = self._readable(repo_id)
            if repo is None:
                return
            branch = self._branch(repo, revision)
            if branch is not None:
                self._resolve(repo, branch, name)
            return
        self._error(404, "EntryNotFound", f"no route for {path}")

    def _readable(self, repo_id: str) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            # The hub answers 401 for a missing repo (it will not say whether a private one exists).
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if repo.unavailable_requests > 0:
            repo.unavailable_requests -= 1
            self._error(503, "ServiceUnavailable", "the hub is temporarily unavailable")
            return None
        if repo.gated:
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if token not in repo.tokens:
                self._error(
                    403 if token else 401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be authenticated.",
                )
                return None
        return repo

    def _branch(self, repo: HubRepo, revision: str) -> str | None:
        """The branch a revision names: a branch name or the commit id of one."""
        for branch in repo.revisions:
            if revision in (branch, repo.commit(branch)):
                return branch
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return None

    def _info(self, repo_id: str, repo: HubRepo, branch: str) -> dict[str, Any]:
        return {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": repo.commit(branch),
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "siblings": [{"rfilename": name} for name in repo.files(branch)],
        }

    def _tree(self, repo: HubRepo, branch: str) -> list[dict[str, Any]]:
        entries = []
        for name, path in repo.files(branch).items():
            blob_id, sha256 = file_hashes(path)
            size = path.stat().st_size
            entry: dict[str, Any] = {"type": "file", "oid": blob_id, "size": size, "path": name}
            if name.endswith(_LFS_SUFFIXES):
                entry["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
            entries.append(entry)
        return entries

    def _resolve(self, repo: HubRepo, branch: str, name: str) -> None:
        path = repo.files(branch).get(name)
        if path is None:
            self._error(404, "EntryNotFound", f"{name} does not exist on {branch}")
            return
        data = path.read_bytes()
        lfs = name.endswith(_LFS_SUFFIXES)
        blob_id, sha256 = file_hashes(path)
        etag = sha256 if lfs else blob_id
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": repo.commit(branch),
            "ETag": f'"{etag}"',
            "Accept-Ranges": "bytes",
        }
        if lfs:
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
        start = 0
        ranged = (self.headers.get("Range") or "").removeprefix("bytes=")
        if ranged and self.command == "GET":
            start = int(ranged.split("-")[0] or 0)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._send(206, data[start:], headers)
            return
        self._send(200, data, headers)
