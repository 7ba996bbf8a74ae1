"""`verify --serving`: each rule of the servers' int4 MoE path, both ways.

Every breaking case copies the session's converted DST, breaks exactly one rule (config.json
or a rewritten shard), and asserts that the check fails naming that rule, and only that rule,
for both servers. The passing side is our own output, and what compressed-tensors writes.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
from compressed_tensors.quantization.quant_scheme import W4A16

from converter.serving import RULES, SERVERS, check_serving, evaluate, fitting_tp
from conftest import (SPEC, read_json, rewrite_shard, run_cli, shard_names, sync_index,
                            write_json)

LAYER = "language_model.model.layers.1.block_sparse_moe.experts"   # the first MoE layer (shard 2)


# ---------------------------------------------------------------- helpers

@pytest.fixture
def dst(converted, tmp_path) -> str:
    """A private copy of the session's converted DST, to break."""
    path = str(tmp_path / "dst")
    shutil.copytree(converted.dst, path)
    return path


def edit_config(root: str, edit) -> None:
    cfg = read_json(os.path.join(root, "config.json"))
    edit(cfg)
    write_json(os.path.join(root, "config.json"), cfg)


def group0(cfg: dict) -> dict:
    return cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]


def edit_tensors(root: str, edit) -> None:
    """Apply ``edit(tensors)`` to every shard (metadata kept), then rebuild the index."""
    for s in shard_names(root):
        rewrite_shard(os.path.join(root, s), edit)
    sync_index(root)


def only_failure(root: str, rule: str, *needles: str, tp: int = 1) -> None:
    """For both servers: exactly ``rule`` fails, in one line naming it, the server and every needle."""
    for server in SERVERS:
        results = check_serving(root, server, tp)
        assert [r.rule for r in results] == list(RULES)
        failed = [r for r in results if not r.ok]
        assert [r.rule for r in failed] == [rule], [r.message for r in failed]
        msg = failed[0].message
        assert msg.startswith(f"rule {rule}: ") and "\n" not in msg, msg
        assert f"({server}: " in msg and msg.endswith(RULES[rule].fix), msg
        for n in needles:
            assert n in msg, f"{n!r} not in {msg}"


def all_pass(root: str, tp: int = 1) -> None:
    for server in SERVERS:
        failed = [r.message for r in check_serving(root, server, tp) if not r.ok]
        assert not failed, failed


def experts(tensors: dict, layer: str = LAYER) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in tensors if k.startswith(layer + ".")})


# ---------------------------------------------------------------- our output passes

@pytest.mark.parametrize("tp", [1, 2])
def test_our_output_passes(converted, tp):
    all_pass(converted.dst, tp)


def test_rules_agree_with_compressed_tensors():
    """What compressed-tensors itself writes for int4 group-32 W4A16 (its W4A16 preset at group 32:
    config block, initialized scale, packed weight) passes every rule; ours is checked against it."""
    scheme = QuantizationScheme(targets=["Linear"],
                                weights=QuantizationArgs(**{**W4A16["weights"].model_dump(), "group_size": 32}))
    block = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized").model_dump(mode="json")
    config = {"model_type": "mixtral", "torch_dtype": "bfloat16", "quantization_config": block,
              "moe_intermediate_size": SPEC.inter, "hidden_size": SPEC.latent}
    codes = {torch.int32: "I32", torch.bfloat16: "BF16"}
    tensors = {}
    for e in range(2):
        for proj, (out, inp) in (("w1", (SPEC.inter, SPEC.latent)), ("w3", (SPEC.inter, SPEC.latent)),
                                 ("w2", (SPEC.latent, SPEC.inter))):
            lin = torch.nn.Linear(inp, out, bias=False, dtype=torch.bfloat16)
            initialize_module_for_quantization(lin, scheme)
            sd = PackedQuantizationCompressor.compress(
                {"weight": torch.empty(out, inp, device="meta"), "weight_scale": lin.weight_scale}, scheme)
            for key in ("weight_packed", "weight_scale"):
                t = sd[key]
                tensors[f"model.layers.0.mlp.experts.{e}.{proj}.{key}"] = SimpleNamespace(
                    dtype=codes[t.dtype], shape=tuple(t.shape))   # all evaluate() reads of a header entry
    for server in SERVERS:
        for tp in (1, 2):
            assert [r.message for r in evaluate(config, tensors, server, tp) if not r.ok] == []


