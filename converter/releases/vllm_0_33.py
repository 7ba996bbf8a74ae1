"""vLLM 0.33.0, read from its released wheel (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl).

Every value is what one rule of the serving check or the plugin cites: ``$V`` stands for
"vllm 0.33.0"; paths are inside the ``vllm/`` package (``model_executor/layers/`` is left out
where the file name is unique). docs/serving.md explains each rule.
"""
from __future__ import annotations

from .release import Facts, Family, MoeActivation, Release, Replicated, Utilization

CITES = {
    # --- the int4 MoE path's rules (converter/servers/rules.py), where vLLM enforces each
    "rule.format": "$V compressed_tensors_moe.py get_moe_method 90-102: format == pack_quantized and bits in "
                   "(4, 8), else ValueError",
    "rule.num-bits": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod: packed_factor = 32 / "
                     "num_bits sizes the int32 params (line 66)",
    "rule.type": "$V compressed_tensors/compressed_tensors.py _is_mxfp4 440-456: type float + 4 bits + group 32 "
                 "routes to the MXFP4 MoE method",
    "rule.symmetric": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 256-277: "
                      "asymmetric makes weight_zero_point params, which the shards do not have",
    "rule.strategy": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.__init__ 127: assert "
                     "weight_quant.strategy == 'group' (non-Marlin backends)",
    "rule.actorder": "$V fused_moe/oracle/int_wna16.py 164, 201-205: RDNA3 and TRITON refuse actorder group",
    "rule.static": "$V compressed_tensors/compressed_tensors.py _is_wNa16_group_channel 698-708: is_static = not "
                   "weight_quant.dynamic",
    "rule.input-activations": "$V compressed_tensors/compressed_tensors.py _is_wNa16_group_channel 698-708: "
                              "input_quant is None, else a W4A8 method or 'Unsupported FusedMoe scheme'",
    "rule.names": "$V compressed_tensors_moe.py get_moe_method 35-58: asks the scheme of "
                  "f'{layer}.0.{gate|up|down}_proj' (RoutedExperts' ckpt names, kimi_k3 passes none), ignored -> "
                  "UnquantizedFusedMoEMethod, mixed -> ValueError; targets match by re.match/equality/class name "
                  "(compressed_tensors/utils.py 73-111)",
    "rule.packed": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 170-210: "
                   "int32 (E, out, in // 8), N-first, filled by copy_",
    "rule.scale-dtype": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 285-306: "
                        "scales are params_dtype; copy_ casts anything else",
    "rule.scale-shape": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 254-255, "
                        "285-306: scale (E, out, in // group_size), filled by copy_",
    "rule.group-size": "k3convert's target (the gfx950 flydsl method and the plugin require group_size == 32)",
    "rule.loader": "the model's classes, per model type (converter/servers/loaders.py LOADERS cites each line); the "
                   "FP8 block linears' per-rank sizes (converter/servers/fp8_tp.py LINEARS: fp8_utils.py "
                   "validate_fp8_block_shape)",
    "rule.memory": "$V v1/worker/utils.py request_memory 716-730 (requested = total x gpu_memory_utilization), "
                   "v1/worker/gpu_worker.py 753-756 (the KV cache gets requested minus the weights and the "
                   "profiled activations)",
    "rule.expert-names": "$V models/kimi_k3/amd/linear.py 974-978: fused_moe_make_expert_params_mapping maps "
                         "w1/w2/w3 (fused_moe/layer.py 466-484)",
    "rule.expert-shapes": "$V fused_moe FusedMoE weight loaders: one (E, ...) param per layer, narrow + copy_",
    "rule.hidden-group": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 255: "
                         "num_groups_w13 = hidden_size // group_size",
    "rule.tp-intermediate": "$V fused_moe/config.py 1352: assert intermediate_size % tp_size == 0 (the MoE's "
                            "tp_size: dp*tp without EP, 1 with EP, 1211-1245); $V compressed_tensors_moe_wna16.py "
                            "CompressedTensorsWNA16MoEMethod.create_weights 254: num_groups_w2 = "
                            "intermediate_size_per_partition // group_size",
    "rule.config-sizes": "$V models/kimi_k3/amd/linear.py 207-221: FusedMoE sized from moe_intermediate_size and "
                         "routed_expert_hidden_size (else hidden_size), then copy_",
    # --- the kernel each target gets (rule kernel)
    "kernel.vllm-rocm": "$V fused_moe/oracle/int_wna16.py 126-143: on gfx942 RDNA3, FlashInfer-TRTLLM, Marlin, "
                        "Humming are not for this device; TritonWNA16Experts (experts/triton_moe.py 681-693) has no "
                        "situ; EMULATION (experts/int4_emulation_moe.py, oracle 1413-1460) dequantizes to bf16 at load",
    "kernel.vllm-cuda": "$V fused_moe/oracle/int_wna16.py 126-143: FlashInfer-TRTLLM takes silu/swigluoai only "
                        "(experts/trtllm_mxint4_moe.py 69-73); MarlinExperts takes situ (experts/marlin_moe.py "
                        "623-626, fused_moe/activation.py 122-136) if hidden % 128 == 0 and per-rank intermediate % "
                        "group == 0 (quantization/utils/marlin_utils.py 356-387)",
    "kernel.vllm-rocm-plugin": "converter/vllm_plugin/route.py decide: AITER flydsl_a16w4_gemm1 with Situv2 (beta, "
                               "linear_beta) on the int4 experts as stored; refuses what it does not understand",
    "oracle.none": "NotImplementedError at start-up (fused_moe/oracle/int_wna16.py 338-363)",
    "oracle.marlin": "fused_moe/oracle/int_wna16.py 126-143; experts/marlin_moe.py 592-594, 623-626",
    "oracle.triton": "fused_moe/oracle/int_wna16.py 126-143; experts/triton_moe.py 681-693",
    "situ.beta": "vLLM's SiTU asserts it (fused_moe/activation.py 361-370)",
    "kimi.padding": "$V models/kimi_k3/amd/linear.py 227-236 and 349-357, nvidia/model.py 419-428 and 571-584",
    # --gpu-memory-utilization when not given (converter/servers/memory.py)
    "memory.utilization": "$V config/cache.py 215 (gpu_memory_utilization: Field(default=0.92)); "
                          "v1/worker/utils.py 724-726 (requested = total x gpu_memory_utilization)",
    # Kimi weights every TP rank holds whole (converter/servers/memory.py; ROCm: models/kimi_k3/amd/,
    # CUDA: nvidia/)
    "replicated.router": "$V models/kimi_k3/amd/linear.py 245 and nvidia/model.py 437: the router is a GateLinear, "
                         "a ReplicatedLinear (fused_moe/router/gate_linear.py 22), with its e_score_correction_bias",
    "replicated.latent-down": "$V models/kimi_k3/amd/linear.py 278, nvidia/model.py 477: routed_expert_down_proj "
                              "is a ReplicatedLinear",
    "replicated.latent-up": "$V models/kimi_k3/amd/linear.py 290-315: routed_expert_up_proj is a ReplicatedLinear "
                            "unless TP > 1, hidden_size % TP == 0, shared experts and routed_scaling_factor 1.0 "
                            "(a ColumnParallelLinear then); nvidia/model.py 494: always a ReplicatedLinear",
    "replicated.mla-a": "$V layers/linear.py 1562 (KimiK3MergedQKVGateLinear: the q_a and kv_a shards stay whole "
                        "on every rank, the output gate is split), models/kimi_k3/amd/linear.py 408-434 "
                        "(disable_tp, ReplicatedLinear), nvidia/mla.py 222, 270",
    "replicated.kda-f-a": "$V models/kimi_k3/amd/kda.py 162, nvidia/kda.py 656: in_proj_qkvgfab's "
                          "replicated_shard_id=4 (f_a_proj)",
    "replicated.res-proj": "$V models/kimi_k3/amd/linear.py 632, 639, 784 and nvidia/model.py 808, 815, 1009: "
                           "the attention-residual projections are ReplicatedLinear",
    "replicated.norm": "$V layers/layernorm.py RMSNorm: one weight, no TP split",
    # Kimi K3.1's DSA (converter/formats/kimi_dsa.py)
    "kimi.dsa-none": "$V has no DSA: no file reads dsa_config, no indexer module under models/kimi_k3/; "
                     "load_weights has no parameter for an indexer tensor: KeyError (amd/linear.py 1068, "
                     "nvidia/model.py 1393)",
    "kimi.dsa-config": "$V reads no dsa_config (no file names it): indexer tensors have no parameter "
                       "(KeyError at amd/linear.py 1068, nvidia/model.py 1393)",
    "cuda.padding-garbage": "its zeroing looks the int4 words up on the MoE runner, finds none and zeroes nothing, "
                            "so the padded words stay as torch.empty left them (compressed_tensors_moe_wna16.py "
                            "183-207) with scales of 1 (282, 298), and Marlin computes every padded channel "
                            "(fused_moe/oracle/int_wna16.py 651-659 masks nothing)",
    "cuda.clamp": "the clamp reaches the kernel: CompressedTensorsWNA16MoEMethod passes layer.swiglu_limit as "
                  "gemm1_clamp_limit (compressed_tensors_moe_wna16.py 495, 506), ApplyMoEActivationConfig carries it "
                  "(fused_moe/activation.py 176-197, modular_kernel.py 525) and MARLIN/TRITON apply silu(min(gate, "
                  "limit)) * clamp(up) (MARLIN: experts/marlin_moe.py 783-785, modular_kernel.py 933-951, "
                  "activation.py 350-356; TRITON: experts/triton_moe.py 219-225), Humming too "
                  "(quantization/utils/humming/activation.py 99-101); only VLLM_USE_FLASHINFER_MOE_INT4=1 on SM100 "
                  "(envs.py 1685, flashinfer_mxint4_moe.py 24-31) picks FlashInfer TRT-LLM MxInt4, called with "
                  "gemm1_clamp_limit=None (flashinfer_mxint4_moe.py 252): leave it unset",
    "activation.minimax_m3": "$V models/minimax_m3/amd/model.py 454-479; defaults "
                             "transformers_utils/configs/minimax_m3.py 36-41",
    "plugin.kernel": "converter/vllm_plugin/moe_method.py: aiter flydsl_a16w4_gemm1 ($V quantization/mxfp4.py "
                     "_setup_kernel_k3_situ_gfx942 builds the same kernel); self-test: moe_method.py _will_self_test",
    "plugin.aiter-found": "$V _aiter_ops.py 279-291",
    # --- how vLLM splits the MoE over ranks (converter/servers/topology.py)
    "split.ep": "$V fused_moe/config.py 1198-1201 (EP on when --enable-expert-parallel and dp*tp > 1), 1228-1245 "
                "(ep_size = dp*tp, MoE tp_size 1)",
    "split.tp": "$V fused_moe/config.py 1106-1114 and 1211-1225 (no EP: the MoE's tp_size = dp*tp)",
    "split.experts": "$V fused_moe/expert_map_manager.py 66-69 (num_experts // ep_size, the first num_experts % "
                     "ep_size ranks one more)",
    "split.all2all": "$V fused_moe/config.py 1035-1038 (use_all2all_kernels: EP and DP > 1); backend "
                     "allgather_reducescatter by default (config/parallel.py 220)",
    "split.pp": "$V distributed/utils.py 225-230 (get_pp_indices: equal stages, the remainder to the stages "
                "before the last)",
    # --- what the models' loaders refuse at a topology (converter/servers/loaders.py)
    "loader.engine.heads": "$V config/model.py 1557-1563 (verify_with_parallel_config)",
    "loader.kimi.heads": "$V models/kimi_k3/amd/linear.py 405 (MLA) and 797-799",
    "loader.kimi.kda-heads": "$V models/kimi_k3/amd/kda.py 130-131 (KDA heads)",
    "loader.minimax.experts": "$V models/minimax_m3/amd/model.py 362-366 (MiniMaxM3MoE)",
    "loader.minimax.heads": "$V models/minimax_m3/amd/model.py 516-517 and 656-657",
    "loader.minimax.kv-heads": "$V models/minimax_m3/amd/model.py 519-523 and 659-663",
    "loader.mimo.experts": "$V model_executor/models/mimo_v2.py 138-142 (MiMoV2MoE)",
    "loader.mimo.act": "$V model_executor/models/mimo_v2.py 144-148 (MiMoV2MoE: only silu)",
    "loader.qkv": "$V model_executor/layers/linear.py 1065-1071 (QKVParallelLinear: divide() asserts)",
    "loader.ling.heads": "$V model_executor/models/bailing_moe_v3.py 480 (BailingMoeV3MLAAttention)",
    "loader.glm5.act": "$V models/glm5next/common/model.py 202-205 (Glm5NextMLP) and 243-247 (Glm5NextMoE: only "
                       "silu)",
    "loader.glm5.heads": "$V models/glm5next/common/model.py 765-768 (Glm5NextModel)",
    # --- the FP8 block linears' per-rank sizes (converter/servers/fp8_tp.py)
    "fp8.validate": "$V quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py 103-114 -> "
                    "quantization/utils/fp8_utils.py validate_fp8_block_shape 1296-1344 (no mismatch allowance "
                    "under compressed-tensors: layers/linear.py 562-581 reads Fp8Config's weight_block_size)",
    "fp8.divide": "$V layers/linear.py 497-503 (column), 1708 (row): divide() asserts",
    "fp8.ling-pad": "$V model_executor/models/bailing_moe_v3.py 299-320, 1186-1198, 1547-1552: under the source's "
                    "Fp8Config vLLM pads the shared experts' intermediate size to a multiple of TP * 128 and "
                    "zero-pads the tensors at load; under compressed-tensors it does not (_is_block_fp8_config "
                    "222-228)",
    "fp8.ling.mlp": "$V model_executor/models/bailing_moe_v3.py 432-446 (BailingMoeV3MLP: dense and shared-expert "
                    "MLPs)",
    "fp8.ling.kda": "$V model_executor/models/bailing_moe_v3.py 696-719 (KDA qkvb_proj; b_proj is fused under "
                    "compressed-tensors, 691)",
    "fp8.ling.qkv-a": "$V model_executor/models/bailing_moe_v3.py 505-512 (fused_qkv_a_proj, disable_tp)",
    "fp8.ling.kv-a": "$V model_executor/models/bailing_moe_v3.py 505-512 (fused_qkv_a_proj, disable_tp); alone "
                     "ReplicatedLinear 497-503",
    "fp8.ling.q-b": "$V model_executor/models/bailing_moe_v3.py 514-520",
    "fp8.ling.kv-b": "$V model_executor/models/bailing_moe_v3.py 525-531",
    "fp8.ling.g": "$V model_executor/models/bailing_moe_v3.py 561-570 (MLA; replicated only under Fp8Config, "
                  "541-552) and 763-769 (KDA)",
    "fp8.ling.f": "$V model_executor/models/bailing_moe_v3.py 721-727",
    "fp8.ling.dense": "$V model_executor/models/bailing_moe_v3.py 573-579",
    "fp8.ling.o": "$V model_executor/models/bailing_moe_v3.py 773-779",
    "fp8.mimo.mlp": "$V model_executor/models/mimo_v2.py 89-103 (MiMoV2MLP)",
    "fp8.mimo.qkv": "$V model_executor/models/mimo_v2.py 284-293 (QKVParallelLinear; layers/linear.py 1063-1083)",
    "fp8.mimo.o": "$V model_executor/models/mimo_v2.py 295-301",
    "fp8.fused-mixed": "$V quantization/compressed_tensors/utils.py 133-176 (_match_fused_layer: a fused layer takes "
                       "a group's scheme only when every shard is a target) -> "
                       "compressed_tensors/compressed_tensors.py 159-173 (no scheme: UnquantizedLinearMethod, a bf16 "
                       "weight); layers/linear.py 772-880 "
                       "(MergedColumnParallelLinear.weight_loader copies the e4m3 values into it, 880)",
    "fp8.ling.kda-fused": "$V model_executor/models/bailing_moe_v3.py 691 (b_proj separate only when "
                          "_is_fp8_module_excluded, false outside a block Fp8Config: 283-297), 710-720 (qkvb_proj "
                          "of q, k, v, b); load_param 1518-1520 skips a name without a parameter (each shard's "
                          "weight_scale is dropped)",
}

