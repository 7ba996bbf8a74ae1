"""vLLM's own Ling class (``model_executor/models/bailing_moe_v3.py`` ``BailingMoeV3ForCausalLM``), built
on the CPU from our output's config by ``tests/support/vllm_scripts/moe_model_quant_methods.py``: the routed
experts get ``CompressedTensorsWNA16MoEMethod`` and ask the int4 backend oracle for silu with each
layer's clamp from ``expert_swiglu_limit_list`` (7.0 and 10.0: vLLM passes it as FusedMoE's
swiglu_limit, 1180-1209, which the WNA16 method hands the kernel config as gemm1_clamp_limit,
compressed_tensors_moe_wna16.py 497-509, and TRITON applies with swiglu_limit_func, triton_moe.py
219-225) and uint4b8 group-32 symmetric weights (TRITON on gfx942 in converter/servers/'s model
of the oracle); the FP8 linears (MLA attention, dense and shared-expert MLPs) get compressed-tensors'
FP8 block method and register ``weight_scale``; router, embeddings and head stay unquantized.
Needs K3CONVERT_VLLM_PYTHON (skips without it, fails under K3CONVERT_REQUIRE_VLLM=1).
"""
from __future__ import annotations

import os
import subprocess

import ling_fixture as ling
import pytest

from converter.run.options import Options
from converter.run.pipeline import convert
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import read_json
from tests.models.test_vllm_mimo_v2 import FP8_INPUT, FP8_WEIGHT
from tests.vllm_plugin.test_vllm_quant_methods import MOE_INT4, UNQUANTIZED, model_methods, vllm_python


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


FP8_TP_SCRIPT = os.path.join(str(support.SUPPORT), "vllm_scripts", "fp8_block_tp.py")
FUSED = {"gate_proj+up_proj": "gate_up_proj", "q_proj+k_proj+v_proj": "qkv_proj",
         "q_proj+k_proj+v_proj+b_proj": "qkvb_proj", "q_a_proj+kv_a_proj_with_mqa": "fused_qkv_a_proj"}


def vllm_names(layer: str) -> str:
    """converter/servers/fp8_tp.py's layer (checkpoint names, fused shards joined by +) as vLLM names it."""
    parent, _, name = layer.rpartition(".")
    return f"{parent.replace('.attention', '.self_attn')}.{FUSED.get(name, name)}"


