"""The plugin inside vLLM 0.34.0's and 0.33.0's own code (the released wheels), from converted K3-shaped
checkpoints.

Runs tests/support/vllm_scripts/k3_vllm_release.py in K3CONVERT_VLLM034_PYTHON / K3CONVERT_VLLM033_PYTHON: venvs
holding the released ``vllm==0.34.0`` / ``vllm==0.33.0`` wheel (the CUDA build, installed ``--no-deps``
over torch 2.13.0's CPU build, .ci/run ``vllm_wheel_env``) with this repo installed. On a simulated ROCm
MI300X (amdsmi answers gfx942, so vLLM picks its own RocmPlatform) with aiter simulated
(tests/support/aiter_sim.py), this runs of the release's code:
``EngineArgs.create_engine_config`` (the plugin claims the checkpoint), ``ModelRegistry`` (K3 and K3.1
resolve to ``models/kimi_k3/amd``), the whole K3 model built on the CPU at TP 1 and as ranks of TP 8
and of TP 8 + EP 8, ``load_weights`` over every shard's MoE-block tensors (routed experts through
``RoutedExperts.weight_loader``), the plugin's ``process_weights_after_loading`` (self-test through
vLLM's ``FusedMoEKernel`` around ``AiterMxfp4Experts``, whose one aiter call is simulated) and one MoE
forward, compared with compressed-tensors' decoding of the checkpoint. (0.33.0 does not know
``kimi_k31``: K3.1 is a 0.34 model, docs/releases.md.)

What cannot run on a CPU, and is therefore not run: vLLM's compiled ops (``vllm._C`` is built against
torch 2.14's CUDA build; the layers' handles on them, e.g. ``situ_and_mul``, raise if called), aiter
itself (a ROCm library: its kernels are simulated, its attention/KDA kernels only named), the
attention and KDA layers' forward, CUDA streams and the GPU memory questions vLLM's ROCm platform asks
(answered for one MI300X), and the collectives of a real 8-rank group (one process plays one rank).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from converter.fixture import FixtureSpec, make_fixture
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import run_cli
from tests.vllm_plugin.test_vllm_plugin import REQUIRE, source

HERE = support.SUPPORT
TOL = 0.02       # the simulated kernel's bf16 stages against the float32 compressed-tensors reference
PARALLEL = {"tp1": (1, 0, 1, 0, 8, 2048), "tp8-rank0": (8, 0, 1, 0, 8, 256), "tp8-rank5": (8, 5, 1, 0, 8, 256),
            # TP 8 + EP 8: vLLM folds TP into EP for the experts (tp 1, ep 8): one expert a rank
            "tp8-ep8-rank0": (1, 0, 8, 0, 1, 2048), "tp8-ep8-rank6": (1, 0, 8, 6, 1, 2048)}
WRONG = ("tp1-wrong-unshuffled", "tp1-wrong-nibbles-swapped", "tp1-wrong-scales-n-first",
         "tp8-ep8-rank6-wrong-unshuffled")


RELEASES = {"0.34.0": "K3CONVERT_VLLM034_PYTHON", "0.33.0": "K3CONVERT_VLLM033_PYTHON"}


def release_python(version: str) -> str:
    env = RELEASES[version]
    py = os.environ.get(env)
    if py and Path(py).is_file():
        return py
    why = f"{env} unset (the vllm {version} wheel's venv: .ci/run vllm_wheel_env)"
    if REQUIRE:
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> list[str]:
    """K3 and K3.1 outputs of the converter. Demo dims: 2048 intermediate (256 a rank at TP 8, which
    KimiMoE builds unpadded), 8 experts (one a rank at EP 8), 2 MoE layers over 2 shards."""
    root = tmp_path_factory.mktemp("converted")
    dsts = []
    for model_type in ("kimi_k3", "kimi_k31"):
        src, dst = root / f"src-{model_type}", root / f"dst-{model_type}"
        make_fixture(str(src), FixtureSpec.demo(layers=3, shards=2, model_type=model_type))
        r = run_cli("mxfp4-to-int4", str(src), "-o", str(dst), "--progress", "none")
        assert r.exit_code == 0, r.output
        dsts.append(str(dst))
    return dsts


@pytest.fixture(scope="module", params=list(RELEASES))
def run(request, converted, tmp_path_factory) -> dict:
    py = release_python(request.param)
    source("K3CONVERT_AITER_SRC", "ops/shuffle.py")
    out = tmp_path_factory.mktemp(f"vllm{request.param}") / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    proc = subprocess.run([py, str(HERE / "vllm_scripts" / "k3_vllm_release.py"), str(out), *converted],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "asked": request.param}


def test_it_is_the_released_vllm_on_a_simulated_rocm_gfx942(run):
    assert run["vllm"] == run["asked"] and "site-packages/vllm/" in run["vllm_file"]
    assert run["torch"].startswith("2.13.0")
    assert run["platform"] == "RocmPlatform" and run["gfx942"]


@pytest.mark.parametrize("model,arch", [("k3", "KimiK3ForConditionalGeneration"),
                                        ("k31", "KimiK31ForConditionalGeneration")])
def test_engine_config_and_registry(run, model, arch):
    """vLLM's ModelConfig hands the checkpoint to the plugin; its registry serves K3 and K3.1 with the
    ROCm (amd/) K3 class. (A release of the plugin that refuses K3.1 on ROCm before load passes too,
    if its one line names the DSA indexer.)"""
    r = run[model]
    if model == "k31" and run["vllm"] == "0.33.0":      # K3.1 is a 0.34 model
        assert "kimi_k31" in r["config_error"], r
        return
    if "config_refused" in r:
        assert model == "k31" and "indexer" in r["config_refused"], r
        return
    assert r["quantization"] == "k3convert-int4-gfx942" and r["quant_config"] == "K3Int4Gfx942Config"
    assert r["registry"] == {"arch": arch, "class": "vllm.models.kimi_k3.amd.model.KimiK3ForConditionalGeneration"}


@pytest.mark.parametrize("case", list(PARALLEL))
def test_kimi_k3_loads_lays_out_and_computes_in_the_release(run, case):
    """The whole model built from the registry class, every shard loaded through vLLM's own
    load_weights / RoutedExperts.weight_loader at this rank, the plugin's layout and self-test, and one
    MoE forward through vLLM's FusedMoEKernel: equal to compressed-tensors' decoding (this rank's share)."""
    tp, tp_rank, ep, ep_rank, local, per_rank = PARALLEL[case]
    r = run["k3"][case]
    assert "error" not in r and "refused" not in r, r
    assert r["model_class"] == "vllm.models.kimi_k3.amd.model.KimiK3ForConditionalGeneration"
    assert r["methods"] == ["K3Int4AiterMoEMethod"]
    assert (r["tp_size"], r["tp_rank"], r["ep_size"], r["ep_rank"]) == (tp, tp_rank, ep, ep_rank)
    assert r["local_experts"] == local and r["per_rank"] == per_rank
    assert r["expert_loads"] == 2 * 8 * 3 * 2     # 2 layers x 8 experts x (w1, w2, w3) x (words, scales)
    assert (r["kernel"], r["experts_class"]) == ("FusedMoEKernel", "AiterMxfp4Experts")
    assert r["selftest_calls"] == 3               # tiles 16, 32, 64 through vLLM's kernel
    call = r["forward_call"]
    assert call["gate_mode"] == "separated" and (call["beta"], call["linear_beta"]) == (4.0, 25.0)
    assert "Situ" in call["activation_method"], call
    assert len(r["local"]) == local
    assert r["tokens_compared"] >= 2 and r["rel_error"] < TOL, r
    assert r["remote_rows_zero"]


@pytest.mark.parametrize("case", WRONG)
def test_a_wrong_layout_in_the_plugins_method_fails_this_test(run, case):
    """The negative control: the plugin's layout step replaced by one that lays the weights out wrongly
    (no (16, 16) preshuffle; nibbles swapped; scales left N-first), self-test off: everything before the
    forward still runs, and the forward is off by far more than TOL, so the test above would fail."""
    r = run["k3"][case]
    assert "error" not in r and "refused" not in r, r
    assert r["expert_loads"] == 96 and r["tokens_compared"] >= 2
    assert r["rel_error"] > 20 * TOL, r


def test_a_wrong_layout_is_refused_by_the_plugins_self_test(run):
    refused = run["k3"]["tp1-wrong-unshuffled-selftest"]["refused"]
    assert refused.startswith("k3convert vLLM plugin: language_model.model.layers.1.block_sparse_moe.experts")
    assert "the kernel self-test failed" in refused and "\n" not in refused


def test_kimi_k31_on_rocm_cannot_load_its_dsa_indexer_in_vllm_0340(run):
    """0.34.0's amd/ K3 class has no DSA indexer: load_weights raises KeyError on the indexer tensors
    (or the plugin refuses K3.1 before load, naming it)."""
    if run["vllm"] != "0.34.0":
        pytest.skip("K3.1 is a 0.34 model (0.33.0: test_engine_config_and_registry)")
    r = run["k31"]
    if "config_refused" in r:
        assert "indexer" in r["config_refused"]
        return
    t = r["tp1"]
    assert t["methods"] == ["K3Int4AiterMoEMethod"]
    assert t["load_error"].startswith("KeyError: ") and ".self_attn.indexer." in t["load_error"], t
