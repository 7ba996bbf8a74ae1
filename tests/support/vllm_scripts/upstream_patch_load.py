"""Run in the vllm 0.34.0 venv, with a patched copy of its ``vllm`` package first on PYTHONPATH: load
checkpoint-shaped int4 experts through 0.34.0's own ``RoutedExperts.weight_loader`` into the params
``CompressedTensorsWNA16MoEMethod`` creates once the patch's AITER backend is selected, then run the
method's ``process_weights_after_loading`` (the backend's ``convert_to_wna16_moe_kernel_format``).

    python upstream_patch_load.py IN.pt OUT.pt AITER_SHUFFLE_PY

IN.pt holds the checkpoint (per expert: w1/w3/w2 ``weight_packed`` int32 [N, K/8], ``weight_scale`` bf16
[N, K/32], ``weight_shape``) and the parallel cases; OUT.pt gets, per case, the params as the loader
left them and as the conversion left them. The test (tests/servers/test_upstream_patch.py) compares them with
the rank's slice of the checkpoint and with converter/vllm_plugin/layout.py; nothing is judged here.

Runs on the CPU. Simulated, because no ROCm GPU is here: the platform (ROCm, gfx942, AITER MoE on) and
aiter. The aiter package is a stand-in: ``shuffle_weight`` is amd-aiter's own (its PyPI
``aiter/ops/shuffle.py``), ``pack_int8_to_packed_int4`` is vLLM 0.34.0's
``_pack_shuffled_int8_to_packed_int4_no_perm`` and ``shuffle_scale_for_int4`` is the scale relayout of
vLLM 0.34.0's ``CompressedTensorsW4A16FlydslMoEMethod.process_weights_after_loading`` (PyPI's aiter has
neither: docs/upstream.md), ``flydsl_a16w4_gemm1`` only has aiter v0.1.20's activation parameters.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch

LAYER = "language_model.model.layers.1.block_sparse_moe.experts"
SHARDS = (("w1", "w13"), ("w3", "w13"), ("w2", "w2"))


def module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def install_aiter(shuffle_py: str) -> None:
    """The aiter stand-in (module docstring) in sys.modules, after vLLM's _aiter_ops has looked for
    aiter (it is not found: vLLM registers no aiter ops, the patched code imports aiter when called)."""
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (imports vllm._aiter_ops)

    spec = importlib.util.spec_from_file_location("aiter_pypi_shuffle", shuffle_py)
    pypi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pypi)

    def flydsl_a16w4_gemm1(*, a_bf16=None, act="silu", situ_beta=1.0, situ_linear_beta=1.0):
        raise AssertionError("no kernel runs here")

    modules = {name: module(name) for name in (
        "aiter", "aiter.dtypes", "aiter.ops", "aiter.ops.shuffle", "aiter.ops.flydsl",
        "aiter.ops.flydsl.kernels", "aiter.ops.flydsl.kernels.moe_2stage_a16wmix")}
    modules["aiter.dtypes"].i4x2 = torch.uint8
    modules["aiter"].dtypes = modules["aiter.dtypes"]
    modules["aiter.ops.shuffle"].shuffle_weight = pypi.shuffle_weight
    modules["aiter.ops.flydsl.kernels.moe_2stage_a16wmix"].flydsl_a16w4_gemm1 = flydsl_a16w4_gemm1
    sys.modules.update(modules)

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a16_flydsl as flydsl,
    )

    def shuffle_scale_for_int4(scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
        """[E, G, N] -> [E, G/2, N, 2], computed by the FlyDSL method's own relayout."""
        assert group_size == 32
        e, g, n = scale.shape
        layer = torch.nn.Module()
        for name in ("w13", "w2"):
            layer.register_parameter(f"{name}_weight_packed", torch.nn.Parameter(
                torch.zeros(e, 4, 16, dtype=torch.int32), requires_grad=False))
            layer.register_parameter(f"{name}_weight_scale",
                                     torch.nn.Parameter(scale.clone(), requires_grad=False))
        flydsl.CompressedTensorsW4A16FlydslMoEMethod.process_weights_after_loading(
            types.SimpleNamespace(group_size=32), layer)
        return layer.w13_weight_scale.data.view(e, g // 2, n, 2)

    modules["aiter.ops.shuffle"].pack_int8_to_packed_int4 = flydsl._pack_shuffled_int8_to_packed_int4_no_perm
    modules["aiter.ops.shuffle"].shuffle_scale_for_int4 = shuffle_scale_for_int4


def simulate_gfx942() -> None:
    """ROCm gfx942 with AITER MoE on, as the patched oracle and AiterMxfp4Experts ask for it.
    vllm.platforms.rocm itself asks the GPU at import: a stand-in holds the three answers read."""
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    int_wna16.current_platform = types.SimpleNamespace(
        is_rocm=lambda: True, is_cpu=lambda: False, is_xpu=lambda: False)
    rocm = module("vllm.platforms.rocm")
    rocm.on_gfx942, rocm.on_gfx950, rocm.on_gfx1250 = (lambda: True), (lambda: False), (lambda: False)
    sys.modules[rocm.__name__] = rocm
    rocm_aiter_ops.is_fused_moe_enabled = staticmethod(lambda: True)
    rocm_aiter_ops.is_fused_moe_situv2_gate_up_interleaved = staticmethod(lambda: False)


def build_layer(ckpt: dict, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int):
    """0.34.0's RoutedExperts (its loader methods, not its __init__, which needs a running vLLM) with
    the real FusedMoEConfig, ExpertMapManager and the patched method's params."""
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (  # noqa: E501
        CompressedTensorsWNA16MoEMethod,
    )

    e, h, i = ckpt["experts"], ckpt["hidden"], ckpt["intermediate"]
    parallel = FusedMoEParallelConfig(
        tp_size=tp_size, pcp_size=1, dp_size=1, ep_size=ep_size, tp_rank=tp_rank, pcp_rank=0, dp_rank=0,
        ep_rank=ep_rank, sp_size=1, use_ep=ep_size > 1, all2all_backend="allgather_reducescatter",
        enable_eplb=False)
    moe = FusedMoEConfig(
        num_experts=e, experts_per_token=2, hidden_dim=h, intermediate_size=i,
        num_local_experts=e // ep_size, num_logical_experts=e, activation=MoEActivation.SITU,
        device="cpu", routing_method=RoutingMethodType.TopK, moe_parallel_config=parallel,
        in_dtype=torch.bfloat16, moe_backend="aiter", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0)
    quant = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True,
                             dynamic=False)
    method = CompressedTensorsWNA16MoEMethod(quant, None, moe)

    layer = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(layer)
    layer.layer_name = LAYER
    layer.quant_config = types.SimpleNamespace(get_name=lambda: "compressed-tensors")
    layer.quant_method = method
    layer.moe_config = moe
    layer.shared_expert_online_loader = None
    layer.expert_map_manager = ExpertMapManager(
        max_num_batched_tokens=64, top_k=2, global_num_experts=e, num_redundant_experts=0,
        num_expert_group=None, moe_parallel_config=parallel, placement_strategy="linear",
        enable_eplb=False, rocm_aiter_enabled=True)
    method.create_weights(layer, num_experts=e // ep_size, hidden_size=h,
                          intermediate_size_per_partition=moe.intermediate_size_per_partition,
                          params_dtype=torch.bfloat16, weight_loader=layer.weight_loader)
    return method, layer


