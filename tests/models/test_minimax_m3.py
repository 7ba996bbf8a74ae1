"""MiniMax-M3 (compressed-tensors MXFP4 build): converts from a fixture shaped as vLLM's loader
expects (tests/support/minimax_m3_fixture.py), decoded by compressed-tensors, judged by the serving model.

What must hold: only the routed experts become int4 and the config selects them under vLLM's
lookup names and nothing else; every other tensor is byte-identical; MiniMax's swiglu
alpha/limit are kept where vLLM reads them (text_config) and stated in every shard;
``verify --serving vllm-rocm`` passes naming TritonWNA16 and swigluoai_uninterleave, while
SGLang 0.5.23's WNA16 MoE (silu only) is a failure, not a pass.
"""
from __future__ import annotations

import os

import minimax_m3_fixture as mm3
import pytest
import serving_rules as serving
import torch

from converter.formats.match import match_name
from converter.run.options import Options
from converter.run.pipeline import convert
from tests.conftest import (
    all_tensors,
    assert_missing_module_named,
    converted_model,
    ct_int4_values,
    ct_mxfp4_values,
    read_json,
    tensor_bytes,
)


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    return converted_model(tmp_path_factory, "mm3", mm3.write)


def test_experts_int4_everything_else_identical(done):
    src, dst = done
    before, after = all_tensors(src), all_tensors(dst)
    experts = sorted(n[: -len(".weight_packed")] for n in before if n.endswith(".weight_packed"))
    assert len(experts) == 2 * 4 * 3
    for m in experts:
        want = ct_mxfp4_values(before[f"{m}.weight_packed"][1], before[f"{m}.weight_scale"][1])
        got = ct_int4_values(after, m)
        assert after[f"{m}.weight_scale"][1].dtype == torch.bfloat16
        assert (got - want).norm() / want.norm() < 0.12, m
    others = {n for n in before if not n.startswith(tuple(experts))}
    assert others and {n for n in after if not n.startswith(tuple(experts))} == others
    for n in others:
        assert before[n][1].dtype == after[n][1].dtype and tensor_bytes(before[n][1]) == tensor_bytes(after[n][1]), n


def test_targets_select_the_experts_under_vllms_names_only(done):
    _, dst = done
    cfg = read_json(os.path.join(dst, "config.json"))
    block = cfg["quantization_config"]
    (group,) = block["config_groups"].values()
    targets, ignore = group["targets"], block["ignore"]

    def selected(name: str) -> bool:
        return not any(match_name(name, p) for p in ignore) and any(match_name(name, t) for t in targets)

    layer = "language_model.model.layers.1.block_sparse_moe.experts"
    for proj in ("gate_proj", "up_proj", "down_proj"):   # vLLM's lookup (compressed_tensors_moe.py 36-58)
        assert selected(f"{layer}.0.{proj}")
    for other in ("language_model.model.layers.1.self_attn.qkv_proj", "language_model.model.layers.0.mlp.gate_up_proj",
                  "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_up_proj",
                  "language_model.model.layers.1.block_sparse_moe.gate", "language_model.lm_head"):
        assert not selected(other), other
    assert group["weights"]["type"] == "int" and group["input_activations"] is None


def test_activation_kept(done):
    _, dst = done
    text = read_json(os.path.join(dst, "config.json"))["text_config"]
    assert (text["hidden_act"], text["swiglu_alpha"], text["swiglu_limit"]) == ("swigluoai", 1.702, 7.0)
    from safetensors import safe_open
    with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["hidden_act"], meta["swiglu_alpha"], meta["swiglu_limit"]) == ("swigluoai", "1.702", "7.0")


