"""A local Hugging Face Hub for the tests and benchmarks: serves fixture repositories the way the Hub
API does, so huggingface_hub (pointed at it with HF_ENDPOINT or ``endpoint=``) downloads from it
unchanged. Loopback only (127.0.0.1), at most 32 requests handled at once, and it stops
itself after ``lifetime`` seconds (a test that dies never leaves it listening).

What huggingface_hub 2.x reads (file_download.py ``get_hf_file_metadata``, ``http_get``; hf_api.py
``model_info``): ``GET /api/models/{repo}/revision/{rev}?blobs=true`` with ``sha`` and ``siblings``
(``rfilename``, ``size``, ``lfs.sha256/size/pointerSize``); ``HEAD|GET /{repo}/resolve/{rev}/{file}``
with ``X-Repo-Commit``, ``ETag`` (the LFS SHA-256, or the git blob id of a small file),
``X-Linked-Etag``/``X-Linked-Size`` for LFS files, and ``Range: bytes=a-b`` / ``a-`` (206, resumes).

Faults for the tests: ``rate`` (bytes/s, shared by all downloads), ``corrupt`` (file names served with
one byte flipped, the listing unchanged), ``gated`` (repos that answer 403 GatedRepo), ``drop_after``
(file -> bytes after which the connection is cut, once), ``listed_size`` (file -> the size the listing
states instead of the real one), ``range_from`` (file -> another local file of the same size whose bytes
answer a bounded range request ``bytes=a-b``, a header read; whole and resumed downloads get the real file),
``silent_ranges`` (files whose bounded range requests are accepted and never answered). ``SilentServer``:
a server that accepts every connection and says nothing. ``requests`` records (method, path, Range) of
every request.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
CHUNK = 64 << 10


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class RepoFile:
    path: str      # on local disk
    size: int
    sha256: str
    lfs: bool
    etag: str      # the LFS SHA-256, or the git blob id of a small file


@dataclass
class Commit:
    sha: str
    files: dict[str, RepoFile]


def load_commit(folder: str, sha: str | None = None) -> Commit:
    """Every file under ``folder`` as one commit (its id: a hash of the files' hashes, unless given)."""
    files = {}
    for d, _, names in os.walk(folder):
        for n in sorted(names):
            p = os.path.join(d, n)
            rel = os.path.relpath(p, folder).replace(os.sep, "/")
            with open(p, "rb") as f:
                data = f.read()
            lfs = rel.endswith(LFS_SUFFIXES)
            digest = hashlib.sha256(data).hexdigest()
            files[rel] = RepoFile(p, len(data), digest, lfs, digest if lfs else _git_blob_id(data))
    sha = sha or hashlib.sha1("".join(f"{k}{v.sha256}" for k, v in sorted(files.items())).encode()).hexdigest()
    return Commit(sha, files)


class _Bounded(ThreadingHTTPServer):
    """At most MAX_THREADS requests handled at once; a further connection waits for a free thread."""

    MAX_THREADS = 32
    daemon_threads = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.slots = threading.BoundedSemaphore(self.MAX_THREADS)

    def process_request(self, request, client_address):
        self.slots.acquire()
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Limiter:
    """Bytes per second over every download at once (None: unlimited)."""

    def __init__(self, rate: float | None):
        self.rate, self.lock, self.next = rate, threading.Lock(), time.monotonic()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.next = max(self.next, now) + n / self.rate
            wait = self.next - now
        if wait > 0:
            time.sleep(wait)


@dataclass
class HubServer:
    rate: float | None = None
    lifetime: float = 900.0
    repos: dict[str, dict[str, Commit]] = field(default_factory=dict)   # repo -> ref or sha -> commit
    corrupt: set[str] = field(default_factory=set)
    gated: set[str] = field(default_factory=set)    # repos that answer 403 GatedRepo (terms not accepted)
    drop_after: dict[str, int] = field(default_factory=dict)
    listed_size: dict[str, int] = field(default_factory=dict)
    listed_sha256: dict[str, str] = field(default_factory=dict)   # a file's LFS SHA-256 as listed (hostile)
    range_from: dict[str, str] = field(default_factory=dict)
    silent_ranges: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)

    def add(self, repo: str, folder: str, branch: str = "main", sha: str | None = None) -> Commit:
        """Publish ``folder`` as a commit of ``repo`` and point ``branch`` at it (a branch that moves)."""
        c = load_commit(folder, sha)
        refs = self.repos.setdefault(repo, {})
        refs[c.sha] = c
        refs[branch] = c
        return c

    # ------------------------------------------------------------------ the server
    def start(self) -> "HubServer":
        self.limiter = _Limiter(self.rate)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                server._handle(self, head=True)

            def do_GET(self):
                server._handle(self, head=False)

        self.httpd = _Bounded(("127.0.0.1", 0), Handler)   # loopback only
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, name="hub-server", daemon=True).start()
        self.timer = threading.Timer(self.lifetime, self.stop)
        self.timer.daemon = True
        self.timer.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ what was asked
    def full_gets(self, suffix: str = ".safetensors") -> list[str]:
        """Files downloaded whole or resumed (GETs of the file without a Range, or from an offset to the end)."""
        return [p for m, p, r in self.requests if m == "GET" and "/resolve/" in p and p.endswith(suffix)
                and (r is None or r.endswith("-"))]

    # ------------------------------------------------------------------ handling
    def _commit(self, repo: str, rev: str) -> Commit | None:
        return self.repos.get(repo, {}).get(rev)

    def _json(self, h, status: int, obj, head: bool = False, extra: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str, head: bool) -> None:
        self._json(h, status, {"error": code}, head, {"X-Error-Code": code, "X-Error-Message": code})

    def _handle(self, h, head: bool) -> None:
        url = urlsplit(h.path)
        path = unquote(url.path)
        rng = h.headers.get("Range")
        with self.lock:
            self.requests.append(("HEAD" if head else "GET", path, rng))
        parts = path.strip("/").split("/")
        if "/".join(parts[2:4] if parts[:2] == ["api", "models"] else parts[:2]) in self.gated:
            return self._error(h, 403, "GatedRepo", head)
        if parts[:2] == ["api", "models"]:
            # /api/models/{org}/{name}[/revision/{rev}]
            repo = "/".join(parts[2:4])
            rev = "/".join(parts[5:]) if len(parts) > 5 and parts[4] == "revision" else "main"
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound", head)
            c = self._commit(repo, rev)
            if c is None:
                return self._error(h, 404, "RevisionNotFound", head)
            siblings = []
            for name, f in sorted(c.files.items()):
                size = self.listed_size.get(name, f.size)
                s = {"rfilename": name, "size": size, "blobId": f.sha256[:40]}
                if f.lfs:
                    s["lfs"] = {"size": size, "sha256": self.listed_sha256.get(name, f.sha256), "pointerSize": 134}
                siblings.append(s)
            return self._json(h, 200, {"id": repo, "modelId": repo, "sha": c.sha, "siblings": siblings,
                                       "private": False, "tags": []}, head)
        # /{org}/{name}/resolve/{rev}/{file...}
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(h, 404, "NotFound", head)
        repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        if repo not in self.repos:
            return self._error(h, 404, "RepoNotFound", head)
        c = self._commit(repo, rev)
        if c is None:
            return self._error(h, 404, "RevisionNotFound", head)
        f = c.files.get(name)
        if f is None:
            return self._error(h, 404, "EntryNotFound", head)
        self._file(h, c, name, f, rng, head)

    def _file(self, h, c: Commit, name: str, f: RepoFile, rng: str | None, head: bool) -> None:
        start, end = 0, f.size - 1
        status = 200
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, f.size - int(b))
            end = min(int(b), f.size - 1) if a and b else f.size - 1
            if start >= f.size:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{f.size}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            status = 206
        h.send_response(status)
        h.send_header("Content-Length", str(end - start + 1))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", f'"{f.etag}"')
        h.send_header("X-Repo-Commit", c.sha)
        if f.lfs:
            h.send_header("X-Linked-Etag", f'"{f.sha256}"')
            h.send_header("X-Linked-Size", str(f.size))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        bounded = bool(rng) and not rng.endswith("-")   # a header read, not a download or its resumption
        if bounded and name in self.silent_ranges:
            self.stopped.wait()   # accepted, never answered
            return
        h.end_headers()
        if head:
            return
        cut = self.drop_after.get(name)
        sent = 0
        with open(self.range_from[name] if bounded and name in self.range_from else f.path, "rb") as src:
            src.seek(start)
            pos = start
            while pos <= end:
                n = min(CHUNK, end - pos + 1)
                data = src.read(n)
                if name in self.corrupt and pos <= f.size // 2 < pos + n:
                    i = f.size // 2 - pos
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                if cut is not None and sent + n > cut:
                    with self.lock:
                        self.drop_after.pop(name, None)
                    h.wfile.write(data[: max(0, cut - sent)])
                    h.wfile.flush()
                    h.close_connection = True
                    try:
                        h.connection.shutdown(2)
                    except OSError:
                        pass
                    return
                self.limiter.take(n)
                try:
                    h.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += n
                pos += n
                with self.lock:
                    self.bytes_sent[name] = self.bytes_sent.get(name, 0) + n


class SilentServer:
    """Accepts every connection on 127.0.0.1 and never says a word (a Hub that hangs), until stopped."""

    def __enter__(self) -> "SilentServer":
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, name="silent-hub", daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def __exit__(self, *exc) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def main(argv: list[str]) -> None:
    """``python tests/support/hub_server.py FOLDER ORG/NAME [RATE_BYTES_PER_S]``: serve until killed (or the lifetime)."""
    server = HubServer(rate=float(argv[2]) if len(argv) > 2 else None)
    c = server.add(argv[1], argv[0])
    server.start()
    print(server.url, c.sha, flush=True)
    server.timer.join()


if __name__ == "__main__":
    main(sys.argv[1:])
