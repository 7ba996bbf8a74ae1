"""Ling-3.0-flash-fp4 (bailing_moe_v3: vLLM's FP8 config with ``scale_fmt: ue8m0`` and
``routed_experts_quant_method: mxfp4``): converts from a fixture shaped as vLLM 0.33.0's loader reads
it (tests/support/ling_fixture.py), decoded by compressed-tensors.

What must hold: the ``ling-3`` profile is chosen; the routed experts (E8M0 scales under
``weight_scale_inv``) become int4 selected under vLLM's lookup names; every FP8 linear keeps its bytes,
its ``weight_scale_inv`` written as ``weight_scale``, named by the FP8 block group under the
checkpoint's names (``attention.``, which vLLM maps to ``self_attn.``); the rest is byte-identical;
the per-layer ``expert_swiglu_limit_list`` is kept and stated in every shard; ``verify`` passes;
vLLM's serving model passes (silu, TRITON); the inventory catches a missing expert.
"""
from __future__ import annotations

import os

import ling_fixture as ling
import pytest
import torch

from converter.errors import BadInput
from converter.formats.match import match_name
from converter.run.options import Options
from converter.run.pipeline import convert
from tests.conftest import (
    all_tensors,
    assert_missing_module_named,
    assert_verified_and_on_triton,
    converted_model,
    ct_int4_values,
    ct_mxfp4_values,
    read_json,
    tensor_bytes,
    with_config,
)


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    return converted_model(tmp_path_factory, "ling", ling.write)


def test_profile_and_dialect(done):
    _, dst = done
    source = read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]
    assert source["profile"]["name"] == "ling-3"
    assert source["quantization"]["dialect"] == "fp8-mxfp4"
    assert "routed_experts_quant_method" in source["quantization"]["scale_convention"]


def test_experts_int4_fp8_linears_kept(done):
    src, dst = done
    before, after = all_tensors(src), all_tensors(dst)
    experts = sorted(n[: -len(".weight")] for n in before if ".mlp.experts." in n and n.endswith(".weight"))
    assert len(experts) == 2 * 4 * 3
    for m in experts:
        scale = before[f"{m}.weight_scale_inv"][1]
        assert scale.dtype == torch.float8_e8m0fnu
        want = ct_mxfp4_values(before[f"{m}.weight"][1], scale.view(torch.uint8))
        got = ct_int4_values(after, m)
        assert (got - want).norm() / want.norm() < 0.12, m
        assert f"{m}.weight_scale_inv" not in after and after[f"{m}.weight_scale"][1].dtype == torch.bfloat16
    fp8 = sorted(n[: -len(".weight_scale_inv")] for n in before
                 if n.endswith(".weight_scale_inv") and ".mlp.experts." not in n)
    assert len(fp8) == 3 * 4 + 3 + 2 * 3
    for m in fp8:
        assert f"{m}.weight_scale_inv" not in after
        for old, new in ((".weight", ".weight"), (".weight_scale_inv", ".weight_scale")):
            a, b = before[m + old][1], after[m + new][1]
            assert a.dtype == b.dtype and tensor_bytes(a) == tensor_bytes(b), m + old
    rest = [n for n in before if not n.startswith(tuple(experts)) and not n.startswith(tuple(fp8))]
    assert "model.layers.1.mlp.gate.expert_bias" in rest
    for n in rest:
        assert tensor_bytes(before[n][1]) == tensor_bytes(after[n][1]), n


def test_config_names_experts_and_fp8_linears_only(done):
    _, dst = done
    cfg = read_json(os.path.join(dst, "config.json"))
    block = cfg["quantization_config"]
    int4, fp8 = block["config_groups"]["group_0"], block["config_groups"]["group_1"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert any(match_name(f"model.layers.2.mlp.experts.0.{proj}", t) for t in int4["targets"])
    for other in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.gate_proj",
                  "model.layers.1.mlp.gate", "lm_head"):
        assert not any(match_name(other, t) for t in int4["targets"]), other
    assert "model.layers.1.attention.kv_b_proj" in fp8["targets"]
    assert "model.layers.1.mlp.shared_experts.down_proj" in fp8["targets"]
    assert not any(".experts." in t and "shared" not in t for t in fp8["targets"])
    assert cfg["expert_swiglu_limit_list"] == [0, 7.0, 10.0] and cfg["hidden_act"] == "silu"
    from safetensors import safe_open
    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        assert f.metadata()["expert_swiglu_limit_list"] == "[0, 7.0, 10.0]"


