"""A tiny GLM-5.3-Flash MXFP4 checkpoint as amd-quark 0.13's file-to-file exporter writes it.

Names and config fields from vLLM 0.33.0 (``models/glm5next/common/model.py``: the language model
under ``model.language_model.`` (inherited Glm4v mapper, 1171-1176), MoE where
``text_config.mlp_layer_types`` says "sparse" (416-431), router ``mlp.gate`` + ``e_score_correction_bias``
(236-249), ``mlp.shared_experts.{gate,up,down}_proj``, ``mlp.experts.E.{gate,up,down}_proj`` (895-901),
silu with ``swiglu_limit``), transformers 5.24's ``glm5_next`` / ``glm5_next_text`` defaults for the
rest. The layout is amd-quark 0.13's (``torch/quantization/file2file_quantization.py``): shards keep the
source's file names, written by ``save_file`` with no metadata (1794-1795); the index is
``{"metadata": {"total_size"}, "weight_map"}`` with indent 4 (2235-2243); config.json gets the
QConfig's ``to_dict()`` at top level, any nested quantization_config removed, the ``export`` block
and ``exclude`` sorted (2284-2302); FP8 originals are dequantized to bf16 where excluded (default
``keep_excluded_layers_as_original_model_state=False``, 1126-1200). The quantization config is made
by amd-quark's own ``LLMTemplate.get("glm5_next").get_config(scheme)``, whose exclude list leaves the
shared experts MXFP4; ``shared_experts_mxfp4=False`` adds ``*shared_experts*`` to it (what
``--exclude_layers`` would). MXFP4 bytes are packed by compressed-tensors (the same bytes as Quark's
packer, docs/quark.md).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import ct_mxfp4_encode, heavy_tailed

PREFIX = "model.language_model"
TEXT = dict(model_type="glm5_next_text", hidden_size=64, intermediate_size=128, moe_intermediate_size=96,
            num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu",
            swiglu_limit=10.0, vocab_size=128, num_attention_heads=2, rms_norm_eps=1e-5)
EXPORT = {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder", "weight_format": "real_quantized",
          "weight_merge_groups": None}   # file2file_quantization.py 2289-2295


@lru_cache(maxsize=None)
def quark_block(scheme: str = "mxfp4", extra_exclude: tuple[str, ...] = ()) -> str:
    """amd-quark 0.13's quantization_config for glm5_next (JSON), as _export_quant_config writes it."""
    pytest.importorskip("quark")
    from quark.torch.quantization.config.template import LLMTemplate
    cfg = LLMTemplate.get("glm5_next").get_config(scheme=scheme)
    cfg.exclude = list(cfg.exclude) + list(extra_exclude)
    block = cfg.to_dict()
    block["export"] = dict(EXPORT)
    block["exclude"] = sorted(cfg.exclude)
    return json.dumps(block)


def write(dst: str, seed: int = 0, scheme: str = "mxfp4_weight_only", shared_experts_mxfp4: bool = False
          ) -> dict[str, torch.Tensor]:
    """The export in ``dst`` (two shards); returns the float matrices it packed, by module."""
    torch.manual_seed(seed)
    os.makedirs(dst, exist_ok=True)
    h, e, inter = TEXT["hidden_size"], TEXT["n_routed_experts"], TEXT["moe_intermediate_size"]
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    packed: dict[str, torch.Tensor] = {}

    def bf16(shard: int, name: str, *shape: int) -> None:
        shards[shard][name] = heavy_tailed(*shape).bfloat16()

    def mxfp4(shard: int, module: str, rows: int, cols: int) -> None:
        packed[module] = heavy_tailed(rows, cols)
        shards[shard][f"{module}.weight"], shards[shard][f"{module}.weight_scale"] = ct_mxfp4_encode(packed[module])

    bf16(0, f"{PREFIX}.embed_tokens.weight", TEXT["vocab_size"], h)
    bf16(0, "model.visual.patch_embed.proj.weight", h, 3 * 14 * 14)
    shards[0][f"{PREFIX}.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for layer, kind in enumerate(TEXT["mlp_layer_types"]):
        s, p = (0 if layer < 2 else 1), f"{PREFIX}.layers.{layer}"
        shards[s][f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        shards[s][f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name, rows in (("q_proj", 64), ("k_proj", 64), ("v_proj", 64)):   # excluded *self_attn*: bf16
            bf16(s, f"{p}.self_attn.{name}.weight", rows, h)
        bf16(s, f"{p}.self_attn.o_proj.weight", h, 64)
        if kind == "dense":
            d = TEXT["intermediate_size"]
            bf16(s, f"{p}.mlp.gate_proj.weight", d, h)
            bf16(s, f"{p}.mlp.up_proj.weight", d, h)
            bf16(s, f"{p}.mlp.down_proj.weight", h, d)
            continue
        shards[s][f"{p}.mlp.gate.weight"] = heavy_tailed(e, h)            # router, fp32 as the source's
        shards[s][f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(e)
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shared = f"{p}.mlp.shared_experts.{proj}"
            if shared_experts_mxfp4:
                mxfp4(s, shared, *shape)
            else:
                bf16(s, f"{shared}.weight", *shape)
            for x in range(e):
                mxfp4(s, f"{p}.mlp.experts.{x}.{proj}", *shape)
    shards[1]["lm_head.weight"] = heavy_tailed(TEXT["vocab_size"], h).bfloat16()
    names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map = {}
    for name, tensors in zip(names, shards):
        save_file(tensors, os.path.join(dst, name))                     # no metadata, as Quark's save_file
        weight_map.update({t: name for t in tensors})
    total = sum(os.path.getsize(os.path.join(dst, n)) for n in names)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, ensure_ascii=False, indent=4)
    extra = () if shared_experts_mxfp4 else ("*shared_experts*",)
    config = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"],
              "text_config": dict(TEXT), "vision_config": {"model_type": "glm5_next_vision"},
              "torch_dtype": "bfloat16", "quantization_config": json.loads(quark_block(scheme, extra))}
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=4)
    return packed
