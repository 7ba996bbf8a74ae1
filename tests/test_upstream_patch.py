"""patches/vllm-0.34.0-ct-int4-situ-gfx942.patch against vLLM 0.34.0's released files (docs/upstream.md).

(a) it applies to the released files (`git apply`, context checked);
(b) with it, vLLM's own `CompressedTensorsMoEMethod.get_moe_method`, fed vLLM's own
    `CompressedTensorsConfig` parsing of a converted K3 and K3.1 config, picks the patched method on a
    faked gfx942 with AITER MoE on, and not elsewhere; without the patch it picks the WNA16 method;
(c) the patched method's `process_weights_after_loading`, run on the CPU on random int4 experts,
    leaves byte for byte the plugin's layout (converter/vllm_plugin/layout.py), and builds the kernel
    the way vLLM's K3 int4 route does, with the layer's activation passed to it.

vLLM 0.34's package cannot be imported on this CPU machine without its full install, so the
definitions that run are compiled one by one from the released (and patched) files with `ast`
(`definitions` below, as tests/server_sources.py `functions` does): vLLM's code, with its
surroundings stubbed (platform, vLLM config, aiter's kernels, the MXFP4 oracle, the WNA16 method).
What the stubs stand for is not tested here: that is said in docs/upstream.md.

Sources (never copied into the repo; skipped when absent, failed under K3CONVERT_REQUIRE_VLLM=1):
  K3CONVERT_VLLM034_SRC  the `vllm/` package directory of vllm 0.34.0 (PyPI wheel, Python files):
                         the files in NEEDED
  K3CONVERT_AITER_SRC    the `aiter/` directory of amd-aiter 0.1.7.post2.dev18 (its ops/shuffle.py)
"""
from __future__ import annotations

import ast
import copy
import importlib.machinery
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterable, Mapping
from enum import Enum
from fnmatch import fnmatch
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import pytest
import regex
import server_sources
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from converter.vllm_plugin import layout

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "patches" / "vllm-0.34.0-ct-int4-situ-gfx942.patch"
ENV = "K3CONVERT_VLLM034_SRC"
PKG = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
CT = "model_executor/layers/quantization/compressed_tensors"
CT_MOE = f"{CT}/compressed_tensors_moe/compressed_tensors_moe.py"
FLYDSL = f"{CT}/compressed_tensors_moe/compressed_tensors_moe_w4a16_flydsl.py"
AITER_METHOD = f"{CT}/compressed_tensors_moe/compressed_tensors_moe_w4a16_aiter.py"   # added by the patch
NEEDED = (
    CT_MOE,                                                         # get_moe_method (patched)
    FLYDSL,                                                         # the patched method's base and helpers
    f"{CT}/compressed_tensors.py",                                  # CompressedTensorsConfig
    f"{CT}/utils.py",                                               # its target / ignore matching
    f"{CT}/schemes/compressed_tensors_wNa16.py",                    # WNA16_SUPPORTED_BITS
    "model_executor/layers/quantization/utils/config_utils.py",     # is_equal_or_regex_match
    "model_executor/layers/fused_moe/activation.py",                # MoEActivation
    "model_executor/utils.py",                                      # replace_parameter
)


def src(rel: str) -> Path:
    return server_sources.released_file(ENV, rel)


