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


from hub_standin import RecordingApi as _Api  # noqa: E402 (records what upload sends; no network)


def test_r15_upload_sends_exactly_the_files_verify_accepted(converted, tmp_path):
    """Temporaries are named by verify (not part of the output) and never sent; every other file
    sent is one verify accepted, and each accepted one is sent."""
    from converter.hub import upload

    dst = copy_dst(converted, tmp_path)
    for rel in ("config.json.tmp4242", shard_names(dst)[1] + ".partial"):
        open(os.path.join(dst, rel), "wb").close()
    accepted = verify(dst, checksums=False)
    assert accepted.ok, accepted.problems
    api = _Api()
    res = upload(dst, "someone/k3-int4", api=api)
    sent = sorted(api.committed)
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


# ------------------------------------------------------------------------------ issue 32 T3: a config the loader reads otherwise

def _retarget(dst: str, edit) -> None:
    """Edit DST's int4 block, then make the manifest agree (a careful tamperer)."""
    path = os.path.join(dst, "config.json")
    cfg = read_json(path)
    edit(cfg["text_config"]["quantization_config"])
    write_json(path, cfg)
    restamp(dst, "config.json")


def _bf16_linears(dst: str) -> list[str]:
    """DST's bf16 modules with a 2-D weight: torch Linears to compressed-tensors' loader."""
    from safetensors import safe_open

    out = []
    for s in shard_names(dst):
        with safe_open(os.path.join(dst, s), "pt") as f:
            out += [n[:-7] for n in f.keys() if n.endswith(".weight") and len(f.get_slice(n).get_shape()) == 2]  # noqa: SIM118 (safe_open)
    return sorted(out)


def test_t3_a_linear_target_selects_the_bf16_linears(converted, tmp_path):
    """targets ["Linear"]: compressed-tensors' is_match selects every bf16 Linear for int4; plain verify,
    verify with the loader's own matcher, and upload --dry-run all refuse it."""
    from compressed_tensors.utils.match import is_match
    from torch import nn

    dst = copy_dst(converted, tmp_path)
    _retarget(dst, lambda b: b["config_groups"]["group_0"].update(targets=["Linear"]))
    block = read_json(os.path.join(dst, "config.json"))["text_config"]["quantization_config"]
    selected = [m for m in _bf16_linears(dst) if is_match(m, nn.Linear(1, 1, device="meta"), ["Linear"], block["ignore"])]
    assert selected  # what the loader does with this config
    for found in (problems(dst), verify(dst, loader_matcher=True).problems):
        assert any(f"select {len(selected)} module(s) that are not int4" in p and selected[0] in p for p in found), found
        assert any("group_0.targets is ['Linear'], the converter writes ['re:" in p for p in found), found
    r = run_cli("upload", dst, "someone/k3-int4", "--dry-run")
    assert r.exit_code == 5 and "not int4" in r.output, r.output


def test_t3_a_config_other_than_the_converters_fails_plain_verify(converted, tmp_path):
    """targets ["Linear"] with every bf16 Linear ignored by name selects exactly the converted modules
    for compressed-tensors, but vLLM asks int4 of its fused layers under names the list lacks: the
    block is held to what the converter writes for DST's modules."""
    dst = copy_dst(converted, tmp_path)
    linears = _bf16_linears(dst)

    def edit(b):
        b["config_groups"]["group_0"]["targets"] = ["Linear"]
        b["ignore"] = sorted(set(b["ignore"]) | set(linears))
    _retarget(dst, edit)
    found = problems(dst)
    assert not any("not int4" in p or "do not select" in p for p in found), found   # is_match: exactly right
    assert any("quantization_config.config_groups.group_0.targets is ['Linear'], the converter writes" in p
               for p in found), found
    r = run_cli("upload", dst, "someone/k3-int4", "--dry-run")
    assert r.exit_code == 5 and "the converter writes" in r.output, r.output


@pytest.mark.parametrize("edit, needle", [
    (lambda b: b["config_groups"]["group_0"]["weights"].update(observer="mse"), "weights.observer is 'mse'"),
    (lambda b: b.update(sparsity_config={"format": "dense"}), "sparsity_config is {'format': 'dense'}"),
    (lambda b: b["ignore"].append("re:.*experts.0.gate_proj"), "catch converted experts under the name vLLM asks"),
])
def test_t3_other_fields_the_converter_does_not_write(converted, tmp_path, edit, needle):
    dst = copy_dst(converted, tmp_path)
    _retarget(dst, edit)
    assert any(needle in p for p in problems(dst)), problems(dst)


def test_t3_the_converters_own_config_passes(converted):
    assert problems(converted.dst) == []