def test_verify_and_serving(done):
    # the default release is vLLM 0.34, whose Ling experts run swiglustep (bailing_moe_v3.py 1205-1207)
    assert_verified_and_on_triton(*done, servers=("sglang-rocm",), activation="swiglustep")


def test_another_routed_experts_method_is_refused(done, tmp_path):
    src = with_config(done[0], str(tmp_path), lambda c: c["quantization_config"].update(routed_experts_quant_method="nvfp4"))
    with pytest.raises(BadInput, match="quant_method='fp8'.*or routed_experts_quant_method mxfp4"):
        convert(src, str(tmp_path / "dst"), Options())


def test_an_incomplete_download_is_caught_by_the_inventory(tmp_path):
    src = str(tmp_path / "src")
    ling.write(src)
    assert_missing_module_named(src, "model.safetensors", "model.layers.2.mlp.experts.3.down_proj",
                                (".weight", ".weight_scale_inv"), 24, str(tmp_path / "dst"))


def test_mtp_layer_experts_are_in_the_inventory(tmp_path):
    """Ling's MTP layers (num_nextn_predict_layers, after num_hidden_layers) are MoE with routed experts
    under the same names (bailing_moe_v3_mtp.py 111, 162-173): the inventory expects them, so they
    convert with the rest, and one missing is named."""
    from converter import profiles
    src = str(tmp_path / "src")
    ling.write(src, mtp=True)
    cfg = read_json(os.path.join(src, "config.json"))
    expected = profiles.expected_modules(profiles.named("ling-3"), cfg)
    assert len(expected) == 3 * 4 * 3 and "model.layers.3.mlp.experts.3.down_proj" in expected
    dst = str(tmp_path / "dst")
    convert(src, dst, Options())
    assert "model.layers.3.mlp.experts.0.gate_proj.weight_packed" in all_tensors(dst)
    assert_missing_module_named(src, "model.safetensors", "model.layers.3.mlp.experts.1.up_proj",
                                (".weight", ".weight_scale_inv"), 36, str(tmp_path / "dst2"))


def test_a_limit_list_of_the_wrong_type_is_refused(done, tmp_path):
    src = with_config(done[0], str(tmp_path), lambda c: c.update(expert_swiglu_limit_list=[0, "7.0", 10.0]))
    with pytest.raises(BadInput, match="expert_swiglu_limit_list is .*expected a list of finite numbers"):
        convert(src, str(tmp_path / "dst"), Options())


def test_vllms_load_time_refusals_for_ling(done):
    """verify --serving's loader table (converter/servers/loaders.py): Ling's MLA asserts TP divides the heads
    (bailing_moe_v3.py 480); the fixture's 2 heads load at TP 2, not at TP 4."""
    from converter.releases.vllm_0_33 import RELEASE
    from converter.servers import loaders
    from converter.servers.topology import Topology
    cfg = read_json(os.path.join(done[1], "config.json"))
    assert loaders.refusals(cfg, Topology(2), RELEASE) == []
    (problem, where), *_ = loaders.refusals(cfg, Topology(4), RELEASE)
    assert "num_attention_heads" in problem and "bailing_moe_v3.py 480" in where


# 4 heads: the MLA linears are whole 128-blocks per rank at TP 2; one shared expert of 128: 64 per rank at TP 2;
# routed experts of 128: whole int4 groups per rank up to TP 4
SHARED_1x128 = dict(num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=128)
SHARED_2x128 = dict(SHARED_1x128, num_shared_experts=2)


@pytest.fixture(scope="module")
def shared_tp(tmp_path_factory):
    """Two outputs: a shared expert of 128 (split to 64 at TP 2) and two of 128 (256, 128 at TP 2)."""
    return {name: converted_model(tmp_path_factory, f"ling-{name}", lambda src, t=text: ling.write(src, text=t))[1]
            for name, text in (("1x128", SHARED_1x128), ("2x128", SHARED_2x128))}


