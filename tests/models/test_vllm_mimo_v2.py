"""vLLM's own MiMo-V2 class (``model_executor/models/mimo_v2.py``), built on the CPU from our
output's config by ``tests/support/vllm_scripts/moe_model_quant_methods.py``: the routed experts get
``CompressedTensorsWNA16MoEMethod`` and ask the int4 backend oracle for silu with uint4b8 group-32
symmetric weights (TRITON on gfx942 in converter/servers/'s model of that oracle); the FP8
linears, fused ones included (qkv_proj, gate_up_proj), get compressed-tensors' FP8 block method
with the keys Fp8Config's block method has (e4m3 128x128 weights, dynamic 1x128 activations) and
register ``weight_scale``, the name our output gives their scales; router, embeddings and head
stay unquantized. Needs K3CONVERT_VLLM_PYTHON (skips without it, fails under
K3CONVERT_REQUIRE_VLLM=1), as tests/vllm_plugin/test_vllm_quant_methods.py.
"""
from __future__ import annotations

import mimo_v2_fixture as mimo
import pytest
import serving_rules as serving

from converter.run.options import Options
from converter.run.pipeline import convert
from tests.vllm_plugin.test_vllm_quant_methods import MOE_INT4, UNQUANTIZED, model_methods

FP8_WEIGHT = "QuantKey(f8e4m3fn,scale(f32,static,GroupShape(row=128, col=128)),symmetric)"
FP8_INPUT = "QuantKey(f8e4m3fn,scale(f32,dynamic,GroupShape(row=1, col=128)),symmetric)"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[dict, str]:
    return model_methods(tmp_path_factory, "mimo_v2", mimo.write)


def test_experts_int4_asking_for_silu(built):
    case, dst = built
    assert "error" not in case, case.get("error")
    assert case["quant_config"] == "CompressedTensorsConfig" and case["class"] == "MiMoV2FlashForCausalLM"
    experts = {n: m["method"] for n, m in case["modules"].items() if m["module"] == "RoutedExperts"}
    assert len(experts) == 2 and set(experts.values()) == {MOE_INT4}, experts
    assert len(case["oracle_asked"]) == 2
    for a in case["oracle_asked"]:
        assert a["activation"] == "silu" and not a["zero_points"]
        assert "uint4b8" in a["weight_key"] and "col=32" in a["weight_key"] and "symmetric" in a["weight_key"]
    verdict = serving.kernel("vllm-rocm", *_kernel_inputs(dst))
    assert verdict.problem is None and "TRITON (TritonWNA16Experts), silu" in verdict.summary


def _kernel_inputs(dst: str):
    config, tensors = serving.load(dst)
    mats = serving.matrices(tensors)
    return config, mats, serving.layer_sizes(mats)[0], 1


def test_fp8_linears_keep_block_fp8_and_load_weight_scale(built):
    case, _ = built
    linears = {n: m for n, m in case["modules"].items() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj",
                                                                        "down_proj")) and ".experts" not in n}
    assert len(linears) == 3 * 2 + 2 and {m["method"] for m in linears.values()} == {"CompressedTensorsLinearMethod"}
    for n in linears:
        assert case["params"][n] == ["weight", "weight_scale"], (n, case["params"][n])
    assert case["fp8_asked"] and all(a == {"weight_key": FP8_WEIGHT, "activation_key": FP8_INPUT}
                                     for a in case["fp8_asked"])
    assert len(case["fp8_asked"]) == len(linears)


def test_the_rest_unquantized(built):
    case, _ = built
    rest = {n: m["method"] for n, m in case["modules"].items()
            if m["module"] in ("GateLinear", "VocabParallelEmbedding", "ParallelLMHead")}
    assert len(rest) == 4 and set(rest.values()) <= UNQUANTIZED, rest


def test_qkv_split_below_a_block_is_refused_as_vllm_does(tmp_path, monkeypatch):
    """MiMo's q/k/v are one QKVParallelLinear (mimo_v2.py 284-293). Under the source's Fp8Config a
    merged layer whose per-rank outputs are not whole blocks is let through (linear.py 562-581);
    under our compressed-tensors output it is refused (fp8_utils.py 1296-1344): with head_dim 192,
    TP 2 gives 192-row q and k partitions. vLLM's own classes at faked TP 1 and 2 refuse exactly what
    converter/servers/fp8_tp.py names (the qkv_proj of every layer at TP 2, nothing at TP 1)."""
    from tests.models.test_vllm_ling import assert_fp8_refusals_are_vllms
    monkeypatch.setitem(mimo.TEXT, "head_dim", 192)
    monkeypatch.setitem(mimo.TEXT, "swa_head_dim", 192)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    mimo.write(src)
    convert(src, dst, Options())
    refused = assert_fp8_refusals_are_vllms("mimo_v2", dst, (1, 2), tmp_path)
    assert not refused[1] and sorted(refused[2]) == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(3)]


def test_the_tp8_opt_in_loads_at_tp_8_in_vllms_own_class_with_the_outputs_values(tmp_path):
    """Issue 35 §2. MiMo-V2-Flash's attention shape (mimo_v2_fixture.FLASH_TP8): vLLM's own classes at faked
    TP 8 refuse the default output's qkv_proj of every layer and nothing of the --fp8-bf16-at-tp 8 output, as
    converter/servers/fp8_tp.py says; built at TP 1 and loaded by its own load_weights, the opt-in output's
    qkv_proj is unquantized and holds the bf16 values, every other linear the output's bytes and scales."""
    from tests.models.test_vllm_ling import assert_fp8_refusals_are_vllms, linear_values
    from tests.vllm_plugin.test_vllm_quant_methods import vllm_python
    vllm_python()
    src = str(tmp_path / "src")
    mimo.write(src, text=mimo.FLASH_TP8)
    plain, tp8 = str(tmp_path / "dst"), str(tmp_path / "dst-tp8")
    convert(src, plain, Options())
    convert(src, tp8, Options(fp8_bf16_tp=8))
    refused = assert_fp8_refusals_are_vllms("mimo_v2", plain, (1, 8), tmp_path)
    assert not refused[1] and sorted(refused[8]) == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(3)]
    assert not any(assert_fp8_refusals_are_vllms("mimo_v2", tp8, (1, 8), tmp_path).values())
    linears = linear_values("mimo_v2", tp8, tmp_path)
    assert all(v["ok"] for v in linears.values()), {k: v for k, v in linears.items() if not v["ok"]}
    for i in range(3):
        qkv = linears[f"model.layers.{i}.self_attn.qkv_proj"]
        assert qkv["kind"] != "fp8" and qkv["source_dtypes"] == ["torch.bfloat16"] * 3
    assert sum(v["kind"] == "fp8" for v in linears.values()) == 3 + 2   # o_proj per layer, the dense MLP
