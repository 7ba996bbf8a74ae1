"""MiMo-V2 FP4 (vLLM's FP8 config with ``store_dtype: mxfp4``): converts from a fixture shaped as
vLLM's loader expects (tests/support/mimo_v2_fixture.py), decoded by compressed-tensors.

What must hold: the routed experts become int4 and the config selects them under vLLM's lookup
names; every FP8 linear keeps its bytes, its ``weight_scale_inv`` written as ``weight_scale``
(what vLLM's compressed-tensors FP8 scheme loads) and is named by an FP8 block group; the rest
is byte-identical under its own name; ``verify`` passes with the source; vLLM and SGLang's
serving models pass (silu); a fused-qkv (Pro) layout and a non-MXFP4 FP8 config are refused.
"""
from __future__ import annotations

import os

import mimo_v2_fixture as mimo
import pytest
import serving_rules as serving
import torch

from converter.errors import BadInput
from converter.formats.match import match_name
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.verify import verify
from tests.conftest import (
    all_tensors,
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


# --- TP 8 (issue 35 §2): --fp8-bf16-at-tp writes the FP8 linears vLLM refuses there as bf16 ---------------

ATTN = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def flash_tp8(tmp_path_factory):
    """(src, default dst, --fp8-bf16-at-tp 8 dst, the FP8 linears' float weights before FP8)."""
    root = tmp_path_factory.mktemp("mimo-tp8")
    originals: dict = {}
    src = str(root / "src")
    mimo.write(src, text=mimo.FLASH_TP8, originals=originals)
    convert(src, str(root / "dst"), Options())
    convert(src, str(root / "dst-tp8"), Options(fp8_bf16_tp=8))
    return src, str(root / "dst"), str(root / "dst-tp8"), originals


@pytest.mark.parametrize("vllm", ["0.33", "0.34"])
def test_the_default_output_is_refused_at_tp_8_and_the_opt_in_loads(flash_tp8, vllm):
    """MiMo-V2-Flash's attention at TP 8: q 192 rows a rank, one replicated KV head of 192: vLLM's
    compressed-tensors FP8 scheme refuses the qkv_proj (fp8_utils.py 1296-1344). The default output says
    so; with --fp8-bf16-at-tp 8 every rule passes at TP 8 (and at TP 1)."""
    _, dst, tp8, _ = flash_tp8
    loader = {r.rule: r for r in serving.rules(dst, "vllm-rocm", 8, vllm=vllm)}["loader"]
    assert not loader.ok and "self_attn.q_proj+k_proj+v_proj: per-rank output q_proj 192, k_proj 192 not " \
                             "whole 128-blocks at TP 8" in loader.message, loader.message
    for tp in (1, 2, 4, 8):
        bad = [r.message for r in serving.rules(tp8, "vllm-rocm", tp, vllm=vllm) if not r.ok]
        assert not bad, (tp, bad)


def test_the_opt_in_writes_only_the_refused_linears_as_bf16_and_states_the_cost(flash_tp8):
    """Only q/k/v become bf16 (each e4m3 value x its fp32 block scale, rounded to bf16); o_proj and the
    MLPs keep their FP8 bytes; the manifest and report say which, why and the bound; verify --source
    checks the values and states the added error. Measured: the bf16 rounding adds ~0.2% relative RMS
    (at most 2^-8 a value) to FP8's own ~2.6% against the original weights."""
    from converter.formats import fp8_block
    src, dst, tp8, originals = flash_tp8
    before, after = all_tensors(src), all_tensors(tp8)
    bf16 = [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ATTN]
    for m in bf16:
        w, s = before[f"{m}.weight"][1], before[f"{m}.weight_scale_inv"][1]
        got = after[f"{m}.weight"][1]
        assert got.dtype == torch.bfloat16 and f"{m}.weight_scale" not in after
        assert torch.equal(got, fp8_block.to_bf16(w, s, (128, 128)))
        worst, added = fp8_block.rel_error(w, s, (128, 128))
        fp8 = w.double() * s.double().repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)
        own = float((fp8 - originals[m].double()).norm() / originals[m].double().norm())
        assert 0 < worst <= 2 ** -8 and added < own / 8, (m, worst, added, own)
    kept = [m for m in originals if m not in bf16]
    assert kept and all(tensor_bytes(before[f"{m}.weight"][1]) == tensor_bytes(after[f"{m}.weight"][1]) and
                        tensor_bytes(before[f"{m}.weight_scale_inv"][1]) == tensor_bytes(after[f"{m}.weight_scale"][1])
                        for m in kept)
    targets = read_json(os.path.join(tp8, "config.json"))["quantization_config"]["config_groups"]["group_1"]["targets"]
    assert sorted(kept) == sorted(targets)
    manifest, report = (read_json(os.path.join(tp8, f)) for f in ("k3convert_manifest.json", "k3convert_report.json"))
    for record in (manifest["source"]["quantization"]["fp8_to_bf16"], report["quantization"]["fp8_to_bf16"]):
        assert record["modules"] == sorted(bf16) and "--fp8-bf16-at-tp 8" in record["why"][0]
        assert "within 2^-8 of the value" in record["values"]
    assert read_json(os.path.join(tp8, "k3convert_manifest.json"))["options"]["fp8_bf16_tp"] == 8
    from converter.hub.upload import model_card
    card = model_card(tp8, repo_id="org/mimo-int4")
    assert "- Except 9 FP8 linear(s) (e.g. `model.layers.0.self_attn.k_proj`) written as bf16 (--fp8-bf16-at-tp 8" \
        in card and "within 2^-8 of the value" in card
    assert "FP8 linear(s)" not in model_card(flash_tp8[1], repo_id="org/mimo-int4")
    result = verify(tp8, src)
    assert result.ok, [p for c in result.checks for p in c.problems]
    summary = {c.name: c for c in result.checks}["passthrough"].summary
    assert " of 9 FP8 linear(s) written as bf16" in summary and "added error against the FP8 values" in summary


