"""Tiny AMD Quark MXFP4 checkpoints made by amd-quark itself, and Quark's own decoders.

Issue 10 §3: the Quark reader is tested on exports written by the `amd-quark` package (0.13),
never on files we lay out ourselves, and reference values come from Quark's code, not ours.
docs/quark.md records what these exports contain and why.

The model is a seeded random Qwen3-MoE (transformers 5 maps its checkpoint names
`mlp.experts.E.{gate,up,down}_proj.weight` natively, which Mixtral's loader does not), bf16,
2 layers x 4 experts; expert weights are [96, 64] (gate/up) and [64, 96] (down), attention
q/o [64, 64] and k/v [32, 64]: every in-dim a multiple of 32, out != in so transposes show.
Known float rows are planted in KNOWN_MODULE before quantization (nibble order, -0, all-zero
groups, ties, saturation, the 2^-127 scale clamp), see known_rows().

Importing `quark.torch` costs 30-80 s on this 2-core machine (it AST-scans every transformers
modeling file); each export then takes 1-5 s. Exports are cached per process: a second call
with the same (variant, seed) copies the first one. If amd-quark is not installed, every
function here makes the calling test skip (pytest.importorskip).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch

QUARK_MIN_VERSION = "0.13"
MODEL_TYPE = "qwen3_moe"
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=64, tie_word_embeddings=False,
)
KNOWN_MODULE = "model.layers.0.mlp.experts.0.gate_proj"

# Arguments of quark's LLMTemplate.get("qwen3_moe").get_config(...) per variant. The template's
# default exclude is ["lm_head", "*.gate"] (router); attention q/k/v/o are MXFP4 unless excluded.
VARIANTS: dict[str, dict[str, Any]] = {
    # MXFP4 weights only, experts and attention alike (the plain source to convert)
    "w4a16": {"scheme": "mxfp4_weight_only"},
    # MXFP4 experts only: attention stays bf16 and is listed in `exclude`
    "experts_only": {"scheme": "mxfp4_weight_only", "exclude_layers": ["lm_head", "*.gate", "*self_attn*"]},
    # (a) W4A4: MXFP4 weights + dynamic MXFP4 input activations (config only, no extra tensors)
    "w4a4": {"scheme": "mxfp4"},
    # (b) MXFP4 weights + static per-tensor FP8 inputs: X.input_scale bf16 [] per Linear
    "w4a8_fp8": {"scheme": "mxfp4_fp8"},
    # (c) FP8 KV cache: self_attn.{k,v}_proj.output_scale bf16 [], kv_cache_quant_config
    "kv_fp8": {"scheme": "mxfp4_weight_only", "kv_cache_scheme": "fp8"},
    # FP8 attention (softmax_quant_spec): self_attn.q_proj.output_scale bf16 []
    "attn_fp8": {"scheme": "mxfp4_weight_only", "attention_scheme": "fp8"},
    # (d) layer_quant_config overrides: attention FP8 (weight F8_E4M3 + weight_scale + input_scale),
    # layer 1 expert 3 int4 group 32 (int32-packed weight, transposed scale, zero point),
    # every expert 0 down_proj excluded (bf16)
    "mixed": {
        "scheme": "mxfp4_weight_only",
        "layer_config": {"*self_attn*": "fp8", "model.layers.1.mlp.experts.3.*": "int4_wo_32"},
        "exclude_layers": ["lm_head", "*.gate", "*.experts.0.down_proj"],
    },
}

_EXPORTS: dict[tuple[str, int, bool], str] = {}
_CACHE_ROOT: list[str] = []


def _quark() -> Any:
    """Import amd-quark (skipping the test if absent), torch.compile off: same bytes, no 20-80 s compile."""
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    quark = pytest.importorskip("quark", minversion=QUARK_MIN_VERSION,
                                reason=f"amd-quark>={QUARK_MIN_VERSION} is not installed")
    import quark.torch  # noqa: F401  (the slow part)
    return quark


def known_rows(subnormal: bool = False) -> torch.Tensor:
    """float32 [6, 64]: the rows planted in KNOWN_MODULE's first 6 rows before quantization.

    Row 0: g0 = every FP4 value and its negative (-0 included), ties (0.25, 0.75, ..., 5), values
    that round to -0 (-0.1, -0.25), 5.9 -> 6 (scale byte 127); g1 all zero (Quark writes byte 1).
    Row 1: g0 all -0.0 (byte 1, codes 0); g1 one 6 and -0.1 elsewhere (codes 0, not 8).
    Row 2: row 0's g0 x 2^-20 (byte 107) and x 2 (amax 12, byte 128).
    Row 3: amax 7 = 1.75 * 4 rounds up to scale 2 (byte 128), both groups.
    Row 4: g0 x 2^-110 (byte 17); with ``subnormal``, x 2^-127: quantized with scale 2^-127 but
    written as byte 1 (2^-126), so it decodes to twice the source, and its best int4 scale is below
    bf16's normal range (k3convert refuses such a tensor); g1 x 2^100 (byte 227).
    Row 5: -8..7 twice per group (amax 8, byte 128).
    """
    base = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6,
                         .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.1, -.25, .1, -5, -2.5, -.75, 5.9, -0., 0])
    w = torch.zeros(6, 64)
    w[0, :32] = base
    w[1, :32] = -0.0
    w[1, 32:] = -0.1
    w[1, 32] = 6.0
    w[2, :32], w[2, 32:] = base * 2.0 ** -20, base * 2.0
    w[3, :32], w[3, 32:] = base, base
    w[3, 7], w[3, 39] = 7.0, 7.0
    w[4, :32], w[4, 32:] = base * 2.0 ** (-127 if subnormal else -110), base * 2.0 ** 100
    w[5] = torch.arange(64) % 16 - 8.0
    return w


def _write_source(path: str, seed: int) -> None:
    """The bf16 source checkpoint, saved by transformers (per-expert names on disk)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_CONFIG)).to(torch.bfloat16).eval()
    model.save_pretrained(path)


