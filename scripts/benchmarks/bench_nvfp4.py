"""NVFP4 -> int4 group 32: the error of the optimum and of the server's load-time rule, and the CPU speed.

Sources: (1) heavy-tailed random weights (Student-t, 4 degrees of freedom, over sqrt(in): like a trained
expert's) quantized to NVFP4 by compressed-tensors itself (``generate_gparam``, ``calculate_qparams``,
``NVFP4PackedCompressor.compress``); (2) auto-round 0.16.1's own NVFP4 export in tests/support/data/auto-round.
Errors are relative RMSE against the NVFP4 values (what the checkpoint holds), and for (1) also against
the bf16 weights the NVFP4 was made from, for scale.

    PYTHONPATH=. python scripts/benchmarks/bench_nvfp4.py [--rows 768 --cols 2048 --mats 4 --threads 1]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import numba
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import NVFP4A16
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file

from converter.formats import nvfp4
from converter.formats.int4 import decode as int4_decode
from converter.quant import nvfp4_requant as nv

SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4A16)
HERE = os.path.dirname(os.path.abspath(__file__))


def ct_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16-valued float32 [R, C] -> compressed-tensors NVFP4 (packed, e4m3 scales, global scale)."""
    gs = generate_gparam(w.min().reshape(1), w.max().reshape(1))
    g = w.reshape(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), SCHEME.weights, global_scale=gs)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, SCHEME)
    return sd["weight_packed"], sd["weight_scale"], sd["weight_global_scale"]


def row(name: str, tot: dict) -> str:
    ours, srv = math.sqrt(tot["err2"] / tot["ref2"]), math.sqrt(tot["server"] / tot["ref2"])
    extra = f" | {math.sqrt(tot['fp4_vs_bf16'] / tot['w2']):.4f} | {math.sqrt(tot['ours_vs_bf16'] / tot['w2']):.4f}" \
        if "w2" in tot else " | - | -"
    return (f"| {name} | {tot['groups']:,} | {ours:.4f} | {srv:.4f} | {srv / ours:.3f}x"
            f"{extra} | {tot['us'] / tot['groups']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=768)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--mats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    numba.set_num_threads(a.threads)   # the sweep kernel's prange
    torch.manual_seed(a.seed)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {a.threads} thread(s)")
    print("| source | groups | ours rel RMSE vs FP4 | server rule vs FP4 | server / ours (RMSE) "
          "| FP4 vs bf16 origin | ours vs bf16 origin | us / group |")
    print("|---|---|---|---|---|---|---|---|")
    tot = dict(err2=0.0, ref2=0.0, server=0.0, groups=0, us=0.0, w2=0.0, fp4_vs_bf16=0.0, ours_vs_bf16=0.0)
    for _ in range(a.mats):
        w = (torch.distributions.StudentT(4.0).sample((a.rows, a.cols)) / math.sqrt(a.cols)).bfloat16().float()
        packed, scales, gs = ct_nvfp4(w)
        g = nv.GlobalScale(float(gs), True)
        t0 = time.perf_counter()
        r = nv.requantize_module(packed, scales, g)
        tot["us"] += (time.perf_counter() - t0) * 1e6
        v = nv.decode(packed, scales, g)
        ours = int4_decode(r.words, r.scales).double()
        tot["err2"] += r.err2
        tot["ref2"] += r.ref2
        tot["server"] += r.server_err2
        tot["groups"] += a.rows * a.cols // 32
        tot["w2"] += float((w.double() ** 2).sum())
        tot["fp4_vs_bf16"] += float(((v - w.double()) ** 2).sum())
        tot["ours_vs_bf16"] += float(((ours - w.double()) ** 2).sum())
    print(row(f"Student-t {a.mats} x [{a.rows}, {a.cols}], compressed-tensors NVFP4", tot))
    groups = v.reshape(-1, 32).contiguous()
    runs = []
    for _ in range(3):   # the search alone (numba kernel, compiled by the calls above)
        t0 = time.perf_counter()
        nv.optimal(groups)
        runs.append((time.perf_counter() - t0) / groups.shape[0] * 1e6)
    for name in ("nvfp4", "nvfp4-llm-compressor"):
        root = os.path.join(HERE, "..", "..", "tests", "data", "auto-round", name)
        with open(os.path.join(root, "config.json")) as f:
            src = nvfp4.read(json.load(f), "config.json", drop=True)
        t = load_file(os.path.join(root, "model.safetensors"))
        tot = dict(err2=0.0, ref2=0.0, server=0.0, groups=0, us=0.0)
        suffix = "." + src.packed_suffix
        for m in sorted(n[: -len(suffix)] for n, x in t.items() if n.endswith(suffix) and x.dtype == torch.uint8):
            packed = t[f"{m}.{src.packed_suffix}"]
            gs = nv.GlobalScale(float(t[f"{m}.{src.global_suffix}"].reshape(())), src.divide)
            t0 = time.perf_counter()
            r = nv.requantize_module(packed, t[f"{m}.weight_scale"], gs)
            tot["us"] += (time.perf_counter() - t0) * 1e6
            tot["err2"] += r.err2
            tot["ref2"] += r.ref2
            tot["server"] += r.server_err2
            tot["groups"] += packed.numel() // 16
        print(row(f"auto-round 0.16.1 export ({src.layout.value}), 10 linears", tot))
    print(f"\nsearch alone (`nvfp4_requant.optimal`, last Student-t matrix): {min(runs):.1f} us / group (best of 3)")


if __name__ == "__main__":
    main()
