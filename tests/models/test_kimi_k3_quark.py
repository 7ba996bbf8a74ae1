"""Kimi K3 as an AMD Quark MXFP4 export (amd-quark 0.13's file-to-file export, ``kimi_k3`` template,
config made by amd-quark itself): the template leaves attention, shared experts and dense MLPs MXFP4
besides the routed experts. The ``kimi-k3-quark`` profile makes the routed experts the same int4 as
the compressed-tensors build's, writes every other MXFP4 linear as exact bf16, keeps SiTU, and
verify, the vLLM plugin's serving model and the inventory hold as for the compressed-tensors build.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from glm5_fixture import EXPORT  # amd-quark's file2file export block (file2file_quantization.py 2289-2295)

from converter.run.options import Options
from converter.run.pipeline import convert
from tests.conftest import (
    all_tensors,
    ct_mxfp4_values,
    load_shard,
    mxfp4_unless_excluded,
    read_json,
    shard_names,
    sync_index,
    tensor_bytes,
    write_json,
)


def write_quark_k3(ct_src: str, dst: str) -> list[str]:
    """The K3 fixture as amd-quark's file-to-file export with the kimi_k3 template writes it: MXFP4
    as X.weight + X.weight_scale, every Linear the template does not exclude quantized, one top-level
    quantization_config (nested ones removed), shards saved with no metadata. Returns the non-expert
    modules made MXFP4."""
    from safetensors.torch import save_file
    template = pytest.importorskip("quark.torch.quantization.config.template")
    cfg = template.LLMTemplate.get("kimi_k3").get_config(scheme="mxfp4_weight_only")
    shutil.copytree(ct_src, dst)
    linears = []
    for shard in shard_names(dst):
        tensors, _ = load_shard(os.path.join(dst, shard))
        tensors = {n.replace(".weight_packed", ".weight"): t for n, t in tensors.items()}  # Quark's names
        linears += mxfp4_unless_excluded(tensors, cfg.exclude)
        save_file(tensors, os.path.join(dst, shard))
    sync_index(dst)
    config = read_json(os.path.join(dst, "config.json"))
    config["text_config"].pop("quantization_config")
    block = cfg.to_dict()
    block.update(export=dict(EXPORT), exclude=sorted(cfg.exclude))
    config["quantization_config"] = json.loads(json.dumps(block))
    write_json(os.path.join(dst, "config.json"), config)
    return sorted(linears)


@pytest.fixture(scope="module")
def quark_k3(converted, tmp_path_factory):
    root = tmp_path_factory.mktemp("k3quark")
    src, dst = str(root / "src"), str(root / "dst")
    linears = write_quark_k3(converted.src, src)
    convert(src, dst, Options())
    return src, dst, linears


def test_the_templates_layout(quark_k3):
    src, _, linears = quark_k3
    kinds = {m.split(".")[-2] if "shared_experts" not in m else "shared_experts" for m in linears}
    assert {"self_attn", "mlp", "shared_experts"} <= kinds, kinds   # what the template leaves MXFP4 beside experts
    assert not any("routed_expert_" in m or "block_sparse_moe.gate" in m for m in linears)
    block = read_json(os.path.join(src, "config.json"))["quantization_config"]
    assert block["quant_method"] == "quark" and block["export"] == EXPORT


def test_experts_are_the_ct_builds_int4_the_rest_exact_bf16(quark_k3, converted):
    src, dst, linears = quark_k3
    manifest = read_json(os.path.join(dst, "k3convert_manifest.json"))
    assert manifest["source"]["profile"]["name"] == "kimi-k3-quark" and manifest["source"]["dequantized"] == linears
    ours, before, ct = all_tensors(dst), all_tensors(src), all_tensors(converted.dst)
    experts = [n for n in ct if ".experts." in n]
    assert experts and all(tensor_bytes(ours[n][1]) == tensor_bytes(ct[n][1]) for n in experts)
    for m in linears:
        assert ours[f"{m}.weight"][1].dtype == torch.bfloat16, m
        assert torch.equal(ours[f"{m}.weight"][1].double(),
                           ct_mxfp4_values(before[f"{m}.weight"][1], before[f"{m}.weight_scale"][1])), m
    from safetensors import safe_open
    with safe_open(os.path.join(dst, shard_names(dst)[0]), "pt") as f:
        assert f.metadata()["hidden_act"] == read_json(os.path.join(dst, "config.json"))["text_config"]["hidden_act"]


def test_verify_passes_and_servers_see_what_they_see_in_the_ct_build(quark_k3, converted):
    """verify --source checks every bf16 value; each server's serving model says of this output
    exactly what it says of the compressed-tensors build's (its experts, SiTU, sizes)."""
    import serving_rules as serving

    from converter.verify import verify
    src, dst, _ = quark_k3
    result = verify(dst, src, sample=None)
    assert result.ok, [p for c in result.checks for p in c.problems]
    for server in ("vllm-rocm-plugin", "vllm-rocm", "vllm-cuda"):
        ours = [(r.rule, r.ok, r.message) for r in serving.rules(dst, server, 1)]
        assert ours == [(r.rule, r.ok, r.message) for r in serving.rules(converted.dst, server, 1)], server
