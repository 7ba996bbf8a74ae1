"""Cross-compile the Triton requant kernel for AMD GPUs; report registers, spills, LDS, occupancy.

No AMD GPU and no ROCm are needed: Triton's AMD backend emits AMDGCN and links an HSACO on
any machine. The numbers come from the compiler's own output: the ``; NumVgprs``,
``; NumAgprs``, ``; TotalNumSgprs``, ``; ScratchSize``, ``; Occupancy`` lines that LLVM
prints after the kernel, and the HSA metadata's ``.vgpr_spill_count``/``.sgpr_spill_count``.
Triton's shared memory is dynamic LDS (``.group_segment_fixed_size`` is 0), so the LDS
bytes are Triton's ``metadata.shared``; the compiler's Occupancy ignores it, and the waves
per SIMD shown are min(Occupancy, LDS bound) with
LDS bound = floor(LDS per CU / LDS per workgroup) * num_warps / 4 SIMDs.

Two argument specialisations are compiled (spills depend on them):
* ``launch``: what an AMD launch from ``prepare()`` gives: every pointer 16-byte aligned
  (``tt.divisibility``) and in a tensor under 2 GiB (``tt.pointer_range`` 32: buffer ops;
  the pipeline's 2**21-group batches are 32 MiB);
* ``bare``: no hints at all (the worst case, e.g. a tensor over 2 GiB).

    python scripts/tools/amd_kernel_report.py            # launch_config(arch) and the old default
    python scripts/tools/amd_kernel_report.py --sweep    # every candidate config (slow: ~70 compiles)
"""
from __future__ import annotations

import argparse
import functools
import itertools
import re
import sys
from dataclasses import dataclass

ARCHS = ("gfx942", "gfx90a", "gfx950")
LDS_PER_CU = {"gfx90a": 65536, "gfx942": 65536, "gfx950": 163840}
SIMDS_PER_CU = 4
OLD_DEFAULT = {"block_groups": 128, "nsplit": 4, "num_warps": 4, "num_stages": 3}
SPECS = ("launch", "bare")

_POINTERS = {
    "words_ptr": "*i32", "bytes_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*u8",
    "oscale_ptr": "*i16", "stats_ptr": "*fp64", "stats_i_ptr": "*i64", "blk_tid_ptr": "*i32",
    "offsets_ptr": "*i64", "b1_ptr": "*fp16", "b2_ptr": "*fp16", "cand1_ptr": "*i32",
    "cand2_ptr": "*i32", "bl_ptr": "*fp16", "lowcand_ptr": "*i32", "lowmask_ptr": "*i32",
    "bits_ptr": "*i32", "bmap_ptr": "*u8", "abserr_ptr": "*fp32", "l2x4_ptr": "*i32",
}
_SCALARS = {"G": "i32", "nblk": "i32", "chunk": "i32"}
_INSTR = re.compile(r"\s+(?:[sv]_|buffer_|global_|ds_|flat_|scratch_)")


@dataclass(frozen=True)
class AmdKernelStats:
    """What one cross-compilation used; ``loop_instr`` counts the block loop's instructions."""

    arch: str
    spec: str
    block_groups: int
    nsplit: int
    num_warps: int
    num_stages: int
    vgprs: int
    agprs: int
    sgprs: int
    vgpr_spills: int
    sgpr_spills: int
    scratch_bytes: int
    lds_bytes: int
    compiler_occupancy: int
    waves_per_simd: int
    instructions: int
    loop_instr: int

    @property
    def loop_instr_per_group(self) -> float:
        """Static wave-instructions of the block loop (all paths) per group."""
        return self.loop_instr * self.num_warps / self.block_groups


def amd_backend_available() -> bool:
    """Whether this Triton install carries the AMD (HIP) backend."""
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "amd" in backends


def _field(text: str, pattern: str, what: str) -> int:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"AMDGCN output has no {what} ({pattern!r}): Triton/LLVM format changed")
    return int(m.group(1))


def _loop_instructions(amdgcn: str) -> int:
    """Instructions in basic blocks LLVM marks as inside a loop (the persistent block loop)."""
    count, in_loop = 0, False
    for line in amdgcn.splitlines():
        if re.match(r"(?:\.LBB\d+_\d+:|; %bb\.\d+:)", line):
            in_loop = "Loop Header" in line or "in Loop:" in line
        elif in_loop and _INSTR.match(line):
            count += 1
    return count


def parse_amdgcn(amdgcn: str) -> dict[str, int]:
    """Register, spill, scratch and occupancy numbers from the compiler's AMDGCN text."""
    return {
        "vgprs": _field(amdgcn, r"; NumVgprs: (\d+)", "NumVgprs"),
        "agprs": _field(amdgcn, r"; NumAgprs: (\d+)", "NumAgprs"),
        "sgprs": _field(amdgcn, r"; TotalNumSgprs: (\d+)", "TotalNumSgprs"),
        "vgpr_spills": _field(amdgcn, r"\.vgpr_spill_count:\s+(\d+)", ".vgpr_spill_count"),
        "sgpr_spills": _field(amdgcn, r"\.sgpr_spill_count:\s+(\d+)", ".sgpr_spill_count"),
        "scratch_bytes": max(_field(amdgcn, r"; ScratchSize: (\d+)", "ScratchSize"),
                             _field(amdgcn, r"\.private_segment_fixed_size:\s+(\d+)",
                                    ".private_segment_fixed_size")),
        "static_lds": _field(amdgcn, r"\.group_segment_fixed_size:\s+(\d+)", ".group_segment_fixed_size"),
        "compiler_occupancy": _field(amdgcn, r"; Occupancy: (\d+)", "Occupancy"),
        "instructions": sum(1 for line in amdgcn.splitlines() if _INSTR.match(line)),
        "loop_instr": _loop_instructions(amdgcn),
    }


