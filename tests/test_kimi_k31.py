"""Kimi K3.1 end to end: vLLM 0.34 builds ``kimi_k31`` on the same K3 classes (docs/models.md), so
the kimi-k3 profile converts it with the same inventory and SiTU checks, and the serving check and
the plugin say what each proven vLLM does with it."""
from __future__ import annotations

import os

import pytest
import serving_rules as serving
from conftest import ct_mxfp4_encode, read_json, run_cli, shard_names, sync_index, write_json

from converter.errors import BadInput
from converter.fixture import FixtureSpec, make_fixture
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.state.files import MANIFEST

# hidden and per-rank intermediate multiples of 128: sizes the plugin's kernel takes unpadded at TP 1
K31 = FixtureSpec(layers=3, experts=4, hidden=128, inter=256, latent=128, shards=2, vocab=64, seed=31,
                  model_type="kimi_k31")


@pytest.fixture(scope="module")
def k31(tmp_path_factory):
    root = tmp_path_factory.mktemp("k31")
    src, dst = str(root / "src"), str(root / "dst")
    make_fixture(src, K31, encoder=ct_mxfp4_encode)
    convert(src, dst, Options())
    return src, dst


def test_k31_converts_under_the_k3_profile_and_keeps_its_config(k31):
    src, dst = k31
    manifest = read_json(os.path.join(dst, MANIFEST))
    assert manifest["source"]["profile"]["name"] == "kimi-k3", manifest["source"]["profile"]
    cfg = read_json(os.path.join(dst, "config.json"))
    assert cfg["model_type"] == "kimi_k31" and cfg["architectures"] == ["KimiK31ForConditionalGeneration"]
    assert cfg["text_config"]["dsa_config"] == read_json(os.path.join(src, "config.json"))["text_config"]["dsa_config"]
    assert cfg["text_config"]["hidden_act"] == "situ"
    assert cfg["text_config"]["quantization_config"]["format"] == "pack-quantized"


def test_k31_gets_the_expert_inventory(k31, tmp_path):
    """A K3.1 download missing one expert is refused in preflight, as a K3 one is."""
    from safetensors.torch import load_file, save_file

    src = str(tmp_path / "src")
    make_fixture(src, K31, encoder=ct_mxfp4_encode)
    shard = os.path.join(src, shard_names(src)[-1])
    tensors = load_file(shard)
    victim = sorted(k for k in tensors if k.endswith(".w2.weight_packed"))[-1].removesuffix(".weight_packed")
    for suffix in (".weight_packed", ".weight_scale"):
        tensors.pop(victim + suffix, None)
    save_file(tensors, shard, metadata={"format": "pt"})
    sync_index(src)
    with pytest.raises(BadInput, match="missing " + victim.replace(".", r"\.")):
        convert(src, str(tmp_path / "dst"), Options())


def test_k31_gets_the_situ_check(tmp_path):
    """Without its SiTU betas a K3.1 source is refused, not converted by the generic profile."""
    src = str(tmp_path / "src")
    make_fixture(src, K31, encoder=ct_mxfp4_encode)
    path = os.path.join(src, "config.json")
    cfg = read_json(path)
    del cfg["text_config"]["activation_situ_beta"]
    write_json(path, cfg)
    with pytest.raises(BadInput, match="activation_situ_beta"):
        convert(src, str(tmp_path / "dst"), Options())


def test_the_serving_check_tells_the_truth_per_release(k31):
    """vLLM 0.34 builds K3.1 on the K3 classes and the plugin takes its experts, but on ROCm those are
    the amd/ classes, which have no DSA: the indexer weights fail the load. CUDA's nvidia/ classes
    read dsa_config. vLLM 0.33 builds no kimi_k31 at all."""
    _, dst = k31
    new = {r.rule: r for r in serving.rules(dst, "vllm-rocm-plugin", 1, vllm="0.34")}
    assert [r.rule for r in new.values() if not r.ok] == ["loader"], [r.message for r in new.values() if not r.ok]
    assert "AITER a16w4 with Situv2 beta 4.0 linear_beta 25.0" in new["kernel"].message
    assert "vLLM 0.34.0's ROCm Kimi classes have no DSA: its 8 indexer tensors" in new["loader"].message
    assert "KeyError" in new["loader"].message and "amd/linear.py load_weights" in new["loader"].detail
    cuda = {r.rule: r for r in serving.rules(dst, "vllm-cuda", 1, vllm="0.34")}
    assert all(r.ok for r in cuda.values()), [r.message for r in cuda.values() if not r.ok]
    old = {r.rule: r for r in serving.rules(dst, "vllm-rocm-plugin", 1, vllm="0.33")}
    assert not old["kernel"].ok and "vLLM 0.33.0 builds no model of model_type 'kimi_k31'" in old["kernel"].message
    assert not old["loader"].ok and "vLLM 0.33.0 builds no model of model_type 'kimi_k31'" in old["loader"].message
    stock = {r.rule: r for r in serving.rules(dst, "vllm-rocm", 1)}["kernel"]
    assert not stock.ok and "EMULATION" in stock.message


def test_a_k31_without_indexer_weights_loads_on_rocm(k31, tmp_path):
    """The ROCm refusal is for the indexer tensors (what raises), not for dsa_config alone."""
    import shutil

    from safetensors.torch import load_file, save_file
    _, dst = k31
    copy = str(tmp_path / "dst")
    shutil.copytree(dst, copy)
    for shard in shard_names(copy):
        path = os.path.join(copy, shard)
        tensors = load_file(path)
        save_file({k: v for k, v in tensors.items() if ".indexer." not in k}, path, metadata={"format": "pt"})
    sync_index(copy)
    loader = {r.rule: r for r in serving.rules(copy, "vllm-rocm-plugin", 1, vllm="0.34")}["loader"]
    assert loader.ok, loader.message


def test_verify_cli_takes_the_release(k31):
    _, dst = k31
    ok = run_cli("verify", dst, "--no-checksums", "--serving", "vllm-cuda", "--vllm-version", "0.34")
    assert ok.exit_code == 0, ok.output
    rocm = run_cli("verify", dst, "--no-checksums", "--serving", "vllm-rocm-plugin")
    assert rocm.exit_code == 5 and "no DSA" in rocm.output, rocm.output
    old = run_cli("verify", dst, "--no-checksums", "--serving", "vllm-rocm-plugin", "--vllm-version", "0.33.1")
    assert old.exit_code == 5 and "kimi_k31" in old.output, old.output
    bad = run_cli("verify", dst, "--serving", "vllm-rocm", "--vllm-version", "0.35")
    assert bad.exit_code == 2 and "0.33.0, 0.34.0" in bad.output, bad.output