def definitions(path: Path, names: set[str], ns: dict, cls: str | None = None) -> dict:
    """Compile only the named top-level functions, classes and assignments of a file we did not write
    (or, with ``cls``, build a class of that name holding only the named methods, its bases taken from
    ``ns['__bases__']``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body
    if cls is not None:
        nodes = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body

    def name_of(node: ast.stmt) -> str | None:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            return node.name
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            return target.id if isinstance(target, ast.Name) else None
        return None

    found = [n for n in nodes if name_of(n) in names]
    assert {name_of(n) for n in found} == names, f"{path} lacks {names - {name_of(n) for n in found}}"
    if cls is not None:
        bases = [ast.Name(b, ast.Load()) for b in ns.get("__bases__", ())]
        found = [ast.ClassDef(name=cls, bases=bases, keywords=[], body=found, decorator_list=[])]
    module = ast.fix_missing_locations(ast.Module(body=found, type_ignores=[]))
    exec(compile(module, str(path), "exec"), ns)
    return ns


def module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


class Logger:
    def __getattr__(self, _name):
        return lambda *a, **k: None


# ---------------------------------------------------------------- (a) it applies

def patched_files() -> list[str]:
    """The released files the patch modifies (``--- a/vllm/...``), relative to ``vllm/``."""
    return re.findall(r"^--- a/vllm/(\S+)$", PATCH.read_text(), flags=re.M)


@pytest.fixture
def patched(tmp_path) -> Path:
    """A copy of the released files the patch touches, with the patch applied; returns its ``vllm/``."""
    for rel in patched_files():
        dst = tmp_path / "vllm" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src(rel), dst)
    git = shutil.which("git")
    assert git, "git is needed to apply the patch"
    # its own repository: inside another one, git apply would skip paths outside the current directory
    subprocess.run([git, "init", "-q"], cwd=tmp_path, check=True)
    for args in (["--check"], []):
        done = subprocess.run([git, "apply", "-p1", *args, str(PATCH)], cwd=tmp_path,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    return tmp_path / "vllm"


def test_patch_applies_to_the_released_files(patched):
    """Context lines and all: `git apply` refuses a hunk whose context is not the released file's."""
    assert patched_files() == [CT_MOE]
    assert (patched / AITER_METHOD).is_file()
    assert (patched.parent / "tests/kernels/moe/test_compressed_tensors_w4a16_aiter.py").is_file()
    for rel in (CT_MOE, AITER_METHOD):
        ast.parse((patched / rel).read_text())
    assert (patched / CT_MOE).read_text() != src(CT_MOE).read_text()


# ---------------------------------------------------------------- (b) vLLM's own selection

def moe_activation() -> type[Enum]:
    """vLLM 0.34's MoEActivation (fused_moe/activation.py), with from_str and its aliases."""
    ns = definitions(src("model_executor/layers/fused_moe/activation.py"), {"MoEActivation", "_STR_ALIASES"},
                     {"Enum": Enum, "torch": torch})
    return ns["MoEActivation"]


def ct_config_cls(ns: dict) -> type:
    """vLLM 0.34's CompressedTensorsConfig: the methods get_moe_method reaches, from its file, over a
    QuantizationConfig base that holds only what its __init__ sets (packed_modules_mapping)."""
    from compressed_tensors.config import CompressionFormat, SparsityCompressionConfig
    from compressed_tensors.quantization import (
        ActivationOrdering,
        QuantizationArgs,
        QuantizationStrategy,
        QuantizationType,
    )
    from compressed_tensors.transform import TransformConfig

    class QuantizationConfig:
        def __init__(self):
            self.packed_modules_mapping: dict[str, list[str]] = {}

    ns.update(torch=torch, re=regex, fnmatch=fnmatch, Iterable=Iterable, Mapping=Mapping,
              MappingProxyType=MappingProxyType, CompressionFormat=CompressionFormat,
              QuantizationStrategy=QuantizationStrategy, QuantizationType=QuantizationType,
              QuantizationArgs=QuantizationArgs, ActivationOrdering=ActivationOrdering,
              SparsityCompressionConfig=SparsityCompressionConfig, TransformConfig=TransformConfig,
              Module=torch.nn.Module, Any=Any, Literal=Literal, cast=lambda _t, v: v,
              QUANTIZATION_SCHEME_MAP_TYPE=dict, QuantKey=object, logger=Logger(),
              __bases__=("QuantizationConfig",), QuantizationConfig=QuantizationConfig)
    definitions(src("model_executor/layers/quantization/utils/config_utils.py"),
                {"find_matching_patterns", "is_equal_or_regex_match"}, ns)
    definitions(src(f"{CT}/utils.py"), {"is_activation_quantization_format", "should_ignore_layer",
                                        "find_matched_target", "_find_first_match", "_match_fused_layer"}, ns)
    definitions(src(f"{CT}/compressed_tensors.py"), {"SPARSITY_CONFIG_NAME"}, ns)
    definitions(src(f"{CT}/compressed_tensors.py"),
                {"__init__", "from_config", "_parse_sparsity_config", "_quantization_scheme_map_from_config",
                 "_add_fused_moe_to_target_scheme_map", "get_scheme_dict", "_is_mxfp4", "_is_mxfp4_w4a8_fp8",
                 "_is_mxfp8", "_is_wNa16_group_channel"}, ns, cls="CompressedTensorsConfig")
    return ns["CompressedTensorsConfig"]


