"""The experts' SwiGLU clamp of Ling-3.0 (per layer, ``expert_swiglu_limit_list``) and GLM-5.3
(``swiglu_limit``) on each server's int4 MoE path, as ``verify --serving`` models it
(converter/servers/ ``clamp_limits``, ``_sglang_clamp``, ``VLLM_CUDA_CLAMP``):

- vLLM 0.33.0 CUDA: MARLIN or TRITON, both apply the clamp (the default backends);
- SGLang 0.5.23 ROCm (CompressedTensorsWNA16TritonMoE): Ling's limit arrives as gemm1_clamp_limit and
  is applied; GLM's arrives as swiglu_limit, which the Triton path asserts is 10 and then clamps with a
  CUDA/XPU-only kernel when no expert is filtered: AssertionError at the first forward on ROCm;
- SGLang 0.5.23 CUDA (Marlin by default): Marlin gets swiglu_limit only, so GLM's is applied and Ling's
  dropped.

The SGLang dataflow those verdicts rest on is read from SGLang 0.5.23's released files where
K3CONVERT_SGLANG0523_SRC names the wheel's ``sglang/`` directory (``test_sglangs_own_code``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import glm5_fixture as glm
import ling_fixture as ling
import pytest
import serving_rules as serving
from server_sources import released_file

from tests.conftest import converted_model, with_config


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    return {"ling": converted_model(tmp_path_factory, "clamp-ling", ling.write)[1],
            "glm": converted_model(tmp_path_factory, "clamp-glm", glm.write)[1]}


def kernel(dst: str, server: str, vllm: str | None = None) -> serving.RuleResult:
    return {r.rule: r for r in serving.rules(dst, server, 1, vllm=vllm)}["kernel"]


def test_vllm_cuda_applies_both_clamps(outs):
    ling_k, glm_k = kernel(outs["ling"], "vllm-cuda", "0.33"), kernel(outs["glm"], "vllm-cuda", "0.33")
    assert ling_k.ok and "MARLIN" in ling_k.message and "silu with the clamp (expert_swiglu_limit_list 7, 10)" \
        in ling_k.message, ling_k.message
    assert glm_k.ok and "TRITON" in glm_k.message and "silu with the clamp (swiglu_limit 10)" in glm_k.message


def test_vllm_034_gives_ling_swiglustep(outs):
    """vLLM 0.34's Ling MoE passes swiglustep where a layer has a limit (bailing_moe_v3.py 1205-1207):
    min(silu(gate), limit) * clamp(up), where 0.33 clamped the gate before silu."""
    ling_k = kernel(outs["ling"], "vllm-cuda", "0.34")
    assert ling_k.ok and "takes swiglustep" in ling_k.message, ling_k.message
    assert "FusedMoE gets activation swiglustep (expert_swiglu_limit_list 7, 10)" in ling_k.message
    config, tensors = serving.load(outs["ling"])
    mats = serving.matrices(tensors)
    verdict = serving.kernel("vllm-cuda", config, mats, serving.layer_sizes(mats)[0], 1, "0.34")
    assert "the activation: vllm 0.34.0 model_executor/models/bailing_moe_v3.py 1205-1207" in verdict.detail
    glm_k = kernel(outs["glm"], "vllm-cuda", "0.34")     # GLM is unchanged: silu with FusedMoE's clamp
    assert glm_k.ok and "silu with the clamp (swiglu_limit 10)" in glm_k.message


def test_sglang_rocm_applies_lings_clamp_and_asserts_on_glms(outs, tmp_path):
    ling_k = kernel(outs["ling"], "sglang-rocm")
    assert ling_k.ok and "with the clamp (expert_swiglu_limit_list 7, 10" in ling_k.message
    glm_k = kernel(outs["glm"], "sglang-rocm")
    assert not glm_k.ok and "AssertionError at the first forward" in glm_k.message
    assert "CUDA/XPU-only kernel when no expert is filtered" in glm_k.message
    assert "fused_moe.py 763-782 (777-782" in glm_k.detail
    other = with_config(outs["glm"], str(tmp_path),
                        lambda c: c["text_config"].update(swiglu_limit=7.0))
    glm7 = kernel(other, "sglang-rocm")
    assert not glm7.ok and "asserts swiglu_limit == 10 (swiglu_limit 7)" in glm7.message, glm7.message
    assert {r.rule: r.ok for r in serving.rules(outs["glm"], "vllm-rocm", 1)}["kernel"]


def test_sglang_cuda_marlin_drops_only_lings_clamp(outs, tmp_path):
    ling_k = kernel(outs["ling"], "sglang-cuda")
    assert not ling_k.ok and "dropped by Marlin (wrong numerics)" in ling_k.message
    assert "compressed_tensors_wNa16_moe.py 493" in ling_k.detail
    glm_k = kernel(outs["glm"], "sglang-cuda")
    assert glm_k.ok and "with the clamp (swiglu_limit 10, Marlin" in glm_k.message
    unclamped = with_config(outs["ling"], str(tmp_path), lambda c: c.update(expert_swiglu_limit_list=[0, 0, 0]))
    assert kernel(unclamped, "sglang-cuda").ok


# ------------------------------------------------------------------ SGLang 0.5.23's own files

def sglang_file(rel: str) -> Path:
    return released_file("K3CONVERT_SGLANG0523_SRC", rel)


def calls_with(tree: ast.AST, cls: str, method: str) -> list[dict[str, str]]:
    """Each call's keyword arguments (as source text) inside ``cls.method``."""
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return [{k.arg: ast.unparse(k.value) for k in c.keywords if k.arg}
            for c in ast.walk(fn) if isinstance(c, ast.Call)]


