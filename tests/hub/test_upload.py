"""`k3convert upload`: refusals, the model card, the dry run, and the upload itself.

The real Hugging Face Hub is NOT reached by any test here. The upload tests run
huggingface_hub's own client against a small fake Hub on 127.0.0.1 (http.server in a
thread, HfApi(endpoint=...) and huggingface_hub.constants.ENDPOINT pointed at it) that
implements just what whoami, create_repo, create_branch, preupload_lfs_files and
create_commit call: the token check, repo creation, branch creation, README YAML
validation, preupload, the LFS batch API, LFS PUT, and the ndjson commit. A socket guard
fails the test on any connection that is not to loopback.

With hf_xet installed, huggingface_hub 2.x uploads through the Xet protocol, which this stub
does not implement; the tests set HF_HUB_DISABLE_XET so the same calls take the LFS path:
the Xet transfer itself is not exercised here. Other tests use ``hub_standin.RecordingApi``,
a stand-in HfApi that records what each call was given.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner
from hub_standin import RecordingApi

from converter.cli import main
from converter.errors import VerifyFailed
from converter.fixture import FixtureSpec, make_fixture
from converter.hub import card as hub_card, publish, upload as hub_module
from converter.hub.upload import model_card, upload, upload_files
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.state.files import MANIFEST
from converter.state.records import write_json
from tests import support

REPO = "someone/kimi-k3-int4"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3up")
    src, dst = str(root / "src"), str(root / "dst")
    make_fixture(src, FixtureSpec(layers=3, experts=4))
    convert(src, dst, Options())
    return src, dst


@pytest.fixture
def dst(converted, tmp_path):
    """A private copy of the good DST, with the junk upload must leave behind."""
    out = str(tmp_path / "dst")
    shutil.copytree(converted[1], out)
    open(os.path.join(out, "model-00002-of-00003.safetensors.partial"), "wb").close()
    open(os.path.join(out, "config.json.tmp1234"), "wb").close()
    return out


@pytest.fixture
def loopback_only(monkeypatch):
    """Fail any socket connection that is not to this machine; record the ones made."""
    real = socket.socket.connect
    seen: list = []

    def guarded(self, address):
        seen.append(address)
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1"):
            raise OSError(f"test blocked a connection to {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    return seen


def _manifest(dst):
    with open(os.path.join(dst, MANIFEST)) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- a fake Hub

class FakeHub:
    """Just enough of the Hub's HTTP API for whoami, create_repo, create_branch, preupload_lfs_files and
    create_commit (LFS)."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict]] = []
        self.created: list[dict] = []
        self.branches: list[str] = []
        self.lfs: dict[str, bytes] = {}
        self.commits: list[dict] = []
        self.fail_commit: int | None = None  # an HTTP status to answer every commit with
        self.tokens: dict = {"hf_fake_token": "write"}  # token -> role (or whoami's whole accessToken), for whoami
        self.files: dict[str, list[str]] = {}  # repo -> the files its main branch holds (absent: no repository)
        self.parts: int | None = None  # LFS by the multipart protocol, in parts of this many bytes
        self.on_request = None  # called with (method, path) before each request is answered
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while (n := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        out += self.rfile.read(n)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

            def _handle(self, method: str) -> None:
                body = self._body()
                path = self.path.split("?")[0]
                hub.requests.append((method, path, {k.lower(): v for k, v in self.headers.items()}))
                if hub.on_request:
                    hub.on_request(method, path)
                p = path.strip("/").split("/")
                api = len(p) == 6 and p[:2] == ["api", "models"]
                if method == "GET" and path == "/api/whoami-v2":
                    token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                    if token not in hub.tokens:
                        return self._send(401, {"error": "Invalid credentials in Authorization header"})
                    role = hub.tokens[token]
                    access = role if isinstance(role, dict) else {"displayName": "fake", "role": role}
                    return self._send(200, {"type": "user", "name": "someone", "orgs": [], "auth": {
                        "type": "access_token", "accessToken": access}})
                if method == "GET" and p[:2] == ["api", "models"] and len(p) >= 4:
                    repo = f"{p[2]}/{p[3]}"
                    if repo not in hub.files:
                        self.send_response(404)
                        self.send_header("X-Error-Code", "RepoNotFound")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    return self._send(200, {"id": repo, "sha": "c" * 40,
                                            "siblings": [{"rfilename": f} for f in hub.files[repo]]})
                if method == "POST" and path == "/api/repos/create":
                    req = json.loads(body)
                    hub.created.append(req)
                    return self._send(200, {"url": f"{hub.url}/{req['organization']}/{req['name']}"})
                if method == "POST" and api and p[4] == "branch":
                    hub.branches.append(p[5])
                    return self._send(200, {})
                if method == "POST" and path == "/api/validate-yaml":
                    return self._send(200, {"errors": [], "warnings": []})
                if method == "POST" and api and p[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [
                        {"path": f["path"], "shouldIgnore": False, "oid": None,
                         "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular"} for f in files]})
                if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
                    objs = json.loads(body)["objects"]
                    return self._send(200, {"transfer": "multipart" if hub.parts else "basic", "objects": [
                        {"oid": o["oid"], "size": o["size"], "actions": {"upload": hub.lfs_action(o)}} for o in objs]})
                if method == "PUT" and path.startswith("/lfs-put/"):
                    hub.lfs[p[1]] = body
                    return self._send(200, {})
                if method == "PUT" and path.startswith("/lfs-part/"):  # /lfs-part/{oid}/{n}: one part, its ETag
                    hub.lfs_parts[(p[1], int(p[2]))] = body
                    self.send_response(200)
                    self.send_header("ETag", f'"{p[1][:8]}-{p[2]}"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if method == "POST" and path.startswith("/lfs-complete/"):
                    oid, n = p[1], len(json.loads(body)["parts"])
                    hub.lfs[oid] = b"".join(hub.lfs_parts[(oid, i)] for i in range(1, n + 1))
                    return self._send(200, {})
                if method == "POST" and api and p[4] == "commit" and hub.fail_commit:
                    return self._send(hub.fail_commit, {"error": "Internal Error - We're working hard to fix this"})
                if method == "POST" and api and p[4] == "commit":
                    lines = [json.loads(x) for x in body.splitlines() if x.strip()]
                    hub.commits.append({"repo": f"{p[2]}/{p[3]}", "revision": p[5], "lines": lines})
                    return self._send(200, {"commitUrl": f"{hub.url}/{p[2]}/{p[3]}/commit/{'a' * 40}",
                                            "commitOid": "a" * 40, "pullRequestUrl": None})
                return self._send(404, {"error": f"not implemented by the fake Hub: {method} {path}"})

        self.lfs_parts: dict[tuple[str, int], bytes] = {}
        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that gave up (an upload refused mid-send)
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def lfs_action(self, obj: dict) -> dict:
        """The batch answer's upload action for one object: one PUT, or (``parts``) a PUT per part."""
        if not self.parts:
            return {"href": f"{self.url}/lfs-put/{obj['oid']}"}
        n = -(-obj["size"] // self.parts)
        parts = {str(i): f"{self.url}/lfs-part/{obj['oid']}/{i}" for i in range(1, n + 1)}
        return {"href": f"{self.url}/lfs-complete/{obj['oid']}", "header": {"chunk_size": str(self.parts), **parts}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(monkeypatch, loopback_only):
    import huggingface_hub.constants as constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub = FakeHub()
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)          # anything not given endpoint= lands here too
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)   # the LFS path, which the fake implements
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    yield hub
    if not was_disabled:
        enable_progress_bars()
    hub.close()


# ----------------------------------------------------------------------------- the upload

def test_upload_through_a_fake_hub_sends_exactly_the_output(dst, fake_hub, loopback_only):
    res = upload(dst, REPO, private=True, revision="int4-v1", token="hf_fake_token", endpoint=fake_hub.url)
    assert res.method == "create_commit" and res.readme == "written"
    assert any("hf_xet" in n for n in res.notes)  # the LFS path resumes file by file: the user is told
    paths = [p for _, p, _ in fake_hub.requests]
    assert paths.index("/api/whoami-v2") < paths.index("/api/repos/create")  # the token first

    assert fake_hub.created == [{"name": "kimi-k3-int4", "organization": "someone", "visibility": "private",
                                 "type": "model"}]
    assert fake_hub.branches == ["int4-v1"]
    assert len(fake_hub.commits) == 1 and fake_hub.commits[0]["revision"] == "int4-v1"
    lines = fake_hub.commits[0]["lines"]
    sent = {x["value"]["path"]: x for x in lines if x["key"] in ("file", "lfsFile")}

    expected = sorted(os.path.relpath(os.path.join(d, f), dst) for d, _, fs in os.walk(dst) for f in fs
                      if not d.startswith(os.path.join(dst, ".k3convert"))
                      and not f.endswith(".partial") and ".tmp" not in f)
    assert sorted(sent) == expected
    assert "README.md" in sent and not any(p.startswith(".k3convert") or p.endswith(".partial") for p in sent)

    # every shard went by LFS with its SHA-256 and the manifest's size, and the bytes sent are the shard's
    shards = _manifest(dst)["shards"]
    assert len(shards) == 3
    for name, rec in shards.items():
        v = sent[name]
        with open(os.path.join(dst, name), "rb") as f:
            data = f.read()
        oid = hashlib.sha256(data).hexdigest()
        assert v["key"] == "lfsFile" and v["value"]["oid"] == oid and v["value"]["size"] == rec["bytes"]
        assert fake_hub.lfs[oid] == data
    # small files inline, byte for byte
    cfg = base64.b64decode(sent["config.json"]["value"]["content"])
    with open(os.path.join(dst, "config.json"), "rb") as f:
        assert cfg == f.read()
    card = base64.b64decode(sent["README.md"]["value"]["content"]).decode()
    assert "activation_situ_beta: 4.0" in card and "group size 32, symmetric" in card

    assert all(h.get("authorization") == "Bearer hf_fake_token"
               for m, p, h in fake_hub.requests if p.startswith("/api/repos") or "/commit/" in p)
    assert loopback_only and all(a[0] in ("127.0.0.1", "::1") for a in loopback_only if isinstance(a, tuple))


def test_upload_commits_once_the_checked_bytes(dst):
    """The operation API: whoami, the repository's listing, create_repo, preupload (large files from
    their path), then one create_commit; small files are committed as the bytes that were read and checked (T2)."""
    api = RecordingApi()
    res = upload(dst, REPO, api=api)
    assert res.method == "create_commit"
    assert api.names == ["whoami", "model_info", "create_repo", "preupload_lfs_files", "create_commit"]
    assert sorted(api.committed) == sorted(p for p, _ in res.files)
    for path, data in api.committed.items():
        with open(os.path.join(dst, path), "rb") as f:
            assert f.read() == data, path


# ----------------------------------------------------------------------------- refusals

class _NoApi:
    def __getattr__(self, name):
        raise AssertionError(f"the Hub was contacted ({name}) although upload should have refused")


def test_refuses_an_incomplete_conversion(dst):
    m = _manifest(dst)
    m["complete"], m["status"] = False, "converting"
    write_json(os.path.join(dst, MANIFEST), m)
    with pytest.raises(VerifyFailed, match="not complete"):
        upload(dst, REPO, api=_NoApi())
    res = CliRunner().invoke(main, ["upload", dst, REPO, "--dry-run"])
    assert res.exit_code == 5


def test_refuses_when_structure_fails(dst):
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    del cfg["text_config"]["hidden_act"]
    write_json(os.path.join(dst, "config.json"), cfg)
    with pytest.raises(VerifyFailed, match="hidden_act"):
        upload(dst, REPO, api=_NoApi())


def test_verify_checksums_flag_catches_a_corrupt_shard(dst):
    path = os.path.join(dst, "model-00001-of-00003.safetensors")
    with open(path, "r+b") as f:  # a byte of tensor data mid-file: only the digest can tell
        f.seek(os.path.getsize(path) // 2)
        mid = f.read(1)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes([mid[0] ^ 0xFF]))
    upload(dst, REPO, dry_run=True)  # structure only by default: passes
    with pytest.raises(VerifyFailed, match="model-00001-of-00003.safetensors"):
        upload(dst, REPO, dry_run=True, verify_checksums=True)


# ----------------------------------------------------------------------------- dry run, card

def test_dry_run_lists_files_and_bytes_without_writing(dst, loopback_only):
    res = CliRunner().invoke(main, ["upload", dst, REPO, "--dry-run"])
    assert res.exit_code == 0, res.output
    assert not os.path.exists(os.path.join(dst, "README.md"))
    assert "README.md" in res.output and ".partial" not in res.output and ".k3convert" not in res.output
    files = upload_files(dst)
    total = sum(n for _, n in files) + len(model_card(dst, repo_id=REPO).encode())
    assert f"would upload {len(files) + 1} files, {total / 1e9:.3f} GB" in res.output
    assert loopback_only == []  # no connection at all


def test_model_card_contents(dst):
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["_name_or_path"] = "moonshotai/Kimi-K3"
    write_json(os.path.join(dst, "config.json"), cfg)
    card = model_card(dst, repo_id=REPO)
    assert card.startswith("---\nbase_model: moonshotai/Kimi-K3\nbase_model_relation: quantized\n")
    assert "`hidden_act: situ`" in card and "`activation_situ_linear_beta: 25.0`" in card
    assert "compressed-tensors" in card and "bf16 scale" in card and "W4A16" in card
    assert "k3convert mxfp4-to-int4 src -o dst" in card
    # this fixture's per-rank intermediate (192 / 8) fails every launch the card checks: it recommends
    # none and quotes the check's refusals (tests/hub/test_card.py: the lines verify --serving passes)
    assert f"vllm serve {REPO}" not in card and "--trust-remote-code --tensor-parallel-size 8" not in card
    assert "KimiMoE pads intermediate 24 to 256" in card and "No launch below passes" in card
    table = [x for x in card.splitlines() if x.startswith("| ") and x[2].isdigit()]
    assert len(table) == 2  # layers 1 and 2 (layer 0 is dense); at most 10 are shown
    assert "relative RMSE mean **0.0" in card


def test_existing_readme_is_kept(dst):
    with open(os.path.join(dst, "README.md"), "w") as f:
        f.write("# mine\n")
    res = upload(dst, REPO, dry_run=True)
    assert res.readme == "kept"
    with open(os.path.join(dst, "README.md")) as f:
        assert f.read() == "# mine\n"


def test_state_and_partials_are_never_sent(dst):
    paths = [p for p, _ in upload_files(dst)]
    assert not any(p.startswith(".k3convert/") or p.endswith(".partial") or ".tmp" in p for p in paths)


# ----------------------------------------------------------------------------- issue 24 §3, issue 25 S14/S16

def test_dry_run_shows_the_card(dst):
    """`upload --dry-run` shows the model card it would write, not just "would write"."""
    res = CliRunner().invoke(main, ["upload", dst, REPO, "--dry-run"])
    assert res.exit_code == 0, res.output
    card = model_card(dst, repo_id=REPO).splitlines()
    assert f"README.md: would write (the model card, {len(card)} lines):" in res.output
    title = next(line for line in card if line.startswith("# "))
    assert f"    {title}" in res.output and "group size 32, symmetric" in res.output
    assert f"... ({len(card) - hub_card.CARD_LINES} more lines)" in res.output
    assert not os.path.exists(os.path.join(dst, "README.md"))


def test_s16_a_fifo_readme_fails_verify_and_is_never_uploaded(dst, loopback_only):
    """S16: README.md as a FIFO passed verify, and the upload said "13 files" while 12 were committed.
    Only regular files are output: verify fails naming it (exit 5), upload refuses before the Hub."""
    os.mkfifo(os.path.join(dst, "README.md"))
    res = CliRunner().invoke(main, ["verify", dst])
    assert res.exit_code == 5, res.output
    assert "README.md: is a FIFO (named pipe), not a regular file" in res.output
    for args in (["--dry-run"], []):
        res = CliRunner().invoke(main, ["upload", dst, REPO, *args])
        assert res.exit_code == 5 and "README.md: is a FIFO" in res.output, res.output
    with pytest.raises(VerifyFailed, match="README.md: is a FIFO"):
        upload(dst, REPO, api=_NoApi())
    assert loopback_only == []


def test_s16_a_hub_error_on_commit_is_one_line(dst, fake_hub):
    """S16: an HTTP 500 on commit printed three lines; now one, saying how to resume (exit 1)."""
    fake_hub.fail_commit = 500
    res = CliRunner().invoke(main, ["upload", dst, REPO, "--token", "hf_fake_token"],
                             env={"HF_ENDPOINT": fake_hub.url})
    assert res.exit_code == 1, res.output
    assert res.stdout.splitlines() == [f"upload {dst} -> {REPO}: verifying DST, then sending it…"], res.stdout
    err = res.stderr.strip()
    assert "\n" not in err, err
    assert err.startswith(f"k3convert: error: upload to {REPO} failed: HTTP 500 Internal Server Error on POST "
                          f"{fake_hub.url}/api/models/{REPO}/commit/main: Internal Error") and err.endswith(
        "Run the same command again to resume"), err
    assert fake_hub.commits == []


class _BlockingApi(RecordingApi):
    """A Hub that holds the upload in preupload until released (what a slow upload looks like)."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def preupload_lfs_files(self, repo_id, additions, **kw):
        self.entered.set()
        assert self.release.wait(120)
        super().preupload_lfs_files(repo_id, additions, **kw)


def test_s14_overwrite_is_refused_while_an_upload_reads_dst(converted, dst):
    """S14: `mxfp4-to-int4 --overwrite` (another scale rule) succeeded while `upload` of the same DST
    waited on the Hub, which then committed files it never verified. The upload holds DST's read
    lock: the overwrite is refused (exit 4) naming the upload, and the upload sends what it verified."""
    import threading

    from converter.verify import verify

    src = converted[0]
    before = {f: open(os.path.join(dst, f), "rb").read() for f, _ in upload_files(dst)}
    api = _BlockingApi()
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(res=upload(dst, REPO, api=api)), daemon=True)
    t.start()
    assert api.entered.wait(120), "the upload never reached the Hub"
    try:
        res = CliRunner().invoke(main, ["mxfp4-to-int4", src, "-o", dst, "--overwrite",
                                        "--scale-rule", "vllm-gfx942", "--progress", "none"])
        assert res.exit_code == 4, res.output
        assert "an upload of it is in progress" in res.stderr and "\n" not in res.stderr.strip(), res.stderr
        finalize = CliRunner().invoke(main, ["finalize", dst])
        assert finalize.exit_code == 4 and "an upload of it is in progress" in finalize.stderr, finalize.output
    finally:
        api.release.set()
        t.join(120)
    assert done["res"].method == "create_commit"
    assert {p: b for p, b in api.committed.items() if p != "README.md"} == before  # what verify accepted, unchanged
    assert verify(dst).ok
    # with the upload done, the overwrite goes ahead
    res = CliRunner().invoke(main, ["mxfp4-to-int4", src, "-o", dst, "--overwrite", "--scale-rule", "vllm-gfx942",
                                    "--progress", "none"])
    assert res.exit_code == 0, res.output


def test_s14_upload_is_refused_while_a_run_changes_dst(dst):
    """The other side of the lock: while a run changes DST (it holds read.lock exclusively), an
    upload is refused at once (exit 4), before it verifies or contacts the Hub."""
    from converter.state.locks import writing

    with writing(dst):
        res = CliRunner().invoke(main, ["upload", dst, REPO])
    assert res.exit_code == 4 and "a k3convert run is changing it" in res.stderr, res.output


# ----------------------------------------------------------------------------- issue 32 (T1, T2, T15, T17), issue 33 §3

def _flip(path: str) -> None:
    """One byte in the middle of a file inverted, size kept (bit rot, a faulty copy)."""
    at = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _cli_upload(dst, hub, *args, token="hf_fake_token"):
    return CliRunner().invoke(main, ["upload", dst, REPO, "--token", token, *args], env={"HF_ENDPOINT": hub.url})


def _one_line(res) -> str:
    err = res.stderr.strip()
    assert err.startswith("k3convert: ") and "\n" not in err, res.output
    return err


def _committed(hub) -> dict[str, bytes]:
    """What the fake Hub's one commit publishes, path -> bytes."""
    assert len(hub.commits) == 1, hub.commits
    out = {}
    for x in hub.commits[0]["lines"]:
        v = x["value"]
        if x["key"] == "file":
            out[v["path"]] = base64.b64decode(v["content"])
        elif x["key"] == "lfsFile":
            out[v["path"]] = hub.lfs[v["oid"]]
    return out


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_publish_reads_the_manifests_digest_and_the_hubs_sha256_at_once(tmp_path, monkeypatch, size):
    """publish's one read gives digest.file_digest's chunked digest (chunk boundaries, an empty
    file) and the plain SHA-256 the Hub names the file by."""
    from converter import digest

    monkeypatch.setattr(digest, "CHUNK", 4096)  # (mmap offsets: a multiple of the page size)
    monkeypatch.setattr(publish, "READ", 1000)  # reads that straddle chunk boundaries
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    c = publish.read_file(str(tmp_path), "f")
    assert c.digest == digest.file_digest(str(tmp_path / "f")) == publish.of_bytes("f", data).digest
    assert c.sha256 == hashlib.sha256(data).hexdigest() and c.size == size and c.data == data


def test_t1_a_shard_byte_flipped_after_the_conversion_is_never_published(dst, fake_hub):
    """T1: one byte flipped mid-shard: verify exits 5 on the digest, upload exited 0 and committed it.
    Every file is now read once and checked against the manifest: exit 5 naming it, nothing sent."""
    shard = "model-00002-of-00003.safetensors"
    _flip(os.path.join(dst, shard))
    assert CliRunner().invoke(main, ["verify", dst]).exit_code == 5
    res = _cli_upload(dst, fake_hub)
    assert res.exit_code == 5, res.output
    err = _one_line(res)
    assert f"{shard}: digest" in err and "refusing to publish" in err, err
    assert fake_hub.created == [] and fake_hub.lfs == {} and fake_hub.commits == []


def _changed_during_upload(dst, hub, monkeypatch, when: str, parts: int | None = None) -> None:
    """A byte of a large shard flipped by another program when the fake Hub is asked ``when`` (a path's
    end): exit 5 naming it, nothing committed, the changed bytes never sent."""
    monkeypatch.setattr(publish, "INLINE", 100_000)  # the shards (0.4-2 MB) go from their path, as real ones do
    monkeypatch.setattr(publish, "BLOCK", 1 << 16)
    hub.parts = parts
    shard = os.path.join(dst, "model-00001-of-00003.safetensors")
    edited = []

    def edit(method, path):
        if path.endswith(when) and not edited:
            _flip(shard)
            edited.append(path)

    hub.on_request = edit
    res = _cli_upload(dst, hub)
    assert edited and res.exit_code == 5, res.output
    err = _one_line(res)
    assert "model-00001-of-00003.safetensors: changed while it was uploaded" in err and "nothing was committed" in err
    assert hub.commits == []
    with open(shard, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() not in hub.lfs  # the changed bytes never reached the Hub


def test_t2_a_shard_changed_while_it_is_uploaded_is_never_committed(dst, fake_hub, monkeypatch):
    """T2: a shard byte flipped by another program while upload talks to the Hub (here: when asked
    for the upload modes, before huggingface_hub hashes it) was committed."""
    _changed_during_upload(dst, fake_hub, monkeypatch, "/preupload/main")


@pytest.mark.parametrize("parts", [None, 300_000], ids=["one PUT", "multipart"])
def test_h6_a_shard_changed_after_it_was_hashed_is_never_committed(dst, fake_hub, monkeypatch, parts):
    """H6: by LFS, huggingface_hub hashed a large file, then read it again from its path to send it: a
    byte changed in between (here: while the LFS batch is asked for, after the hash) was committed under
    the checked SHA-256. Each byte sent is now proven to be the checked one as it is read: exit 5, no commit."""
    _changed_during_upload(dst, fake_hub, monkeypatch, "/objects/batch", parts)


@pytest.mark.parametrize("parts", [None, 300_000], ids=["one PUT", "multipart"])
def test_h6_large_files_are_sent_as_the_checked_bytes(dst, fake_hub, monkeypatch, parts):
    """What a proven send gives huggingface_hub reads back whole: one PUT, or parts whose edges are not
    the proof's blocks (300,000 against 65,536), each shard byte for byte under its own SHA-256."""
    monkeypatch.setattr(publish, "INLINE", 100_000)
    monkeypatch.setattr(publish, "BLOCK", 1 << 16)
    fake_hub.parts = parts
    res = _cli_upload(dst, fake_hub)
    assert res.exit_code == 0, res.output
    sent = _committed(fake_hub)
    for name in _manifest(dst)["shards"]:
        with open(os.path.join(dst, name), "rb") as f:
            assert sent[name] == f.read(), name
    assert len(fake_hub.lfs_parts) > 3 if parts else not fake_hub.lfs_parts


def test_h6_a_proven_read_refuses_a_truncated_or_edited_block(tmp_path, monkeypatch):
    """publish.Sent on its own: reads at any offset and size equal the file; a shorter file or one
    changed byte stops the read naming the bytes, and a seek reads the file again."""
    monkeypatch.setattr(publish, "BLOCK", 1000)
    monkeypatch.setattr(publish, "INLINE", 100)
    data = os.urandom(4500)
    (tmp_path / "f").write_bytes(data)
    c = publish.read_file(str(tmp_path), "f")
    assert c.data is None and len(c.blocks) == 5
    s = publish.Sent(str(tmp_path), c)
    try:
        assert s.read(10) == data[:10] and s.read(1990) == data[10:2000]
        s.seek(3999)
        assert s.read() == data[3999:] and s.read() == b""
        with open(tmp_path / "f", "r+b") as f:
            f.seek(1500)
            f.write(bytes([data[1500] ^ 1]))
        s.seek(0)
        assert s.read(1000) == data[:1000]
        with pytest.raises(publish.Changed, match="bytes 1000-1999 are not the ones checked"):
            s.read(1)
        os.truncate(tmp_path / "f", 4200)
        s.seek(4000)
        with pytest.raises(publish.Changed, match="4200 bytes long now, 4500 checked"):
            s.read()
    finally:
        s.close()


def test_t2_a_small_file_rewritten_during_the_upload_is_committed_as_checked(dst, fake_hub):
    """T2: chat_template.jinja rewritten while upload waits on the Hub was committed as rewritten
    (huggingface_hub reads an inline file at commit time). It is sent as the bytes checked."""
    path = os.path.join(dst, "chat_template.jinja")
    with open(path, "rb") as f:
        checked = f.read()

    def rewrite(method, p):
        if p.endswith("/preupload/main"):
            with open(path, "w") as f:
                f.write("{{ something else }}")

    fake_hub.on_request = rewrite
    res = _cli_upload(dst, fake_hub)
    assert res.exit_code == 0, res.output
    assert _committed(fake_hub)["chat_template.jinja"] == checked


class _Interrupting(RecordingApi):
    """An HfApi (as the CLI makes it) whose create_repo is where Ctrl-C lands."""

    def __init__(self, *a, **kw):
        super().__init__()

    def create_repo(self, repo_id, **kw):
        raise KeyboardInterrupt


def test_t15_ctrl_c_during_upload_exits_130(dst, monkeypatch):
    """T15: Ctrl-C during `upload` exited 1 "Aborted!"; README promises 130 and how to resume.
    The read lock goes with it."""
    import huggingface_hub

    from converter.state.locks import writing

    monkeypatch.setattr(huggingface_hub, "HfApi", _Interrupting)
    res = CliRunner().invoke(main, ["upload", dst, REPO])
    assert res.exit_code == 130, res.output
    assert _one_line(res) == "k3convert: interrupted; run the same command again to resume"
    assert "Aborted" not in res.output
    with writing(dst):  # nobody holds DST
        pass


@pytest.mark.parametrize("inherited", ["default", "ignored"], ids=["foreground", "background job"])
def test_t15_sigint_to_the_upload_process_exits_130(dst, fake_hub, inherited):
    """T15 as a user meets it: SIGINT (Ctrl-C at a terminal) to `python -m converter upload` while it
    waits on the Hub. The test ran it as a child of pytest, which inherits pytest's SIGINT: where
    pytest runs as a background job of a script (SIGINT ignored) the child ignored the signal too and
    ran on until the fake Hub's 60 s hold ended (issue 40: the flake). The child now gets SIGINT as a
    terminal gives it (``sigint.interruptible_children``), and every wait is long enough for a loaded
    machine; the Hub holds the upload until the test ends, so an ignored signal cannot pass unseen."""
    import signal
    import subprocess
    import sys
    import time

    from sigint import interruptible_children

    waiting, release = threading.Event(), threading.Event()

    def hold(method, path):
        if path.endswith("/preupload/main"):
            waiting.set()
            release.wait(900)

    fake_hub.on_request = hold
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if inherited == "ignored" else signal.default_int_handler)
    try:
        with interruptible_children():
            proc = subprocess.Popen([sys.executable, "-m", "converter", "upload", dst, REPO, "--token",
                                     "hf_fake_token"], cwd=str(support.REPO),
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        assert waiting.wait(600), proc.communicate(timeout=600)  # start-up and verify: minutes on a loaded machine
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1] == "k3convert: interrupted; run the same command again to resume", err
    assert fake_hub.commits == []


@pytest.fixture
def read_only_view(tmp_path):
    """``view(path)``: a read-only bind mount of a folder (root only), as published storage is."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root: a read-only bind mount")
    mounts: list[str] = []

    def view(path: str) -> str:
        mnt = str(tmp_path / f"ro{len(mounts)}")
        os.makedirs(mnt)
        try:
            subprocess.run(["mount", "--bind", path, mnt], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"cannot bind-mount: {getattr(e, 'stderr', e)}")
        mounts.append(mnt)
        subprocess.run(["mount", "-o", "remount,ro,bind", mnt], check=True, capture_output=True)
        return mnt

    yield view
    for m in reversed(mounts):
        subprocess.run(["umount", m], capture_output=True)


@pytest.mark.parametrize("state", ["with its state folder", "a snapshot without it"])
def test_t17_a_read_only_dst_is_published(dst, fake_hub, read_only_view, state):
    """T17: upload from a read-only DST failed on the lock file. Where DST cannot be written no
    lock file is made (an existing one is taken read-only) and the card is sent, not written."""
    from converter.state.locks import writing

    if state == "a snapshot without it":
        shutil.rmtree(os.path.join(dst, ".k3convert"))
    ro = read_only_view(dst)
    with pytest.raises(OSError):
        open(os.path.join(ro, "x"), "w")
    if state == "with its state folder":  # the lock still works: a run changing DST keeps the upload out
        with writing(dst):
            res = _cli_upload(ro, fake_hub)
        assert res.exit_code == 4 and "a k3convert run is changing it" in _one_line(res), res.output
    res = _cli_upload(ro, fake_hub)
    assert res.exit_code == 0, res.output
    assert f"README.md: {hub_module.NOT_WRITTEN}" in res.stdout
    sent = _committed(fake_hub)
    assert "group size 32, symmetric" in sent["README.md"].decode()
    assert not os.path.exists(os.path.join(dst, "README.md"))
    for name, rec in _manifest(dst)["shards"].items():
        assert len(sent[name]) == rec["bytes"]


def test_auth_a_refused_token_exits_2_before_anything_is_written_or_hashed(dst, fake_hub, monkeypatch):
    """Issue 33 §3: the token was first used after verify and hashing. Checked once DST verifies:
    a refused token is exit 2, one line, no card written, nothing hashed or sent."""
    def hashed(*a):
        raise AssertionError("hashed before the token was checked")

    monkeypatch.setattr(publish, "read_file", hashed)
    res = _cli_upload(dst, fake_hub, token="hf_wrong")
    assert res.exit_code == 2, res.output
    err = _one_line(res)
    assert "the Hub refused the token (HTTP 401" in err and "hf auth login" in err, err
    assert not os.path.exists(os.path.join(dst, "README.md")) and fake_hub.created == []


def test_auth_no_token_or_a_read_only_one_exits_2(dst, fake_hub, monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "nowhere" / "token"))
    res = CliRunner().invoke(main, ["upload", dst, REPO], env={"HF_ENDPOINT": fake_hub.url})
    assert res.exit_code == 2 and "no Hugging Face token" in _one_line(res), res.output
    fake_hub.tokens["hf_reader"] = "read"
    res = _cli_upload(dst, fake_hub, token="hf_reader")
    assert res.exit_code == 2 and "is read-only: upload needs a write token" in _one_line(res), res.output
    assert fake_hub.created == []


def test_network_a_refused_connection_is_exit_4_with_the_cause(dst, monkeypatch, loopback_only):
    """Issue 33 §3: a refused connection exited 1 "run the same command again to resume". It is
    the I/O exit code, 4, with the cause; nothing was started, so nothing to resume."""
    import huggingface_hub.constants as constants

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nobody listens there
    monkeypatch.setattr(constants, "ENDPOINT", url)
    res = CliRunner().invoke(main, ["upload", dst, REPO, "--token", "hf_fake_token"], env={"HF_ENDPOINT": url})
    assert res.exit_code == 4, res.output
    err = _one_line(res)
    assert f"cannot reach {url}" in err and "Connection refused" in err and "resume" not in err, err


class _ConnectionLost(RecordingApi):
    def __init__(self, *a, **kw):
        super().__init__()

    def preupload_lfs_files(self, repo_id, additions, **kw):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_network_lost_during_the_upload_is_exit_4_and_resumable(dst, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _ConnectionLost)
    res = CliRunner().invoke(main, ["upload", dst, REPO])
    assert res.exit_code == 4, res.output
    err = _one_line(res)
    assert "Connection reset by peer" in err and err.endswith("Run the same command again to resume"), err


# ----------------------------------------------------------------------------- issue 40 (H8, H12)

def _nothing_done(dst, hub) -> None:
    """No card written into DST, no repository made, nothing sent or committed."""
    assert not os.path.exists(os.path.join(dst, "README.md"))
    assert hub.created == [] and hub.lfs == {} and hub.commits == []


@pytest.mark.parametrize("repo", ["someone/name.", "someone/.x", "someone/naïve", "someone/a--b", "someone/x.git",
                                  "name."])
def test_h12_a_repo_id_the_hub_refuses_is_refused_before_anything(dst, fake_hub, repo):
    """H12: `name.`, `.x`, `naïve` passed upload's own check, then failed at create_repo after the card was
    written and every file hashed, exit 1 "run the same command again to resume". The Hub's rules are
    checked first: exit 2, one line, not a request made."""
    res = CliRunner().invoke(main, ["upload", dst, repo, "--token", "hf_fake_token"], env={"HF_ENDPOINT": fake_hub.url})
    assert res.exit_code == 2, res.output
    err = _one_line(res)
    assert f"{repo!r} is not a Hub repo id OWNER/NAME" in err and "resume" not in err, err
    assert fake_hub.requests == []
    _nothing_done(dst, fake_hub)


def _fine_grained(*scopes: tuple[str, str, list[str]]) -> dict:
    """whoami's accessToken for a fine-grained token: (entity type, entity name, permissions) each."""
    return {"displayName": "fg", "role": "fineGrained", "fineGrained": {
        "canReadGatedRepos": True, "global": ["discussion.write", "post.write"],
        "scoped": [{"entity": {"_id": "0" * 24, "type": t, "name": n}, "permissions": p} for t, n, p in scopes]}}


READ_ONLY = ["repo.content.read", "repo.access.read"]
WRITE = ["repo.content.read", "repo.write"]


@pytest.mark.parametrize("scopes", [
    [("user", "someone", READ_ONLY)],                            # read-only on the owner
    [("org", "another-org", WRITE), ("user", "someone", READ_ONLY)],  # write elsewhere only
    [("model", "someone/other-model", WRITE)],                   # write on another repository
    [],
], ids=["read-only", "write-elsewhere", "another-repo", "no-scope"])
def test_h12_a_fine_grained_token_that_cannot_write_is_refused_before_any_work(dst, fake_hub, monkeypatch, scopes):
    """H12: a fine-grained token without write access to the repository failed after hashing every file.
    Its grants are read from whoami first: exit 2, one line naming the repository, nothing hashed."""
    def hashed(*a):
        raise AssertionError("hashed before the token was checked")

    monkeypatch.setattr(publish, "read_file", hashed)
    fake_hub.tokens["hf_fg"] = _fine_grained(*scopes)
    res = _cli_upload(dst, fake_hub, token="hf_fg")
    assert res.exit_code == 2, res.output
    err = _one_line(res)
    assert f"the fine-grained token 'fg' cannot write to {REPO}" in err and "resume" not in err, err
    _nothing_done(dst, fake_hub)


@pytest.mark.parametrize("scopes", [
    [("user", "someone", WRITE)], [("model", REPO, WRITE)], [("org", "x", READ_ONLY), ("user", "someone", WRITE)],
], ids=["owner", "the-repo", "among-others"])
def test_h12_a_fine_grained_token_that_can_write_uploads(dst, fake_hub, scopes):
    fake_hub.tokens["hf_fg"] = _fine_grained(*scopes)
    res = _cli_upload(dst, fake_hub, token="hf_fg")
    assert res.exit_code == 0, res.output
    assert len(fake_hub.commits) == 1


@pytest.mark.parametrize("status, resumable", [(400, False), (403, False), (404, False), (412, True), (429, True),
                                               (503, True)])
def test_h12_only_a_failure_a_rerun_can_get_past_promises_a_resume(dst, fake_hub, status, resumable):
    """H12: every Hub refusal said "run the same command again to resume", which cannot work for a
    400/403/404. Only the network and HTTP 408/409/412/429/5xx say it (412: the branch moved since it was
    listed: a rerun lists it again); 401/403 is the token's (exit 2)."""
    fake_hub.fail_commit = status
    res = _cli_upload(dst, fake_hub)
    err = _one_line(res)
    assert res.exit_code == (1 if status != 403 else 2), res.output
    assert f"HTTP {status}" in err and ("Run the same command again to resume" in err) == resumable, err
    assert fake_hub.commits == []


STALE = ["model-00004-of-00004.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json", "sub/old.gguf"]


def test_h8_other_weight_files_in_the_repository_are_refused_before_any_work(dst, fake_hub, monkeypatch):
    """H8: a repository holding an old fourth shard and pytorch_model.bin kept them beside the new model,
    unmentioned: a loader may take them. They are named and refused (exit 2) before anything is
    written, hashed or sent; files the upload replaces and files that are not weights are no reason."""
    def hashed(*a):
        raise AssertionError("hashed before the repository was checked")

    monkeypatch.setattr(publish, "read_file", hashed)
    fake_hub.files[REPO] = [".gitattributes", "README.md", "config.json", "model-00001-of-00003.safetensors",
                            "model.safetensors.index.json", "notes.txt", *STALE]
    for args in ([], ["--revision", "int4-v2"]):  # a new branch starts from the default one: the same files
        res = _cli_upload(dst, fake_hub, *args)
        assert res.exit_code == 2, res.output
        err = _one_line(res)
        assert f"holds weight files this upload does not replace: {', '.join(sorted(STALE))};" in err, err
        assert "--delete-stale" in err and "resume" not in err, err
        _nothing_done(dst, fake_hub)


def test_h8_delete_stale_removes_them_in_the_same_commit(dst, fake_hub):
    fake_hub.files[REPO] = [".gitattributes", "config.json", "model-00001-of-00003.safetensors", *STALE]
    res = _cli_upload(dst, fake_hub, "--delete-stale")
    assert res.exit_code == 0, res.output
    assert f"note: deleted {len(STALE)} other weight file(s) in the same commit (--delete-stale): " in res.stdout
    (commit,) = fake_hub.commits
    assert sorted(x["value"]["path"] for x in commit["lines"] if x["key"] == "deletedFile") == sorted(STALE)
    header = next(x["value"] for x in commit["lines"] if x["key"] == "header")
    assert header.get("parentCommit") == "c" * 40  # the commit the files were listed at: a push since is refused
    assert "model-00001-of-00003.safetensors" in _committed(fake_hub)


def test_h8_a_repository_without_other_weights_or_none_at_all_uploads(dst, fake_hub):
    fake_hub.files[REPO] = [".gitattributes", "README.md", "model-00002-of-00003.safetensors"]
    assert _cli_upload(dst, fake_hub).exit_code == 0
    del fake_hub.files[REPO]
    fake_hub.commits.clear()
    res = _cli_upload(dst, fake_hub)
    assert res.exit_code == 0 and "deleted" not in res.stdout, res.output
