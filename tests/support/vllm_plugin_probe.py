"""Run by tests/vllm_plugin/test_vllm_plugin.py with the vLLM server's python: prints one JSON line.

  resolve DIR       load vLLM's general plugins, resolve DIR's quantization as vLLM's ModelConfig does
  resolve+rocm DIR  then fake ROCm gfx942 + AITER MoE + a SiTUv2-capable aiter and ask the plugin
                    about a K3 int4 config and about DIR's
Config resolution only (no engine is started): two runs of this cost about two vLLM imports.
"""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import server_sources  # tests/support/server_sources.py, beside this script


def resolve(model_dir: str) -> dict:
    from vllm.plugins import load_general_plugins, load_plugins_by_group

    names = sorted(load_plugins_by_group("vllm.general_plugins"))
    load_general_plugins()
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16")
    quant_cls = get_quantization_config(mc.quantization)
    inst = quant_cls.from_config(dict(mc.hf_config.quantization_config))
    return {"general_plugins": names, "registered": "k3convert-int4-gfx942" in QUANTIZATION_METHODS,
            "quantization": mc.quantization, "quant_config_class": type(inst).__name__}


def rocm(model_dir: str) -> dict:
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm import _aiter_ops
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.layers.quantization import get_quantization_config

    cls = get_quantization_config("k3convert-int4-gfx942")
    current_platform.is_rocm = lambda: True
    _aiter_ops.IS_AITER_FOUND = True          # the aiter faked below is "installed" (_aiter_ops.py 113-123)
    rocm_aiter_ops.is_fused_moe_enabled = lambda: True

    def gemm1(*, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0):
        """a SiTUv2-capable aiter flydsl_a16w4_gemm1"""

    sys.modules["vllm.platforms.rocm"] = types.SimpleNamespace(
        on_gfx942=lambda: True, on_gfx950=lambda: False, on_gfx1250=lambda: False,
        get_cdna_version=lambda: 3)
    sys.modules["aiter.ops.flydsl.kernels.moe_2stage_a16wmix"] = types.SimpleNamespace(flydsl_a16w4_gemm1=gemm1)
    for parent in ("aiter", "aiter.ops", "aiter.ops.flydsl", "aiter.ops.flydsl.kernels"):
        sys.modules[parent] = types.ModuleType(parent)

    from converter.fixture import FixtureSpec, config
    from converter.formats.dialect import int4_block
    from converter.vllm_plugin.route import Refused
    k3 = config(FixtureSpec())
    quant = int4_block(["Linear"], [])
    k3["text_config"]["quantization_config"] = quant
    try:
        cls.override_quantization_method(quant, None, hf_config=k3)
        refused = None
    except Refused as exc:
        refused = str(exc)
    mixtral = json.load(open(f"{model_dir}/config.json"))
    return {"refused": refused,
            "not_k3": cls.override_quantization_method(mixtral["quantization_config"], None, hf_config=mixtral),
            "method": method(rocm_aiter_ops), "scheme": scheme(cls), "quant_method": quant_method(cls)}


def scheme(cls) -> dict:
    """The config's routed-experts scheme lookup (vLLM's get_scheme_dict on `{prefix}.0.gate_proj`...)."""
    import torch

    from converter.formats.dialect import int4_block
    from converter.vllm_plugin.route import Refused

    class RoutedExperts(torch.nn.Module):     # matched by class name, as vLLM matches "Linear" targets
        ckpt_gate_proj_name, ckpt_up_proj_name, ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"

    prefix = "language_model.model.layers.1.block_sparse_moe.experts"

    def ask(**weights):
        block = int4_block(["Linear"], weights.pop("ignore", []))
        block["config_groups"]["group_0"]["weights"].update(weights)
        try:
            w = cls.from_config(block)._int4_expert_weights(RoutedExperts(), prefix)
            return None if w is None else f"int{w.num_bits} g{w.group_size}"
        except Refused as exc:
            return str(exc)
    return {"int4": ask(), "g128": ask(group_size=128), "ignored": ask(ignore=["re:.*block_sparse_moe.*"]),
            "int8": ask(num_bits=8)}


def quant_method(cls) -> dict:
    """get_quant_method on vLLM's RoutedExperts class (after `method`, which fakes the rest of aiter),
    under each vllm config vLLM's own get_moe_method checks; vLLM's own answer is recorded as 'stock'."""
    import torch
    import vllm.config
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from converter.formats.dialect import int4_block
    from converter.vllm_plugin.route import Refused

    layer = RoutedExperts.__new__(RoutedExperts)       # vLLM's class; its __init__ needs a whole engine
    torch.nn.Module.__init__(layer)
    layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"
    layer.moe_config = types.SimpleNamespace(activation=MoEActivation.SITU, activation_situ_linear_beta=25.0,
                                             max_capture_size=0)
    CompressedTensorsConfig.get_quant_method = lambda self, lyr, prefix: "stock"
    config = cls.from_config(int4_block(["Linear"], []))
    out = {}
    for case, lora, backend, elastic, eplb in (
            ("default", None, "auto", False, False), ("aiter", None, "aiter", False, False),
            ("lora", object(), "auto", False, False), ("emulation", None, "emulation", False, False),
            ("flydsl", None, "flydsl", False, False), ("elastic-ep", None, "auto", True, False),
            ("eplb", None, "auto", False, True)):
        vllm.config.get_current_vllm_config = lambda lora=lora, backend=backend, elastic=elastic, eplb=eplb: (
            types.SimpleNamespace(lora_config=lora, kernel_config=types.SimpleNamespace(moe_backend=backend),
                                  parallel_config=types.SimpleNamespace(enable_elastic_ep=elastic,
                                                                        enable_eplb=eplb)))
        try:
            got = config.get_quant_method(layer, "language_model.model.layers.1.block_sparse_moe.experts")
            out[case] = got if isinstance(got, str) else type(got).__name__
        except Refused as exc:
            out[case] = str(exc)
    return out