def wna16_bits() -> list[int]:
    """WNA16_SUPPORTED_BITS: the keys of WNA16_SUPPORTED_TYPES_MAP (schemes/compressed_tensors_wNa16.py)."""
    tree = ast.parse(src(f"{CT}/schemes/compressed_tensors_wNa16.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign)
               and getattr(n.targets[0], "id", None) == "WNA16_SUPPORTED_TYPES_MAP"]
    return [ast.literal_eval(k) for k in node.value.keys]


class Recorded:
    """Stands for a vLLM method class this test does not run: records how it was built."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class Machine:
    """The platform, vLLM config and aiter the selection asks about (faked; defaults: K3 on gfx942)."""

    def __init__(self, gfx942=True, gfx950=False, aiter_moe=True, moe_backend="auto", lora=None,
                 gemm1_params=("act", "situ_beta", "situ_linear_beta"), silu_only_module=False):
        self.gfx942, self.gfx950, self.aiter_moe = gfx942, gfx950, aiter_moe
        self.vllm_config = types.SimpleNamespace(lora_config=lora,
                                                 kernel_config=types.SimpleNamespace(moe_backend=moe_backend))
        self.gemm1_params = gemm1_params
        self.silu_only_module = silu_only_module     # aiter between #4502 and #4646


def flydsl_ns(aiter_shuffle_weight=None) -> dict:
    """vLLM 0.34's CompressedTensorsW4A16FlydslMoEMethod and its CT -> FlyDSL helpers, over a
    CompressedTensorsMoEMethod base that only keeps the MoE config (FusedMoEMethodBase.__init__)."""
    class CompressedTensorsMoEMethod:
        def __init__(self, moe):
            self.moe = moe
            self.moe_quant_config = None
            self.moe_kernel = None

    ns = {"torch": torch, "shuffle_weight": aiter_shuffle_weight, "QuantizationArgs": object,
          "FusedMoEConfig": object, "FusedMoEQuantConfig": object, "RoutedExperts": object,
          "SharedExperts": object, "CompressedTensorsMoEMethod": CompressedTensorsMoEMethod,
          "logger": Logger()}
    return definitions(src(FLYDSL), {"_unpack_gptq_int32_to_signed_int4",
                                     "_pack_shuffled_int8_to_packed_int4_no_perm",
                                     "_gptq_int32_to_flydsl_packed", "CompressedTensorsW4A16FlydslMoEMethod"}, ns)


class Kernel:
    """Stands for the FusedMoEKernel make_mxfp4_moe_kernel builds: records its build and its calls."""

    def __init__(self, **kwargs):
        self.built, self.calls = kwargs, []
        self.fused_experts = types.SimpleNamespace(keep_constants=lambda layer: None)

    def apply(self, **kwargs):
        self.calls.append(kwargs)
        return "out"


def aiter_method_ns(patched: Path, moe_activation_cls, flydsl: dict, replace_parameter) -> dict:
    """The patched file's CompressedTensorsW4A16AiterMoEMethod and helpers, with the MXFP4 oracle's
    functions and aiter's dtypes standing in (what they are: docs/upstream.md)."""
    backend = Enum("Mxfp4MoeBackend", {"AITER_MXFP4_BF16": "AITER_MXFP4_BF16"})
    ns = {"torch": torch, "inspect": inspect, "importlib": importlib, "os": os, "logger": Logger(),
          "QuantizationArgs": object, "FusedMoEConfig": object, "FusedMoEQuantConfig": object,
          "RoutedExperts": object, "SharedExperts": object, "UnfinalizedMoEOutput": object,
          "MoEActivation": moe_activation_cls, "Mxfp4MoeBackend": backend,
          "backend_to_kernel_cls": lambda b: [f"AiterMxfp4Experts<{b.name}>"],
          "make_mxfp4_moe_kernel": Kernel,
          "make_mxfp4_moe_quant_config": lambda **kw: ("mxfp4_w4a16", kw),
          "mxfp4_round_up_hidden_size_and_intermediate_size": lambda b, h, i, activation: (h, i),
          "replace_parameter": replace_parameter,
          "CompressedTensorsW4A16FlydslMoEMethod": flydsl["CompressedTensorsW4A16FlydslMoEMethod"],
          "_gptq_int32_to_flydsl_packed": flydsl["_gptq_int32_to_flydsl_packed"]}
    return definitions(patched / AITER_METHOD, {"_CONVERT_CHUNK_VALUES", "_GEMM1_ACTIVATION_PARAMS",
                                                "_SILU_ONLY_INT4_MODULE",
                                                "check_aiter_int4_gemm1_activation", "ct_int4_to_aiter_int4_",
                                                "CompressedTensorsW4A16AiterMoEMethod"}, ns)


def install(monkeypatch, machine: Machine, moe_activation_cls, aiter_ns: dict | None, flydsl: dict) -> None:
    """sys.modules entries for what get_moe_method and the method import at call time."""
    rocm_aiter_ops = types.SimpleNamespace(
        is_fused_moe_enabled=lambda: machine.aiter_moe,
        is_fused_moe_situv2_gate_up_interleaved=lambda: False,
        is_fused_moe_situv2_enabled=lambda: False)

    def gemm1(**_kw):
        """Stands for aiter's flydsl_a16w4_gemm1, with the machine's keyword parameters."""

    gemm1.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY) for p in ("a_bf16", *machine.gemm1_params)])
    entries = {
        "vllm._aiter_ops": module("vllm._aiter_ops", rocm_aiter_ops=rocm_aiter_ops),
        "vllm.model_executor.layers.fused_moe.activation": module("activation", MoEActivation=moe_activation_cls),
        "vllm.platforms.rocm": module("vllm.platforms.rocm", on_gfx942=lambda: machine.gfx942,
                                      on_gfx950=lambda: machine.gfx950),
        "aiter.ops.flydsl.kernels": module("aiter.ops.flydsl.kernels", __path__=[]),
        "aiter.ops.flydsl.kernels.moe_2stage_a16wmix": module("kernels", flydsl_a16w4_gemm1=gemm1),
        "aiter.dtypes": module("aiter.dtypes", i4x2=torch.uint8),
        PKG: module(PKG),
        f"{PKG}.compressed_tensors_moe_w4a16_flydsl": module("flydsl", **flydsl),
        f"{PKG}.compressed_tensors_moe_wna16": module("wna16", CompressedTensorsWNA16MoEMethod=Recorded),
    }
    if machine.silu_only_module:
        name = "aiter.ops.flydsl.kernels.moe_gemm_2stage"
        entries[name] = module(name, __spec__=importlib.machinery.ModuleSpec(name, None))
    if aiter_ns is not None:
        entries[f"{PKG}.compressed_tensors_moe_w4a16_aiter"] = module("w4a16_aiter", **aiter_ns)
    entries["aiter"] = module("aiter", dtypes=entries["aiter.dtypes"])
    for name, mod in entries.items():
        monkeypatch.setitem(sys.modules, name, mod)


