"""A tiny MiMo-V2 FP4 checkpoint (FP8 config, MXFP4 routed experts), shaped as vLLM 0.33.0 reads it.

No MiMo checkpoint is read here (no hub): names, dtypes and config fields come from vLLM's code.
``model_executor/models/mimo_v2.py``: ``model.layers.L.self_attn.{q,k,v,o}_proj``, dense
``mlp.{gate,up,down}_proj`` where ``moe_layer_freq`` is 0, MoE ``mlp.gate`` (fp32 router) +
``mlp.gate.e_score_correction_bias`` + ``mlp.experts.E.{gate,up,down}_proj`` (854-864);
``hybrid_layer_pattern`` picks the sliding-window attention (``swa_*`` fields).
``model_executor/layers/quantization/fp8.py``: ``quant_method fp8``, ``activation_scheme dynamic``,
``weight_block_size [128, 128]``, ``store_dtype mxfp4`` (164-204); FP8 linears are ``X.weight``
e4m3 + ``X.weight_scale_inv`` fp32, one per 128x128 block (a dequantization multiplier); experts
``X.weight`` uint8 + ``X.weight_scale`` E8M0, packed here by compressed-tensors
(``conftest.ct_mxfp4_encode``). The FP8 bytes only pass through: they are made by a plain
amax/448 block rule.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tests.conftest import ct_mxfp4_encode, heavy_tailed

BLOCK = 128
TEXT = dict(model_type="mimo_v2_flash", architectures=["MiMoV2FlashForCausalLM"], hidden_size=128,
            intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, head_dim=128, v_head_dim=128, swa_num_attention_heads=2,
            swa_num_key_value_heads=2, swa_head_dim=128, swa_v_head_dim=128, sliding_window_size=64,
            hybrid_layer_pattern=[0, 1, 0], moe_layer_freq=[0, 1, 1], n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, norm_topk_prob=True, hidden_act="silu", layernorm_epsilon=1e-5,
            attention_bias=False, max_position_embeddings=256, vocab_size=256, rope_theta=5000000.0,
            partial_rotary_factor=0.334, tie_word_embeddings=False, torch_dtype="bfloat16")
QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
         "store_dtype": "mxfp4", "mxfp4_block_size": 32, "ignored_layers": ["lm_head"]}


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (e4m3 [out, in], fp32 scale_inv [ceil(out/128), ceil(in/128)]): w ~ q * s."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    s = torch.empty(br, bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s[i, j] = blk.abs().amax().clamp(min=1e-12) / 448.0
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


# MiMo-V2.6-Flash(-RL)'s additions as vLLM 0.33.0 reads them (no V2.6 checkpoint is read here): attention
# sinks on the sliding-window layers (mimo_v2.py 314-316, 418-420: ``self_attn.attention_sink_bias``
# [heads] fp32), a value scale and the SWA rope theta (402-422), and one MTP layer under
# ``model.mtp.layers.0`` (mimo_v2_mtp.py 8-18: enorm, hnorm, eh_proj, attention, pre_mlp_layernorm,
# a dense MLP, final_layernorm), which the main model's loader skips (mimo_v2.py 895) and whose
# o_proj vLLM builds unquantized (299); the many-shard layout cuts shards in the middle of experts
# (a weight in one file, its scale in the next).
# MiMo-V2-Flash's attention shape at TP 8 (64 heads of 192 for q/k and 128 for v, 4 KV heads; here 8 heads):
# q 192 rows a rank and one replicated KV head of 192 are not whole 128-blocks, so vLLM's compressed-tensors
# FP8 scheme refuses the qkv_proj at TP 8 (issue 35 §2); the MLPs split into whole blocks and int4 groups
FLASH_TP8 = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=192, v_head_dim=128,
                 swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=192, swa_v_head_dim=128,
                 intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=8)
V26 = dict(add_swa_attention_sink_bias=True, attention_value_scale=0.707, swa_rope_theta=10000.0,
           num_nextn_predict_layers=1)


def write(dst: str, seed: int = 0, v26: bool = False, shards: int = 1, text: dict | None = None,
          originals: dict | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint in ``dst``; returns the float experts it packed, by module. ``v26``: MiMo-V2.6's
    additions (V26); ``shards``: cut the tensors, in file order, into that many files with an index;
    ``text``: config fields to change (the tensors follow them); ``originals``: filled with each FP8
    linear's float weight before FP8 (to measure FP8's own error)."""
    t = {**TEXT, **(text or {})}
    torch.manual_seed(seed)
    os.makedirs(dst, exist_ok=True)
    h, e, inter = t["hidden_size"], t["n_routed_experts"], t["moe_intermediate_size"]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": heavy_tailed(t["vocab_size"], h).bfloat16(),
                                    "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                                    "lm_head.weight": heavy_tailed(t["vocab_size"], h).bfloat16()}
    experts = {}

    def fp8(module: str, rows: int, cols: int) -> None:
        w = heavy_tailed(rows, cols)
        if originals is not None:
            originals[module] = w
        out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = fp8_block(w)

    for layer, moe in enumerate(t["moe_layer_freq"]):
        p = f"model.layers.{layer}"
        out[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        n, kv, hd, vd = (t[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim"))
        for name, rows in (("q_proj", n * hd), ("k_proj", kv * hd), ("v_proj", kv * vd)):   # mimo_v2.py 284-301
            fp8(f"{p}.self_attn.{name}", rows, h)
        fp8(f"{p}.self_attn.o_proj", h, n * vd)
        if v26 and t["hybrid_layer_pattern"][layer]:
            out[f"{p}.self_attn.attention_sink_bias"] = torch.zeros(t["swa_num_attention_heads"])
        if not moe:
            d = t["intermediate_size"]
            fp8(f"{p}.mlp.gate_proj", d, h)
            fp8(f"{p}.mlp.up_proj", d, h)
            fp8(f"{p}.mlp.down_proj", h, d)
            continue
        out[f"{p}.mlp.gate.weight"] = heavy_tailed(e, h)                                  # fp32 router (moe_router_dtype)
        out[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(e)
        for x in range(e):
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                m = f"{p}.mlp.experts.{x}.{proj}"
                experts[m] = heavy_tailed(*shape).bfloat16()
                out[f"{m}.weight"], out[f"{m}.weight_scale"] = ct_mxfp4_encode(experts[m].float())
    if v26:
        m = "model.mtp.layers.0"
        for norm in ("enorm", "hnorm", "input_layernorm", "pre_mlp_layernorm", "final_layernorm"):
            out[f"{m}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        fp8(f"{m}.eh_proj", h, 2 * h)
        heads = t["swa_num_attention_heads"] * t["swa_head_dim"]
        for name in ("q_proj", "k_proj", "v_proj"):
            fp8(f"{m}.self_attn.{name}", heads, h)
        out[f"{m}.self_attn.o_proj.weight"] = heavy_tailed(h, heads).bfloat16()    # unquantized (mimo_v2.py 299)
        out[f"{m}.self_attn.attention_sink_bias"] = torch.zeros(t["swa_num_attention_heads"])
        d = t["intermediate_size"]
        fp8(f"{m}.mlp.gate_proj", d, h)
        fp8(f"{m}.mlp.up_proj", d, h)
        fp8(f"{m}.mlp.down_proj", h, d)
    _save(dst, out, shards)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**t, **(V26 if v26 else {}), "quantization_config": dict(QUANT)}, f, indent=2)
    return experts


def _save(dst: str, out: dict[str, torch.Tensor], shards: int) -> None:
    """One model.safetensors, or ``shards`` files of about equal tensor count in insertion order (so a
    module's weight and scale can land in different files) and the index."""
    if shards == 1:
        save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(out)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: out[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, os.path.join(dst, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in out.values())},
                   "weight_map": weight_map}, f, indent=2)
