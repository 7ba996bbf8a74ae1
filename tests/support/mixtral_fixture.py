"""A tiny MXFP4 Mixtral checkpoint, for loading k3convert's output in a real client (transformers).

Mixtral's checkpoint names are K3's (``block_sparse_moe.experts.E.w1/w2/w3``), and transformers
knows the architecture, so it can load and run the converted output. The checkpoint is made the
way compressed-tensors' ``mxfp4-pack-quantized`` format writes one: transformers' own
``save_pretrained`` gives the tensor names (it un-fuses its in-memory expert tensors), the
experts are packed by compressed-tensors (``conftest.ct_mxfp4_encode``) and compressed-tensors'
``ModelCompressor.update_config`` writes the ``quantization_config``. Everything else stays bf16.
"""
from __future__ import annotations

import json
import math
import os
import tempfile

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from tests.conftest import MXFP4_SCHEME, ct_mxfp4_encode

# Every expert in-dim (hidden 64 for w1/w3, intermediate 96 for w2) is a multiple of 32.
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
             max_position_embeddings=64, tie_word_embeddings=False)
# What llm-compressor leaves out of a Mixtral MXFP4 recipe: the router (both its checkpoint
# name and transformers 5's in-memory name), attention and the head.
IGNORE = ["lm_head", "re:.*self_attn.*", r"re:.*block_sparse_moe\.gate.*", r"re:.*mlp\.gate$"]
EXPERT_SUFFIXES = (".w1.weight", ".w2.weight", ".w3.weight")


def is_expert_weight(name: str) -> bool:
    """A routed expert's dense weight in the checkpoint's (un-fused) naming."""
    return ".block_sparse_moe.experts." in name and name.endswith(EXPERT_SUFFIXES)


def tiny_mixtral(seed: int = 0, **sizes) -> MixtralForCausalLM:
    """A random bf16 Mixtral whose output is dominated by its experts (``sizes`` override SIZES)."""
    return tiny_moe(MixtralConfig(**{**SIZES, **sizes}), seed)


def tiny_moe(config, seed: int = 0) -> torch.nn.Module:
    """A random bf16 MoE model (any transformers 5 architecture whose layers hold fused
    ``mlp.experts.gate_up_proj``/``down_proj``) whose output is dominated by its experts.

    transformers' init (normal, std 0.02) would make the experts' contribution to the residual
    stream tiny, so a broken expert would barely move the logits. The experts get heavy-tailed
    weights like a trained model's (Student-t, 4 degrees of freedom) scaled by 1/sqrt(in), so an
    expert has about unit gain.
    """
    with torch.random.fork_rng(devices=[]):  # seeded, without touching other tests' RNG state
        torch.manual_seed(seed)
        # from_config, like from_pretrained, keeps the rotary buffers float32 (``.to(bf16)`` would not)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        t = torch.distributions.StudentT(4.0)
        for layer in model.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                with torch.no_grad():
                    p.copy_(t.sample(p.shape) / math.sqrt(p.shape[-1]))
    return model


def write_mxfp4_checkpoint(model: torch.nn.Module, dst: str, is_expert=is_expert_weight,
                           ignore: list[str] = IGNORE) -> None:
    """Save ``model`` to ``dst`` with every routed expert (``is_expert(name)``) packed to MXFP4 by
    compressed-tensors, ``ignore`` being the recipe's ignore list."""
    os.makedirs(dst, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            config = json.load(f)
        tensors = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(tmp, name)))
    out = {}
    for name, t in tensors.items():
        if not is_expert(name):
            out[name] = t
            continue
        module = name[: -len(".weight")]
        out[f"{module}.weight_packed"], out[f"{module}.weight_scale"] = ct_mxfp4_encode(t.float())
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    qc = QuantizationConfig(config_groups={"group_0": MXFP4_SCHEME}, format="mxfp4-pack-quantized",
                            quantization_status="compressed", ignore=ignore)
    ModelCompressor(quantization_config=qc).update_config(dst)
