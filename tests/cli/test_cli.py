"""The k3convert command line, driven through click's CliRunner."""
from __future__ import annotations

import json
import os
import re

import click
import pytest

from converter.cli import main
from converter.run.options import default_dst
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import INDEX, MANIFEST, REPORT, read_json, run_cli, sha256, shard_names


def _long_opts(cmd: click.Command) -> list[str]:
    return [o for p in cmd.params if isinstance(p, click.Option) for o in p.opts if o.startswith("--")]


def test_help_lists_commands_and_options():
    r = run_cli("--help")
    assert r.exit_code == 0, r.output
    for name in ("mxfp4-to-int4", "make-fixture", "demo"):
        assert name in main.commands
        assert re.search(rf"^\s+{re.escape(name)}\s", r.stdout, re.M), name
    r = run_cli("mxfp4-to-int4", "--help")
    assert r.exit_code == 0, r.output
    opts = _long_opts(main.commands["mxfp4-to-int4"])
    for o in ("--output", "--max-rel-rmse", "--overwrite", "--progress", "--devices", "--workers"):
        assert o in opts
    for o in opts:
        assert o in r.stdout, o
    assert "-o, --output" in r.stdout and "SRC" in r.stdout
    r = run_cli("make-fixture", "--help")
    assert r.exit_code == 0 and all(o in r.stdout for o in _long_opts(main.commands["make-fixture"]))


def test_make_fixture_then_convert_to_default_dst(tmp_path):
    src = tmp_path / "ckpt"
    r = run_cli("make-fixture", src, "--layers", 3, "--experts", 2, "--shards", 2)
    assert r.exit_code == 0, r.output
    assert "wrote 2 shards" in r.stdout and str(src) in r.stdout
    assert len(shard_names(src)) == 2 and os.path.exists(src / INDEX)

    r = run_cli("mxfp4-to-int4", src, "--progress", "none")
    assert r.exit_code == 0, (r.output, r.exception)
    dst = tmp_path / "ckpt-int4"  # the sibling, not inside SRC
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt-int4"]
    assert read_json(dst / MANIFEST)["complete"] is True
    assert shard_names(dst) == shard_names(src)

    lines = r.stdout.splitlines()
    report_path = str(dst / REPORT)
    assert f"report: {report_path}" in lines
    report = read_json(report_path)
    assert [layer["layer"] for layer in report["layers"]] == [1, 2]  # the MoE layers of 3
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["layer", "tensors"])
    table = {int(line.split()[0]): line.split() for line in lines[head + 1:head + 1 + len(report["layers"])]}
    for layer in report["layers"]:
        row = table[layer["layer"]]
        assert int(row[1]) == layer["tensors"]
        assert row[2] == f"{layer['rel_rmse_mean']:.4f}" and row[3] == f"{layer['rel_rmse_worst']:.4f}"
    assert any(line.startswith("complete:") and str(dst) in line for line in lines)


def test_default_dst_ignores_trailing_slash(tmp_path):
    assert default_dst(str(tmp_path / "m") + os.sep) == str(tmp_path / "m") + "-int4"


def test_progress_json_events(fixture_src, converted, tmp_path):
    dst = tmp_path / "dst"
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", dst, "--progress", "json")
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stderr.splitlines() if line.strip()]  # every line parses
    kinds = [e["event"] for e in events]
    assert kinds[0] == "plan" and kinds[-1] == "finished"
    shards = shard_names(fixture_src)
    plan = events[0]
    assert plan["shards"] == plan["todo"] == len(shards)
    assert sorted(e["shard"] for e in events if e["event"] == "start") == shards
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["shard"] for e in done) == shards
    for e in done:  # each shard starts before it is done
        start = next(i for i, x in enumerate(events) if x["event"] == "start" and x["shard"] == e["shard"])
        assert start < events.index(e)
        assert e["rel_rmse_worst"] >= 0
    assert all(isinstance(e["time"], (int, float)) for e in events[:-1])  # progress events are timed
    assert events[-1]["complete"] is True and events[-1]["dst"] == str(dst)
    assert r.stdout == ""  # machine mode: nothing else on stdout
    for s in shards:  # same bytes as the library conversion
        assert sha256(dst / s) == sha256(os.path.join(converted.dst, s))


