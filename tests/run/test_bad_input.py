"""Broken or foreign sources: one clear error naming the file (and tensor), a non-zero exit,
nothing in DST that looks complete, and the source left exactly as it was."""
from __future__ import annotations

import os
import re

import pytest
import torch

from converter.errors import BadInput
from tests.conftest import (
    INDEX,
    all_tensors,
    assert_clean_error,
    assert_not_complete,
    expert_modules,
    raw_header,
    read_json,
    rewrite_shard,
    run_cli,
    shard_names,
    sync_index,
    tree_hash,
    write_json,
)

CODE = BadInput.exit_code


def refused(src: str, tmp_path, *needles: str, one_line: bool = True, workers: int = 1) -> str:
    """Run the CLI on a broken SRC; check the refusal and its aftermath. Returns the message."""
    before = tree_hash(src)
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--workers", workers)
    assert CODE != 0
    err = assert_clean_error(r, *needles, code=CODE, one_line=one_line)
    assert_not_complete(dst)
    assert tree_hash(src) == before, "source modified"
    return err


def expert_shard(src: str) -> tuple[str, str]:
    """(path of a shard holding experts, one expert module in it)."""
    modules = expert_modules(src)
    module = sorted(modules)[0]
    return os.path.join(src, modules[module]), module


def named_tensor(err: str) -> str:
    m = re.search(r"tensor (\S+?):", err)
    assert m, err
    return m.group(1)


# ------------------------------------------------------------------ shards and index

def test_missing_shard(src_copy, tmp_path):
    path, _ = expert_shard(src_copy)
    os.unlink(path)
    err = refused(src_copy, tmp_path, f"file {path}", "missing")
    assert INDEX in err


def test_tensor_in_index_not_in_shard(src_copy, tmp_path):
    wm = read_json(os.path.join(src_copy, INDEX))["weight_map"]
    name = sorted(n for n in wm if n.endswith("input_layernorm.weight"))[-1]
    path = os.path.join(src_copy, wm[name])
    rewrite_shard(path, lambda t: t.pop(name))  # the index still lists it
    refused(src_copy, tmp_path, f"file {path}", f"tensor {name}", INDEX)


def test_truncated_shard_data(src_copy, tmp_path):
    path, _ = expert_shard(src_copy)
    header, start = raw_header(path)
    size = os.path.getsize(path) - 1000
    os.truncate(path, size)
    cut = {k for k, v in header.items() if k != "__metadata__" and start + v["data_offsets"][1] > size}
    err = refused(src_copy, tmp_path, f"file {path}", "truncated")
    assert named_tensor(err) in cut


def test_truncated_inside_header(src_copy, tmp_path):
    path, _ = expert_shard(src_copy)
    os.truncate(path, 40)
    refused(src_copy, tmp_path, f"file {path}", "truncated")


def test_corrupt_header_json(src_copy, tmp_path):
    path, _ = expert_shard(src_copy)
    with open(path, "r+b") as f:
        f.seek(8)
        assert f.read(1) == b"{"
        f.seek(9)
        f.write(b"\x01")  # a control byte where the first key's quote was
    refused(src_copy, tmp_path, f"file {path}", "header")


# ------------------------------------------------------------------ tensor contents

def _poke_scale(src: str, value: int, group: int) -> tuple[str, str]:
    """Set one E8M0 scale byte of one expert, in place. Returns (shard path, scale tensor name)."""
    path, module = expert_shard(src)
    name = f"{module}.weight_scale"
    header, start = raw_header(path)
    with open(path, "r+b") as f:
        f.seek(start + header[name]["data_offsets"][0] + group)
        f.write(bytes([value]))
    return path, name


@pytest.mark.parametrize("workers", [1, 2])  # found in-process, and in a worker process
def test_nan_scale_byte(src_copy, tmp_path, workers):
    path, name = _poke_scale(src_copy, 255, group=5)
    refused(src_copy, tmp_path, f"file {path}", f"tensor {name}", "255", workers=workers)
    assert not os.path.exists(os.path.join(tmp_path, "dst", os.path.basename(path)))


def test_scale_exponent_zero_in_nonzero_block(src_copy, tmp_path):
    """2^-127 times any nonzero E2M1 value needs an int4 scale below bf16's normal range."""
    _, module = expert_shard(src_copy)
    codes = all_tensors(src_copy)[f"{module}.weight_packed"][1]
    assert bool((codes[0, 16:32] & 0x77 != 0).any())  # group 1 of row 0 is not all (+/-)zero
    path, name = _poke_scale(src_copy, 0, group=1)
    refused(src_copy, tmp_path, f"file {path}", f"tensor {name}")
    assert not os.path.exists(os.path.join(tmp_path, "dst", os.path.basename(path)))


def test_in_dim_not_multiple_of_32(src_copy, tmp_path):
    path, module = expert_shard(src_copy)
    packed = f"{module}.weight_packed"

    def edit(t):
        rows = t[packed].shape[0]
        t[packed] = t[packed][:, :24].clone()                      # in = 48
        t[f"{module}.weight_scale"] = t[f"{module}.weight_scale"][:, :1].clone()
        assert rows == t[packed].shape[0]
    rewrite_shard(path, edit)
    sync_index(src_copy)
    refused(src_copy, tmp_path, f"file {path}", f"tensor {packed}", "48", "32")


def test_packed_scale_shape_mismatch(src_copy, tmp_path):
    path, module = expert_shard(src_copy)
    scale = f"{module}.weight_scale"

    def edit(t):
        s = t[scale]
        t[scale] = torch.cat([s, s[:, :1]], dim=1)  # one group too many
    rewrite_shard(path, edit)
    sync_index(src_copy)
    refused(src_copy, tmp_path, f"file {path}", f"tensor {module}.weight_packed", "scale")


# ------------------------------------------------------------------ config

@pytest.mark.parametrize("kind", ["fp8", "none", "already-int4"])
def test_not_an_mxfp4_checkpoint(src_copy, tmp_path, converted, kind):
    if kind == "already-int4":  # the converter's own output is not a source
        src = converted.dst
    else:
        src = src_copy
        cfg_path = os.path.join(src, "config.json")
        cfg = read_json(cfg_path)
        if kind == "fp8":
            cfg["text_config"]["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        else:
            del cfg["text_config"]["quantization_config"]
        write_json(cfg_path, cfg)
    err = refused(src, tmp_path, f"file {os.path.join(src, 'config.json')}")
    assert "mxfp4" in err.lower()


@pytest.mark.parametrize("missing", ["hidden_act", "activation_situ_beta"])
def test_activation_not_stated(src_copy, tmp_path, missing):
    cfg_path = os.path.join(src_copy, "config.json")
    cfg = read_json(cfg_path)
    del cfg["text_config"][missing]
    assert missing not in cfg
    write_json(cfg_path, cfg)
    refused(src_copy, tmp_path, f"file {cfg_path}", missing)


# ------------------------------------------------------------------ all problems at once

def test_preflight_reports_every_problem(src_copy, tmp_path):
    names = shard_names(src_copy)
    assert len(names) >= 3
    paths = [os.path.join(src_copy, n) for n in names]
    os.unlink(paths[0])                                    # missing
    os.truncate(paths[1], os.path.getsize(paths[1]) - 1)   # truncated
    with open(paths[2], "r+b") as f:                       # corrupt header
        f.seek(9)
        f.write(b"\x01")
    err = refused(src_copy, tmp_path, *(f"file {p}" for p in paths), one_line=False)
    assert "3 problem(s)" in err.splitlines()[0]
    assert len(err.splitlines()) == 4  # a summary line, then one line per problem
