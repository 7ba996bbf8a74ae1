"""The aiter the plugin takes: the pre-#4646 window refused from the module's presence alone, and the
installed aiter read under either distribution name (`amd-aiter`, `aiter`).

ROCm/aiter from #4502 (868ac1f7aa) to just before #4646 (4bbc57db1a) has moe_2stage_a16wmix with
flydsl_a16w4_gemm1(act, situ_beta, situ_linear_beta), so the signature check passes, but its fused_moe
builds packed-int4 stage 1 with aiter.ops.flydsl.kernels.moe_gemm_2stage.compile_moe_gemm1, which takes
no activation and computes SiLU (docs/deploy.md, "The vLLM/aiter pairs"). Here aiter is a package made
in tmp_path with those modules; vLLM is faked in sys.modules as far as vllm_config.machine reads it.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

import converter.vllm_plugin as plugin_pkg
from converter.vllm_plugin import aiter_info, route

# k3(): the (quantization_config, config) of a k3convert K3 int4 output
from tests.vllm_plugin.test_vllm_plugin import k3

GOOD = route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=True, vllm_version="0.33.0",
                     gemm1=lambda *, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0: None)
WINDOW = route.Machine(**{**GOOD.__dict__, "aiter_silu_int4": True})

GEMM1_SITU = ("def flydsl_a16w4_gemm1(*, a_bf16, act='silu', situ_beta=1.0, situ_linear_beta=1.0, "
              "swiglu_limit=float('inf'), w_dtype='fp4', w_layout='standard'):\n    return None\n")


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_the_pre_4646_window_is_refused_whatever_the_selftest_switch(monkeypatch, switch):
    if switch is None:
        monkeypatch.delenv("K3CONVERT_SELFTEST", raising=False)
    else:
        monkeypatch.setenv("K3CONVERT_SELFTEST", switch)
    quant, cfg = k3()
    with pytest.raises(route.Refused) as err:
        route.decide(quant, None, cfg, WINDOW)
    text = str(err.value)
    assert text.startswith(route.PREFIX) and "\n" not in text
    for words in (route.SILU_INT4_MODULE, "#4502", "#4646", "computes SiLU", "v0.1.20 or later"):
        assert words in text


def test_an_aiter_past_4646_is_taken():
    quant, cfg = k3()
    assert route.decide(quant, None, cfg, GOOD) == route.NAME
    assert route.aiter_window_problem(False) is None


def test_an_aiter_before_4502_is_refused_for_its_missing_kernel_module_first():
    """Before #4502 moe_gemm_2stage exists too, but the missing moe_2stage_a16wmix is the truer reason."""
    quant, cfg = k3()
    machine = route.Machine(**{**WINDOW.__dict__, "gemm1": None, "gemm1_error": "ModuleNotFoundError: x"})
    with pytest.raises(route.Refused, match="no packed-int4 a16w4 MoE path"):
        route.decide(quant, None, cfg, machine)


# --- a made-up aiter on sys.path, and a faked vLLM around vllm_config.machine -----------------------

def make_aiter(root: Path, *, window: bool, dist: str | None = "amd-aiter", version: str = "0.1.20") -> None:
    """An `aiter` package with moe_2stage_a16wmix; with ``window``, the pre-#4646 module, which must never
    be imported (importing it raises). ``dist``: the distribution name its dist-info records."""
    kernels = root / "aiter" / "ops" / "flydsl" / "kernels"
    (kernels / "moe_2stage_a16wmix").mkdir(parents=True)
    for pkg in (root / "aiter", root / "aiter" / "ops", root / "aiter" / "ops" / "flydsl", kernels):
        (pkg / "__init__.py").write_text("")
    (kernels / "moe_2stage_a16wmix" / "__init__.py").write_text(GEMM1_SITU)
    if window:
        (kernels / "moe_gemm_2stage.py").write_text("raise RuntimeError('the pre-#4646 module was imported')\n")
    if dist is not None:
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "top_level.txt").write_text("aiter\n")


