"""NVFP4 -> int4 on a GPU and on every CPU core, and `verify --source --all` beside it (issue 42 §3).

Builds a K3-shaped NVFP4 source (compressed-tensors ``nvfp4-pack-quantized``, Mixtral names, real expert
dims: w1/w3 [3072, 3584], w2 [3584, 3072]; heavy-tailed weights through a round-to-nearest NVFP4
encoder: E4M3 block scale amax * global / 6), then measures, each on the same source:

* the module step alone (``kernels.nvfp4_requantizer``: decode, search, codes, figures) on the GPU
  and on every core, GB/s of source bytes, and whether the bytes agree;
* ``k3convert mxfp4-to-int4`` and ``k3convert verify DST --source SRC --all`` end to end, on the GPU
  (default devices) and on the CPU (``--devices cpu``; verify with CUDA_VISIBLE_DEVICES=""), and whether the
  GPU's and the CPU's DST shards are byte-identical, with each run's rate from its shards' own seconds;
* with ``--big LAYERS``, the same on a larger source with the kernels compiled (the steady rate), and with
  ``--drop-caches`` once more from the disk.

    PYTHONPATH=. python scripts/benchmarks/bench_nvfp4_gpu.py --root /tmp/nvb --layers 2 --experts 16 --big 12
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

import numba
import torch
from bench_gpu import convert, drop_caches, sh  # this folder: the end-to-end timer (JSON events, shard records)
from safetensors.torch import save_file

from converter.kernels import nvfp4_requantizer, nvfp4_searcher
from converter.quant import nvfp4_requant as nv

HIDDEN, INTER = 3584, 3072
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def encode(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """float32 [R, C] -> compressed-tensors NVFP4 tensors (global = 448 * 6 / amax, divided by): the scales
    of ``tests/models/test_nvfp4_convert.ct_nvfp4_encode``, codes rounded to the nearest E2M1 level, in torch
    on the GPU (compressed-tensors is not on the device machine, and the search needs no particular rounding)."""
    gs = (448 * 6 / w.abs().max()).reshape(1).float()
    blocks = w.reshape(w.shape[0], -1, 16)
    scale = (blocks.abs().amax(-1) * gs / 6).clamp(min=2.0 ** -9).to(torch.float8_e4m3fn)
    x = blocks / (scale.float() / gs).unsqueeze(-1)
    mag = (x.abs().unsqueeze(-1) - E2M1.to(w.device)).abs().argmin(-1)
    code = (mag + 8 * (x < 0)).to(torch.uint8).reshape(w.shape[0], -1)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return {"weight_packed": packed.contiguous(), "weight_scale": scale, "weight_global_scale": gs}


def build(root: str, layers: int, experts: int, dev: str) -> int:
    """The source checkpoint, one shard a layer; its NVFP4 bytes."""
    os.makedirs(root, exist_ok=True)
    wm, nbytes = {}, 0
    torch.manual_seed(0)
    for i in range(layers):
        t = {f"model.layers.{i}.input_layernorm.weight": torch.ones(HIDDEN).bfloat16()}
        for e in range(experts):
            for w, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
                x = torch.distributions.StudentT(torch.tensor(4.0, device=dev)).sample(shape) / math.sqrt(shape[1])
                for k, v in encode(x).items():
                    t[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.{k}"] = v.cpu()
                    nbytes += v.numel() * v.element_size()
        shard = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(t, os.path.join(root, shard), metadata={"format": "pt"})
        wm.update({n: shard for n in t})
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
               "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    quant = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
             "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": [r"re:.*experts\.\d+\.(w1|w2|w3)$"], "weights": weights,
                                           "input_activations": None, "output_activations": None,
                                           "format": "nvfp4-pack-quantized"}},
             "ignore": ["lm_head"], "kv_cache_scheme": None}
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": layers,
              "num_local_experts": experts, "num_experts_per_tok": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 32, "quantization_config": quant}
    for name, obj in (("config.json", config), ("model.safetensors.index.json", {"metadata": {}, "weight_map": wm}),
                      ("tokenizer_config.json", {"model_max_length": 256})):
        with open(os.path.join(root, name), "w") as f:
            json.dump(obj, f)
    return nbytes


def modules(root: str):
    from safetensors import safe_open
    with open(os.path.join(root, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    for shard in sorted(set(wm.values())):
        with safe_open(os.path.join(root, shard), "pt") as f:
            for n in sorted(f.keys()):
                if n.endswith(".weight_packed"):
                    m = n[: -len(".weight_packed")]
                    yield m, f.get_tensor(n), f.get_tensor(f"{m}.weight_scale"), \
                        nv.GlobalScale(float(f.get_tensor(f"{m}.weight_global_scale")), True)


def step(root: str, device: str, limit: int | None) -> tuple[float, int, list]:
    """Seconds and source bytes of requantize_module over the (first ``limit``) modules, in host memory as
    a worker holds them: pinned for a GPU, written into two pinned output buffers taken in turn."""
    pin = device != "cpu"
    mods = [(p.pin_memory() if pin else p, s.pin_memory() if pin else s, g) for _, p, s, g in modules(root)][:limit]
    outs = [(torch.empty(mods[0][0].numel() // 16, 16, dtype=torch.uint8, pin_memory=pin),
             torch.empty(mods[0][0].numel() // 16, dtype=torch.int16, pin_memory=pin)) for _ in range(2)]
    run = nvfp4_requantizer(str(device))
    run(*mods[0], out=outs[0])    # compile / warm
    t0 = time.perf_counter()
    res = []
    for i, (p, s, g) in enumerate(mods):
        r = run(p, s, g, out=outs[i % 2])
        res.append((r.words.clone(), r.scales.clone(), r.err2, r.ref2, r.server_err2))   # the buffer is taken again
    dt = time.perf_counter() - t0
    return dt, sum(p.numel() + s.numel() + 4 for p, s, _ in mods), res


def profile(mods) -> None:
    """Where the GPU module step's time goes, and the kernel's launch variants (same scales each)."""
    from converter.kernels import triton_nvfp4 as tk

    def timed(f) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p, sc, g in mods:
            f(p, sc, g)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / len(mods)

    run = nvfp4_requantizer("cuda")
    pinned = [(p.cpu().pin_memory(), sc.cpu().pin_memory(), g) for p, sc, g in mods]
    n = mods[0][0].numel() // 16
    out = (torch.empty(n, 16, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.int16, pin_memory=True))
    it = iter(pinned)

    def from_pinned(p, sc, g):
        return run(*next(it), out=out)

    print(f"per module (ms): the server rule in torch (fused in the kernel since) "
          f"{timed(lambda p, sc, g: nv.server_rule(nv.decode(p, sc, g).reshape(-1, 32))):.2f}, "
          f"step from pageable host tensors {timed(lambda p, sc, g: run(p.cpu(), sc.cpu(), g)):.2f}, "
          f"step from pinned host tensors into pinned buffers {timed(from_pinned):.2f}, "
          f"step from device tensors {timed(lambda p, sc, g: run(p, sc, g)):.2f}")
    pre = [(p.reshape(-1, 16), sc.reshape(-1, 2), g) for p, sc, g in mods]
    ref = [tk.requantize(p, sc, g.value, g.divide) for p, sc, g in pre]
    for bg, nw in ((8, 2), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8)):
        got = [tk.requantize(p, sc, g.value, g.divide, bg, nw) for p, sc, g in pre]
        same = all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(got, ref))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p, sc, g in pre:
            tk.requantize(p, sc, g.value, g.divide, bg, nw)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / len(pre)
        print(f"kernel BG={bg} num_warps={nw}: {ms:.2f} ms a module ({pre[0][0].shape[0] / ms / 1e3:.1f} M groups/s), "
              f"same bytes: {same}", flush=True)


def cli(*args: str, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "converter", *args], env={**os.environ, **(env or {})},
                       capture_output=True, text=True)
    dt = time.perf_counter() - t0
    print(f"$ k3convert {' '.join(args)}  -> exit {r.returncode}, {dt:.1f} s", flush=True)
    if r.returncode:
        print(r.stdout[-3000:], r.stderr[-3000:])
    return dt if r.returncode == 0 else math.nan


def digest(root: str) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(root, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(root)) if n.endswith(".safetensors")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/nvfp4-bench")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--cpu-modules", type=int, default=3, help="modules for the CPU step figure")
    ap.add_argument("--skip-cli-cpu", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--big", type=int, default=0, metavar="LAYERS",
                    help="also convert and verify a source of this many layers on the GPU, kernels already "
                         "compiled: its shards' own seconds are the rate without start-up")
    ap.add_argument("--drop-caches", action="store_true",
                    help="then convert the big source again from the disk (drops the page cache: root only)")
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, numba {numba.get_num_threads()} threads, torch {torch.__version__}, "
          f"GPU {torch.cuda.get_device_name(0) if gpu else None}")
    src = os.path.join(a.root, "src")
    t0 = time.perf_counter()
    nbytes = build(src, a.layers, a.experts, "cuda" if gpu else "cpu")
    print(f"source: {a.layers} layers x {a.experts} experts x (w1, w3 [{INTER}, {HIDDEN}], w2 [{HIDDEN}, {INTER}]),"
          f" {nbytes / 1e9:.3f} GB of NVFP4 (built in {time.perf_counter() - t0:.0f} s)", flush=True)
    if gpu:
        dt, b, g_out = step(src, "cuda", None)
        mods = [(p.cuda(), sc.cuda(), g) for _, p, sc, g in modules(src)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p, sc, g in mods:
            nvfp4_searcher(p.device.type)(p, sc, g)
        torch.cuda.synchronize()
        ks = time.perf_counter() - t0
        print(f"search alone (Triton kernel, scales, codes and figures), GPU: {b / ks / 1e9:.2f} GB/s ({ks:.3f} s)")
        if not a.skip_profile:
            profile(mods)
        del mods
        print(f"module step, GPU: {b / dt / 1e9:.2f} GB/s ({dt:.2f} s for {b / 1e9:.3f} GB); "
              f"1.65 TB at this rate: {1.65e12 / (b / dt) / 3600:.2f} h", flush=True)
    dt, b, c_out = step(src, "cpu", a.cpu_modules)
    print(f"module step, CPU ({numba.get_num_threads()} threads): {b / dt / 1e9:.4f} GB/s ({dt:.2f} s for "
          f"{b / 1e9:.3f} GB); 1.65 TB at this rate: {1.65e12 / (b / dt) / 3600:.1f} h", flush=True)
    if gpu:
        same = all(torch.equal(x[0], y[0]) and torch.equal(x[1].view(torch.int16), y[1].view(torch.int16))
                   for x, y in zip(g_out, c_out))
        rel = max(abs(x[i] - y[i]) / y[i] for x, y in zip(g_out, c_out) for i in (2, 3, 4))
        print(f"GPU bytes == CPU bytes on the first {len(c_out)} modules: {same}; their figures (ours, the values', "
              f"the server rule's sums of squares) differ by at most {rel:.1e} relative (summation order)", flush=True)
    runs = {}
    if gpu:
        runs["gpu"] = ("cuda:0", 1, None)
    if not a.skip_cli_cpu:
        runs["cpu"] = ("cpu", "auto", {"CUDA_VISIBLE_DEVICES": ""})
    for k, (devices, workers, env) in runs.items():
        dst = os.path.join(a.root, f"dst_{k}")
        r = convert(REPO, src, dst, devices, workers, False)
        ver = cli("verify", dst, "--source", src, "--all", "--no-checksums", env=env)
        print(f"{k}: convert {r['wall_s']:.1f} s end to end (kernels compiled on first use), steady "
              f"{r['steady_GBps']:.2f} GB/s; verify --source --all {ver:.1f} s, "
              f"verify / convert = {ver / r['wall_s']:.2f}")
        stages(r)
    if len(runs) == 2:
        same = digest(os.path.join(a.root, "dst_gpu")) == digest(os.path.join(a.root, "dst_cpu"))
        print("DST shards GPU == CPU:", same)
    if gpu and a.big:
        big = os.path.join(a.root, "src_big")
        nbig = build(big, a.big, a.experts, "cuda")
        dst = os.path.join(a.root, "dst_big")
        for cold in (False, True) if a.drop_caches else (False,):
            r = convert(REPO, big, dst, "cuda:0", 1, cold)
            where = "page cache" if not cold else "disk, page cache dropped" if r["cache_dropped"] else \
                "page cache (not dropped: not root?)"
            print(f"big source ({a.big} layers, {nbig / 1e9:.3f} GB, {where}): convert {r['wall_s']:.1f} s end to "
                  f"end, steady {r['steady_GBps']:.2f} GB/s, start-up {r['startup_s']:.1f} s; 1.65 TB at the steady "
                  f"rate: {1.65e12 / r['steady_GBps'] / 1e9 / 3600:.2f} h", flush=True)
            stages(r)
        copy = os.path.join(a.root, "cp_big")
        shutil.rmtree(copy, ignore_errors=True)
        if a.drop_caches:
            drop_caches()
        print(f"big source: cp -r && sync {sh(['sh', '-c', f'cp -r {big} {copy} && sync']):.1f} s"
              f"{' (page cache dropped first)' if a.drop_caches else ''}")
        shutil.rmtree(copy)
        ver = cli("verify", dst, "--source", big, "--all", "--no-checksums")
        print(f"big source: verify --source --all {ver:.1f} s (verify / convert = {ver / r['wall_s']:.2f})")


def stages(r: dict) -> None:
    print(f"  {r['workers']}; steady = first shard's start to last shard's fsync; stages (s, summed over shards "
          "and threads): " + ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items()), flush=True)

if __name__ == "__main__":
    main()