def get_moe_method(ct_moe: Path, machine: Machine) -> Any:
    """vLLM's CompressedTensorsMoEMethod.get_moe_method compiled from ``ct_moe``."""
    from compressed_tensors import CompressionFormat
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

    ns = {"__name__": f"{PKG}.compressed_tensors_moe", "__package__": PKG, "torch": torch,
          "CompressionFormat": CompressionFormat, "QuantizationStrategy": QuantizationStrategy,
          "QuantizationType": QuantizationType, "WNA16_SUPPORTED_BITS": wna16_bits(), "logger": Logger(),
          "FusedMoEMethodBase": object, "UnquantizedFusedMoEMethod": Recorded,
          "current_platform": types.SimpleNamespace(is_rocm=lambda: True),
          "get_current_vllm_config": lambda: machine.vllm_config}
    definitions(ct_moe, {"get_moe_method"}, ns, cls="CompressedTensorsMoEMethod")
    return ns["CompressedTensorsMoEMethod"].get_moe_method


class RoutedExperts(torch.nn.Module):
    """Named as vLLM's class: compressed-tensors matches a "RoutedExperts" target by class name."""

    def __init__(self, moe_config):
        super().__init__()
        self.moe_config = moe_config
        self.ckpt_gate_proj_name, self.ckpt_up_proj_name, self.ckpt_down_proj_name = "w1", "w3", "w2"


