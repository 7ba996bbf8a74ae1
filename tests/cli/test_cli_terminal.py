"""The command as a person meets it, in its own process: on a terminal (a pseudo-terminal), its
first line before torch is imported, and no process of its group left once it has exited.

Facts and orderings only; how fast lives in scripts/benchmarks/bench_cli_latency.py (BENCHMARKS.md)."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K3 = [sys.executable, "-m", "converter"]
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BAR = re.compile(r"^(starting|shards \d+/\d+|fixture)\b.*(\]|\|)$")  # a bar frame, and nothing after it


def on_terminal(argv: list[str], cwd: str, env: dict | None = None, timeout: float = 300,
                columns: int = 100) -> tuple[int, str]:
    """Run ``argv`` on a 100-column pseudo-terminal (stdout and stderr); its exit status and output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env or ENV,
                         start_new_session=True)
    os.close(slave)
    out = b""
    try:
        while True:
            r, _, _ = select.select([master], [], [], timeout)
            if not r:
                raise AssertionError(f"no output for {timeout} s: {out[-2000:]!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command and its children have closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    return p.wait(timeout=timeout), out.decode(errors="replace")


def screen_lines(text: str) -> list[str]:
    """What each line of a terminal shows at the end: a carriage return goes back to column 0 and
    what follows overwrites (so a stale bar shows as the bar with text glued on after it)."""
    rows = []
    for raw in ANSI.sub("", text).split("\n"):
        row: list[str] = []
        col = 0
        for ch in raw:
            if ch == "\r":
                col = 0
                continue
            if col < len(row):
                row[col] = ch
            else:
                row.append(ch)
            col += 1
        rows.append("".join(row).rstrip())
    return [r for r in rows if r]


def test_screen_lines_sees_a_glued_bar():
    """The check below would catch 74b0137's output (copied from a run of it)."""
    old = ("\rshards 0/3:   0%|          | 0.00/5.21M [00:00, starting]converting 3 of 3 shards; cpu: 1\r\n"
           "\rshards 0/3:  44%|####      | 2.31M/5.21M [00:01]\r\rshards 3/3: 100%|##########| 5.21M/5.21M [00:02]\n")
    with pytest.raises(AssertionError, match="printed onto it"):
        assert_no_glued_lines(old)


def assert_no_glued_lines(text: str) -> list[str]:
    """Every line that shows a bar shows only the bar; the progress line stands on its own."""
    lines = screen_lines(text)
    for line in lines:
        if "%|" in line or re.search(r"\[\d\d:\d\d", line):
            assert BAR.match(line), f"a bar with something printed onto it: {line!r}"
        if "converting " in line:
            assert line.startswith("converting "), f"glued: {line!r}"
    return lines


def test_convert_on_a_terminal_prints_through_its_bar(fixture_src, tmp_path):
    rc, text = on_terminal(K3 + ["mxfp4-to-int4", fixture_src, "-o", str(tmp_path / "dst"), "--workers", "1"],
                           str(tmp_path))
    assert rc == 0, text
    assert "%|" in text, "no bar was drawn on the terminal"
    lines = assert_no_glued_lines(text)
    assert any(x.startswith("converting 3 of 3 shards; cpu: 1 worker(s)") for x in lines), lines
    assert lines[-1].startswith("report: "), lines[-3:]
    first = ANSI.sub("", text).lstrip("\r\n")
    assert first.startswith("starting ["), first[:200]  # the bar is there from the start, saying what it waits on


def test_demo_on_a_terminal_cleans_up_and_says_so(tmp_path):
    """demo: a first line at once (where, and that it is removed), no glued bar, nothing left."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rc, text = on_terminal(K3 + ["demo"], str(tmp_path), env={**ENV, "TMPDIR": str(tmp)})
    assert rc == 0, text
    lines = assert_no_glued_lines(text)
    assert lines[0].startswith(f"demo: a small Kimi-K3-shaped checkpoint and its int4 conversion, in {tmp}")
    assert lines[-1].startswith(f"removed {tmp}") and "--keep" in lines[-1]
    assert os.listdir(tmp) == []  # once 11 MB of /tmp/k3convert-demo-* per run


# --------------------------------------------------------------------------- the first line before torch

def first_line_then_torch(argv: list[str], cwd: str) -> tuple[str, str]:
    """Run ``argv`` on a terminal with ``-X importtime`` (every import a line on stderr, as it
    happens, in this process and its workers); the first line of the command's own output, and
    what came before torch's import line (everything when torch is never imported)."""
    rc, text = on_terminal([sys.executable, "-X", "importtime", *K3[1:], *argv], cwd)
    assert rc == 0, text[-3000:]
    lines = [x for x in re.split(r"[\r\n]", ANSI.sub("", text)) if x.strip()]
    ours = [i for i, x in enumerate(lines) if not x.startswith("import time:")]
    torch = [i for i, x in enumerate(lines) if re.match(r"import time:.*\|\s+torch$", x)]
    assert ours, text[-2000:]
    return lines[ours[0]], "\n".join(lines[: torch[0]] if torch else lines)


@pytest.mark.parametrize("argv, first", [
    (["make-fixture", "fx", "--layers", "2", "--experts", "2", "--shards", "1"],
     "writing a Kimi-K3-shaped MXFP4 fixture (2 layers, 2 experts, 1 shards) to fx; loading torch…"),
    (["demo", "--dir", "d"], "demo: a small Kimi-K3-shaped checkpoint and its int4 conversion, in d"),
    (["mxfp4-to-int4", "{src}", "-o", "out", "--workers", "1"], "starting ["),
    (["mxfp4-to-int4", "{src}", "-o", "out", "--dry-run"], "reading the shard headers of {src}…"),
])
def test_first_line_comes_before_torch_is_imported(argv, first, fixture_src, tmp_path):
    """On a terminal, each command's first line says what it waits on, before torch (seconds)
    is imported in it or its workers: 74b0137 printed make-fixture's and demo's first line after
    it, and convert's bar only after the plan."""
    argv = [a.format(src=fixture_src) for a in argv]
    line, before_torch = first_line_then_torch(argv, str(tmp_path))
    assert line.startswith(first.format(src=fixture_src)), line
    assert line in before_torch.splitlines(), f"{line!r} came after torch's import"


@pytest.mark.parametrize("argv", [["--help"], ["mxfp4-to-int4", "--help"], ["inspect", "{src}"],
                                  ["convert", "{src}"]])
def test_quick_commands_never_import_torch(argv, fixture_src, tmp_path):
    r = subprocess.run([sys.executable, "-X", "importtime", *K3[1:], *[a.format(src=fixture_src) for a in argv]],
                       cwd=str(tmp_path), env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 2), r.stderr[-2000:]
    assert not re.search(r"\|\s+torch$", r.stderr, re.M), "torch imported"


# --------------------------------------------------------------------------- nothing left behind

REAPER = r"""
import ctypes, json, os, subprocess, sys
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
with open(sys.argv[1], "wb") as log:
    rc = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=log).wait()
orphans = []  # what outlived the command is now our child: named while alive, then reaped
for d in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{d}/stat").read()
        if int(stat[stat.rindex(")") + 2:].split()[1]) == os.getpid():
            orphans.append(open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode())
    except (OSError, ValueError):
        pass
while True:
    try:
        pid, _ = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    orphans.append(pid)
print(json.dumps({"rc": rc, "outlived": orphans}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER")
@pytest.mark.parametrize("workers", ["1", "2"])
def test_no_process_outlives_the_command(workers, fixture_src, tmp_path):
    """Workers, their queues' threads and multiprocessing's resource tracker end before the command
    does (74b0137's resource tracker outlived it). A subreaper adopts whatever outlives the command:
    deterministic, however briefly it outlived it."""
    log = tmp_path / "stderr"
    r = subprocess.run([sys.executable, "-c", REAPER, str(log), *K3, "mxfp4-to-int4", fixture_src, "-o",
                        str(tmp_path / "dst"), "--workers", workers, "--progress", "none"],
                       cwd=str(tmp_path), env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["rc"] == 0, log.read_text()
    assert res["outlived"] == [], res["outlived"]
    text = log.read_text()
    assert "leaked" not in text and "Traceback" not in text, text  # no resource tracker warning at exit


def test_verify_prints_each_check_before_its_numeric_checks_load_torch(converted, tmp_path):
    """verify --source loads torch and compressed-tensors for its numeric checks (seconds): its first
    line and the structural checks come before that; 74b0137 printed the whole list at the end."""
    line, before_torch = first_line_then_torch(["verify", converted.dst, "--source", converted.src],
                                               str(tmp_path))
    assert line == f"verify {converted.dst}", line
    assert line in before_torch.splitlines(), f"{line!r} came after torch's import"
    assert any(x.strip().startswith("PASS  manifest") for x in before_torch.splitlines()), before_torch[-2000:]


# --------------------------------------------------------------------------- issue 33 §3: switches, verify

@pytest.mark.parametrize("switch", ["TQDM_DISABLE=1", "HF_HUB_DISABLE_PROGRESS_BARS=1", "K3CONVERT_QUIET=1", "-q"])
def test_bars_off_on_a_terminal(switch, tmp_path):
    """The ecosystem's switches turn the bars off (TQDM_DISABLE=1 once crashed demo: "'tqdm' object has no
    attribute 'fp'"; HF_HUB_DISABLE_PROGRESS_BARS was ignored); quiet also drops the status lines."""
    env = dict(ENV)
    argv = K3 + ["demo", "--dir", "d"]
    if switch == "-q":
        argv.insert(len(K3), "-q")
    else:
        env.update([switch.split("=")])
    rc, text = on_terminal(argv, str(tmp_path), env=env)
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text and "%|" not in text and not re.search(r"\[\d\d:\d\d", text), text[-3000:]
    lines = assert_no_glued_lines(text)
    assert lines[-1] == f"report: {tmp_path / 'd' / 'kimi-k3-fixture-int4' / 'k3convert_report.json'}", lines
    quiet = switch in ("K3CONVERT_QUIET=1", "-q")
    said = [x for x in lines if x.startswith(("demo: ", "writing a ", "converting "))]
    assert (said == []) if quiet else len(said) == 3, lines  # bars off: the status lines stay
    assert any(x.startswith("wrote 3 shards") for x in lines), lines  # make-fixture's result stays


@pytest.mark.parametrize("columns", [100, 0])
def test_verify_source_shows_each_check_while_it_runs(columns, converted, tmp_path):
    """verify --source was silent for 7 s (config: compressed-tensors' matcher) and then 15 s (the
    re-decode): each check shows what it does, its clock running, and is gone when its line prints.
    A terminal that reports no width (`script` into a pipe, some containers) once got blank frames."""
    from converter.verify import DOING, config, redecode

    rc, text = on_terminal(K3 + ["verify", converted.dst, "--source", converted.src], str(tmp_path),
                           columns=columns)
    assert rc == 0, text[-3000:]
    plain = ANSI.sub("", text)
    for module, name in ((config, "config"), (redecode, "re-decode")):
        shown = plain.find(DOING[module] + " [00:")
        assert shown >= 0, (DOING[module], plain[-3000:])
        assert shown < plain.index(f"PASS  {name}"), f"{name}: its status came after its result"
    lines = screen_lines(text)
    assert not [x for x in lines if any(f"{d} [" in x for d in DOING.values())], lines  # each status cleared
    assert lines[0] == f"verify {converted.dst}" and lines[-1] == "result: PASS", lines
