"""A tiny Ling-3.0-flash-fp4 checkpoint (bailing_moe_v3: FP8 config, MXFP4 routed experts), shaped as
vLLM 0.33.0 reads it.

No Ling checkpoint is read here (no hub): names, dtypes and config fields come from vLLM's code,
``model_executor/models/bailing_moe_v3.py``: checkpoint attention under ``model.layers.L.attention.``
(``hf_to_vllm_mapper`` 1415-1418 maps it to ``self_attn``), MLA without q-LoRA (``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``dense``; 483-580) on every layer
(``layer_group_size`` 1: ``_is_kda_layer`` 131-137 is false), dense ``mlp.{gate,up,down}_proj`` below
``first_k_dense_replace`` (1265), MoE ``mlp.gate`` (fp32 router) + ``mlp.gate.expert_bias`` (1169-1179),
``mlp.shared_experts.{gate,up,down}_proj`` and ``mlp.experts.E.{gate,up,down}_proj`` (1404-1411);
``word_embeddings``, ``norm``, ``lm_head``. The quant block is vLLM's Fp8Config
(``quant_method fp8``, ``weight_block_size [128, 128]``, ``activation_scheme dynamic``) with Ling's
``scale_fmt: ue8m0`` and ``routed_experts_quant_method: mxfp4`` (222-260): experts ``X.weight`` uint8
+ ``X.weight_scale_inv`` F8_E8M0 (remapped to ``weight_scale`` 263-281), packed here by
compressed-tensors (``conftest.ct_mxfp4_encode``); FP8 linears ``X.weight`` e4m3 + fp32
``X.weight_scale_inv`` rounded up to powers of two (what ``ue8m0`` promises; stored as fp32 as
DeepSeek-V3.1's ue8m0 checkpoints do). The expert clamp is per layer: ``expert_swiglu_limit_list``
(0 for the dense layer: no clamp, ``_get_layer_swiglu_limit`` 201-207).

KDA layers (``KDA_TEXT``: ``layer_group_size`` 2 makes layer 0 KDA, ``_is_kda_layer`` 131-137) hold
``attention.{q,k,v,b,f,g}_proj`` and ``o_proj`` (FP8 unless ``ignored`` names them: Ling's
``ignored_layers`` match as suffixes, bailing_moe_v3.py 236; such a module is bf16), the short
convolutions ``{q,k,v}_conv1d.weight`` fp32 ``[proj, 1, conv]``, ``A_log`` ``[heads]``, ``dt_bias``
``[proj]`` and ``o_norm.weight`` (640-770; ``no_kda_lora`` required, 662).
"""
from __future__ import annotations

import json
import os

import torch
from mimo_v2_fixture import fp8_block
from safetensors.torch import save_file

from tests.conftest import ct_mxfp4_encode, heavy_tailed

TEXT = dict(model_type="bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"], hidden_size=128,
            intermediate_size=256, moe_intermediate_size=64, moe_shared_expert_intermediate_size=128,
            num_shared_experts=1, num_hidden_layers=3, first_k_dense_replace=1, layer_group_size=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=128, kv_lora_rank=64, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128, num_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, routed_scaling_factor=2.5, score_function="sigmoid", hidden_act="silu",
            expert_swiglu_limit_list=[0, 7.0, 10.0], share_expert_swiglu_limit_list=[0, 7.0, 10.0],
            rms_norm_eps=1e-6, use_bias=False, use_qkv_bias=False, max_position_embeddings=256, vocab_size=256,
            rope_theta=600000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
         "scale_fmt": "ue8m0", "routed_experts_quant_method": "mxfp4", "ignored_layers": ["lm_head"]}
LIMITS = {1: 7.0, 2: 10.0}   # expert_swiglu_limit_list per MoE layer
KDA_TEXT = dict(layer_group_size=2, short_conv_kernel_size=4, no_kda_lora=True)   # layer 0 KDA, 1 and 2 MLA
B_IGNORED = ("attention.b_proj",)   # a source that keeps the KDA b_proj out of FP8 (the case of issue 35)


