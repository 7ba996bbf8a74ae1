"""``--workers auto``: the CPU worker count chosen from cores, memory and shards; where the
choice is shown (dry run, progress line, ready event); the final line's rate and the bar's ETA."""
from __future__ import annotations

import inspect
import json

import pytest

from converter import devices, digest
from converter.run import workers
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.run.selection import plan_workers, resolve_devices
from converter.run.workers import THREADS_PER_WORKER, choose_cpu_workers, cpu_workers, worker_bytes
from converter.terminal import progress as cli
from converter.terminal.progress import eta, human_bytes, human_seconds, rate_line
from tests.conftest import SPEC, run_cli

GiB = 1 << 30
PER = worker_bytes(THREADS_PER_WORKER)


@pytest.mark.parametrize("cores, memory, shards, n, threads, why", [
    (16, 24 * GiB, 8, 8, 2, "one per 2 cores"),            # the benchmark machine (BENCHMARKS.md)
    (16, 24 * GiB, 64, 8, 2, "one per 2 cores"),           # many shards: cores decide
    (16, 24 * GiB, None, 8, 2, "one per 2 cores"),         # shard count unknown
    (16, 24 * GiB, 4, 4, 4, "one per shard, 4 to convert"),  # fewer shards: their workers get the cores
    (16, 24 * GiB, 1, 1, 16, "one per shard"),
    (16, 8 * GiB, 64, 4, 4, "half the available memory"),  # 4 GiB for workers of ~0.9 GiB
    (16, 1 * GiB, 64, 1, 16, "half the available memory"),  # never fewer than one
    (16, None, 64, 8, 2, "memory unknown"),
    (128, 500 * GiB, 1000, 64, 2, "one per 2 cores"),
    (3, 24 * GiB, 8, 1, 3, "one per 2 cores"),
    (2, 24 * GiB, 8, 1, 2, "one per 2 cores"),             # this VM
    (1, 24 * GiB, 8, 1, 1, "one per 2 cores"),
    (0, 24 * GiB, 8, 1, 1, "one per 2 cores"),             # a broken count still gives one worker
])
def test_chooser_table(cores, memory, shards, n, threads, why):
    c = choose_cpu_workers(cores, memory, shards)
    assert (c.workers, c.threads) == (n, threads), c
    assert why in c.reason and c.reason.startswith("auto: ")
    assert f"{max(1, cores)} cores" in c.reason
    assert str(c).startswith(f"cpu: {n} worker(s) x {threads} thread(s) (auto: ")


