"""GLM-5.3-Flash as an AMD Quark MXFP4 export (amd-quark 0.13's glm5_next template, file-to-file
layout: tests/support/glm5_fixture.py): the ``glm-5-quark`` profile reads it, the routed experts become int4
selected under vLLM's lookup names, everything else is byte-identical, silu and ``swiglu_limit`` are
stated in every shard, ``verify`` and vLLM's serving model pass. The template as amd-quark ships it
leaves the shared experts MXFP4: they are written as exact bf16, as the rest of the model loads.
"""
from __future__ import annotations

import os
import re

import glm5_fixture as glm
import pytest
import torch

from converter.errors import BadInput
from converter.formats.match import match_name
from converter.run.options import Options
from converter.run.pipeline import convert
from tests.conftest import (
    all_tensors,
    assert_verified_and_on_triton,
    converted_model,
    ct_int4_values,
    ct_mxfp4_values,
    read_json,
    tensor_bytes,
)


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
        assert any(match_name(f"{layer}.0.{proj}", t) for t in group["targets"])
    for other in ("model.language_model.layers.1.mlp.shared_experts.gate_proj", "model.language_model.layers.0.mlp.gate_proj",
                  "model.language_model.layers.1.mlp.gate", "lm_head"):
        assert not any(match_name(other, t) for t in group["targets"]), other
    from safetensors import safe_open
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with safe_open(os.path.join(dst, shard), "pt") as f:
            meta = f.metadata()
        assert (meta["hidden_act"], meta["swiglu_limit"]) == ("silu", "10.0"), shard


