"""Source configs the converter must not silently change (issue 8 §4, docs/mxfp4_dialects.md).

Every quantization_config here is written by compressed-tensors itself (its presets, its
QuantizationConfig / TransformConfig / sparsity classes, ModelCompressor.update_config), and the
scale-convention tests run on tests/support/data/ct013-mxfp4, bytes written by the real
compressed-tensors 0.13.0 together with the weights 0.13.0 itself dequantized from them.
"""
from __future__ import annotations

import copy
import os
import re
import tempfile

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.config import Sparse24BitMaskConfig
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme
from safetensors.torch import load_file

from converter.fixture import IGNORE
from converter.run.plan import build_plan
from converter.verify import brute_force_min
from tests.conftest import REPORT, assert_not_complete, ct_int4_q, read_json, write_json
from tests.models.test_profiles import CT013, converts, ct013_copy, refused

CT_EXPERTS = "model.layers.1.block_sparse_moe.experts."
MXFP4 = PRESET_SCHEMES["MXFP4"]  # W4A4: MXFP4 weights, dynamic MXFP4 input activations
BLOCK = "text_config.quantization_config"


def ct_block(groups: dict[str, QuantizationScheme], fmt: str = "mxfp4-pack-quantized", status: str = "compressed",
             kv_cache: QuantizationArgs | None = None, transform: TransformConfig | None = None) -> dict:
    """The quantization_config compressed-tensors' ModelCompressor.update_config writes for these groups."""
    qc = QuantizationConfig(config_groups=groups, format=fmt, quantization_status=status, ignore=list(IGNORE),
                            kv_cache_scheme=kv_cache)
    with tempfile.TemporaryDirectory() as d:
        ModelCompressor(quantization_config=qc, transform_config=transform).update_config(d)
        return read_json(os.path.join(d, "config.json"))["quantization_config"]


def w4a16() -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["MXFP4A16"])


def set_block(src: str, block: dict) -> str:
    """Put ``block`` where Kimi K3 has its quantization_config; returns config.json's path."""
    path = os.path.join(src, "config.json")
    cfg = read_json(path)
    cfg["text_config"]["quantization_config"] = block
    write_json(path, cfg)
    return path


# ------------------------------------------------------------------ 1. activation quantization

ACTIVATION_CASES = {
    "input_activations": lambda: QuantizationScheme(targets=["Linear"], **MXFP4),
    "output_activations": lambda: QuantizationScheme(targets=["Linear"], weights=MXFP4["weights"],
                                                     output_activations=MXFP4["input_activations"]),
}


@pytest.mark.parametrize("key", sorted(ACTIVATION_CASES))
def test_activation_quantization_is_refused_or_dropped_on_record(src_copy, tmp_path, key):
    block = ct_block({"group_0": ACTIVATION_CASES[key]()})
    assert block["config_groups"]["group_0"][key]["num_bits"] == 4
    cfg_path = set_block(src_copy, block)
    err = refused(src_copy, tmp_path, f"file {cfg_path}", f"{BLOCK}.config_groups.group_0", "--drop-activation-quant")
    assert re.search(key.replace("_", "[_ ]"), err), err
    assert_not_complete(str(tmp_path / "dst"))

    dst = str(tmp_path / "out")
    manifest = converts(src_copy, dst, "--drop-activation-quant")
    want = [{"where": f"{BLOCK}.config_groups.group_0.{key}", "what": block["config_groups"]["group_0"][key]}]
    assert manifest["source"]["quantization"]["dropped"] == want
    assert read_json(os.path.join(dst, REPORT))["quantization"]["dropped"] == want
    assert manifest["options"]["drop_activation_quant"] is True
    out = read_json(os.path.join(dst, "config.json"))["text_config"]["quantization_config"]
    assert all(g[key] is None for g in out["config_groups"].values())
    QuantizationConfig.model_validate(out)  # the library reads the weight-only block back


# ------------------------------------------------------------------ 2. other keys that cannot be carried

def _transform(block: dict) -> None:
    tc = TransformConfig(config_groups={"u": TransformScheme(type="hadamard", apply=[
        TransformArgs(targets=["Linear"], location="input"),
        TransformArgs(targets=["Linear"], location="weight_input", inverse=True)])})
    block["transform_config"] = ct_block({"group_0": w4a16()}, transform=tc)["transform_config"]