def assert_fp8_refusals_are_vllms(family: str, dst: str, tps: tuple[int, ...], tmp_path) -> dict:
    """vLLM's own model class of ``family``, built from DST at each faked TP size
    (tests/support/vllm_scripts/fp8_block_tp.py, validate_fp8_block_shape run as released), refuses exactly
    the FP8 block linears converter/servers/fp8_tp.py names; returns vLLM's refusals per TP."""
    import serving_rules as serving

    from converter.releases import NEWEST_VLLM
    from converter.servers import fp8_tp
    from converter.servers.topology import Topology
    out = str(tmp_path / f"{family}-tp.json")
    run = subprocess.run([vllm_python(), FP8_TP_SCRIPT, family, out, dst, *map(str, tps)], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    got = read_json(out)["results"]
    config, tensors = serving.load(dst)
    ctx = serving.ctx_of(config, tensors, "vllm-rocm")
    assert ctx.block == (128, 128) and ctx.fp8
    for tp in tps:
        case = got[str(tp)]
        assert "error" not in case, (tp, case)
        ours = {vllm_names(layer) for layer, _, _ in fp8_tp.refusals(config, ctx.fp8, ctx.block, Topology(tp),
                                                                       NEWEST_VLLM)}
        assert ours == set(case["refused"]), (tp, sorted(ours), case["refused"])
        loader = {r.rule: r for r in serving.rules(dst, "vllm-rocm", tp)}["loader"]
        assert loader.ok == (not case["refused"]), (tp, loader.message)
    return {tp: got[str(tp)]["refused"] for tp in tps}


@pytest.mark.parametrize("shared", ["1x128", "2x128"])
def test_fp8_block_refusals_are_vllms_own_at_each_tp(shared, tmp_path):
    """vLLM's own BailingMoeV3ForCausalLM, built from our output at faked TP 1, 2 and 4, refuses
    exactly the FP8 block linears converter/servers/fp8_tp.py names: the shared-expert MLP at TP 2 for one
    shared expert of 128, nothing at TP 2 for two, and at TP 4 the MLA kv_b_proj, the dense MLP and
    the shared experts."""
    from tests.models.test_ling import SHARED_1x128, SHARED_2x128
    vllm_python()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ling.write(src, text={"1x128": SHARED_1x128, "2x128": SHARED_2x128}[shared])
    convert(src, dst, Options())
    refused = assert_fp8_refusals_are_vllms("ling", dst, (1, 2, 4), tmp_path)
    assert not refused[1] and bool(refused[2]) == (shared == "1x128")
    assert "model.layers.1.mlp.shared_experts.gate_up_proj" in refused[4]
    assert "model.layers.0.self_attn.kv_b_proj" in refused[4] and "model.layers.0.mlp.gate_up_proj" in refused[4]


def test_a_head_wise_fp8_g_proj_is_refused_at_every_tp_above_1(tmp_path):
    """Ling's head-wise MLA gate g_proj has one output per head. vLLM 0.33.0 replicates it at TP > 1
    when it is block FP8 under Fp8Config (bailing_moe_v3.py 541-552, 568); under our
    compressed-tensors output it is a ColumnParallelLinear of heads / TP outputs per rank, never whole
    128-blocks: vLLM's own classes refuse it at TP 2, and converter/servers/fp8_tp.py says so."""
    from tests.models.test_ling import SHARED_2x128
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ling.write(src, text=dict(SHARED_2x128, gated_attention_proj_granularity_type="head_wise"))
    convert(src, dst, Options())
    refused = assert_fp8_refusals_are_vllms("ling", dst, (1, 2), tmp_path)
    assert not refused[1] and sorted(refused[2]) == [f"model.layers.{i}.self_attn.g_proj" for i in range(3)]


VALUES_SCRIPT = os.path.join(str(support.SUPPORT), "vllm_scripts", "linear_values.py")


def linear_values(family: str, dst: str, tmp_path) -> dict:
    """vLLM's own class built from DST and loaded by its own load_weights: per linear, whether it holds
    the output's values (tests/support/vllm_scripts/linear_values.py)."""
    out = str(tmp_path / f"{family}-values-{os.path.basename(dst)}.json")
    run = subprocess.run([vllm_python(), VALUES_SCRIPT, family, out, dst], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    got = read_json(out)
    assert got["vllm"].startswith("0.32.")
    return got["linears"]


def test_kda_layers_hold_the_outputs_values_after_vllms_loader(tmp_path):
    """Issue 35 §1: a Ling whose KDA b_proj is not FP8. vLLM's own BailingMoeV3ForCausalLM, built from our
    output and loaded by its own load_weights, holds the output's values in every linear: qkvb_proj
    unquantized with q, k, v (bf16, their FP8 values) and b; every FP8 linear its bytes and scales. The
    output as k3convert wrote it before loads q, k and v unscaled (their e4m3 values in an unquantized
    layer): vLLM's qkvb_proj is then off by the block scales' inverse."""
    from tests.models.test_ling import KDA, convert_kda
    vllm_python()
    _, dst = convert_kda(tmp_path)
    linears = linear_values("ling", dst, tmp_path)
    assert linears and all(v["ok"] for v in linears.values()), {k: v for k, v in linears.items() if not v["ok"]}
    qkvb = linears["model.layers.0.self_attn.qkvb_proj"]
    assert qkvb["kind"] != "fp8" and qkvb["shards"] == [f"{KDA}.{p}" for p in ("q_proj", "k_proj", "v_proj", "b_proj")]
    assert sum(v["kind"] == "fp8" for v in linears.values()) == 17
    _, old = convert_kda(tmp_path, before_the_fix=True)
    before = linear_values("ling", old, tmp_path)
    wrong = sorted(k for k, v in before.items() if not v["ok"])
    assert wrong == ["model.layers.0.self_attn.qkvb_proj"], wrong
    assert before[wrong[0]]["norm_ratio"] < 0.1, before[wrong[0]]   # the scales (~1/100 here) dropped