@pytest.fixture
def on_path(monkeypatch, tmp_path):
    """tmp_path on sys.path; every `aiter` module imported from it is forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name == "aiter" or name.startswith("aiter."):
            del sys.modules[name]
    importlib.invalidate_caches()


def fake_vllm(monkeypatch) -> None:
    """The vLLM names vllm_config imports and machine() reads: ROCm, gfx942, aiter found, AITER MoE on."""
    mods = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.logger", "vllm.platforms", "vllm.platforms.rocm", "vllm._aiter_ops",
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")}
    mods["vllm"].__version__ = "0.33.0"
    mods["vllm"]._aiter_ops = mods["vllm._aiter_ops"]
    mods["vllm.logger"].init_logger = lambda name: types.SimpleNamespace(warning_once=print)
    mods["vllm.platforms"].current_platform = types.SimpleNamespace(is_rocm=lambda: True,
                                                                    get_device_name=lambda: "AMD Instinct MI325X")
    mods["vllm.platforms.rocm"].on_gfx942 = lambda: True
    mods["vllm._aiter_ops"].IS_AITER_FOUND = True
    mods["vllm._aiter_ops"].rocm_aiter_ops = types.SimpleNamespace(is_fused_moe_enabled=lambda: True)
    mods["vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors"].CompressedTensorsConfig = (
        type("CompressedTensorsConfig", (), {}))
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def machine_with_fakes(monkeypatch) -> route.Machine:
    """vllm_config.machine() imported afresh under the faked vLLM; the real module is restored afterwards."""
    name = "converter.vllm_plugin.vllm_config"
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))     # restores (or removes) it afterwards
    monkeypatch.setattr(plugin_pkg, "vllm_config", None, raising=False)
    del sys.modules[name]
    delattr(plugin_pkg, "vllm_config")
    fake_vllm(monkeypatch)
    return importlib.import_module(name).machine()


@pytest.mark.parametrize("window", [True, False])
def test_machine_finds_the_pre_4646_module_without_importing_it(monkeypatch, on_path, window):
    make_aiter(on_path, window=window)
    m = machine_with_fakes(monkeypatch)
    assert m.gemm1 is not None and route.gemm1_problem(m.gemm1) is None    # the signature check passes alike
    assert m.aiter_silu_int4 is window
    assert route.SILU_INT4_MODULE not in sys.modules
    quant, cfg = k3()
    if window:
        with pytest.raises(route.Refused, match="computes SiLU"):
            route.decide(quant, None, cfg, m)
    else:
        assert route.decide(quant, None, cfg, m) == route.NAME


@pytest.mark.parametrize("dist", ["amd-aiter", "aiter", "rocm-aiter"])
def test_the_installed_aiter_is_read_under_any_distribution_name(on_path, dist):
    """`amd-aiter` (ROCm/aiter's setup.py, vLLM's image), `aiter` (other images), or any name whose
    distribution installed the `aiter` package."""
    make_aiter(on_path, window=False, dist=dist, version="0.1.28.post1")
    assert aiter_info.aiter_dist() == aiter_info.Dist(dist, "0.1.28.post1")


def test_no_aiter_distribution_is_none(on_path):
    make_aiter(on_path, window=False, dist=None)
    assert aiter_info.aiter_dist() is None


@pytest.mark.parametrize("window", [True, False])
def test_report_says_what_the_plugin_would_do(on_path, capsys, window):
    make_aiter(on_path, window=window, dist="aiter", version="0.1.20")
    assert aiter_info.main() == (1 if window else 0)
    out = capsys.readouterr().out
    assert "aiter: aiter 0.1.20" in out
    assert f"pre-#4646: {route.SILU_INT4_MODULE} (SiLU for int4) present: {'yes' if window else 'no'}" in out
    assert "situ_beta, situ_linear_beta: yes" in out
    assert ("computes SiLU" in out) is window
    assert route.SILU_INT4_MODULE not in sys.modules


def test_report_names_a_missing_aiter(on_path, capsys):
    if importlib.util.find_spec("aiter") is not None:
        pytest.skip("this Python has an aiter of its own")
    assert aiter_info.main() == 1
    assert "aiter: not importable" in capsys.readouterr().out


def test_a_checkout_without_metadata_is_read_from_its_version_file(on_path):
    """aiter's build writes aiter/_version.py (pyproject.toml write_to); a checkout on the path has no dist-info."""
    make_aiter(on_path, window=False, dist=None)
    (on_path / "aiter" / "_version.py").write_text("__version__ = '0.1.28.post1'\n")
    assert aiter_info.aiter_dist() == aiter_info.Dist("aiter/_version.py", "0.1.28.post1")
    assert "aiter._version" not in sys.modules and "aiter" not in sys.modules    # read, not imported


def test_vllm_version_and_commit_as_its_wheel_records_them(on_path, monkeypatch):
    """vllm/_version.py as the 0.34.0 wheel has it (vcs-versioning): `__commit_id__ = commit_id = 'g...'`."""
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    (on_path / "vllm").mkdir()
    (on_path / "vllm" / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    (on_path / "vllm" / "_version.py").write_text("__version__ = version = '0.34.0'\n"
                                                  "__commit_id__ = commit_id = 'g62d4bc3c7'\n")
    (on_path / "vllm-0.34.0.dist-info").mkdir()
    (on_path / "vllm-0.34.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n")
    assert aiter_info.vllm_dist() == aiter_info.Dist("vllm", "0.34.0 (commit g62d4bc3c7)")


def test_the_deploy_page_lists_the_refusal_and_the_pin():
    text = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    assert route.aiter_window_problem(True).split(":")[0] in text
    assert "python -m converter.vllm_plugin.aiter_info" in text and "m.version('amd-aiter')" not in text
