"""Options as the command line, job files and the environment give them: one type per option, one
precedence order, counts in ASCII digits, selections that select something, values bounded at the
edge, and figures that do not depend on the worker count.

Each test is named for its defect in docs/reliability.md (D20, D22, D23, R10-R12, R16, S10-S12, T6,
T8, T11), which describes the mechanism that fixed it; each failed before its fix.
"""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import pytest
from dst_helpers import CPU, REPO, convert_cli, dry_run, profile_copy

from converter.errors import BadInput
from converter.run import selection, workers as run_workers
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.run.selection import select_shards
from tests.conftest import MANIFEST, REPORT, SPEC, TABLE, assert_clean_error, assert_not_complete, run_cli, shard_names

# ---------------------------------------- R10, R12, S10, S11: job files, typed as the command line

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


def test_s10_job_file_profile_is_relative_to_the_job_file(src_copy, tmp_path, monkeypatch):
    jobs, cwd = tmp_path / "jobs", tmp_path / "cwd"
    profile_copy(jobs, name="k3-of-the-job")
    profile_copy(cwd, name="k3-of-the-cwd")
    (jobs / "job.toml").write_text(f'src = "{src_copy}"\nprofile = "k3.toml"\n')
    monkeypatch.chdir(cwd)
    info = dry_run("--config", str(jobs / "job.toml"))
    assert info["profile"].startswith("k3-of-the-job ")
    # on the command line a relative file is the working directory's, as any path there
    info = dry_run(src_copy, "--profile", "k3.toml")
    assert info["profile"].startswith("k3-of-the-cwd ")


def test_s11_two_job_files_apply_in_order(src_copy, tmp_path):
    site, model = tmp_path / "site.toml", tmp_path / "model.toml"
    site.write_text('scale-rule = "vllm-gfx942"\nshards = "1-2"\n')
    model.write_text(f'src = "{src_copy}"\nshards = "2"\n')
    info = dry_run("--config", str(site), "--config", str(model))
    assert info["scale_rule"] == "vllm-gfx942"  # the first file is not ignored
    assert info["shards"] == 1                   # the later file wins where both say
    info = dry_run("--config", str(site), "--config", str(model), "--shards", "1-3")
    assert info["shards"] == 3                   # the command line wins over both


@pytest.mark.parametrize("value", ["2.7", "1e3", "2.0"])
def test_s12_job_file_workers_must_be_whole(src_copy, tmp_path, value):
    job = tmp_path / "job.toml"
    job.write_text(f"workers = {value}\n")
    r = run_cli("mxfp4-to-int4", src_copy, "--config", str(job), "-o", str(tmp_path / "dst"), "--dry-run")
    assert_clean_error(r, str(job), "workers", "whole number", code=2)


# ---------------------------------------- R16, S12: one precedence order; the environment blamed by name

def test_r16_precedence_command_line_job_file_environment_default(fixture_src, tmp_path, monkeypatch):
    """command line > job file > K3CONVERT_WORKERS > default (docs/convert.md, "Options of `mxfp4-to-int4`")."""
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


@pytest.mark.parametrize("value", ["", "abc", "0"])
def test_s12_workers_from_the_environment_is_blamed_by_name(src_copy, tmp_path, monkeypatch, value):
    monkeypatch.setenv("K3CONVERT_WORKERS", value)
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--dry-run")
    err = assert_clean_error(r, f"K3CONVERT_WORKERS={value!r}", code=2)
    assert "--workers" not in err
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--dry-run", "--workers", "1")
    assert r.exit_code == 0, r.output  # the command line wins over the environment


# ---------------------------------------- T11, D20: worker counts, and figures that do not depend on them

@pytest.mark.parametrize("value", ["1_0", "٢", "+2", "99999999999999999999", "100000", "9" * 5000])
def test_t11_workers_accept_only_ascii_digits_and_what_fits(fixture_src, tmp_path, value):
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", "--workers", value, *CPU)
    assert_clean_error(r, "--workers", code=2)


def test_t11_workers_from_the_environment_are_ascii_digits(fixture_src, tmp_path, monkeypatch):
    monkeypatch.setenv("K3CONVERT_WORKERS", "1_0")
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", *CPU)
    assert_clean_error(r, "K3CONVERT_WORKERS='1_0'", code=2)


def test_t11_more_workers_than_cores_is_said(fixture_src, tmp_path, monkeypatch):
    monkeypatch.setattr(run_workers, "cpus", lambda: 2)
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", "--workers", "3", *CPU)
    assert r.exit_code == 0, r.output
    assert "cpu: 3 worker(s)" in r.stdout and "more workers than the 2 core(s)" in r.stdout


def test_t11_other_counts_refuse_int_syntax(monkeypatch):
    for spec, part in (("١", None), ("1_0", None), (None, "1/٢"), (None, "1_0/2")):
        with pytest.raises(BadInput):
            select_shards(["a", "b", "c"], spec, part)
    with pytest.raises(BadInput, match="not cpu or cuda:N"):
        selection.plan_workers(Options(devices=["cuda:²"]))  # "²".isdigit() is True, int("²") a ValueError
    monkeypatch.setenv("NUMBA_NUM_THREADS", "²")
    assert run_workers.cpu_workers(1).workers == 1
    monkeypatch.setenv("K3CONVERT_IO_THREADS", "٢,2")
    with pytest.raises(BadInput, match="K3CONVERT_IO_THREADS"):
        run_workers.io_threads()


