"""SGLang 0.5.23, read from its released wheel (sglang-0.5.23-py3-none-any.whl).

``$V`` stands for "sglang 0.5.23"; paths are inside ``sglang/srt/`` (``layers/quantization/`` left
out where the file name is unique).
"""
from __future__ import annotations

from .release import Family, Release

_WNA16 = "$V compressed_tensors_wNa16_moe.py CompressedTensorsWNA16MoE"
_CT = "$V compressed_tensors/compressed_tensors.py"
_LAYER = "$V moe/fused_moe_triton/layer.py FusedMoE"

CITES = {
    "rule.format": f"{_WNA16}.__init__ 83-90: quant_format == pack_quantized, else ValueError",
    "rule.num-bits": f"{_WNA16}: packed_factor = 32 // num_bits sizes the int32 params (line 77)",
    "rule.type": f"{_WNA16}: decodes the nibbles as int (uint4b8) whatever the type says",
    "rule.symmetric": f"{_CT} _is_wNa16_group_channel requires symmetric; {_WNA16}.__init__ asserts it",
    "rule.strategy": f"{_WNA16}.create_weights 155: strategy 'channel' makes one scale per row, not [out, in/32]",
    "rule.actorder": f"{_WNA16}.create_weights 141: any actorder loads full-K w2 scales, which the ROCm Triton "
                     f"path does not shard",
    "rule.static": f"{_CT} _is_wNa16_group_channel: is_static = not weight_quant.dynamic",
    "rule.input-activations": f"{_CT}: ignores input_activations under pack-quantized, so they would not be served",
    "rule.names": f"{_CT} get_moe_scheme 882-898: asks the scheme of layer_name + '.0.gate_proj|up_proj|"
                  f"down_proj', ignored -> unquantized, mixed -> ValueError",
    "rule.packed": f"{_WNA16}.create_weights: int32 (E, in // 8, out) filled by copy_ (shape must match)",
    "rule.scale-dtype": f"{_WNA16}.create_weights: scales are params_dtype; copy_ casts anything else",
    "rule.scale-shape": f"{_WNA16}.create_weights 158-159: scale (E, in // group_size, out), filled by copy_",
    "rule.group-size": "k3convert's target; the scale shapes and TP sizes below assume 32",
    "rule.expert-names": "$V models/kimi_k3.py 3169-3172: FusedMoE.make_expert_params_mapping maps w1/w2/w3",
    "rule.expert-shapes": f"{_LAYER}._load_w13/_load_w2: one (E, ...) param per layer, narrow + copy_",
    "rule.hidden-group": f"{_WNA16}.create_weights 159: num_groups_w13 = hidden_size // group_size",
    "rule.tp-intermediate": f"{_LAYER} 427: assert intermediate_size % moe_tp_size == 0; {_WNA16} 158: "
                            f"num_groups_w2 = intermediate_size_per_partition // group_size",
    "split.tp": f"{_LAYER} 427 (the MoE's TP is the TP size: SGLang's DP and EP splits were not read)",
    "rule.config-sizes": "the server sizes (E, ...) params from config, then copy_ the tensors into them",
    "rule.memory": "not modelled: SGLang's memory split was not read",
    "rule.loader": "not modelled: SGLang's model loaders were not read",
    "kernel.sglang-rocm": f"{_CT} 919-923 -> CompressedTensorsWNA16TritonMoE, whose apply_weights asserts "
                          f"activation == 'silu' (compressed_tensors_wNa16_moe.py 558)",
    "kernel.sglang-cuda": f"{_CT} 924-951 -> CompressedTensorsWNA16MoE (Marlin; Triton on SM100 by default), "
                          f"whose apply_weights assert activation == 'silu' (compressed_tensors_wNa16_moe.py 454, 558)",
    "kernel.asserts-silu.sglang-rocm": "558",
    "kernel.asserts-silu.sglang-cuda": "454 (Marlin), 558 (Triton)",
    "situ.beta": "SGLang's SituAndMul needs it",
    "fused": "$V layers/moe/moe_runner/triton_utils/fused_moe.py",
    "clamp.bailing": "$V models/bailing_moe_v3.py 436-439, 469-478, 568-579 (BailingMoE: each layer's limit as "
                     "gemm1_clamp_limit)",
    "clamp.glm5": "$V models/glm5_next.py 102, 748-756 (Glm5NextMoE is DeepseekV2MoE), models/deepseek_v2.py 753-767 "
                  "(swiglu_limit)",
    "clamp.marlin-drops": "CompressedTensorsWNA16MoE.apply_weights passes fused_marlin_moe clamp_limit="
                          "moe_runner_config.swiglu_limit only ($V compressed_tensors_wNa16_moe.py 493), None here, "
                          "so fused_marlin_moe.py 356-361 is skipped and plain silu_and_mul runs (362-363)",
}

RELEASE = Release(Family.SGLANG, "0.5.23", CITES, wheel="sglang-0.5.23-py3-none-any.whl")
