"""A small Kimi-K3-shaped MXFP4 checkpoint, for the demo, the tests and the benchmarks.

Same names, nested config, shard index and side files as the published model; sizes are
options (``real_dims`` gives the real expert shapes). Shards are cut by size, as Hugging Face
writers cut them, so a module's packed tensor and its scale often sit in different shards.
Every shard is written at once, one tensor (pair) in memory at a time.
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
    shards: int = 3            # cut by size, as Hugging Face writers cut: modules straddle shards
    vocab: int = 512
    seed: int = 0
    keep_modules: bool = False  # cut only between modules (each packed tensor beside its scale)

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


def _tensors(spec: FixtureSpec) -> Iterator[tuple[str, tuple[int, int], str]]:
    """(name, shape, kind) for every tensor, in file order; kind is 'bf16', 'packed' or 'scale'.

    Within an MoE layer the experts' packed tensors and their scales are written in two runs,
    packed first in even layers and scales first in odd ones (``keep_modules``: each scale
    right after its packed tensor), so a cut inside a layer separates pairs, in either order
    and across more than one shard when a layer is larger than a shard.
    """
    h, lat, inter = spec.hidden, spec.latent, spec.inter
    yield f"{PREFIX}.embed_tokens.weight", (spec.vocab, h), "bf16"
    yield "vision_tower.patch_embed.proj.weight", (h, 64), "bf16"
    for layer in range(spec.layers):
        p = f"{PREFIX}.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (1, h), "bf16"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{p}.self_attn.{proj}.weight", (h, h), "bf16"
        if layer == 0:
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                yield f"{p}.mlp.{proj}.weight", shape, "bf16"
            continue
        m = f"{p}.block_sparse_moe"
        yield f"{m}.gate.weight", (spec.experts, h), "bf16"
        yield f"{m}.routed_expert_down_proj.weight", (lat, h), "bf16"
        yield f"{m}.routed_expert_up_proj.weight", (h, lat), "bf16"
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            yield f"{m}.shared_experts.{proj}.weight", shape, "bf16"
        experts = [(f"{m}.experts.{e}.{w}", shape) for e in range(spec.experts)
                   for w, shape in (("w1", (inter, lat)), ("w2", (lat, inter)), ("w3", (inter, lat)))]
        if spec.keep_modules:
            for name, shape in experts:
                yield name, shape, "packed"
                yield name, shape, "scale"
        else:
            runs = ("packed", "scale") if layer % 2 == 0 else ("scale", "packed")
            for kind in runs:
                for name, shape in experts:
                    yield name, shape, kind
    yield f"{PREFIX}.norm.weight", (1, h), "bf16"
    yield "language_model.lm_head.weight", (spec.vocab, h), "bf16"


def _out_tensor(name: str, shape: tuple[int, int], kind: str) -> OutTensor:
    rows, cols = shape
    if kind == "packed":
        return OutTensor(f"{name}.weight_packed", "U8", (rows, cols // 2))
    if kind == "scale":
        return OutTensor(f"{name}.weight_scale", "U8", (rows, cols // 32))
    return OutTensor(name, "BF16", shape)


def _shard_of(tensors: list[OutTensor], spec: FixtureSpec) -> list[int]:
    """Each tensor's shard: ``spec.shards`` parts of equal expert bytes.

    The cuts fall between two expert tensors, so with the run layout of ``_tensors`` every cut
    separates pairs (real writers cut by size too, where a cut inside a pair is rare per cut but
    close to certain over 96 shards); ``keep_modules`` keeps each scale with its packed tensor.
    """
    expert = [t.dtype == "U8" for t in tensors]
    total = sum(t.nbytes for t, e in zip(tensors, expert) if e)
    out, seen = [], total // (4 * spec.shards)  # cuts a little early: not on a layer boundary
    for t, e in zip(tensors, expert):
        glued = spec.keep_modules and t.name.endswith(".weight_scale")  # stays with its packed tensor
        out.append(out[-1] if glued else min(spec.shards - 1, seen * spec.shards // total))
        seen += t.nbytes if e else 0
    if sorted(set(out)) != list(range(spec.shards)):
        raise ValueError(f"{spec.shards} shards do not fit these tensor sizes: some shard would be empty")
    return out


SIDE_FILES = {
    "generation_config.json": json.dumps({"max_new_tokens": 64, "temperature": 0.6}, indent=2),
    "tokenizer_config.json": json.dumps({"model_max_length": 262144, "tokenizer_class": "TikTokenTokenizer"}),
    "chat_template.jinja": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n",
    "modeling_kimi_k3.py": '"""Remote code placeholder: copied byte-identical by k3convert."""\n',
}


def fixture_bytes(spec: FixtureSpec) -> int:
    """The bytes of tensor data ``make_fixture`` writes (what its progress counts to)."""
    return sum(_out_tensor(*e).nbytes for e in _tensors(spec))


def make_fixture(dst: str, spec: FixtureSpec = FixtureSpec(), encoder: Encoder = mxfp4.encode,
                 device: str = "cpu", progress: Callable[[int], None] | None = None) -> list[str]:
    """Write the checkpoint into ``dst`` (created). Returns the shard file names.

    ``device="cuda"`` draws and encodes the weights on a GPU: tens of GB in a minute.
    ``progress`` is told the bytes of each tensor written (a real-dims fixture takes minutes on a CPU).
    """
    os.makedirs(dst, exist_ok=True)
    gen = torch.Generator(device).manual_seed(spec.seed)
    entries = list(_tensors(spec))
    outs = [_out_tensor(*e) for e in entries]
    shard_of = _shard_of(outs, spec)
    names = [f"model-{i + 1:05d}-of-{spec.shards:05d}.safetensors" for i in range(spec.shards)]
    writers = [ShardWriter(os.path.join(dst, n), Layout([t for t, s in zip(outs, shard_of) if s == i],
                                                        {"format": "pt"})) for i, n in enumerate(names)]
    scales: dict[str, torch.Tensor] = {}  # a scale drawn with its packed tensor, written in its turn
    try:
        for (name, (rows, cols), kind), out, shard in zip(entries, outs, shard_of):
            if kind == "bf16":
                data = _student_t(gen, rows, cols).to(torch.bfloat16).view(torch.uint8)
            elif name in scales:
                data = scales.pop(name)
            else:  # the first of the pair to be written draws the weight and encodes both
                packed, scale = encoder(_student_t(gen, rows, cols) * 0.02)
                data, scales[name] = (packed, scale) if kind == "packed" else (scale, packed)
            writers[shard].write(out.name, data.cpu().numpy())
            if progress:
                progress(out.nbytes)
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    weight_map = {t.name: names[s] for t, s in zip(outs, shard_of)}
    with open(os.path.join(dst, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in outs)},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
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
