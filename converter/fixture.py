"""A small Kimi-K3-shaped MXFP4 checkpoint, for the demo, the tests and the benchmarks.

Same names, nested config, shard index and side files as the published model; sizes are
options (``real_dims`` gives the real expert shapes). Written shard by shard, one tensor
in memory at a time.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .formats import mxfp4
from .formats.checkpoint import INDEX
from .formats.safetensors_io import Layout, OutTensor, ShardWriter

Encoder = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
PREFIX = "language_model.model"
IGNORE = [
    "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
    r"re:.*block_sparse_moe\.gate\..*", "re:.*routed_expert_(up|down)_proj.*",
]


@dataclass(frozen=True)
class FixtureSpec:
    layers: int = 4            # layer 0 dense, the rest MoE
    experts: int = 8
    hidden: int = 256
    inter: int = 192           # moe_intermediate_size (real: 3072)
    latent: int = 128          # routed_expert_hidden_size (real: 3584)
    shards: int = 3
    vocab: int = 512
    seed: int = 0

    @classmethod
    def real_dims(cls, **kw) -> "FixtureSpec":
        return cls(**{"hidden": 1024, "inter": 3072, "latent": 3584, **kw})


def config(spec: FixtureSpec) -> dict:
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": True, "dynamic": False, "scale_dtype": "uint8"},
            "input_activations": None, "output_activations": None}},
        "ignore": IGNORE,
    }
    text = {
        "model_type": "kimi_linear", "num_hidden_layers": spec.layers, "first_k_dense_replace": 1,
        "hidden_size": spec.hidden, "num_experts": spec.experts, "num_experts_per_token": 2,
        "num_shared_experts": 1, "moe_intermediate_size": spec.inter,
        "routed_expert_hidden_size": spec.latent, "vocab_size": spec.vocab,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "quantization_config": quant,
    }
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text, "torch_dtype": "bfloat16"}


def _tensors(spec: FixtureSpec) -> Iterator[tuple[int, str, tuple[int, int], str]]:
    """(shard, name, shape, kind) for every tensor; kind is 'bf16' or 'mxfp4'."""
    h, lat, inter = spec.hidden, spec.latent, spec.inter
    yield 0, f"{PREFIX}.embed_tokens.weight", (spec.vocab, h), "bf16"
    yield 0, "vision_tower.patch_embed.proj.weight", (h, 64), "bf16"
    for layer in range(spec.layers):
        shard = layer * spec.shards // spec.layers  # every shard gets at least one layer
        p = f"{PREFIX}.layers.{layer}"
        yield shard, f"{p}.input_layernorm.weight", (1, h), "bf16"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield shard, f"{p}.self_attn.{proj}.weight", (h, h), "bf16"
        if layer == 0:
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                yield shard, f"{p}.mlp.{proj}.weight", shape, "bf16"
            continue
        m = f"{p}.block_sparse_moe"
        yield shard, f"{m}.gate.weight", (spec.experts, h), "bf16"
        yield shard, f"{m}.routed_expert_down_proj.weight", (lat, h), "bf16"
        yield shard, f"{m}.routed_expert_up_proj.weight", (h, lat), "bf16"
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            yield shard, f"{m}.shared_experts.{proj}.weight", shape, "bf16"
        for e in range(spec.experts):
            for w, shape in (("w1", (inter, lat)), ("w2", (lat, inter)), ("w3", (inter, lat))):
                yield shard, f"{m}.experts.{e}.{w}", shape, "mxfp4"
    yield spec.shards - 1, f"{PREFIX}.norm.weight", (1, h), "bf16"
    yield spec.shards - 1, "language_model.lm_head.weight", (spec.vocab, h), "bf16"


SIDE_FILES = {
    "generation_config.json": json.dumps({"max_new_tokens": 64, "temperature": 0.6}, indent=2),
    "tokenizer_config.json": json.dumps({"model_max_length": 262144, "tokenizer_class": "TikTokenTokenizer"}),
    "chat_template.jinja": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n",
    "modeling_kimi_k3.py": '"""Remote code placeholder: copied byte-identical by k3convert."""\n',
}


def make_fixture(dst: str, spec: FixtureSpec = FixtureSpec(), encoder: Encoder = mxfp4.encode,
                 device: str = "cpu") -> list[str]:
    """Write the checkpoint into ``dst`` (created). Returns the shard file names.

    ``device="cuda"`` draws and encodes the weights on a GPU: tens of GB in a minute.
    """
    if not 1 <= spec.shards <= spec.layers:
        raise ValueError(f"shards ({spec.shards}) must be between 1 and layers ({spec.layers})")
    os.makedirs(dst, exist_ok=True)
    gen = torch.Generator(device).manual_seed(spec.seed)
    plan: dict[int, list[tuple[str, tuple[int, int], str]]] = {}
    for shard, name, shape, kind in _tensors(spec):
        plan.setdefault(shard, []).append((name, shape, kind))
    names = [f"model-{i + 1:05d}-of-{spec.shards:05d}.safetensors" for i in range(spec.shards)]
    weight_map, total = {}, 0
    for shard, items in sorted(plan.items()):
        outs = []
        for name, (rows, cols), kind in items:
            if kind == "bf16":
                outs.append(OutTensor(name, "BF16", (rows, cols)))
            else:
                outs += [OutTensor(f"{name}.weight_packed", "U8", (rows, cols // 2)),
                         OutTensor(f"{name}.weight_scale", "U8", (rows, cols // 32))]
        writer = ShardWriter(os.path.join(dst, names[shard]), Layout(outs, {"format": "pt"}))
        try:
            for name, (rows, cols), kind in items:
                w = _student_t(gen, rows, cols)
                if kind == "bf16":
                    writer.write(name, w.to(torch.bfloat16).view(torch.uint8).cpu().numpy())
                    continue
                packed, scale = encoder(w * 0.02)
                writer.write(f"{name}.weight_packed", packed.cpu().numpy())
                writer.write(f"{name}.weight_scale", scale.cpu().numpy())
            writer.close()
        except BaseException:
            writer.abort()
            raise
        weight_map.update({t.name: names[shard] for t in outs})
        total += sum(t.nbytes for t in outs)
    with open(os.path.join(dst, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config(spec), f, indent=2)
    for fname, text in SIDE_FILES.items():
        with open(os.path.join(dst, fname), "w") as f:
            f.write(text)
    return names


def _student_t(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Heavy-tailed weights like a trained model's: Student-t with 4 degrees of freedom,
    normal / sqrt(chi2_4 / 4), where chi2_4 is the sum of two exponentials of mean 2."""
    dev = gen.device
    chi2 = sum(torch.empty(rows, cols, device=dev).exponential_(0.5, generator=gen) for _ in range(2))
    return torch.randn(rows, cols, generator=gen, device=dev) / torch.sqrt(chi2 / 4)
