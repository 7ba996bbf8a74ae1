"""The routed-experts method: load k3convert int4 as compressed-tensors does, lay it out for AITER's
packed-int4 a16w4 kernel, and build the kernel vLLM's own gfx942 K3 route builds.

Written against vLLM's `quantization/mxfp4.py` (Mxfp4MoEMethod, `_setup_kernel_k3_situ_gfx942`) and
`compressed_tensors_moe_wna16.py` (create_weights) of every proven release (converter/releases;
file and line per release in docs/vllm_plugin.md); route.decide refuses other versions.
"""
from __future__ import annotations

import functools
import logging
import os
from fractions import Fraction
from typing import TYPE_CHECKING, Any

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

from . import layout, repair, route, selftest

if TYPE_CHECKING:   # the layer vLLM hands a method: its attributes are set at run time
    from vllm.model_executor.layers.fused_moe import FusedMoE

logger = logging.getLogger(route.LOGGER)


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
    supports_eplb = False    # Mxfp4MoEMethod says True; EPLB is refused (route.experts_choice) before this
    # Weights load exactly as vLLM's compressed-tensors WNA16 MoE method loads them (N-first int32
    # words and bf16 group scales, vLLM's TP/EP sharding): the same functions, not a copy.
    get_weight_shape = CompressedTensorsWNA16MoEMethod.get_weight_shape
    self_tested = False      # once per process: the first routed-experts layer laid out
    repair_minus8 = False    # set when the self-test found code -8 misread: every later layer repaired
    ckpt_inter: int | None   # the checkpoint's whole intermediate size, as the weight loader saw it

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        """vLLM's WNA16 create_weights, with the weight loader watched for the checkpoint's own
        intermediate size (what tells real channels from the padding vLLM's KimiMoE adds)."""
        self._refuse_padding_vllm_cannot_build()
        loader = extra.get("weight_loader")
        if loader is not None:
            extra["weight_loader"] = self._watching(loader)
        CompressedTensorsWNA16MoEMethod.create_weights(
            self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra)

    def _refuse_padding_vllm_cannot_build(self) -> None:
        """One line instead of the AttributeError vLLM's KimiMoE raises right after this layer
        is built when it pads it (route.padding_crashes)."""
        import vllm
        from vllm.config import get_current_vllm_config
        from vllm.distributed import get_tensor_model_parallel_world_size

        text = get_current_vllm_config().model_config.hf_text_config
        inter = getattr(text, "moe_intermediate_size", None)
        if isinstance(inter, int):
            why = route.padding_refusal(inter, get_tensor_model_parallel_world_size(),
                                        route.kimi_min_per_rank(text), getattr(vllm, "__version__", ""))
            if why:
                raise route.Refused(f"{self.prefix}: {why}")

    def _watching(self, loader):
        def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
            if shard_id in ("w1", "w3") and loaded_weight.ndim == 2 and loaded_weight.dtype == torch.int32:
                self.ckpt_inter = int(loaded_weight.shape[0])   # [I, H/8]: the whole, before the TP split
            return loader(param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
        return weight_loader

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
        self.ckpt_inter = None
        self.max_capture_size = moe.max_capture_size
        self._cache_permute_indices: dict = {}
        self.moe_kernel: Any = None   # vLLM's modular kernel, made once the weights are laid out
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

    def real_channels(self, layer: FusedMoE) -> int:
        """This rank's intermediate channels that hold checkpoint data (the rest is vLLM's padding)."""
        padded = layer.w13_weight_packed.shape[1] // 2
        if self.ckpt_inter is None:        # nothing loaded through the loader (dummy weights)
            return padded
        par = self.moe.moe_parallel_config
        return route.real_channels(self.ckpt_inter, par.tp_size, par.tp_rank)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        from aiter import dtypes as aiter_dtypes

        check_aiter_layout()
        for s_name in ("w13_weight_scale", "w2_weight_scale"):
            if getattr(layer, s_name).dtype != torch.bfloat16:
                raise route.Refused(f"{self.prefix}.{s_name}: {getattr(layer, s_name).dtype} scales; the kernel "
                                    "reads bf16 (serve with --dtype bfloat16)")
        w13, s13 = layer.w13_weight_packed.data, layer.w13_weight_scale.data
        w2, s2 = layer.w2_weight_packed.data, layer.w2_weight_scale.data
        real = self.real_channels(layer)
        probe = self._probe_experts(layer, real) if self._will_self_test() else None
        why = layout.neutralize_padding_(w13, s13, w2, s2, real)
        if why is not None:
            raise route.Refused(f"{self.prefix}: vLLM padded the per-rank intermediate size to {w13.shape[1] // 2} "
                                f"but {why}; not serving")
        for w_name, s_name in (("w13_weight_packed", "w13_weight_scale"),
                               ("w2_weight_packed", "w2_weight_scale")):
            words, scales = getattr(layer, w_name).data, getattr(layer, s_name).data
            if K3Int4AiterMoEMethod.repair_minus8:   # the kernel misreads -8 (self-test of the first layer)
                got = repair.repair_ct_(words, scales)
                logger.debug("%s %s.%s: %d of %d groups re-optimized over [-7, 7], relative weight RMSE "
                             "%.3g vs the stored int4", route.PREFIX, self.prefix, w_name, got.repaired,
                             got.groups, got.rel_rmse)
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
            # as the release's own route does after the build (docs/vllm_plugin.md): constants the experts
            # derive are kept on the layer, so a post-load rerun refills what captured graphs read
            keep = getattr(self.moe_kernel.fused_experts, "keep_constants", None)
            if keep is not None:    # releases before it have no such method
                keep(layer)
        if probe is not None:
            self._self_test(layer, *probe)

    # ---------------------------------------------------------------- the load-time self-test

    def _will_self_test(self) -> bool:
        if K3Int4AiterMoEMethod.self_tested:
            return False
        K3Int4AiterMoEMethod.self_tested = True
        if not selftest.enabled():
            logger.warning("%s %s=0: the kernel self-test is OFF; nothing checks that the installed aiter "
                           "computes K3's experts correctly", route.PREFIX, selftest.ENV)
            return False
        return True

    def _probe_experts(self, layer: FusedMoE, real: int):
        """Copies of a few local experts' int4 as loaded (real channels only), and remote expert ids."""
        emap = layer.expert_map
        chosen, remote = selftest.choose_experts(selftest.local_ids(emap, layer.global_num_experts),
                                                 layer.global_num_experts, self.moe.experts_per_token)
        experts = {}
        for g in chosen:
            i = g if emap is None else int(emap[g])
            experts[g] = selftest.expert_copy(layer.w13_weight_packed.data[i], layer.w13_weight_scale.data[i],
                                              layer.w2_weight_packed.data[i], layer.w2_weight_scale.data[i], real)
        return experts, remote

    def _kernel_call(self, layer: FusedMoE):
        """The layer's own expert kernel as a function of a probe, without any collective.

        Without all2all kernels it is ``self.apply``, the call the model makes. With them (DP > 1 and
        EP: vLLM's `fused_moe/config.py` use_all2all_kernels) the serving kernel's prepare/finalize dispatches
        tokens across ranks, which one rank cannot do alone at load; so the same experts object (the
        one serving uses: same weights, quant config, activation) is wrapped in vLLM's own no-DP/EP
        prepare/finalize (`prepare_finalize/no_dp_ep.py`, what `maybe_make_prepare_finalize` picks at
        DP 1) and called with the layer's expert mask, as the TP + EP path calls it.
        """
        call = dict(activation=layer.activation, global_num_experts=layer.global_num_experts,
                    apply_router_weight_on_input=layer.apply_router_weight_on_input,
                    shared_experts=None, shared_experts_input=None)
        if not self.moe.moe_parallel_config.use_all2all_kernels:
            return lambda p: self.apply(layer, p.x, p.topk_weights, p.topk_ids, None, None)
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
            MoEPrepareAndFinalizeNoDPEPModular,
        )

        experts = self.moe_kernel.fused_experts
        if not isinstance(experts, mk.FusedMoEExpertsModular) or \
                experts.activation_format() != mk.FusedMoEActivationFormat.Standard:
            raise route.Refused(f"{self.prefix}: with all2all kernels (data parallelism with EP) the experts "
                                f"kernel is {type(experts).__name__}, which the self-test cannot run without "
                                "its collective dispatch; serve without --data-parallel-size, or with "
                                f"{selftest.ENV}=0 at your own risk")
        local = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
        return lambda p: local.apply(hidden_states=p.x, w1=layer.w13_weight_packed, w2=layer.w2_weight_packed,
                                     topk_weights=p.topk_weights, topk_ids=p.topk_ids,
                                     expert_map=layer.expert_map, **call)

    def _run_self_test(self, layer: FusedMoE, experts: dict, remote: list[int], act) -> selftest.Outcome:
        call = self._kernel_call(layer)
        try:
            return selftest.run(call, experts, remote, act)
        except Exception as exc:  # noqa: BLE001 - the kernel could not even run: not served unseen
            raise route.Refused(f"{self.prefix}: the kernel self-test could not run the layer's kernel "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                f"not serving ({selftest.ENV}=0 skips the test at your own risk)") from exc

    def _self_test(self, layer: FusedMoE, experts: dict, remote: list[int]) -> None:
        act = selftest.Activation(float(self.moe.activation_situ_beta),
                                  None if self.moe.activation_situ_linear_beta is None
                                  else float(self.moe.activation_situ_linear_beta))
        out = self._run_self_test(layer, experts, remote, act)
        if out.problem is not None and out.minus_eight_misread and not repair.refuse():
            out = self._repair_minus_eight(layer, experts, remote, act, out)
        if out.problem is not None:
            fix = (f"; {selftest.MINUS_EIGHT_FIX}, or unset {repair.ENV} to repair such layers at load"
                   if out.minus_eight_misread else "")
            raise route.Refused(f"{self.prefix}: the kernel self-test failed ({out.line()}): {out.problem}{fix}; "
                                f"not serving ({selftest.ENV}=0 skips the test at your own risk)")
        logger.info("%s kernel self-test passed on %s: %s", route.PREFIX, self.prefix, out.line())

    def _repair_minus_eight(self, layer: FusedMoE, experts: dict, remote: list[int], act,
                            first: selftest.Outcome) -> selftest.Outcome:
        """Re-optimize this layer's groups that use -8 over [-7, 7], lay them out again and re-test;
        later layers are repaired at layout time (repair_minus8) without a test of their own."""
        got = repair.repair_layer_(layer.w13_weight_packed.data, layer.w13_weight_scale.data,
                                   layer.w2_weight_packed.data, layer.w2_weight_scale.data, experts.values())
        out = self._run_self_test(layer, experts, remote, act)
        if out.problem is None:
            K3Int4AiterMoEMethod.repair_minus8 = True
            logger.warning(
                "%s the installed aiter misreads int4 code -8 (%s); repaired at load: the groups that use -8 "
                "(%d of %d on %s) re-optimized over [-7, 7] (optimal-pm7 of the stored values), relative weight "
                "RMSE %.3g vs the stored int4 on that layer; the re-run self-test passed (%s); every later "
                "layer gets the same repair at load. %s=refuse refuses instead; converting with "
                "--scale-rule optimal-pm7 avoids it", route.PREFIX, first.problem, got.repaired, got.groups,
                self.prefix, got.rel_rmse, out.line(), repair.ENV)
        return out

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
