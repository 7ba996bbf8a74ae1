"""Helpers shared by the behaviour test files (test_dst_identity, test_dst_writes, test_source_input,
test_source_files, test_options, test_terminal_errors, test_verify_strict, test_upload_contents): running a
conversion on the CPU, comparing a DST with a reference, editing a checkpoint's config, a profile
copy, waiting on something that may block.
"""
from __future__ import annotations

import contextlib
import filecmp
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from converter.profiles import bundled_dir
from tests.conftest import INDEX, MANIFEST, read_json, run_cli, shard_names, write_json

REPO = Path(__file__).resolve().parents[2]
TEMPORARY = re.compile(r"\.tmp\d*$|\.partial$")  # our temporaries: .tmpPID (.tmp alone: older versions), .partial
CPU = ("--devices", "cpu", "--progress", "none")
CONFIG = "config.json"
MOD = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"  # an MXFP4 expert of the session fixture


# ---------------------------------------- DST

def temporaries(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if TEMPORARY.search(f))


def same_output(dst: str, ref: str) -> None:
    """DST holds the reference conversion: every shard, index and config byte for byte, complete."""
    assert shard_names(dst) == shard_names(ref)
    for f in shard_names(ref) + [INDEX, "config.json"]:
        assert filecmp.cmp(os.path.join(dst, f), os.path.join(ref, f), shallow=False), f
    m = read_json(os.path.join(dst, MANIFEST))
    assert m["complete"] is True and sorted(m["shards"]) == shard_names(ref)
    assert not temporaries(dst)


def copy_dst(converted, tmp_path, name: str = "dst", **kw) -> str:
    """A copy of the session's conversion (mtimes kept, so its shard records still hold)."""
    dst = str(tmp_path / name)
    shutil.copytree(converted.dst, dst, **kw)
    return dst


def complete(dst: str) -> bool:
    return (read_json(os.path.join(dst, MANIFEST)) or {}).get("complete") is True


def verified(dst: str, src: str) -> None:
    r = run_cli("verify", dst, "--source", src)
    assert r.exit_code == 0, r.output


# ---------------------------------------- commands

def convert_cli(src: str, dst: str, *extra: str):
    return run_cli("mxfp4-to-int4", src, "-o", dst, *CPU, *extra)


def cli_verify(dst: str, source: str | None = None):
    return run_cli("verify", dst, *(("--source", source, "--all") if source else ()))


def dry_run(*args: str) -> dict:
    r = run_cli("mxfp4-to-int4", *args, "--dry-run", "--progress", "json", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# ---------------------------------------- config and profile edits

def edit_json(path: str, edit) -> None:
    obj = read_json(path)
    obj = edit(obj) or obj
    write_json(path, obj)


def quant_block(cfg: dict) -> dict:
    return cfg["text_config"]["quantization_config"]


def profile_copy(folder, name: str | None = None, **edits: str) -> str:
    """configs/profiles/kimi-k3.toml copied into ``folder`` (as k3.toml), optionally renamed."""
    os.makedirs(folder, exist_ok=True)
    text = open(os.path.join(bundled_dir(), "kimi-k3.toml")).read()
    if name:
        assert 'name = "kimi-k3"' in text
        text = text.replace('name = "kimi-k3"', f'name = "{name}"')
    path = os.path.join(folder, "k3.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


# ---------------------------------------- what may block

def in_thread(fn, timeout: float, release=lambda: None):
    """``fn()`` on a thread; if it is still running after ``timeout`` s, ``release()`` (e.g.
    open a FIFO's other end) lets it go, and the test fails: it would have hung."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        release()
        t.join(30)
        pytest.fail(f"still running after {timeout} s: it would wait for ever")
    return out["r"]


def release_fifo(path: str):
    def go():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    return go


@contextlib.contextmanager
def mounted_tmpfs(folder: str, size: str):
    """A tmpfs of ``size`` (``1m``) mounted at the new folder ``folder``, unmounted afterwards; the test is
    skipped where it cannot be mounted (not root)."""
    os.makedirs(folder)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", folder], capture_output=True, check=False)
