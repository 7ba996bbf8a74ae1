"""What the host can do, stage by stage: the ceilings the conversion pipeline works against.

Hashing (SHA-256 on 1 and N threads), memory copy, file write and read in a directory
(tmpfs or disk), pinned host<->device copies, and start-up costs (imports, CUDA init,
the Triton kernel's first call from a warm cache).

    PYTHONPATH=. python scripts/benchmarks/bench_host.py --dir /dev/shm/k3host [--gb 2]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def rate(nbytes: int, fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/k3host")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    n = int(args.gb * 1e9) // (64 << 20) * (64 << 20)
    buf = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    chunks = [memoryview(buf[i:i + (64 << 20)]) for i in range(0, n, 64 << 20)]
    res: dict = {"cpus": os.cpu_count(), "dir": args.dir, "bytes": n}

    res["sha256_1thread_GBps"] = rate(n, lambda: hashlib.sha256(buf).digest())
    with ThreadPoolExecutor(args.threads) as pool:
        res[f"sha256_{args.threads}threads_GBps"] = rate(
            n, lambda: list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks)))
    res["blake2b_1thread_GBps"] = rate(n, lambda: hashlib.blake2b(buf).digest())
    dst = np.empty_like(buf)
    res["memcpy_1thread_GBps"] = rate(n, lambda: np.copyto(dst, buf))

    path = os.path.join(args.dir, "write.bin")

    def write(piece: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(buf)
        for i in range(0, n, piece):
            os.write(fd, view[i:i + piece])
        os.close(fd)

    for piece in (1 << 20, 16 << 20, 64 << 20):
        res[f"write_{piece >> 20}MiB_GBps"] = rate(n, lambda: write(piece))

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        for i in range(0, n, 64 << 20):
            os.preadv(fd, [memoryview(dst[i:i + (64 << 20)])], i)
        os.close(fd)

    res["pread_64MiB_GBps"] = rate(n, read)
    os.unlink(path)

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    res["python_import_torch_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import converter.cli"], check=True)
    res["python_import_cli_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import converter.run.pipeline"], check=True)
    res["python_import_pipeline_s"] = time.perf_counter() - t0

    import torch
    if torch.cuda.is_available():
        t0 = time.perf_counter()
        torch.cuda.init()
        torch.empty(1, device="cuda")
        res["cuda_init_s"] = time.perf_counter() - t0
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")

        def h2d():
            dev.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        def d2h():
            pinned.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()

        res["h2d_pinned_GBps"] = rate(n, h2d)
        res["d2h_pinned_GBps"] = rate(n, d2h)
        t0 = time.perf_counter()
        torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        res["pin_alloc_1GiB_s"] = time.perf_counter() - t0
        from converter.kernels.triton_requant import requantize
        p = torch.zeros(1 << 16, 16, dtype=torch.uint8, device="cuda")
        s = torch.full((1 << 16,), 127, dtype=torch.uint8, device="cuda")
        t0 = time.perf_counter()
        requantize(p, s)
        torch.cuda.synchronize()
        res["triton_first_call_s"] = time.perf_counter() - t0
    print(json.dumps(res, indent=2))
    with open(os.path.join(args.out, "bench_host.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
