"""A tiny MiniMax-M3 MXFP4 checkpoint, shaped as vLLM 0.33.0's loader expects it.

No MiniMax-M3 checkpoint is read here (no hub): names, dtypes and the config fields come from
vLLM's own code (``models/minimax_m3/amd/model.py``: ``block_sparse_moe.experts.E.w1|w2|w3``
mapped as gate/down/up at 1581-1591, ``FusedMoEFactory(activation="swigluoai_uninterleave",
swiglu_alpha/beta/limit=config...)`` at 454-479, dense layers under ``mlp``, the language model
under ``language_model.``; ``transformers_utils/configs/minimax_m3.py``: ``model_type
minimax_m3_vl`` with ``text_config``, whose ``swiglu_beta`` the real config omits). Experts are
packed by compressed-tensors (``conftest.ct_mxfp4_encode``) and its ``ModelCompressor`` writes
the ``quantization_config``; everything else is bf16, and the router and its score-correction
bias fp32, as vLLM builds them.
"""
from __future__ import annotations

import json
import os

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import save_file

from tests.conftest import MXFP4_SCHEME, ct_mxfp4_encode, heavy_tailed, mxfp4_unless_excluded

PREFIX = "language_model.model.layers"
# layer 0 dense, layers 1 and 2 MoE (moe_layer_freq), as the real model's first layers are dense
TEXT = dict(model_type="minimax_m3_text", hidden_size=64, intermediate_size=96, dense_intermediate_size=128,
            shared_intermediate_size=96, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_layer_freq=[0, 1, 1],
            hidden_act="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0, scoring_func="sigmoid",
            use_routing_bias=True, routed_scaling_factor=2.0, vocab_size=128, torch_dtype="bfloat16")
IGNORE = ["re:.*self_attn.*", r"re:.*block_sparse_moe\.gate$", "re:.*shared_experts.*", r"re:.*\.mlp\..*",
          "re:.*lm_head.*", "re:.*vision_tower.*"]