def _sparsity(block: dict) -> None:
    block["sparsity_config"] = Sparse24BitMaskConfig().model_dump()


def _fp8_attention(block: dict) -> None:
    mx = QuantizationScheme(targets=["Linear"], format="mxfp4-pack-quantized", **PRESET_SCHEMES["MXFP4A16"])
    fp8 = QuantizationScheme(targets=["re:.*self_attn.*"], format="float-quantized", **PRESET_SCHEMES["FP8"])
    block.clear()
    block.update(ct_block({"group_0": mx, "group_1": fp8}, fmt="mixed-precision"))


def _frozen(block: dict) -> None:
    block["quantization_status"] = ct_block({"group_0": w4a16()}, status="frozen")["quantization_status"]


@pytest.mark.parametrize("edit, key, needle", [
    (_transform, "transform_config", "is set"),
    (_sparsity, "sparsity_config", "sparse-24-bitmask"),
    (_fp8_attention, "config_groups.group_1", "float-quantized"),
    (_frozen, "quantization_status", "frozen"),
])
def test_config_keys_that_an_int4_output_cannot_carry_are_refused(src_copy, tmp_path, edit, key, needle):
    block = ct_block({"group_0": w4a16()})
    edit(block)
    cfg_path = set_block(src_copy, block)
    err = refused(src_copy, tmp_path, f"file {cfg_path}", f"{BLOCK}.{key}", needle)
    assert "--drop-activation-quant" not in err  # no flag makes these convert
    refused(src_copy, tmp_path, f"{BLOCK}.{key}", args=("--drop-activation-quant",))


def test_the_plain_library_block_converts(src_copy, tmp_path):
    """The control for the refusals above: the same block without the edit converts."""
    set_block(src_copy, ct_block({"group_0": w4a16()}))
    converts(src_copy, str(tmp_path / "out"))


# ------------------------------------------------------------------ 3. the scale convention

def ct_decode(dst: str) -> dict[str, torch.Tensor]:
    """module.weight -> float64 weights of the converted output: compressed-tensors' unpack_from_int32 x scale."""
    out = load_file(os.path.join(dst, "model.safetensors"))
    decoded = {}
    for name in load_file(os.path.join(CT013, "expected.safetensors")):
        m = name[: -len(".weight")]
        q = ct_int4_q(out[f"{m}.weight_packed"], out[f"{m}.weight_shape"]).double()
        decoded[name] = q * out[f"{m}.weight_scale"].double().repeat_interleave(32, dim=1)
    return decoded


def rel_errors(dst: str) -> dict[str, float]:
    expected = load_file(os.path.join(CT013, "expected.safetensors"))
    return {n: float((w - expected[n].double()).norm() / expected[n].double().norm())
            for n, w in ct_decode(dst).items()}


def with_version(tmp_path, version: str | None, name: str = "src") -> str:
    src = ct013_copy(tmp_path, name)
    path = os.path.join(src, "config.json")
    cfg = read_json(path)
    if version is None:
        del cfg["quantization_config"]["version"]
    else:
        cfg["quantization_config"]["version"] = version
    write_json(path, cfg)
    return src


def test_ct013_converts_with_the_optimal_error_against_its_own_dequantization(tmp_path):
    assert read_json(os.path.join(CT013, "config.json"))["quantization_config"]["version"] == "0.13.0"
    dst = str(tmp_path / "out")
    manifest = converts(ct013_copy(tmp_path), dst)
    q = manifest["source"]["quantization"]
    assert q["scale_bias"] == 125 and "0.13.0" in q["scale_convention"] and "bias 125" in q["scale_convention"]

    expected = load_file(os.path.join(CT013, "expected.safetensors"))
    decoded = ct_decode(dst)
    assert len(decoded) == 6
    for name, w in decoded.items():
        e = expected[name].double()
        assert torch.isfinite(w).all()
        rel = float((w - e).norm() / e.norm())
        off = float((w / 4 - e).norm() / e.norm())  # what reading the bytes as OCP would give
        assert rel < 0.15 and off > 0.7, (name, rel, off)
        # group by group, no int4 group-32 form with a bf16 scale is closer to 0.13.0's own weights
        err = ((w - e) ** 2).reshape(-1, 32).sum(1)
        best = brute_force_min(e.reshape(-1, 32))
        torch.testing.assert_close(err, best, rtol=1e-9, atol=0.0)
    zero = decoded[CT_EXPERTS + "1.w2.weight"][3, 32:64]  # the fixture's all-zero group (stored as 254)
    assert expected[CT_EXPERTS + "1.w2.weight"][3, 32:64].abs().max() == 0 and bool((zero == 0).all())


