"""GLM-5.3-Flash as an AMD Quark MXFP4 export (amd-quark 0.13's glm5_next template, file-to-file
layout: tests/glm5_fixture.py): the ``glm-5-quark`` profile reads it, the routed experts become int4
selected under vLLM's lookup names, everything else is byte-identical, silu and ``swiglu_limit`` are
stated in every shard, ``verify`` and vLLM's serving model pass. The template as amd-quark ships it
leaves the shared experts MXFP4: that export is refused by name, not half-converted.
"""
from __future__ import annotations

import os
import re

import pytest

import glm5_fixture as glm
from conftest import (
    all_tensors, assert_verified_and_on_triton, converted_model, ct_int4_values, ct_mxfp4_values,
    read_json, tensor_bytes)
from converter.errors import BadInput
from converter.formats.dialect import _matches
from converter.pipeline import Options, convert


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    return converted_model(tmp_path_factory, "glm5", glm.write)


def test_the_writers_layout(done):
    """What the fixture must look like to stand for amd-quark's output (file2file_quantization.py)."""
    from safetensors import safe_open
    src, _ = done
    block = read_json(os.path.join(src, "config.json"))["quantization_config"]
    assert block["quant_method"] == "quark" and block["version"] == "0.13" and block["export"] == glm.EXPORT
    assert block["exclude"] == sorted(block["exclude"]) and "model.language_model.layers.45.*" in block["exclude"]
    with safe_open(os.path.join(src, "model-00001-of-00002.safetensors"), "pt") as f:
        assert f.metadata() is None


def test_experts_int4_everything_else_identical(done):
    src, dst = done
    manifest = read_json(os.path.join(dst, "k3convert_manifest.json"))
    assert manifest["source"]["profile"]["name"] == "glm-5-quark"
    before, after = all_tensors(src), all_tensors(dst)
    experts = sorted(n[: -len(".weight_scale")] for n in before if n.endswith(".weight_scale"))
    assert len(experts) == 2 * 4 * 3 and all(".mlp.experts." in m for m in experts)
    for m in experts:
        want = ct_mxfp4_values(before[f"{m}.weight"][1], before[f"{m}.weight_scale"][1])
        assert (ct_int4_values(after, m) - want).norm() / want.norm() < 0.12, m
    others = {n for n in before if not n.startswith(tuple(experts))}
    assert {n for n in after if not n.startswith(tuple(experts))} == others
    for n in others:
        assert before[n][1].dtype == after[n][1].dtype and tensor_bytes(before[n][1]) == tensor_bytes(after[n][1]), n


def test_config_and_activation(done):
    _, dst = done
    cfg = read_json(os.path.join(dst, "config.json"))
    (group,) = cfg["quantization_config"]["config_groups"].values()
    layer = "model.language_model.layers.1.mlp.experts"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert any(_matches(f"{layer}.0.{proj}", t) for t in group["targets"])
    for other in ("model.language_model.layers.1.mlp.shared_experts.gate_proj", "model.language_model.layers.0.mlp.gate_proj",
                  "model.language_model.layers.1.mlp.gate", "lm_head"):
        assert not any(_matches(other, t) for t in group["targets"]), other
    from safetensors import safe_open
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with safe_open(os.path.join(dst, shard), "pt") as f:
            meta = f.metadata()
        assert (meta["hidden_act"], meta["swiglu_limit"]) == ("silu", "10.0"), shard


def test_verify_and_serving(done):
    assert_verified_and_on_triton(*done)


def test_the_templates_mxfp4_shared_experts_are_refused_by_name(tmp_path):
    src = str(tmp_path / "src")
    glm.write(src, shared_experts_mxfp4=True)
    with pytest.raises(BadInput, match=r"mlp\.shared_experts\.\w+_proj\.weight: MXFP4, but profile 'glm-5-quark' "
                                       r"converts routed experts only"):
        convert(src, str(tmp_path / "dst"), Options())


def test_an_incomplete_download_is_caught_by_the_inventory(tmp_path):
    """mlp_layer_types "sparse" x n_routed_experts x gate/up/down: a config that asks for a fifth expert
    the shards lack is refused, the missing module named."""
    from conftest import write_json
    src = str(tmp_path / "src")
    glm.write(src)
    cfg = read_json(os.path.join(src, "config.json"))
    cfg["text_config"]["n_routed_experts"] = 5
    write_json(os.path.join(src, "config.json"), cfg)
    gone = "model.language_model.layers.1.mlp.experts.4.gate_proj"
    with pytest.raises(BadInput, match=rf"expected 30 expert matrices, found 24: missing {re.escape(gone)}"):
        convert(src, str(tmp_path / "dst"), Options())


def test_vllms_load_time_refusals_for_glm5(done):
    """verify --serving's loader table (converter/loaders.py): GLM-5.3's model asserts TP divides the
    heads (glm5next/common/model.py 765-768) and refuses any activation but silu (202-205, 243-247)."""
    from converter import loaders
    from converter.topology import Topology
    cfg = read_json(os.path.join(done[1], "config.json"))
    assert loaders.refusals(cfg, Topology(2)) == []
    assert any("765-768" in where for _, where in loaders.refusals(cfg, Topology(4)))
    cfg["text_config"]["hidden_act"] = "gelu"
    assert any("243-247" in where for _, where in loaders.refusals(cfg, Topology(1)))
