"""The Triton requantizer must fit AMD CDNA GPUs (gfx90a, gfx942, gfx950) without spilling.

There is no AMD GPU here: Triton's AMD backend cross-compiles the kernel to AMDGCN and an
HSACO on any machine, and the register, spill and scratch numbers are the compiler's own
(scripts/tools/amd_kernel_report.py reads them; run it for the full table). Each compile takes
seconds, so every (arch, config, specialisation) is compiled once per session.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from converter.kernels import triton_requant  # noqa: E402
from converter.kernels.triton_requant import device_arch, launch_config  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[3]


def _load_report() -> ModuleType:
    path = REPO / "scripts" / "tools" / "amd_kernel_report.py"
    spec = importlib.util.spec_from_file_location("amd_kernel_report", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module by name
    spec.loader.exec_module(mod)
    return mod


report = _load_report()
needs_amd = pytest.mark.skipif(
    not report.amd_backend_available(),
    reason="this Triton install has no AMD backend (triton.backends.amd): cannot cross-compile")


@needs_amd
@pytest.mark.parametrize("spec", report.SPECS)
@pytest.mark.parametrize("arch", report.ARCHS)
def test_launch_config_has_no_spills(arch: str, spec: str) -> None:
    s = report.compile_config(arch, launch_config(arch), spec)
    assert s.vgpr_spills == 0, s
    # SGPRs may spill into VGPR lanes (no memory); nothing may go to scratch memory
    assert s.scratch_bytes == 0, s
    assert s.vgprs <= 256 and s.agprs <= 256 and s.waves_per_simd >= 1, s


@needs_amd
def test_spill_detector_sees_old_default_spill() -> None:
    """Today's NVIDIA config spills on gfx942: the detector must say so, or it proves nothing."""
    s = report.compile_config("gfx942", report.OLD_DEFAULT, "launch")
    assert s.vgpr_spills > 0 and s.scratch_bytes > 0, s


def test_launch_config_per_target() -> None:
    nvidia = {"block_groups": 128, "nsplit": 4, "num_warps": 4, "num_stages": 3}
    assert launch_config("sm_90") == nvidia and launch_config("sm_80") == nvidia
    for arch in ("gfx942", "gfx90a", "gfx950", "gfx1100", "interpreter"):
        cfg = launch_config(arch)
        assert set(cfg) == set(nvidia), arch
        assert cfg["nsplit"] in (2, 4) and cfg["block_groups"] in (64, 128, 256), arch
    # an unmeasured gfx gets the config with the fewest registers on the measured ones
    assert launch_config("gfx1100") == {"block_groups": 64, "nsplit": 2, "num_warps": 4, "num_stages": 1}
    launch_config("gfx942")["nsplit"] = 99                      # callers get a copy
    assert launch_config("gfx942")["nsplit"] in (2, 4)
    with pytest.raises(ValueError, match="unknown kernel target"):
        launch_config("cpu")


def test_device_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_arch(torch.device("cpu")) == "interpreter"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        major=9, minor=0, gcnArchName="gfx942:sramecc+:xnack-"))
    monkeypatch.setattr(torch.version, "hip", None)
    assert device_arch("cuda:0") == "sm_90"
    monkeypatch.setattr(torch.version, "hip", "6.3.0")
    assert device_arch("cuda:0") == "gfx942"


class _Recorder:
    """Stands in for the jitted kernel: records the launch keywords instead of running."""

    def __init__(self) -> None:
        self.kwargs: dict = {}

    def __getitem__(self, grid: tuple):
        def launch(*args, **kwargs):
            self.kwargs = kwargs
        return launch


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm_90", "interpreter"])
def test_prepare_takes_defaults_from_launch_config(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    rec = _Recorder()
    monkeypatch.setattr(triton_requant, "_requant_kernel", rec)
    monkeypatch.setattr(triton_requant, "device_arch", lambda device: arch)
    packed, scales = torch.zeros(300, 16, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8)
    triton_requant.prepare(packed, scales)()
    cfg = launch_config(arch)
    got = {"block_groups": rec.kwargs["BG"], "nsplit": rec.kwargs["NSPLIT"],
           "num_warps": rec.kwargs["num_warps"], "num_stages": rec.kwargs["num_stages"]}
    assert got == cfg
    triton_requant.prepare(packed, scales, block_groups=256, nsplit=2, num_warps=8, num_stages=2)()
    assert (rec.kwargs["BG"], rec.kwargs["NSPLIT"], rec.kwargs["num_warps"], rec.kwargs["num_stages"]) == (
        256, 2, 8, 2)


@needs_amd
@pytest.mark.parametrize("arch", report.ARCHS)
def test_server_rule_kernel_compiles_for_amd(arch: str) -> None:
    """The --scale-rule vllm-gfx942 kernel (plain Triton) builds for CDNA without spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from converter.kernels.triton_server_rule import BLOCK, _server_kernel

    pointers = {"bytes_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*u8", "oscale_ptr": "*i16",
                "stats_ptr": "*fp64", "stats_i_ptr": "*i64", "blk_tid_ptr": "*i32", "offsets_ptr": "*i64",
                "nib_ptr": "*u8", "bits_ptr": "*i16", "ok_ptr": "*i8", "err2_ptr": "*fp64",
                "abserr_ptr": "*fp64", "ref2_ptr": "*fp64"}
    src = ASTSource(fn=_server_kernel, signature={**pointers, "G": "i32", "BG": "constexpr"},
                    constexprs={"BG": BLOCK})
    compiled = triton.compile(src, target=GPUTarget("hip", arch, 64), options={"num_warps": 4, "num_stages": 1})
    asm = compiled.asm["amdgcn"]
    nums = report.parse_amdgcn(asm)
    assert nums["instructions"] > 0 and ("buffer_atomic" in asm or "global_atomic" in asm), \
        "no atomics: the statistics were compiled away"
    assert nums["vgpr_spills"] == 0 and nums["scratch_bytes"] == 0, nums


@needs_amd
@pytest.mark.parametrize("divide", [True, False], ids=["divide", "multiply"])
@pytest.mark.parametrize("arch", report.ARCHS)
def test_nvfp4_search_kernel_compiles_for_amd(arch: str, divide: bool) -> None:
    """The NVFP4 scale search (kernels/triton_nvfp4.py, plain Triton) builds for CDNA at its launch
    configuration without spills or scratch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from converter.kernels.triton_nvfp4 import BG, NUM_WARPS, SLOTS, _search_kernel

    sig = {"packed_ptr": "*u8", "sbytes_ptr": "*u8", "g_ptr": "*fp64", "scale_ptr": "*fp64", "words_ptr": "*i32",
           "err_ptr": "*fp64", "ref_ptr": "*fp64", "amax_ptr": "*fp64", "srv_ptr": "*fp64", "G": "i32",
           "DIVIDE": "constexpr", "BG": "constexpr", "SLOTS": "constexpr"}
    src = ASTSource(fn=_search_kernel, signature=sig, constexprs={"DIVIDE": divide, "BG": BG, "SLOTS": SLOTS})
    compiled = triton.compile(src, target=GPUTarget("hip", arch, 64),
                              options={"num_warps": NUM_WARPS, "num_stages": 1, "enable_fp_fusion": False})
    nums = report.parse_amdgcn(compiled.asm["amdgcn"])
    assert nums["instructions"] > 0 and nums["vgpr_spills"] == 0 and nums["scratch_bytes"] == 0, nums