# ---------------------------------------------------------------- config rules

def _w(key, value):
    return lambda cfg: group0(cfg)["weights"].__setitem__(key, value)


CONFIG_CASES = {
    "format": (lambda cfg: group0(cfg).__setitem__("format", "int-quantized"), "'int-quantized'"),
    "format-method": (lambda cfg: cfg["text_config"]["quantization_config"].__setitem__("quant_method", "gptq"),
                      "'gptq'"),
    "num-bits": (_w("num_bits", 8), "num_bits is 8, not 4"),
    "type": (_w("type", "float"), 'type is "float", not "int"'),
    "symmetric": (_w("symmetric", False), "symmetric is false, not true"),
    "strategy": (_w("strategy", "channel"), 'strategy is "channel"'),
    "group-size": (_w("group_size", 128), "group_size is 128, not 32"),
    "actorder": (_w("actorder", "group"), 'actorder is "group", not null'),
    "static": (_w("dynamic", True), "dynamic is true, not false"),
    "input-activations": (lambda cfg: group0(cfg).__setitem__(
        "input_activations", {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
        "input_activations is set"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_rule_fails(dst, case):
    edit, needle = CONFIG_CASES[case]
    edit_config(dst, edit)
    only_failure(dst, case.removesuffix("-method"), "text_config.quantization_config", needle)


def test_every_quantization_config_is_checked(dst):
    """A second, top-level block that says asymmetric fails, although the nested one is right."""
    def add_top(cfg):
        top = copy.deepcopy(cfg["text_config"]["quantization_config"])
        top["config_groups"]["group_0"]["weights"]["symmetric"] = False
        cfg["quantization_config"] = top
    edit_config(dst, add_top)
    only_failure(dst, "symmetric", "quantization_config.config_groups.group_0.weights.symmetric is false")


def test_absent_keys_take_compressed_tensors_defaults(dst):
    """symmetric, type, actorder, dynamic, strategy absent: compressed-tensors' defaults, which pass."""
    edit_config(dst, lambda cfg: group0(cfg).__setitem__("weights", {"num_bits": 4, "group_size": 32}))
    all_pass(dst)
    edit_config(dst, lambda cfg: group0(cfg)["weights"].pop("num_bits"))   # default 8
    only_failure(dst, "num-bits", "num_bits is 8")


def test_no_config_fails_every_config_rule(dst):
    os.remove(os.path.join(dst, "config.json"))
    config_rules = {"format", "num-bits", "type", "symmetric", "strategy", "group-size", "actorder", "static",
                    "input-activations"}
    for server in SERVERS:
        failed = {r.rule: r.message for r in check_serving(dst, server, 1) if not r.ok}
        assert set(failed) == config_rules and all("no config.json" in m for m in failed.values())


# ---------------------------------------------------------------- tensor rules

def test_packed_left_as_uint8(dst):
    mod = f"{LAYER}.2.w3"
    def edit(t):
        if f"{mod}.weight_packed" in t:
            t[f"{mod}.weight_packed"] = torch.zeros(SPEC.inter, SPEC.latent // 2, dtype=torch.uint8)
    edit_tensors(dst, edit)
    only_failure(dst, "packed", f"{mod}.weight_packed is U8[64, 48], not I32")


def test_scale_not_in_model_dtype(dst):
    mod = f"{LAYER}.0.w2"
    def edit(t):
        if f"{mod}.weight_scale" in t:
            t[f"{mod}.weight_scale"] = t[f"{mod}.weight_scale"].float()
    edit_tensors(dst, edit)
    only_failure(dst, "scale-dtype", f"{mod}.weight_scale is F32, the model dtype is BF16")


def test_model_dtype_comes_from_config(dst):
    edit_config(dst, lambda cfg: cfg.__setitem__("torch_dtype", "float16"))
    only_failure(dst, "scale-dtype", "the model dtype is F16", "(and 23 more)")


def test_scale_wrong_shape(dst):
    mod = f"{LAYER}.1.w1"
    def edit(t):
        if f"{mod}.weight_scale" in t:
            t[f"{mod}.weight_scale"] = torch.ones(SPEC.inter, SPEC.latent // 16, dtype=torch.bfloat16)
    edit_tensors(dst, edit)
    only_failure(dst, "scale-shape", f"{mod}.weight_scale is [64, 6], not [64, 3]")


def _rename(mapping: dict[str, str], layer_filter: str = "") -> callable:
    def edit(t):
        for k in list(t):
            for old, new in mapping.items():
                if f".experts." in k and layer_filter in k and f".{old}." in k:
                    t[k.replace(f".{old}.", f".{new}.")] = t.pop(k)
    return edit


GATE_UP_DOWN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def test_gate_proj_names_pass_where_the_model_maps_them(dst):
    edit_tensors(dst, _rename(GATE_UP_DOWN))
    edit_config(dst, lambda cfg: (cfg.__setitem__("model_type", "deepseek_v3"),
                                  cfg["text_config"].__setitem__("model_type", "deepseek_v3")))
    all_pass(dst)


def test_gate_proj_names_fail_for_kimi(dst):
    edit_tensors(dst, _rename(GATE_UP_DOWN))
    only_failure(dst, "expert-names", "model_type kimi_k3 loads experts as w1/w2/w3", "24 are named gate_proj")


def test_mixed_expert_names_fail(dst):
    edit_tensors(dst, _rename(GATE_UP_DOWN, layer_filter="layers.2."))
    edit_config(dst, lambda cfg: (cfg.__setitem__("model_type", "deepseek_v3"),
                                  cfg["text_config"].__setitem__("model_type", "deepseek_v3")))
    only_failure(dst, "expert-names", "mix w1/w2/w3 (12) and gate_proj/up_proj/down_proj (12)")


def test_quantized_module_that_is_no_expert(dst):
    extra = "language_model.model.layers.1.block_sparse_moe.router_proj"
    def edit(t):
        if f"{LAYER}.0.w1.weight_packed" in t:
            for key in ("weight_packed", "weight_scale"):
                t[f"{extra}.{key}"] = t[f"{LAYER}.0.w1.{key}"].clone()
    edit_tensors(dst, edit)
    only_failure(dst, "expert-names", f"{extra} is quantized but is not named")


def test_expert_missing_a_projection(dst):
    edit_tensors(dst, lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{LAYER}.3.w3.")])
    only_failure(dst, "expert-shapes", f"{LAYER}.3 has no up projection")


def test_expert_of_another_shape(dst):
    mod = f"{LAYER}.1.w1"
    def edit(t):
        if f"{mod}.weight_packed" in t:
            t[f"{mod}.weight_packed"] = t[f"{mod}.weight_packed"][:32].clone()
            t[f"{mod}.weight_scale"] = t[f"{mod}.weight_scale"][:32].clone()
            t[f"{mod}.weight_shape"] = torch.tensor([32, SPEC.latent])
    edit_tensors(dst, edit)
    only_failure(dst, "expert-shapes", f"{LAYER}.1 gate is [32, 96], the layer's experts are gate/up [64, 96]")


# ---------------------------------------------------------------- size rules

def test_hidden_size_not_a_multiple_of_the_group(dst):
    """Experts of hidden size 80 (whole int32 words, 3 scale groups of which the last is partial):
    everything else consistent, only hidden-group fails."""
    hidden, inter = 80, SPEC.inter
    def edit(t):
        for mod in {k.rsplit(".", 1)[0] for k in t if ".experts." in k}:
            out, inp = (hidden, inter) if mod.endswith(".w2") else (inter, hidden)
            t[f"{mod}.weight_packed"] = torch.zeros(out, inp // 8, dtype=torch.int32)
            t[f"{mod}.weight_scale"] = torch.ones(out, -(-inp // 32), dtype=torch.bfloat16)
            t[f"{mod}.weight_shape"] = torch.tensor([out, inp])
    edit_tensors(dst, edit)
    edit_config(dst, lambda cfg: cfg["text_config"].__setitem__("routed_expert_hidden_size", hidden))
    only_failure(dst, "hidden-group", "expert hidden size 80 (in-dim of w1/w3, tensor shapes of 2 MoE layers)")


@pytest.mark.parametrize("tp", [3, 4, 8])
def test_tp_that_splits_groups_fails(converted, tp):
    only_failure(converted.dst, "tp-intermediate", f"per-rank intermediate size 64/{tp}=",
                 f"at --tp {tp}; TP sizes that fit: 1, 2", tp=tp)


def test_fitting_tp_for_kimi_k3():
    """K3's intermediate 3072 = 96 groups of 32: TP must divide 96 (8 and 16 fit, 64 does not)."""
    assert fitting_tp(3072) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]
    assert fitting_tp(SPEC.inter) == [1, 2]


@pytest.mark.parametrize("key, value, needle", [
    ("moe_intermediate_size", 128, "moe_intermediate_size is 128, but the experts' intermediate size is 64"),
    ("routed_expert_hidden_size", 7168, "routed_expert_hidden_size is 7168, but the experts' hidden size is 96"),
])
def test_config_sizes_disagree(dst, key, value, needle):
    edit_config(dst, lambda cfg: cfg["text_config"].__setitem__(key, value))
    only_failure(dst, "config-sizes", needle)


def test_latent_hidden_size_is_the_experts_hidden_size(dst):
    """K3's experts run in routed_expert_hidden_size; without it, hidden_size (64 here) is compared."""
    edit_config(dst, lambda cfg: cfg["text_config"].pop("routed_expert_hidden_size"))
    only_failure(dst, "config-sizes", "config hidden_size is 64, but the experts' hidden size is 96")


# ---------------------------------------------------------------- CLI

def test_cli_serving_passes(converted):
    for server in SERVERS:
        r = run_cli("verify", converted.dst, "--serving", server, "--tp", "2")
        assert r.exit_code == 0, r.output
        assert f"PASS  serving      {server} int4 W4A16 MoE path at --tp 2: {len(RULES)}/{len(RULES)}" in r.output


def test_cli_serving_tp_failure_is_one_line_and_exit_5(converted):
    r = run_cli("verify", converted.dst, "--no-checksums", "--serving", "vllm-rocm", "--tp", "8")
    assert r.exit_code == 5, r.output
    lines = [ln for ln in r.output.splitlines() if "rule " in ln]
    assert lines == [next(ln for ln in r.output.splitlines() if "rule tp-intermediate:" in ln)]
    assert "64/8=8" in lines[0] and "TP sizes that fit: 1, 2" in lines[0]
    assert "FAIL  serving" in r.output and "result: FAIL (1 problem(s))" in r.output


def test_cli_serving_config_failure_json(dst):
    edit_config(dst, _w("actorder", "group"))
    r = run_cli("verify", dst, "--no-checksums", "--serving", "sglang-rocm", "--json")
    assert r.exit_code == 5, r.output
    checks = {c["name"]: c for c in json.loads(r.output)["checks"]}
    assert checks["serving"]["status"] == "FAIL"
    assert [p.split(":")[0] for p in checks["serving"]["problems"]] == ["rule actorder"]
    assert all(c["status"] != "FAIL" for name, c in checks.items() if name != "serving")


def test_cli_tp_without_serving_is_refused(converted):
    r = run_cli("verify", converted.dst, "--tp", "2")
    assert r.exit_code == 2 and "--tp is used with --serving" in r.output