def run_case(ckpt: dict, case: tuple[int, int, int, int]) -> dict:
    method, layer = build_layer(ckpt, *case)
    out: dict = {"backend": method.wna16_backend.name, "experts_cls": method.experts_cls.__name__,
                 "local_to_global": [], "loaded_flags": {}}
    for expert in range(ckpt["experts"]):
        local = layer._map_global_expert_id_to_local_expert_id(expert)
        if local >= 0:
            out["local_to_global"].append((local, expert))
        for shard, param in SHARDS:
            for suffix in ("weight_packed", "weight_scale", "weight_shape"):
                ok = layer.weight_loader(
                    getattr(layer, f"{param}_{suffix}"), ckpt[f"{expert}.{shard}.{suffix}"],
                    f"{LAYER}.{param}_{suffix}", shard_id=shard, expert_id=expert, return_success=True)
                out["loaded_flags"][f"{expert}.{shard}.{suffix}"] = bool(ok)
    names = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale",
             "w13_weight_shape", "w2_weight_shape")
    out["loaded"] = {n: getattr(layer, n).data.clone() for n in names}
    storage = {n: getattr(layer, n).data.untyped_storage().data_ptr() for n in names[:4]}
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    int_wna16._AITER_INT4_CONVERT_CHUNK_VALUES = ckpt["chunk_values"][case]
    method.process_weights_after_loading(layer)
    out["converted"] = {n: getattr(layer, n).data.contiguous().view(torch.uint8).clone() for n in names[:4]}
    out["converted_dtypes"] = {n: str(getattr(layer, n).dtype) for n in names[:4]}
    out["in_place"] = {n: getattr(layer, n).data.untyped_storage().data_ptr() == storage[n]
                       for n in names[:4]}
    out["is_shuffled"] = bool(getattr(layer.w13_weight_packed, "is_shuffled", False))
    out["kernel"] = type(method.moe_kernel.fused_experts).__name__ if method.moe_kernel else None
    out["w13_weight_is_packed"] = layer.w13_weight is layer.w13_weight_packed
    return out


def main() -> None:
    src, dst, shuffle_py = sys.argv[1:4]
    ckpt = torch.load(src)
    install_aiter(shuffle_py)
    simulate_gfx942()
    import vllm

    results = {"vllm_version": str(vllm.__version__), "vllm_file": vllm.__file__, "torch": str(torch.__version__),
               "cases": {case: run_case(ckpt, case) for case in ckpt["cases"]}}
    torch.save(results, dst)


if __name__ == "__main__":
    main()