def waves_per_simd(arch: str, occupancy: int, lds_bytes: int, num_warps: int) -> int:
    """The compiler's register-bound Occupancy, capped by the dynamic LDS per workgroup."""
    if lds_bytes == 0:
        return occupancy
    lds_cap = (LDS_PER_CU.get(arch, 65536) // lds_bytes) * num_warps // SIMDS_PER_CU
    return min(occupancy, lds_cap)


@functools.cache
def compile_for(arch: str, block_groups: int, nsplit: int, num_warps: int, num_stages: int,
                spec: str = "launch") -> AmdKernelStats:
    """Cross-compile ``_requant_kernel`` (STATS on) for ``arch`` and read its resource use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from converter.kernels.triton_requant import _requant_kernel as kernel

    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, not {spec!r}")
    hints = [["tt.divisibility", 16], ["tt.pointer_range", 32]] if spec == "launch" else []
    signature = {**_POINTERS, **_SCALARS,
                 "BG": "constexpr", "STATS": "constexpr", "FORCE_EXACT": "constexpr", "NSPLIT": "constexpr"}
    attrs = {(kernel.arg_names.index(n),): hints for n in _POINTERS} if hints else {}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs, constexprs={
        "BG": block_groups, "STATS": True, "FORCE_EXACT": False, "NSPLIT": nsplit})
    compiled = triton.compile(src, target=GPUTarget("hip", arch, 64),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    nums = parse_amdgcn(compiled.asm["amdgcn"])
    lds = int(compiled.metadata.shared) + nums.pop("static_lds")
    return AmdKernelStats(
        arch=arch, spec=spec, block_groups=block_groups, nsplit=nsplit, num_warps=num_warps,
        num_stages=num_stages, lds_bytes=lds,
        waves_per_simd=waves_per_simd(arch, nums["compiler_occupancy"], lds, num_warps), **nums)


def compile_config(arch: str, config: dict, spec: str = "launch") -> AmdKernelStats:
    """:func:`compile_for` with a ``launch_config``-style dict."""
    return compile_for(arch, config["block_groups"], config["nsplit"], config["num_warps"],
                       config["num_stages"], spec)


_COLUMNS = ("config", "spec", "VGPR", "AGPR", "SGPR", "VGPR spills", "SGPR spills", "LDS B",
            "scratch B", "waves/SIMD", "instr", "loop instr/group")


def _row(label: str, s: AmdKernelStats) -> list[str]:
    cfg = f"{label} bg{s.block_groups}/ns{s.nsplit}/w{s.num_warps}/st{s.num_stages}"
    return [cfg, s.spec, str(s.vgprs), str(s.agprs), str(s.sgprs), str(s.vgpr_spills),
            str(s.sgpr_spills), str(s.lds_bytes), str(s.scratch_bytes), str(s.waves_per_simd),
            str(s.instructions), f"{s.loop_instr_per_group:.0f}"]


def _print_table(arch: str, rows: list[list[str]]) -> None:
    print(f"\n### {arch}\n")
    print("| " + " | ".join(_COLUMNS) + " |")
    print("|" + " --- |" * len(_COLUMNS))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", action="append", help=f"default: {', '.join(ARCHS)}")
    parser.add_argument("--sweep", action="store_true",
                        help="also every block 64/128 x nsplit 2/4 x warps 4/8 x stages 1/2/3")
    args = parser.parse_args(argv)
    if not amd_backend_available():
        print("amd_kernel_report.py: this Triton has no AMD backend", file=sys.stderr)
        return 1
    from converter.kernels.triton_requant import launch_config

    for arch in args.arch or ARCHS:
        chosen = launch_config(arch)
        configs = [("chosen", chosen), ("old", OLD_DEFAULT)]
        if args.sweep:
            configs += [("", dict(zip(OLD_DEFAULT, c)))
                        for c in itertools.product((64, 128), (2, 4), (4, 8), (1, 2, 3))]
        rows, seen = [], set()
        for label, cfg in configs:
            for spec in SPECS:
                key = (tuple(cfg[k] for k in OLD_DEFAULT), spec)
                if key not in seen:
                    seen.add(key)
                    rows.append(_row(label, compile_config(arch, cfg, spec)))
        _print_table(arch, rows)
    print("\nwaves/SIMD = min(compiler '; Occupancy', floor(LDS per CU / LDS B) * warps / 4); "
          "LDS per CU: 64 KiB gfx90a/gfx942, 160 KiB gfx950. instr: static AMDGCN instructions; "
          "loop instr/group: static instructions of the block loop (all paths) * warps / block.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