def test_d20_figures_do_not_depend_on_workers_or_threads(fixture_src, tmp_path):
    """--workers 1 and 2 (worker processes with 2 and 1 compute threads on this machine's
    cores, NUMBA_NUM_THREADS fixed at 2): report and tensor table byte-identical."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "NUMBA_NUM_THREADS": "2"}
    outs = []
    for workers in ("1", "2"):
        dst = str(tmp_path / f"w{workers}")
        r = subprocess.run([sys.executable, "-m", "converter", "mxfp4-to-int4", fixture_src, "-o", dst, *CPU,
                            "--workers", workers], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        outs.append(dst)
    for f in (REPORT, TABLE):
        assert filecmp.cmp(os.path.join(outs[0], f), os.path.join(outs[1], f), shallow=False), f


def test_d20_output_error_is_exact_for_any_thread_count():
    """The CPU kernel's output error of one matrix with 1 and 2 numba threads: equal, and
    equal to the exactly summed figure."""
    import math

    import numba
    import torch

    from converter.quant.cpu_kernel import output_error, requantize
    from converter.run.validate import probe

    gen = torch.Generator().manual_seed(3)
    rows, cols = 4096, 64
    packed = torch.randint(0, 256, (rows * cols // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 130, (rows * cols // 32,), dtype=torch.uint8, generator=gen)
    res = requantize(packed, scales)
    got = []
    for n in (1, 2):
        numba.set_num_threads(n)
        got.append(output_error(packed, scales, res.packed, res.scales, cols, probe(cols)))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert got[0] == got[1] and math.isfinite(got[0]) and got[0] > 0


# ---------------------------------------- S12, T6, T8: --shards and --part select something

@pytest.mark.parametrize("args, needle", [
    (("--shards", ""), "--shards ''"),
    (("--part", ""), "--part: ''"),
    (("--shards", " "), "selects no shard"),
    (("--shards", "3-1"), "reversed"),
])
def test_s12_an_empty_or_reversed_selection_is_refused(src_copy, tmp_path, args, needle):
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--dry-run", *args)
    assert_clean_error(r, needle, code=2)
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--progress", "none", *args)
    assert_clean_error(r, needle, code=2)
    assert not os.path.exists(tmp_path / "dst" / MANIFEST)


def test_s12_job_file_empty_shards_is_refused(src_copy, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('shards = ""\n')
    r = run_cli("mxfp4-to-int4", src_copy, "--config", str(job), "-o", str(tmp_path / "dst"), "--dry-run")
    assert_clean_error(r, "selects no shard", code=2)


def test_t6_job_file_shards_with_part_that_select_nothing_are_refused(fixture_src, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'src = "{fixture_src}"\nshards = "1"\n')
    dst = tmp_path / "dst"
    r = run_cli("mxfp4-to-int4", "--config", job, "-o", dst, "--part", "2/3", *CPU)
    assert_clean_error(r, "--shards 1 with --part 2/3 selects no shard", code=2)
    assert not dst.exists()
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", dst, "--part", f"{SPEC.shards + 1}/{SPEC.shards + 1}", *CPU)
    assert_clean_error(r, "selects no shard", f"use at most {SPEC.shards} parts", code=2)
    assert not dst.exists()


def test_t8_an_open_range_is_refused_not_cut_to_its_start(fixture_src, tmp_path):
    with pytest.raises(BadInput, match="has no end: write 2-3"):
        select_shards(["a", "b", "c"], "2-")
    assert select_shards(["a", "b", "c"], "2-3") == ["b", "c"]
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--shards", "2-", *CPU)
    assert_clean_error(r, "'2-' has no end", code=2)
    assert not (tmp_path / "dst").exists()


# ---------------------------------------- R11, D22, D23: values bounded at the edge

def test_r11_sample_experts_out_of_range_is_refused_up_front(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--sample-experts", "99999999999999999999")
    assert r.exit_code == 2 and "--sample-experts" in r.output, r.output
    assert not os.path.exists(dst)
    from converter.errors import BadInput
    from converter.run.options import Options
    with pytest.raises(BadInput, match="--sample-experts"):
        Options(sample_experts=10**20).check()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_d22_bad_threshold_refused(fixture_src, tmp_path, value):
    dst = str(tmp_path / "dst")
    assert_clean_error(convert_cli(fixture_src, dst, "--max-rel-rmse", value), "--max-rel-rmse", code=2)
    assert not os.path.exists(dst)


def test_d23_cuda_device_without_gpu_support(fixture_src, tmp_path, monkeypatch):
    """--devices cuda:0 where no GPU is visible, and where one is but torch has no CUDA: exit 2,
    one line, nothing written."""
    import torch

    dst = str(tmp_path / "dst")
    if selection.gpu_count() == 0:
        assert_clean_error(run_cli("mxfp4-to-int4", fixture_src, "-o", dst, "--devices", "cuda:0"),
                           "--devices", "cuda:0", code=2)
        assert not os.path.exists(dst)
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the CPU-only case cannot be shown here")
    monkeypatch.setattr(selection, "gpu_count", lambda: 1)  # a GPU is there, this torch cannot use it
    with pytest.raises(BadInput) as e:
        convert(fixture_src, dst, Options(devices=["cuda:0"], workers_per_gpu=1, inline=True))
    assert "cuda:0" in str(e.value) and "no CUDA or ROCm support" in str(e.value) and "\n" not in str(e.value)
    assert not shard_names(dst)
    assert_not_complete(dst)
