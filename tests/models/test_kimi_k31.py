"""Kimi K3.1 end to end: vLLM 0.34 builds ``kimi_k31`` on the same K3 classes (docs/models.md), so
the kimi-k3 profile converts it with the same inventory and SiTU checks, and the serving check and
the plugin say what each proven vLLM does with it."""
from __future__ import annotations

import os

import pytest
import serving_rules as serving

from converter.errors import BadInput
from converter.fixture import FixtureSpec, make_fixture
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.state.files import MANIFEST
from tests.conftest import ct_mxfp4_encode, read_json, run_cli, shard_names, sync_index, write_json

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
    """vLLM 0.34 builds K3.1 on the K3 classes, but on ROCm those are the amd/ classes, which have no DSA:
    the indexer weights fail the load, and the plugin's route refuses it before (issue 41 item 4). CUDA's
    nvidia/ classes read dsa_config. vLLM 0.33 builds no kimi_k31 at all."""
    _, dst = k31
    new = {r.rule: r for r in serving.rules(dst, "vllm-rocm-plugin", 1, vllm="0.34")}
    assert [r.rule for r in new.values() if not r.ok] == ["kernel", "loader"], [r.message for r in new.values()]
    for rule in ("kernel", "loader"):
        assert "vLLM 0.34.0's ROCm Kimi classes cannot load Kimi K3.1's DSA indexer, its 8 indexer tensors" \
            in new[rule].message and "KeyError" in new[rule].message, new[rule].message
    assert "k3convert vLLM plugin:" in new["kernel"].message and "amd/linear.py load_weights" in new["loader"].detail
    assert "serve K3.1 with vLLM 0.34.0 on CUDA" in new["loader"].message
    cuda = {r.rule: r for r in serving.rules(dst, "vllm-cuda", 1, vllm="0.34")}
    assert all(r.ok for r in cuda.values()), [r.message for r in cuda.values() if not r.ok]
    old = {r.rule: r for r in serving.rules(dst, "vllm-rocm-plugin", 1, vllm="0.33")}
    assert not old["kernel"].ok and "vLLM 0.33.0 builds no model of model_type 'kimi_k31'" in old["kernel"].message
    assert not old["loader"].ok and "vLLM 0.33.0 builds no model of model_type 'kimi_k31'" in old["loader"].message
    stock = {r.rule: r for r in serving.rules(dst, "vllm-rocm", 1)}
    assert not stock["kernel"].ok and "EMULATION" in stock["kernel"].message
    assert not stock["loader"].ok and "DSA indexer" in stock["loader"].message


def _copy_with(dst, tmp_path, config=None, keep=lambda name: True):
    """A copy of DST with its config changed by ``config`` and only the tensors ``keep`` says."""
    import shutil

    from safetensors.torch import load_file, save_file
    copy = str(tmp_path / "dst")
    shutil.copytree(dst, copy)
    for shard in shard_names(copy):
        path = os.path.join(copy, shard)
        tensors = load_file(path)
        save_file({k: v for k, v in tensors.items() if keep(k)}, path, metadata={"format": "pt"})
    sync_index(copy)
    if config is not None:
        path = os.path.join(copy, "config.json")
        cfg = read_json(path)
        config(cfg)
        write_json(path, cfg)
    return copy


def _pop_dsa(cfg, put=None, where="text_config"):
    cfg["text_config"].pop("dsa_config")
    if where == "text_config":
        cfg["text_config"]["dsa_config"] = put
    elif where == "top":
        cfg["dsa_config"] = put


@pytest.mark.parametrize("server", ["vllm-cuda", "vllm-rocm-plugin"])
@pytest.mark.parametrize("case, change, keep, said", [
    # issue 41 item 4: a dsa_config with no indexer tensors (on CUDA the indexer would stay torch.empty)
    ("no-indexer", None, lambda k: ".indexer." not in k, "tensors (layers.1) are missing"),
    ("one-part-gone", None, lambda k: not k.endswith("layers.2.self_attn.indexer.wk.weight"),
     "lists layer 3 but its self_attn.indexer.{wk} tensors (layers.2) are missing"),
    # issue 40 H7: a falsy or misplaced dsa_config while the indexer tensors are there
    ("empty", lambda c: _pop_dsa(c, {}), None, "text_config.dsa_config has no dsa_layers"),
    ("null", lambda c: _pop_dsa(c, None), None, "8 DSA indexer tensors (e.g. "),
    ("top-level", lambda c: _pop_dsa(c, {"dsa_layers": [2, 3]}, "top"), None, "stated at top level"),
    ("absent", lambda c: _pop_dsa(c, where="gone"), None, "but no text_config.dsa_config"),
    ("extra-layer", lambda c: c["text_config"]["dsa_config"].update(dsa_layers=[3]), None,
     "DSA indexer tensors in layers.1, which text_config.dsa_config.dsa_layers does not list"),
])
def test_dsa_config_and_indexer_tensors_must_agree(k31, tmp_path, server, case, change, keep, said):
    """One rule (formats/kimi_dsa.py) for verify --serving and the plugin's route: a K3.1 whose dsa_config
    and indexer tensors disagree fails on every target, CUDA included, in one line naming the cause."""
    _, dst = k31
    copy = _copy_with(dst, tmp_path, change, keep or (lambda k: True))
    results = {r.rule: r for r in serving.rules(copy, server, 1, vllm="0.34")}
    assert not results["loader"].ok and said in results["loader"].message, (case, results["loader"].message)
    assert "\n" not in results["loader"].message
    r = run_cli("verify", copy, "--no-checksums", "--serving", server)
    assert r.exit_code == 5 and said in r.output, r.output


