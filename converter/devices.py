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


def cpus() -> int:
    """Cores this process may run on: a batch job's allocation (its CPU affinity), not the node's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
