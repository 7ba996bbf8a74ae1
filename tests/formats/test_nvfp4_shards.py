"""NVFP4 exports cut into shards the way their writers cut them (issue 42 §1, docs/nvfp4.md).

transformers' ``save_pretrained`` (which llm-compressor's exports go through) cuts shards with
huggingface_hub's ``split_torch_state_dict_into_shards`` over the state dict in name order, so a module's
``weight_global_scale`` comes before its ``weight_packed`` and a cut between them leaves the 4-byte global
scale alone at the end of the previous shard. Such a module must be found and converted: the output is
tensor for tensor the conversion of the same model in one file. Two sources: the same sharding function on
the compressed-tensors-built state dict of tests/models/test_nvfp4_convert.py, and llm-compressor's own
``oneshot`` + ``save_pretrained`` run in its environment (``$K3CONVERT_LLMC_PYTHON``).
"""
from __future__ import annotations

import os
import subprocess

import pytest
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from converter.state.records import read_rows
from converter.verify import verify
from tests import support
from tests.conftest import INDEX, TABLE, all_tensors, read_json, run_cli, tensor_bytes, write_json
from tests.models.test_nvfp4_convert import EXPERTS_OF, _config, _ct_quant, _tensors

LLMC_PYTHON = os.environ.get("K3CONVERT_LLMC_PYTHON")
REQUIRE = os.environ.get("K3CONVERT_REQUIRE_VLLM") == "1"   # CI: the llm-compressor environment must be there


