"""The routed-experts method: load k3convert int4 as compressed-tensors does, lay it out for AITER's
packed-int4 a16w4 kernel, and build the kernel vLLM 0.33's own gfx942 K3 route builds.

Written against vLLM 0.33.0 (`quantization/mxfp4.py` Mxfp4MoEMethod and `_setup_kernel_k3_situ_gfx942`,
`compressed_tensors_moe_wna16.py` create_weights); route.decide refuses other versions.
"""
from __future__ import annotations

import functools
import os
from fractions import Fraction
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
    Mxfp4MoeBackend,
    backend_to_kernel_cls,
    make_mxfp4_moe_kernel,
    mxfp4_round_up_hidden_size_and_intermediate_size,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (  # noqa: E501
    CompressedTensorsWNA16MoEMethod,
)
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from vllm.model_executor.utils import replace_parameter

from . import layout, route


@functools.cache
def check_aiter_layout() -> None:
    """Refuse an aiter whose own layout functions (the ones the load-time path calls) differ from ours."""
    try:
        from aiter.ops.shuffle import (
            pack_int8_to_packed_int4,
            shuffle_scale_for_int4,
            shuffle_weight,
        )
    except ImportError as exc:
        raise route.Refused(f"aiter has no packed-int4 layout helpers ({exc})") from None
    why = layout.probe(shuffle_weight, pack_int8_to_packed_int4, shuffle_scale_for_int4)
    if why is not None:
        raise route.Refused(f"{why} from the layout this plugin writes; not serving")


class K3Int4AiterMoEMethod(Mxfp4MoEMethod):
    """Mxfp4MoEMethod's K3 gfx942 int4 route, fed from int4 on disk instead of requantized MXFP4."""

    supports_pre_processed_weights = False
    # Weights load exactly as vLLM's compressed-tensors WNA16 MoE method loads them (N-first int32
    # words and bf16 group scales, vLLM's TP/EP sharding): the same functions, not a copy.
    create_weights = CompressedTensorsWNA16MoEMethod.create_weights
    get_weight_shape = CompressedTensorsWNA16MoEMethod.get_weight_shape

    def __init__(self, weight_quant: Any, moe: Any, prefix: str = ""):
        FusedMoEMethodBase.__init__(self, moe)
        if moe.activation != MoEActivation.SITU or moe.activation_situ_linear_beta is None:
            raise route.Refused(f"{prefix}: experts' activation is {moe.activation}, not SiTU with "
                                "linear_beta; the plugin only serves K3's SiTUv2 experts")
        self.prefix = prefix
        # read by CompressedTensorsWNA16MoEMethod.create_weights / get_weight_shape
        self.weight_quant = weight_quant
        self.num_bits = 4
        self.packed_factor = Fraction(32, 4)
        self.strategy = weight_quant.strategy
        self.group_size = layout.GROUP
        self.symmetric = True
        # as Mxfp4MoEMethod.__init__ sets up its is_k3_situ_int4_gfx942 route
        self.weight_dtype = "int4"
        self.activation_key = None
        self.is_k3_situ_aiter = False
        self.is_k3_situ_int4_gfx942 = True
        self.mxfp4_backend = Mxfp4MoeBackend.AITER_MXFP4_BF16
        self.experts_cls = backend_to_kernel_cls(self.mxfp4_backend)[0]
        from vllm._aiter_ops import rocm_aiter_ops

        if rocm_aiter_ops.is_fused_moe_situv2_gate_up_interleaved():
            raise route.Refused("VLLM_ROCM_USE_AITER_MOE_SITUV2=a8w4 wants gate/up-interleaved w13; the "
                                "packed-int4 a16w4 kernel reads [gate; up] separated: unset it")
        if rocm_aiter_ops.is_fused_moe_situv2_enabled():
            os.environ["AITER_BF16_FP8_MOE_BOUND"] = "0"   # as mxfp4.py does: a16w4 ignores this bound
        self.max_capture_size = moe.max_capture_size
        self._cache_permute_indices: dict = {}
        self.moe_kernel = None
        self.w13_precision_config = None
        self.w2_precision_config = None

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype,
                            moe_parallel_config):
        """No padding (the words on disk fix the shapes); refuse sizes the kernel would have padded."""
        sizes = FusedMoEMethodBase.maybe_roundup_sizes(
            self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config)
        aligned = mxfp4_round_up_hidden_size_and_intermediate_size(
            self.mxfp4_backend, *sizes, activation=self.moe.activation)
        hidden, inter = sizes
        why = route.size_problem(hidden, inter)
        if why is None and tuple(aligned) != tuple(sizes):
            why = f"vLLM's route would pad them to {tuple(aligned)}"
        if why:
            raise route.Refused(
                f"{self.prefix}: experts of hidden size {hidden} and intermediate size {inter} per rank "
                f"do not fit the kernel unpadded ({why}); choose a tensor/expert-parallel split that "
                f"keeps the per-rank intermediate size a multiple of {route.ALIGN}")
        return sizes

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from aiter import dtypes as aiter_dtypes

        check_aiter_layout()
        for w_name, s_name in (("w13_weight_packed", "w13_weight_scale"),
                               ("w2_weight_packed", "w2_weight_scale")):
            words, scales = getattr(layer, w_name).data, getattr(layer, s_name).data
            if scales.dtype != torch.bfloat16:
                raise route.Refused(f"{self.prefix}.{s_name}: {scales.dtype} scales; the kernel reads "
                                    "bf16 (serve with --dtype bfloat16)")
            packed, flat_scales = layout.convert_experts_(words.contiguous(), scales.contiguous())
            replace_parameter(layer, w_name, packed.view(aiter_dtypes.i4x2))
            replace_parameter(layer, s_name, flat_scales)
            getattr(layer, w_name).is_shuffled = True
        # the kernel _setup_kernel_k3_situ_gfx942 builds
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        if self.moe_quant_config is not None and self.experts_cls is not None:
            self.moe_kernel = make_mxfp4_moe_kernel(
                moe_quant_config=self.moe_quant_config,
                moe_config=self.moe,
                mxfp4_backend=self.mxfp4_backend,
                experts_cls=self.experts_cls,
                routing_tables=layer._expert_routing_tables(),
            )

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        """Mxfp4MoEMethod.apply on the compressed-tensors parameter names."""
        assert self.moe_kernel is not None
        return self.moe_kernel.apply(
            hidden_states=x,
            w1=layer.w13_weight_packed,
            w2=layer.w2_weight_packed,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            activation=layer.activation,
            global_num_experts=layer.global_num_experts,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            expert_map=layer.expert_map,
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )
