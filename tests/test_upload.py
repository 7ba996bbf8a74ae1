"""`k3convert upload`: refusals, the model card, the dry run, and the upload itself.

The real Hugging Face Hub is NOT reached by any test here. The upload test runs
huggingface_hub's own client against a small fake Hub on 127.0.0.1 (http.server in a
thread, HfApi(endpoint=...) and huggingface_hub.constants.ENDPOINT pointed at it) that
implements just what create_repo, create_branch and upload_folder call: repo creation,
branch creation, README YAML validation, preupload, the LFS batch API, LFS PUT, and the
ndjson commit. A socket guard fails the test on any connection that is not to loopback.

With hf_xet installed, huggingface_hub 2.x's upload_folder streams through the Xet
protocol, which this stub does not implement; the test sets HF_HUB_DISABLE_XET so the
same call takes the LFS path: the Xet transfer itself is not exercised here. The installed
huggingface_hub (2.4.0) has no `upload_large_folder`; the branch that calls it on older
versions is tested with a stand-in HfApi that records its arguments.
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

from converter.cli import main
from converter.errors import VerifyFailed
from converter.fixture import FixtureSpec, make_fixture
from converter import hub as hub_module
from converter.hub import IGNORE, model_card, upload, upload_files
from converter.manifest import MANIFEST, write_json
from converter.pipeline import Options, convert

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
    """Just enough of the Hub's HTTP API for create_repo, create_branch and upload_folder (LFS)."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict]] = []
        self.created: list[dict] = []
        self.branches: list[str] = []
        self.lfs: dict[str, bytes] = {}
        self.commits: list[dict] = []
        self.fail_commit: int | None = None  # an HTTP status to answer every commit with
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
                p = path.strip("/").split("/")
                api = len(p) == 6 and p[:2] == ["api", "models"]
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
                    return self._send(200, {"transfer": "basic", "objects": [
                        {"oid": o["oid"], "size": o["size"],
                         "actions": {"upload": {"href": f"{hub.url}/lfs-put/{o['oid']}"}}} for o in objs]})
                if method == "PUT" and path.startswith("/lfs-put/"):
                    hub.lfs[p[1]] = body
                    return self._send(200, {})
                if method == "POST" and api and p[4] == "commit" and hub.fail_commit:
                    return self._send(hub.fail_commit, {"error": "Internal Error - We're working hard to fix this"})
                if method == "POST" and api and p[4] == "commit":
                    lines = [json.loads(x) for x in body.splitlines() if x.strip()]
                    hub.commits.append({"repo": f"{p[2]}/{p[3]}", "revision": p[5], "lines": lines})
                    return self._send(200, {"commitUrl": f"{hub.url}/{p[2]}/{p[3]}/commit/{'a' * 40}",
                                            "commitOid": "a" * 40, "pullRequestUrl": None})
                return self._send(404, {"error": f"not implemented by the fake Hub: {method} {path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

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
    assert res.method == "upload_folder" and res.readme == "written"
    assert any("hf_xet" in n for n in res.notes)  # the LFS path is one commit: the user is told

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


def test_upload_large_folder_is_used_when_the_library_has_it(dst, monkeypatch):
    """huggingface_hub without the streamed upload_folder (0.x, early 1.x): create_repo(exist_ok)
    then upload_large_folder(repo_type='model', ...)."""
    monkeypatch.setattr(hub_module, "streams_upload_folder", lambda: False)
    calls = []

    class OldApi:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))
            return f"https://hub.invalid/{repo_id}"

        def upload_large_folder(self, **kw):
            calls.append(("upload_large_folder", kw))

    res = upload(dst, REPO, api=OldApi())
    assert res.method == "upload_large_folder"
    assert calls[0] == ("create_repo", REPO, {"repo_type": "model", "private": False, "exist_ok": True})
    kw = calls[1][1]
    assert kw["repo_id"] == REPO and kw["folder_path"] == os.path.abspath(dst) and kw["repo_type"] == "model"
    assert ".k3convert/**" in kw["ignore_patterns"] and "*.partial" in kw["ignore_patterns"]


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
    assert "k3convert mxfp4-to-int4 src -o dst" in card and f"vllm serve {REPO}" in card
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


