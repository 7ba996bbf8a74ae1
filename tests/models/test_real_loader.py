"""The output loads and runs in a real client: transformers, decompressing through compressed-tensors.

A tiny random Mixtral (the same expert names as K3: ``block_sparse_moe.experts.E.w1/w2/w3``) is
saved with its experts packed to MXFP4 by compressed-tensors, converted by k3convert, and loaded
with ``AutoModelForCausalLM.from_pretrained(dst, dtype=bfloat16)``. transformers 5 fuses a
layer's experts in memory (``mlp.experts.gate_up_proj`` [E, 2I, H] = w1 rows then w3 rows,
``mlp.experts.down_proj`` [E, H, I] = w2), decompressing each expert's int4 tensors first.

Two checks, with different jobs:
* loading (exact): the loaded model's weights and logits equal those of the same model built from
  compressed-tensors' decode of DST's tensors. Any naming, fusing or decoding slip fails this.
* quantization (bounded): its logits are close to the MXFP4 model's. Each expert linear's output
  moves by about r = its relative weight RMSE (r <= 0.1, checked), an expert (w1, w3, w2) by about
  sqrt(3) r, and the errors of the L MoE layers add in quadrature through the residual stream,
  which dominates this model's logits (the experts have unit gain, the rest is small). So
  ||logits_int4 - logits_mxfp4|| / ||logits_mxfp4 - logits_no_experts|| ~ sqrt(3 L) r: 0.21
  predicted for L = 2, r = 0.087, and 0.21 to 0.25 measured over seeds 0-5. We allow
  2 sqrt(3 L) 0.1 = 0.49. Loader bugs (swapped nibbles, w1/w3 swapped, experts shifted by one)
  give 0.76 to 1.01, above the bound: the test checks that too.
"""
from __future__ import annotations

import copy
import logging
import math
import re
from dataclasses import dataclass

import pytest
import torch
import transformers
from mixtral_fixture import SIZES, tiny_mixtral, write_mxfp4_checkpoint
from safetensors.torch import load_file

from converter.run.options import Options
from converter.run.pipeline import convert
from tests.conftest import ct_int4_q, ct_mxfp4_values

