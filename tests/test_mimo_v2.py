"""MiMo-V2 FP4 (vLLM's FP8 config with ``store_dtype: mxfp4``): converts from a fixture shaped as
vLLM's loader expects (tests/mimo_v2_fixture.py), decoded by compressed-tensors.

What must hold: the routed experts become int4 and the config selects them under vLLM's lookup
names; every FP8 linear keeps its bytes, its ``weight_scale_inv`` written as ``weight_scale``
(what vLLM's compressed-tensors FP8 scheme loads) and is named by an FP8 block group; the rest
is byte-identical under its own name; ``verify`` passes with the source; vLLM and SGLang's
serving models pass (silu); a fused-qkv (Pro) layout and a non-MXFP4 FP8 config are refused.
"""
from __future__ import annotations

import os

import pytest
import torch

import mimo_v2_fixture as mimo
from conftest import (
    all_tensors, assert_verified_and_on_triton, converted_model, ct_int4_values, ct_mxfp4_values,
    read_json, tensor_bytes, with_config)
import serving_rules as serving
from converter.errors import BadInput
from converter.formats.match import match_name
from converter.pipeline import Options, convert
from converter.verify import verify


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    return converted_model(tmp_path_factory, "mimo", mimo.write)


def test_experts_int4_fp8_linears_kept(done):
    src, dst = done
    before, after = all_tensors(src), all_tensors(dst)
    experts = sorted(n[: -len(".weight")] for n, (_, t) in before.items()
                     if ".mlp.experts." in n and n.endswith(".weight"))
    assert len(experts) == 2 * 4 * 3
    for m in experts:
        want = ct_mxfp4_values(before[f"{m}.weight"][1], before[f"{m}.weight_scale"][1])
        got = ct_int4_values(after, m)
        assert (got - want).norm() / want.norm() < 0.12, m
    fp8 = sorted(n[: -len(".weight_scale_inv")] for n in before if n.endswith(".weight_scale_inv"))
    assert len(fp8) == 3 * 4 + 3
    for m in fp8:
        assert f"{m}.weight_scale_inv" not in after
        assert after[f"{m}.weight"][1].dtype == torch.float8_e4m3fn
        for old, new in ((".weight", ".weight"), (".weight_scale_inv", ".weight_scale")):
            a, b = before[m + old][1], after[m + new][1]
            assert a.dtype == b.dtype and tensor_bytes(a) == tensor_bytes(b), m + old
    rest = [n for n in before if not n.startswith(tuple(experts)) and not n.startswith(tuple(fp8))]
    for n in rest:
        assert tensor_bytes(before[n][1]) == tensor_bytes(after[n][1]), n


def test_config_names_experts_and_fp8_linears_only(done):
    _, dst = done
    block = read_json(os.path.join(dst, "config.json"))["quantization_config"]
    assert block["quant_method"] == "compressed-tensors"
    int4, fp8 = block["config_groups"]["group_0"], block["config_groups"]["group_1"]
    for proj in ("gate_proj", "up_proj", "down_proj"):   # vLLM's lookup (compressed_tensors_moe.py 36-58)
        assert any(match_name(f"model.layers.1.mlp.experts.0.{proj}", t) for t in int4["targets"])
    assert not any(match_name("model.layers.0.mlp.gate_proj", t) for t in int4["targets"])
    assert not any(match_name(n, t) for t in int4["targets"] for n in ("model.layers.1.mlp.gate", "lm_head"))
    assert fp8["format"] == "float-quantized" and fp8["weights"]["block_structure"] == [128, 128]
    assert fp8["weights"]["strategy"] == "block" and fp8["input_activations"]["dynamic"] is True
    assert "model.layers.1.self_attn.q_proj" in fp8["targets"] and "model.layers.0.mlp.down_proj" in fp8["targets"]
    assert not any(".experts." in t or t.endswith(".gate") or t == "lm_head" for t in fp8["targets"])


def test_verify_and_serving(done):
    assert_verified_and_on_triton(*done, servers=("sglang-rocm",))


def test_fused_qkv_layout_is_refused(done, tmp_path):
    src = with_config(done[0], str(tmp_path), lambda c: c.update(attention_projection_layout="fused_qkv"))
    with pytest.raises(BadInput, match="fused_qkv.*mimo_v2.py 387-392"):
        convert(src, str(tmp_path / "dst"), Options())


def test_an_fp8_config_without_mxfp4_experts_is_refused(done, tmp_path):
    src = with_config(done[0], str(tmp_path), lambda c: c["quantization_config"].pop("store_dtype"))
    with pytest.raises(BadInput, match="quant_method='fp8'"):
        convert(src, str(tmp_path / "dst"), Options())


def test_a_config_without_moe_layer_freq_is_refused(done, tmp_path):
    """vLLM's MiMo builds no MoE layer without moe_layer_freq (mimo_v2.py is_moe_layer): the inventory says so."""
    src = with_config(done[0], str(tmp_path), lambda c: c.pop("moe_layer_freq"))
    with pytest.raises(BadInput, match="needs moe_layer_freq in config.json"):
        convert(src, str(tmp_path / "dst"), Options())


def test_v26_flash_layout_converts(tmp_path):
    """MiMo-V2.6-Flash's additions (mimo_v2_fixture.V26: SWA attention sinks, an MTP layer with FP8
    linears and an unquantized o_proj) over 7 shards cut mid-module: the experts (some with weight and
    scale in different files) become int4, every FP8 linear, the MTP's included, is named by the FP8
    group and keeps its bytes, sinks and the MTP o_proj pass through, verify and vLLM's serving model pass."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    mimo.write(src, v26=True, shards=7)
    index = read_json(os.path.join(src, "model.safetensors.index.json"))["weight_map"]
    split = [n[: -len(".weight")] for n in index if ".mlp.experts." in n and n.endswith(".weight")
             and index[n] != index[n[: -len(".weight")] + ".weight_scale"]]
    assert split, "the fixture should cut some expert between its weight and its scale"
    convert(src, dst, Options())
    before, after = all_tensors(src), all_tensors(dst)
    assert len([n for n in after if n.endswith(".weight_packed")]) == 2 * 4 * 3
    for m in split:
        want = ct_mxfp4_values(before[f"{m}.weight"][1], before[f"{m}.weight_scale"][1])
        assert (ct_int4_values(after, m) - want).norm() / want.norm() < 0.12, m
    fp8 = read_json(os.path.join(dst, "config.json"))["quantization_config"]["config_groups"]["group_1"]["targets"]
    mtp = [t for t in fp8 if t.startswith("model.mtp.layers.0.")]
    assert sorted(mtp) == sorted(f"model.mtp.layers.0.{n}" for n in ("eh_proj", "self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj", "mlp.gate_proj",
                                                                     "mlp.up_proj", "mlp.down_proj"))
    for n in ("model.layers.1.self_attn.attention_sink_bias", "model.mtp.layers.0.self_attn.o_proj.weight",
              "model.mtp.layers.0.self_attn.attention_sink_bias", "model.mtp.layers.0.eh_proj.weight"):
        assert tensor_bytes(before[n][1]) == tensor_bytes(after[n][1]), n
    assert tensor_bytes(before["model.mtp.layers.0.eh_proj.weight_scale_inv"][1]) == \
        tensor_bytes(after["model.mtp.layers.0.eh_proj.weight_scale"][1])
    result = verify(dst, src)
    assert result.ok, [p for c in result.checks for p in c.problems]
    rocm = {r.rule: r for r in serving.rules(dst, "vllm-rocm", 1)}
    assert all(r.ok for r in rocm.values()), [r.message for r in rocm.values() if not r.ok]
