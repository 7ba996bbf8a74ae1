"""Start-up cost of laying out Kimi K3's routed experts on one rank: vLLM 0.33's route against the plugin.

Three ways to reach aiter's packed-int4 a16w4 layout, timed over all 92 MoE layers of one rank:

* ``vllm``: vLLM 0.33.0's own load-time route for an MXFP4 K3 on gfx942, restated line for line from
  ``vllm/model_executor/layers/quantization/mxfp4.py`` ``Mxfp4MoEMethod._setup_kernel_k3_situ_gfx942``
  lines 879-1000 (wheel sha256 4b6bdec4...): 8 experts at a time, MXFP4 -> fp32 -> bf16, requantize to
  int4, shuffle, pack, ``empty_cache`` after every chunk. aiter's functions it calls are torch code,
  restated from ROCm/aiter v0.1.20 (commit fc2e5d57fb5b, the first tag with the int4 a16wmix path):
  ``aiter/utility/fp4_utils.py`` ``mxfp4_to_f32`` 25-52 and ``e8m0_to_f32`` 213-221,
  ``aiter/ops/quant.py`` ``per_1x32_i4_quant`` 207-227, ``aiter/ops/shuffle.py`` ``shuffle_weight``
  148-209 (the branch this call takes), ``pack_int8_to_packed_int4`` 443-459, ``shuffle_scale_for_int4``
  462-484. ``aiter.dtypes.i4x2`` is ``torch.int4`` where torch has it, else uint8 (dtypes.py 30): the
  bench uses uint8 (a view either way: the same bytes and time).
* ``plugin-torch``: this plugin's layout before issue 23 (``layout.convert_experts_torch_``, 4 experts a chunk).
* ``plugin-fused``: its one Triton pass (``layout_kernel.convert_experts_``, what ``convert_experts_`` runs on a GPU).

Sizes (../shared/SPEC.md §1): 92 MoE layers, 896 experts, routed_expert_hidden_size 3584 (the experts'
hidden size), moe_intermediate_size 3072. Per rank: TP 8 gives every expert with 3072/8 = 384 channels
(w13 [896, 768, 3584], w2 [896, 3584, 384]); TP 8 + EP 8 gives 112 whole experts (w13 [112, 6144, 3584],
w2 [112, 3584, 3072]). The weights are SYNTHETIC random bytes (the layout's cost does not depend on them;
E8M0 scales kept finite). One layer's tensors are re-made before each layer (untimed); the time is the sum
of the 92 layouts, each synchronized; memory is the peak allocated above what the layer holds before.
A first, untimed layer per route absorbs one-time costs (CUDA module loading, Triton's JIT compile): its
time is reported apart as ``first_layer_s`` (run with an empty TRITON_CACHE_DIR to see a cold compile).

    python scripts/bench_startup.py --out results.json              # on a GPU: both splits, all routes
    python scripts/bench_startup.py --device cpu --tiny --layers 2 --routes vllm,plugin-torch   # smoke
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from converter.vllm_plugin import layout  # noqa: E402

LAYERS = 92                       # SPEC §1: num_hidden_layers 93, first_k_dense_replace 1
EXPERTS, HIDDEN, INTER = 896, 3584, 3072
SPLITS = {"tp8": (EXPERTS, INTER // 8), "tp8-ep8": (EXPERTS // 8, INTER)}   # (experts, channels) a rank
TINY = {"tp8": (16, 64), "tp8-ep8": (2, 512)}, 256                        # --tiny: same shapes, small
ROUTES = ("vllm", "plugin-torch", "plugin-fused")


# ---------------------------------------------------------------- aiter v0.1.20's torch functions, restated

class aiter_dtypes:  # noqa: N801 - aiter/utility/dtypes.py 23-40, uint8 fallback for the sub-byte dtypes
    i4x2 = torch.uint8
    i8 = torch.int8
    bf16 = torch.bfloat16
    fp32 = torch.float32


def mxfp4_to_f32(x):
    """aiter/utility/fp4_utils.py 25-52."""
    if x.dtype == torch.float4_e2m1fn_x2:
        x = x.view(torch.uint8)

    # 2 because we pack fp4 in uint8.
    x = x.repeat_interleave(2, dim=-1)
    x[..., ::2] = x[..., ::2] & 0xF
    x[..., 1::2] = x[..., 1::2] >> 4
    mxfp4_list = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    mxfp4_in_f32 = torch.tensor(mxfp4_list, dtype=torch.float32, device=x.device)
    return mxfp4_in_f32[x.long()]


def e8m0_to_f32(scale_e8m0_biased):
    """aiter/utility/fp4_utils.py 213-221."""
    scale_e8m0_biased = scale_e8m0_biased.view(torch.uint8)
    zero_case = scale_e8m0_biased == 0
    nan_case = scale_e8m0_biased == 0xFF
    scale_f32 = scale_e8m0_biased.to(torch.int32) << 23
    scale_f32[zero_case] = 0x00400000
    scale_f32[nan_case] = 0x7F800001
    scale_f32 = scale_f32.view(aiter_dtypes.fp32)
    return scale_f32


def per_1x32_i4_quant(weight, group_size=32):
    """aiter/ops/quant.py 207-227."""
    *batch_dims, N, K = weight.shape
    G = K // group_size
    w_groups = weight.view(*batch_dims, N, G, group_size)
    w_group_max = w_groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    w_scale_raw = (w_group_max / 7.0).squeeze(-1)
    weight_qt = (
        (w_groups / w_scale_raw.unsqueeze(-1))
        .round()
        .clamp(-7, 7)
        .to(aiter_dtypes.i8)
        .view(*batch_dims, N, K)
    )
    weight_scale = w_scale_raw.transpose(-1, -2).contiguous().to(aiter_dtypes.bf16)
    return weight_qt, weight_scale


def shuffle_weight(x, layout=(16, 16), use_int4=False):
    """aiter/ops/shuffle.py 148-209, the branch this call reaches (is_guinterleave False, pad_k_to 0)."""
    x_type = x.dtype
    if hasattr(torch, "float4_e2m1fn_x2") and x_type == torch.float4_e2m1fn_x2:
        x = x.view(torch.uint8)

    IN, IK = layout
    BK = IK * 2
    K = 16 // x.element_size() if not use_int4 else 32
    BN = IN
    assert x.shape[-2] % BN == 0, f"{x.shape[-2]} % {BN} == {x.shape[-2] % BN }"
    assert x.shape[-1] % BK == 0, f"{x.shape[-1]} % {BK} == {x.shape[-1] % BK }"

    x_ = x
    x_ = x_.view(-1, x.shape[-2] // BN, BN, x.shape[-1] // BK, BK // K, K)
    x_ = x_.permute(0, 1, 3, 4, 2, 5)
    x_ = x_.contiguous()
    x_ = x_.view(*x.shape)
    x_ = x_.view(x_type)
    x_.is_shuffled = True
    return x_


def pack_int8_to_packed_int4(x_shuf_i8):
    """aiter/ops/shuffle.py 443-459."""
    flat = x_shuf_i8.contiguous().view(-1).to(torch.int16)
    assert flat.numel() % 8 == 0
    u = (flat & 0xF).to(torch.uint8).view(-1, 8)
    out = torch.empty((u.shape[0], 4), device=u.device, dtype=torch.uint8)
    out[:, 0] = u[:, 0] | (u[:, 4] << 4)
    out[:, 1] = u[:, 1] | (u[:, 5] << 4)
    out[:, 2] = u[:, 2] | (u[:, 6] << 4)
    out[:, 3] = u[:, 3] | (u[:, 7] << 4)
    return out.view(-1).to(torch.int8)


def shuffle_scale_for_int4(scale, group_size=32):
    """aiter/ops/shuffle.py 462-484."""
    if group_size != 32:
        raise ValueError(f"shuffle_scale_for_int4 only supports group_size=32, got {group_size}.")
    if scale.dtype == torch.bfloat16:
        E, G, N = scale.shape
        return scale.view(E, G // 2, 2, N).permute(0, 1, 3, 2).contiguous()
    return scale.contiguous()


fp4_utils = SimpleNamespace(mxfp4_to_f32=mxfp4_to_f32, e8m0_to_f32=e8m0_to_f32)


def empty_cache() -> None:
    """torch.accelerator.empty_cache (torch >= 2.8), as the route calls it; nothing on a CPU run."""
    if not torch.cuda.is_available():
        return
    acc = getattr(torch, "accelerator", None)
    (acc.empty_cache if acc is not None and hasattr(acc, "empty_cache") else torch.cuda.empty_cache)()


def replace_parameter(layer, name, t):
    """vllm/model_executor/utils.py replace_parameter, for a plain namespace."""
    setattr(layer, name, torch.nn.Parameter(t, requires_grad=False))


# ---------------------------------------------------------------- vLLM 0.33's route, restated (mxfp4.py 879-1000)

def vllm_route(layer) -> None:
    """The body of Mxfp4MoEMethod._setup_kernel_k3_situ_gfx942 up to the kernel build (1002): the
    aiter version check (885-893) and imports (895-903) are left out, the rest is line for line."""
    fp4_dtype = torch.float4_e2m1fn_x2
    e8m0_dtype = torch.float8_e8m0fnu

    # mxfp4_to_f32 grows the packed weight 8x and peaks above 20 GiB per
    # rank if all experts convert at once. Convert 8 experts at a time.
    _CONVERT_CHUNK = 8

    def convert(weight, scale):
        w_all = weight.data.view(fp4_dtype)
        s_all = scale.data.view(e8m0_dtype)
        num_experts = w_all.shape[0]

        out_packed = None
        out_scale = None
        scale_stride = 0
        for lo in range(0, num_experts, _CONVERT_CHUNK):
            hi = min(lo + _CONVERT_CHUNK, num_experts)
            weight_f32 = fp4_utils.mxfp4_to_f32(w_all[lo:hi])
            scale_f32 = fp4_utils.e8m0_to_f32(s_all[lo:hi])
            chunk_experts, output_size, input_size = weight_f32.shape
            weight_bf16 = (
                (
                    weight_f32.view(chunk_experts, output_size, input_size // 32, 32)
                    * scale_f32.view(chunk_experts, output_size, input_size // 32, 1)
                )
                .view(chunk_experts, output_size, input_size)
                .to(torch.bfloat16)
            )
            del weight_f32, scale_f32

            weight_int4, weight_scale = per_1x32_i4_quant(weight_bf16)
            del weight_bf16
            weight_int4 = weight_int4.view(aiter_dtypes.i4x2).view(chunk_experts, output_size, input_size)
            weight_packed = pack_int8_to_packed_int4(
                shuffle_weight(weight_int4.view(aiter_dtypes.i8), (16, 16))
            )
            del weight_int4
            chunk_packed = weight_packed.view(chunk_experts, output_size, input_size // 2).view(aiter_dtypes.i4x2)
            chunk_scale = shuffle_scale_for_int4(weight_scale, group_size=32).view(-1).contiguous()
            if out_packed is None:
                out_packed = torch.empty((num_experts,) + tuple(chunk_packed.shape[1:]),
                                         dtype=chunk_packed.dtype, device=chunk_packed.device)
                scale_stride = chunk_scale.numel() // chunk_experts
                out_scale = torch.empty(num_experts * scale_stride, dtype=chunk_scale.dtype,
                                        device=chunk_scale.device)
            assert out_packed is not None
            assert out_scale is not None
            out_packed[lo:hi].copy_(chunk_packed)
            out_scale[lo * scale_stride: hi * scale_stride].copy_(chunk_scale)
            del weight_packed, weight_scale, chunk_packed, chunk_scale
            empty_cache()

        del w_all, s_all
        assert out_packed is not None
        assert out_scale is not None
        weight.data = torch.empty(0, dtype=torch.uint8, device=out_packed.device)
        scale.data = torch.empty(0, dtype=torch.uint8, device=out_packed.device)
        empty_cache()
        return out_packed, out_scale

    w13, w13_scale = convert(layer.w13_weight, layer.w13_weight_scale)
    replace_parameter(layer, "w13_weight", w13)
    replace_parameter(layer, "w13_weight_scale", w13_scale)
    del w13, w13_scale
    empty_cache()

    w2, w2_scale = convert(layer.w2_weight, layer.w2_weight_scale)
    replace_parameter(layer, "w2_weight", w2)
    replace_parameter(layer, "w2_weight_scale", w2_scale)
    del w2, w2_scale
    empty_cache()
    layer.w13_weight.is_shuffled = True
    layer.w2_weight.is_shuffled = True


# ---------------------------------------------------------------- the plugin (moe_method.py's loop)

def plugin_route(layer, fn) -> None:
    """K3Int4AiterMoEMethod.process_weights_after_loading's layout loop with ``fn`` as convert_experts_."""
    for w_name, s_name in (("w13_weight_packed", "w13_weight_scale"), ("w2_weight_packed", "w2_weight_scale")):
        packed, flat = fn(getattr(layer, w_name).data, getattr(layer, s_name).data)
        replace_parameter(layer, w_name, packed)
        replace_parameter(layer, s_name, flat)