def _plant_known_rows(model: torch.nn.Module, subnormal: bool) -> None:
    layer, _, _, expert, proj = KNOWN_MODULE.split(".")[2:]
    linear = getattr(getattr(model.model.layers[int(layer)].mlp.experts, expert), proj)
    rows = known_rows(subnormal)
    with torch.no_grad():
        linear.weight[: len(rows)] = rows.to(linear.weight.dtype)


def _cache_dir() -> str:
    if not _CACHE_ROOT:
        _CACHE_ROOT.append(tempfile.mkdtemp(prefix="quark-exports-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT[0], True)
    return _CACHE_ROOT[0]


def _quantize_and_export(dst: str, variant: str, seed: int, subnormal: bool) -> None:
    """Quark's documented LLM flow (quark-cli torch-llm-ptq): preprocess, quantize, freeze, export."""
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        _write_source(src, seed)
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
        preprocess_for_quantization(model)  # fused Qwen3MoeExperts -> per-expert nn.Linear
        _plant_known_rows(model, subnormal)
        config = LLMTemplate.get(MODEL_TYPE).get_config(**VARIANTS[variant])
        quantizer = ModelQuantizer(config)
        gen = torch.Generator().manual_seed(seed)
        calib = [torch.randint(0, TINY_CONFIG["vocab_size"], (1, 16), generator=gen) for _ in range(2)]
        model = quantizer.freeze(quantizer.quantize_model(model, calib))
        with torch.no_grad():
            export_safetensors(model, dst, custom_mode="quark", weight_format="real_quantized",
                               pack_method="reorder")


def export_quark_mxfp4(dst: str, *, variant: str = "w4a16", seed: int = 0, subnormal: bool = False) -> str:
    """Write a Quark MXFP4 export of the tiny Qwen3-MoE to ``dst`` (must not exist); returns dst.

    ``subnormal`` plants known_rows' 2^-127 group (see there)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {sorted(VARIANTS)}")
    _quark()
    cached = _EXPORTS.get((variant, seed, subnormal))
    if cached is None:
        cached = os.path.join(_cache_dir(), f"{variant}-{seed}{'-subnormal' if subnormal else ''}")
        _quantize_and_export(cached, variant, seed, subnormal)
        _EXPORTS[(variant, seed, subnormal)] = cached
    shutil.copytree(cached, dst)
    return dst


def quark_dequantize(packed: torch.Tensor, scale: torch.Tensor,
                     weight_spec: dict | None = None) -> torch.Tensor:
    """MXFP4 (uint8 [out, in/2], E8M0 uint8 [out, in/32]) -> float32 [out, in] by Quark's own code.

    The same path Quark's importer uses for a QParamsLinear weight: StaticScaledRealQuantizer
    (Pack_fp4.unpack, scale 2^(byte-127), quark.torch.kernel.dequantize). ``weight_spec`` is the
    `weight` dict of the export's quantization_config (default: Quark's OCP MXFP4 spec).
    """
    _quark()
    from quark.torch.export.nn.modules.realquantizer import get_real_quantizer
    from quark.torch.quantization.config.config import OCP_MXFP4Spec, QTensorConfig

    spec = (QTensorConfig.from_dict(weight_spec) if weight_spec is not None
            else OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec())
    rq = get_real_quantizer(qspec=spec, quantizer=None, reorder=True, real_quantized=True,
                            float_dtype=torch.float32, device=packed.device, scale_shape=tuple(scale.shape))
    rq.scale = scale  # the uint8 E8M0 bytes, as Quark's importer loads them
    with torch.no_grad():
        return rq(packed)


def load_reference_model(path: str) -> torch.nn.Module:
    """The Quark export as a runnable model (MXFP4 emulated on CPU), loaded by Quark's importer.

    transformers 5.24 cannot load it itself (its Quark integration only swaps nn.Linear, and the
    fused Qwen3MoeExperts get the uint8 tensors: size mismatch). Quark's
    import_model_from_safetensors(None, ...) needs accelerate, so the skeleton is built here:
    from_config, then Quark's preprocess_for_quantization(reload=True) to unfuse the experts.
    Weights are dequantized on each forward, activation specs (W4A4, FP8 inputs) are emulated.
    """
    _quark()
    from quark.torch import import_model_from_safetensors
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config  # a plain float skeleton; Quark reads the config from path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    preprocess_for_quantization(model, reload=True)
    return import_model_from_safetensors(model, path).eval()