def test_the_default_is_unchanged(flash_tp8):
    """Without the option every FP8 linear keeps its bytes and nothing says fp8_to_bf16."""
    src, dst, _, originals = flash_tp8
    before, after = all_tensors(src), all_tensors(dst)
    assert all(tensor_bytes(before[f"{m}.weight"][1]) == tensor_bytes(after[f"{m}.weight"][1]) for m in originals)
    assert "fp8_to_bf16" not in read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]["quantization"]
    assert "fp8_bf16_tp" not in read_json(os.path.join(dst, "k3convert_manifest.json"))["options"]


def test_the_option_is_refused_where_it_means_nothing(flash_tp8, fixture_src, tmp_path):
    """0 is no TP size (library and CLI: exit 2); a source without FP8 block linears (Kimi K3's
    compressed-tensors MXFP4) has nothing to write as bf16: refused in one line, DST not made."""
    from click.testing import CliRunner

    from converter.cli import main
    with pytest.raises(BadInput, match="--fp8-bf16-at-tp 0: expected a whole number >= 1"):
        convert(flash_tp8[0], str(tmp_path / "a"), Options(fp8_bf16_tp=0))
    run = CliRunner().invoke(main, ["mxfp4-to-int4", flash_tp8[0], "-o", str(tmp_path / "b"), "--fp8-bf16-at-tp", "0"])
    assert run.exit_code == 2, run.output
    with pytest.raises(BadInput, match="--fp8-bf16-at-tp 8: the source has no FP8 block linears"):
        convert(fixture_src, str(tmp_path / "c"), Options(fp8_bf16_tp=8))
    assert not os.path.exists(tmp_path / "c" / "config.json")


def test_the_opt_in_reads_a_scale_from_another_shard(tmp_path):
    """A q/k/v weight in one file and its scale in the next (a many-shard layout): the bf16 value is still
    the weight times its own scales (verify --source re-derives every value), and the shard's record
    hashes the partner's scale bytes (sources.partner_ranges) as it does for split MXFP4 pairs."""
    from converter.run import sources
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    mimo.write(src, text=mimo.FLASH_TP8, shards=11)
    index = read_json(os.path.join(src, "model.safetensors.index.json"))["weight_map"]
    split = [m for m in (f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ATTN)
             if index[f"{m}.weight"] != index[f"{m}.weight_scale_inv"]]
    assert split, "no q/k/v with its scale in another shard: change the shard count"
    convert(src, dst, Options(fp8_bf16_tp=8))
    result = verify(dst, src, sample=None)   # every tensor
    assert result.ok, [p for c in result.checks for p in c.problems]
    assert "9 of 9 FP8 linear(s) written as bf16" in {c.name: c for c in result.checks}["passthrough"].summary
    plan = Options(fp8_bf16_tp=8).plan(src)
    shard = next(s for s in plan.shards for f in s.fp8_dequants if f.module == split[0])
    assert sources.partner_ranges(shard)