def moe_config(text: dict, moe_activation_cls) -> types.SimpleNamespace:
    """The FusedMoEConfig fields the selection and the method read, as vLLM 0.34's KimiMoE fills them
    from text_config (models/kimi_k3/amd/linear.py 237-242 and 338-340: the betas only for situ;
    fused_moe/layer.py 239: MoEActivation.from_str)."""
    situ = text["hidden_act"] == "situ"
    return types.SimpleNamespace(
        activation=moe_activation_cls.from_str(text["hidden_act"]),
        activation_situ_beta=text.get("activation_situ_beta") if situ else None,
        activation_situ_linear_beta=text.get("activation_situ_linear_beta") if situ else None,
        is_act_and_mul=True)


def k31(config: dict) -> dict:
    """A K3 output's config as Kimi K3.1's (vLLM 0.34: registry.py 493-496 maps the architecture to the
    K3 classes; transformers_utils/config.py 152 model_type kimi_k31; configs/kimi_linear.py 16-40
    dsa_config). The experts' quantization and SiTU fields are K3's: what the selection reads."""
    out = copy.deepcopy(config)
    out["model_type"] = "kimi_k31"
    out["architectures"] = ["KimiK31ForConditionalGeneration"]
    out["text_config"]["dsa_config"] = {"dsa_layers": [1], "index_topk": 2048, "index_head_dim": 64,
                                        "index_num_heads": 16}
    return out


@pytest.fixture(scope="module")
def k3_configs(tmp_path_factory) -> dict[str, dict]:
    """config.json of a K3-shaped fixture converted by k3convert, and its K3.1 twin."""
    from conftest import SPEC, ct_mxfp4_encode

    from converter.fixture import make_fixture
    from converter.run.options import Options
    from converter.run.pipeline import convert

    for rel in NEEDED:       # skip (or fail) before converting when the sources are absent
        src(rel)
    root = tmp_path_factory.mktemp("upstream")
    make_fixture(str(root / "src"), SPEC, encoder=ct_mxfp4_encode)
    convert(str(root / "src"), str(root / "dst"), Options())
    k3 = json.loads((root / "dst" / "config.json").read_text())
    return {"kimi_k3": k3, "kimi_k31": k31(k3)}


def select(ct_moe: Path, config: dict, machine: Machine, monkeypatch, patched: Path | None,
           layer_name: str = "language_model.model.layers.1.block_sparse_moe.experts") -> Any:
    """What vLLM's get_moe_method returns for the routed experts of ``config`` on ``machine``.

    The quantization config is the text config's (vLLM 0.34 KimiK3Config lifts it:
    transformers_utils/configs/kimi_k3.py 133-134), parsed by vLLM's CompressedTensorsConfig.from_config.
    """
    act = moe_activation()
    flydsl = flydsl_ns()
    aiter = None if patched is None else aiter_method_ns(patched, act, flydsl, replace_parameter=None)
    install(monkeypatch, machine, act, aiter, flydsl)
    cfg_cls = ct_config_cls({})
    quant = cfg_cls.from_config(copy.deepcopy(config["text_config"]["quantization_config"]))
    layer = RoutedExperts(moe_config(config["text_config"], act))
    return get_moe_method(ct_moe, machine)(quant, layer, layer_name)


@pytest.mark.parametrize("model_type", ["kimi_k3", "kimi_k31"])
def test_gfx942_picks_the_patched_method(patched, k3_configs, model_type, monkeypatch):
    config = k3_configs[model_type]
    method = select(patched / CT_MOE, config, Machine(), monkeypatch, patched)
    assert type(method).__name__ == "CompressedTensorsW4A16AiterMoEMethod"
    patched_module = sys.modules[f"{PKG}.compressed_tensors_moe_w4a16_aiter"]
    assert type(method) is patched_module.CompressedTensorsW4A16AiterMoEMethod
    text = config["text_config"]
    assert method.moe.activation.value == "situ"
    assert (method.moe.activation_situ_beta, method.moe.activation_situ_linear_beta) == \
        (text["activation_situ_beta"], text["activation_situ_linear_beta"])
    assert (method.group_size, method.num_bits, method.mxfp4_backend.name) == (32, 4, "AITER_MXFP4_BF16")


