"""Pass 2's defects of verify, finalize and upload (issue 19 §3: R6, R7, R8, R15, R17).

Each test failed on main 6a29357. A tamperer edits DST twice: once leaving the manifest as it
is (plain ``verify`` must catch it against the manifest's own record), once also making the
manifest agree (only ``verify --source`` can catch it, by recomputing from SRC what DST must
hold). Digests in the tests are computed by conftest's own ``chunked_sha256``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from conftest import (INDEX, MANIFEST, REPORT, TABLE, chunked_sha256, load_shard, read_json, run_cli, shard_names,
                      sync_index, write_json)
from safetensors.torch import save_file

from converter.verify import verify

REPO = Path(__file__).resolve().parents[1]
TEMPORARY = re.compile(r"\.tmp\d*$|\.partial$")


def copy_dst(converted, tmp_path) -> str:
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    return dst


def restamp(dst: str, *rels: str) -> None:
    """Make the manifest's record of each file agree with the file as it now is (a careful tamperer)."""
    m = read_json(os.path.join(dst, MANIFEST))
    for rel in rels:
        for table in ("shards", "files"):
            if rel in m.get(table, {}):
                path = os.path.join(dst, rel)
                m[table][rel].update(bytes=os.path.getsize(path), digest=chunked_sha256(path))
    write_json(os.path.join(dst, MANIFEST), m)


def problems(dst: str) -> list[str]:
    """What plain verify finds: DST against its own manifest."""
    return verify(dst).problems


def cli_verify(dst: str, source: str | None = None):
    return run_cli("verify", dst, *(("--source", source, "--all") if source else ()))


def temporaries(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if TEMPORARY.search(f))


# ------------------------------------------------------------------------------ R6: config fields

@pytest.mark.parametrize("field,value", [("num_experts_per_token", 3), ("moe_intermediate_size", 128),
                                         ("num_hidden_layers", 2)])
def test_r6_config_fields_outside_the_quantization_block(converted, tmp_path, field, value):
    dst = copy_dst(converted, tmp_path)
    path = os.path.join(dst, "config.json")
    cfg = read_json(path)
    assert field in cfg["text_config"] and cfg["text_config"][field] != value
    cfg["text_config"][field] = value
    write_json(path, cfg)
    assert any("config.json" in p for p in problems(dst)), "plain verify: config.json against the manifest"
    restamp(dst, "config.json")
    assert problems(dst) == []  # the manifest now agrees: only SRC can tell
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5, r.output
    assert f"text_config.{field}" in r.output and "config.json" in r.output, r.output


def test_r6_verify_source_passes_an_untouched_dst(converted):
    """The guard: recomputing DST from SRC agrees with what the converter wrote, field for field."""
    r = cli_verify(converted.dst, converted.src)
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------------------ R7: side files

@pytest.mark.parametrize("name", ["modeling_kimi_k3.py", "chat_template.jinja", "tokenizer_config.json"])
def test_r7_side_files_are_byte_identical(converted, tmp_path, name):
    dst = copy_dst(converted, tmp_path)
    with open(os.path.join(dst, name), "ab") as f:
        f.write(b"\n# edited\n")
    assert any(name in p for p in problems(dst)), "plain verify: the side file against the manifest"
    restamp(dst, name)
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5 and name in r.output, r.output


def test_r7_side_file_removed_or_not_from_source(converted, tmp_path):
    """A side file missing from DST, and one in DST (named by the manifest) that SRC does not have."""
    dst = copy_dst(converted, tmp_path)
    os.unlink(os.path.join(dst, "chat_template.jinja"))
    assert any("chat_template.jinja" in p for p in problems(dst))
    dst2 = str(tmp_path / "dst2")
    shutil.copytree(converted.dst, dst2)
    with open(os.path.join(dst2, "extra.py"), "w") as f:
        f.write("print('not from SRC')\n")
    m = read_json(os.path.join(dst2, MANIFEST))
    m.setdefault("files", {})["extra.py"] = {}
    write_json(os.path.join(dst2, MANIFEST), m)
    restamp(dst2, "extra.py")
    r = cli_verify(dst2, converted.src)
    assert r.exit_code == 5 and "extra.py" in r.output, r.output


# ------------------------------------------------------------------------------ R8: a removed shard