def test_demo_dir(tmp_path):
    work = tmp_path / "demo"
    r = run_cli("demo", "--dir", work)
    assert r.exit_code == 0, (r.output, r.exception)
    src, dst = work / "kimi-k3-fixture", work / "kimi-k3-fixture-int4"
    assert read_json(dst / MANIFEST)["complete"] is True
    assert shard_names(dst) == shard_names(src) and shard_names(src)
    assert f"report: {dst / REPORT}" in r.stdout.splitlines()
    # again: reuses the fixture and replaces the conversion
    before = {s: sha256(src / s) for s in shard_names(src)}
    r = run_cli("demo", "--dir", work)
    assert r.exit_code == 0, r.output
    assert {s: sha256(src / s) for s in shard_names(src)} == before
    assert read_json(dst / MANIFEST)["complete"] is True


def test_the_coordinating_process_does_not_import_torch():
    """Workers import torch (seconds) while the parent plans: the parent's modules must not."""
    import subprocess
    import sys

    code = "import sys, converter.cli, converter.run.pipeline, converter.run.plan; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False", r.stderr


def test_devices_cpu_never_uses_a_gpu_and_gpus_get_two_workers(monkeypatch):
    from converter.errors import BadInput
    from converter.run import selection
    from converter.run.options import Options
    from converter.run.selection import resolve_devices

    monkeypatch.setattr(selection, "gpu_count", lambda: 2)
    assert resolve_devices(Options(devices=["cpu"], workers=3)) == ["cpu"] * 3  # once ran on the GPUs
    assert resolve_devices(Options()) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert resolve_devices(Options(devices=["cuda:1"], workers_per_gpu=1)) == ["cuda:1"]
    monkeypatch.setattr(selection, "gpu_count", lambda: 0)
    assert resolve_devices(Options(workers=2)) == ["cpu", "cpu"]
    for bad in (["gpu0"], ["cpu", "cuda:0"]):
        try:
            resolve_devices(Options(devices=bad))
        except BadInput as e:
            assert "--devices" in str(e)
        else:
            raise AssertionError(f"{bad} accepted")


def test_job_file_options_relative_paths_and_command_line_wins(fixture_src, tmp_path):
    """--config: keys are the long options (and src), paths are relative to the file, the command
    line overrides it, and an unknown key is refused naming the file."""
    import shutil

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    shutil.copytree(fixture_src, tmp_path / "src")
    job = jobs / "job.toml"
    job.write_text('src = "../src"\noutput = "../out"\ndevices = ["cpu"]\nmax-rel-rmse = 0.0001\n'
                   'progress = "none"\n')
    r = run_cli("mxfp4-to-int4", "--config", job)  # the file's tiny threshold fails the run, in ../out
    assert r.exit_code == 3, r.output
    assert os.path.isdir(tmp_path / "out")
    r = run_cli("mxfp4-to-int4", "--config", job, "--max-rel-rmse", "0.2")  # the command line wins: another
    assert r.exit_code == 4 and "--max-rel-rmse 0.0001 (recorded) vs 0.2" in r.output  # threshold, another run
    r = run_cli("mxfp4-to-int4", "--config", job, "--max-rel-rmse", "0.2", "--overwrite")
    assert r.exit_code == 0, r.output
    assert read_json(tmp_path / "out" / MANIFEST)["complete"] is True
    job.write_text('src = "../src"\nmax_rel_rmse = 0.2\nworkerz = 2\n')
    r = run_cli("mxfp4-to-int4", "--config", job)
    assert r.exit_code == 2 and str(job) in r.output and "workerz" in r.output


# ------------------------------------------------------------------ issue 24 §3: the small things

def test_unknown_command_names_the_close_ones():
    """'convert' once said only "No such command"; a word people reach for names the command."""
    for typed, meant in (("convert", "mxfp4-to-int4"), ("quantize", "mxfp4-to-int4"), ("verfy", "verify"),
                         ("inspct", "inspect"), ("fixture", "make-fixture"), ("make-fixtures", "make-fixture")):
        r = run_cli(typed, "src")
        assert r.exit_code == 2, (typed, r.output)
        assert r.stderr.strip() == f"k3convert: error: No such command '{typed}'. Did you mean {meant}?", r.stderr
    r = run_cli("frobnicate")
    assert r.exit_code == 2 and "Did you mean" not in r.stderr and "k3convert --help" in r.stderr, r.stderr