def test_released_file_falls_to_wna16(k3_configs, monkeypatch):
    """Without the patch, vLLM 0.34 gives the same K3 output on the same machine its WNA16 method
    (TRITON refuses SiTU, EMULATION dequantizes: docs/upstream.md)."""
    method = select(src(CT_MOE), k3_configs["kimi_k3"], Machine(), monkeypatch, None)
    assert isinstance(method, Recorded)


@pytest.mark.parametrize("machine", [
    pytest.param(Machine(gfx942=False), id="not-gfx942"),
    pytest.param(Machine(aiter_moe=False), id="aiter-moe-off"),
    pytest.param(Machine(moe_backend="emulation"), id="emulation"),
    pytest.param(Machine(moe_backend="triton"), id="triton"),
    pytest.param(Machine(lora=object()), id="lora"),
    pytest.param(Machine(gfx942=False, gfx950=True, moe_backend="flydsl"), id="gfx950-flydsl-computes-silu"),
])
def test_elsewhere_the_patched_method_stays_out(patched, k3_configs, machine, monkeypatch):
    """WNA16 (vLLM's choice today) wherever the AITER int4 SiTU kernel is not the one to use; on gfx950
    with --moe-backend flydsl the patch also keeps SiTU experts off fused_flydsl_moe (it computes SiLU)."""
    method = select(patched / CT_MOE, k3_configs["kimi_k3"], machine, monkeypatch, patched)
    assert isinstance(method, Recorded)


def weights(text: dict) -> dict:
    return text["quantization_config"]["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("edit", [
    pytest.param(lambda t: t.update(hidden_act="silu"), id="silu-keeps-triton"),
    pytest.param(lambda t: t.update(activation_situ_linear_beta=None), id="situ-without-linear-beta"),
    pytest.param(lambda t: weights(t).update(group_size=128), id="g128"),
    pytest.param(lambda t: weights(t).update(symmetric=False), id="asymmetric"),
])
def test_other_checkpoints_stay_out(patched, k3_configs, edit, monkeypatch):
    config = copy.deepcopy(k3_configs["kimi_k3"])
    edit(config["text_config"])
    method = select(patched / CT_MOE, config, Machine(), monkeypatch, patched)
    assert isinstance(method, Recorded)


@pytest.mark.parametrize("machine,error", [
    pytest.param(Machine(gemm1_params=("act",)), "takes no situ_beta; .* takes no situ_linear_beta",
                 id="gemm1-without-situ-betas"),
    pytest.param(Machine(silu_only_module=True), "it has aiter.ops.flydsl.kernels.moe_gemm_2stage",
                 id="aiter-before-4646"),
])
def test_silu_only_aiter_is_refused(patched, k3_configs, machine, error, monkeypatch):
    """Fail closed: an aiter whose flydsl_a16w4_gemm1 takes `act` but no SiTU betas, or one from between
    #4502 and #4646 (int4 stage 1 in moe_gemm_2stage, SiLU hard-coded), would compute SiLU."""
    with pytest.raises(RuntimeError, match=error):
        select(patched / CT_MOE, k3_configs["kimi_k3"], machine, monkeypatch, patched)


# ---------------------------------------------------------------- (c) the plugin's bytes

def vllm_replace_parameter(monkeypatch) -> Any:
    """vLLM 0.34's replace_parameter (model_executor/utils.py): keeps the loaded storage."""
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload.direct",
                        module("direct", direct_reload_enabled=lambda: False))
    ns = {"torch": torch, "set_weight_attrs": lambda p, attrs: [setattr(p, k, v) for k, v in attrs.items()]}
    definitions(src("model_executor/utils.py"),
                {"replace_parameter", "_in_own_storage", "_extent", "storage_view"}, ns)
    return ns["replace_parameter"]