def test_verify_and_serving(done):
    assert_verified_and_on_triton(*done)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The glm5_next template as amd-quark ships it: the shared experts are MXFP4 too."""
    return converted_model(tmp_path_factory, "glm5-shipped", lambda d: glm.write(d, shared_experts_mxfp4=True))


SHARED = [f"model.language_model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2)
          for p in ("gate_proj", "up_proj", "down_proj")]


def test_the_template_as_shipped_keeps_shared_experts_as_exact_bf16(shipped, done):
    """Its MXFP4 shared experts are written as plain bf16 weights holding exactly the values
    compressed-tensors' unpacker reads from the source bytes; the routed experts are the same int4 as
    from the export that excluded them, and verify --source checks every bf16 value."""
    src, dst = shipped
    before, after, excluded = all_tensors(src), all_tensors(dst), all_tensors(done[1])
    for m in SHARED:
        assert before[f"{m}.weight"][1].dtype == torch.uint8 and f"{m}.weight_packed" not in after
        got = after[f"{m}.weight"][1]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.double(), ct_mxfp4_values(before[f"{m}.weight"][1], before[f"{m}.weight_scale"][1])), m
    experts = [n for n in after if ".mlp.experts." in n]
    assert experts and all(tensor_bytes(after[n][1]) == tensor_bytes(excluded[n][1]) for n in experts)
    assert read_json(os.path.join(dst, "k3convert_manifest.json"))["source"]["dequantized"] == sorted(SHARED)
    (group,) = read_json(os.path.join(dst, "config.json"))["quantization_config"]["config_groups"].values()
    assert not any(match_name(m, t) for m in SHARED for t in group["targets"])
    assert_verified_and_on_triton(src, dst)
    from converter.hub.upload import model_card  # the card says so; the excluding export's says nothing was decoded
    assert "6 other MXFP4 linear(s)" in model_card(dst) and "Everything else is byte-identical" in model_card(done[1])


def test_verify_catches_a_changed_bf16_value_of_a_dequantized_module(shipped, tmp_path):
    import shutil

    from converter.verify import verify
    from tests.conftest import rewrite_shard
    src, dst = shipped
    bad = str(tmp_path / "dst")
    shutil.copytree(dst, bad)
    name = f"{SHARED[0]}.weight"
    shard = os.path.join(bad, all_tensors(bad)[name][0])

    def edit(t):
        t[name] = t[name].clone()
        t[name][3, 5] = t[name][3, 5] * 2 + 1
    rewrite_shard(shard, edit)
    (check,) = [c for c in verify(bad, src).checks if c.name == "passthrough"]
    assert any(p.startswith(f"{name}: 1 value(s) differ from the MXFP4 values") for p in check.problems), check.problems


def test_a_shared_expert_too_large_for_bf16_is_refused_by_name(tmp_path):
    """E8M0 254 with code 6: 6 * 2^127 has no bf16 value; the group is named, nothing looks complete."""
    from tests.conftest import rewrite_shard
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    glm.write(src, shared_experts_mxfp4=True)
    name = SHARED[4]
    shard = os.path.join(src, all_tensors(src)[f"{name}.weight"][0])

    def edit(t):
        t[f"{name}.weight_scale"][2, 1] = 254
        t[f"{name}.weight"][2, 16] = 0x07   # group 1's first code: +6
    rewrite_shard(shard, edit)
    with pytest.raises(BadInput, match=rf"{re.escape(name)}\.weight_scale.*group 1 of row 2: its values exceed bf16's range"):
        convert(src, dst, Options())
    assert not os.path.exists(os.path.join(dst, "k3convert_manifest.json"))


def test_an_incomplete_download_is_caught_by_the_inventory(tmp_path):
    """mlp_layer_types "sparse" x n_routed_experts x gate/up/down: a config that asks for a fifth expert
    the shards lack is refused, the missing module named."""
    from tests.conftest import write_json
    src = str(tmp_path / "src")
    glm.write(src)
    cfg = read_json(os.path.join(src, "config.json"))
    cfg["text_config"]["n_routed_experts"] = 5
    write_json(os.path.join(src, "config.json"), cfg)
    gone = "model.language_model.layers.1.mlp.experts.4.gate_proj"
    with pytest.raises(BadInput, match=rf"expected 30 expert matrices, found 24: missing {re.escape(gone)}"):
        convert(src, str(tmp_path / "dst"), Options())


def test_vllms_load_time_refusals_for_glm5(done):
    """verify --serving's loader table (converter/servers/loaders.py): GLM-5.3's model asserts TP divides the
    heads (glm5next/common/model.py 765-768) and refuses any activation but silu (202-205, 243-247)."""
    from converter.releases.vllm_0_33 import RELEASE
    from converter.servers import loaders
    from converter.servers.topology import Topology
    cfg = read_json(os.path.join(done[1], "config.json"))
    assert loaders.refusals(cfg, Topology(2), RELEASE) == []
    assert any("765-768" in where for _, where in loaders.refusals(cfg, Topology(4), RELEASE))
    cfg["text_config"]["hidden_act"] = "gelu"
    assert any("243-247" in where for _, where in loaders.refusals(cfg, Topology(1), RELEASE))


def test_bf16_pieces_of_any_size_write_the_same_shard(shipped, tmp_path, monkeypatch):
    """A dequantized module is decoded and written in row pieces at their offsets: one row a piece
    gives the same bytes as the whole module in one piece."""
    from converter.quant.cpu_kernel import requantize
    from converter.run import shard
    from converter.run.plan import build_plan

    src, dst = shipped
    sp = next(s for s in build_plan(src).shards if s.dequants)
    digests = []
    for piece in (shard.DEQUANT_PIECE, 2 * max(d.cols for d in sp.dequants)):
        monkeypatch.setattr(shard, "DEQUANT_PIECE", piece)
        out = tmp_path / str(piece)
        out.mkdir()
        digests.append(shard.ShardConverter(requantize, "cpu", 1 << 12).convert(sp, str(out)).digest)
        assert (out / sp.name).read_bytes() == open(os.path.join(dst, sp.name), "rb").read()
    assert digests[0] == digests[1]


def test_every_code_at_every_scale_decodes_to_its_exact_bf16():
    """mxfp4.to_bf16 over the whole domain (16 codes x E8M0 0..254) against compressed-tensors'
    unpacker: every value that bf16 can hold is exact, subnormals included, and the first group
    that cannot (E8M0 253: 4 * 2^126) is the one reported."""
    import numpy as np

    from converter.formats import mxfp4

    codes = np.arange(32) % 16
    row = (codes[0::2] | codes[1::2] << 4).astype(np.uint8)           # one group: every code, twice
    packed = np.tile(row, (255, 1))
    scales = np.arange(255, dtype=np.uint8).reshape(255, 1)
    bits, first = mxfp4.to_bf16(packed, scales)
    got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).double()
    want = ct_mxfp4_values(torch.from_numpy(packed), torch.from_numpy(scales))
    fits = want.abs() <= torch.finfo(torch.bfloat16).max
    assert torch.equal(got[fits], want[fits]) and torch.isinf(got[~fits]).all()
    assert first == 253 and fits[:253].all() and not fits[253].all()
    assert (got[:2] != 0).sum() == 2 * 28 and got[0].abs().min() == 0 and got[0][got[0] != 0].abs().min() == 2.0 ** -128


def test_a_dequantized_modules_scale_in_another_shard(shipped, tmp_path):
    """Writers cut shards by size: a shared expert's scale in the other shard is read from there by
    offset, recorded as a partner shard (resume and job arrays see it), and gives the same bytes."""
    import shutil

    from converter.run.plan import build_plan
    from tests.conftest import load_shard, rewrite_shard, sync_index
    src, dst = shipped
    moved, out = str(tmp_path / "src"), str(tmp_path / "dst")
    shutil.copytree(src, moved)
    name = f"{SHARED[3]}.weight_scale"    # layer 2: shard 2; its scale goes to shard 1
    where = all_tensors(moved)[name][0]
    other = next(s for s in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors") if s != where)
    scale = load_shard(os.path.join(moved, where))[0][name]
    rewrite_shard(os.path.join(moved, where), lambda t: t.pop(name))
    rewrite_shard(os.path.join(moved, other), lambda t: t.update({name: scale}))
    sync_index(moved)
    sp = next(s for s in build_plan(moved).shards if s.name == where)
    assert sp.partners == [other] and build_plan(moved).straddled == 1
    convert(moved, out, Options())
    assert open(os.path.join(out, where), "rb").read() == open(os.path.join(dst, where), "rb").read()
    from converter.verify import verify
    assert verify(out, moved, sample=None).ok


def test_the_cli_says_how_many_modules_it_wrote_as_bf16(shipped, tmp_path):
    from tests.conftest import run_cli
    result = run_cli("mxfp4-to-int4", shipped[0], "-o", tmp_path / "dst", "--progress", "none")
    assert result.exit_code == 0, result.output
    assert "complete: 24 tensors (+6 non-expert MXFP4 module(s) as exact bf16);" in result.stdout