def method(rocm_aiter_ops) -> dict:
    """The routed-experts method on this real vLLM: vLLM's WNA16 create_weights, our in-place layout,
    replace_parameter, and the kernel build call (recorded: AiterMxfp4Experts cannot build on a CPU)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend, backend_to_kernel_cls

    from converter.vllm_plugin import moe_method, route

    rocm_aiter_ops.is_fused_moe_situv2_gate_up_interleaved = lambda: False
    rocm_aiter_ops.is_fused_moe_situv2_enabled = lambda: False
    sys.modules["aiter"].dtypes = types.SimpleNamespace(i4x2=torch.uint8, i8=torch.int8)
    # the simulated aiter's layout helpers and the expected bytes: aiter's and vLLM 0.33's own code
    aiter_shuffle = server_sources.aiter_shuffle(Path(os.environ["K3CONVERT_AITER_SRC"], "ops/shuffle.py"))
    shuffle_weight = aiter_shuffle.shuffle_weight
    ns = server_sources.vllm_flydsl(Path(os.environ["K3CONVERT_VLLM033_SRC"], server_sources.FLYDSL), shuffle_weight)
    relayout = server_sources.vllm_scale_relayout(ns)
    sys.modules["aiter.ops.shuffle"] = types.SimpleNamespace(
        shuffle_weight=shuffle_weight, pack_int8_to_packed_int4=ns["_pack_shuffled_int8_to_packed_int4_no_perm"],
        shuffle_scale_for_int4=relayout)
    built = {}
    kept = []   # what the plugin hands keep_constants after the build, as 0.34's route does (mxfp4.py 1026)
    moe_method.make_mxfp4_moe_kernel = lambda **kw: built.update(kw) or types.SimpleNamespace(
        fused_experts=types.SimpleNamespace(keep_constants=kept.append))

    moe = types.SimpleNamespace(activation=MoEActivation.SITU, activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
                                max_capture_size=0, has_bias=False, is_act_and_mul=True, experts_per_token=2,
                                moe_parallel_config=types.SimpleNamespace(tp_size=1, tp_rank=0,
                                                                          use_all2all_kernels=False))
    os.environ["K3CONVERT_SELFTEST"] = "0"   # the kernel build is recorded, not run: nothing to test here
    import vllm.config
    import vllm.distributed
    vllm.config.get_current_vllm_config = lambda: types.SimpleNamespace(   # an unpadded TP 1 layer
        model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(moe_intermediate_size=64)))
    vllm.distributed.get_tensor_model_parallel_world_size = lambda: 1
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    m = moe_method.K3Int4AiterMoEMethod(args, moe, "model.layers.1.block_sparse_moe.experts")
    layer = torch.nn.Module()
    e, hidden, inter = 3, 128, 64
    m.create_weights(layer, num_experts=e, hidden_size=hidden, intermediate_size_per_partition=inter,
                     params_dtype=torch.bfloat16, weight_loader=lambda *a, **k: None)
    shapes = {n: list(p.shape) for n, p in layer.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    codes13 = torch.randint(-8, 8, (e, 2 * inter, hidden), dtype=torch.int8, generator=gen)
    layer.w13_weight_packed.data.copy_(pack_to_int32(codes13, 4))
    layer.w13_weight_scale.data.copy_(torch.rand(e, 2 * inter, hidden // 32, generator=gen).to(torch.bfloat16))
    want13 = ns["_gptq_int32_to_flydsl_packed"](layer.w13_weight_packed.data.transpose(1, 2).contiguous())
    want_s13 = relayout(layer.w13_weight_scale.data.transpose(1, 2).contiguous()).reshape(-1)
    layer._expert_routing_tables = lambda: None
    m.process_weights_after_loading(layer)
    par = type("NoAll2All", (), {"__getattr__": lambda self, name: False})()   # no all2all kernel in use
    try:
        m.maybe_roundup_sizes(3584, 96, torch.bfloat16, par)
        pad_refused = None
    except route.Refused as exc:
        pad_refused = str(exc)
    return {
        "shapes": shapes,
        "w13_bytes_equal": bool(torch.equal(layer.w13_weight_packed.data.view(torch.uint8),
                                            want13.view(torch.uint8).view(e, 2 * inter, hidden // 2))),
        "w13_scale_equal": bool(torch.equal(layer.w13_weight_scale.data, want_s13)),
        "w13_shape": list(layer.w13_weight_packed.shape), "w2_shape": list(layer.w2_weight_packed.shape),
        "shuffled": bool(getattr(layer.w13_weight_packed, "is_shuffled", False)),
        "keep_constants_of_the_layer": len(kept) == 1 and kept[0] is layer,
        "experts_cls": built["experts_cls"].__name__, "backend": built["mxfp4_backend"].name,
        "vllm_route_experts_cls": backend_to_kernel_cls(Mxfp4MoeBackend.AITER_MXFP4_BF16)[0].__name__,
        "w1_scale_is_layer_scale": built["moe_quant_config"].w1_scale is layer.w13_weight_scale,
        "sizes_k3_tp8": list(m.maybe_roundup_sizes(3584, 384, torch.bfloat16, par)),
        "pad_refused": pad_refused,
    }


if __name__ == "__main__":
    out = {"resolve": resolve(sys.argv[2])}
    if sys.argv[1] == "resolve+rocm":       # after resolve: it fakes the platform for the rest of the run
        out["rocm"] = rocm(sys.argv[2])
    print(json.dumps(out))
