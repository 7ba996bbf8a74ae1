"""Batch jobs for real: scripts/tools/slurm_array.sh under a one-node Slurm, and the job files.

A session fixture starts munged, slurmctld and slurmd as root, every file of theirs under a
temporary directory (no systemd, no cgroups: proctrack/linuxproc, task/none), and points the
Slurm commands at them with SLURM_CONF. ``sbatch --array --wait`` of the example script must
give the bytes of a single-process run, and a failing task must fail the test with its log.
Skipped, saying why, only without root or without the packages and a way to install them;
K3CONVERT_REQUIRE_SLURM=1 (set by .ci/run as root) turns that skip into a failure.
The job files in configs/jobs/ and the Kubernetes Job are checked without Slurm.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from loop_mounts import two_mounts  # noqa: F401 (a fixture)

from converter.cli import jobfile, mxfp4_to_int4
from converter.fixture import FixtureSpec, make_fixture
from tests.conftest import (
    INDEX,
    MANIFEST,
    assert_not_complete,
    ct_mxfp4_encode,
    expert_modules,
    raw_header,
    read_json,
    run_cli,
    tree_hash,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "tools" / "slurm_array.sh"
K8S = REPO / "scripts" / "tools" / "k8s_job.yaml"
JOBS = sorted((REPO / "configs" / "jobs").glob("*.toml"))
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
TOOLS = ["munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scancel"]
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
PARTITION = "k3test"
# Five shards, one layer each (shard 1 dense, copy-only): an array of 4 gives task 0 two shards.
SPEC = FixtureSpec(layers=5, experts=4, hidden=64, inter=64, latent=96, shards=5, vocab=64, seed=7)


# ---------------------------------------------------------------- the one-node cluster

def _which(tool: str) -> str | None:
    return shutil.which(tool, path=SBIN_PATH)


def _install() -> str | None:
    """Install the Slurm packages with apt-get (root only); why not, or None when done."""
    missing = [t for t in TOOLS if not _which(t)]
    if not missing:
        return None
    apt = shutil.which("apt-get")
    if apt is None:
        return f"{', '.join(missing)} missing and no apt-get to install {' '.join(PACKAGES)}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode:
            return f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-500:]}"
    missing = [t for t in TOOLS if not _which(t)]
    return f"{', '.join(missing)} still missing after installing {' '.join(PACKAGES)}" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """A running one-node Slurm: ``env`` points the Slurm commands at it."""
    root: Path
    host: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def logs(self) -> str:
        """The daemons' logs (their last lines), for failure messages."""
        out = []
        for p in sorted((self.root / "log").iterdir()):
            lines = p.read_text(errors="replace").splitlines()[-30:]
            out.append(f"--- {p.name}:\n" + "\n".join(lines))
        return "\n".join(out)

    def run(self, *cmd: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([_which(cmd[0]) or cmd[0], *cmd[1:]], env=kw.pop("env", self.env),
                              capture_output=True, text=True, timeout=timeout, **kw)

    def start(self, name: str, *cmd: str) -> None:
        out = open(self.root / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen([_which(cmd[0]), *cmd[1:]], env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()

    def wait_for(self, what: str, ready, timeout: float = 30) -> None:
        """Poll ``ready()`` until true; fail with the logs if a daemon exits or time runs out."""
        end = time.monotonic() + timeout
        while not ready():
            dead = [f"{n} exited {p.returncode}" for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > end:
                pytest.fail(f"one-node Slurm: {what} not ready ({'; '.join(dead) or f'{timeout} s'})\n{self.logs()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons this fixture started (by their pids)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", f"--partition={PARTITION}", timeout=10)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _slurm_conf(c: Cluster, sock: Path) -> str:
    r = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
    hw = [t for t in r.stdout.splitlines()[0].split() if not t.startswith("NodeName=")]  # CPUs, RealMemory, ...
    d = c.root
    return "\n".join([
        "ClusterName=k3convert-test",
        f"SlurmctldHost={c.host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/run/slurmctld.pid", f"SlurmdPidFile={d}/run/slurmd.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd.log",
        # no systemd, no cgroups, no accounting
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
        # sbatch --wait polls every 2 s while MinJobAge/2 <= 2, and finished jobs are purged soon
        "MinJobAge=5", "ReturnToService=2",
        f"NodeName={c.host} NodeAddr=127.0.0.1 {' '.join(hw)} State=UNKNOWN",
        # up to 4 jobs per core: an array's tasks all run at once, even on a 2-core machine
        f"PartitionName={PARTITION} Nodes={c.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
    ]) + "\n"


def _node_state(c: Cluster) -> str:
    try:
        return c.run("sinfo", "-h", "-N", "-n", c.host, "-o", "%T", timeout=10).stdout.strip()
    except subprocess.TimeoutExpired:
        return ""


@pytest.fixture(scope="session")
def slurm():
    """A one-node Slurm with munge, root-owned, all state in a temporary directory."""
    t0 = time.monotonic()
    reason = "needs root to start munged, slurmctld and slurmd" if os.geteuid() != 0 else _install()
    if reason:
        if os.environ.get("K3CONVERT_REQUIRE_SLURM"):
            pytest.fail(f"K3CONVERT_REQUIRE_SLURM is set but the one-node Slurm cannot run: {reason}")
        pytest.skip(f"one-node Slurm: {reason}")
    t_install = time.monotonic() - t0
    root = Path(tempfile.mkdtemp(prefix="k3slurm-"))  # short: unix socket paths are limited to 107 bytes
    for d in ("state", "spool", "log", "run"):
        (root / d).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    c = Cluster(root, socket.gethostname().split(".")[0], env)
    try:
        t1 = time.monotonic()
        key, sock = root / "munge.key", root / "run" / "munge.sock"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # its own key, never group/other-readable
        os.write(fd, os.urandom(128))
        os.close(fd)
        c.start("munged", "munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log",
                f"--seed-file={root}/run/munged.seed")
        c.wait_for("munged", sock.exists, timeout=10)
        (root / "slurm.conf").write_text(_slurm_conf(c, sock))
        c.start("slurmctld", "slurmctld", "-D")
        c.start("slurmd", "slurmd", "-D", "-N", c.host)
        c.wait_for(f"node {c.host} idle", lambda: _node_state(c) == "idle")
        print(f"\none-node Slurm: install {t_install:.1f} s, daemons up {time.monotonic() - t1:.1f} s")
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- jobs

@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("slurm-src") / "kimi-k3-mini")
    make_fixture(path, SPEC, encoder=ct_mxfp4_encode)
    return path


def write_job(path: Path, src: str, dst: str) -> Path:
    """A job file with paths relative to itself (not to the job's working directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rel = lambda p: os.path.relpath(p, path.parent)  # noqa: E731
    path.write_text(f'# test job\nsrc = "{rel(src)}"\noutput = "{rel(dst)}"\ndevices = "cpu"\nprogress = "json"\n')
    return path


def job_env(c: Cluster) -> dict[str, str]:
    """The cluster's environment, with this Python's k3convert first on PATH (sbatch exports it)."""
    env = dict(c.env)
    bindir = os.path.dirname(sys.executable)
    if os.access(os.path.join(bindir, "k3convert"), os.X_OK):
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    else:  # installed elsewhere (pip --user): the same Python, as a module
        env["K3CONVERT"] = f"{sys.executable} -m converter"
    return env


def sbatch_array(c: Cluster, job: Path, tasks: int, workdir: Path, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
    """``sbatch --array=0-(tasks-1) --wait`` of scripts/tools/slurm_array.sh (``extra``: k3convert options
    after the job file); (sbatch's result, job id)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable", "--wait", f"--array=0-{tasks - 1}", "--export=ALL", f"--chdir={workdir}",
           f"--output={workdir}/k3convert-%A_%a.log", "--cpus-per-task=1", "--mem=1G", "--time=5",
           str(SCRIPT), str(job), *extra]
    try:
        r = c.run(*cmd, timeout=300, env=job_env(c))
    except subprocess.TimeoutExpired:
        pytest.fail(f"sbatch --wait still waiting after 300 s\n{c.logs()}\n{task_logs(workdir)}")
    m = re.match(r"(\d+)", r.stdout)
    assert m, f"sbatch printed no job id (exit {r.returncode}): {r.stdout}{r.stderr}\n{c.logs()}"
    return r, m.group(1)


def task_logs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')}" for p in sorted(workdir.glob("*.log")))


def finished(log: str) -> bool:
    """The task's k3convert reached its JSON 'finished' event (progress = "json")."""
    for line in log.splitlines():
        try:
            if json.loads(line).get("event") == "finished":
                return True
        except (ValueError, AttributeError):
            continue
    return False


def assert_array_ok(r: subprocess.CompletedProcess, workdir: Path, job_id: str, tasks: int) -> None:
    """sbatch --wait exited 0 and every task finished; else fail showing each failed task's log."""
    failed = []
    for t in range(tasks):
        path = workdir / f"k3convert-{job_id}_{t}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        if not finished("\n".join(lines)):
            tail = [ln for ln in lines if '"event": "bytes"' not in ln][-40:]
            failed.append(f"--- task {t} ({path.name}):\n" + ("\n".join(tail) or "(no log)"))
    if r.returncode or failed:
        said = f": {r.stderr.strip()}" if r.stderr.strip() else ""
        raise AssertionError(f"job array {job_id}: sbatch --wait exited {r.returncode}, {len(failed)} of {tasks} "
                             f"task(s) failed{said}\n" + "\n".join(failed))


def stable_manifest(dst: str) -> dict:
    """The manifest without what differs between runs: timings and output mtimes."""
    m = read_json(os.path.join(dst, MANIFEST))
    m.pop("finished_at", None)
    for s in m["shards"].values():
        s.pop("seconds", None)
        s.pop("stages", None)
        s.get("output", {}).pop("mtime_ns", None)
    return m


def outputs(dst: str) -> dict[str, str]:
    """sha256 of every file a server or user reads: all but the run records in .k3convert/ and the manifest."""
    return {k: v for k, v in tree_hash(dst).items() if not k.startswith(".k3convert") and k != MANIFEST}


def test_slurm_array_equals_one_process(slurm, src, tmp_path):
    dst, ref = str(tmp_path / "out" / "dst"), str(tmp_path / "out" / "ref")
    job = write_job(tmp_path / "jobs" / "job.toml", src, dst)
    t0 = time.monotonic()
    r, job_id = sbatch_array(slurm, job, 4, tmp_path / "work")
    print(f"4-task array: {time.monotonic() - t0:.1f} s")
    assert_array_ok(r, tmp_path / "work", job_id, 4)
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is True

    one = run_cli("mxfp4-to-int4", "--config", job, "-o", ref, "--progress", "none")
    assert one.exit_code == 0, one.output
    got, want = outputs(dst), outputs(ref)
    assert sum(k.endswith(".safetensors") for k in want) == SPEC.shards and "model.safetensors.index.json" in want
    assert got == want, [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
    assert stable_manifest(dst) == stable_manifest(ref)

    v = run_cli("verify", dst, "--source", src, "--all")
    assert v.exit_code == 0, v.output


def test_failing_task_fails_with_its_log(slurm, src, tmp_path):
    """A NaN scale in shard 4: the task converting it fails, the test helper shows its log."""
    bad = str(tmp_path / "bad-src")
    shutil.copytree(src, bad)
    shard = sorted(set(expert_modules(bad).values()))[-2]  # model-00004-of-00005: part 2 of 2
    module = sorted(m for m, s in expert_modules(bad).items() if s == shard)[0]
    scale_shard = read_json(os.path.join(bad, INDEX))["weight_map"][f"{module}.weight_scale"]  # maybe another
    header, start = raw_header(os.path.join(bad, scale_shard))
    with open(os.path.join(bad, scale_shard), "r+b") as f:
        f.seek(start + header[f"{module}.weight_scale"]["data_offsets"][0])
        f.write(b"\xff")  # E8M0 255 = NaN
    dst = str(tmp_path / "dst")
    r, job_id = sbatch_array(slurm, write_job(tmp_path / "job.toml", bad, dst), 2, tmp_path / "work")
    assert r.returncode != 0, r

    with pytest.raises(AssertionError) as e:
        assert_array_ok(r, tmp_path / "work", job_id, 2)
    msg = str(e.value)
    assert f"--- task 1 (k3convert-{job_id}_1.log)" in msg and "--- task 0" not in msg, msg
    # the job logs JSON events (progress = "json"): the error is the last one, "failed"
    error = (rf'^{{"event": "failed", .*"error": "file \S*{re.escape(scale_shard)}, tensor '
             rf'{re.escape(module)}\.weight_scale: .*NaN')
    assert re.search(error, msg, re.M), msg
    assert "slurm_array.sh: task 1 (part 2/2) failed with exit 2" in msg, msg
    assert_not_complete(dst)


def test_slurm_arrays_through_another_device_continue(slurm, src, two_mounts, tmp_path):
    """Issue 25 S1: the tasks of a job array see SRC through another mount than the ones before
    them (another node, an autofs remount, a reboot: another st_dev, the same files). A first
    array converts shards 1-2 through one loop device; SRC is then remounted through another
    (read-only) and a second array converts the rest and completes DST, equal to one process."""
    mnt, remount = two_mounts
    shared = os.path.join(mnt, "src")
    shutil.copytree(src, shared)
    os.sync()
    dst, ref = str(tmp_path / "out" / "dst"), str(tmp_path / "out" / "ref")
    job = write_job(tmp_path / "jobs" / "job.toml", shared, dst)
    r, job_id = sbatch_array(slurm, job, 2, tmp_path / "work1", "--shards", "1-2")
    assert_array_ok(r, tmp_path / "work1", job_id, 2)
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is False
    dev = os.stat(os.path.join(shared, "config.json")).st_dev
    remount()
    assert os.stat(os.path.join(shared, "config.json")).st_dev != dev
    r, job_id = sbatch_array(slurm, job, 2, tmp_path / "work2")
    assert_array_ok(r, tmp_path / "work2", job_id, 2)
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is True

    one = run_cli("mxfp4-to-int4", "--config", job, "-o", ref, "--progress", "none")
    assert one.exit_code == 0, one.output
    assert outputs(dst) == outputs(ref)
    v = run_cli("verify", dst, "--source", shared, "--all")
    assert v.exit_code == 0, v.output


# ---------------------------------------------------------------- without Slurm

def test_script_gives_each_task_its_part(tmp_path):
    """The script's --part from the array variables, the options passed on, and its refusals."""
    def run(task: int, lo: int, n: int, k3: str = "echo") -> subprocess.CompletedProcess:
        env = dict(os.environ, K3CONVERT=k3, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_MIN=str(lo),
                   SLURM_ARRAY_TASK_COUNT=str(n))
        return subprocess.run(["bash", str(SCRIPT), "job.toml", "--overwrite"], env=env, capture_output=True,
                              text=True, timeout=30)

    for task, lo, n, part in ((0, 0, 4, "1/4"), (3, 0, 4, "4/4"), (8, 1, 8, "8/8")):
        r = run(task, lo, n)
        assert r.returncode == 0 and r.stdout.split() == [
            "mxfp4-to-int4", "--config", "job.toml", "--part", part, "--overwrite"], (task, lo, n, r)
    r = run(14, 0, 8)  # --array=0-14:2: 8 tasks, ids not contiguous
    assert r.returncode == 2 and "contiguous" in r.stderr and not r.stdout, r
    r = run(0, 0, 2, k3="false")
    assert r.returncode == 1 and "task 0 (part 1/2) failed with exit 1" in r.stderr, r


def test_examples_are_job_files(src, tmp_path):
    """Every example loads, names SRC and DST by absolute path, leaves --part to the scheduler,
    and each value is accepted by the command (a dry run, SRC and -o given on the command line)."""
    assert len(JOBS) >= 3, JOBS
    for job in JOBS:
        values = jobfile.load(str(job), mxfp4_to_int4)
        assert os.path.isabs(values["src"]) and os.path.isabs(values["dst"]), (job.name, values)
        assert "part" not in values and "shard_spec" not in values, job.name
        dst = str(tmp_path / job.stem)
        r = run_cli("mxfp4-to-int4", "--config", job, src, "-o", dst, "--dry-run")
        assert r.exit_code == 0 and dst in r.stdout and src in r.stdout, (job.name, r.output)


def test_schedulers_use_example_job_files(tmp_path):
    """slurm_array.sh and k8s_job.yaml name existing examples; the Job's pods get part k+1 of
    completions from the mounted job file (its shell command run with a stand-in k3convert)."""
    for script in (SCRIPT, K8S):
        named = re.findall(r"configs/jobs/\S+?\.toml", script.read_text())
        assert named and all((REPO / n).is_file() for n in named), (script.name, named)
    yaml = pytest.importorskip("yaml")
    text = K8S.read_text()
    spec = yaml.safe_load(text)["spec"]
    pod = spec["template"]["spec"]
    box = pod["containers"][0]
    m = re.search(r"kubectl create configmap (\S+) --from-file=([^=\s]+)=(\S+)", text)
    assert m, "no kubectl create configmap line"
    name, key, example = m.groups()
    assert REPO / example in JOBS, example
    vol = [v["name"] for v in pod["volumes"] if v.get("configMap", {}).get("name") == name]
    assert vol, f"ConfigMap {name} not mounted"
    mount = next(v["mountPath"] for v in box["volumeMounts"] if v["name"] == vol[0])
    fake = tmp_path / "bin" / "k3convert"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    n = spec["completions"]
    for k in range(n):
        env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", JOB_COMPLETION_INDEX=str(k))
        r = subprocess.run(box["command"] + box["args"], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.split() == [
            "mxfp4-to-int4", "--config", f"{mount}/{key}", "--part", f"{k + 1}/{n}"], (k, r)