def test_fp8_shared_experts_split_below_a_block_are_refused_at_that_tp(shared_tp):
    """Under the source's Fp8Config vLLM pads Ling's shared-expert MLP to TP * 128 (bailing_moe_v3.py
    299-320, 1186-1198, 1547-1552); under our compressed-tensors output it does not, and the FP8 block
    scheme refuses a per-rank size that is not whole 128-blocks (fp8_utils.py 1296-1344). verify
    --serving says so at TP 2, passes TP 1, and lists only TP 1 (tests/models/test_vllm_ling.py checks the
    refusals against vLLM's own classes)."""
    import serving_rules as serving
    dst = shared_tp["1x128"]
    assert all(r.ok for r in serving.rules(dst, "vllm-rocm", 1))
    for server in ("vllm-rocm", "vllm-cuda", "vllm-rocm-plugin"):
        loader = {r.rule: r for r in serving.rules(dst, server, 2)}["loader"]
        assert not loader.ok, server
        assert "model.layers.1.mlp.shared_experts.down_proj: per-rank input 128/2=64 is not whole 128-blocks at " \
               "TP 2 (and 3 more FP8 linears)" in loader.message, loader.message
        assert "model.layers.2.mlp.shared_experts.gate_proj+up_proj: per-rank output gate_proj 64, up_proj 64 not " \
               "whole 128-blocks" in loader.detail
        assert "vLLM pads its shared experts' intermediate 128 to 256" in loader.detail
        assert "fp8_utils.py validate_fp8_block_shape 1296-1344" in loader.detail
    config, tensors = serving.load(dst)
    check = serving.check_of(config, tensors, "vllm-rocm", 2)
    assert "TP sizes that pass: 1" in check.notes, check.notes
    assert {r.rule: r for r in serving.rules(shared_tp["2x128"], "vllm-rocm", 2)}["loader"].ok


def test_sglang_is_not_given_vllms_fp8_rule(shared_tp):
    import serving_rules as serving
    assert {r.rule: r for r in serving.rules(shared_tp["1x128"], "sglang-rocm", 2)}["loader"].ok


# --- KDA layers (issue 35 §1): a source that keeps attention.b_proj out of FP8 -------------------------------

def convert_kda(root, ignored=ling.B_IGNORED, before_the_fix: bool = False) -> tuple[str, str]:
    """(src, dst) of a Ling with one KDA layer (layer 0); ``before_the_fix``: converted as k3convert did
    before it wrote such layers' q/k/v as bf16 (every FP8 linear kept as FP8), the output vLLM loads wrong."""
    from converter.servers import fp8_tp
    src, dst = str(root / "src"), str(root / ("dst-old" if before_the_fix else "dst"))
    if not os.path.exists(src):
        ling.write(src, text=ling.KDA_TEXT, ignored=ignored)
    with pytest.MonkeyPatch.context() as mp:
        if before_the_fix:
            mp.setattr(fp8_tp, "bf16_modules", lambda *a: set())
        convert(src, dst, Options())
    return src, dst


@pytest.fixture(scope="module")
def kda(tmp_path_factory):
    root = tmp_path_factory.mktemp("ling-kda")
    src, dst = convert_kda(root)
    return src, dst, convert_kda(root, before_the_fix=True)[1]


KDA = "model.layers.0.attention"