@pytest.mark.parametrize("vllm, beta", [("0.33", "beta 1.0 (default)"), ("0.34", "beta 1.0 (fixed)")])
def test_serving_vllm_rocm_passes_triton_sglang_fails(done, vllm, beta):
    """vLLM 0.33 passes the config's swiglu_beta (1.0 when absent); 0.34's class fixes it at 1.0."""
    _, dst = done
    ok = {r.rule: r for r in serving.rules(dst, "vllm-rocm", 1, vllm=vllm)}
    assert all(r.ok for r in ok.values()), [r.message for r in ok.values() if not r.ok]
    note = ok["kernel"].message
    assert "TRITON (TritonWNA16Experts)" in note and "swigluoai_uninterleave" in note
    assert "alpha 1.702" in note and "limit 7.0" in note and beta in note
    sg = {r.rule: r for r in serving.rules(dst, "sglang-rocm", 1)}
    assert not sg["kernel"].ok and "asserts activation == 'silu'" in sg["kernel"].message


def test_a_non_expert_mxfp4_linear_becomes_exact_bf16(done, tmp_path):
    """The profile converts routed experts only: an MXFP4 attention linear (compressed-tensors names:
    X.weight_packed) becomes a plain bf16 X.weight holding exactly its MXFP4 values, left out of the
    int4 targets, and verify --source checks it; the experts are the same int4 as without it."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import assert_verified_and_on_triton, ct_mxfp4_encode, write_json

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    mm3.write(src)
    path = os.path.join(src, "model.safetensors")
    t = load_file(path)
    name = "language_model.model.layers.1.self_attn.o_proj"
    t[f"{name}.weight_packed"], t[f"{name}.weight_scale"] = ct_mxfp4_encode(t.pop(f"{name}.weight").float())
    save_file(t, path, metadata={"format": "pt"})
    cfg = read_json(os.path.join(src, "config.json"))
    cfg["quantization_config"]["ignore"] = [i for i in cfg["quantization_config"]["ignore"] if "self_attn" not in i]
    write_json(os.path.join(src, "config.json"), cfg)
    convert(src, dst, Options())
    ours, before, plain = all_tensors(dst), all_tensors(src), all_tensors(done[1])
    assert f"{name}.weight_packed" not in ours and ours[f"{name}.weight"][1].dtype == torch.bfloat16
    assert torch.equal(ours[f"{name}.weight"][1].double(),
                       ct_mxfp4_values(before[f"{name}.weight_packed"][1], before[f"{name}.weight_scale"][1]))
    assert set(ours) == set(plain)
    assert all(tensor_bytes(ours[n][1]) == tensor_bytes(plain[n][1]) for n in plain if ".experts." in n)
    group = read_json(os.path.join(dst, "config.json"))["quantization_config"]["config_groups"]["group_0"]
    assert not any(match_name(name, x) for x in group["targets"])
    assert_verified_and_on_triton(src, dst, activation="swigluoai_uninterleave")


def test_quark_w4a4_export_converts_weight_only_to_the_same_int4(done, tmp_path):
    """A Quark MXFP4 W4A4 block (written by amd-quark's exporter) over the same expert bytes: the
    minimax-m3-quark profile reads it, refuses it without --drop-activation-quant, and with it
    writes int4 byte-identical to the compressed-tensors route's, the dropped spec recorded."""
    from quark_fixture import export_quark_mxfp4

    from converter.errors import BadInput

    block = read_json(os.path.join(export_quark_mxfp4(str(tmp_path / "q"), variant="w4a4"), "config.json"))
    src = str(tmp_path / "src")
    mm3.write_quark(src, block["quantization_config"])
    with pytest.raises(BadInput, match="--drop-activation-quant"):
        convert(src, str(tmp_path / "refused"), Options())
    dst = str(tmp_path / "dst")
    convert(src, dst, Options(drop_activation_quant=True))
    manifest = read_json(os.path.join(dst, "k3convert_manifest.json"))
    assert manifest["source"]["profile"]["name"] == "minimax-m3-quark"
    assert manifest["source"]["quantization"]["dialect"] == "quark" and manifest["source"]["quantization"]["dropped"]
    ours, ct = all_tensors(dst), all_tensors(done[1])
    assert set(ours) == set(ct)
    for n in ct:
        assert tensor_bytes(ours[n][1]) == tensor_bytes(ct[n][1]), n


def test_an_incomplete_download_is_caught_by_the_inventory(tmp_path):
    """The profile's inventory (moe_layer_freq x num_local_experts x w1/w2/w3) names a missing expert."""
    src = str(tmp_path / "src")
    mm3.write(src)
    assert_missing_module_named(src, "model.safetensors",
                                "language_model.model.layers.2.block_sparse_moe.experts.3.w2",
                                (".weight_packed", ".weight_scale"), 24, str(tmp_path / "dst"))


# ---------------------------------------------------------------------------- the real writers (issue 26 §1)

def test_auto_round_model_free_export_converts_to_the_same_int4(done, tmp_path):
    """auto-round 0.16's model-free MXFP4 export (minimax_m3_fixture.write_auto_round): W4A4 preset on
    targets ["Linear"], exact-name ignore, provider auto-round, two metadata-free shards, total_size 0,
    a quantization_config.json beside config.json. It is refused without --drop-activation-quant; with
    it the int4 is byte-identical to the compressed-tensors route's, and the stale quantization_config.json
    (MXFP4 W4A4, targets Linear) is not copied into DST."""
    from converter.errors import BadInput
    from converter.verify import verify

    src = str(tmp_path / "src")
    mm3.write_auto_round(src)
    with pytest.raises(BadInput, match="input activations.*--drop-activation-quant"):
        convert(src, str(tmp_path / "refused"), Options())
    dst = str(tmp_path / "dst")
    convert(src, dst, Options(drop_activation_quant=True))
    assert not os.path.exists(os.path.join(dst, "quantization_config.json"))
    assert read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]["profile"]["name"] == "minimax-m3"
    ours, ct = all_tensors(dst), all_tensors(done[1])
    assert set(ours) == set(ct)
    for n in ct:
        assert tensor_bytes(ours[n][1]) == tensor_bytes(ct[n][1]), n
    result = verify(dst, src)
    assert result.ok, [p for c in result.checks for p in c.problems]


