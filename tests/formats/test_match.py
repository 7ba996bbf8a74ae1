"""formats/match.py against the loaders themselves, on one table of configs: compressed-tensors'
installed ``is_match``/``match_named_modules``, and vLLM 0.33's own matcher loaded from its released
sources (K3CONVERT_VLLM033_SRC, scripts/tools/fetch_server_sources.sh; skipped without them, failed under
K3CONVERT_REQUIRE_VLLM=1)."""
from __future__ import annotations

import fnmatch
import logging
import re
import types
from collections.abc import Iterable, Mapping
from typing import Any, cast

import pytest
from server_sources import functions, released_file
from torch import nn

from converter.formats import match
from converter.formats.checkpoint import quant_blocks
from converter.formats.dialect import EXPERT_TARGET, int4_block

CT_DIR = "model_executor/layers/quantization/compressed_tensors/"
UTILS, CONFIG_UTILS = CT_DIR + "utils.py", "model_executor/layers/quantization/utils/config_utils.py"
CT_CONFIG = CT_DIR + "compressed_tensors.py"
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def block(groups: dict[str, list[str]], ignore: list[str]) -> dict:
    """A compressed-tensors block whose groups differ by group size (which tells them apart in vLLM)."""
    b = int4_block([], ignore)
    w = b["config_groups"].pop("group_0")
    for n, (name, targets) in enumerate(groups.items()):
        b["config_groups"][name] = {**w, "targets": targets, "weights": {**w["weights"], "group_size": 32 << n}}
    return b


def nested(b: dict) -> dict:
    return {"model_type": "kimi_k3", "text_config": {"quantization_config": b}}


# One table: each config, top-level or nested in text_config, with one or more (conditional) groups.
CONFIGS = {
    "ours": nested(block({"group_0": [EXPERT_TARGET]}, ["lm_head", "model.layers.1.mlp.experts.0.gate_proj"])),
    "linear": {"quantization_config": block({"group_0": ["Linear"]}, ["lm_head"])},
    "linear-ignore-regex": nested(block({"group_0": ["Linear"]}, [r"re:.*self_attn.*", "re:.*mlp\\.gate$"])),
    "two-groups": nested(block({"group_0": [EXPERT_TARGET], "group_1": [r"re:.*self_attn\.(q|k|v|o)_proj$"]},
                               [r"re:model\.layers\.0\.mlp\..*"])),
    "later-group-wins": nested(block({"group_0": ["Linear", "lm_head"], "group_1": ["lm_head"]}, [])),
    "exact-names": nested(block({"group_0": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                             "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate"]}, [])),
    "ignore-by-class": nested(block({"group_0": ["re:.*"]}, ["Linear", "Embedding"])),
    "module-and-norm-class": nested(block({"group_0": ["Module", "DeepseekV3RMSNorm"]}, ["lm_head"])),
    "partial-regex": nested(block({"group_0": [r"re:layers\.\d+", r"re:model\.layers\.0\.self"]}, [])),  # re.match
    "backref": nested(block({"group_0": [EXPERT_TARGET, r"re:(m)(o)del\.n\2rm$"]}, [])),  # \2: its own group
    "case-blind-fragment": nested(block({"group_0": ["experts", "Embedding"]}, [])),
    "flag-and-backref": nested(block({"group_0": [r"re:(?i).*NORM$", r"re:(m)odel\.layers\.0\.(?!\1).*"]},
                                     [r"re:.*\.experts\.(?P<e>\d+)\..*"])),
    "fused-partly-ignored": nested(block({"group_0": ["Linear"]}, ["model.layers.0.self_attn.q_proj"])),
    "attention-group": {"quantization_config": block({"group_0": [r"re:.*self_attn\..*|LlamaAttention"],
                                                      "group_1": ["re:.*experts.*"]}, [])},   # vLLM drops group_0
    "both-levels": {"quantization_config": block({"group_0": ["lm_head"]}, []),
                    "text_config": {"quantization_config": block({"group_0": [EXPERT_TARGET]}, ["re:.*w2$"])}},
}


def blocks() -> list[tuple[str, str, dict]]:
    return [(case, ".".join(path), b) for case, cfg in CONFIGS.items() for path, b in quant_blocks(cfg)]


def targets_of(b: dict) -> list[str]:
    return [t for g in b["config_groups"].values() for t in g["targets"]]


# ---------------------------------------------------------------------------- compressed-tensors

class LinearBase(nn.Module):       # vLLM's base class name, which compressed-tensors counts as Linear
    pass


class ColumnParallelLinear(LinearBase):
    pass


class DeepseekV3RMSNorm(nn.Module):
    pass


