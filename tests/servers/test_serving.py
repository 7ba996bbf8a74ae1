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
import serving_rules as serving
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
from compressed_tensors.quantization.quant_scheme import W4A16
from server_sources import released_file
from serving_rules import rules as check_serving, rules_of as evaluate

from converter.fixture import FixtureSpec, make_fixture
from converter.releases import VLLM
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.servers import check, loaders
from converter.servers.rules import RULES, SERVERS, ServingRequest
from converter.servers.topology import Topology, local_experts, pp_stages
from converter.vllm_plugin import route
from tests.conftest import SPEC, ct_mxfp4_encode, read_json, rewrite_shard, run_cli, shard_names, sync_index, write_json

LAYER = "language_model.model.layers.1.block_sparse_moe.experts"   # the first MoE layer (shard 2)
SHORT = 120             # a finding's line (issue 23 section 4); the citations are under --verbose
SHORT_NAMED = 200       # one that names a checkpoint tensor or module in full


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def servable(tmp_path_factory) -> str:
    """A tiny K3 output at sizes the int4 SiTU kernels take unpadded (expert hidden and
    intermediate 128: Marlin's hidden % 128, the plugin's 128-aligned per-rank sizes)."""
    root = tmp_path_factory.mktemp("servable")
    make_fixture(str(root / "src"), FixtureSpec(layers=3, experts=4, hidden=64, inter=128, latent=128, shards=2,
                                                vocab=64, seed=7), encoder=ct_mxfp4_encode)
    convert(str(root / "src"), str(root / "dst"), Options())
    return str(root / "dst")


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
    """For every server: exactly ``rule`` fails, in one line naming it, the server and every needle
    (the kernel verdict, which differs by server, has its own tests below)."""
    for server in SERVERS:
        results = check_serving(root, server, tp)
        assert [r.rule for r in results] == list(RULES)
        failed = [r for r in results if not r.ok and r.rule != "kernel"]
        assert [r.rule for r in failed] == [rule], [r.message for r in failed]
        msg = failed[0].message
        assert msg.startswith(f"rule {rule}: ") and "\n" not in msg and len(msg) <= SHORT_NAMED, msg
        for n in needles:
            assert n in msg, f"{n!r} not in {msg}"


def all_pass(root: str, tp: int = 1) -> None:
    """Every checkpoint rule passes for every server (the kernel verdict aside)."""
    for server in SERVERS:
        failed = [r.message for r in check_serving(root, server, tp) if not r.ok and r.rule != "kernel"]
        assert not failed, failed


