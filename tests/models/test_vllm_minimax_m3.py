"""vLLM's own MiniMax-M3 ROCm classes (``vllm.models.minimax_m3.amd``), built on the CPU from our
output's config by ``tests/support/vllm_scripts/moe_model_quant_methods.py``: the routed experts get
``CompressedTensorsWNA16MoEMethod`` and ask the int4 backend oracle for swigluoai_uninterleave with
MiniMax's alpha 1.702, beta 1.0 (vLLM's default: the config omits it), limit 7.0 and uint4b8
group-32 symmetric weights (TRITON on gfx942 in converter/servers/'s model of the oracle);
every other module (attention, dense and shared-expert MLPs, router, vision tower, head) stays
unquantized, as in the source (for amd-quark's template export, whose shared experts and dense MLPs
are MXFP4, as the exact bf16 we write). vLLM asked the experts' scheme under gate/up/down_proj only.
Needs K3CONVERT_VLLM_PYTHON (skips without it, fails under K3CONVERT_REQUIRE_VLLM=1).
"""
from __future__ import annotations

import re

import minimax_m3_fixture as mm3
import pytest

from tests.vllm_plugin.test_vllm_quant_methods import MOE_INT4, UNQUANTIZED, model_methods

LOOKUP = re.compile(r"^language_model\.model\.layers\.\d+\.block_sparse_moe\.experts\.0\.(gate|up|down)_proj$")


# the compressed-tensors build, and amd-quark's minimax_m3_vl template as shipped (shared experts and
# dense MLPs MXFP4 too, written as exact bf16): vLLM must see the same unquantized rest in both
WRITERS = {"ct": mm3.write, "quark-template": lambda d: mm3.write_quark_template(d, scheme="mxfp4_weight_only")}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def case(request, tmp_path_factory) -> dict:
    return model_methods(tmp_path_factory, "minimax_m3", WRITERS[request.param])[0]


def test_experts_int4_asking_for_swigluoai_uninterleave(case):
    assert "error" not in case, case.get("error")
    assert case["class"] == "MiniMaxM3SparseForConditionalGeneration"
    experts = {n: m["method"] for n, m in case["modules"].items() if m["module"] == "RoutedExperts"}
    assert len(experts) == 2 and set(experts.values()) == {MOE_INT4}, experts
    assert len(case["oracle_asked"]) == 2
    for a in case["oracle_asked"]:
        assert a["activation"] == "swigluoai_uninterleave"
        assert (a["swiglu_alpha"], a["swiglu_beta"], a["swiglu_limit"]) == (1.702, 1.0, 7.0)
        assert "uint4b8" in a["weight_key"] and "col=32" in a["weight_key"] and not a["zero_points"]


def test_nothing_else_quantized(case):
    others = {n: m["method"] for n, m in case["modules"].items() if m["module"] != "RoutedExperts"}
    assert any("vision_tower" in n for n in others) and any("shared_experts" in n for n in others)
    quantized = {n: m for n, m in others.items() if m not in UNQUANTIZED and not m.endswith("KVCacheMethod")}
    assert not quantized, quantized
    selected = {n for n, ok in case["lookups"].items() if ok}
    assert len(selected) == 6 and all(LOOKUP.match(n) for n in selected), selected