def _t(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return heavy_tailed(*shape).to(dtype)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, bf16 experts included (packed by :func:`write`)."""
    torch.manual_seed(seed)
    h, inter, e = TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["num_local_experts"]
    qkv = TEXT["num_attention_heads"] * TEXT["head_dim"], TEXT["num_key_value_heads"] * TEXT["head_dim"]
    out = {"language_model.model.embed_tokens.weight": _t(TEXT["vocab_size"], h),
           "language_model.model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
           "language_model.lm_head.weight": _t(TEXT["vocab_size"], h)}
    for layer, moe in enumerate(TEXT["moe_layer_freq"]):
        p = f"{PREFIX}.{layer}"
        out[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name, rows in (("q_proj", qkv[0]), ("k_proj", qkv[1]), ("v_proj", qkv[1])):
            out[f"{p}.self_attn.{name}.weight"] = _t(rows, h)
        out[f"{p}.self_attn.o_proj.weight"] = _t(h, qkv[0])
        if not moe:
            d = TEXT["dense_intermediate_size"]
            out[f"{p}.mlp.gate_proj.weight"], out[f"{p}.mlp.up_proj.weight"] = _t(d, h), _t(d, h)
            out[f"{p}.mlp.down_proj.weight"] = _t(h, d)
            continue
        m = f"{p}.block_sparse_moe"
        out[f"{m}.gate.weight"] = _t(e, h, dtype=torch.float32)
        out[f"{m}.e_score_correction_bias"] = torch.zeros(e, dtype=torch.float32)
        s = TEXT["shared_intermediate_size"]
        out[f"{m}.shared_experts.gate_proj.weight"] = _t(s, h)
        out[f"{m}.shared_experts.up_proj.weight"] = _t(s, h)
        out[f"{m}.shared_experts.down_proj.weight"] = _t(h, s)
        for x in range(e):
            out[f"{m}.experts.{x}.w1.weight"] = _t(inter, h)     # gate
            out[f"{m}.experts.{x}.w3.weight"] = _t(inter, h)     # up
            out[f"{m}.experts.{x}.w2.weight"] = _t(h, inter)     # down
    return out


def is_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name and name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))


def write(dst: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The compressed-tensors MXFP4 checkpoint in ``dst``; returns the bf16 experts it packed."""
    os.makedirs(dst, exist_ok=True)
    out, experts = {}, {}
    for name, t in tensors(seed).items():
        if not is_expert(name):
            out[name] = t
            continue
        module = name[: -len(".weight")]
        experts[module] = t
        out[f"{module}.weight_packed"], out[f"{module}.weight_scale"] = ct_mxfp4_encode(t.float())
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
              "text_config": dict(TEXT), "torch_dtype": "bfloat16"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    qc = QuantizationConfig(config_groups={"group_0": MXFP4_SCHEME}, format="mxfp4-pack-quantized",
                            quantization_status="compressed", ignore=IGNORE)
    ModelCompressor(quantization_config=qc).update_config(dst)
    return experts


# Quark's exclude (fnmatch) for what MiniMax-M3 keeps in bf16, the checkpoint's names
QUARK_EXCLUDE = ["*lm_head", "*self_attn*", "*block_sparse_moe.gate", "*shared_experts*", "*.mlp.*", "*vision_tower*"]


def write_quark(dst: str, quark_block: dict, seed: int = 0) -> None:
    """The same checkpoint as an AMD Quark MXFP4 export: ``X.weight`` + ``X.weight_scale`` (the bytes
    of compressed-tensors' packing, which docs/quark.md shows Quark's packer writes too) and
    ``quark_block``, a ``quantization_config`` written by amd-quark's exporter, its ``exclude`` set
    to MiniMax-M3's bf16 modules."""
    from safetensors.torch import load_file
    write(dst, seed)
    path = os.path.join(dst, "model.safetensors")
    tensors = {n.replace(".weight_packed", ".weight"): t for n, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**quark_block, "exclude": list(QUARK_EXCLUDE)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_quark_template(dst: str, scheme: str = "mxfp4", seed: int = 0) -> list[str]:
    """The checkpoint as amd-quark 0.13's file-to-file export with its ``minimax_m3_vl`` template as
    shipped (config from amd-quark itself): every Linear the template does not exclude is MXFP4, the
    shared experts and dense MLPs included. Returns those non-expert modules, sorted."""
    from quark.torch.quantization.config.template import LLMTemplate
    from safetensors.torch import load_file

    cfg = LLMTemplate.get("minimax_m3_vl").get_config(scheme=scheme)
    write_quark(dst, cfg.to_dict(), seed)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["exclude"] = sorted(cfg.exclude)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    linears = mxfp4_unless_excluded(t, cfg.exclude)
    save_file(t, path, metadata={"format": "pt"})
    return linears


# What a user passes auto-round as --ignore_layers to keep MiniMax-M3's non-expert linears in bf16
AUTO_ROUND_IGNORE = ("self_attn", "shared_experts", ".mlp.", "vision_tower")


def write_auto_round(dst: str, seed: int = 0, version: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint as auto-round 0.16's model-free MXFP4 export writes it (auto_round/compressors/
    model_free.py, utils/model_free_utils.py, read from the 0.16.1 wheel):

    - ``quantization_config`` at top level (nested ones removed, model_free.py 1569-1578) and again in
      ``quantization_config.json`` (1580-1581): compressed-tensors' ``QuantizationConfig`` of the
      ``MXFP4`` preset on ``targets ["Linear"]`` (W4A4: MXFP4 dynamic input activations), status
      compressed, ``format mxfp4-pack-quantized``, ``provider: "auto-round"`` (model_free_utils.py
      2744-2752, 2586-2589), ``version`` = the compressed-tensors that wrote the JSON (``version``
      overrides it); ``ignore`` = every 2-D ``.weight`` left unquantized, by exact name (2689-2693;
      the router by auto-round's predefined skips, the rest by --ignore_layers, 1355-1368);
    - tensors ``X.weight_packed`` uint8 (low nibble first, qlinear_fp.py 234-275, adapted from
      compressed-tensors) + ``X.weight_scale`` uint8 = shared exponent + 127 (qlinear_fp.py 44, 170),
      the bytes compressed-tensors' packer writes, so packed here by it; everything else as in the source;
    - shards keep the source's names, ``save_file`` with no metadata (2532-2561), index
      ``{"metadata": {"total_size": 0}, "weight_map"}`` with indent 2 (2564-2578).
    """
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    os.makedirs(dst, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    experts, ignore = {}, []
    for name, t in tensors(seed).items():
        s = 1 if name.startswith(f"{PREFIX}.2.") or name.startswith("language_model.lm_head") else 0
        if is_expert(name):
            module = name[: -len(".weight")]
            experts[module] = t
            shards[s][f"{module}.weight_packed"], shards[s][f"{module}.weight_scale"] = ct_mxfp4_encode(t.float())
            continue
        shards[s][name] = t
        if name.endswith(".weight") and t.dim() == 2:   # embeddings too (predefined skip "embed", 48)
            ignore.append(name[: -len(".weight")])
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for shard, part in zip(names, shards):
        save_file(part, os.path.join(dst, shard))
        weight_map.update({t: shard for t in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)
    block = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("MXFP4", ["Linear"])},
                               quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore).to_dict()
    block["format"] = "mxfp4-pack-quantized"
    block["provider"] = "auto-round"
    if version is not None:
        block["version"] = version
    config = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
              "text_config": dict(TEXT), "torch_dtype": "bfloat16", "quantization_config": block}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(dst, "quantization_config.json"), "w") as f:
        json.dump(block, f, indent=2)
    return experts
