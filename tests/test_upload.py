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


def test_upload_large_folder_is_used_when_the_library_has_it(dst):
    """huggingface_hub < 2: create_repo(exist_ok) then upload_large_folder(repo_type='model', ...)."""
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