def test_sglangs_own_code():
    """What the verdicts above rest on, in SGLang 0.5.23's released files: Ling's MoE passes its limit
    as gemm1_clamp_limit and GLM's (DeepseekV2MoE) as swiglu_limit; Marlin passes swiglu_limit only;
    the Triton path asserts swiglu_limit == 10 and, when no expert is filtered, a CUDA/XPU platform."""
    ling_calls = calls_with(ast.parse(sglang_file("srt/models/bailing_moe_v3.py").read_text()), "BailingMoE",
                            "__init__")
    experts = next(c for c in ling_calls if "num_fused_shared_experts" in c and "gemm1_clamp_limit" in c)
    assert experts["gemm1_clamp_limit"] == "self.expert_swiglu_limit" and "swiglu_limit" not in experts
    glm_src = sglang_file("srt/models/glm5_next.py").read_text()
    assert "from sglang.srt.models.deepseek_v2 import DeepseekV2MoE as Glm5NextMoE" in glm_src
    ds_calls = calls_with(ast.parse(sglang_file("srt/models/deepseek_v2.py").read_text()), "DeepseekV2MoE",
                          "__init__")
    experts = next(c for c in ds_calls if "num_fused_shared_experts" in c and "swiglu_limit" in c)
    assert experts["swiglu_limit"] == "getattr(config, 'swiglu_limit', None)" and "gemm1_clamp_limit" not in experts
    marlin = calls_with(ast.parse(sglang_file(
        "srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py").read_text()),
        "CompressedTensorsWNA16MoE", "apply_weights")
    (call,) = [c for c in marlin if "clamp_limit" in c]
    assert call["clamp_limit"] == "self.moe_runner_config.swiglu_limit"
    tree = ast.parse(sglang_file("srt/layers/moe/moe_runner/triton_utils/fused_moe.py").read_text())
    seq = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_fused_moe_kernel_sequence")
    asserts = [ast.unparse(a.test) for a in ast.walk(seq) if isinstance(a, ast.Assert)]
    assert "swiglu_limit == 10" in asserts
    branch = next(n for n in ast.walk(seq) if isinstance(n, ast.If) and ast.unparse(n.test) == "filter_expert"
                  and n.orelse)
    assert [ast.unparse(a.test) for a in branch.orelse if isinstance(a, ast.Assert)] == ["_is_cuda or _is_xpu"]
    limit_branch = next(n for n in ast.walk(seq) if isinstance(n, ast.If) and ast.unparse(n.test) ==
                        "gemm1_limit is not None")
    assert "_swiglu_silu_clamp_mul" in ast.unparse(limit_branch.body[0])
