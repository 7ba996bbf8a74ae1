"""The plugin's fused Triton layout (converter/vllm_plugin/layout_kernel.py) and scripts/benchmarks/bench_startup.py.

* Bytes: the kernel, run by the Triton interpreter on K3's real K (3584, 384, 3072) and odd chunkings,
  against aiter's own shuffle_weight with vLLM 0.33's packer and scale relayout (and aiter's own packer
  and scale shuffle where K3CONVERT_AITER_SRC has them), code -8 (CT nibble 0) and code 0 included.
* AMD: cross-compiled for CDNA (gfx942 first) on every specialization K3's splits reach: no spills, no scratch.
* The bench's restatements of vLLM's load-time routes give the bytes vLLM 0.33's and 0.34's own methods give.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

pytest.importorskip("triton")

import server_sources  # noqa: E402
from interpreted import run_interpreted  # noqa: E402

from converter.vllm_plugin import layout, layout_kernel  # noqa: E402
from tests.quant.kernels.test_kernel_amd import needs_amd, report  # noqa: E402
from tests.vllm_plugin.test_vllm_plugin import (  # noqa: E402
    MXFP4,
    _load_time_helpers,
    aiter_shuffle,
    as_bytes,
    source,
    vllm_flydsl,
)

REPO = Path(__file__).resolve().parents[2]


def bench_module() -> types.ModuleType:
    """scripts/benchmarks/bench_startup.py as a module (scripts/ is not a package)."""
    if "bench_startup" not in sys.modules:
        path = REPO / "scripts" / "benchmarks" / "bench_startup.py"
        spec = importlib.util.spec_from_file_location("bench_startup", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["bench_startup"] = mod
    return sys.modules["bench_startup"]

# (experts, N, K, chunk): K3's K per matrix (w13: 3584; w2: 384 at TP 8, 3072 at TP 8 + EP 8), tiles that do
# not fill a program, chunks that do not divide the experts, one expert a chunk
CASES = {"k3_hidden": (2, 16, 3584, None), "tp8_w2": (5, 32, 384, 2), "ep8_w2": (1, 16, 3072, None),
         "small": (3, 48, 64, 1), "extremes": (3, 16, 128, None)}


def case_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [E, N, K] in [-8, 7] (-8 and 7 certain) and bf16 scales [E, N, K/32]."""
    e, n, k, _ = CASES[name]
    gen = torch.Generator().manual_seed(len(name) * 1000 + k)
    codes = torch.randint(-8, 8, (e, n, k), dtype=torch.int8, generator=gen)
    codes[:, 0, :8], codes[:, 1, :8] = -8, 7
    scales = torch.randn(e, n, k // 32, generator=gen).to(torch.bfloat16)
    if name == "extremes":            # all -8 (CT nibble 0), all 0 (packed nibble 0), alternating 7/-8
        codes[0], codes[1] = -8, 0
        codes[2, :, 0::2], codes[2, :, 1::2] = 7, -8
        odd = torch.tensor([0.0, -0.0, float("inf"), float("nan")], dtype=torch.bfloat16)
        scales.view(-1)[: odd.numel()] = odd          # bytes move, never values
    return codes, scales


def _child_main(out: str) -> None:
    """Under TRITON_INTERPRET=1: the fused layout of every case, and whether it stayed in place."""
    arrays = {}
    for name, (_, _, _, chunk) in CASES.items():
        codes, scales = case_inputs(name)
        words, sc = pack_to_int32(codes, 4), scales.clone()
        w, s = layout_kernel.convert_experts_(words, sc, chunk)
        arrays[f"{name}_w"] = w.numpy()
        arrays[f"{name}_s"] = s.view(torch.int16).numpy()
        arrays[f"{name}_inplace"] = np.array([w.data_ptr() == words.data_ptr() and s.data_ptr() == sc.data_ptr()])
    np.savez(out, **arrays)


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> dict[str, np.ndarray]:
    return run_interpreted(__name__, tmp_path_factory.mktemp("layout") / "out.npz")


@pytest.mark.parametrize("helpers", ["vllm", "aiter"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_layout_is_aiters_bytes(fused, name, helpers):
    pack, shuffle_scale = _load_time_helpers(helpers)
    shuffle_weight = aiter_shuffle().shuffle_weight
    codes, scales = case_inputs(name)
    e, n, k, _ = CASES[name]
    got_w, got_s = torch.from_numpy(fused[f"{name}_w"]), torch.from_numpy(fused[f"{name}_s"])
    assert got_w.shape == (e, n, k // 2) and bool(fused[f"{name}_inplace"][0])
    assert torch.equal(as_bytes(got_w), as_bytes(pack(shuffle_weight(codes.clone(), (16, 16)))))
    theirs_s = shuffle_scale(scales.transpose(1, 2).contiguous(), group_size=32)
    assert torch.equal(as_bytes(got_s), as_bytes(theirs_s))
    if helpers == "vllm":       # vLLM's own CT words -> packed route, and the plugin's torch path
        ct = pack_to_int32(codes, 4)
        theirs = vllm_flydsl()["_gptq_int32_to_flydsl_packed"](ct.transpose(1, 2).contiguous())
        assert torch.equal(as_bytes(theirs), as_bytes(got_w))
        w, s = layout.convert_experts_(ct, scales.clone())
        assert torch.equal(w, got_w) and torch.equal(as_bytes(s), as_bytes(got_s))


def test_minus_eight_and_zero_nibbles(fused):
    """CT nibble 0 (code -8) becomes packed 0x8; CT nibble 8 (code 0) becomes packed 0x0."""
    w = torch.from_numpy(fused["extremes_w"])
    assert bool((w[0] == 0x88).all()) and bool((w[1] == 0).all())
    # v0..v7 = 7, -8, 7, -8, ...: byte j = v_j | v_{j+4} << 4 gives 0x77, 0x88, 0x77, 0x88
    assert bool((w[2, :, 0::2] == 0x77).all()) and bool((w[2, :, 1::2] == 0x88).all())


def test_bad_shapes_are_one_clear_error():
    words, scales = torch.zeros(2, 16, 16, dtype=torch.int32), torch.zeros(2, 16, 4, dtype=torch.bfloat16)
    layout_kernel.check_shapes(words, scales)
    for w, s in ((words[:, :8], scales[:, :8]), (words, scales[..., :2]), (words.float(), scales),
                 (words.transpose(1, 2).contiguous().transpose(1, 2), scales)):
        with pytest.raises(ValueError, match=r"words .*scales|int32 words"):
            layout_kernel.check_shapes(w, s)


def k3_specializations() -> set[tuple[int, int, int]]:
    """(BT, BN, BG) of every matrix of both splits (bench_startup's shapes are SPEC's)."""
    bs = bench_module()
    out = set()
    for split in bs.SPLITS:
        for e, n, k in bs.shapes(split, tiny=False).values():
            sh = layout_kernel.launch_shape(e * n, k // 8, e, n, k // 64)
            out.add((sh["BT"], sh["BN"], sh["BG"]))
    return out


@needs_amd
@pytest.mark.parametrize("spec", ["launch", "bare"])
@pytest.mark.parametrize("arch", report.ARCHS)
def test_fused_layout_compiles_for_amd_without_spills(arch, spec):
    """Plain Triton to AMDGCN (Triton's AMD backend, no GPU needed): no spills, no scratch memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = layout_kernel._layout_kernel
    pointers = ("w_ptr", "s_ptr", "ow_ptr", "os_ptr")
    signature = {**{p: "*i32" for p in pointers},
                 **{i: "i32" for i in ("KW", "KT", "NKB", "W_PROGRAMS", "N", "G2", "NNB", "NGB")},
                 "BT": "constexpr", "BN": "constexpr", "BG": "constexpr"}
    attrs = {(kernel.arg_names.index(p),): [["tt.divisibility", 16]] for p in pointers} if spec == "launch" else {}
    specs = k3_specializations()
    assert len(specs) >= 2          # TP 8's w2 (K 384) takes another tile than the rest
    for bt, bn, bg in sorted(specs):
        src = ASTSource(fn=kernel, signature=signature, attrs=attrs, constexprs={"BT": bt, "BN": bn, "BG": bg})
        asm = triton.compile(src, target=GPUTarget("hip", arch, 64),
                             options={"num_warps": 4, "num_stages": 1}).asm["amdgcn"]
        nums = report.parse_amdgcn(asm)
        assert nums["vgpr_spills"] == 0 and nums["scratch_bytes"] == 0, (arch, spec, bt, bn, bg, nums)
        assert ("buffer_load" in asm or "global_load" in asm) and ("buffer_store" in asm or "global_store" in asm)


# ------------------------------------------------------------------ the bench's restated vLLM route

def test_bench_restates_vllms_route(monkeypatch):
    """bench_startup.vllm_route against vLLM 0.33's own Mxfp4MoEMethod._setup_kernel_k3_situ_gfx942
    (run from its released source, aiter's calls answered by the bench's restated aiter functions):
    the same packed bytes and scales, 10 experts so that its 8-expert chunks split."""
    bs = bench_module()
    mods = {"aiter": types.ModuleType("aiter"), "aiter.ops": types.ModuleType("aiter.ops"),
            "aiter.ops.flydsl": types.ModuleType("aiter.ops.flydsl"),
            "aiter.ops.flydsl.kernels": types.ModuleType("aiter.ops.flydsl.kernels"),
            "aiter.ops.flydsl.kernels.moe_2stage_a16wmix": types.SimpleNamespace(
                flydsl_a16w4_gemm1=lambda *, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0: None),
            "aiter.ops.quant": types.SimpleNamespace(per_1x32_i4_quant=bs.per_1x32_i4_quant),
            "aiter.ops.shuffle": types.SimpleNamespace(shuffle_weight=bs.shuffle_weight,
                                                       pack_int8_to_packed_int4=bs.pack_int8_to_packed_int4,
                                                       shuffle_scale_for_int4=bs.shuffle_scale_for_int4),
            "aiter.utility": types.ModuleType("aiter.utility")}
    mods["aiter"].dtypes = bs.aiter_dtypes
    mods["aiter.utility"].fp4_utils = bs.fp4_utils
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    ns = server_sources.functions(source("K3CONVERT_VLLM033_SRC", MXFP4), {"_setup_kernel_k3_situ_gfx942"},
                                  {"torch": torch, "replace_parameter": bs.replace_parameter}, cls="Mxfp4MoEMethod")
    tpl = bs.templates("tp8", tiny=True, device=torch.device("cpu"))
    tpl["mxfp4"] = {k: (w[:10].clone() if w.shape[0] >= 10 else torch.cat([w] * 5)[:10],
                        s[:10].clone() if s.shape[0] >= 10 else torch.cat([s] * 5)[:10])
                    for k, (w, s) in tpl["mxfp4"].items()}
    theirs, ours = bs.make_layer("vllm", tpl), bs.make_layer("vllm", tpl)
    ns["_setup_kernel_k3_situ_gfx942"](types.SimpleNamespace(get_fused_moe_quant_config=lambda _l: None,
                                                             experts_cls=None), theirs)
    bs.vllm_route(ours)
    for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
        a, b = getattr(theirs, name).data, getattr(ours, name).data
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b)), name
    assert ours.w13_weight.is_shuffled and ours.w2_weight.is_shuffled


def _vllm034_route(bs, monkeypatch, chunk_values: int) -> dict:
    """vLLM 0.34.0's own _setup_kernel_k3_situ_gfx942 and _mxfp4_experts_to_int4_gfx942 (mxfp4.py) with its
    own replace_parameter (model_executor/utils.py), compiled from the released sources; aiter's calls are
    answered by the bench's restated aiter functions, _K3_INT4_CONVERT_CHUNK_VALUES set to ``chunk_values``."""
    src = source("K3CONVERT_VLLM034_SRC", MXFP4)
    utils = source("K3CONVERT_VLLM034_SRC", "model_executor/utils.py")
    released = [n for n in ast.parse(src.read_text()).body if isinstance(n, ast.Assign)
                and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["_K3_INT4_CONVERT_CHUNK_VALUES"]]
    assert len(released) == 1, f"{src}: no single _K3_INT4_CONVERT_CHUNK_VALUES"
    value = eval(compile(ast.Expression(released[0].value), str(src), "eval"), {"__builtins__": {}})  # 1 << 27
    assert value == bs._K3_INT4_CONVERT_CHUNK_VALUES, (value, bs._K3_INT4_CONVERT_CHUNK_VALUES)
    mods = {"aiter": types.ModuleType("aiter"), "aiter.ops": types.ModuleType("aiter.ops"),
            "aiter.ops.flydsl": types.ModuleType("aiter.ops.flydsl"),
            "aiter.ops.flydsl.kernels": types.ModuleType("aiter.ops.flydsl.kernels"),
            "aiter.ops.flydsl.kernels.moe_2stage_a16wmix": types.SimpleNamespace(
                flydsl_a16w4_gemm1=lambda *, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0: None),
            "aiter.ops.quant": types.SimpleNamespace(per_1x32_i4_quant=bs.per_1x32_i4_quant),
            "aiter.ops.shuffle": types.SimpleNamespace(shuffle_weight=bs.shuffle_weight,
                                                       pack_int8_to_packed_int4=bs.pack_int8_to_packed_int4,
                                                       shuffle_scale_for_int4=bs.shuffle_scale_for_int4),
            "aiter.utility": types.ModuleType("aiter.utility")}
    mods["aiter"].dtypes = bs.aiter_dtypes
    mods["aiter.utility"].fp4_utils = bs.fp4_utils
    # replace_parameter imports direct_reload_enabled where a result's shape differs (the default: off)
    direct = "vllm.model_executor.model_loader.reload.direct"
    for i in range(1, direct.count(".") + 2):
        mods[".".join(direct.split(".")[:i])] = types.ModuleType(".".join(direct.split(".")[:i]))
    mods[direct].direct_reload_enabled = lambda: False
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    ns = server_sources.functions(utils, {"_extent", "storage_view", "_in_own_storage", "replace_parameter"},
                                  {"torch": torch, "set_weight_attrs": None})
    ns["_K3_INT4_CONVERT_CHUNK_VALUES"] = chunk_values
    server_sources.functions(src, {"_mxfp4_experts_to_int4_gfx942"}, ns)
    return server_sources.functions(src, {"_setup_kernel_k3_situ_gfx942"}, ns, cls="Mxfp4MoEMethod")


def test_bench_restates_vllm034_route(monkeypatch):
    """bench_startup.vllm034_route against vLLM 0.34.0's own route and replace_parameter, run from the
    released source: the same bytes, shapes and dtypes, the int4 weight written into the loaded parameter's
    storage in both (0.34's replace_parameter) and the scales rebound, on 10 experts with chunk sizes that
    split them unevenly (w13 3 experts a chunk, w2 6: 0.34's last chunk shifted back), and the same bytes
    as the bench's 0.33 route."""
    bs = bench_module()
    tpl = bs.templates("tp8", tiny=True, device=torch.device("cpu"))
    tpl["mxfp4"] = {k: (torch.cat([w] * 5)[:10].clone(), torch.cat([s] * 5)[:10].clone())
                    for k, (w, s) in tpl["mxfp4"].items()}
    (_, n13, k13), (_, n2, k2) = (x.shape[0:2] + (x.shape[2] * 2,) for x in (tpl["mxfp4"]["w13"][0],
                                                                              tpl["mxfp4"]["w2"][0]))
    chunk_values = 3 * n13 * k13
    assert (chunk_values // (n13 * k13), chunk_values // (n2 * k2)) == (3, 6)
    ns = _vllm034_route(bs, monkeypatch, chunk_values)
    monkeypatch.setattr(bs, "_K3_INT4_CONVERT_CHUNK_VALUES", chunk_values)
    theirs, ours = bs.make_layer("vllm-0.34", tpl), bs.make_layer("vllm-0.34", tpl)
    old = bs.make_layer("vllm-0.33", tpl)
    ptrs = {name: (getattr(theirs, name).data_ptr(), getattr(ours, name).data_ptr())
            for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")}
    ns["_setup_kernel_k3_situ_gfx942"](types.SimpleNamespace(get_fused_moe_quant_config=lambda _l: None,
                                                             experts_cls=None), theirs)
    bs.vllm034_route(ours)
    bs.vllm033_route(old)
    for name, (p_theirs, p_ours) in ptrs.items():
        a, b, c = getattr(theirs, name).data, getattr(ours, name).data, getattr(old, name).data
        assert a.shape == b.shape == c.shape and a.dtype == b.dtype == c.dtype, name
        assert torch.equal(as_bytes(a), as_bytes(b)) and torch.equal(as_bytes(a), as_bytes(c)), name
        kept = getattr(theirs, name).data_ptr() == p_theirs
        assert kept == (getattr(ours, name).data_ptr() == p_ours) == name.endswith("_weight"), name
    assert ours.w13_weight.is_shuffled and ours.w2_weight.is_shuffled


@pytest.mark.parametrize("helpers", ["vllm", "aiter"])
def test_bench_restates_aiters_layout_functions(helpers):
    """The bench's restated shuffle_weight / pack / scale shuffle against aiter's (or vLLM's) own."""
    bs = bench_module()
    pack, shuffle_scale = _load_time_helpers(helpers)
    codes, scales = case_inputs("small")
    theirs = aiter_shuffle().shuffle_weight(codes.clone(), (16, 16))
    assert torch.equal(as_bytes(bs.shuffle_weight(codes.clone(), (16, 16))), as_bytes(theirs))
    assert torch.equal(as_bytes(bs.pack_int8_to_packed_int4(theirs)), as_bytes(pack(theirs)))
    gn = scales.transpose(1, 2).contiguous()
    assert torch.equal(as_bytes(bs.shuffle_scale_for_int4(gn, 32)), as_bytes(shuffle_scale(gn, group_size=32)))


def _kernel_build_calls(path, cls: str, method: str) -> set[str]:
    """The calls made on ``self.moe_kernel...`` inside the ``make_mxfp4_moe_kernel`` block of a method."""
    tree = ast.parse(Path(path).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method)
    block = next(n for n in ast.walk(fn) if isinstance(n, ast.If) and "make_mxfp4_moe_kernel" in ast.unparse(n))
    out = set()
    for node in ast.walk(block):
        text = ast.unparse(node)
        if isinstance(node, ast.Call) and text.startswith("self.moe_kernel."):
            out.add(text.split("(")[0].removeprefix("self."))
        if isinstance(node, ast.Attribute) and text.startswith("self.moe_kernel.") and text.count(".") >= 3:
            out.add(text.removeprefix("self."))   # a method looked up (getattr guard) and called by another name
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and \
                ast.unparse(node.args[0]).startswith("self.moe_kernel"):
            out.add(f"{ast.unparse(node.args[0]).removeprefix('self.')}.{node.args[1].value}")
    return out


def test_the_plugin_builds_the_kernel_as_vllm034s_route_does():
    """Issue 41 item 5: after make_mxfp4_moe_kernel, vLLM 0.34.0's K3 route calls
    moe_kernel.fused_experts.keep_constants(layer) (quantization/mxfp4.py 1026); the plugin's
    process_weights_after_loading makes every call 0.34's route makes on the kernel it built."""
    theirs = _kernel_build_calls(source("K3CONVERT_VLLM034_SRC", MXFP4), "Mxfp4MoEMethod",
                                 "_setup_kernel_k3_situ_gfx942")
    assert "moe_kernel.fused_experts.keep_constants" in theirs, theirs
    ours = _kernel_build_calls(Path(__file__).parents[2] / "converter/vllm_plugin/moe_method.py",
                               "K3Int4AiterMoEMethod", "process_weights_after_loading")
    assert theirs <= ours, theirs - ours
