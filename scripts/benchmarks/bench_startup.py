"""Start-up cost of laying out Kimi K3's routed experts on one rank: vLLM 0.33's and 0.34's routes against the plugin.

Four ways to reach aiter's packed-int4 a16w4 layout, timed over all 92 MoE layers of one rank:

* ``vllm-0.33`` (alias ``vllm``): vLLM 0.33.0's own load-time route for an MXFP4 K3 on gfx942, restated
  line for line from ``vllm/model_executor/layers/quantization/mxfp4.py``
  ``Mxfp4MoEMethod._setup_kernel_k3_situ_gfx942`` lines 879-1000 (wheel sha256 4b6bdec4...): 8 experts at
  a time, MXFP4 -> fp32 -> bf16, requantize to int4, shuffle, pack, ``empty_cache`` after every chunk.
  aiter's functions it calls are torch code, restated from ROCm/aiter v0.1.20 (commit fc2e5d57fb5b, the
  first tag with the int4 a16wmix path): ``aiter/utility/fp4_utils.py`` ``mxfp4_to_f32`` 25-52 and
  ``e8m0_to_f32`` 213-221, ``aiter/ops/quant.py`` ``per_1x32_i4_quant`` 207-227, ``aiter/ops/shuffle.py``
  ``shuffle_weight`` 148-209 (the branch this call takes), ``pack_int8_to_packed_int4`` 443-459,
  ``shuffle_scale_for_int4`` 462-484. ``aiter.dtypes.i4x2`` is ``torch.int4`` where torch has it, else
  uint8 (dtypes.py 30): the bench uses uint8 (a view either way: the same bytes and time).
* ``vllm-0.34``: vLLM 0.34.0's route, restated from its released ``quantization/mxfp4.py``:
  ``_setup_kernel_k3_situ_gfx942`` 984-1026 calls the module-level ``_mxfp4_experts_to_int4_gfx942``
  515-607 once for w13 and once for w2. Against 0.33: chunks hold ``_K3_INT4_CONVERT_CHUNK_VALUES`` = 1 << 27
  unpacked values (512, 540-543: ``min(E, max(1, 2**27 // (N * K)))`` experts: 48 for TP 8's w13, 97 for its
  w2, 6 / 12 at TP 8 + EP 8; 0.33 took 8 experts), the last chunk is shifted back to the same shape
  (overlapping experts recomputed), no ``empty_cache`` per chunk (600-601) and the source is not emptied
  inside the conversion; ``empty_cache`` stays after w13 and after w2 (1005, 1013). 0.34's
  ``replace_parameter`` (``model_executor/utils.py`` 106-162, 165-258) keeps the loaded parameter and
  copies a result that fits into its storage (the int4 weight: the same bytes as the MXFP4 source)
  instead of rebinding it: restated too (``replace_parameter_034``). aiter's functions are the same
  restatements as for 0.33. Both vLLM routes write the same bytes (checked after the timing, as
  ``vllm_033_equals_034_bytes``); tests/vllm_plugin/test_layout_kernel.py runs each against vLLM's own released code.
* ``plugin-torch``: this plugin's layout before issue 23 (``layout.convert_experts_torch_``, 4 experts a chunk).
* ``plugin-fused``: its one Triton pass (``layout_kernel.convert_experts_``, what ``convert_experts_`` runs on a GPU).

Sizes (Kimi K3's config.json): 92 MoE layers, 896 experts, routed_expert_hidden_size 3584 (the experts'
hidden size), moe_intermediate_size 3072. Per rank: TP 8 gives every expert with 3072/8 = 384 channels
(w13 [896, 768, 3584], w2 [896, 3584, 384]); TP 8 + EP 8 gives 112 whole experts (w13 [112, 6144, 3584],
w2 [112, 3584, 3072]). The weights are SYNTHETIC random bytes (the layout's cost does not depend on them;
E8M0 scales kept finite). One layer's tensors are re-made before each layer (untimed); the time is the sum
of the 92 layouts, each synchronized; memory is the peak allocated above what the layer holds before.
A first, untimed layer per route absorbs one-time costs (CUDA module loading, Triton's JIT compile): its
time is reported apart as ``first_layer_s`` (run with an empty TRITON_CACHE_DIR to see a cold compile).
Every route runs under the allocator setting vLLM's ``load_model`` sets around weight loading and
``process_weights_after_loading`` (``v1/worker/gpu_worker.py`` 0.33.0 420-446 and 598-599, 0.34.0 422-448
and 599-600: ``max_split_size_mb:20``); ``--max-split-mb 0`` leaves the allocator as it is (the
conditions of the figures measured before this option).

    python scripts/benchmarks/bench_startup.py --out results.json              # on a GPU: both splits, all routes
    python scripts/benchmarks/bench_startup.py --routes vllm-0.33,vllm-0.34 --out vllm.json   # vLLM's two routes only
    python scripts/benchmarks/bench_startup.py --device cpu --tiny --layers 2 --routes vllm-0.33,vllm-0.34,plugin-torch \
        --chunk-values 100000     # CPU smoke: 0.34's chunks split unevenly (3 and 6 experts a chunk)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from converter.vllm_plugin import layout  # noqa: E402

LAYERS = 92                       # K3 config: num_hidden_layers 93, first_k_dense_replace 1
EXPERTS, HIDDEN, INTER = 896, 3584, 3072
SPLITS = {"tp8": (EXPERTS, INTER // 8), "tp8-ep8": (EXPERTS // 8, INTER)}   # (experts, channels) a rank
TINY = {"tp8": (16, 64), "tp8-ep8": (2, 512)}, 256                        # --tiny: same shapes, small
ROUTES = ("vllm-0.33", "vllm-0.34", "plugin-torch", "plugin-fused")
ALIASES = {"vllm": "vllm-0.33"}   # the name of 0.33's route before 0.34's was added
MAX_SPLIT_MB = 20                 # vLLM's load_model: _scoped_allocator_max_split(max_split_size_mb=20)


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


def _extent(t: torch.Tensor) -> int:
    """vLLM 0.34.0 model_executor/utils.py 106-110: elements spanned by ``t`` in its storage."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _in_own_storage(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """vLLM 0.34.0 model_executor/utils.py 113-162 (``storage_view`` inlined; no direct reload: the
    default ``VLLM_RELOAD_MODE``): ``new`` copied into the bytes ``old`` spans if it fits, else ``new``."""
    storage = old.untyped_storage()
    offset, size = old.storage_offset() * old.element_size(), new.element_size()
    span = _extent(new)
    fits = (new.numel() > 0 and span == new.numel() and _extent(old) == old.numel()
            and new.numel() * size <= old.numel() * old.element_size())
    if not fits or old.device != new.device or new.untyped_storage().data_ptr() == storage.data_ptr() \
            or offset % size:
        return new
    view = torch.empty(0, dtype=new.dtype, device=storage.device).set_(storage, offset // size, new.shape,
                                                                       new.stride())
    return view.copy_(new)


def replace_parameter_034(layer, name, t):
    """vLLM 0.34.0 model_executor/utils.py replace_parameter 165-258 on a plain Parameter (no
    requantization source, not meta, no ``uses_meta_device`` method): the parameter object is kept;
    equal shape, stride, dtype and device copy in place, else a result that fits is copied into the
    parameter's own storage (the loaded storage never shrinks), else ``.data`` is rebound to it."""
    old = getattr(layer, name, None)
    attrs = {k: v for k, v in t.__dict__.items() if k not in ("weight_loader", "_weight_loader", "_ckpt")}
    if isinstance(t, torch.nn.Parameter):
        t = t.data
    if not isinstance(old, torch.nn.Parameter):
        replace_parameter(layer, name, t)
        return
    if (old.shape, old.stride(), old.dtype, old.device) == (t.shape, t.stride(), t.dtype, t.device):
        old.data.copy_(t)
    else:
        old.data = _in_own_storage(old, t)
    for k, v in attrs.items():
        setattr(old, k, v)


