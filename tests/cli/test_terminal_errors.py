"""Output that cannot be written (a full device, a closed pipe) and a temporary directory that cannot
take the demo: one error line, the documented exit code, never a traceback; a finished conversion is
not failed for its log (docs/reliability.md T10, T14). Commands whose real standard streams matter run
in their own process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
from dst_helpers import REPO, complete, mounted_tmpfs, verified

from tests.conftest import assert_clean_error, run_cli


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """The command line in its own process (its real standard streams)."""
    return subprocess.run([sys.executable, "-m", "converter", *args], cwd=REPO, env={**os.environ, **(env or {})},
                          timeout=300, check=False, **kw)


def one_error_line(stderr: str, *needles: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [x for x in lines if x.startswith("k3convert: error:")]
    assert len(errors) == 1, stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


# ---------------------------------------- T14: demo where TMPDIR cannot take it

def test_t14_demo_without_a_usable_tmpdir_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    r = run_cli("demo")
    assert_clean_error(r, "temporary directory", code=4)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only), unmounted afterwards."""
    with mounted_tmpfs(str(tmp_path / "tmpfs"), "1m") as mnt:
        yield mnt


def test_t14_demo_with_a_full_tmpdir_exits_4_in_one_line(small_tmpfs, monkeypatch):
    with open(os.path.join(small_tmpfs, "fill"), "wb") as f:
        f.write(b"\0" * (800 << 10))   # room for the folder, not for the fixture
    monkeypatch.setattr(tempfile, "tempdir", small_tmpfs)
    r = run_cli("demo")
    assert r.exit_code == 4 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert one_error_line(r.stderr, "No space left on device") == r.stderr.strip().splitlines()[-1]
    assert os.listdir(small_tmpfs) == ["fill"]   # the demo's folder is removed


# ---------------------------------------- T10: output that cannot be written

def test_t10_inspect_json_to_a_full_device_is_one_line(converted):
    with open("/dev/full", "w") as full:
        r = cli("inspect", "--json", converted.dst, stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 4, r.stderr
    one_error_line(r.stderr, "could not be written", "No space left on device")


def test_t10_verify_into_a_closed_pipe_says_so(converted):
    read, write = os.pipe()
    os.close(read)   # `| head -0`: the reader is gone before the first line
    try:
        r = cli("verify", converted.dst, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert r.returncode == 4, r.stderr
    one_error_line(r.stderr, "could not be written", "Broken pipe")


def test_t10_a_finished_conversion_is_not_failed_for_its_log(fixture_src, tmp_path):
    dst = str(tmp_path / "dst")
    with open("/dev/full", "w") as full:
        r = cli("mxfp4-to-int4", fixture_src, "-o", dst, "--devices", "cpu", stdout=full, stderr=full)
    assert r.returncode == 0
    assert complete(dst)
    verified(dst, fixture_src)