# Kimi's weights kept whole on every TP rank, by platform (amd/ classes on ROCm, nvidia/ on CUDA)
_LATENT_UP = r"\.routed_expert_up_proj\."
_KIMI_HEAD = (Replicated(r"\.block_sparse_moe\.gate\.", "replicated.router"),
              Replicated(r"\.routed_expert_down_proj\.", "replicated.latent-down"))
_KIMI_TAIL = (Replicated(r"\.(q_a_proj|kv_a_proj_with_mqa)\.", "replicated.mla-a"),
              Replicated(r"\.f_a_proj\.", "replicated.kda-f-a"),
              Replicated(r"_res_proj\.", "replicated.res-proj"),
              Replicated(r"norm\.weight$", "replicated.norm"))
# ROCm splits the latent up projection when ``kimi_up_proj_sharded`` holds; CUDA keeps it whole always
_KIMI_ROCM = (*_KIMI_HEAD, Replicated(_LATENT_UP, "replicated.latent-up", unless="kimi_up_proj_sharded"), *_KIMI_TAIL)
_KIMI_CUDA = (*_KIMI_HEAD, Replicated(_LATENT_UP, "replicated.latent-up"), *_KIMI_TAIL)


def kimi_replicated(types: tuple[str, ...], rocm: tuple[Replicated, ...], cuda: tuple[Replicated, ...]) -> dict:
    """The (model_type, platform) table of Facts.replicated for the release's Kimi model ``types``."""
    return {(t, platform): rows for t in types for platform, rows in (("ROCm", rocm), ("CUDA", cuda))}


_MINIMAX = MoeActivation("swigluoai_uninterleave", {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0},
                         "activation.minimax_m3")

_KIMI, _KIMI_MTP = ("kimi_k3",), ("kimi_k3_mtp",)
RELEASE = Release(
    Family.VLLM, "0.33.0", CITES,
    Facts(kimi_model_types=_KIMI,
          kimi_mtp_types=_KIMI_MTP,                      # config/speculative.py 785-792
          kimi_padding_crashes=True,                     # models/kimi_k3/amd/linear.py 349-357: AttributeError
          gemm1_module="aiter.ops.flydsl.kernels.moe_2stage_a16wmix",   # quantization/mxfp4.py 882
          align=128,                                     # fused_moe/oracle/mxfp4.py 888-892
          aiter_pin="v0.1.26",                           # docker/Dockerfile.rocm_base 11 at the release commit
          moe_activations={"minimax_m3_vl": _MINIMAX, "minimax_m3_text": _MINIMAX},
          utilization=Utilization(0.92, "memory.utilization"),
          replicated=kimi_replicated((*_KIMI, *_KIMI_MTP), _KIMI_ROCM, _KIMI_CUDA)),
    wheel="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
)
