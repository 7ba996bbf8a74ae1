"""vLLM 0.34.0, read from its released wheel (vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl).

Every citation that moved or changed since 0.33.0 is re-cited here from 0.34.0's files; the rest keep
0.33.0's (inherited), each checked to be at the same lines in 0.34.0. ``$V`` stands for "vllm 0.34.0".
"""
from __future__ import annotations

from .release import Facts, Family, MoeActivation, Release, Replicated, Utilization
from .vllm_0_33 import _KIMI_CUDA, _KIMI_ROCM, CITES as CITES_0_33, kimi_replicated

CITES = {
    **CITES_0_33,
    "rule.num-bits": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod: packed_factor = 32 / "
                     "num_bits sizes the int32 params (line 65)",
    "rule.symmetric": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 251-272: "
                      "asymmetric makes weight_zero_point params, which the shards do not have",
    "rule.strategy": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.__init__ 125: assert "
                     "weight_quant.strategy == 'group' (non-Marlin backends)",
    "rule.actorder": "$V fused_moe/oracle/int_wna16.py 188, 230-234: RDNA3 and TRITON refuse actorder group",
    "rule.packed": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 165-205: "
                   "int32 (E, out, in // 8), N-first, filled by copy_",
    "rule.scale-dtype": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 280-301: "
                        "scales are params_dtype; copy_ casts anything else",
    "rule.scale-shape": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 249-250, "
                        "280-301: scale (E, out, in // group_size), filled by copy_",
    # models/kimi_k3/amd/linear.py: 278-282 give routed_expert_down_proj the online quant config (None
    # under compressed-tensors: base_config.py 135), so every line after 278 moved by 5
    "rule.expert-names": "$V models/kimi_k3/amd/linear.py 979-983: fused_moe_make_expert_params_mapping maps "
                         "w1/w2/w3 (fused_moe/layer.py 471-489)",
    "rule.memory": "$V v1/worker/utils.py request_memory 734-748 (requested = total x gpu_memory_utilization), "
                   "v1/worker/gpu_worker.py 776-779 (the KV cache gets requested minus the weights and the "
                   "profiled activations)",
    "rule.hidden-group": "$V compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights 250: "
                         "num_groups_w13 = hidden_size // group_size",
    "rule.tp-intermediate": "$V fused_moe/config.py 1397: assert intermediate_size % tp_size == 0 (the MoE's "
                            "tp_size: dp*tp without EP, 1 with EP, 1248-1284); $V compressed_tensors_moe_wna16.py "
                            "CompressedTensorsWNA16MoEMethod.create_weights 249: num_groups_w2 = "
                            "intermediate_size_per_partition // group_size",
    "kernel.vllm-rocm": "$V fused_moe/oracle/int_wna16.py 130-147: on gfx942 RDNA3, FlashInfer-TRTLLM, Marlin, "
                        "Humming are not for this device; TritonWNA16Experts (experts/triton_moe.py 810-822) has no "
                        "situ; EMULATION (experts/int4_emulation_moe.py, oracle 1294-1341) dequantizes to bf16 at load",
    "kernel.vllm-cuda": "$V fused_moe/oracle/int_wna16.py 130-147: FlashInfer-TRTLLM takes silu/swigluoai only "
                        "(experts/trtllm_mxint4_moe.py 69-73); MarlinExperts takes situ (experts/marlin_moe.py "
                        "570-573, fused_moe/activation.py 122-136) if hidden % 128 == 0 and per-rank intermediate % "
                        "group == 0 (quantization/utils/marlin_utils.py 355-386)",
    "oracle.none": "NotImplementedError at start-up (fused_moe/oracle/int_wna16.py 342-361)",
    "oracle.marlin": "fused_moe/oracle/int_wna16.py 130-147; experts/marlin_moe.py 539-541, 570-573",
    "oracle.triton": "fused_moe/oracle/int_wna16.py 130-147; experts/triton_moe.py 810-822",
    "kimi.padding": "$V models/kimi_k3/amd/linear.py 227-236 and 354-362, nvidia/model.py 422-431 and 579-592",
    "cuda.padding-garbage": "its zeroing looks the int4 words up on the MoE runner, finds none and zeroes nothing, "
                            "so the padded words stay as torch.empty left them (compressed_tensors_moe_wna16.py "
                            "178-202) with scales of 1 (277, 293), and Marlin computes every padded channel "
                            "(fused_moe/oracle/int_wna16.py 591-599 masks nothing)",
    "cuda.clamp": "the clamp reaches the kernel: CompressedTensorsWNA16MoEMethod passes layer.swiglu_limit as "
                  "gemm1_clamp_limit (compressed_tensors_moe_wna16.py 474, 485), ApplyMoEActivationConfig carries it "
                  "(fused_moe/activation.py 176-197, modular_kernel.py 570) and MARLIN/TRITON apply silu(min(gate, "
                  "limit)) * clamp(up) (MARLIN: experts/marlin_moe.py 728-730, modular_kernel.py 993-1011, "
                  "activation.py 350-356; TRITON: experts/triton_moe.py 257-263), Humming too "
                  "(quantization/utils/humming/activation.py 99-101); only VLLM_USE_FLASHINFER_MOE_INT4=1 on SM100 "
                  "(envs.py 1764, flashinfer_mxint4_moe.py 24-31) picks FlashInfer TRT-LLM MxInt4, called with "
                  "gemm1_clamp_limit=None (flashinfer_mxint4_moe.py 252): leave it unset",
    "activation.minimax_m3": "$V models/minimax_m3/amd/model.py 520-545 (swiglu_beta fixed at 1.0); defaults "
                             "transformers' MiniMaxM3VLTextConfig (transformers_utils/config.py 159)",
    "activation.ling": "$V model_executor/models/bailing_moe_v3.py 1205-1207 (swiglustep when "
                       "expert_swiglu_limit is set); fused_moe/activation.py 390-394 (min(silu(gate), limit) * "
                       "clamp(up))",
    "plugin.kernel": "converter/vllm_plugin/moe_method.py: aiter flydsl_a16w4_gemm1 ($V quantization/mxfp4.py "
                     "_setup_kernel_k3_situ_gfx942 984-1026 builds the same kernel); self-test: moe_method.py "
                     "_will_self_test",
    "plugin.aiter-found": "$V _aiter_ops.py 273-285",
    "split.ep": "$V fused_moe/config.py 1235-1238 (EP on when --enable-expert-parallel and dp*tp > 1), 1266-1284 "
                "(ep_size = dp*tp, MoE tp_size 1)",
    "split.tp": "$V fused_moe/config.py 1143-1151 and 1248-1263 (no EP: the MoE's tp_size = dp*tp)",
    "split.all2all": "$V fused_moe/config.py 1066-1069 (use_all2all_kernels: EP and DP > 1); backend "
                     "allgather_reducescatter by default (config/parallel.py 229)",
    "split.pp": "$V distributed/utils.py 240-245 (get_pp_indices: equal stages, the remainder to the stages "
                "before the last)",
    "loader.engine.heads": "$V config/model.py 1577-1583 (verify_with_parallel_config)",
    "loader.kimi.heads": "$V models/kimi_k3/amd/linear.py 410 (MLA) and 802-804",
    "loader.kimi.kda-heads": "$V models/kimi_k3/amd/kda.py 170-171 (KDA heads)",
    "loader.minimax.experts": "$V models/minimax_m3/amd/model.py 433-437 (MiniMaxM3MoE)",
    "loader.minimax.heads": "$V models/minimax_m3/amd/model.py 591-592 and 744-745",
    "loader.minimax.kv-heads": "$V models/minimax_m3/amd/model.py 594-598 and 747-751",
    "loader.qkv": "$V model_executor/layers/linear.py 1113-1119 (QKVParallelLinear: divide() asserts)",
    "loader.glm5.act": "$V models/glm5next/common/model.py 208-211 (Glm5NextMLP) and 249-253 (Glm5NextMoE: only "
                       "silu)",
    "loader.glm5.heads": "$V models/glm5next/common/model.py 864-867 (Glm5NextModel)",
    "fp8.validate": "$V quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py 103-114 -> "
                    "quantization/utils/fp8_utils.py validate_fp8_block_shape 1296-1344 (no mismatch allowance "
                    "under compressed-tensors: layers/linear.py 565-584 reads Fp8Config's weight_block_size)",
    "fp8.divide": "$V layers/linear.py 500-506 (column), 1741 (row): divide() asserts",
    "fp8.ling-pad": "$V model_executor/models/bailing_moe_v3.py 299-320, 1185-1197, 1548-1553: under the source's "
                    "Fp8Config vLLM pads the shared experts' intermediate size to a multiple of TP * 128 and "
                    "zero-pads the tensors at load; under compressed-tensors it does not (_is_block_fp8_config "
                    "222-228)",
    "fp8.mimo.qkv": "$V model_executor/models/mimo_v2.py 284-293 (QKVParallelLinear; layers/linear.py 1111-1131)",
    "fp8.fused-mixed": "$V quantization/compressed_tensors/utils.py 133-176 (_match_fused_layer: a fused layer takes "
                       "a group's scheme only when every shard is a target) -> "
                       "compressed_tensors/compressed_tensors.py 159-173 (no scheme: UnquantizedLinearMethod, a bf16 "
                       "weight); layers/linear.py 818-926 "
                       "(MergedColumnParallelLinear.weight_loader copies the e4m3 values into it, 926 copy_weight_)",
    "fp8.ling.kda-fused": "$V model_executor/models/bailing_moe_v3.py 691 (b_proj separate only when "
                          "_is_fp8_module_excluded, false outside a block Fp8Config: 283-297), 710-720 (qkvb_proj "
                          "of q, k, v, b); load_param 1519-1521 skips a name without a parameter (each shard's "
                          "weight_scale is dropped)",
    # Kimi K3.1: registry.py 493-496 (KimiK31ForConditionalGeneration on the K3 classes),
    # transformers_utils/config.py 152 (kimi_k31 -> KimiK3Config), configs/kimi_linear.py 15-57, 177-189
    "kimi.dsa-rocm": "$V models/kimi_k3/__init__.py 26-29 builds amd/ on ROCm, which reads no dsa_config (DSA is "
                     "nvidia/dsa.py, nvidia/model.py 1028-1079 only); amd/linear.py load_weights (943-1081) has no "
                     "parameter for the indexer tensors: KeyError at 1073 on the first one",
    "memory.utilization": "$V config/cache.py 186 (DEFAULT_GPU_MEMORY_UTILIZATION 0.92), 216 "
                          "(gpu_memory_utilization: default None), 495-501 (resolved_gpu_memory_utilization: "
                          "1.0 with enable_extensible_kv_cache, else 0.92); config/vllm.py 2006, 3180-3263 "
                          "(_resolve_extensible_kv_cache: on where unset on CUDA and ROCm unless a KV connector "
                          "needs otherwise, kv_cache_memory_bytes, num_gpu_blocks_override or elastic EP); "
                          "v1/worker/utils.py 742-743 (request_memory uses the resolved value)",
    "replicated.router": "$V models/kimi_k3/amd/linear.py 245 and nvidia/model.py 440: the router is a GateLinear, "
                         "a ReplicatedLinear (fused_moe/router/gate_linear.py 26), with its e_score_correction_bias",
    "replicated.latent-down": "$V models/kimi_k3/amd/linear.py 283, nvidia/model.py 480: routed_expert_down_proj "
                              "is a ReplicatedLinear",
    "replicated.latent-up": "$V models/kimi_k3/amd/linear.py 295-320: routed_expert_up_proj is a ReplicatedLinear "
                            "unless TP > 1, hidden_size % TP == 0, shared experts and routed_scaling_factor 1.0 "
                            "(a ColumnParallelLinear then); nvidia/model.py 497: always a ReplicatedLinear",
    "replicated.mla-a": "$V layers/linear.py 1595-1635 (KimiK3MergedQKVGateLinear: the q_a and kv_a shards stay "
                        "whole on every rank, the output gate is split), models/kimi_k3/amd/linear.py 413-439 "
                        "(disable_tp, ReplicatedLinear), nvidia/mla.py 225, 273",
    "replicated.kda-f-a": "$V models/kimi_k3/amd/kda.py 202, nvidia/kda.py 663: in_proj_qkvgfab's "
                          "replicated_shard_id=4 (f_a_proj)",
    "replicated.res-proj": "$V models/kimi_k3/amd/linear.py 637, 644, 789 and nvidia/model.py 834, 841, 1094: "
                           "the attention-residual projections are ReplicatedLinear",
    "replicated.dsa-indexer": "$V models/kimi_k3/nvidia/dsa.py 150-175: K3.1's indexer wq_index is a "
                              "ReplicatedLinear, wkv_index (wk, weights_proj) disable_tp, and its k norm",
    "kimi.dsa-config": "$V transformers_utils/configs/kimi_linear.py 15-57 (KimiLinearDSAConfig.from_dict: "
                       "dsa_layers required, else TypeError), 177-189 (text_config.dsa_config only), 231-235 "
                       "(is_dsa_layer: 1-based layer numbers); models/kimi_k3/nvidia/dsa.py 8-11 (each DSA "
                       "layer's self_attn.indexer.{wq_b, wk, weights_proj, k_norm}); an indexer parameter the "
                       "checkpoint does not fill stays torch.empty: the unloaded-weights check runs only "
                       "without quantization (model_loader/default_loader.py 547-551, 608-613)",
}