def test_dry_run_sizes_for_people_exact_bytes_in_json(fixture_src, tmp_path):
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "d", "--dry-run", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    lines = dict(line.strip().split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    size = re.compile(r"^\d+(\.\d+)? (B|kB|MB|GB|TB)$")
    for key in ("bytes_in", "bytes_out", "free_bytes_at_dst"):
        assert size.match(lines[key]), (key, lines[key])  # once free_bytes_at_dst: 66821144576
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "d", "--dry-run", "--devices", "cpu",
                "--progress", "json")
    info = json.loads(r.stdout)
    assert all(isinstance(info[k], int) and info[k] > 0 for k in ("bytes_in", "bytes_out", "free_bytes_at_dst"))
    from converter.terminal.progress import human_bytes
    assert lines["bytes_out"] == human_bytes(info["bytes_out"])


def test_figures_table_columns_align_under_their_headings():
    """Each heading is one column (two spaces apart, with its unit), right-aligned over its numbers;
    once 'relRMSE mean    worst SNR dB min out err worst' read as one run of words."""
    from converter.run.validate import format_table

    layers = [{"layer": 1, "tensors": 24, "rel_rmse_mean": 0.0955, "rel_rmse_worst": 0.1003, "snr_db_worst": 19.97,
               "out_rel_worst": 0.1135, "cmp_rel_rmse_mean": 0.1237, "cmp_ratio": 1.2953},
              {"layer": 12, "tensors": 3, "rel_rmse_mean": 0.09, "rel_rmse_worst": 0.1, "snr_db_worst": 9.5,
               "out_rel_worst": None, "cmp_rel_rmse_mean": None, "cmp_ratio": None}]
    head, *rows = format_table(layers).splitlines()
    names = re.split(r" {2,}", head.strip())
    assert names == ["layer", "tensors", "rel RMSE mean", "rel RMSE worst", "SNR min (dB)", "out err worst",
                     "server rel RMSE", "ratio (x ours)"]
    ends = [head.index(n) + len(n) for n in names]  # each heading's right edge
    for row in rows:
        cells = row.split()
        assert len(cells) == len(names) and [m.end() for m in re.finditer(r"\S+", row)] == ends, row
    assert rows[0].split()[2:] == ["0.0955", "0.1003", "19.97", "0.1135", "0.1237", "1.30x"]
    assert rows[1].split()[5:] == ["-", "-", "-"]


def test_inspect_with_missing_shards_exits_2(fixture_src, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixture_src, src)
    gone = shard_names(src)[1]
    os.unlink(src / gone)
    message = f"file {src}: 1 shard(s) named by the index are missing: {gone}"
    r = run_cli("inspect", src)
    assert r.exit_code == 2, r.output  # was 0 after printing MISSING
    assert r.stderr.strip() == f"k3convert: error: {message}", r.stderr
    assert gone in r.stdout  # still described
    r = run_cli("inspect", src, "--json")  # one JSON object: the description, the error and its exit code
    assert r.exit_code == 2 and r.stderr == "", r.output
    info = json.loads(r.stdout)
    assert (info["error"], info["exit_code"], info["file"]) == (message, 2, str(src))
    assert gone in json.dumps({k: v for k, v in info.items() if k not in ("error", "file")})  # still described