def problem_lines(output: str) -> list[str]:
    """The serving check's finding lines (each short) in verify's text output."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("- rule ")]
    assert all(len(ln) <= SHORT + 2 for ln in lines), lines
    return lines


def experts(tensors: dict, layer: str = LAYER) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in tensors if k.startswith(layer + ".")})


# ---------------------------------------------------------------- our output passes

@pytest.mark.parametrize("tp", [1, 2])
def test_our_output_passes(converted, tp):
    all_pass(converted.dst, tp)
    # the tiny fixture's experts (hidden 96, intermediate 64) fit no int4 SiTU kernel unpadded
    for server in SERVERS:
        assert [r.rule for r in check_serving(converted.dst, server, tp) if not r.ok] == ["kernel"]


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
    for server in SERVERS:   # no hidden_act: the servers' default silu, which every one of them runs
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
        failed = {r.rule: r.message for r in check_serving(dst, server, 1) if not r.ok and r.rule != "kernel"}
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
                if ".experts." in k and layer_filter in k and f".{old}." in k:
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
def test_tp_that_splits_groups_fails(dst, tp):
    """KimiMoE's padding floor set to 1 (it pads nothing here): every server's MoE splits 64 channels."""
    edit_config(dst, lambda cfg: cfg["text_config"].__setitem__("min_moe_intermediate_per_partition", 1))
    only_failure(dst, "tp-intermediate", f"per-rank intermediate size 64/{tp}=", f"at MoE TP {tp}", tp=tp)


def test_k3_tp_sizes_that_pass_on_cuda():
    """K3's intermediate 3072 on vLLM CUDA: the sizes without KimiMoE padding whose per-rank size is
    whole groups (74b0137 listed 16-48 as fitting, where KimiMoE pads)."""
    config, tensors = k3_headers(layers=1, experts=2)
    ctx = serving.ctx_of(config, tensors, "vllm-cuda")
    assert serving.passing_tp(ctx, Topology(1)) == [1, 2, 3, 4, 6, 8, 12]


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

@pytest.mark.parametrize("server, tp, kernel", [
    ("vllm-rocm-plugin", 1, "Situv2 beta 4.0 linear_beta 25.0"), ("vllm-cuda", 1, "MARLIN")])
def test_cli_serving_passes(servable, server, tp, kernel):
    r = run_cli("verify", servable, "--serving", server, "--tp", str(tp))
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if "serving " in ln)
    assert line.strip() == f"PASS  serving      {server} at TP {tp}: {len(RULES)}/{len(RULES)} rules pass", line
    assert kernel in r.output and "int4 as stored, 0.00" in r.output


def test_cli_serving_vllm_cuda_fails_where_vllm_pads(servable):
    """R9: vLLM's KimiMoE pads, leaves the padded int4 words as allocated with scales 1, and Marlin
    masks nothing; the plugin refuses the split vLLM 0.33.0 cannot build, in its own line."""
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-cuda", "--tp", "2")
    assert r.exit_code == 5, r.output
    lines = problem_lines(r.output)
    assert len(lines) == 1 and "pads per-rank intermediate 64 to 256 at TP 2" in lines[0], lines
    assert "Marlin computes the unzeroed padding" in lines[0]
    assert "note: TP sizes that pass: 1\n" in r.output   # EP too: KimiMoE pads by the TP group alone
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-cuda", "--tp", "2", "--verbose")
    assert "zeroes nothing" in r.output and "models/kimi_k3/amd/linear.py 227-236" in r.output
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm-plugin", "--tp", "2", "--verbose")
    lines = problem_lines(r.output)
    assert r.exit_code == 5 and len(lines) == 1 and "KimiMoE pads intermediate 64 to 256" in lines[0], r.output
    assert "cannot build it" in lines[0] and "k3convert vLLM plugin:" in r.output   # the plugin's words, verbose


def test_cli_serving_stock_vllm_rocm_fails_on_situ(servable):
    """The one-line EMULATION failure, with the memory figure, and exit 5."""
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm", "--tp", "2")
    assert r.exit_code == 5, r.output
    lines = problem_lines(r.output)
    assert len(lines) == 1 and "rule kernel:" in lines[0] and "EMULATION" in lines[0], lines
    # 2 MoE layers x 4 experts x 3 x 128 x 128 weights, vLLM's KimiMoE pads 64 per rank to 256
    bf16 = 2 * 4 * 3 * 256 * 128 * 2
    assert f"bf16 dequantization at load, {bf16 / 1e9:.3g} GB per rank at TP 2" in lines[0]


@pytest.mark.parametrize("server", ["sglang-rocm", "sglang-cuda"])
def test_cli_serving_sglang_fails_on_situ(servable, server):
    r = run_cli("verify", servable, "--no-checksums", "--serving", server)
    assert r.exit_code == 5, r.output
    lines = problem_lines(r.output)
    assert len(lines) == 1 and "asserts activation == 'silu'" in lines[0], lines


def test_cli_serving_tp_failure_is_one_line_and_exit_5(servable):
    """74b0137 said "TP sizes that fit: 1, 2, 4" here, and 2 and 4 failed when run (KimiMoE pads them)."""
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm-plugin", "--tp", "8")
    assert r.exit_code == 5, r.output
    lines = problem_lines(r.output)
    assert len(lines) == 1 and "KimiMoE pads intermediate 16 to 256 per rank at TP 8" in lines[0], lines
    assert "TP sizes that pass: 1\n" in r.output + "\n" and "fit: 1, 2, 4" not in r.output
    assert "FAIL  serving" in r.output and "result: FAIL (1 problem(s))" in r.output


def test_cli_serving_config_failure_json(dst):
    edit_config(dst, _w("actorder", "group"))
    r = run_cli("verify", dst, "--no-checksums", "--serving", "sglang-rocm", "--json")
    assert r.exit_code == 5, r.output
    checks = {c["name"]: c for c in json.loads(r.output)["checks"]}
    assert checks["serving"]["status"] == "FAIL"
    assert [p.split(":")[0] for p in checks["serving"]["problems"]] == ["rule actorder", "rule kernel"]
    # verify's own config check refuses actorder too, and the files check config.json's recorded digest;
    # the others see nothing wrong
    assert all(c["status"] != "FAIL" for name, c in checks.items() if name not in ("serving", "config", "files"))


def test_cli_tp_without_serving_is_refused(converted):
    for flag in (("--tp", "2"), ("--dp", "2"), ("--pp", "2"), ("--ep",), ("--verbose",)):
        r = run_cli("verify", converted.dst, *flag)
        assert r.exit_code == 2 and "are used with --serving" in r.output, flag


# ---------------------------------------------------------------- names: the scheme lookup

EXPERT_TARGET = r"re:.*\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"


def _block(cfg: dict) -> dict:
    return cfg["text_config"]["quantization_config"]


@pytest.mark.parametrize("edit, needle", [
    # right on the checkpoint's w1/w2/w3 names, wrong on the name the servers ask for
    (lambda b: b["ignore"].append(r"re:.*\.(gate|up|down)_proj$"), "the layer's experts load unquantized"),
    (lambda b: b["ignore"].append(r"re:.*gate_proj.*"), "but not the other projections"),
    (lambda b: b["config_groups"]["group_0"].__setitem__("targets", [r"re:.*\.experts\.\d+\.w[123]$"]),
     "no target matches …experts.0.gate_proj"),
])
def test_names_rule_fails(dst, edit, needle):
    edit_config(dst, lambda cfg: edit(_block(cfg)))
    only_failure(dst, "names", "text_config.quantization_config", needle)


def test_names_rule_passes_ours_and_a_class_target_with_a_note(converted, dst):
    assert _block(read_json(os.path.join(converted.dst, "config.json")))["config_groups"]["group_0"]["targets"] \
        == [EXPERT_TARGET]
    assert all(not r.note for r in check_serving(converted.dst, "vllm-rocm", 1))
    edit_config(dst, lambda cfg: _block(cfg)["config_groups"]["group_0"].__setitem__("targets", ["Linear"]))
    all_pass(dst)   # vLLM maps "Linear" onto RoutedExperts: the experts are found ...
    names = next(r for r in check_serving(dst, "vllm-rocm", 1) if r.rule == "names")
    assert "targets ['Linear'] select by class" in names.note   # ... but other layers may be too


def test_int4_targets_select_exactly_the_converted_modules():
    """Both ways, on compressed-tensors' own matcher and on the names vLLM asks for: a source ignore
    entry that would catch vLLM's expert names is dropped, others kept; kept experts the pattern
    would catch are ignored (under both names); non-expert converted modules by exact name."""
    from compressed_tensors.utils.match import match_name

    from converter.formats.dialect import int4_targets

    layer = "model.layers.{}.mlp.experts"
    converted = [f"{layer.format(1)}.{e}.{p}" for e in range(2) for p in ("w1", "w2", "w3")] + \
        ["model.layers.0.self_attn.q_proj"]
    kept = [f"{layer.format(2)}.{e}.{p}" for e in range(2) for p in ("w1", "w2", "w3")] + \
        ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.gate", "lm_head", "model.layers.0.mlp.gate_proj"]
    inherited = [r"re:.*self_attn\.k_proj$", r"re:.*\.gate_proj$", "lm_head"]
    targets, ignore = int4_targets(converted, kept, inherited)
    assert targets == [EXPERT_TARGET, "model.layers.0.self_attn.q_proj"]
    assert r"re:.*\.gate_proj$" not in ignore and r"re:.*self_attn\.k_proj$" in ignore and "lm_head" in ignore
    assert f"{layer.format(2)}.0.w1" in ignore and f"{layer.format(2)}.0.gate_proj" in ignore

    def selected(name: str) -> bool:
        return any(match_name(name, t) for t in targets) and not any(match_name(name, i) for i in ignore)
    assert {m for m in converted + kept if selected(m)} == set(converted)
    for L, want in ((1, True), (2, False)):   # vLLM's lookups: layer 1 int4, layer 2 (kept) not
        assert {selected(f"{layer.format(L)}.0.{p}") for p in ("gate_proj", "up_proj", "down_proj")} == {want}
    assert not selected("model.layers.0.self_attn.qkv_proj")   # a server's fused name: no class target


# ---------------------------------------------------------------- kernel: per server and target

LAYER_K3 = "language_model.model.layers.1.block_sparse_moe.experts"


def k3_headers(layers: int = 2, experts: int = 4, inter: int = 3072, hidden: int = 3584,
               act: dict | None = None) -> tuple[dict, dict]:
    """A K3-shaped config and header entries at K3's expert dims (fewer layers and experts)."""
    text = {"model_type": "kimi_linear", "moe_intermediate_size": inter, "routed_expert_hidden_size": hidden,
            **(act if act is not None else {"hidden_act": "situ", "activation_situ_beta": 4.0,
                                            "activation_situ_linear_beta": 25.0}),
            "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"targets": [EXPERT_TARGET],
                                                                  "format": "pack-quantized",
                                                                  "weights": {"num_bits": 4, "type": "int",
                                                                              "symmetric": True, "strategy": "group",
                                                                              "group_size": 32, "dynamic": False,
                                                                              "actorder": None}}},
                                    "ignore": []}}
    config = {"model_type": "kimi_k3", "torch_dtype": "bfloat16", "text_config": text}
    tensors = {}
    for L in range(1, layers + 1):
        for e in range(experts):
            for w, (o, i) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
                m = f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w}"
                tensors[f"{m}.weight_packed"] = SimpleNamespace(dtype="I32", shape=(o, i // 8))
                tensors[f"{m}.weight_scale"] = SimpleNamespace(dtype="BF16", shape=(o, i // 32))
    return config, tensors


def kernel_result(config, tensors, server, tp):
    results = evaluate(config, tensors, server, tp)
    assert [r.rule for r in results if not r.ok] in ([], ["kernel"]), [r.message for r in results if not r.ok]
    return next(r for r in results if r.rule == "kernel")


def test_situ_at_k3_dims_per_server():
    """Stock vLLM on gfx942: EMULATION, with the memory it costs; the plugin and vLLM CUDA (Marlin)
    take SiTU at int4; both SGLang paths assert SiLU."""
    config, tensors = k3_headers()
    weights = 2 * 4 * 3 * 3072 * 3584                      # expert weights in these headers
    stock = kernel_result(config, tensors, "vllm-rocm", 8)
    assert not stock.ok and "\n" not in stock.message
    assert "EMULATION" in stock.message and "bf16 dequantization at load" in stock.message
    assert f"{weights * 2 / 8 / 1e9:.3g} GB per rank" in stock.message          # bf16; TP 8 splits I
    assert f"int4 as stored: {weights * (0.5 + 2 / 32) / 8 / 1e9:.3g} GB" in stock.detail
    assert len(stock.message) <= SHORT
    plugin = kernel_result(config, tensors, "vllm-rocm-plugin", 8)
    assert plugin.ok and "Situv2 beta 4.0 linear_beta 25.0" in plugin.message and "int4 as stored" in plugin.message
    cuda = kernel_result(config, tensors, "vllm-cuda", 8)
    assert cuda.ok and "MARLIN" in cuda.message and "takes situ" in cuda.message
    for server, line in (("sglang-rocm", "558"), ("sglang-cuda", "454")):
        r = kernel_result(config, tensors, server, 8)
        assert not r.ok and "asserts activation == 'silu'" in r.message and line in r.detail


def test_silu_experts_run_everywhere_at_int4():
    """The other way: the same experts with SiLU get an int4 kernel on every server (TRITON on
    stock gfx942, where the plugin stays out)."""
    config, tensors = k3_headers(act={"hidden_act": "silu"})
    for server in SERVERS:
        r = kernel_result(config, tensors, server, 8)
        assert r.ok, r.message
    assert "TRITON" in kernel_result(config, tensors, "vllm-rocm", 8).message
    assert "plugin stays out" in kernel_result(config, tensors, "vllm-rocm-plugin", 8).message


def test_marlin_shape_rule_on_cuda():
    """vLLM CUDA falls back to EMULATION when Marlin cannot take the shape (hidden % 128)."""
    config, tensors = k3_headers(hidden=3584 - 32)
    r = kernel_result(config, tensors, "vllm-cuda", 1)
    assert not r.ok and "EMULATION" in r.message and "hidden % 128" in r.detail


def test_plugin_refusals_are_the_plugins():
    """The plugin server uses the plugin's own decision: no linear_beta is refused in its words;
    a non-32 group is refused (and fails group-size too)."""
    config, tensors = k3_headers()
    del config["text_config"]["activation_situ_linear_beta"]
    r = kernel_result(config, tensors, "vllm-rocm-plugin", 8)
    assert not r.ok and "k3convert vLLM plugin:" in r.message and "activation_situ_linear_beta" in r.message
    config, tensors = k3_headers()
    config["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    r = next(x for x in evaluate(config, tensors, "vllm-rocm-plugin", 8) if x.rule == "kernel")
    assert not r.ok and "group_size 128" in r.message


def test_kimi_padding_in_the_memory_estimate():
    """vLLM's KimiMoE pads a per-rank intermediate below 256 up to 256: at TP 16, K3's 192 -> 256."""
    config, tensors = k3_headers(layers=1, experts=1)
    r = kernel_result(config, tensors, "vllm-rocm", 16)
    assert f"{3 * 256 * 3584 * 2 / 1e9:.3g} GB per rank" in r.message


@pytest.mark.parametrize("tp,per", [(16, 192), (24, 128), (32, 96), (48, 64)])
def test_k3_where_vllm_pads(tp, per):
    """Real K3 (intermediate 3072) at the TP sizes vLLM's KimiMoE pads to 256 per rank: the plugin
    refuses what vLLM 0.33.0 cannot build, in one line; stock vLLM on CUDA fails naming the padding."""
    config, tensors = k3_headers(layers=1, experts=2)
    r = kernel_result(config, tensors, "vllm-rocm-plugin", tp)
    assert not r.ok and f"KimiMoE pads intermediate {per} to 256 per rank at TP {tp} and cannot build" in r.message
    assert "\n" not in r.message and len(r.message) <= SHORT
    assert f"k3convert vLLM plugin: {LAYER_K3}: at TP {tp}" in r.detail      # the plugin's own line
    r = kernel_result(config, tensors, "vllm-cuda", tp)
    assert not r.ok and f"pads per-rank intermediate {per} to 256 at TP {tp}" in r.message
    assert "zeroes nothing" in r.detail and len(r.message) <= SHORT
    assert kernel_result(config, tensors, "vllm-cuda", 8).ok


def test_kimi_padding_follows_the_config():
    """KimiMoE reads min_moe_intermediate_per_partition from the config (getattr, default 256)."""
    config, tensors = k3_headers(layers=1, experts=2)
    config["text_config"]["min_moe_intermediate_per_partition"] = 128
    assert kernel_result(config, tensors, "vllm-cuda", 24).ok           # 128 per rank: no padding
    assert not kernel_result(config, tensors, "vllm-cuda", 32).ok       # 96 -> 128
    assert kernel_result(config, tensors, "vllm-rocm-plugin", 24).ok


def test_plugin_refuses_sizes_its_kernel_would_pad():
    """Both ways: K3's per-rank sizes at TP 8 (hidden 3584, intermediate 384) pass; a hidden size
    that is no multiple of 128 is refused at load, in the plugin's words."""
    config, tensors = k3_headers()
    assert kernel_result(config, tensors, "vllm-rocm-plugin", 8).ok
    config, tensors = k3_headers(hidden=3584 - 32)
    r = kernel_result(config, tensors, "vllm-rocm-plugin", 8)
    assert not r.ok and "the plugin refuses" in r.message and "hidden size 3552" in r.message
    assert f"k3convert vLLM plugin: {LAYER_K3}: hidden size 3552" in r.detail


# ---------------------------------------------------------------- issue 23 section 4: topologies

TWO_NODE = {"TP 8 + EP": Topology(8, ep=True), "DP 2 x TP 8 + EP": Topology(8, dp=2, ep=True),
            "PP 2 x TP 8": Topology(8, pp=2)}


def _vllm_split(release: str):
    """A vLLM release's own FusedMoEParallelConfig (fused_moe/config.py), determine_expert_map
    (expert_map_manager.py) and get_pp_indices (distributed/utils.py), compiled from the released
    files with the process-group getters stubbed."""
    import ast
    import dataclasses
    import logging
    from typing import Literal

    ns = {"dataclass": dataclasses.dataclass, "torch": torch, "ParallelConfig": object, "Literal": Literal,
          "ExpertPlacementStrategy": str, "logger": logging.getLogger("vllm033"),
          "envs": SimpleNamespace(VLLM_PP_LAYER_PARTITION=None),
          "get_dp_group": lambda: ns["_dp"], "get_pcp_group": lambda: SimpleNamespace(rank_in_group=0),
          "get_tensor_model_parallel_rank": lambda: ns["_tp_rank"]}
    for rel, names in (("model_executor/layers/fused_moe/config.py", {"FusedMoEParallelConfig"}),
                       ("model_executor/layers/fused_moe/expert_map_manager.py", {"determine_expert_map"}),
                       ("distributed/utils.py", {"get_pp_indices"})):
        tree = ast.parse(released_file(release, rel).read_text())
        found = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names]
        assert {n.name for n in found} == names, rel
        exec(compile(ast.Module(body=found, type_ignores=[]), rel, "exec"), ns)
    return ns


@pytest.mark.parametrize("release", ["K3CONVERT_VLLM033_SRC", "K3CONVERT_VLLM034_SRC"])
@pytest.mark.parametrize("tp, dp, ep", [(8, 1, True), (8, 2, True), (8, 2, False), (16, 1, False), (16, 1, True),
                                        (1, 1, True), (1, 4, True), (4, 2, False), (1, 1, False)])
def test_topology_is_vllms_own_split(tp, dp, ep, release):
    """The MoE's tp_size, ep_size, all2all and the experts per rank, against vLLM 0.33.0's and 0.34.0's
    own code run for every rank (FusedMoEParallelConfig.make, determine_expert_map), and the PP stages
    against get_pp_indices."""
    ns = _vllm_split(release)
    topo = Topology(tp, dp=dp, ep=ep)
    par = SimpleNamespace(enable_expert_parallel=ep, all2all_backend="allgather_reducescatter", enable_eplb=False,
                          mori_ep_v2=False)   # 0.34: the MoRI EPv2 switch, off by default
    held = []
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            ns["_dp"], ns["_tp_rank"] = SimpleNamespace(rank_in_group=dp_rank), tp_rank
            cfg = ns["FusedMoEParallelConfig"].make(tp_size_=tp, pcp_size_=1, dp_size_=dp, sp_size_=1,
                                                     vllm_parallel_config=par)
            assert (cfg.tp_size, cfg.ep_size, cfg.use_ep, cfg.use_all2all_kernels) == \
                (topo.moe_tp, topo.ep_size, topo.ep_on, topo.all2all)
            for experts in (896, 8, 61):
                held.append((experts, ns["determine_expert_map"](cfg.ep_size, cfg.ep_rank, experts)[0]))
    for experts in (896, 8, 61):
        assert max(n for e, n in held if e == experts) == local_experts(experts, topo.ep_size)
    for layers, pp in ((93, 2), (93, 4), (7, 3), (3, 3), (62, 8)):
        got = [ns["get_pp_indices"](layers, r, pp) for r in range(pp)]
        assert [(s.start, s.stop) for s in pp_stages(layers, pp)] == got


def test_two_node_topologies_at_k3_dims():
    """Per topology on the plugin: the kernel, the self-test, and the experts' memory per rank
    (all 896 experts, K3's expert dims, 4 MoE layers of 5), computed here from the dims."""
    config, tensors = k3_headers(layers=4, experts=896)
    config["text_config"]["num_hidden_layers"] = 5
    per_expert = 3 * 3072 * 3584 * (0.5 + 2 / 32)           # int4 + bf16 scale per 32, bytes
    want = {"TP 8 + EP": (112, 3072, 4), "DP 2 x TP 8 + EP": (56, 3072, 4), "PP 2 x TP 8": (896, 384, 2)}
    for name, topo in TWO_NODE.items():
        c = serving.check_of(config, tensors, "vllm-rocm-plugin", topo)
        assert c.ok and c.summary == f"vllm-rocm-plugin at {name}: {len(RULES)}/{len(RULES)} rules pass", c.problems
        local, inter, layers = want[name]
        gb = per_expert * local * inter / 3072 * layers / 1e9
        text = "\n".join(c.notes)
        assert "AITER a16w4 with Situv2 beta 4.0 linear_beta 25.0" in text and "self-test runs" in text
        assert f"int4 as stored, {gb:.3g} GB per rank" in text, text
        assert f"per rank {local}/896 experts x {inter} of 3072 intermediate, {layers}/4 MoE layers" in text, text
        assert ("all2all" in text) == (name == "DP 2 x TP 8 + EP")
        assert all(len(n) <= 160 for n in c.notes), c.notes
    # without --ep, DP flattens the MoE's TP to 16: 192 channels per rank, which the plugin refuses
    c = serving.check_of(config, tensors, "vllm-rocm-plugin", Topology(8, dp=2))
    assert not c.ok and "per-rank intermediate size 192 is not a multiple of 128" in c.problems[0]
    assert any("with EP: 1, 2, 3, 4, 5, 6, 7, 8" in n for n in c.notes), c.notes


def test_cli_topology_flags(servable):
    """--dp/--pp/--ep reach the check; SGLang refuses them (its split was not read)."""
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-cuda", "--dp", "2", "--tp", "2", "--ep")
    assert "serving      vllm-cuda at DP 2 x TP 2 + EP" in r.output, r.output
    assert "EP 4 (all2all)" in r.output and "per rank 1/4 experts" in r.output
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-cuda", "--pp", "2")
    assert r.exit_code == 0 and "at PP 2 x TP 1: " in r.output and "1/2 MoE layers" in r.output, r.output
    r = run_cli("verify", servable, "--no-checksums", "--serving", "sglang-rocm", "--ep")
    assert r.exit_code == 2 and "vllm-* servers only" in r.output


def _passes(config, tensors, server, topo) -> bool:
    return all(r.ok for r in serving.rules_of(config, tensors, server, topo))


@pytest.mark.parametrize("server", ["vllm-rocm-plugin", "vllm-cuda", "vllm-rocm", "sglang-cuda"])
@pytest.mark.parametrize("dims", [(192, 128), (128, 128), (3072, 3584), (64, 96)])
def test_advice_lists_exactly_the_sizes_that_pass(server, dims):
    """The listed TP sizes are found by running every rule at each: each listed one passes when run,
    each other one fails. On the demo fixture's dims (192 x 128) 74b0137 said "TP sizes that fit: 1,
    2, 3, 6", and the plugin failed at every one of them."""
    inter, hidden = dims
    config, tensors = k3_headers(layers=1, experts=2, inter=inter, hidden=hidden,
                                 act=None if server != "sglang-cuda" else {"hidden_act": "silu"})
    ctx = serving.ctx_of(config, tensors, server)
    for topo in (Topology(4), Topology(4, ep=True)) if server.startswith("vllm") else (Topology(4),):
        listed = serving.passing_tp(ctx, topo, limit=20)
        for t in range(1, 21):
            assert _passes(config, tensors, server, topo.with_tp(t)) == (t in listed), (t, listed)
    if server == "vllm-rocm-plugin" and dims == (192, 128):
        assert not any(_passes(config, tensors, server, Topology(t)) for t in (1, 2, 3, 6))
        c = serving.check_of(config, tensors, server, 4)
        assert "TP sizes that pass: none up to 64" in c.notes


@pytest.mark.parametrize("vllm, cites", [
    ("0.33", ("vllm 0.33.0 fused_moe/oracle/int_wna16.py 126-143", "vllm 0.33.0 fused_moe/config.py 1198-1201")),
    ("0.34", ("vllm 0.34.0 fused_moe/oracle/int_wna16.py 130-147", "vllm 0.34.0 fused_moe/config.py 1235-1238")),
])
def test_findings_are_short_and_cite_under_verbose(servable, vllm, cites):
    """One short line per finding; the file-and-line citations, of the release asked about, only with --verbose."""
    args = ("verify", servable, "--no-checksums", "--serving", "vllm-rocm", "--tp", "8", "--vllm-version", vllm)
    short, verbose = run_cli(*args), run_cli(*args, "--verbose")
    assert short.exit_code == verbose.exit_code == 5
    assert len(problem_lines(short.output)) == 1 and problem_lines(short.output) == problem_lines(verbose.output)
    assert all(len(ln) <= SHORT + 8 for ln in short.output.splitlines() if "serving" in ln or "- rule" in ln)
    for cite in (*cites, "rule kernel fix: for SiTU experts"):
        assert cite not in short.output and cite in verbose.output, cite


# ---------------------------------------------------------------- the plugin: aiter missing, 0.33.x padding

def _gemm1(*a, act=None, situ_beta=None, situ_linear_beta=None, **k):
    raise NotImplementedError


def test_aiter_missing_is_reported_as_missing():
    """Without aiter, vLLM's is_fused_moe_enabled answers None (_aiter_ops.py 279-291): the refusal
    says aiter is missing, not that AITER MoE is off."""
    config, _ = k3_headers()
    block = config["text_config"]["quantization_config"]
    missing = route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=False, vllm_version="0.33.0",
                            aiter_found=False)
    with pytest.raises(route.Refused, match="aiter is not installed") as e:
        route.decide(block, None, config, missing)
    assert "AITER MoE is off" not in str(e.value)
    off = route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=False, vllm_version="0.33.0", gemm1=_gemm1)
    with pytest.raises(route.Refused, match="AITER MoE is off"):
        route.decide(block, None, config, off)


@pytest.mark.parametrize("version, crashes", [("0.33.0", True), ("0.33.1", True), ("0.33.0+rocm700", True),
                                              ("0.33.2rc1", True), ("0.33.1.dev12+g1234", True),
                                              ("0.34.0", True), ("0.34.1+rocm7", True), ("0.35.0", False), ("0.32.1", False), ("0.3.3", False), ("", False)])
def test_padding_crash_matches_every_proven_build(version, crashes):
    """0.33.x and 0.34.x KimiMoE zero the padding through the MoE runner (the same code in both)."""
    assert bool(route.padding_refusal(3072, 16, 256, version)) == crashes
    assert route.padding_refusal(3072, 8, 256, version) is None      # 384 per rank: nothing padded


# ---------------------------------------------------------------- issue 26 section 3: the loaders' refusals

def _moe_headers(model_type: str, experts: int, text: dict, name="model.layers.{L}.mlp.experts", w=("w1", "w3", "w2"),
                 inter=512, hidden=256):
    config, _ = k3_headers(layers=1, experts=1, act={"hidden_act": "silu"})
    block = config["text_config"]["quantization_config"]
    config = {"model_type": model_type, "torch_dtype": "bfloat16", "quantization_config": block, **text}
    tensors = {}
    for e in range(experts):
        for proj, (o, i) in zip(w, ((inter, hidden), (inter, hidden), (hidden, inter))):
            m = f"{name.format(L=1)}.{e}.{proj}"
            tensors[f"{m}.weight_packed"] = SimpleNamespace(dtype="I32", shape=(o, i // 8))
            tensors[f"{m}.weight_scale"] = SimpleNamespace(dtype="BF16", shape=(o, i // 32))
    return config, tensors


@pytest.mark.parametrize("model_type, key, where, text", [
    ("minimax_m3_text", "num_local_experts", {"0.33": "models/minimax_m3/amd/model.py 362-366",
                                              "0.34": "models/minimax_m3/amd/model.py 433-437"},
     {"hidden_act": "swigluoai", "swiglu_alpha": 1.702, "swiglu_limit": 7.0}),
    ("mimo_v2", "n_routed_experts", {"0.33": "model_executor/models/mimo_v2.py 138-142",
                                     "0.34": "model_executor/models/mimo_v2.py 138-142"}, {"hidden_act": "silu"}),
])
@pytest.mark.parametrize("vllm", ["0.33", "0.34"])
def test_tp_above_the_expert_count_is_refused(model_type, key, where, text, vllm):
    """vLLM refuses TP > number of experts for MiniMax-M3 and MiMo-V2; 74b0137 passed TP 16 with 8."""
    config, tensors = _moe_headers(model_type, 8, {**text, key: 8, "num_attention_heads": 64})
    where = f"vllm {vllm}.0 {where[vllm]}"
    for server in ("vllm-rocm", "vllm-cuda"):
        res = {r.rule: r for r in serving.rules_of(config, tensors, server, 16, vllm)}
        assert not res["loader"].ok and res["loader"].message == \
            f"rule loader: TP 16 > {key} 8: vLLM's loader refuses it", res["loader"].message
        assert where in res["loader"].detail
        assert [r for r in res.values() if not r.ok] == [res["loader"]]
        assert all(r.ok for r in serving.rules_of(config, tensors, server, 8))
        assert all(r.ok for r in serving.rules_of(config, tensors, server, Topology(8, dp=2, ep=True)))
        assert all(r.ok for r in serving.rules_of(config, tensors, "sglang-cuda", 16) if r.rule == "loader")


@pytest.mark.parametrize("vllm, mla, kda", [
    ("0.33", "vllm 0.33.0 models/kimi_k3/amd/linear.py 405 (MLA)", "kda.py 130-131"),
    ("0.34", "vllm 0.34.0 models/kimi_k3/amd/linear.py 410 (MLA)", "kda.py 170-171")])
def test_heads_and_kv_heads_refusals(vllm, mla, kda):
    """The engine refuses heads TP does not divide (config/model.py 1557-1563); Kimi's KDA heads
    (kda.py 130-131); MiniMax's KV-head rule (model.py 519-523); a MiMo with non-silu experts. Each
    cited from the release asked about (0.34.0's linear.py moved by 5 lines)."""
    config, tensors = k3_headers(layers=1, experts=2)
    config["text_config"].update(num_attention_heads=64, linear_attn_config={"num_heads": 96, "head_dim": 128})
    assert next(r for r in serving.rules_of(config, tensors, "vllm-cuda", 8, vllm) if r.rule == "loader").ok
    r = next(r for r in serving.rules_of(config, tensors, "vllm-cuda", 5, vllm) if r.rule == "loader")
    assert r.message == "rule loader: num_attention_heads 64 not divisible by TP 5: vLLM's loader refuses it (and 1 " \
                        "more)" and mla in r.detail and kda in r.detail
    assert "linear_attn_config.num_heads 96 not divisible by TP 5" in r.detail
    r = next(r for r in serving.rules_of(config, tensors, "vllm-cuda", 3) if r.rule == "loader")
    assert r.message.startswith("rule loader: num_attention_heads 64 not divisible by TP 3") and "more" not in r.message
    config["text_config"]["num_attention_heads"] = 96
    r = next(r for r in serving.rules_of(config, tensors, "vllm-cuda", 12) if r.rule == "loader")
    assert r.ok
    mm, mt = _moe_headers("minimax_m3_vl", 8, {"text_config": {"model_type": "minimax_m3_text",
                                                               "num_key_value_heads": 4, "num_attention_heads": 48}},
                          inter=768)
    msgs = [r.message for r in serving.rules_of(mm, mt, "vllm-rocm", 6) if not r.ok]
    assert msgs == ["rule loader: num_key_value_heads 4 and TP 6 do not divide one another: vLLM's loader "
                    "refuses it"], msgs
    mi, ti = _moe_headers("mimo_v2_flash", 8, {"hidden_act": "gelu", "n_routed_experts": 8})
    assert any("hidden_act is 'gelu', not 'silu'" in r.message for r in serving.rules_of(mi, ti, "vllm-rocm", 1))


def test_a_model_is_added_by_one_table_entry(monkeypatch):
    """LOADERS is the per-model table: a new model type's refusal is checked once it is listed."""
    config, tensors = _moe_headers("bailing_moe_v3", 8, {"num_experts": 8})
    assert all(r.ok for r in serving.rules_of(config, tensors, "vllm-cuda", 16) if r.rule == "loader")
    monkeypatch.setitem(loaders.LOADERS, "bailing_moe_v3", (loaders.Refusal("num_experts", "tp<=", "loader.new"),))
    for release in VLLM:   # and its line, one entry per release
        monkeypatch.setitem(release.cites, "loader.new", "$V somewhere 1-2")
        r = next(r for r in serving.rules_of(config, tensors, "vllm-cuda", 16, vllm=release.version)
                 if r.rule == "loader")
        assert not r.ok and "TP 16 > num_experts 8" in r.message and r.detail == f"vllm {release.version} somewhere 1-2"


@pytest.fixture(scope="module")
def moe_outputs(tmp_path_factory):
    """The MiniMax-M3 and MiMo-V2 fixtures (4 experts each), converted."""
    import mimo_v2_fixture as mimo
    import minimax_m3_fixture as mm3
    out = {}
    for name, mod in (("minimax", mm3), ("mimo", mimo)):
        root = tmp_path_factory.mktemp(name)
        mod.write(str(root / "src"))
        convert(str(root / "src"), str(root / "dst"), Options())
        out[name] = str(root / "dst")
    return out


@pytest.mark.parametrize("name, key, advice, passing", [
    ("minimax", "num_local_experts", "TP sizes that pass: 1; with EP: 1, 2", ("--tp", "2", "--ep")),
    ("mimo", "n_routed_experts", "TP sizes that pass: 1, 2\n", ("--tp", "2"))])
def test_cli_refuses_tp_above_experts_on_converted_outputs(moe_outputs, name, key, advice, passing):
    r = run_cli("verify", moe_outputs[name], "--no-checksums", "--serving", "vllm-rocm", "--tp", "8")
    assert r.exit_code == 5 and f"rule loader: TP 8 > {key} 4" in r.output, r.output
    assert advice in r.output     # the fixtures' 2 heads: TP 2 at most
    r = run_cli("verify", moe_outputs[name], "--no-checksums", "--serving", "vllm-rocm", *passing)
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------- issue 33 section 4: does a rank fit its GPU

@pytest.fixture(scope="module")
def k3_full_headers():
    """Kimi K3's 92 MoE layers x 896 experts at its expert dims (headers only), plus 30 GB of other
    weights (attention, shared experts, embeddings), and its 93 decoder layers."""
    config, tensors = k3_headers(layers=92, experts=896)
    config["text_config"]["num_hidden_layers"] = 93
    tensors["language_model.model.embed_tokens.weight"] = SimpleNamespace(dtype="BF16", shape=(15_000_000_000 // 7168, 7168))
    return config, tensors


def _memory(config, tensors, topo, **kw):
    req = ServingRequest.parse("vllm-rocm-plugin", topo, **kw)
    results = {r.rule: r for r in check.evaluate(config, tensors, req)}
    return results["memory"], check.serving_check(config, tensors, req)


K3_EXPERTS_TP8 = 92 * 112 * 3 * 3072 * 3584 * (0.5 + 2 / 32)    # bytes of int4 experts a rank holds at TP 8 + EP
MI300X = 192 * 2 ** 30


def test_k3_at_tp8_ep_fits_mi325x_not_mi300x_at_0_9(k3_full_headers):
    """191 GB of experts per rank at TP 8 + EP: over MI300X's 192 GiB x 0.9 when the flag says 0.9."""
    config, tensors = k3_full_headers
    rule, c = _memory(config, tensors, Topology(8, ep=True), utilization=0.9)
    assert rule.ok, rule.message
    note = "; ".join(c.notes)
    assert f"experts {K3_EXPERTS_TP8 / 1e9:.3g}" in note and "split by TP 3.75" in note, note
    assert "MI300X 192 GiB x 0.9: does not fit" in note and "MI325X 256 GiB x 0.9: " in note
    left = 256 * 2 ** 30 * 0.9 - K3_EXPERTS_TP8 - (15_000_000_000 // 7168) * 7168 * 2 // 8
    assert f"{left / 1e9:.3g} GB left for the KV cache" in note, note
    assert "gpu_memory_utilization 0.9: --gpu-memory-utilization 0.9" in note, note


@pytest.mark.parametrize("vllm, utilization, fits", [("0.33", 0.92, False), ("0.34", 1.0, True)])
def test_each_release_checks_at_its_own_default_utilization(k3_full_headers, vllm, utilization, fits):
    """Issue 41 item 3: without the flag each release's own default: 0.33.0's 0.92 (config/cache.py 215),
    0.34.0's 1.0 (unset, resolved with the extensible KV cache, on by default on ROCm). K3 at TP 8 + EP on
    MI300X: 191.4 GB of experts against 189.7 GB (0.33: short) or 206.2 GB (0.34: room for the KV cache)."""
    config, tensors = k3_full_headers
    rule, c = _memory(config, tensors, Topology(8, ep=True), vllm=vllm)
    note = "; ".join(c.notes)
    assert all(len(n) <= 160 for n in c.notes), c.notes
    weights = K3_EXPERTS_TP8 + (15_000_000_000 // 7168) * 7168 * 2 // 8
    left = MI300X * utilization - weights
    assert (left >= 0) == fits and rule.ok      # MI325X fits under both
    room = f"{left / 1e9:.3g} GB left for the KV cache" if fits else f"does not fit ({-left / 1e9:.3g} GB short)"
    assert f"MI300X 192 GiB x {utilization:g}: {room}" in note, note
    basis = {"0.33": "vLLM 0.33.0's default 0.92",
             "0.34": "vLLM 0.34.0's default: 1 with its extensible KV cache, on by default on ROCm (else 0.92)"}
    assert f"gpu_memory_utilization {utilization:g}: {basis[vllm]}" in note, note
    assert round(MI300X * utilization / 1e9, 1) == {"0.33": 189.7, "0.34": 206.2}[vllm]
    assert round(K3_EXPERTS_TP8 / 1e9, 1) == 191.4


def test_the_cuda_target_resolves_0_34_the_same_way(k3_full_headers):
    """vLLM 0.34 turns the extensible KV cache on on CUDA too: a given GPU is checked at 1.0 there."""
    config, tensors = k3_full_headers
    req = ServingRequest.parse("vllm-cuda", Topology(8, ep=True), gpu_memory=200)
    assert req.budget().value == 1.0 and "on by default on CUDA" in req.budget().basis
    req = ServingRequest.parse("vllm-cuda", Topology(8, ep=True), vllm="0.33", gpu_memory=200)
    assert req.budget().value == 0.92


def test_weights_vllm_keeps_whole_count_on_every_rank():
    """Issue 41 item 3: the router (a GateLinear: ReplicatedLinear), the latent down projection and K3.1's
    DSA indexer are held whole by every TP rank, not divided by TP; the latent up projection is split at
    TP 8 when hidden_size % 8 == 0 (KimiMoE shard_up_proj) and whole when it is not."""
    config, tensors = k3_headers(layers=4, experts=8)
    tensors["language_model.model.embed_tokens.weight"] = SimpleNamespace(dtype="BF16", shape=(1000, 7168))
    config["text_config"]["hidden_size"] = 7168
    layer = "language_model.model.layers.{}.block_sparse_moe.{}.weight"
    for L in range(1, 5):
        tensors[layer.format(L, "gate")] = SimpleNamespace(dtype="BF16", shape=(896, 7168))
        tensors[layer.format(L, "routed_expert_down_proj")] = SimpleNamespace(dtype="BF16", shape=(3584, 7168))
        tensors[layer.format(L, "routed_expert_up_proj")] = SimpleNamespace(dtype="BF16", shape=(7168, 3584))
        tensors[f"language_model.model.layers.{L}.self_attn.indexer.wq_b.weight"] = SimpleNamespace(
            dtype="BF16", shape=(4096, 1536))
    gate, proj, indexer = 4 * 896 * 7168 * 2, 4 * 3584 * 7168 * 2, 4 * 4096 * 1536 * 2
    embed = 1000 * 7168 * 2
    for vllm, whole in (("0.33", gate + proj), ("0.34", gate + proj + indexer)):
        req = ServingRequest.parse("vllm-rocm-plugin", Topology(8, ep=True), vllm=vllm, utilization=0.9)
        ctx = check.context(config, tensors, req)
        f = check.rank_fit(ctx, Topology(8, ep=True))
        assert f.replicated == whole, (vllm, f.replicated, whole)
        assert f.rest == (embed + proj + (0 if vllm == "0.34" else indexer)) // 8
        assert f"on every TP rank {whole / 1e9:.3g}" in f.text()
    odd = {**config, "text_config": {**config["text_config"], "hidden_size": 7169}}   # 7169 % 8: up proj whole
    req = ServingRequest.parse("vllm-rocm-plugin", Topology(8, ep=True), utilization=0.9)
    f = check.rank_fit(check.context(odd, tensors, req), Topology(8, ep=True))
    assert f.replicated == gate + 2 * proj + indexer
    cuda = ServingRequest.parse("vllm-cuda", Topology(8, ep=True), gpu_memory=200)   # nvidia/: up proj whole
    f = check.rank_fit(check.context(config, tensors, cuda), Topology(8, ep=True))
    assert f.replicated == gate + 2 * proj + indexer


def test_a_rank_that_fits_no_gpu_fails_and_the_sizes_that_fit_are_listed(k3_full_headers):
    """On one node of 141 GB GPUs no TP size fits K3 with EP (TP 12: 75 experts a rank, 128 GB > 127;
    TP 16: KimiMoE pads 192 to 256 and the plugin refuses): the advice says so; DP 2 fits."""
    config, tensors = k3_full_headers
    rule, c = _memory(config, tensors, Topology(8, ep=True), gpu_memory=141, utilization=0.9)   # an H200's 141 GB
    assert not rule.ok and "fit no 141 GB GPU at gpu_memory_utilization 0.9" in rule.message, rule.message
    assert "TP sizes that pass with EP: none up to 64" in c.notes, c.notes
    rule, _ = _memory(config, tensors, Topology(8, dp=2, ep=True), gpu_memory=141, utilization=0.9)
    assert rule.ok, rule.message                        # DP 2 x TP 8 + EP: 56 experts a rank
    rule, _ = _memory(config, tensors, Topology(8, ep=True), utilization=0.5)
    assert not rule.ok and "fit no MI300X or MI325X at gpu_memory_utilization 0.5" in rule.message


def test_memory_options_are_validated_at_the_edge(servable):
    r = run_cli("verify", servable, "--serving", "vllm-rocm", "--gpu-memory-utilization", "1.5")
    assert r.exit_code == 2 and "--gpu-memory-utilization must be in (0, 1]" in r.output, r.output
    # H11 (issue 40): no traceback for inf or 1e300 GB, and the value refused is the one given
    r = run_cli("verify", servable, "--serving", "vllm-rocm", "--gpu-memory-utilization", "1.0000001")
    assert r.exit_code == 2 and "got 1.0000001" in r.output, r.output
    for bad in ("inf", "1e300", "nan", "-1", "0", "1e7"):
        r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm", "--gpu-memory", bad)
        assert r.exit_code == 2 and "--gpu-memory must be a positive number of GB up to 1e+06" in r.output, (bad, r.output)
        assert f"got {float(bad)!r}" in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm", "--gpu-memory", "1e6")
    assert r.exit_code in (0, 5) and "1e+06 GB GPU" in r.output, r.output
    r = run_cli("verify", servable, "--gpu-memory", "80")
    assert r.exit_code == 2 and "used with --serving" in r.output


def test_verify_cli_gives_each_releases_verdict_on_k3_headers(servable, k3_full_headers, monkeypatch):
    """Issue 41, must show: `verify --serving vllm-rocm-plugin --tp 8 --ep` with K3's headers (92 MoE layers x
    896 experts at K3's expert dims: a header stand-in given to the serving check of a real output): 0.33 at
    its 0.92 does not fit MI300X, 0.34 at its 1.0 does, and each line says the KV-cache room in GB."""
    config, tensors = k3_full_headers
    real = check.serving_check
    monkeypatch.setattr(check, "serving_check", lambda _config, _tensors, request: real(config, tensors, request))
    lines = {}
    for vllm in ("0.33", "0.34"):
        r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm-plugin", "--tp", "8", "--ep",
                    "--vllm-version", vllm)
        lines[vllm] = " ".join(x.strip() for x in r.output.splitlines() if "GiB x" in x or "weights per rank" in x
                               or "gpu_memory_utilization" in x)
        assert r.exit_code == 0, r.output            # MI325X fits under both: the rule passes
    assert "MI300X 192 GiB x 0.92: does not fit (5.53 GB short)" in lines["0.33"], lines["0.33"]
    assert "MI325X 256 GiB x 0.92: 57.7 GB left for the KV cache" in lines["0.33"], lines["0.33"]
    assert "MI300X 192 GiB x 1: 11 GB left for the KV cache" in lines["0.34"], lines["0.34"]
    assert "MI325X 256 GiB x 1: 79.7 GB left for the KV cache" in lines["0.34"], lines["0.34"]
    assert "vLLM 0.33.0's default 0.92" in lines["0.33"] and "vLLM 0.34.0's default: 1 with" in lines["0.34"]
    print("\n".join(f"vLLM {v}: {x}" for v, x in lines.items()))


def test_verbose_names_where_the_memory_figures_come_from(servable):
    """--verbose cites the release's utilization rule and each kind of weight it keeps whole (the router,
    the latent projections, the norms of the fixture), from that release's module."""
    for vllm, cite in (("0.33", "vllm 0.33.0 config/cache.py 215"), ("0.34", "vllm 0.34.0 config/cache.py 186")):
        r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm-plugin", "--vllm-version", vllm,
                    "--verbose")
        assert f"memory: gpu_memory_utilization {cite}" in r.output, r.output
        assert "memory: kept whole on every TP rank, " + cite.split(" config")[0] + " models/kimi_k3/amd/linear.py 245" \
            in r.output, r.output
    r = run_cli("verify", servable, "--no-checksums", "--serving", "vllm-rocm-plugin", "--verbose",
                "--gpu-memory-utilization", "0.8")
    assert "memory: gpu_memory_utilization vllm" not in r.output and "--gpu-memory-utilization 0.8" in r.output