_MINIMAX = MoeActivation("swigluoai_uninterleave", {"swiglu_alpha": 1.702, "swiglu_limit": 7.0},
                         "activation.minimax_m3", fixed={"swiglu_beta": 1.0})
_LING = MoeActivation("swiglustep", {"expert_swiglu_limit_list": 7.0}, "activation.ling",
                      when="expert_swiglu_limit_list")

_DSA = Replicated(r"\.self_attn\.(dsa_)?indexer\.", "replicated.dsa-indexer")

_KIMI, _KIMI_MTP = ("kimi_k3", "kimi_k31"), ("kimi_k3_mtp",)
RELEASE = Release(
    Family.VLLM, "0.34.0", CITES,
    Facts(kimi_model_types=_KIMI,
          kimi_mtp_types=_KIMI_MTP,                      # config/speculative.py 883-890 (K3.1's draft keeps kimi_k31)
          kimi_padding_crashes=True,                     # linear.py 354-362: the same code as 0.33.0's
          kimi_dsa=True,                                 # models/kimi_k3/nvidia/dsa.py, model.py 1028-1079
          gemm1_module="aiter.ops.flydsl.kernels.moe_2stage_a16wmix",   # quantization/mxfp4.py 987-989
          align=128,                                     # fused_moe/oracle/mxfp4.py 886-892
          aiter_pin="v0.1.28.post1",                     # docker/Dockerfile.rocm_base 13 at the release commit
          moe_activations={"minimax_m3_vl": _MINIMAX, "minimax_m3_text": _MINIMAX,
                           "bailing_moe_v3": _LING, "bailing_hybrid": _LING},
          utilization=Utilization(0.92, "memory.utilization", extensible=1.0, extensible_on=("CUDA", "ROCm")),
          replicated=kimi_replicated((*_KIMI, *_KIMI_MTP), (*_KIMI_ROCM, _DSA), (*_KIMI_CUDA, _DSA))),
    wheel="vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
)