def test_demo_removes_its_temporary_folder_unless_keep(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run_cli("demo")
    assert r.exit_code == 0, (r.output, r.exception)
    assert os.listdir(tmp_path) == []  # once 11 MB of /tmp/k3convert-demo-* left per run, without a word
    assert r.stdout.splitlines()[-1].startswith(f"removed {tmp_path}{os.sep}k3convert-demo-")
    assert r.stderr.splitlines()[0].startswith("demo: ") and "--keep" in r.stderr.splitlines()[0]
    r = run_cli("demo", "--keep")
    assert r.exit_code == 0, r.output
    (kept,) = os.listdir(tmp_path)
    assert r.stdout.splitlines()[-1] == f"kept in {tmp_path / kept}"
    assert read_json(tmp_path / kept / "kimi-k3-fixture-int4" / MANIFEST)["complete"] is True


def test_make_fixture_shows_progress_to_its_total(tmp_path, monkeypatch):
    """A real-dims fixture takes minutes on a CPU (once 131 s without a word): each tensor written
    is reported, and the reports add up to the tensor bytes in the files."""
    from converter.fixture import FixtureSpec, fixture_bytes, make_fixture
    from converter.formats.safetensors_io import read_header

    spec = FixtureSpec(layers=2, experts=2, shards=2)
    seen: list[int] = []
    names = make_fixture(str(tmp_path / "f"), spec, progress=seen.append)
    written = sum(t.nbytes for n in names for t in read_header(str(tmp_path / "f" / n)).tensors.values())
    assert len(seen) > 20 and sum(seen) == fixture_bytes(spec) == written
    from converter.terminal import progress
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.001)  # stderr is no terminal here: a line each 1 ms
    r = run_cli("make-fixture", tmp_path / "g", "--layers", 2, "--experts", 2, "--shards", 2)
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith("writing a Kimi-K3-shaped MXFP4 fixture (2 layers, 2 experts, 2 shards) to ")
    total = progress.human_bytes(fixture_bytes(spec))
    assert re.search(rf"^fixture: \d+%, [\d.]+ (B|kB|MB) of {re.escape(total)}, ", r.stderr, re.M), r.stderr


# ------------------------------------------------------------------ issue 33 §3: the small things