def test_auto_round_bytes_are_ocp_whatever_compressed_tensors_version_wrote_the_config(done, tmp_path):
    """auto-round packs E8M0 itself (exponent + 127, qlinear_fp.py 44, 170): a config written under
    compressed-tensors 0.13.1a20260108 (whose own packer used bias 125) still holds OCP bytes. Read by
    the version alone (74b0137), every scale would be shifted by 2 (4x the weights)."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    mm3.write_auto_round(src, version="0.13.1a20260108")
    convert(src, dst, Options(drop_activation_quant=True))
    quant = read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]["quantization"]
    assert quant["scale_bias"] == 127 and "auto-round" in quant["scale_convention"]
    ours, ct = all_tensors(dst), all_tensors(done[1])
    for n in ct:
        assert tensor_bytes(ours[n][1]) == tensor_bytes(ct[n][1]), n


def test_quark_minimax_m3_vl_template_as_shipped(done, tmp_path):
    """amd-quark 0.13's minimax_m3_vl template (quantization/config/template.py) excludes the head,
    vision tower, projector, router and attention only: its export holds MXFP4 shared experts (and
    dense MLPs). Every such linear becomes an exact bf16 weight; the routed experts are the same int4
    as the compressed-tensors build's; verify --source and the serving model pass."""
    from tests.conftest import assert_verified_and_on_triton

    pytest.importorskip("quark.torch.quantization.config.template")
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    linears = mm3.write_quark_template(src)
    assert linears and all(".shared_experts." in m or ".mlp." in m for m in linears), linears
    convert(src, dst, Options(drop_activation_quant=True))
    ours, before, ct = all_tensors(dst), all_tensors(src), all_tensors(done[1])
    for m in linears:
        assert ours[f"{m}.weight"][1].dtype == torch.bfloat16, m
        assert torch.equal(ours[f"{m}.weight"][1].double(),
                           ct_mxfp4_values(before[f"{m}.weight"][1], before[f"{m}.weight_scale"][1])), m
    assert all(tensor_bytes(ours[n][1]) == tensor_bytes(ct[n][1]) for n in ct if ".experts." in n)
    assert read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]["dequantized"] == linears
    assert_verified_and_on_triton(src, dst, activation="swigluoai_uninterleave")