def test_ignore_patterns_cover_state_and_partials(dst):
    paths = [p for p, _ in upload_files(dst)]
    assert not any(p.startswith(".k3convert/") or p.endswith(".partial") or ".tmp" in p for p in paths)
    assert ".k3convert/**" in IGNORE and "*.partial" in IGNORE


# ----------------------------------------------------------------------------- issue 24 §3, issue 25 S14/S16

def test_dry_run_shows_the_card(dst):
    """`upload --dry-run` shows the model card it would write, not just "would write"."""
    res = CliRunner().invoke(main, ["upload", dst, REPO, "--dry-run"])
    assert res.exit_code == 0, res.output
    card = model_card(dst, repo_id=REPO).splitlines()
    assert f"README.md: would write (the model card, {len(card)} lines):" in res.output
    title = next(line for line in card if line.startswith("# "))
    assert f"    {title}" in res.output and "group size 32, symmetric" in res.output
    assert f"... ({len(card) - hub_module.CARD_LINES} more lines)" in res.output
    assert not os.path.exists(os.path.join(dst, "README.md"))


def test_streamed_upload_folder_is_used_without_the_deprecation_banner(dst):
    """huggingface_hub 1.33 has both methods; its upload_large_folder prints a FutureWarning banner
    ("`upload_large_folder` is DEPRECATED ... Use `upload_folder`"). Where the installed version
    streams upload_folder (it has ``_upload_pipeline``), that is what is called."""
    import warnings

    assert hub_module.streams_upload_folder()  # the installed huggingface_hub (2.4.0) streams it
    calls = []

    class Api133:  # the two methods as 1.33 has them
        def create_repo(self, repo_id, **kw):
            return f"https://hub.invalid/{repo_id}"

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))

        def upload_large_folder(self, **kw):
            warnings.warn("\n=====\n`upload_large_folder` is DEPRECATED and will be removed in a future release.\n\n"
                          "Use `upload_folder` instead:\n=====\n", FutureWarning, stacklevel=2)
            calls.append(("upload_large_folder", kw))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = upload(dst, REPO, api=Api133())
    assert res.method == "upload_folder" and [c[0] for c in calls] == ["upload_folder"]
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    assert calls[0][1]["folder_path"] == os.path.abspath(dst) and ".k3convert/**" in calls[0][1]["ignore_patterns"]


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


class _BlockingApi:
    """A Hub that holds the upload in upload_folder until released (what a slow upload looks like)."""

    def __init__(self):
        import threading

        self.entered, self.release, self.sent = threading.Event(), threading.Event(), None

    def create_repo(self, repo_id, **kw):
        return f"https://hub.invalid/{repo_id}"

    def upload_folder(self, folder_path, allow_patterns, **kw):
        self.entered.set()
        assert self.release.wait(120)
        self.sent = {p: open(os.path.join(folder_path, p), "rb").read() for p in allow_patterns}


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
    assert done["res"].method == "upload_folder"
    assert {p: b for p, b in api.sent.items() if p != "README.md"} == before  # what verify accepted, unchanged
    assert verify(dst).ok
    # with the upload done, the overwrite goes ahead
    res = CliRunner().invoke(main, ["mxfp4-to-int4", src, "-o", dst, "--overwrite", "--scale-rule", "vllm-gfx942",
                                    "--progress", "none"])
    assert res.exit_code == 0, res.output


def test_s14_upload_is_refused_while_a_run_changes_dst(dst):
    """The other side of the lock: while a run changes DST (it holds read.lock exclusively), an
    upload is refused at once (exit 4), before it verifies or contacts the Hub."""
    from converter.manifest import writing

    with writing(dst):
        res = CliRunner().invoke(main, ["upload", dst, REPO])
    assert res.exit_code == 4 and "a k3convert run is changing it" in res.stderr, res.output