@pytest.mark.parametrize("e,inter,hidden,chunk_values", [
    (3, 64, 128, 1 << 27),        # one chunk
    (5, 64, 256, 128 * 256),      # w13 one expert a chunk, w2 two (2, 2, 1)
    (6, 128, 64, 4 * 256 * 64),   # w13 chunks of 4 and 2, w2 one chunk
])
def test_process_weights_gives_the_plugin_bytes(patched, e, inter, hidden, chunk_values, monkeypatch):
    shuffle_weight = server_sources.aiter_shuffle(
        server_sources.released_file("K3CONVERT_AITER_SRC", "ops/shuffle.py")).shuffle_weight
    act = moe_activation()
    flydsl = flydsl_ns(shuffle_weight)
    replace_parameter = vllm_replace_parameter(monkeypatch)
    ns = aiter_method_ns(patched, act, flydsl, replace_parameter)
    ns["_CONVERT_CHUNK_VALUES"] = chunk_values
    machine = Machine()
    install(monkeypatch, machine, act, ns, flydsl)

    gen = torch.Generator().manual_seed(e * inter + hidden)
    shapes = {"w13": (2 * inter, hidden), "w2": (hidden, inter)}
    codes = {name: torch.randint(-8, 8, (e, n, k), dtype=torch.int8, generator=gen)
             for name, (n, k) in shapes.items()}
    for c in codes.values():
        c[:, 0, :8] = -8          # k3convert writes -8; the load-time requantizer never does
    scales = {name: (torch.rand(e, n, k // 32, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
              for name, (n, k) in shapes.items()}

    moe = moe_config({"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}, act)
    quant_args = types.SimpleNamespace(num_bits=4, strategy="group", group_size=32, symmetric=True)
    method = ns["CompressedTensorsW4A16AiterMoEMethod"](quant_args, None, moe)

    # the layer as the FlyDSL create_weights lays out what vLLM's loader writes:
    # words [E, K/8, N], scales [E, G, N]
    layer = torch.nn.Module()
    for name in shapes:
        words = pack_to_int32(codes[name], 4)           # [E, N, K/8], nibble = q + 8
        layer.register_parameter(f"{name}_weight_packed",
                                 torch.nn.Parameter(words.transpose(1, 2).contiguous(), requires_grad=False))
        scale = scales[name].transpose(1, 2).contiguous()
        layer.register_parameter(f"{name}_weight_scale", torch.nn.Parameter(scale, requires_grad=False))
    storage = {n: getattr(layer, f"{n}_weight_packed").data.untyped_storage().data_ptr() for n in shapes}
    layer._expert_routing_tables = lambda: "tables"
    method.process_weights_after_loading(layer)

    for name in shapes:
        ours_w, ours_s = layout.convert_experts_(pack_to_int32(codes[name], 4), scales[name].clone())
        theirs_w = getattr(layer, f"{name}_weight_packed")
        assert theirs_w.shape == ours_w.shape and theirs_w.is_shuffled
        assert torch.equal(theirs_w.data.view(torch.uint8), ours_w.view(torch.uint8)), name
        assert torch.equal(getattr(layer, f"{name}_weight_scale").data.view(torch.int16),
                           ours_s.view(torch.int16)), name
        # in place: the laid-out weights live in the storage vLLM's loader filled
        assert theirs_w.data.untyped_storage().data_ptr() == storage[name]

    # the kernel vLLM's K3 int4 route builds (quantization/mxfp4.py _setup_kernel_k3_situ_gfx942)
    kernel = method.moe_kernel
    assert kernel.built["mxfp4_backend"].name == "AITER_MXFP4_BF16"
    assert kernel.built["experts_cls"] == "AiterMxfp4Experts<AITER_MXFP4_BF16>"
    assert kernel.built["moe_config"] is moe and kernel.built["routing_tables"] == "tables"
    assert kernel.built["moe_quant_config"][1]["w1_scale"] is layer.w13_weight_scale
    # apply hands the kernel the layer's activation and expert map (the betas ride in moe_config)
    layer.activation, layer.expert_map = moe.activation, "emap"
    layer.global_num_experts, layer.apply_router_weight_on_input = e, False
    assert method.apply(layer, "x", "w", "ids", None, None) == "out"
    call = kernel.calls[-1]
    assert call["activation"] is act.SITU and call["expert_map"] == "emap"
    assert call["w1"] is layer.w13_weight_packed and call["w2"] is layer.w2_weight_packed