def test_the_version_is_what_selects_the_convention(tmp_path):
    """The same bytes under "version": "0.14.0" (OCP) convert, and come out exactly 4x smaller than
    0.13.0's weights: a relative error of 0.75, which the measure above would catch."""
    dst = str(tmp_path / "out")
    q = converts(with_version(tmp_path, "0.14.0"), dst)["source"]["quantization"]
    assert q["scale_bias"] == 127 and "0.14.0" in q["scale_convention"]
    expected = load_file(os.path.join(CT013, "expected.safetensors"))
    for name, w in ct_decode(dst).items():
        e = expected[name].double()
        assert abs(float((w - e).norm() / e.norm()) - 0.75) < 0.01, name
        assert abs(float(w.norm() / e.norm()) - 0.25) < 0.01, name


@pytest.mark.parametrize("version, bias", [
    ("0.12.3a20251212", 125), ("0.12.3.a20251212", 125), ("0.13.0", 125), ("0.13.1a20260108", 125),
    ("0.13.1a20260109", 127), ("0.13.1a20260116", 127), ("0.14.0", 127), ("0.20.1", 127),
    ("0.18.1.dev0+gac8e2ba.d20260813", 127),
])
def test_versions_either_side_of_the_bias_125_era(tmp_path, version, bias):
    """docs/mxfp4_dialects.md §1-2: the nightly and release boundaries of the bias-125 encoder."""
    assert build_plan(with_version(tmp_path, version)).source.scale_bias == bias


@pytest.mark.parametrize("version", ["0.12.3a20251101", "0.12.3a20251203", "0.13.1.dev5+gabc", "0.12.3.dev2",
                                     "0.12.2", "not-a-version"])
def test_versions_whose_scales_cannot_be_read_are_refused(tmp_path, version):
    src = with_version(tmp_path, version)
    refused(src, tmp_path, f"file {os.path.join(src, 'config.json')}", f"quantization_config.version {version}"
            if version != "not-a-version" else repr(version))


def test_no_version_converts_as_ocp_and_says_so(tmp_path):
    q = converts(with_version(tmp_path, None), str(tmp_path / "out"))["source"]["quantization"]
    assert q["scale_bias"] == 127 and "names no compressed-tensors version" in q["scale_convention"]
    assert all(abs(r - 0.75) < 0.01 for r in rel_errors(str(tmp_path / "out")).values())


# ------------------------------------------------------------------ 4. the output config

def test_output_config_drops_version_keeps_ignore(tmp_path):
    dst = str(tmp_path / "out")
    converts(ct013_copy(tmp_path), dst)
    src_block = read_json(os.path.join(CT013, "config.json"))["quantization_config"]
    out = read_json(os.path.join(dst, "config.json"))["quantization_config"]
    assert "version" in src_block and "version" not in out
    assert out["ignore"] == src_block["ignore"] == ["model.layers.1.block_sparse_moe.gate"]
    assert QuantizationConfig.model_validate(out).ignore == src_block["ignore"]


def test_output_config_keeps_kv_cache_scheme(src_copy, tmp_path):
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    block = ct_block({"group_0": w4a16()}, kv_cache=kv)
    assert block["kv_cache_scheme"]["num_bits"] == 8 and block["version"]
    set_block(src_copy, copy.deepcopy(block))
    dst = str(tmp_path / "out")
    converts(src_copy, dst)
    out = read_json(os.path.join(dst, "config.json"))["text_config"]["quantization_config"]
    assert out["kv_cache_scheme"] == block["kv_cache_scheme"]
    assert out["ignore"] == block["ignore"] == IGNORE and "version" not in out
    assert QuantizationConfig.model_validate(out).kv_cache_scheme == kv