def test_kda_qkv_beside_a_bf16_b_proj_are_written_as_exact_bf16(kda):
    """vLLM fuses q, k, v and b of a KDA layer into one qkvb_proj under compressed-tensors
    (bailing_moe_v3.py 691, 710-720) and gives it the FP8 scheme only when all four are FP8 targets
    (compressed_tensors/utils.py 133-176): with b_proj bf16 the layer is unquantized. So q/k/v are written
    as bf16: their e4m3 values times the (power-of-two, ue8m0) block scales, exactly; b_proj byte-identical;
    none of the four in the FP8 group; the manifest says which and why; verify --source passes."""
    from converter.verify import verify
    src, dst, _ = kda
    before, after = all_tensors(src), all_tensors(dst)
    for p in ("q_proj", "k_proj", "v_proj"):
        w, s = before[f"{KDA}.{p}.weight"][1], before[f"{KDA}.{p}.weight_scale_inv"][1]
        got = after[f"{KDA}.{p}.weight"][1]
        per_block = s.double().repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        exact = w.double() * per_block
        assert got.dtype == torch.bfloat16 and torch.equal(got.double(), exact), p   # exact: ue8m0 scales
        assert f"{KDA}.{p}.weight_scale" not in after
    assert tensor_bytes(before[f"{KDA}.b_proj.weight"][1]) == tensor_bytes(after[f"{KDA}.b_proj.weight"][1])
    cfg = read_json(os.path.join(dst, "config.json"))
    targets = cfg["quantization_config"]["config_groups"]["group_1"]["targets"]
    qkvb = ("q_proj", "k_proj", "v_proj", "b_proj")
    assert not [t for t in targets if t.startswith(KDA) and t.rsplit(".", 1)[1] in qkvb]
    assert {f"{KDA}.{p}" for p in ("f_proj", "g_proj", "o_proj")} <= set(targets)
    record = read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]["quantization"]["fp8_to_bf16"]
    assert record["modules"] == [f"{KDA}.{p}" for p in ("k_proj", "q_proj", "v_proj")]
    assert "vLLM fuses with a linear that is not FP8" in record["why"][0] and "exact when" in record["values"]
    result = verify(dst, src)
    assert result.ok, [p for c in result.checks for p in c.problems]
    assert "3 of 3 FP8 linear(s) written as bf16" in {c.name: c for c in result.checks}["passthrough"].summary


@pytest.mark.parametrize("vllm", ["0.33", "0.34"])
def test_verify_serving_refuses_a_kda_layer_vllm_would_load_unscaled(kda, vllm):
    """The output as k3convert wrote it before: verify --serving names the fused layer and why, at every TP,
    for both releases; the fixed output passes."""
    import serving_rules as serving
    _, dst, old = kda
    for tp in (1, 2):
        loader = {r.rule: r for r in serving.rules(old, "vllm-rocm", tp, vllm=vllm)}["loader"]
        assert not loader.ok
        assert f"{KDA}.q_proj+k_proj+v_proj+b_proj: vLLM fuses these into one layer, unquantized because b_proj " \
               "is not in the FP8 group, and loads the e4m3 values of q_proj, k_proj, v_proj with their " \
               "weight_scale dropped" in loader.message, loader.message
        assert f"vllm {vllm}.0 model_executor/models/bailing_moe_v3.py 691" in loader.detail
        assert "_match_fused_layer" in loader.detail
    assert all(r.ok for r in serving.rules(dst, "vllm-rocm", 1, vllm=vllm)), \
        [r.message for r in serving.rules(dst, "vllm-rocm", 1, vllm=vllm) if not r.ok]
    assert {r.rule: r for r in serving.rules(old, "sglang-rocm", 1)}["loader"].ok   # vLLM's fusion only


def test_a_kda_layer_all_fp8_keeps_every_fp8_linear(tmp_path):
    """b_proj FP8 too: the fused qkvb_proj takes the FP8 scheme (all four are targets): nothing is bf16."""
    src, dst = convert_kda(tmp_path, ignored=())
    targets = read_json(os.path.join(dst, "config.json"))["quantization_config"]["config_groups"]["group_1"]["targets"]
    assert {f"{KDA}.{p}" for p in ("q_proj", "k_proj", "v_proj", "b_proj")} <= set(targets)
    assert "fp8_to_bf16" not in read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]["quantization"]
    assert all(r.ok for r in __import__("serving_rules").rules(dst, "vllm-rocm", 1))


def test_verify_catches_a_kda_bf16_value_that_is_not_the_fp8_value(kda, tmp_path):
    """verify --source re-derives each FP8 linear written as bf16 from the source's e4m3 bytes and scales."""
    import shutil

    from safetensors.torch import load_file, save_file

    from converter.verify import verify
    src, dst, _ = kda
    copy = str(tmp_path / "dst")
    shutil.copytree(dst, copy)
    path = os.path.join(copy, "model.safetensors")
    tensors = load_file(path)
    tensors[f"{KDA}.k_proj.weight"][3, 5] *= 2
    save_file(tensors, path, metadata={"format": "pt"})
    result = verify(copy, src, sample=None, checksums=False)
    problems = [p for c in result.checks if c.name == "passthrough" for p in c.problems]
    assert problems == [f"{KDA}.k_proj.weight: 1 value(s) differ from the FP8 values of {KDA}.k_proj.weight times "
                        f"{KDA}.k_proj.weight_scale_inv"], problems