def checkpoint_model() -> nn.Module:
    """A model as a compressed-tensors loader builds it: containers, Linears, a norm, an embedding."""
    leaves = {
        "model.embed_tokens": nn.Embedding(4, 4, device="meta"),
        "model.layers.0.input_layernorm": DeepseekV3RMSNorm(),
        "model.layers.0.self_attn.q_proj": nn.Linear(4, 4, device="meta"),
        "model.layers.0.self_attn.k_proj": nn.Linear(4, 4, device="meta"),
        "model.layers.0.self_attn.v_proj": nn.Linear(4, 4, device="meta"),
        "model.layers.0.self_attn.o_proj": ColumnParallelLinear(),
        "model.layers.0.mlp.gate_proj": nn.Linear(4, 4, device="meta"),
        "model.layers.1.mlp.gate": nn.Linear(4, 4, device="meta"),
        "model.layers.1.mlp.experts.0.w1": nn.Linear(4, 4, device="meta"),
        "model.layers.1.mlp.experts.7.w2": nn.Linear(4, 4, device="meta"),
        "model.layers.1.mlp.experts.12.down_proj": nn.Linear(4, 4, device="meta"),
        "model.norm": DeepseekV3RMSNorm(),
        "lm_head": nn.Linear(4, 4, device="meta"),
    }
    root = nn.Module()
    for name, module in leaves.items():
        parent = root
        *path, leaf = name.split(".")
        for p in path:
            if p not in parent._modules:
                parent.add_module(p, nn.Module())
            parent = parent._modules[p]
        parent.add_module(leaf, module)
    return root


