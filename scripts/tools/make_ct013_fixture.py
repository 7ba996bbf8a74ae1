"""Write tests/support/data/ct013-mxfp4: a tiny MoE checkpoint packed by the real compressed-tensors 0.13.0.

Why: 0.13.0 stored MXFP4 E8M0 scales with bias 125 (two below OCP) and all-zero groups as 254
(docs/mxfp4_dialects.md). The converter must detect and correct that, and the only honest test
data is bytes that 0.13.0 itself wrote. Everything quantization-related below is done by the
library: scales (``calculate_qparams``, as llm-compressor's min-max observer calls it), the
ground truth (``fake_quantize``), packing (``ModelCompressor.compress_model``, the path
llm-compressor 0.9's ``save_pretrained`` takes) and the ``quantization_config``
(``ModelCompressor.update_config``). This script only draws the weights and saves the results.

Run with 0.13.0 importable, e.g.:
    pip install --no-deps --target /tmp/ct013 compressed_tensors-0.13.0-py3-none-any.whl
    PYTHONPATH=/tmp/ct013 python scripts/tools/make_ct013_fixture.py tests/support/data/ct013-mxfp4
"""
from __future__ import annotations

import json
import os
import sys

# 0.13.0 wraps pack_fp4_to_uint8 in torch.compile; eager gives the same bytes without a compiler.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import compressed_tensors  # noqa: E402
import torch  # noqa: E402
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

WANT_VERSION = "0.13.0"
MOE = "model.layers.1.block_sparse_moe"
HIDDEN, INTER, EXPERTS, ROWS = 64, 96, 2, 8  # in-dims: w1/w3 HIDDEN, w2 INTER (multiples of 32)
SHAPES = {"w1": (ROWS, HIDDEN), "w2": (ROWS, INTER), "w3": (ROWS, HIDDEN)}
IGNORE = [r"re:.*block_sparse_moe\.gate$"]  # the router stays bf16, as in llm-compressor recipes
ZERO_GROUP = ("experts.1.w2", 3, 1)  # (module, row, group) left all-zero
CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
          "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 2,
          "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 128, "torch_dtype": "bfloat16"}


def _set(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """Register ``module`` at dotted ``path``, creating empty parents, so names match Mixtral's."""
    *parents, leaf = path.split(".")
    for p in parents:
        if not hasattr(root, p):
            root.add_module(p, torch.nn.Module())
        root = getattr(root, p)
    root.add_module(leaf, module)


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    return lin


def _weight(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Heavy-tailed bf16 (Student-t, 3 dof) with a per-row magnitude spread of 2^-10 .. 2^2, so the
    stored exponents cover a range and some group maxima round up (mantissa >= 1.75)."""
    normal = torch.randn(rows, cols, generator=gen)
    chi2 = torch.randn(rows, cols, 3, generator=gen).pow(2).sum(-1)
    t = normal / (chi2 / 3).sqrt()
    row_scale = 2.0 ** torch.linspace(-10, 2, rows).unsqueeze(1)
    return (t * row_scale * 0.05).to(torch.bfloat16)


def build_model(seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for e in range(EXPERTS):
        for w, (rows, cols) in SHAPES.items():
            weight = _weight(gen, rows, cols)
            if f"experts.{e}.{w}" == ZERO_GROUP[0]:
                _, r, g = ZERO_GROUP
                weight[r, 32 * g: 32 * (g + 1)] = 0
            _set(model, f"{MOE}.experts.{e}.{w}", _linear(weight))
    _set(model, f"{MOE}.gate", _linear(_weight(gen, EXPERTS, HIDDEN)))
    return model


def calibrate(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Set every quantized module's weight_scale/zero_point the way llm-compressor's min-max
    observer does (group min/max -> the library's calculate_qparams); return the library's
    fake-quantized weights (float32) keyed by tensor name."""
    expected = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, w = scheme.weights, module.weight.data
        groups = w.reshape(w.shape[0], -1, args.group_size)
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype)
        expected[f"{name}.weight"] = fake_quantize(w, module.weight_scale, module.weight_zero_point,
                                                   args).to(torch.float32)
    return expected


def main(dst: str) -> None:
    if compressed_tensors.__version__ != WANT_VERSION:
        sys.exit(f"{compressed_tensors.__file__}: compressed-tensors {compressed_tensors.__version__} "
                 f"is imported; this fixture must be written by {WANT_VERSION}")
    os.makedirs(dst, exist_ok=True)
    model = build_model()
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["MXFP4A16"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE))
    expected = calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_file(expected, os.path.join(dst, "expected.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    compressor.update_config(dst)  # adds quantization_config, exactly as the library writes it
    for k, v in sorted(state.items()):
        print(f"{k:55s} {str(v.dtype):15s} {tuple(v.shape)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_ct013_fixture.py OUTPUT_DIR")
    main(sys.argv[1])