LAYERS, EXPERTS = SIZES["num_hidden_layers"], SIZES["num_local_experts"]
TOKENS = torch.randint(0, SIZES["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))

# Relative RMSE of the int4 experts against the MXFP4 ones: about 0.096 is the conversion's optimum
# on heavy-tailed weights (docs/convert.md, "The requantization"); this model's 24 tensors give 0.087. Fixed, so that a broken
# conversion cannot widen the bound.
R_WEIGHTS = 0.1

Weights = dict[str, torch.Tensor]  # module (checkpoint name, without .weight) -> float64 [out, in]


@dataclass
class Mixtral:
    template: torch.nn.Module  # the bf16 model the checkpoint was made from
    src: str
    dst: str
    mxfp4: Weights             # compressed-tensors' decode of SRC's experts
    int4: Weights              # compressed-tensors' decode of DST's experts


def _module(L: int, e: int, w: str) -> str:
    return f"model.layers.{L}.block_sparse_moe.experts.{e}.{w}"


def _ct_decode(path: str) -> Weights:
    """Every packed module of a checkpoint, decoded by compressed-tensors (MXFP4 or int4)."""
    t = load_file(path)
    out = {}
    for name in t:
        if not name.endswith(".weight_packed"):
            continue
        m = name[: -len(".weight_packed")]
        packed, scale = t[name], t[f"{m}.weight_scale"]
        if packed.dtype == torch.uint8:
            out[m] = ct_mxfp4_values(packed, scale)
        else:
            q = ct_int4_q(packed, t[f"{m}.weight_shape"])
            out[m] = q.double() * scale.double().repeat_interleave(32, dim=1)
    return out


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Mixtral:
    root = tmp_path_factory.mktemp("mixtral")
    src, dst = str(root / "mxfp4"), str(root / "int4")
    template = tiny_mixtral(seed=0)
    write_mxfp4_checkpoint(template, src)
    convert(src, dst, Options())
    mx, i4 = _ct_decode(f"{src}/model.safetensors"), _ct_decode(f"{dst}/model.safetensors")
    assert sorted(mx) == sorted(i4) == sorted(_module(L, e, w) for L in range(LAYERS)
                                              for e in range(EXPERTS) for w in ("w1", "w2", "w3"))
    return Mixtral(template, src, dst, mx, i4)


def with_experts(template: torch.nn.Module, weights: Weights) -> torch.nn.Module:
    """A copy of ``template`` whose experts are ``weights``, fused the way transformers 5 keeps
    them (conversion_mapping.py "mixtral": gate_up_proj[e] = cat(w1, w3), down_proj[e] = w2)."""
    model = copy.deepcopy(template)
    with torch.no_grad():
        for L, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for e in range(EXPERTS):
                ex.gate_up_proj[e] = torch.cat([weights[_module(L, e, "w1")], weights[_module(L, e, "w3")]])
                ex.down_proj[e] = weights[_module(L, e, "w2")]
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.double()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load(path: str) -> tuple[torch.nn.Module, dict, list[str]]:
    """from_pretrained in bf16, as a user would; returns the model, its loading info and the
    warnings transformers logged while loading."""
    handler, log = _Records(), transformers.logging.get_logger("transformers")
    log.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, output_loading_info=True)
    finally:
        log.removeHandler(handler)
    return model.eval(), info, handler.messages


@pytest.fixture(scope="module")
def loaded(mixtral) -> tuple[torch.nn.Module, dict, list[str]]:
    return load(mixtral.dst)


def _rel_weight_rmse(a: Weights, b: Weights) -> float:
    """RMS over expert tensors of ||a - b|| / ||b||: the conversion's weight error r."""
    r2 = [float((a[m] - b[m]).norm() / b[m].norm()) ** 2 for m in b]
    return math.sqrt(sum(r2) / len(r2))


@dataclass
class Reference:
    logits: torch.Tensor   # the MXFP4 model's
    ablated: torch.Tensor  # the same model with every expert zeroed
    bound: float

    def error(self, got: torch.Tensor) -> float:
        """||got - L_mxfp4|| / ||L_mxfp4 - L_no_experts||: relative to what the experts contribute."""
        return float((got - self.logits).norm() / (self.logits - self.ablated).norm())


@pytest.fixture(scope="module")
def reference(mixtral) -> Reference:
    zero = {m: torch.zeros_like(w) for m, w in mixtral.mxfp4.items()}
    return Reference(logits(with_experts(mixtral.template, mixtral.mxfp4)),
                     logits(with_experts(mixtral.template, zero)),
                     bound=2 * math.sqrt(3 * LAYERS) * R_WEIGHTS)  # twice the expected error


def test_expert_weight_error_is_the_conversions(mixtral):
    """The bound's premise: DST's experts are MXFP4's to within r <= R_WEIGHTS, and not equal."""
    r = _rel_weight_rmse(mixtral.int4, mixtral.mxfp4)
    assert 0.05 < r <= R_WEIGHTS, r


def test_loads_without_missing_or_unexpected_keys(loaded):
    model, info, warnings = loaded
    assert isinstance(model, transformers.MixtralForCausalLM)
    assert model.config.quantization_config.quantization_config.format == "pack-quantized"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert warnings == [], warnings  # transformers 5.24 logs none; a LOAD REPORT would list bad keys


def test_loaded_experts_are_the_int4_weights(mixtral, loaded):
    """Not random init, not the MXFP4 values: exactly compressed-tensors' decode of DST, in bf16."""
    model = loaded[0]
    want = with_experts(mixtral.template, mixtral.int4)
    mx = with_experts(mixtral.template, mixtral.mxfp4)
    for L in range(LAYERS):
        for p in ("gate_up_proj", "down_proj"):
            got = getattr(model.model.layers[L].mlp.experts, p)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, getattr(want.model.layers[L].mlp.experts, p)), (L, p)
            assert not torch.equal(got, getattr(mx.model.layers[L].mlp.experts, p)), (L, p)
    for name, p in model.named_parameters():  # and everything else is the bf16 original
        if ".experts." not in name:
            assert torch.equal(p, mixtral.template.get_parameter(name)), name


def test_logits_equal_compressed_tensors_decode(mixtral, loaded):
    """Loading bugs, separated from quantization error: bit-identical logits."""
    assert torch.equal(logits(loaded[0]), logits(with_experts(mixtral.template, mixtral.int4)))


def test_transformers_loads_the_mxfp4_reference_identically(mixtral, reference):
    """The reference (compressed-tensors' decode of SRC) is also the MXFP4 model as transformers
    itself loads the source checkpoint, through compressed-tensors' MXFP4 decompression."""
    model, info, warnings = load(mixtral.src)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert warnings == [], warnings
    assert torch.equal(logits(model), reference.logits)


def test_logits_close_to_mxfp4_model(reference, loaded):
    err = reference.error(logits(loaded[0]))
    assert err <= reference.bound, f"logits error {err:.3f} above {reference.bound:.3f}"


def _swap_nibbles(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1, 2).flip(-1).reshape(w.shape)


def _rename(weights: Weights, fn) -> Weights:
    return {fn(m): w for m, w in weights.items()}


def _swap_gate_up(m: str) -> str:
    return re.sub(r"\.w[13]$", lambda g: ".w3" if g.group(0) == ".w1" else ".w1", m)


def _shift_experts(m: str) -> str:
    return re.sub(r"experts\.(\d+)", lambda g: f"experts.{(int(g.group(1)) + 1) % EXPERTS}", m)


WRONG = {
    "swapped nibbles": lambda w: {m: _swap_nibbles(t) for m, t in w.items()},
    "w1/w3 swapped": lambda w: _rename(w, _swap_gate_up),
    "experts shifted by one": lambda w: _rename(w, _shift_experts),
}


@pytest.mark.parametrize("bug", WRONG)
def test_bound_catches_loader_bugs(mixtral, reference, bug):
    """The bound is tight enough: a plausible misreading of DST's int4 weights fails it."""
    err = reference.error(logits(with_experts(mixtral.template, WRONG[bug](mixtral.int4))))
    assert err > reference.bound, f"{bug}: logits error {err:.3f} not above {reference.bound:.3f}"
