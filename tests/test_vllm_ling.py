"""vLLM's own Ling class (``model_executor/models/bailing_moe_v3.py`` ``BailingMoeV3ForCausalLM``), built
on the CPU from our output's config by ``tests/vllm_scripts/moe_model_quant_methods.py``: the routed
experts get ``CompressedTensorsWNA16MoEMethod`` and ask the int4 backend oracle for silu with each
layer's clamp from ``expert_swiglu_limit_list`` (7.0 and 10.0: vLLM passes it as FusedMoE's
swiglu_limit, 1180-1209, which the WNA16 method hands the kernel config as gemm1_clamp_limit,
compressed_tensors_moe_wna16.py 497-509, and TRITON applies with swiglu_limit_func, triton_moe.py
219-225) and uint4b8 group-32 symmetric weights (TRITON on gfx942 in converter/serving.py's model
of the oracle); the FP8 linears (MLA attention, dense and shared-expert MLPs) get compressed-tensors'
FP8 block method and register ``weight_scale``; router, embeddings and head stay unquantized.
Needs K3CONVERT_VLLM_PYTHON (skips without it, fails under K3CONVERT_REQUIRE_VLLM=1).
"""
from __future__ import annotations

import pytest

import ling_fixture as ling
from test_vllm_mimo_v2 import FP8_INPUT, FP8_WEIGHT
from test_vllm_quant_methods import MOE_INT4, UNQUANTIZED, model_methods


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[dict, str]:
    return model_methods(tmp_path_factory, "ling", ling.write)


def test_experts_int4_asking_for_silu_with_each_layers_limit(built):
    case, _ = built
    assert "error" not in case, case.get("error")
    assert case["quant_config"] == "CompressedTensorsConfig" and case["class"] == "BailingMoeV3ForCausalLM"
    experts = {n: m["method"] for n, m in case["modules"].items() if m["module"] == "RoutedExperts"}
    assert len(experts) == 2 and set(experts.values()) == {MOE_INT4}, experts
    assert len(case["oracle_asked"]) == 2
    assert sorted(a["swiglu_limit"] for a in case["oracle_asked"]) == sorted(ling.LIMITS.values())
    for a in case["oracle_asked"]:
        assert a["activation"] == "silu" and not a["zero_points"]
        assert "uint4b8" in a["weight_key"] and "col=32" in a["weight_key"]


def test_fp8_linears_keep_block_fp8_and_load_weight_scale(built):
    case, _ = built
    linears = {n: m for n, m in case["modules"].items() if m["method"] == "CompressedTensorsLinearMethod"}
    # per layer: q_proj, kv_a_proj_with_mqa, kv_b_proj, dense; gate_up/down (dense or shared experts)
    assert len(linears) == 3 * 4 + 3 * 2, sorted(linears)
    for n in linears:
        assert case["params"][n] == ["weight", "weight_scale"], (n, case["params"][n])
    assert case["fp8_asked"] and all(a == {"weight_key": FP8_WEIGHT, "activation_key": FP8_INPUT}
                                     for a in case["fp8_asked"])


def test_the_rest_unquantized(built):
    case, _ = built
    quantized = {n: m["method"] for n, m in case["modules"].items()
                 if m["method"] not in UNQUANTIZED and m["method"] not in (MOE_INT4, "CompressedTensorsLinearMethod")
                 and not m["method"].endswith("KVCacheMethod")}
    assert not quantized, quantized
    assert {case["modules"][n]["method"] for n in ("model.layers.1.mlp.gate", "lm_head", "model.word_embeddings")} \
        <= UNQUANTIZED
    selected = sorted(n for n, ok in case["lookups"].items() if ok and ".experts." in n)
    assert selected == [f"model.layers.{i}.mlp.experts.0.{p}" for i in (1, 2) for p in ("down_proj", "gate_proj",
                                                                                         "up_proj")], selected