# ---------------------------------------------------------------- vLLM 0.33's route, restated (mxfp4.py 879-1000)

def vllm033_route(layer) -> None:
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


vllm_route = vllm033_route   # its name before 0.34's route was added


# ------------------------------------------------ vLLM 0.34's route, restated (mxfp4.py 508-607, 984-1026)

# mxfp4.py 508-512: "Chunks are sized by unpacked values rather than experts so that pure TP, which holds
# every expert at 1/tp width, runs as many chunks as EP." (--chunk-values changes it for a smoke run)
_K3_INT4_CONVERT_CHUNK_VALUES = 1 << 27


def _mxfp4_experts_to_int4_gfx942(weight, scale):
    """vLLM 0.34.0 mxfp4.py 515-607, line for line (aiter's imports 525-532 answered by the restatements)."""
    fp4_dtype = torch.float4_e2m1fn_x2
    e8m0_dtype = torch.float8_e8m0fnu

    w_all = weight.data.view(fp4_dtype)
    s_all = scale.data.view(e8m0_dtype)
    num_experts, rows, packed_cols = w_all.shape
    chunk = min(
        num_experts,
        max(1, _K3_INT4_CONVERT_CHUNK_VALUES // (rows * packed_cols * 2)),
    )

    out_packed = None
    out_scale = None
    scale_stride = 0
    for lo in range(0, num_experts, chunk):
        # Shift the last chunk back so every chunk has the same shapes (551-554)
        lo = min(lo, num_experts - chunk)
        hi = lo + chunk
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
        # No empty_cache() here (600-601)
        del weight_packed, weight_scale, chunk_packed, chunk_scale

    del w_all, s_all
    assert out_packed is not None
    assert out_scale is not None
    return out_packed, out_scale


def vllm034_route(layer) -> None:
    """Mxfp4MoEMethod._setup_kernel_k3_situ_gfx942 (0.34.0 mxfp4.py 984-1015) up to the kernel build
    (1017-1026): the aiter version check (985-997) is left out, the rest is line for line, with 0.34's
    replace_parameter. The build is timed for neither route: the plugin builds it as 0.34 does, with
    keep_constants(layer) after it (1026; a no-op for AiterMxfp4Experts, whose kept_constants is
    FusedMoEExperts' empty tuple, modular_kernel.py 580; tests/vllm_plugin/test_layout_kernel.py checks the calls)."""
    w13, w13_scale = _mxfp4_experts_to_int4_gfx942(layer.w13_weight, layer.w13_weight_scale)
    replace_parameter_034(layer, "w13_weight", w13)
    replace_parameter_034(layer, "w13_weight_scale", w13_scale)
    del w13, w13_scale
    empty_cache()

    w2, w2_scale = _mxfp4_experts_to_int4_gfx942(layer.w2_weight, layer.w2_weight_scale)
    replace_parameter_034(layer, "w2_weight", w2)
    replace_parameter_034(layer, "w2_weight_scale", w2_scale)
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
    if ALIASES.get(route, route).startswith("vllm"):
        (w13, s13), (w2, s2) = tpl["mxfp4"]["w13"], tpl["mxfp4"]["w2"]
        return SimpleNamespace(w13_weight=p(w13), w13_weight_scale=p(s13), w2_weight=p(w2), w2_weight_scale=p(s2))
    (w13, s13), (w2, s2) = tpl["ct"]["w13"], tpl["ct"]["w2"]
    return SimpleNamespace(w13_weight_packed=p(w13), w13_weight_scale=p(s13),
                           w2_weight_packed=p(w2), w2_weight_scale=p(s2))


RUN = {"vllm-0.33": vllm033_route,
       "vllm-0.34": vllm034_route,
       "plugin-torch": lambda layer: plugin_route(layer, torch_passes),
       "plugin-fused": lambda layer: plugin_route(layer, fused)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer(route: str, tpl: dict, device: torch.device) -> tuple[float, int]:
    """(seconds, peak bytes above the layer's own) of one layer's layout."""
    route = ALIASES.get(route, route)
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


def vllm_routes_agree(tpl: dict) -> bool:
    """vLLM 0.33's and 0.34's routes write the same bytes (only chunking and memory handling differ)."""
    a, b = make_layer("vllm-0.33", tpl), make_layer("vllm-0.34", tpl)
    RUN["vllm-0.33"](a)
    RUN["vllm-0.34"](b)
    names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    return all(getattr(a, n).shape == getattr(b, n).shape and
               torch.equal(getattr(a, n).data.view(torch.uint8), getattr(b, n).data.view(torch.uint8))
               for n in names)


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
    if "vllm-0.33" in routes and "vllm-0.34" in routes:
        res["vllm_033_equals_034_bytes"] = vllm_routes_agree(tpl)
    print(f"{split:8s} one layer is {res['layer_bytes'] / 1e9:.2f} GB; cloning it takes {res['copy_ms']:.2f} ms; "
          f"fused equals torch bytes: {res.get('fused_equals_torch_bytes')}; "
          f"vLLM 0.33 equals 0.34 bytes: {res.get('vllm_033_equals_034_bytes')}", flush=True)
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


@contextlib.contextmanager
def allocator_max_split(mb: int, device: torch.device):
    """vLLM's GPUWorker._scoped_allocator_max_split (0.34.0 v1/worker/gpu_worker.py 422-448, 0.33.0 420-446),
    which load_model wraps around loading and process_weights_after_loading; nothing on a CPU or at 0."""
    if not mb or device.type != "cuda" or torch.cuda.memory.get_allocator_backend() != "native":
        yield
        return
    get_settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    original = get_settings() if get_settings is not None else \
        torch.cuda.memory._snapshot()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]
    prefix = original.strip().rstrip(",")
    settings = f"max_split_size_mb:{mb}"
    torch._C._accelerator_setAllocatorSettings(f"{prefix},{settings}" if prefix else settings)
    try:
        yield
    finally:
        torch._C._accelerator_setAllocatorSettings(original)


def main(argv: list[str] | None = None) -> int:
    global _K3_INT4_CONVERT_CHUNK_VALUES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--splits", default=",".join(SPLITS))
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--fused-chunk-mib", type=int, help="layout_kernel.CHUNK_BYTES for this run (default 128)")
    ap.add_argument("--chunk-values", type=int, default=_K3_INT4_CONVERT_CHUNK_VALUES,
                    help="vllm-0.34's _K3_INT4_CONVERT_CHUNK_VALUES for this run (default 1 << 27, as released; "
                         "smaller to make --tiny chunks split)")
    ap.add_argument("--max-split-mb", type=int, default=MAX_SPLIT_MB,
                    help=f"allocator max_split_size_mb during the layouts, as vLLM's load_model sets it "
                         f"(default {MAX_SPLIT_MB}; 0 leaves the allocator as it is)")
    args = ap.parse_args(argv)
    if args.chunk_values < 1:
        ap.error("--chunk-values must be positive")
    _K3_INT4_CONVERT_CHUNK_VALUES = args.chunk_values
    if args.fused_chunk_mib:
        from converter.vllm_plugin import layout_kernel
        layout_kernel.CHUNK_BYTES = args.fused_chunk_mib << 20
    device = torch.device(args.device)
    routes = list(dict.fromkeys(ALIASES.get(r, r) for r in args.routes.split(",") if r))
    if unknown := set(routes) - set(ROUTES):
        ap.error(f"unknown routes {sorted(unknown)}; choose from {ROUTES} (or {', '.join(ALIASES)})")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
              "command": " ".join(sys.argv),
              "torch": torch.__version__, "synthetic": True,
              "vllm_034_chunk_values": args.chunk_values,
              "max_split_size_mb": args.max_split_mb if device.type == "cuda" else None,   # as applied
              "results": []}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        pass
    for split in args.splits.split(","):
        with allocator_max_split(args.max_split_mb, device):
            report["results"].append(bench(split, routes, args.layers, args.tiny, device))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    if not all(r.get("fused_equals_torch_bytes", True) for r in report["results"]):
        print("bench_startup.py: the fused pass and the torch passes wrote different bytes", file=sys.stderr)
        return 1
    if not all(r.get("vllm_033_equals_034_bytes", True) for r in report["results"]):
        print("bench_startup.py: vLLM 0.33's and 0.34's restated routes wrote different bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