@pytest.mark.parametrize("cores", [1, 2, 5, 16, 32, 96])
@pytest.mark.parametrize("memory", [GiB // 2, 3 * GiB, 16 * GiB, 1 << 40])
@pytest.mark.parametrize("shards", [None, 1, 3, 8, 200])
def test_chooser_invariants(cores, memory, shards):
    c = choose_cpu_workers(cores, memory, shards)
    assert c.workers >= 1 and c.workers * c.threads <= cores or c.workers == c.threads == 1
    assert c.workers == 1 or c.workers * PER <= memory * workers.MEMORY_SHARE
    # sized with the threads each worker is given (its hashing buffers), not THREADS_PER_WORKER's
    assert c.workers == 1 or c.workers * worker_bytes(c.threads) <= memory * workers.MEMORY_SHARE
    assert c.workers <= (shards or c.workers) and c.workers <= max(1, cores // THREADS_PER_WORKER)
    # a cap that does not bind changes nothing
    assert choose_cpu_workers(cores, memory * 4, shards).workers >= c.workers


def test_worker_bytes_are_shard_converters_pools():
    """The memory estimate counts the buffers ShardConverter really allocates (shard.py)."""
    from converter.quant.cpu_kernel import requantize
    from converter.run import shard

    params = inspect.signature(shard.ShardConverter).parameters
    assert (params["readers"].default, params["writers"].default) == (workers.READERS, workers.WRITERS)
    assert workers.COPY_PIECE == shard.COPY_PIECE
    groups = 4096
    conv = shard.ShardConverter(requantize, "cpu", groups)

    def pooled_bytes(pool) -> int:
        buf = pool._make()
        return pool._count * (sum(t.numel() * t.element_size() for t in buf) if isinstance(buf, tuple) else buf.nbytes)

    # a source is MXFP4 or NVFP4: one of the two input pools fills (each allocates on first use)
    pooled = max(pooled_bytes(conv._inputs), pooled_bytes(conv._nvfp4_inputs)) + \
        pooled_bytes(conv._outputs) + pooled_bytes(conv._copies)
    hashing = digest.threads_for(6) * digest.CHUNK
    assert worker_bytes(6, groups) == workers.RUNTIME_BYTES + pooled + hashing
    assert worker_bytes(6, 2 * groups) > worker_bytes(6, groups)


def test_cgroup_quota_and_memory_limit(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert devices.cpu_quota(str(v2)) == 2
    (v2 / "cpu.max").write_text("max 100000\n")
    assert devices.cpu_quota(str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert devices.cpu_quota(str(v1)) == 4
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert devices.cpu_quota(str(v1)) is None
    monkeypatch.setattr(devices, "cpu_quota", lambda root=devices.CGROUP: 1)
    assert devices.cpus() == 1

    monkeypatch.setattr(devices, "_meminfo", lambda key: 64 * GiB)
    (v2 / "memory.max").write_text(f"{4 * GiB}\n")
    (v2 / "memory.current").write_text(f"{3 * GiB}\n")
    (v2 / "memory.stat").write_text(f"anon 123\ninactive_file {GiB}\nactive_file 5\n")
    assert devices.memory_available(str(v2)) == 2 * GiB   # page cache it may reclaim is not in use
    (v2 / "memory.max").write_text("max\n")
    assert devices.memory_available(str(v2)) == 64 * GiB
    (v1 / "memory").mkdir()
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{8 * GiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{2 * GiB}\n")
    (v1 / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    assert devices.memory_available(str(v1)) == 6 * GiB


def test_requested_count_is_kept_and_said(monkeypatch):
    monkeypatch.setattr(workers, "cpus", lambda: 16)
    monkeypatch.setattr(workers, "memory_available", lambda: 24 * GiB)
    c = cpu_workers(3, shards=1)   # an explicit count is never capped
    assert (c.workers, c.threads) == (3, 5) and "--workers 3; 16 cores, 24.0 GiB available" in c.reason
    assert cpu_workers(None, 8) == choose_cpu_workers(16, 24 * GiB, 8)
    devs, note, threads = plan_workers(Options(devices=["cpu"], workers=None), shards=8)
    assert threads == 2  # what the note says each worker gets, passed to Workers as is
    assert devs == ["cpu"] * 8
    assert note == "cpu: 8 worker(s) x 2 thread(s) (auto: one per 2 cores; 16 cores, 24.0 GiB available)"
    assert resolve_devices(Options(devices=["cpu"], workers=None), 3) == ["cpu"] * 3


def test_dry_run_says_the_choice(fixture_src, monkeypatch):
    monkeypatch.delenv("K3CONVERT_WORKERS", raising=False)  # conftest pins the other tests to one worker
    r = run_cli("mxfp4-to-int4", fixture_src, "--dry-run", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("workers:"))
    c = cpu_workers(None, SPEC.shards)
    assert f"cpu: {c.workers} worker(s) x {c.threads} thread(s) (auto: " in line
    r = run_cli("mxfp4-to-int4", fixture_src, "--dry-run", "--devices", "cpu", "--workers", "2", "--progress", "json")
    info = json.loads(r.stdout)
    assert info["devices"] == ["cpu", "cpu"] and "(--workers 2; " in info["workers"]
    monkeypatch.setenv("K3CONVERT_WORKERS", "3")  # a site's default; the command line still wins
    r = run_cli("mxfp4-to-int4", fixture_src, "--dry-run", "--devices", "cpu")
    assert "(--workers 3; " in r.stdout
    r = run_cli("mxfp4-to-int4", fixture_src, "--dry-run", "--devices", "cpu", "--workers", "auto")
    assert "(auto: " in r.stdout
    r = run_cli("mxfp4-to-int4", fixture_src, "--dry-run", "--workers", "0")
    assert r.exit_code == 2 and "not a positive number or auto" in r.output


def test_progress_line_and_events_carry_the_choice(fixture_src, tmp_path, capsys):
    events: list[tuple[str, dict]] = []
    convert(fixture_src, str(tmp_path / "out"), Options(devices=["cpu"], workers=None),
            lambda k, f: events.append((k, f)))
    plan = next(f for k, f in events if k == "plan")
    c = cpu_workers(None, SPEC.shards)
    assert plan["workers"].startswith(f"cpu: {c.workers} worker(s) x {c.threads} thread(s) (auto: ")
    progress = cli.Progress("bar")
    progress("plan", plan)
    progress.close()
    assert f"converting {SPEC.shards} of {SPEC.shards} shards; {plan['workers']}" in capsys.readouterr().err


def test_ready_event_reports_threads(fixture_src, tmp_path, monkeypatch):
    """A worker process reports its compute threads: its share of the cores, or fewer where
    NUMBA_NUM_THREADS is set lower (numba refuses more: the worker once failed)."""
    for env, expected in ((None, devices.cpus()), ("1", 1)):
        if env:
            monkeypatch.setenv("NUMBA_NUM_THREADS", env)
        c = cpu_workers(1)  # the note states the threads the worker reports
        assert c.threads == expected and (f"NUMBA_NUM_THREADS={env}" in str(c)) == (expected < devices.cpus()), c
        events: list[tuple[str, dict]] = []
        convert(fixture_src, str(tmp_path / f"out{env}"), Options(devices=["cpu"], workers=1, inline=False),
                lambda k, f: events.append((k, f)))
        ready = [f for k, f in events if k == "ready"]
        assert len(ready) == 1 and ready[0]["threads"] == expected


def test_rate_line_tiny_and_huge_jobs():
    assert rate_line(5_240_000, 0.41) == "5.24 MB in 0.41 s, 12.8 MB/s"
    assert rate_line(5_240_000, 4.1) == "5.24 MB in 4.1 s, 1.28 MB/s"  # the demo: once "0.00 GB/s"
    assert rate_line(1_450_000_000_000, 4321.0) == "1.45 TB in 1 h 12 min, 336 MB/s"
    assert rate_line(12_300_000_000, 10.71) == "12.3 GB in 10.7 s, 1.15 GB/s"
    assert rate_line(0, 0.05) == "nothing left to convert (0.05 s)"
    assert human_bytes(999) == "999 B" and human_bytes(999_600) == "1.00 MB" and human_bytes(12_660) == "12.7 kB"
    assert human_seconds(59.6) == "1 min 00 s" and human_seconds(3600) == "1 h 00 min"
    assert human_seconds(0.004) == "0.004 s"


def test_no_eta_until_data_has_flowed(monkeypatch, capsys):
    """A long start-up before the first bytes must not enter the rate, and the first bytes
    (headers, at once) are no rate either."""
    assert eta(10**6, 10**9, cli.ETA_AFTER_S / 2) is None
    assert eta(2 * 10**9, 12 * 10**9, 2.5) == "800 MB/s, 12.5 s left"
    clock = [1000.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    bar = cli.Progress("bar")
    bar("plan", {"todo": 1, "shards": 1, "bytes_in": 10**10, "devices": ["cpu"], "workers": "cpu: 1 worker(s)"})
    clock[0] += 30.0                       # workers start up
    bar("bytes", {"n": 10**6})             # a shard's header
    assert "left" not in bar.bar.postfix
    clock[0] += 1.0
    bar("bytes", {"n": 10**9})
    assert "left" not in bar.bar.postfix   # 1 s of data: too early
    clock[0] += 1.0
    bar("bytes", {"n": 10**9})             # 2e9 bytes in 2 s since the header: 1 GB/s, 8 s left
    assert bar.bar.postfix == "1.00 GB/s, 8 s left"
    bar.close()
    capsys.readouterr()