def fused(words, scales):
    from converter.vllm_plugin import layout_kernel
    return layout_kernel.convert_experts_(words, scales)


def torch_passes(words, scales):
    return layout.convert_experts_torch_(words, scales)


# ---------------------------------------------------------------- synthetic layers

def shapes(split: str, tiny: bool) -> dict[str, tuple[int, int, int]]:
    """[E, N, K] of w13 and w2 on one rank."""
    (experts, inter), hidden = (TINY[0][split], TINY[1]) if tiny else (SPLITS[split], HIDDEN)
    return {"w13": (experts, 2 * inter, hidden), "w2": (experts, hidden, inter)}


def templates(split: str, tiny: bool, device: torch.device, seed: int = 0) -> dict:
    """One layer's source tensors for each format (random; E8M0 scales 2^-9 .. 2^0, finite)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict = {"mxfp4": {}, "ct": {}}
    for name, (e, n, k) in shapes(split, tiny).items():
        out["mxfp4"][name] = (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device, generator=gen),
                              torch.randint(118, 128, (e, n, k // 32), dtype=torch.uint8, device=device, generator=gen))
        words = torch.randint(-2**31, 2**31 - 1, (e, n, k // 8), dtype=torch.int32, device=device, generator=gen)
        scales = (torch.rand((e, n, k // 32), device=device, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
        out["ct"][name] = (words, scales)
    return out


def make_layer(route: str, tpl: dict) -> SimpleNamespace:
    p = lambda t: torch.nn.Parameter(t.clone(), requires_grad=False)  # noqa: E731
    if route == "vllm":
        (w13, s13), (w2, s2) = tpl["mxfp4"]["w13"], tpl["mxfp4"]["w2"]
        return SimpleNamespace(w13_weight=p(w13), w13_weight_scale=p(s13), w2_weight=p(w2), w2_weight_scale=p(s2))
    (w13, s13), (w2, s2) = tpl["ct"]["w13"], tpl["ct"]["w2"]
    return SimpleNamespace(w13_weight_packed=p(w13), w13_weight_scale=p(s13),
                           w2_weight_packed=p(w2), w2_weight_scale=p(s2))


RUN = {"vllm": vllm_route,
       "plugin-torch": lambda layer: plugin_route(layer, torch_passes),
       "plugin-fused": lambda layer: plugin_route(layer, fused)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer(route: str, tpl: dict, device: torch.device) -> tuple[float, int]:
    """(seconds, peak bytes above the layer's own) of one layer's layout."""
    layer = make_layer(route, tpl)
    sync(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    RUN[route](layer)
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    del layer
    return dt, peak


def check_same_bytes(tpl: dict) -> bool:
    """The fused pass and the torch passes write the same bytes on this device."""
    a, b = make_layer("plugin-fused", tpl), make_layer("plugin-torch", tpl)
    RUN["plugin-fused"](a)
    RUN["plugin-torch"](b)
    names = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")
    return all(torch.equal(getattr(a, n).data.view(torch.uint8), getattr(b, n).data.view(torch.uint8))
               for n in names)


def bench(split: str, routes: list[str], layers: int, tiny: bool, device: torch.device) -> dict:
    tpl = templates(split, tiny, device)
    res: dict = {"split": split, "shapes": {k: list(v) for k, v in shapes(split, tiny).items()}, "layers": layers,
                 "layer_bytes": sum(w.numel() * 4 + s.numel() * 2 for w, s in tpl["ct"].values()),
                 "copy_ms": copy_ms(tpl, device)}
    for route in routes:
        first, _ = time_layer(route, tpl, device)
        times, peaks = [], []
        for _ in range(layers):
            dt, peak = time_layer(route, tpl, device)
            times.append(dt)
            peaks.append(peak)
        res[route] = {"total_s": sum(times), "per_layer_ms": 1e3 * sum(times) / layers,
                      "max_layer_ms": 1e3 * max(times), "peak_transient_gib": max(peaks) / 2**30,
                      "first_layer_s": first}
        print(f"{split:8s} {route:13s} {sum(times):8.3f} s for {layers} layers "
              f"({1e3 * sum(times) / layers:7.2f} ms a layer), +{max(peaks) / 2**30:.3f} GiB transient, "
              f"first layer {first:.3f} s", flush=True)
    if "plugin-fused" in routes and "plugin-torch" in routes:   # after the timing: first_layer_s holds the JIT
        res["fused_equals_torch_bytes"] = check_same_bytes(tpl)
    print(f"{split:8s} one layer is {res['layer_bytes'] / 1e9:.2f} GB; cloning it takes {res['copy_ms']:.2f} ms; "
          f"fused equals torch bytes: {res.get('fused_equals_torch_bytes')}", flush=True)
    return res


def copy_ms(tpl: dict, device: torch.device, repeat: int = 10) -> float:
    """One device-to-device clone of a layer's CT tensors (each byte read and written once), in ms."""
    clone = lambda: [t.clone() for pair in tpl["ct"].values() for t in pair]  # noqa: E731
    clone()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        clone()
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / repeat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--splits", default=",".join(SPLITS))
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--fused-chunk-mib", type=int, help="layout_kernel.CHUNK_BYTES for this run (default 128)")
    args = ap.parse_args(argv)
    if args.fused_chunk_mib:
        from converter.vllm_plugin import layout_kernel
        layout_kernel.CHUNK_BYTES = args.fused_chunk_mib << 20
    device = torch.device(args.device)
    routes = [r for r in args.routes.split(",") if r]
    if unknown := set(routes) - set(ROUTES):
        ap.error(f"unknown routes {sorted(unknown)}; choose from {ROUTES}")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
              "command": " ".join(sys.argv),
              "torch": torch.__version__, "synthetic": True, "results": []}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        pass
    for split in args.splits.split(","):
        report["results"].append(bench(split, routes, args.layers, args.tiny, device))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    if not all(r.get("fused_equals_torch_bytes", True) for r in report["results"]):
        print("bench_startup.py: the fused pass and the torch passes wrote different bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