def is_kda(layer: int, t: dict) -> bool:
    """bailing_moe_v3.py 131-137."""
    g = t["layer_group_size"]
    return not ((layer + 1) % g == 0 or layer >= t["num_hidden_layers"] // g * g)


def fp8_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_block with each block's scale rounded up to a power of two (scale_fmt ue8m0)."""
    _, s = fp8_block(w)
    s = torch.exp2(torch.ceil(torch.log2(s)))
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def write(dst: str, seed: int = 0, mtp: bool = False, text: dict | None = None,
          ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The checkpoint in ``dst``; returns the bf16 experts it packed, by module. ``mtp``: one MTP layer
    (``num_nextn_predict_layers`` 1) at ``model.layers.3``, a MoE layer as bailing_moe_v3_mtp.py builds it
    (111, 162-173) with its own MXFP4 experts (the MTP's other tensors are left out: not read here).
    ``text``: config fields to change (the tensors follow them); ``ignored``: added to ignored_layers
    (the modules they name, as suffixes, are written bf16)."""
    t = {**TEXT, **(text or {})}
    torch.manual_seed(seed)
    os.makedirs(dst, exist_ok=True)
    h, e, inter = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    out: dict[str, torch.Tensor] = {"model.word_embeddings.weight": heavy_tailed(t["vocab_size"], h).bfloat16(),
                                    "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                                    "lm_head.weight": heavy_tailed(t["vocab_size"], h).bfloat16()}
    experts = {}

    def fp8(module: str, rows: int, cols: int) -> None:
        if any(module.endswith("." + i) for i in ignored):
            out[f"{module}.weight"] = heavy_tailed(rows, cols).bfloat16()
            return
        out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = fp8_ue8m0(heavy_tailed(rows, cols))

    heads = t["num_attention_heads"]

    def kda(a: str) -> None:
        proj, conv = heads * t["head_dim"], t["short_conv_kernel_size"]
        for name, rows, cols in (("q_proj", proj, h), ("k_proj", proj, h), ("v_proj", proj, h), ("b_proj", heads, h),
                                 ("f_proj", proj, h), ("g_proj", proj, h), ("o_proj", h, proj)):
            fp8(f"{a}.{name}", rows, cols)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            out[f"{a}.{name}.weight"] = heavy_tailed(proj, conv).reshape(proj, 1, conv)
        out[f"{a}.A_log"], out[f"{a}.dt_bias"] = torch.randn(heads), torch.randn(proj)
        out[f"{a}.o_norm.weight"] = torch.ones(t["head_dim"], dtype=torch.bfloat16)

    def mla(a: str) -> None:
        fp8(f"{a}.q_proj", heads * (t["qk_nope_head_dim"] + t["qk_rope_head_dim"]), h)
        fp8(f"{a}.kv_a_proj_with_mqa", t["kv_lora_rank"] + t["qk_rope_head_dim"], h)
        out[f"{a}.kv_a_layernorm.weight"] = torch.ones(t["kv_lora_rank"], dtype=torch.bfloat16)
        fp8(f"{a}.kv_b_proj", heads * (t["qk_nope_head_dim"] + t["v_head_dim"]), t["kv_lora_rank"])
        fp8(f"{a}.dense", h, heads * t["v_head_dim"])
        gate = {"head_wise": heads, "element_wise": heads * t["v_head_dim"]}.get(
            t.get("gated_attention_proj_granularity_type"))      # MLA output gate, 533-570
        if gate:
            fp8(f"{a}.g_proj", gate, h)

    for layer in range(t["num_hidden_layers"] + (1 if mtp else 0)):
        p = f"model.layers.{layer}"
        out[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        a = f"{p}.attention"
        if t["layer_group_size"] > 1 and layer < t["num_hidden_layers"] and is_kda(layer, t):
            kda(a)
        else:
            mla(a)
        if layer < t["first_k_dense_replace"]:
            d = t["intermediate_size"]
            fp8(f"{p}.mlp.gate_proj", d, h)
            fp8(f"{p}.mlp.up_proj", d, h)
            fp8(f"{p}.mlp.down_proj", h, d)
            continue
        out[f"{p}.mlp.gate.weight"] = heavy_tailed(e, h)                 # fp32 router (GateLinear params_dtype)
        out[f"{p}.mlp.gate.expert_bias"] = torch.zeros(e)
        s = t["moe_shared_expert_intermediate_size"] * t["num_shared_experts"]   # one MLP (1186-1198)
        fp8(f"{p}.mlp.shared_experts.gate_proj", s, h)
        fp8(f"{p}.mlp.shared_experts.up_proj", s, h)
        fp8(f"{p}.mlp.shared_experts.down_proj", h, s)
        for x in range(e):
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                m = f"{p}.mlp.experts.{x}.{proj}"
                experts[m] = heavy_tailed(*shape).bfloat16()
                packed, scale = ct_mxfp4_encode(experts[m].float())
                out[f"{m}.weight"], out[f"{m}.weight_scale_inv"] = packed, scale.view(torch.float8_e8m0fnu)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        quant = {**QUANT, "ignored_layers": QUANT["ignored_layers"] + list(ignored)}
        json.dump({**t, **({"num_nextn_predict_layers": 1} if mtp else {}), "quantization_config": quant},
                  f, indent=2)
    return experts
