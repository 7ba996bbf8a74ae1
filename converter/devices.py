"""How many GPUs (and cores) this process may use; GPUs asked of the driver without importing torch.

Importing torch takes about 3 s. The parent process only plans and coordinates, so it
asks the CUDA driver (or the HIP runtime) directly and starts one worker per GPU at once;
the workers import torch in parallel while the parent reads the checkpoint's headers. Both
calls honour CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, as torch does. Where neither
library loads but a GPU device node exists (a torch wheel that bundles its own runtime),
torch is asked after all.
"""
from __future__ import annotations

import ctypes
import glob
import os

from .terminal.whole import whole


def _count(library: str, init: str | None, count: str) -> int | None:
    """Devices the library reports; None when the library is not there."""
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        return None
    if init and getattr(lib, init)(0) != 0:  # no device, no driver: none usable
        return 0
    n = ctypes.c_int(0)
    return n.value if getattr(lib, count)(ctypes.byref(n)) == 0 else 0


def gpu_count() -> int:
    for probe in (("libcuda.so.1", "cuInit", "cuDeviceGetCount"), ("libamdhip64.so", None, "hipGetDeviceCount")):
        n = _count(*probe)
        if n is not None:
            return n
    if os.path.exists("/dev/kfd") or glob.glob("/dev/nvidia[0-9]*"):
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 0


CGROUP = "/sys/fs/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    n = whole(text.removeprefix("-")) if text else None   # ASCII digits: "²".isdigit() is True, int("²") fails
    return None if n is None or text is None else -n if text.startswith("-") else n


def cpu_quota(root: str = CGROUP) -> int | None:
    """Whole cores a container's CPU quota allows (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``);
    None when unlimited or unknown."""
    v2 = (_read(os.path.join(root, "cpu.max")) or "").split()
    quota, period = (_number(v2[0]), _number(v2[1])) if len(v2) == 2 else \
        (_number(_read(os.path.join(root, "cpu", "cpu.cfs_quota_us"))),
         _number(_read(os.path.join(root, "cpu", "cpu.cfs_period_us"))))
    if not quota or not period or quota < 0:
        return None
    return max(1, quota // period)


def cpus() -> int:
    """Cores this process may run on: a batch job's allocation (its CPU affinity and a
    container's CPU quota), not the node's."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return min(n, cpu_quota() or n)


def _meminfo(key: str) -> int | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def memory_available(root: str = CGROUP) -> int | None:
    """Bytes this process may still use without pushing anything out: the kernel's MemAvailable,
    or less under a container's memory limit (its limit minus its usage that cannot be
    reclaimed, page cache not counted). None when unknown."""
    found = [m for m in (_meminfo("MemAvailable"),) if m is not None]
    for limit, usage, stat, inactive in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                          "memory/memory.stat", "total_inactive_file")):
        lim, used = _number(_read(os.path.join(root, limit))), _number(_read(os.path.join(root, usage)))
        if lim is None or used is None or lim >= 1 << 60:  # "max", or v1's "unlimited" (about 2**63)
            continue
        cache = next((int(line.split()[1]) for line in (_read(os.path.join(root, stat)) or "").splitlines()
                      if line.startswith(inactive + " ")), 0)
        found.append(max(0, lim - max(0, used - cache)))
        break
    return min(found) if found else None
