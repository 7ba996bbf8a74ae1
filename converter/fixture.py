"""A small Kimi-K3-shaped MXFP4 checkpoint, for the demo, the tests and the benchmarks.

Same names, nested config, shard index and side files as the published model; sizes are
options (``real_dims`` gives the real expert shapes). Shards are cut by size, as Hugging Face
writers cut them, so a module's packed tensor and its scale often sit in different shards.
Every shard is written at once, one tensor (pair) in memory at a time.
"""
from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .errors import BadInput, OutputError
from .formats import mxfp4
from .formats.checkpoint import INDEX
from .formats.safetensors_io import Layout, OutTensor, ShardWriter
from .safepath import new_folder

Encoder = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
PREFIX = "language_model.model"
IGNORE = [
    "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
    r"re:.*block_sparse_moe\.gate\..*", "re:.*routed_expert_(up|down)_proj.*",
]


ARCHITECTURES = {"kimi_k3": "KimiK3ForConditionalGeneration", "kimi_k31": "KimiK31ForConditionalGeneration"}
# Kimi K3.1's text_config.dsa_config, as vLLM 0.34's KimiLinearDSAConfig reads it (docs/models.md)
K31_DSA = {"index_topk": 2048, "index_head_dim": 64, "index_num_heads": 16, "index_rope_dim": 0,
           "index_k_norm_type": "rmsnorm", "indexer_use_fp8": False, "index_topk_freq": 1,
           "index_skip_topk_offset": 1}


class Draw(enum.Enum):
    """How the expert weights are made; both give Student-t weights' MXFP4 codes and scales."""
    WEIGHTS = "weights"  # draw each weight, encode each tensor: the bytes the tests were written against
    GROUPS = "groups"    # encode one pool of Student-t groups, sample groups (and signs) from it: 12-19x faster


POOL_GROUPS = 1 << 16  # groups of 32 in the pool: 2M weights, histograms to ~0.5%, one draw per fixture


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
    model_type: str = "kimi_k3"  # or "kimi_k31": Kimi K3.1's config (its DSA block), the same experts
    draw: Draw = Draw.WEIGHTS

    @classmethod
    def real_dims(cls, **kw) -> "FixtureSpec":
        return cls(**{"hidden": 1024, "inter": 3072, "latent": 3584, "draw": Draw.GROUPS, **kw})

    @classmethod
    def demo(cls, **kw) -> "FixtureSpec":
        """The smallest shape whose conversion passes the launch README teaches (vllm-rocm-plugin,
        TP 8 + EP): 2048 intermediate, 256 per rank at TP 8 (vLLM's KimiMoE pads less to 256 and
        cannot build it), hidden and latent multiples of 128 (the plugin's kernel); 1 expert a rank."""
        return cls(**{"inter": 2048, "draw": Draw.GROUPS, **kw})


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
    if spec.model_type == "kimi_k31":   # every MoE layer's attention sparse (1-based layer numbers)
        text["dsa_config"] = {**K31_DSA, "dsa_layers": list(range(2, spec.layers + 1))}
    return {"model_type": spec.model_type, "architectures": [ARCHITECTURES[spec.model_type]],
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
        if spec.model_type == "kimi_k31" and layer > 0:   # the DSA indexer of K3.1's sparse layers
            for name, shape in (("wq_b", (64, h)), ("wk", (64, h)), ("weights_proj", (16, h)), ("k_norm", (1, 64))):
                yield f"{p}.self_attn.indexer.{name}.weight", shape, "bf16"
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
    out: list[int] = []
    seen = total // (4 * spec.shards)  # cuts a little early: not on a layer boundary
    for t, e in zip(tensors, expert):
        glued = spec.keep_modules and t.name.endswith(".weight_scale")  # stays with its packed tensor
        out.append(out[-1] if glued else min(spec.shards - 1, seen * spec.shards // total))
        seen += t.nbytes if e else 0
    if sorted(set(out)) != list(range(spec.shards)):
        raise BadInput(f"{spec.shards} shards do not fit these tensor sizes: some shard would be empty")
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
    ``progress`` is told the bytes of each tensor written (``Draw.WEIGHTS`` at real dims: minutes on a CPU).
    """
    new_folder(dst, "make-fixture writes only into a new or empty directory")  # never over a checkpoint (T5)
    try:
        return _write(dst, spec, encoder, device, progress)
    except OSError as e:  # a full disk or TMPDIR (demo): one line, exit 4, not a traceback (T14)
        raise OutputError(f"cannot write the fixture: {e.strerror}", file=e.filename or dst) from None


def _write(dst: str, spec: FixtureSpec, encoder: Encoder, device: str,
           progress: Callable[[int], None] | None) -> list[str]:
    gen = torch.Generator(device).manual_seed(spec.seed)
    pool = _Pool(gen, encoder) if spec.draw is Draw.GROUPS else None
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
                data = (pool.bf16(rows, cols) if pool else _student_t(gen, rows, cols).to(torch.bfloat16)
                        ).view(torch.uint8)
            elif name in scales:
                data = scales.pop(name)
            else:  # the first of the pair to be written draws the weight and encodes both
                packed, scale = pool.experts(rows, cols) if pool else encoder(_student_t(gen, rows, cols) * 0.02)
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
    e1, e2 = (torch.empty(rows, cols, device=dev).exponential_(0.5, generator=gen) for _ in range(2))
    chi2 = e1 + e2
    return torch.randn(rows, cols, generator=gen, device=dev) / torch.sqrt(chi2 / 4)


class _Pool:
    """Draw.GROUPS: MXFP4 groups of Student-t weights, encoded once, sampled per tensor.

    A tensor of independent Student-t weights is a sequence of independent groups of 32, so
    sampling encoded groups, each weight's sign at random (the distribution is symmetric), gives
    the code and scale histograms of encoding the tensor, at the cost of a gather: Draw.WEIGHTS
    spends ~2.4 s per real-dims expert tensor on a CPU drawing and encoding. The bf16 tensors
    (copied by the converter, never quantized) are sampled from a pool of Student-t values too.
    """

    def __init__(self, gen: torch.Generator, encoder: Encoder) -> None:
        self.gen = gen
        packed, scales = encoder(_student_t(gen, POOL_GROUPS, 32) * 0.02)  # [P, 16], [P, 1]
        self.packed = packed.to(gen.device).contiguous().view(torch.int64)  # [P, 2]: a group is two words
        self.scales = scales.to(gen.device)
        self.values = _student_t(gen, 1, 1 << 16).to(torch.bfloat16).reshape(-1)

    def _words(self, n: int) -> torch.Tensor:
        """``n`` random int64 words, every bit fair (the cheapest random bytes torch draws)."""
        return torch.empty(n, dtype=torch.int64, device=self.gen.device).random_(-2 ** 63, None, generator=self.gen)

    def experts(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = rows * cols // 32
        pick = torch.randint(POOL_GROUPS, (n,), generator=self.gen, device=self.gen.device)
        signs = self._words(2 * n).view(n, 2) & _SIGN_BITS
        packed = (self.packed[pick] ^ signs).view(torch.uint8).reshape(rows, cols // 2)
        return packed, self.scales[pick].reshape(rows, cols // 32)

    def bf16(self, rows: int, cols: int) -> torch.Tensor:
        n = rows * cols
        pick = self._words((n + 3) // 4).view(torch.int16)[:n].long() & 0xFFFF  # four 16-bit picks a word
        return self.values[pick].reshape(rows, cols)


_SIGN_BITS = int.from_bytes(b"\x88" * 8, "little", signed=True)  # E2M1's sign bit, in each of a word's 16 codes