@pytest.mark.parametrize("case, where, b", blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_compressed_tensors_variant_is_is_match(case, where, b):
    """Module by module (containers too) and over the loader's own traversal, both our forms equal
    compressed-tensors' ``is_match``."""
    from compressed_tensors.utils.match import is_match, match_named_modules

    model, targets, ignore = checkpoint_model(), targets_of(b), b["ignore"]
    rule = match.CtRule.of(targets, ignore)
    ours = []
    for name, module in model.named_modules():
        classes = match.class_names(module)
        want = is_match(name, module, targets, ignore)
        assert rule(name, classes) == match.ct_is_match(name, classes, targets, ignore) == want, (case, name)
        ours += [name] if want else []
    assert ours == [n for n, _ in match_named_modules(model, targets, ignore)], case


@pytest.mark.parametrize("case, where, b", blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_sources_selection_is_is_match_on_a_linear(case, where, b):
    """Which packed modules of a compressed-tensors source convert: those its loader quantized, the
    Linears ``is_match`` selects (not every module a capitalised target names)."""
    from compressed_tensors.utils.match import is_match

    from converter.formats.compressed_tensors import CompressedTensorsSource

    src = CompressedTensorsSource("compressed-tensors", (), "weight_packed", targets=tuple(targets_of(b)),
                                  ignore=tuple(b["ignore"]))
    for name, module in checkpoint_model().named_modules():
        if isinstance(module, nn.Linear):
            assert src.selects(name) == is_match(name, module, targets_of(b), b["ignore"]), (case, name)


def test_the_classes_a_checkpoint_name_stands_for():
    """What verify calls a module it knows by name only is what compressed-tensors sees on torch's."""
    assert match.class_names(nn.Linear(1, 1, device="meta")) == match.LINEAR
    assert match.class_names(nn.Module()) == match.MODULE


def test_a_bad_regex_is_an_error_as_in_the_loader():
    from compressed_tensors.utils.match import is_match

    with pytest.raises(re.error):
        is_match("a", nn.Module(), ["re:a)(b"])
    for form in (lambda: match.CtRule.of(["re:a)(b", "re:c"]), lambda: match.match_name("a", "re:a)(b")):
        with pytest.raises(match.BadPattern, match=r"re:a\)\(b is not a regular expression"):
            form()


# ---------------------------------------------------------------------------- vLLM

@pytest.fixture(scope="module")
def vllm() -> types.SimpleNamespace:
    """vLLM 0.33's own CompressedTensorsConfig matching: from_config (its real target -> scheme map,
    with compressed-tensors' QuantizationArgs), get_scheme_dict, should_ignore_layer,
    find_matched_target, is_equal_or_regex_match and the Linear -> RoutedExperts mapping."""
    import torch
    from compressed_tensors import CompressionFormat
    from compressed_tensors.quantization import (
        ActivationOrdering,
        QuantizationArgs,
        QuantizationType,
    )
    try:
        import regex as re_module  # what vLLM's config_utils imports as re
    except ImportError:
        import re as re_module

    ns: dict[str, Any] = {
        "re": re_module, "fnmatch": fnmatch.fnmatch, "MappingProxyType": types.MappingProxyType,
        "Iterable": Iterable, "Mapping": Mapping, "Module": nn.Module, "torch": torch, "Any": Any, "cast": cast,
        "QuantizationArgs": QuantizationArgs, "QuantizationType": QuantizationType, "CompressionFormat": CompressionFormat,
        "ActivationOrdering": ActivationOrdering, "logger": logging.getLogger("vllm-sources"),
    }
    functions(released_file("K3CONVERT_VLLM033_SRC", CONFIG_UTILS), {"find_matching_patterns", "is_equal_or_regex_match"}, ns)
    functions(released_file("K3CONVERT_VLLM033_SRC", UTILS), {"should_ignore_layer", "find_matched_target",
                                                             "_find_first_match", "_match_fused_layer",
                                                             "is_activation_quantization_format"}, ns)
    ns["QUANTIZATION_SCHEME_MAP_TYPE"] = dict
    functions(released_file("K3CONVERT_VLLM033_SRC", CT_CONFIG), {
        "from_config", "_quantization_scheme_map_from_config", "get_scheme_dict",
        "_add_fused_moe_to_target_scheme_map"}, ns, cls="CompressedTensorsConfig")

    class CompressedTensorsConfig:
        from_config = ns["from_config"]
        _quantization_scheme_map_from_config = ns["_quantization_scheme_map_from_config"]
        _parse_sparsity_config = classmethod(lambda cls, config: None)
        get_scheme_dict = ns["get_scheme_dict"]
        _add_fused_moe_to_target_scheme_map = ns["_add_fused_moe_to_target_scheme_map"]

        def __init__(self, **kw):
            self.__dict__.update(kw)

    return types.SimpleNamespace(config=CompressedTensorsConfig, **ns)


# (name vLLM asks the scheme of, the class of its layer): fused layers, the experts' lookups, the head
VLLM_LAYERS = [
    ("model.embed_tokens", "VocabParallelEmbedding"),
    ("model.layers.0.self_attn.qkv_proj", "QKVParallelLinear"),
    ("model.layers.0.self_attn.o_proj", "RowParallelLinear"),
    ("model.layers.0.mlp.gate_up_proj", "MergedColumnParallelLinear"),
    ("model.layers.1.mlp.gate", "ReplicatedLinear"),
    *((f"model.layers.1.mlp.experts.0.{p}", "RoutedExperts") for p in ("gate_proj", "up_proj", "down_proj")),
    ("lm_head", "ParallelLMHead"),
]


def vllm_verdict(fn) -> str | None:
    try:
        return fn()
    except ValueError as e:
        return f"ValueError: {e}"


@pytest.mark.parametrize("case, where, b", blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_vllm_variant_is_vllms_get_scheme_dict(vllm, case, where, b):
    """Layer by layer, the group our vLLM variant picks is the one whose scheme vLLM's own
    get_scheme_dict returns (groups told apart by group size), after a MoE layer mapped Linear onto
    RoutedExperts; a fused layer whose shards the ignore list splits is vLLM's ValueError."""
    import copy

    cfg = vllm.config.from_config(copy.deepcopy(b))
    cfg.packed_modules_mapping = FUSED
    cfg._add_fused_moe_to_target_scheme_map()
    by_size = {g["weights"]["group_size"]: name for name, g in b["config_groups"].items()}
    groups = {name: g["targets"] for name, g in b["config_groups"].items()}
    def theirs(name: str, cls: str) -> str | None:
        scheme = cfg.get_scheme_dict(type(cls, (nn.Module,), {})(), name)
        return None if scheme is None else by_size[scheme["weights"].group_size]

    for name, cls in VLLM_LAYERS:
        ours = vllm_verdict(lambda: match.vllm_group(name, cls, groups, b["ignore"], FUSED))  # noqa: B023
        assert ours == vllm_verdict(lambda: theirs(name, cls)), (case, name)  # noqa: B023 (called at once)


@pytest.mark.parametrize("case, where, b", blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_experts_why_not_is_vllms_verdict_on_the_experts_lookups(vllm, case, where, b):
    """What the server model asks: vLLM gives the experts' lookups a scheme exactly when we say so."""
    targets = targets_of(b)
    cfg = vllm.config(target_scheme_map={t: {"format": "x"} for t in targets}, ignore=b["ignore"],
                      quant_format="pack-quantized", packed_modules_mapping={})
    cfg._add_fused_moe_to_target_scheme_map()
    experts = type("RoutedExperts", (nn.Module,), {})()
    for name, cls in VLLM_LAYERS:
        if cls == "RoutedExperts":
            why = match.experts_why_not(name, cls, targets, b["ignore"])
            assert (why is None) == (cfg.get_scheme_dict(experts, name) is not None), (case, name, why)


def test_the_two_variants_differ_where_the_loaders_do():
    """The table's point: one rule would be wrong for one loader on each of these."""
    ct = lambda name, classes, t, i=(): match.ct_is_match(name, classes, t, i)
    # "Linear" reaches vLLM's experts layer, not compressed-tensors' experts container
    assert match.vllm_group("m.experts.0.gate_proj", "RoutedExperts", {"g": ["Linear"]}, []) == "g"
    assert not ct("m.experts", match.MODULE, ["Linear"])
    # a class ignore entry: compressed-tensors honours it, vLLM ignores by name only
    assert not ct("m.q_proj", match.LINEAR, ["re:.*"], ["Linear"])
    assert match.vllm_group("m.q_proj", "QKVParallelLinear", {"g": ["re:.*"]}, ["Linear"]) == "g"
    # a lower-case fragment of a class name: vLLM contains, compressed-tensors exact
    assert match.vllm_group("m.experts.0.up_proj", "RoutedExperts", {"g": ["experts"]}, []) == "g"
    assert not ct("m.experts.0.up_proj", match.LINEAR, ["experts"])
