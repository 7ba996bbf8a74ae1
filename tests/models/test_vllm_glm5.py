"""vLLM's own GLM-5.3-Flash class (``models/glm5next``: ``Glm5NextForConditionalGeneration``), built on
the CPU from our converted Quark export's config (the glm5_next template as amd-quark ships it: MXFP4
shared experts, which we write as exact bf16) by ``tests/support/vllm_scripts/moe_model_quant_methods.py``:
the routed experts get ``CompressedTensorsWNA16MoEMethod`` and ask the int4 backend oracle for silu
with the text config's swiglu_limit 10.0 (FusedMoE's swiglu_limit, model.py 277, 325; the WNA16 method
hands it to the kernel config as gemm1_clamp_limit, compressed_tensors_moe_wna16.py 497-509; TRITON
applies it, triton_moe.py 219-225) and uint4b8 group-32 symmetric weights (TRITON on gfx942 in
converter/servers/'s model of the oracle); KDA and MLA attention, dense and shared-expert MLPs,
router, vision tower and head stay unquantized. The one stand-in: the CPU has no sparse MLA, so the
MLA layer is built as vLLM's full-MLA variant (index_topk None, model.py 712-722); the MoE does not
read it. Needs K3CONVERT_VLLM_PYTHON (skips without it, fails under K3CONVERT_REQUIRE_VLLM=1).
"""
from __future__ import annotations

import re

import glm5_fixture as glm
import pytest

from tests.vllm_plugin.test_vllm_quant_methods import MOE_INT4, UNQUANTIZED, model_methods

LOOKUP = re.compile(r"^language_model\.model\.layers\.[12]\.mlp\.experts\.0\.(gate|up|down)_proj$")


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    return model_methods(tmp_path_factory, "glm5", lambda d: glm.write(d, shared_experts_mxfp4=True))[0]


def test_experts_int4_asking_for_silu_with_the_limit(case):
    assert "error" not in case, case.get("error")
    assert case["class"] == "Glm5NextForConditionalGeneration"
    experts = {n: m["method"] for n, m in case["modules"].items() if m["module"] == "RoutedExperts"}
    assert len(experts) == 2 and set(experts.values()) == {MOE_INT4}, experts
    assert len(case["oracle_asked"]) == 2
    for a in case["oracle_asked"]:
        assert a["activation"] == "silu" and a["swiglu_limit"] == 10.0 and not a["zero_points"]
        assert "uint4b8" in a["weight_key"] and "col=32" in a["weight_key"]


def test_nothing_else_quantized(case):
    others = {n: m["method"] for n, m in case["modules"].items() if m["module"] != "RoutedExperts"}
    assert any(n.startswith("visual.") for n in others)
    shared = {n: m for n, m in others.items() if "shared_experts" in n}
    assert shared and set(shared.values()) <= UNQUANTIZED, shared   # the template's MXFP4 shared experts: bf16
    assert any("in_proj_qkvbfg_a" in n for n in others) and any("kv_b_proj" in n for n in others)
    quantized = {n: m for n, m in others.items() if m not in UNQUANTIZED and not m.endswith("KVCacheMethod")}
    assert not quantized, quantized
    selected = {n for n, ok in case["lookups"].items() if ok}
    assert len(selected) == 6 and all(LOOKUP.match(n) for n in selected), selected
