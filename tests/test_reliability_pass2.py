"""Defects of the second adversarial pass (the second pass of docs/reliability.md, main 6a29357) that
concern what a conversion is (its identity) and what SRC is: each test failed on 6a29357.
docs/reliability.md maps each to its mechanism.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from converter.state.files import MANIFEST
from converter.state.records import read_json

from conftest import assert_clean_error, expert_modules, rewrite_shard, run_cli, shard_names, sync_index


def manifest(dst: str) -> dict:
    return read_json(os.path.join(dst, MANIFEST)) or {}


# ---------------------------------------------------------------- R1: the threshold is part of the run

def test_r1_finalize_judges_with_the_recorded_threshold(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--max-rel-rmse", "0.01", "--progress", "none")
    assert r.exit_code == 3, r.output
    r = run_cli("finalize", dst)
    assert r.exit_code == 3, r.output
    assert manifest(dst).get("complete") is not True and manifest(dst).get("status") == "failed-validation"


def test_r1_a_part_with_another_threshold_is_refused_naming_both_values(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--max-rel-rmse", "0.01", "--part", "1/3", "--progress", "none")
    assert r.exit_code == 3, r.output
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--part", "2/3", "--progress", "none")
    assert_clean_error(r, "--max-rel-rmse 0.01 (recorded) vs 0.15", dst, code=4)


# ---------------------------------------------------------------- R2: an in-place edit is seen on resume

def test_r2_in_place_edit_with_size_and_mtime_restored_is_refused(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--shards", "1", "--progress", "none")
    assert r.exit_code == 0, r.output
    shard = sorted(f for f in os.listdir(src_copy) if f.endswith(".safetensors"))[0]
    path = os.path.join(src_copy, shard)
    st = os.stat(path)
    with open(path, "r+b") as f:                    # flip one byte in the middle, keep the size
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert_clean_error(r, f"source files changed: {shard} changed", code=4)


# ---------------------------------------------------------------- R3: finalize compares SRC with run.json

def test_r3_finalize_refuses_a_changed_source(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--shards", "1", "--progress", "none")
    assert r.exit_code == 0, r.output
    shard = sorted(f for f in os.listdir(src_copy) if f.endswith(".safetensors"))[-1]
    path = os.path.join(src_copy, shard)
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 1   # another last MiB (the same bytes with another mtime are the same source: issue 32 T9)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
    r = run_cli("finalize", dst)
    assert_clean_error(r, f"no longer matches (source files changed: {shard} changed)", dst, code=4)
    assert manifest(dst).get("complete") is not True


def test_r3_finalize_of_an_unchanged_source_completes(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    for part in ("1/2", "2/2"):
        r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--part", part, "--progress", "none")
        assert r.exit_code == 0, r.output
    r = run_cli("finalize", dst)
    assert r.exit_code == 0, r.output
    assert manifest(dst).get("complete") is True


def test_identity_records_every_option_that_changes_dst(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--shards", "1", "--sample-experts", "2", "--progress", "none")
    assert r.exit_code == 0, r.output
    run = json.load(open(os.path.join(dst, ".k3convert", "run.json")))
    assert set(run["options"]) >= {"version", "sample_experts", "profile", "drop_activation_quant",
                                   "scale_rule", "max_rel_rmse"}
    # the identity is what the files hold, never where they sit (S1): no device, inode or ctime;
    # those are hints for re-reading the content, kept apart and never compared
    assert not {"dev", "inode", "ctime_ns"} & set(next(iter(run["shards"].values())))
    assert set(next(iter(run["hints"].values()))) == {"inode", "ctime_ns"}
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert_clean_error(r, "--sample-experts 2 (recorded) vs 4", code=4)


# ---------------------------------------------------------------- R4, R5: collisions refused in preflight

@pytest.mark.parametrize("suffix,dtype,same_shard", [
    ("weight_shape", torch.int64, True), ("weight_shape", torch.int64, False),   # R4
    ("weight", torch.bfloat16, True), ("weight", torch.bfloat16, False),         # R5
])
def test_r4_r5_a_tensor_colliding_with_a_converted_module_is_refused(src_copy, tmp_path, suffix, dtype, same_shard):
    module, shard = next(iter(sorted(expert_modules(src_copy).items())))
    shards = shard_names(src_copy)
    target = shard if same_shard else next(s for s in shards if s != shard)
    stray = torch.tensor([3, 4], dtype=dtype) if suffix == "weight_shape" else torch.zeros(4, 4, dtype=dtype)
    rewrite_shard(os.path.join(src_copy, target), lambda t: t.__setitem__(f"{module}.{suffix}", stray))
    sync_index(src_copy)
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert_clean_error(r, os.path.join(src_copy, target), f"tensor {module}.{suffix}", "beside the MXFP4 pair",
                       code=2)
    assert not os.path.exists(dst)


# ---------------------------------------------------------------- R13: SiTU fields are type-checked

@pytest.mark.parametrize("key,value", [("activation_situ_beta", "4.0"), ("activation_situ_beta", None),
                                       ("activation_situ_beta", True), ("hidden_act", ["situ"]),
                                       ("activation_situ_linear_beta", "25")])
def test_r13_activation_fields_of_the_wrong_type_are_refused(src_copy, tmp_path, key, value):
    path = os.path.join(src_copy, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"][key] = value
    json.dump(cfg, open(path, "w"))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--progress", "none")
    assert_clean_error(r, path, f"text_config.{key} is {value!r}", "wrong type", code=2)


def test_r13_a_null_linear_beta_is_a_stated_value(src_copy, tmp_path):
    """vLLM's SituAndMul takes linear_beta None (no clipping): a stated null converts."""
    path = os.path.join(src_copy, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"]["activation_situ_linear_beta"] = None
    json.dump(cfg, open(path, "w"))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--progress", "none")
    assert r.exit_code == 0, r.output


def test_r13_shard_metadata_states_null_as_json(src_copy, tmp_path):
    path = os.path.join(src_copy, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"]["activation_situ_linear_beta"] = None
    json.dump(cfg, open(path, "w"))
    dst = str(tmp_path / "dst")
    assert run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none").exit_code == 0
    from safetensors import safe_open
    with safe_open(os.path.join(dst, shard_names(dst)[0]), "pt") as f:
        meta = f.metadata()
    assert meta["activation_situ_linear_beta"] == "null" and meta["activation_situ_beta"] == "4.0"
    assert run_cli("verify", dst).exit_code == 0


# ---------------------------------------------------------------- R10, R12: job files typed as the CLI

@pytest.mark.parametrize("line,named", [
    ("dry-run = 1", "expected true or false"),                     # R10
    ("output = 5", "expected a string"),
    ("output = 1979-05-27", "a date or time"),
    ("max-rel-rmse = true", "expected a value, not true/false"),   # R12
    ("[[output]]\npath = 'dst2'", "a list, where one value is expected"),
    ("max-rel-rmse = 0.2\nmax_rel_rmse = 0.3", "are the same option"),
    ("sample-experts = 2.5", "expected a whole number"),
])
def test_r10_r12_job_file_values_are_typed_as_the_command_line(fixture_src, tmp_path, line, named):
    job = tmp_path / "job.toml"
    job.write_text(f'src = "{fixture_src}"\n{line}\n')
    r = run_cli("mxfp4-to-int4", "--config", job)
    err = assert_clean_error(r, str(job), named, code=2)          # one line: k3convert: error: ...
    assert "Usage:" not in r.output, err
    assert not any(p.name.startswith("{") for p in tmp_path.iterdir())


# ---------------------------------------------------------------- R11: values bounded at the edge

def test_r11_sample_experts_out_of_range_is_refused_up_front(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--sample-experts", "99999999999999999999")
    assert r.exit_code == 2 and "--sample-experts" in r.output, r.output
    assert not os.path.exists(dst)
    from converter.errors import BadInput
    from converter.pipeline import Options
    with pytest.raises(BadInput, match="--sample-experts"):
        Options(sample_experts=10**20).check()


# ---------------------------------------------------------------- R16: one precedence order

def test_r16_precedence_command_line_job_file_environment_default(fixture_src, tmp_path, monkeypatch):
    """command line > job file > K3CONVERT_WORKERS > default (README, Usage)."""
    job = tmp_path / "job.toml"
    job.write_text(f'src = "{fixture_src}"\nworkers = 2\ndevices = "cpu"\n')

    def chosen(*extra):
        r = run_cli("mxfp4-to-int4", "--config", job, "-o", tmp_path / "dst", "--dry-run", *extra)
        assert r.exit_code == 0, r.output
        return r.output

    monkeypatch.setenv("K3CONVERT_WORKERS", "1")
    assert "cpu: 2 worker(s)" in chosen()                  # the job file beats the environment
    assert "cpu: 3 worker(s)" in chosen("--workers", "3")  # the command line beats both
    job.write_text(f'src = "{fixture_src}"\ndevices = "cpu"\n')
    assert "cpu: 1 worker(s)" in chosen()                  # the environment beats the default
    monkeypatch.setenv("K3CONVERT_WORKERS", "zero")
    r = run_cli("mxfp4-to-int4", "--config", job, "-o", tmp_path / "dst", "--dry-run")
    assert r.exit_code == 2 and "K3CONVERT_WORKERS='zero' (the environment): not a positive number" in r.output
