"""Issue 15 §1, input side: one case per defect of docs/reliability.md (D1-D5, D7, D8,
D15, D24-D26), each of which failed before its fix.

Source cases damage a copy of the session fixture (bytes with a hand-written safetensors
header walk, JSON as text) and run the CLI: a refusal is exit 2, one line naming the file
and the tensor, group or field. DST cases damage a copy of a real conversion and run
``verify``: a DST that is not exactly what k3convert writes fails with exit 5.
"""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors import safe_open

from conftest import (INDEX, MANIFEST, REPORT, assert_clean_error, assert_not_complete, ct_int4_q, read_json,
                      rewrite_shard, run_cli, sync_index, write_json)
from converter.formats import mxfp4
from converter.verify import brute_force_min

MOD = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
CONFIG = "config.json"


# ---------------------------------------------------------------- helpers

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


def edit_json(path: str, edit) -> None:
    obj = read_json(path)
    obj = edit(obj) or obj
    write_json(path, obj)


def edit_text(path: str, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    assert old in text, old
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


def quant_block(cfg: dict) -> dict:
    return cfg["text_config"]["quantization_config"]


def convert_cli(src: str, dst: str):
    return run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none")


# ---------------------------------------------------------------- D2: stored E8M0 bytes, raw

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
    assert_clean_error(convert_cli(src_copy, dst), f"file {shard}", f"tensor {MOD}.weight_scale",
                       "group 0 of row 0", needle, code=2)
    assert_not_complete(dst)


def test_ct013_all_zero_group_stored_as_254_still_converts_to_zeros(src_copy, tmp_path):
    """compressed-tensors 0.13.0 stores an all-zero group as 254 (docs/mxfp4_dialects.md §1): kept."""
    _ct013(src_copy)
    set_bytes(src_copy, f"{MOD}.weight_packed", 0, bytes(16))
    set_bytes(src_copy, f"{MOD}.weight_scale", 0, bytes([254]))
    dst = str(tmp_path / "dst")
    r = convert_cli(src_copy, dst)
    assert r.exit_code == 0, r.output
    wm = read_json(os.path.join(dst, INDEX))["weight_map"]
    with safe_open(os.path.join(dst, wm[f"{MOD}.weight_packed"]), "pt") as f:
        q = ct_int4_q(f.get_tensor(f"{MOD}.weight_packed"), f.get_tensor(f"{MOD}.weight_shape"))
    assert not q[0, :32].any()


# ---------------------------------------------------------------- D1: exponents near the top

def test_verify_source_decodes_the_top_exponents_exactly_and_the_converter_is_optimal_there(src_copy, tmp_path):
    """Stored bytes 253 and 254 (OCP: 6 * 2^127 overflows float32) in groups 0 and 1 of row 0."""
    set_bytes(src_copy, f"{MOD}.weight_scale", 0, bytes([253, 254]))
    dst = str(tmp_path / "dst")
    assert convert_cli(src_copy, dst).exit_code == 0
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


# ---------------------------------------------------------------- D7, D8: numbers in JSON

def _num_experts(value: str):
    def edit(src):
        edit_text(os.path.join(src, CONFIG), '"num_experts": 4', f'"num_experts": {value}')
        return CONFIG, "num_experts" if "e" not in value else None
    return edit


def _beta(value: str):
    def edit(src):
        edit_text(os.path.join(src, CONFIG), '"activation_situ_beta": 4.0', f'"activation_situ_beta": {value}')
        return CONFIG, None
    return edit


def _total_size(value: str):
    def edit(src):
        path = os.path.join(src, INDEX)
        total = read_json(path)["metadata"]["total_size"]
        edit_text(path, f'"total_size": {total}', f'"total_size": {value}')
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


# ---------------------------------------------------------------- D15: a zero dimension

@pytest.mark.parametrize("packed, scale", [((0, 48), (0, 3)), ((64, 0), (64, 0))], ids=["no-rows", "no-cols"])
def test_mxfp4_module_with_a_zero_dimension_is_refused_in_preflight(src_copy, tmp_path, packed, scale):
    for t, shape in ((f"{MOD}.weight_packed", packed), (f"{MOD}.weight_scale", scale)):
        rewrite_shard(_where(src_copy, t)[0], lambda d, t=t, shape=shape: d.update({t: torch.zeros(shape, dtype=torch.uint8)}))
    sync_index(src_copy)
    r = convert_cli(src_copy, str(tmp_path / "dst"))
    assert_clean_error(r, f"tensor {MOD}.weight_packed", "zero dimension", code=2)
    assert not os.path.exists(tmp_path / "dst")


# ---------------------------------------------------------------- D3, D4, D5: config fields

@pytest.mark.parametrize("field, value, needle", [
    ("group_size", 16, "config_groups.group_0.weights.group_size is 16, expected 32"),
    ("num_bits", 8, "config_groups.group_0.weights.num_bits is 8, expected 4"),
    ("type", "int", "config_groups.group_0.weights.type is 'int', expected 'float'"),
])
def test_an_mxfp4_block_with_other_weight_args_names_the_field(src_copy, tmp_path, field, value, needle):
    edit_json(os.path.join(src_copy, CONFIG),
              lambda c: quant_block(c)["config_groups"]["group_0"]["weights"].update({field: value}))
    err = assert_clean_error(convert_cli(src_copy, str(tmp_path / "dst")), CONFIG, needle, code=2)
    assert "k3convert converts compressed-tensors" not in err  # the old self-contradiction


def test_conflicting_activation_fields_are_refused_naming_both(src_copy, tmp_path):
    edit_json(os.path.join(src_copy, CONFIG), lambda c: c.update(hidden_act="silu"))
    assert_clean_error(convert_cli(src_copy, str(tmp_path / "dst")), CONFIG, "text_config.hidden_act is 'situ'",
                       "top-level hidden_act is 'silu'", code=2)


def test_a_quark_block_beside_a_compressed_tensors_block_names_the_mixed_dialects(src_copy, tmp_path):
    quark = {"quant_method": "quark", "export": {"weight_format": "real_quantized"},
             "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                                "scale_format": "e8m0"}}}
    edit_json(os.path.join(src_copy, CONFIG), lambda c: c.update(quantization_config=quark))
    err = assert_clean_error(convert_cli(src_copy, str(tmp_path / "dst")), "mixed quantization dialects",
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
    assert_clean_error(convert_cli(src_copy, str(tmp_path / "dst")), CONFIG, needle, code=2)


# ---------------------------------------------------------------- D24, D25, D26: verify

@pytest.fixture
def dst(converted, tmp_path):
    out = str(tmp_path / "dst")
    shutil.copytree(converted.dst, out)
    return out


def _groups(c):
    return quant_block(c)["config_groups"]


def _first_shard(m):
    return next(iter(m["shards"].values()))


# (file, edit, what the failing check says): verify exits 5 and names it
STRICT = {
    "targets-miss-the-experts": (CONFIG, lambda c: _groups(c)["group_0"].update(targets=["re:.*self_attn.*"]),
                                 "do not select 24 converted module(s)"),
    "targets-select-bf16": (CONFIG, lambda c: _groups(c)["group_0"]["targets"].append("re:.*embed_tokens$"),
                            "select 1 module(s) that are not int4 (a loader would look for int4 tensors): language_model.model.embed_tokens"),
    "ignore-drops-an-expert": (CONFIG, lambda c: quant_block(c)["ignore"].append(f"{MOD}"),
                               f"do not select 1 converted module(s) (a loader would read them as bf16): {MOD}"),
    "status-frozen": (CONFIG, lambda c: quant_block(c).update(quantization_status="frozen"),
                      "quantization_status is 'frozen', not 'compressed'"),
    "actorder-group": (CONFIG, lambda c: _groups(c)["group_0"]["weights"].update(actorder="group"),
                       "weights.actorder is 'group', expected None"),
    "dynamic-true": (CONFIG, lambda c: _groups(c)["group_0"]["weights"].update(dynamic=True),
                     "weights.dynamic is True, expected False"),
    "manifest-status": (MANIFEST, lambda m: m.update(status="failed-validation"),
                        "complete, but status is 'failed-validation'"),
    "manifest-target-format": (MANIFEST, lambda m: m.update(target_format="int8"), "target_format is 'int8'"),
    "manifest-source-format": (MANIFEST, lambda m: m.update(source_format="quark MXFP4"),
                               "source_format is 'quark MXFP4'"),
    "manifest-digest": (MANIFEST, lambda m: m.update(digest_algorithm="md5"), "digest_algorithm is 'md5'"),
}


@pytest.mark.parametrize("case", sorted(STRICT))
def test_verify_is_strict_about_what_dst_declares(dst, case):
    name, edit, needle = STRICT[case]
    ok = run_cli("verify", dst, "--no-checksums")
    assert ok.exit_code == 0, ok.output  # the undamaged copy passes: the damage below is what fails
    edit_json(os.path.join(dst, name), edit)
    r = run_cli("verify", dst, "--no-checksums")
    assert r.exit_code == 5, r.output
    assert "Traceback" not in r.output and needle in r.output, r.output


# (file, edit, field named): one line, exit 5, never a traceback
WRONG_TYPE = {
    "manifest-array": (MANIFEST, lambda m: [1], "the file is an array, expected an object"),
    "config-array": (CONFIG, lambda c: [1], "the file is an array, expected an object"),
    "shard-bytes-string": (MANIFEST, lambda m: _first_shard(m).update(bytes="big"),
                           ".bytes is a string (\"big\"), expected an integer"),
    "manifest-shards-array": (MANIFEST, lambda m: m.update(shards=[1]), "field shards is an array"),
    "manifest-complete-string": (MANIFEST, lambda m: m.update(complete="yes"), "field complete is a string"),
    "manifest-scale-bias-string": (MANIFEST, lambda m: m["source"]["quantization"].update(scale_bias="127"),
                                   "field source.quantization.scale_bias is a string"),
    "index-weight-map-number": (INDEX, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): 3}),
                                "is an integer (3), expected a string"),
    "index-total-size-string": (INDEX, lambda i: i["metadata"].update(total_size="1"),
                                "field metadata.total_size is a string"),
    "config-targets-string": (CONFIG, lambda c: _groups(c)["group_0"].update(targets="Linear"),
                              "field text_config.quantization_config.config_groups.group_0.targets is a string"),
    "config-groups-array": (CONFIG, lambda c: quant_block(c).update(config_groups=[1]),
                            "field text_config.quantization_config.config_groups is an array"),
    "config-text-config-array": (CONFIG, lambda c: c.update(text_config=[1]), "field text_config is an array"),
    "report-tensors-string": (REPORT, lambda r: r.update(tensors="24"), "field tensors is a string"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPE))
def test_verify_names_a_field_of_the_wrong_type(dst, case):
    name, edit, needle = WRONG_TYPE[case]
    edit_json(os.path.join(dst, name), edit)
    assert_clean_error(run_cli("verify", dst, "--no-checksums"), name, needle, code=5)