def save_like_save_pretrained(root: str, state_dict: dict, config: dict, max_shard_size: int) -> str:
    """What ``save_pretrained`` does with a state dict: split by huggingface_hub's function in the dict's
    order, one safetensors file per shard, the index of ``tensor_to_filename``."""
    os.makedirs(root)
    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    for name, names in split.filename_to_tensors.items():
        save_file({n: state_dict[n].contiguous() for n in names}, os.path.join(root, name), metadata={"format": "pt"})
    if split.is_sharded:
        write_json(os.path.join(root, INDEX), {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
    write_json(os.path.join(root, "config.json"), config)
    return root


def lone_global_scales(src: str) -> list[str]:
    """Modules whose weight_global_scale sits in another shard than both of its other tensors."""
    wm = read_json(os.path.join(src, INDEX))["weight_map"]
    return [n[: -len(".weight_packed")] for n, s in wm.items() if n.endswith(".weight_packed")
            and wm[n.replace("weight_packed", "weight_global_scale")] not in (s, wm[n.replace("packed", "scale")])]


def assert_same_conversion(one: str, sharded: str, tmp_path) -> None:
    """Both convert (exit 0); every output tensor byte-identical, the config and the figures equal; the
    sharded one verifies against its source; inspect counts the split modules."""
    out = {}
    for name, src in (("one", one), ("sharded", sharded)):
        out[name] = str(tmp_path / f"dst-{name}")
        r = run_cli("mxfp4-to-int4", src, "-o", out[name], "--progress", "none")
        assert r.exit_code == 0, (name, r.output, r.exception)
    a, b = all_tensors(out["one"]), all_tensors(out["sharded"])
    assert set(a) == set(b)
    for n in a:
        assert a[n][1].dtype == b[n][1].dtype and tensor_bytes(a[n][1]) == tensor_bytes(b[n][1]), n
    assert not any(n.endswith("global_scale") for n in b)   # consumed, not copied
    assert read_json(os.path.join(out["one"], "config.json")) == read_json(os.path.join(out["sharded"], "config.json"))
    rows = [{k: v for k, v in r.items() if k != "shard"} for d in out.values()
            for r in sorted(read_rows(os.path.join(d, TABLE)), key=lambda r: r["name"])]
    assert rows[: len(rows) // 2] == rows[len(rows) // 2:]
    res = verify(out["sharded"], sharded, sample=None)
    assert res.ok, [(c.name, c.problems) for c in res.checks if not c.ok]
    r = run_cli("inspect", sharded)
    assert r.exit_code == 0 and "k3convert converts this" in r.output and "preflight fails" not in r.output, r.output
    assert f"{len(lone_global_scales(sharded))} module(s) with tensors in more than one shard" in r.output


def test_global_scales_cut_into_the_previous_shard_convert_as_unsharded(tmp_path):
    """The compressed-tensors-built state dict in name order, split by huggingface_hub's own function at
    ~12 kB (before: "its weight_global_scale sits in a third shard ... not read", once per such module)."""
    sd = dict(sorted(_tensors().items()))
    config = _config(_ct_quant(False))
    one = save_like_save_pretrained(str(tmp_path / "one"), sd, config, 1 << 30)
    sharded = save_like_save_pretrained(str(tmp_path / "sharded"), sd, config, 12_000)
    lone = lone_global_scales(sharded)
    assert len(lone) >= 3 and set(lone) <= set(EXPERTS_OF), lone   # the layout this test is about
    assert_same_conversion(one, sharded, tmp_path)


def test_llm_compressors_own_sharded_export_converts_as_its_unsharded_one(tmp_path):
    """llm-compressor 0.14's ``oneshot`` NVFP4A16 and ``save_pretrained(max_shard_size="20KB")``, run in its
    environment: its global scales land in the previous shard, and the conversion equals the one-file one."""
    if not LLMC_PYTHON or not os.access(LLMC_PYTHON, os.X_OK):
        reason = f"$K3CONVERT_LLMC_PYTHON is {LLMC_PYTHON!r}: no llm-compressor environment (.ci/run makes one)"
        pytest.fail(reason) if REQUIRE else pytest.skip(reason)
    root = tmp_path / "llmc"
    r = subprocess.run([LLMC_PYTHON, os.path.join(str(support.SUPPORT), "llmc_nvfp4_export.py"), str(root), "20KB"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    sharded = str(root / "sharded")
    assert len(lone_global_scales(sharded)) >= 2, read_json(os.path.join(sharded, INDEX))["weight_map"]
    assert_same_conversion(str(root / "one"), sharded, tmp_path)


def test_from_the_hub_a_previous_shards_global_scale_and_hf_quant_config_are_read(tmp_path):
    """Straight from a (local, loopback) Hub with one shard ahead: a shard whose global scales sit in the
    previous shard waits for it as for any partner, and a ModelOpt <= 0.27 repository's hf_quant_config.json
    (a side file of the view) is its statement; each output equals the local conversion of the same files."""
    from hub_runs import cli
    from hub_server import HubServer

    from tests.formats.test_nvfp4 import to_modelopt
    from tests.models.test_nvfp4_convert import MODELOPT_CONFIG

    sd = dict(sorted(_tensors().items()))
    config = _config(_ct_quant(False))
    repos = {"org/ct": save_like_save_pretrained(str(tmp_path / "ct"), sd, config, 12_000)}
    modelopt = save_like_save_pretrained(str(tmp_path / "mo"), dict(sorted(to_modelopt(sd).items())),
                                         {k: v for k, v in config.items() if k != "quantization_config"}, 12_000)
    write_json(os.path.join(modelopt, "hf_quant_config.json"),
               {"producer": {"name": "modelopt", "version": "0.27.1"},
                "quantization": {k: v for k, v in MODELOPT_CONFIG.items() if k != "quant_method"}})
    repos["org/modelopt"] = modelopt
    assert lone_global_scales(repos["org/ct"])
    with HubServer(lifetime=600) as hub:
        for repo, src in repos.items():
            hub.add(repo, src)
            local, remote = str(tmp_path / f"{repo}-local"), str(tmp_path / f"{repo}-hub")
            r = run_cli("mxfp4-to-int4", src, "-o", local, "--drop-activation-quant", "--progress", "none")
            assert r.exit_code == 0, (repo, r.output, r.exception)
            r = cli(["mxfp4-to-int4", repo, "-o", remote, "--ahead", "1", "--drop-activation-quant"], hub,
                    str(tmp_path / "cache"))
            assert r.returncode == 0, (repo, r.stderr)
            a, b = all_tensors(local), all_tensors(remote)
            assert set(a) == set(b) and all(tensor_bytes(a[n][1]) == tensor_bytes(b[n][1]) for n in a), repo
            assert read_json(os.path.join(local, "config.json")) == read_json(os.path.join(remote, "config.json"))
            assert not os.path.exists(os.path.join(remote, "hf_quant_config.json"))