def _k3(*args: str, env: dict | None = None, prelude: str = "", timeout: float = 300):
    """The command line in its own process, stderr a pipe (a log): (rc, stdout, stderr). ``prelude``
    runs first in that process (a shorter LINE_EVERY_S)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"{prelude}\nfrom converter.cli import main\nmain()"
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": repo, **(env or {})})
    return r.returncode, r.stdout, r.stderr


def test_bare_command_prints_its_help_and_exits_0():
    """Once one 694-character error line and exit 2; `hf` and `vllm` print their help."""
    r = run_cli()
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Usage: ") and "\nCommands:\n" in r.stdout and r.stderr == ""
    assert r.stdout == run_cli("--help").stdout
    rc, out, err = _k3()  # the process too (fastexit)
    assert (rc, err) == (0, "") and "\nCommands:\n" in out and "mxfp4-to-int4" in out


def test_tqdm_disable_neither_crashes_nor_draws(tmp_path):
    """TQDM_DISABLE=1 once crashed convert and demo: "'tqdm' object has no attribute 'fp'" (progress.py)."""
    rc, out, err = _k3("demo", "--dir", tmp_path / "d", env={"TQDM_DISABLE": "1"})
    assert rc == 0, err[-2000:]
    assert "Traceback" not in err and "%|" not in err and "\r" not in err, err
    assert "converting " in err  # status lines stay: only bars are off
    assert out.splitlines()[-1] == f"report: {tmp_path / 'd' / 'kimi-k3-fixture-int4' / REPORT}"


def test_in_a_log_the_bar_is_plain_lines(fixture_src, tmp_path):
    """stderr a pipe: once one long line of carriage returns; now a plain line every LINE_EVERY_S
    (here 0.02 s) and the last state, no carriage return."""
    fast = "import converter.terminal.progress as p; p.LINE_EVERY_S = 0.02"
    rc, out, err = _k3("mxfp4-to-int4", fixture_src, "-o", tmp_path / "d", "--workers", "1", prelude=fast)
    assert rc == 0, err[-2000:]
    assert "\r" not in err and "%|" not in err, err[:500]
    lines = err.splitlines()
    assert lines[0].startswith("converting 3 of 3 shards; "), lines
    steps = [x for x in lines if re.match(r"shards \d/3: \d+%, [\d.]+ (B|kB|MB) of [\d.]+ (kB|MB), [\d.]+ s", x)]
    assert len(steps) >= 2 and steps[-1].startswith("shards 3/3: 100%, "), lines  # the last line stays
    rc, out, err = _k3("make-fixture", tmp_path / "f", "--layers", 2, "--experts", 2, "--shards", 1, prelude=fast)
    assert rc == 0 and "\r" not in err and re.search(r"^fixture: \d+%, ", err, re.M), err


def test_slow_steps_say_what_they_do_in_a_log(converted, tmp_path):
    """verify --source was silent for 7 s and then 15 s: each check says what it does while it runs."""
    from converter.verify import config

    fast = "import converter.terminal.progress as p; p.LINE_EVERY_S = 0.05"
    rc, out, err = _k3("verify", converted.dst, "--source", converted.src, prelude=fast)
    assert rc == 0, out + err
    from converter.verify import DOING

    said = {re.sub(r" \([\d.]+ s\)$", "", x) for x in err.splitlines()}
    assert said <= set(DOING.values()), said  # each line is a step and its time
    # the slow one here: config imports compressed-tensors (and torch with it, so the re-decode after it
    # may end within one interval and say nothing: not asserted)
    assert DOING[config] in said, err
    assert "\r" not in err and out.splitlines()[-1] == "result: PASS"


def test_verify_says_each_check_as_it_begins(converted):
    from converter.verify import CHECKS, DOING, verify

    seen: list[str] = []
    verify(converted.dst, converted.src, sample=1, on_start=seen.append)
    assert seen == [DOING[c] for c in CHECKS] and len(set(seen)) == len(CHECKS)


@pytest.mark.parametrize("how", [["-q"], ["after"], ["env"]])
def test_quiet_prints_results_only(how, tmp_path):
    """-q (before or after the command's name) or K3CONVERT_QUIET=1: no bar, no status line; stdout as without."""
    from click.testing import CliRunner

    argv = ["demo", "--dir", str(tmp_path / "d")]
    argv = ["-q", *argv] if how == ["-q"] else [*argv, "-q"] if how == ["after"] else argv
    r = CliRunner().invoke(main, argv, env={"K3CONVERT_QUIET": "1"} if how == ["env"] else None)
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stderr == ""
    assert f"report: {tmp_path / 'd' / 'kimi-k3-fixture-int4' / REPORT}" in r.stdout.splitlines()
    loud = run_cli("make-fixture", tmp_path / "f", "--layers", 2, "--experts", 2, "--shards", 1)
    assert loud.stderr.startswith("writing a Kimi-K3-shaped")  # quiet ended with its command


def test_quiet_turns_the_hubs_bars_off_for_the_command():
    """An upload's bars are huggingface_hub's: -q turns them off while the command runs, and only then."""
    from huggingface_hub.utils import are_progress_bars_disabled

    seen = []

    @click.command("probe-bars")
    def probe():
        seen.append((are_progress_bars_disabled(), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")))

    before = are_progress_bars_disabled(), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    main.add_command(probe)
    try:
        assert run_cli("-q", "probe-bars").exit_code == 0
        assert run_cli("probe-bars", "-q").exit_code == 0
        assert run_cli("probe-bars").exit_code == 0
    finally:
        main.commands.pop("probe-bars")
    assert seen[:2] == [(True, "1"), (True, "1")]
    assert seen[2] == before == (are_progress_bars_disabled(), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"))


VLLM_SPELLINGS = [
    ["--tp", "8", "--ep", "--dp", "2", "--pp", "2"],
    ["--tensor-parallel-size", "8", "--enable-expert-parallel", "--data-parallel-size", "2",
     "--pipeline-parallel-size", "2"],
    ["-tp", "8", "-ep", "-dp", "2", "-pp", "2"],
    ["--tensor-parallel-size=8", "--enable-expert-parallel", "--data-parallel-size=2", "--pipeline-parallel-size=2"],
]


def test_verify_takes_vllms_spellings(converted):
    """`vllm serve`'s own option names mean what --tp/--ep/--dp/--pp mean (once: "No such option")."""
    base = ["verify", converted.dst, "--no-checksums", "--serving", "vllm-rocm-plugin", "--json"]
    results = []
    for spelling in VLLM_SPELLINGS:
        r = run_cli(*base, *spelling)
        assert r.exit_code in (0, 5), (spelling, r.output)
        results.append(json.loads(r.stdout))
    assert all(x == results[0] for x in results[1:])
    other = json.loads(run_cli(*base, "--tp", "4", "--dp", "2", "--pp", "2").stdout)
    assert other != results[0]  # the value is used, not ignored


def _one_json_error(text: str, code: int, *needles: str) -> dict:
    err = json.loads(text)  # the whole stream is one JSON object
    assert err["exit_code"] == code and all(n in err["error"] for n in needles), err
    assert "k3convert: error" not in err["error"]
    return err


def test_json_errors_are_json(converted, fixture_src, tmp_path):
    """With --json (stdout) or --progress json (stderr's events), an error is JSON on that stream,
    with its exit code; once a plain 'k3convert: error:' line."""
    missing = str(tmp_path / "nowhere")
    r = run_cli("verify", missing, "--json")
    assert r.exit_code == 2
    assert _one_json_error(r.stdout, 2, "does not exist")["file"] == missing and r.stderr == ""
    r = run_cli("inspect", missing, "--json")
    assert r.exit_code == 2 and _one_json_error(r.stdout, 2, "nowhere") and r.stderr == ""
    for bad in (["--tp", "0", "--serving", "vllm-rocm"], ["--bogus"], ["--tp", "8"]):  # usage errors, 2
        r = run_cli("verify", converted.dst, "--json", *bad)
        assert r.exit_code == 2, (bad, r.output)
        _one_json_error(r.stdout, 2)
        assert r.stderr == ""
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("mxfp4-to-int4", empty, "-o", tmp_path / "o", "--progress", "json")
    assert r.exit_code == 2, r.output
    events = [json.loads(x) for x in r.stderr.splitlines()]  # every line is an event
    assert events[-1]["event"] == "failed" and events[-1]["exit_code"] == 2 and str(empty) in events[-1]["error"]
    r = run_cli("mxfp4-to-int4", empty, "--dry-run", "--progress=json")
    assert r.exit_code == 2 and _one_json_error(r.stdout, 2, str(empty)), r.output
    r = run_cli("verify", missing)  # without JSON: the line, as before
    assert r.exit_code == 2 and r.stderr.startswith("k3convert: error: ") and r.stdout == ""


def test_scale_rule_help_agrees_with_readme():
    """--scale-rule's help once recommended optimal-pm7 "until the plugin's self-test passes";
    README says the default optimal is right for MI300X/MI325X (the self-test re-optimizes at load)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = " ".join(open(os.path.join(repo, "README.md"), encoding="utf-8").read().split())
    assert "The default `optimal` is right for MI300X/MI325X too" in readme
    (opt,) = [p for p in main.commands["mxfp4-to-int4"].params if p.name == "scale_rule"]
    assert opt.default == "optimal"
    assert "until" not in opt.help and "right for MI300X/MI325X too" in opt.help
    assert "self-test" in opt.help and "re-optimizes" in opt.help


def test_fp4_to_int4_is_the_same_command_under_the_name_of_both_formats(tmp_path):
    """``fp4-to-int4`` runs ``mxfp4-to-int4`` itself (one command object, no copy): on an NVFP4 source both
    write the same tensors and config; --help lists it under Aliases; usage errors say the name typed;
    a misspelling of it is suggested; the job guard treats it as the conversion it is."""
    from tests.conftest import all_tensors, tensor_bytes

    src = os.path.join(str(support.DATA), "auto-round", "nvfp4")
    out = {}
    for name in ("mxfp4-to-int4", "fp4-to-int4"):
        out[name] = str(tmp_path / name)
        r = run_cli(name, src, "-o", out[name], "--drop-activation-quant", "--progress", "none")
        assert r.exit_code == 0, (name, r.output, r.exception)
    a, b = all_tensors(out["mxfp4-to-int4"]), all_tensors(out["fp4-to-int4"])
    assert set(a) == set(b) and all(tensor_bytes(a[n][1]) == tensor_bytes(b[n][1]) for n in a)
    assert read_json(os.path.join(out["fp4-to-int4"], "config.json")) == \
        read_json(os.path.join(out["mxfp4-to-int4"], "config.json"))
    assert main.get_command(None, "fp4-to-int4") is main.get_command(None, "mxfp4-to-int4")
    help_text = run_cli("--help").output
    assert re.search(r"Aliases:\s+fp4-to-int4\s+the same command as mxfp4-to-int4", help_text), help_text
    r = run_cli("fp4-to-int4", "--help")
    assert r.exit_code == 0 and "fp4-to-int4 [OPTIONS] SRC" in r.output and "MXFP4 or NVFP4" in r.output
    r = run_cli("fp4-to-int4")
    assert r.exit_code == 2 and "Missing argument 'SRC'" in r.stderr
    assert main.k3_command == "mxfp4-to-int4"   # streams.JOBS: a job, whichever name was typed
    r = run_cli("fp4-to-int")
    assert r.exit_code == 2 and "Did you mean fp4-to-int4" in r.stderr, r.stderr