def _remove_shard_with_its_traces(dst: str, shard: str) -> None:
    """The reproduction: the shard, its manifest entry, index entries, total_size, table rows and report count."""
    gone = {n for n, s in read_json(os.path.join(dst, INDEX))["weight_map"].items() if s == shard}
    size = sum(t.nbytes for t in _header_tensors(os.path.join(dst, shard)))
    os.unlink(os.path.join(dst, shard))
    index = read_json(os.path.join(dst, INDEX))
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard}
    index["metadata"]["total_size"] -= size
    write_json(os.path.join(dst, INDEX), index)
    table = os.path.join(dst, TABLE)
    with open(table, "rb") as f:
        rows = [json.loads(x) for x in zstandard.ZstdDecompressor().decompress(f.read()).splitlines() if x]
    rows = [r for r in rows if r["name"] not in gone]
    with open(table, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    report = read_json(os.path.join(dst, REPORT))
    report["tensors"] = len(rows)
    write_json(os.path.join(dst, REPORT), report)
    m = read_json(os.path.join(dst, MANIFEST))
    del m["shards"][shard]
    write_json(os.path.join(dst, MANIFEST), m)
    restamp(dst, INDEX, TABLE, REPORT)


def _header_tensors(path: str):
    from converter.formats.safetensors_io import read_header
    return read_header(path).tensors.values()


def test_r8_a_removed_shard_with_its_traces_fails(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    shard = shard_names(dst)[-1]
    _remove_shard_with_its_traces(dst, shard)
    found = problems(dst)
    assert any(shard in p for p in found), found  # the manifest's source still lists it
    m = read_json(os.path.join(dst, MANIFEST))
    del m["source"]["shards"][shard]
    write_json(os.path.join(dst, MANIFEST), m)
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5 and shard in r.output, r.output


@pytest.mark.parametrize("edit", ["drop a bf16 tensor", "shard metadata"])
def test_r8_verify_source_holds_each_shard_to_the_layout_src_gives(converted, tmp_path, edit):
    """Every module SRC gives, in its shard, with the shard's metadata: a passthrough tensor
    removed (index, total_size and digests made to agree) or a metadata field changed fails."""
    dst = copy_dst(converted, tmp_path)
    wm = read_json(os.path.join(dst, INDEX))["weight_map"]
    name = next(n for n in sorted(wm) if n.endswith("norm.weight"))
    shard = wm[name]

    def change(tensors, meta):
        if edit == "drop a bf16 tensor":
            del tensors[name]
        else:
            meta["quantization"] = "bf16"

    tensors, meta = load_shard(os.path.join(dst, shard))
    change(tensors, meta)
    save_file(tensors, os.path.join(dst, shard), metadata=meta)
    sync_index(dst)
    restamp(dst, shard, INDEX)
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5, r.output
    assert shard in r.output and (name if edit == "drop a bf16 tensor" else "metadata.quantization") in r.output, r.output


# ------------------------------------------------------------------------------ R15: files nobody names

@pytest.mark.parametrize("name", ["model-00004-of-00003.safetensors", "notes.txt", "sub/extra.safetensors"])
def test_r15_a_file_nobody_names_fails_verify_and_upload(converted, tmp_path, name):
    dst = copy_dst(converted, tmp_path)
    os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
    shutil.copy(os.path.join(dst, shard_names(dst)[0]), os.path.join(dst, name))
    r = cli_verify(dst)
    assert r.exit_code == 5 and name in r.output, r.output
    r = run_cli("upload", dst, "someone/k3-int4", "--dry-run")
    assert r.exit_code == 5 and name in r.output, r.output


class _Api:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kw):
        return f"https://hub.invalid/{repo_id}"

    def upload_folder(self, **kw):
        self.calls.append(kw)


def test_r15_upload_sends_exactly_the_files_verify_accepted(converted, tmp_path):
    """Temporaries are named by verify (not part of the output) and never sent; every other file
    sent is one verify accepted, and each accepted one is sent."""
    from huggingface_hub.utils import filter_repo_objects

    from converter.hub import upload

    dst = copy_dst(converted, tmp_path)
    for rel in ("config.json.tmp4242", shard_names(dst)[1] + ".partial"):
        open(os.path.join(dst, rel), "wb").close()
    accepted = verify(dst, checksums=False)
    assert accepted.ok, accepted.problems
    api = _Api()
    res = upload(dst, "someone/k3-int4", api=api)
    everything = sorted(os.path.relpath(os.path.join(d, f), dst) for d, _, fs in os.walk(dst) for f in fs)
    kw = api.calls[0]
    sent = sorted(filter_repo_objects(everything, allow_patterns=kw.get("allow_patterns"),
                                      ignore_patterns=kw.get("ignore_patterns")))
    assert sent == sorted(accepted.files + ["README.md"]) == sorted(p for p, _ in res.files)


# ------------------------------------------------------------------------------ R17: a killed finalize

_KILLED_FINALIZE = """
import os, signal, sys
from converter import pipeline
real = os.replace
def replace(a, b, *k, **kw):  # SIGKILL inside finalize's commit, before the first rename
    if os.path.basename(b) == "tokenizer_config.json":
        os.kill(os.getpid(), signal.SIGKILL)
    return real(a, b, *k, **kw)
os.replace = replace
pipeline.finalize(sys.argv[1])
"""


def test_r17_the_completing_finalize_removes_a_killed_finalizes_temporaries(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    os.unlink(os.path.join(dst, "tokenizer_config.json"))  # so that the killed finalize stages a side file too
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", _KILLED_FINALIZE, dst], env=env, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    left = temporaries(dst)
    assert any(t.startswith("tokenizer_config.json.tmp") for t in left), left
    assert any(t.startswith(MANIFEST + ".tmp") for t in left), left
    r = run_cli("finalize", dst)
    assert r.exit_code == 0, r.output
    assert temporaries(dst) == []
    assert cli_verify(dst, converted.src).exit_code == 0


def test_r17_verify_names_temporaries_left_in_a_complete_dst(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    left = ["config.json.tmp4242", "chat_template.jinja.tmp4242", shard_names(dst)[0] + ".partial"]
    for rel in left:
        open(os.path.join(dst, rel), "wb").close()
    r = cli_verify(dst)
    assert r.exit_code == 0, r.output  # never part of the output, never uploaded: named, not failed
    for rel in left:
        assert rel in r.output, (rel, r.output)
    assert not set(left) & set(verify(dst).files)