def test_verify_cli_takes_the_release(k31):
    _, dst = k31
    ok = run_cli("verify", dst, "--no-checksums", "--serving", "vllm-cuda", "--vllm-version", "0.34")
    assert ok.exit_code == 0, ok.output
    rocm = run_cli("verify", dst, "--no-checksums", "--serving", "vllm-rocm-plugin")
    assert rocm.exit_code == 5 and "cannot load Kimi K3.1's DSA indexer" in rocm.output, rocm.output
    old = run_cli("verify", dst, "--no-checksums", "--serving", "vllm-rocm-plugin", "--vllm-version", "0.33.1")
    assert old.exit_code == 5 and "kimi_k31" in old.output, old.output
    bad = run_cli("verify", dst, "--serving", "vllm-rocm", "--vllm-version", "0.35")
    assert bad.exit_code == 2 and "0.33.0, 0.34.0" in bad.output, bad.output


def test_the_plugin_route_refuses_k31_on_rocm_before_load(k31):
    """The plugin's route decision (override_quantization_method) refuses a K3.1 under a release whose ROCm
    classes cannot load its DSA indexer, in one line naming the indexer and the release, from the config
    alone (a Hub id: no tensors yet) or with the tensors (a local folder's index); the same rule as verify."""
    import dataclasses
    import types

    from converter.formats import kimi_dsa
    from converter.formats.checkpoint import weight_map
    from converter.vllm_plugin import route
    _, dst = k31
    cfg = read_json(os.path.join(dst, "config.json"))
    quant = cfg["text_config"]["quantization_config"]
    good = route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=True, vllm_version="0.34.0",
                         gemm1=lambda *, act=None, situ_beta=None, situ_linear_beta=None: None)
    names = list(weight_map(dst))
    for tensors in (None, names):
        with pytest.raises(route.Refused) as e:
            route.decide(quant, None, cfg, good, tensors=tensors)
        line = str(e.value)
        assert "\n" not in line and "vLLM 0.34.0's ROCm Kimi classes cannot load Kimi K3.1's DSA indexer" in line, line
    # the plugin reads the index lazily: only for a K3 int4 checkpoint on ROCm
    reads = []

    def read_names():
        reads.append(1)
        return names
    assert route.decide(quant, None, cfg, route.Machine(is_rocm=False), tensors=read_names) is None
    assert route.decide(None, None, cfg, good, tensors=read_names) is None and reads == []
    with pytest.raises(route.Refused, match="DSA indexer"):
        route.decide(quant, None, cfg, good, tensors=read_names)
    assert reads == [1]
    # vLLM hands the route config objects: text_config and KimiLinearDSAConfig with attributes
    dsa = types.SimpleNamespace(**cfg["text_config"]["dsa_config"])
    obj = types.SimpleNamespace(model_type="kimi_k31", text_config=types.SimpleNamespace(
        **{**cfg["text_config"], "dsa_config": dsa}))
    with pytest.raises(route.Refused, match="DSA indexer"):
        route.decide(quant, None, obj, good)
    # H7 through the route: dsa_config null while the indexer tensors are there
    cfg["text_config"]["dsa_config"] = None
    with pytest.raises(route.Refused, match="8 DSA indexer tensors .* but no text_config.dsa_config"):
        route.decide(quant, None, cfg, good, tensors=names)
    # K3 (no DSA, no indexer) still takes the plugin; a release that loaded DSA on ROCm would too
    k3 = [n for n in names if ".indexer." not in n]
    assert route.decide(quant, None, cfg, good, tensors=k3) == route.NAME
    cfg = read_json(os.path.join(dst, "config.json"))
    rel = route.release_of("0.34.0", "kimi_k31")
    loads = dataclasses.replace(rel, facts=dataclasses.replace(rel.facts, rocm_kimi_dsa=True))
    assert kimi_dsa.problem(cfg, names, loads, rocm=True) is None
    assert kimi_dsa.problem(cfg, names, rel, rocm=True) is not None
