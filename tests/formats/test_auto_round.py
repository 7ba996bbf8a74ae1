"""auto-round's own format (``quant_method "auto-round"``) with MXFP4 weights (issue 35 §3).

The source is auto-round 0.16.1's own export (``quantize_and_save(format="auto_round")``, scheme
MXFP4, on a tiny Mixtral), written once by ``tests/support/data/auto-round/make_fixtures.py`` and committed:
its config says ``packing_format "auto_round:llm_compressor"``, ``data_type "mx_fp"``, W4A4 with
dynamic MXFP4 inputs, and an ``extra_config`` regex that keeps the router bf16. Values are checked
against compressed-tensors' decode of the same bytes (a decoder we did not write).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from converter.errors import BadInput
from converter.formats.auto_round import AutoRoundSource, auto_round_source
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.verify import brute_force_min
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import (
    MANIFEST,
    all_tensors,
    assert_verified_and_on_triton,
    ct_int4_values,
    ct_mxfp4_values,
    read_json,
    with_config,
)

SRC = os.path.join(str(support.DATA), "auto-round", "mxfp4")
LAYER = "model.layers.0"
EXPERTS = {f"{LAYER}.block_sparse_moe.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
ATTENTION = {f"{LAYER}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """(src copy, dst) of the export converted with --drop-activation-quant."""
    root = tmp_path_factory.mktemp("auto_round")
    src, dst = str(root / "src"), str(root / "dst")
    shutil.copytree(SRC, src)
    convert(src, dst, Options(drop_activation_quant=True))
    return src, dst


def test_the_fixture_is_auto_rounds_own_format():
    """What the committed export says, so the tests below read what auto-round writes (not a restatement)."""
    block = read_json(os.path.join(SRC, "config.json"))["quantization_config"]
    assert block["quant_method"] == "auto-round" and block["packing_format"] == "auto_round:llm_compressor"
    assert (block["bits"], block["group_size"], block["data_type"], block["autoround_version"]) == (4, 32, "mx_fp", "0.16.1")
    assert block["act_bits"] == 4 and block["act_dynamic"] is True


def test_w4a4_refused_without_the_flag(tmp_path):
    """Dynamic MXFP4 input activations: named, with the flag that drops them (before this dialect the
    message was "quant_method='auto-round' ... k3convert converts ...")."""
    with pytest.raises(BadInput, match="input activations.*mx_fp.*--drop-activation-quant") as e:
        convert(SRC, str(tmp_path / "dst"), Options())
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "dst" / "config.json")


def test_experts_int4_the_other_mxfp4_linears_exact_bf16(done):
    """auto-round's MXFP4 scheme packs attention too: the routed experts become int4, attention an exact
    bf16 weight (compressed-tensors' decode of the same bytes, bit for bit), as the experts-only profiles do."""
    src, dst = done
    out, s = all_tensors(dst), all_tensors(src)
    converted = {n[: -len(".weight_packed")] for n in out if n.endswith(".weight_packed")}
    assert converted == EXPERTS
    for m in converted:
        assert out[f"{m}.weight_packed"][1].dtype == torch.int32 and out[f"{m}.weight_scale"][1].dtype == torch.bfloat16
    for m in ATTENTION:
        w = out[f"{m}.weight"][1]
        ref = ct_mxfp4_values(s[f"{m}.weight_packed"][1], s[f"{m}.weight_scale"][1])
        assert w.dtype == torch.bfloat16 and torch.equal(w.double(), ref), m
    assert out[f"{LAYER}.block_sparse_moe.gate.weight"][1].dtype == torch.bfloat16   # the router: extra_config bits 16
    manifest = read_json(os.path.join(dst, MANIFEST))
    quant = manifest["source"]["quantization"]
    assert manifest["source_format"] == "auto-round MXFP4" and manifest["source"]["profile"]["name"] == "auto-round-mxfp4"
    assert quant["dialect"] == "auto-round" and quant["scale_bias"] == 127
    assert quant["dropped"] == [{"where": "quantization_config", "what": {
        "act_bits": 4, "act_group_size": 32, "act_sym": True, "act_data_type": "mx_fp", "act_dynamic": True}}]
    block = read_json(os.path.join(dst, "config.json"))["quantization_config"]
    assert block["quant_method"] == "compressed-tensors" and block["format"] == "pack-quantized"
    assert not os.path.exists(os.path.join(dst, "quantization_config.json"))   # it restated the MXFP4 block


def test_values_are_the_optimum_of_compressed_tensors_decode(done):
    """Every 32-group of every module is the least-squares int4 of the MXFP4 values compressed-tensors
    decodes from auto-round's bytes; a misread bias (x2) or nibble order would not be."""
    src, dst = done
    s, d = all_tensors(src), all_tensors(dst)
    for m in sorted(EXPERTS):
        ref = ct_mxfp4_values(s[f"{m}.weight_packed"][1], s[f"{m}.weight_scale"][1])
        got = ct_int4_values(d, m)
        assert 0 < float((got - ref).norm() / ref.norm()) < 0.15, m
        err = ((got - ref) ** 2).reshape(-1, 32).sum(1)
        best = brute_force_min(ref.reshape(-1, 32))
        assert not ((err - best).abs() > 1e-12 * best + 1e-300).any(), m
        wrong = ct_mxfp4_values(s[f"{m}.weight_packed"][1], s[f"{m}.weight_scale"][1] + 1)
        assert float((got - wrong).norm() / wrong.norm()) > 0.3, m


def test_verify_and_the_serving_check_pass(done):
    """verify --source passes, and stock vLLM 0.33 on gfx942 (its rules, tests/support/serving_rules.py) takes the
    experts with TRITON and SiLU, as for the other dialects' outputs."""
    src, dst = done
    assert_verified_and_on_triton(src, dst)


# ---------------------------------------------------------------- which modules, as auto-round's loader says

def _source(**block) -> AutoRoundSource:
    base = {"quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "bits": 4, "group_size": 32,
            "data_type": "mx_fp", "sym": True, "block_name_to_quantize": "model.layers"}
    return auto_round_source({"quantization_config": {**base, **block}}, "config.json")


def test_selection_follows_get_layer_config():
    """Exact extra_config names apply to that module only; other keys are regexes (re.search, first in file
    order); modules outside block_name_to_quantize are unquantized unless a key names them."""
    src = _source(extra_config={"model.layers.0.mlp.gate": {"bits": 16}, r".*shared.*": {"bits": 16},
                                r".*down_proj": {"bits": 4}, "lm_head": {"bits": 4}})
    src = src.seen({f"{n}.weight_packed": None for n in ("model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj",
                                                         "lm_head")})
    assert not src.selects("model.layers.0.mlp.gate")          # exact: bits 16
    assert src.selects("model.layers.0.mlp.gate_proj")         # the exact key is not a regex for it
    assert not src.selects("model.layers.0.mlp.shared_expert.down_proj")   # first regex wins
    assert src.selects("model.layers.0.mlp.experts.3.down_proj")
    assert src.selects("lm_head")                               # outside the blocks, but named
    assert not src.selects("model.embed_tokens")                # outside the blocks, not named


@pytest.mark.parametrize("block, needle", [
    ({"packing_format": "auto_round:auto_gptq"}, "packing_format is 'auto_round:auto_gptq'"),
    ({"extra_config": {r".*o_proj": {"bits": 8, "data_type": "int"}}}, "8-bit int"),
    ({"rotation_config": {"hadamard": True}}, "rotation_config is set"),
    ({"static_kv_dtype": "fp8"}, "KV cache"),
])
def test_what_int4_cannot_carry_is_refused(block, needle):
    with pytest.raises(BadInput, match=needle):
        _source(**block)


def test_a_packed_module_the_config_keeps_bf16_is_refused(tmp_path):
    """An extra_config entry that says bits 16 for a module whose bytes are packed: refused, not guessed."""
    m = f"{LAYER}.self_attn.q_proj"

    def edit(cfg):
        cfg["quantization_config"]["extra_config"][m] = {"bits": 16}
    src = with_config(SRC, str(tmp_path / "src"), edit)
    with pytest.raises(BadInput, match=f"does not select {m}"):
        convert(src, str(tmp_path / "dst"), Options(drop_activation_quant=True))


# ---------------------------------------------------------------- MiniMax-M3 in auto-round's format

def _auto_round_block(ignore: list[str]) -> dict:
    """What save_quantized_as_fp writes for MiniMax-M3 with the MXFP4 scheme and the non-expert linears
    kept bf16 (keys as in tests/support/data/auto-round/mxfp4/config.json, auto-round's own output): those by
    exact name in extra_config, the router by the regex auto-round's predefined ignore becomes."""
    keep = {"bits": 16, "data_type": "float", "act_bits": 16, "act_data_type": "float"}
    extra = {n: dict(keep) for n in ignore if not n.endswith("block_sparse_moe.gate")}
    extra[r".*block_sparse_moe\.gate.*"] = dict(keep)
    return {"act_bits": 4, "act_data_type": "mx_fp", "act_dynamic": True, "act_group_size": 32, "act_sym": True,
            "autoround_version": "0.16.1", "bits": 4, "block_name_to_quantize": "language_model.model.layers",
            "data_type": "mx_fp", "extra_config": extra, "group_size": 32, "iters": 0,
            "packing_format": "auto_round:llm_compressor", "quant_method": "auto-round", "sym": True}


def test_minimax_m3_in_auto_rounds_format_gives_the_llm_compressor_exports_int4(tmp_path):
    """The same MiniMax-M3 bytes described by auto-round's own config convert (profile minimax-m3-auto-round:
    inventory, swiglu fields) to int4 byte-identical to its llm_compressor-format export's, and verify passes."""
    import minimax_m3_fixture as mm3

    from tests.conftest import tensor_bytes, write_json

    lc, ar = str(tmp_path / "lc"), str(tmp_path / "ar")
    mm3.write_auto_round(lc)
    mm3.write_auto_round(ar)
    cfg = read_json(os.path.join(ar, "config.json"))
    cfg["quantization_config"] = _auto_round_block(cfg["quantization_config"]["ignore"])
    write_json(os.path.join(ar, "config.json"), cfg)
    write_json(os.path.join(ar, "quantization_config.json"), cfg["quantization_config"])
    outs = {}
    for src in (lc, ar):
        outs[src] = src + "-int4"
        convert(src, outs[src], Options(drop_activation_quant=True))
    manifest = read_json(os.path.join(outs[ar], MANIFEST))
    assert manifest["source"]["profile"]["name"] == "minimax-m3-auto-round"
    assert manifest["source"]["quantization"]["dialect"] == "auto-round"
    a, b = all_tensors(outs[lc]), all_tensors(outs[ar])
    assert set(a) == set(b)
    for n in a:
        assert tensor_bytes(a[n][1]) == tensor_bytes(b[n][1]), n
    assert_verified_and_on_triton(ar, outs[ar], activation="swigluoai_uninterleave")
