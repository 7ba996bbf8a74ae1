"""The vLLM plugin (converter/vllm_plugin): its layout against vLLM's and aiter's own code, bit for bit;
its route and every refusal with ROCm and aiter simulated; and, installed into the real vLLM CPU
server, that it changes nothing there.

Sources these tests read (never copied into the repo; scripts/tools/fetch_server_sources.sh fetches them):
  K3CONVERT_VLLM033_SRC  the `vllm/` package directory of vllm 0.33.0 (PyPI wheel, Python files only)
  K3CONVERT_AITER_SRC    the `aiter/` package directory of amd-aiter 0.1.7.post2.dev18 (PyPI)
  K3CONVERT_VLLM_PYTHON  a python with vLLM and this package installed (`pip install --no-deps -e .`)
Absent, a test skips saying which; with K3CONVERT_REQUIRE_VLLM=1 it fails instead.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import server_sources  # noqa: E402 - tests/support/server_sources.py: vLLM's and aiter's own layout code
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from converter.fixture import FixtureSpec, config as k3_config
from converter.formats.dialect import int4_block
from converter.vllm_plugin import layout, route
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)

HERE = support.SUPPORT
REQUIRE = os.environ.get("K3CONVERT_REQUIRE_VLLM") == "1"
FLYDSL, MXFP4, functions = server_sources.FLYDSL, server_sources.MXFP4, server_sources.functions


def source(env: str, rel: str) -> Path:
    root = os.environ.get(env)
    path = Path(root, rel) if root else None
    if path is not None and path.is_file():
        return path
    why = f"{env} {'unset' if not root else f'has no {rel}'} (run scripts/tools/fetch_server_sources.sh)"
    if REQUIRE:
        pytest.fail(why)
    pytest.skip(why)


def aiter_shuffle() -> types.ModuleType:
    """aiter's own layout functions from aiter/ops/shuffle.py (server_sources.aiter_shuffle)."""
    return server_sources.aiter_shuffle(source("K3CONVERT_AITER_SRC", "ops/shuffle.py"))


RELEASES = ("K3CONVERT_VLLM033_SRC", "K3CONVERT_VLLM034_SRC")   # every proven vLLM's released files


def vllm_flydsl(release: str = RELEASES[0]) -> dict:
    """A vLLM release's CT int4 -> FlyDSL helpers, with aiter's real shuffle_weight."""
    return server_sources.vllm_flydsl(source(release, FLYDSL), aiter_shuffle().shuffle_weight)


def random_codes(e: int, n: int, k: int, seed: int) -> torch.Tensor:
    """int4 codes in [-8, 7] with -8 and 7 certainly present (k3convert writes -8; aiter's requant never does)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (e, n, k), dtype=torch.int8, generator=gen)
    codes[:, 0, :8] = -8
    codes[:, 1, :8] = 7
    return codes


def random_scales(e: int, n: int, g: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.rand(e, n, g, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def ours(codes: torch.Tensor, scales: torch.Tensor, chunk: int = layout.CHUNK_EXPERTS):
    """The plugin's conversion, from CT words packed by compressed-tensors' own packer."""
    words = pack_to_int32(codes, 4)                     # [E, N, K/8], q + 8 per nibble
    return layout.convert_experts_(words.clone(), scales.clone(), chunk)


# ------------------------------------------------------------------ the layout, bit for bit

@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("e,n,k", [(3, 32, 128), (2, 48, 64), (5, 16, 256)])
def test_layout_matches_vllm_ct_to_flydsl(e, n, k, release):
    """Against CompressedTensorsW4A16FlydslMoEMethod.process_weights_after_loading (vLLM 0.33.0 and
    0.34.0), which takes the same CT int32 words (transposed, as that method loads them) and bf16 scales."""
    ns = vllm_flydsl(release)
    codes, scales = random_codes(e, n, k, seed=e * n), random_scales(e, n, k // 32, seed=k)
    words = pack_to_int32(codes, 4)
    layer = types.SimpleNamespace(
        w13_weight_packed=torch.nn.Parameter(words.transpose(1, 2).contiguous(), requires_grad=False),
        w13_weight_scale=torch.nn.Parameter(scales.transpose(1, 2).contiguous(), requires_grad=False),
        w2_weight_packed=torch.nn.Parameter(words.transpose(1, 2).contiguous(), requires_grad=False),
        w2_weight_scale=torch.nn.Parameter(scales.transpose(1, 2).contiguous(), requires_grad=False))
    ns["replace_parameter"] = lambda lyr, name, t: setattr(lyr, name, t)
    ns["process_weights_after_loading"](types.SimpleNamespace(group_size=32), layer)

    w, s = ours(codes, scales)
    assert torch.equal(as_bytes(layer.w13_weight_packed), as_bytes(w))
    assert torch.equal(as_bytes(layer.w13_weight_scale), as_bytes(s))
    # and the helper alone, on the shape the load-time path keeps
    theirs = ns["_gptq_int32_to_flydsl_packed"](words.transpose(1, 2).contiguous())
    assert theirs.shape == (e, n, k // 2) and torch.equal(as_bytes(theirs), as_bytes(w))


def _load_time_helpers(kind: str):
    """(pack_int8_to_packed_int4, shuffle_scale_for_int4) as the load-time path would import them.

    amd-aiter 0.1.7.post2.dev18 (the only amd-aiter on PyPI) has neither; a ROCm build of aiter has both.
    'aiter' uses them from K3CONVERT_AITER_SRC when that tree has them; 'vllm' uses vLLM 0.33's own
    equivalents (its FlyDSL packer, documented there as the same byte order, and its scale relayout).
    """
    shuffle = aiter_shuffle()
    if kind == "aiter":
        if not hasattr(shuffle, "pack_int8_to_packed_int4"):
            pytest.skip("this amd-aiter has no pack_int8_to_packed_int4/shuffle_scale_for_int4 "
                        "(PyPI 0.1.7.post2.dev18 does not; ROCm builds do)")
        return shuffle.pack_int8_to_packed_int4, shuffle.shuffle_scale_for_int4
    ns = vllm_flydsl()
    return ns["_pack_shuffled_int8_to_packed_int4_no_perm"], server_sources.vllm_scale_relayout(ns)


@pytest.mark.parametrize("helpers", ["vllm", "aiter"])
def test_layout_matches_vllm_load_time_path(helpers, monkeypatch):
    """Run vLLM 0.33's own Mxfp4MoEMethod._setup_kernel_k3_situ_gfx942 with aiter simulated, its
    requantizer replaced by one that returns our int4 codes and scales: what it hands the kernel for
    those codes must be byte for byte what the plugin hands it. 10 experts: its 8-expert chunks split."""
    e, inter, hidden = 10, 64, 128
    pack, shuffle_scale = _load_time_helpers(helpers)
    w13_codes, w2_codes = random_codes(e, 2 * inter, hidden, 1), random_codes(e, hidden, inter, 2)
    w13_s, w2_s = random_scales(e, 2 * inter, hidden // 32, 3), random_scales(e, hidden, inter // 32, 4)
    queue = []
    for codes, scales in ((w13_codes, w13_s), (w2_codes, w2_s)):
        for lo in range(0, e, 8):       # the order its loop asks for chunks
            queue.append((codes[lo:lo + 8], scales[lo:lo + 8].transpose(1, 2).contiguous()))

    def per_1x32_i4_quant(w_bf16):
        codes, scale_gn = queue.pop(0)
        assert tuple(w_bf16.shape) == tuple(codes.shape), "chunks asked in another order"
        return codes.clone(), scale_gn.clone()

    def gemm1(*, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0):
        raise AssertionError("not called at load time")

    shuffle = aiter_shuffle()
    mods = {
        "aiter": types.ModuleType("aiter"), "aiter.ops": types.ModuleType("aiter.ops"),
        "aiter.ops.flydsl": types.ModuleType("aiter.ops.flydsl"),
        "aiter.ops.flydsl.kernels": types.ModuleType("aiter.ops.flydsl.kernels"),
        "aiter.ops.flydsl.kernels.moe_2stage_a16wmix": types.SimpleNamespace(flydsl_a16w4_gemm1=gemm1),
        "aiter.ops.quant": types.SimpleNamespace(per_1x32_i4_quant=per_1x32_i4_quant),
        "aiter.ops.shuffle": types.SimpleNamespace(shuffle_weight=shuffle.shuffle_weight,
                                                   pack_int8_to_packed_int4=pack,
                                                   shuffle_scale_for_int4=shuffle_scale),
        "aiter.utility": types.ModuleType("aiter.utility"),
    }
    # aiter/utility/dtypes.py: i4x2 = getattr(torch, "int4", uint8), i8 = int8. CPU torch cannot copy_
    # torch.int4 tensors, so the simulated aiter takes its own fallback, uint8: the bytes are compared.
    mods["aiter"].dtypes = types.SimpleNamespace(i4x2=torch.uint8, i8=torch.int8)
    mods["aiter.utility"].fp4_utils = types.SimpleNamespace(   # values unused: the requantizer is ours
        mxfp4_to_f32=lambda w: torch.zeros(*w.shape[:-1], w.shape[-1] * 2),
        e8m0_to_f32=lambda s: torch.ones(s.shape))
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)   # no accelerator here

    ns = functions(source("K3CONVERT_VLLM033_SRC", MXFP4), {"_setup_kernel_k3_situ_gfx942"},
                   {"torch": torch, "replace_parameter": lambda lyr, name, t: setattr(lyr, name, t)},
                   cls="Mxfp4MoEMethod")
    p = lambda *shape: torch.nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)
    layer = types.SimpleNamespace(w13_weight=p(e, 2 * inter, hidden // 2), w13_weight_scale=p(e, 2 * inter, hidden // 32),
                                  w2_weight=p(e, hidden, inter // 2), w2_weight_scale=p(e, hidden, inter // 32))
    method = types.SimpleNamespace(get_fused_moe_quant_config=lambda _l: None, experts_cls=None)
    ns["_setup_kernel_k3_situ_gfx942"](method, layer)
    assert not queue

    w13, s13 = ours(w13_codes, w13_s, chunk=3)
    w2, s2 = ours(w2_codes, w2_s, chunk=3)
    assert layer.w13_weight.shape == w13.shape and layer.w2_weight.shape == w2.shape
    assert layer.w13_weight.dtype == mods["aiter"].dtypes.i4x2
    assert torch.equal(as_bytes(layer.w13_weight), as_bytes(w13))
    assert torch.equal(as_bytes(layer.w2_weight), as_bytes(w2))
    assert layer.w13_weight_scale.dtype == torch.bfloat16 and layer.w13_weight_scale.dim() == 1
    assert torch.equal(as_bytes(layer.w13_weight_scale), as_bytes(s13))
    assert torch.equal(as_bytes(layer.w2_weight_scale), as_bytes(s2))


def test_minus_eight_is_the_twos_complement_nibble():
    """k3convert's codes reach -8 (docs/spec.md §5: clamp to [-8, 7]); aiter's load-time requant stops at -7.
    The packed format is two's-complement nibbles, so -8 is 0x8 and sign-extends back to -8."""
    codes = torch.full((1, 16, 64), -8, dtype=torch.int8)
    codes[0, :, 1::2] = 7
    w, _ = ours(codes, torch.ones(1, 16, 2, dtype=torch.bfloat16))
    nib = torch.stack((w & 15, w >> 4), -1).view(-1).to(torch.int16)
    assert set(nib.tolist()) == {0x8, 0x7}
    assert sorted(set(((nib ^ 8) - 8).tolist())) == [-8, 7]       # signed nibble decode
    assert (nib == 0x8).sum() == (codes == -8).sum()
    words = pack_to_int32(codes, 4)
    assert torch.equal(layout.ct_words_to_codes(words), codes)


def test_in_place_and_chunked():
    """The conversion overwrites the loaded words (no second copy of the layer), any chunking alike."""
    codes, scales = random_codes(7, 32, 128, 9), random_scales(7, 32, 4, 9)
    words, sc = pack_to_int32(codes, 4), scales.clone()
    w, s = layout.convert_experts_(words, sc, chunk=2)
    assert w.data_ptr() == words.data_ptr() and s.data_ptr() == sc.data_ptr()
    for chunk in (1, 7, 100):
        w2, s2 = ours(codes, scales, chunk)
        assert torch.equal(w2, w) and torch.equal(as_bytes(s2), as_bytes(s))


def test_probe_accepts_aiters_layout_and_refuses_others():
    ns = vllm_flydsl()
    shuffle_weight, pack = aiter_shuffle().shuffle_weight, ns["_pack_shuffled_int8_to_packed_int4_no_perm"]

    def scale_gn_pairs(scale, group_size=32):
        e, g, n = scale.shape
        return scale.view(e, g // 2, 2, n).permute(0, 1, 3, 2).contiguous()

    def scale_n_major(scale, group_size=32):          # an older a16wi4 kernel's (E, N, G/2, 2)
        return scale.transpose(1, 2).contiguous()

    def pack_adjacent(x):                             # the common v0 | v1 << 4 order
        u = (x.contiguous().view(-1).view(torch.uint8) & 15).view(-1, 2)
        return (u[:, 0] | (u[:, 1] << 4)).view(torch.int8)

    assert layout.probe(shuffle_weight, pack, scale_gn_pairs) is None
    assert (layout.probe(shuffle_weight, pack, scale_n_major)
            == "aiter's shuffle_scale_for_int4 lays out bf16 group scales differently")
    assert (layout.probe(shuffle_weight, pack_adjacent, scale_gn_pairs)
            == "aiter's pack_int8_to_packed_int4 packs int4 codes differently")
    assert (layout.probe(lambda x, _l: x, pack, scale_gn_pairs)
            == "aiter's shuffle_weight (16, 16) lays out int8 codes differently")


# ------------------------------------------------------------------ route and refusals (simulated)

def _gemm1_ok(*, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0, w_dtype="mxfp4"):
    """Stands in for a SiTUv2-capable aiter flydsl_a16w4_gemm1."""


def _gemm1_silu_only(*, a_bf16, w_dtype="mxfp4"):
    """An aiter build whose packed-int4 stage 1 takes no activation."""


def _gemm1_act_no_beta(*, a_bf16, act="silu", w_dtype="mxfp4"):
    """Takes an activation but no SiTU betas."""


GOOD = route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=True, vllm_version="0.33.0",
                     gemm1=_gemm1_ok)


def k3(weights_overrides=None, group_overrides=None, text_overrides=None, model_type="kimi_k3"):
    """(quantization_config, hf config) of a k3convert K3 int4 output, with overrides."""
    cfg = k3_config(FixtureSpec())
    cfg["model_type"] = model_type
    quant = int4_block(["Linear"], ["re:.*self_attn.*"])
    quant["config_groups"]["group_0"]["weights"].update(weights_overrides or {})
    quant["config_groups"]["group_0"].update(group_overrides or {})
    cfg["text_config"].update({"quantization_config": quant, **(text_overrides or {})})
    return quant, cfg


@pytest.mark.parametrize("model_type", ["kimi_k3", "kimi_k31", "kimi_k3_mtp"])
@pytest.mark.parametrize("version", ["0.34.0", "0.34.2+rocm7.1", "0.33.1"])
def test_route_claims_k3_and_k31_on_every_proven_release(model_type, version):
    """Kimi K3.1 (kimi_k31) is built on K3's classes from vLLM 0.34 on; every 0.33.x and 0.34.x build
    is a proven release (converter/releases)."""
    quant, cfg = k3(model_type=model_type)
    machine = dataclasses.replace(GOOD, vllm_version=version)
    if model_type == "kimi_k31" and version.startswith("0.33"):
        with pytest.raises(route.Refused, match="first in vLLM 0.34.0"):
            route.decide(quant, None, cfg, machine)
    else:
        assert route.decide(quant, None, cfg, machine) == route.NAME


def test_route_claims_k3_int4_on_gfx942_with_aiter():
    quant, cfg = k3()
    assert route.decide(quant, None, cfg, GOOD) == route.NAME
    assert route.decide(quant, "compressed-tensors", cfg, GOOD) == route.NAME
    # hf_config as vLLM passes it: an object with attributes, text_config an object too
    obj = types.SimpleNamespace(model_type="kimi_k3", text_config=types.SimpleNamespace(**cfg["text_config"]))
    assert route.decide(quant, None, obj, GOOD) == route.NAME


def test_route_claims_the_k3_mtp_draft():
    """vLLM 0.33's speculative config renames the draft's model_type to kimi_k3_mtp (speculative.py:785-792)
    and keeps text_config; its layers are K3's own KimiDecoderLayer (models/kimi_k3/amd/mtp.py:84)."""
    quant, cfg = k3(model_type="kimi_k3_mtp")
    assert route.decide(quant, None, cfg, GOOD) == route.NAME
    quant, cfg = k3(model_type="kimi_k3_mtp", text_overrides={"hidden_act": "silu"})
    assert route.decide(quant, None, cfg, GOOD) is None
    quant, cfg = k3(model_type="deepseek_mtp")
    assert route.decide(quant, None, cfg, GOOD) is None


@pytest.mark.parametrize("case,machine,change", [
    ("CUDA or CPU", route.Machine(is_rocm=False), {}),
    ("another model", GOOD, {"model_type": "mixtral"}),
    ("SiLU experts", GOOD, {"text": {"hidden_act": "silu"}}),
    ("MXFP4 checkpoint", GOOD, {"weights": {"type": "float"}}),
    ("int8 checkpoint", GOOD, {"weights": {"num_bits": 8}}),
    ("user asked another method", GOOD, {"user": "fp8"}),
])
def test_route_stays_out_of_the_way(case, machine, change):
    quant, cfg = k3(change.get("weights"), None, change.get("text"), change.get("model_type", "kimi_k3"))
    assert route.decide(quant, change.get("user"), cfg, machine) is None, case


@pytest.mark.parametrize("change", [{"model_type": "mixtral"}, {"text": {"hidden_act": "silu"}},
                                    {"weights": {"type": "float"}}, {"user": "fp8"}])
def test_the_machine_is_not_asked_for_other_checkpoints(change):
    """machine() (which imports aiter) is evaluated only for a K3 int4 SiTU checkpoint."""
    quant, cfg = k3(change.get("weights"), None, change.get("text"), change.get("model_type", "kimi_k3"))
    asked = []
    assert route.decide(quant, change.get("user"), cfg, lambda: asked.append(1) or GOOD) is None
    assert not asked
    quant, cfg = k3()
    assert route.decide(quant, None, cfg, lambda: asked.append(1) or GOOD) == route.NAME and asked == [1]


@pytest.mark.parametrize("case,machine,change,message", [
    ("gfx950", route.Machine(True, False, True, "0.33.0", _gemm1_ok, gpu="AMD Instinct MI355X"), {},
     "this GPU (AMD Instinct MI355X) is not gfx942"),
    ("AITER MoE off", route.Machine(True, True, False, "0.33.0", _gemm1_ok), {},
     "AITER MoE is off: set VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1"),
    ("vLLM 0.32", route.Machine(True, True, True, "0.32.0", _gemm1_ok), {},
     "proven on vLLM 0.33.x, 0.34.x, found vLLM 0.32.0"),
    ("vLLM 0.35", route.Machine(True, True, True, "0.35.0", _gemm1_ok), {}, "proven on vLLM 0.33.x, 0.34.x, found vLLM 0.35.0"),
    ("K3.1 on vLLM 0.33", GOOD, {"model_type": "kimi_k31"},
     "vLLM 0.33.0 builds no model of model_type 'kimi_k31' (first in vLLM 0.34.0)"),
    ("aiter without the int4 entry point", route.Machine(True, True, True, "0.33.0", None), {}, "no packed-int4 a16w4"),
    ("aiter import error kept", route.Machine(True, True, True, "0.33.0", None, "ImportError: libflydsl.so: cannot open"),
     {}, "ImportError: libflydsl.so: cannot open"),
    ("aiter gemm1 without act", route.Machine(True, True, True, "0.33.0", _gemm1_silu_only), {}, "would compute SiLU"),
    ("aiter gemm1 without betas", route.Machine(True, True, True, "0.33.0", _gemm1_act_no_beta), {}, "situ_beta, situ_linear_beta"),
    ("group 128", GOOD, {"weights": {"group_size": 128}}, "expected group 32"),
    ("channel", GOOD, {"weights": {"strategy": "channel", "group_size": None}}, "expected group 32"),
    ("asymmetric", GOOD, {"weights": {"symmetric": False}}, "asymmetric"),
    ("actorder group", GOOD, {"weights": {"actorder": "group"}}, "actorder 'group'"),
    ("actorder weight", GOOD, {"weights": {"actorder": "weight"}}, "actorder 'weight'"),
    ("dynamic", GOOD, {"weights": {"dynamic": True}}, "dynamic"),
    ("W4A8", GOOD, {"group": {"input_activations": {"num_bits": 8, "type": "int"}}}, "input activations"),
    ("marlin-24 format", GOOD, {"group": {"format": "marlin-24"}}, "format 'marlin-24'"),
    ("no linear_beta", GOOD, {"text": {"activation_situ_linear_beta": None}}, "activation_situ_linear_beta"),
])
def test_route_refuses_with_one_clear_line(case, machine, change, message):
    quant, cfg = k3(change.get("weights"), change.get("group"), change.get("text"), change.get("model_type", "kimi_k3"))
    with pytest.raises(route.Refused) as err:
        route.decide(quant, None, cfg, machine)
    text = str(err.value)
    assert text.startswith("k3convert vLLM plugin:") and message in text and "\n" not in text, case


def test_gemm1_signature_check_reads_the_real_signature():
    def gemm1(**kwargs):      # a **kwargs wrapper hides the parameters: not accepted on faith
        return kwargs
    assert "act" in route.gemm1_problem(gemm1)
    assert route.gemm1_problem(_gemm1_ok) is None


def test_importing_the_plugin_imports_no_vllm():
    code = ("import sys, converter, converter.cli, converter.vllm_plugin, converter.vllm_plugin.layout, "
            "converter.vllm_plugin.route; sys.exit(any(m == 'vllm' or m.startswith(('vllm.', 'aiter')) "
            "for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------ the real vLLM (CPU server)

def vllm_python() -> str:
    py = os.environ.get("K3CONVERT_VLLM_PYTHON")
    if py and Path(py).is_file():
        return py
    why = "K3CONVERT_VLLM_PYTHON unset (a python with vLLM and `pip install --no-deps -e .` of this repo)"
    if REQUIRE:
        pytest.fail(why)
    pytest.skip(why)


def run_probe(py: str, mode: str, model_dir: Path, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full.update(VLLM_LOGGING_LEVEL="ERROR", **env)
    proc = subprocess.run([py, str(HERE / "vllm_plugin_probe.py"), mode, str(model_dir)],
                          capture_output=True, text=True, timeout=300, env=full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def real_vllm(tmp_path_factory) -> dict:
    """Two runs of the real vLLM: with the plugin (then ROCm simulated), and with VLLM_PLUGINS excluding it.
    The checkpoint is the config.json of a tiny Mixtral as k3convert writes its int4 output (docs/spec.md §3)."""
    py = vllm_python()
    source("K3CONVERT_VLLM033_SRC", FLYDSL)          # the probe's expected bytes come from these
    source("K3CONVERT_AITER_SRC", "ops/shuffle.py")
    d = tmp_path_factory.mktemp("int4_mixtral")
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 256, "max_position_embeddings": 256, "torch_dtype": "bfloat16",
           "quantization_config": int4_block(["Linear"], ["lm_head", "re:.*block_sparse_moe.gate"])}
    (d / "config.json").write_text(json.dumps(cfg))
    return {"with": run_probe(py, "resolve+rocm", d), "without": run_probe(py, "resolve", d, VLLM_PLUGINS="")}


def test_real_vllm_loads_the_plugin_and_resolves_the_same(real_vllm):
    with_plugin, without = real_vllm["with"]["resolve"], real_vllm["without"]["resolve"]
    assert "k3convert" in with_plugin["general_plugins"] and with_plugin["registered"]
    assert "k3convert" not in without["general_plugins"] and not without["registered"]
    assert with_plugin["quantization"] == without["quantization"] == "compressed-tensors"
    assert with_plugin["quant_config_class"] == without["quant_config_class"] == "CompressedTensorsConfig"


def test_real_vllm_with_rocm_simulated_refuses_its_version(real_vllm):
    """The glue on a real vLLM (0.32 CPU) with ROCm, gfx942, AITER MoE and aiter faked: a K3 int4
    config is refused (this vLLM is not 0.33); the Mixtral int4 config is left alone."""
    out = real_vllm["with"]["rocm"]
    assert out["refused"].startswith("k3convert vLLM plugin: proven on vLLM 0.33.x, 0.34.x, found vLLM 0.32")
    assert out["not_k3"] is None


def test_real_vllm_runs_the_experts_method(real_vllm):
    """K3Int4AiterMoEMethod on the real vLLM (aiter faked): the experts load through vLLM's own
    compressed-tensors WNA16 create_weights (N-first int32 words, bf16 [E, N, G] scales), are laid out in
    place, and the kernel is built as vLLM's Mxfp4 K3 route builds it, with the layer's scales."""
    out = real_vllm["with"]["rocm"]["method"]
    assert out["shapes"]["w13_weight_packed"] == [3, 128, 16] and out["shapes"]["w2_weight_packed"] == [3, 128, 8]
    assert out["shapes"]["w13_weight_scale"] == [3, 128, 4] and out["shapes"]["w2_weight_scale"] == [3, 128, 2]
    assert out["w13_bytes_equal"] and out["w13_scale_equal"] and out["shuffled"]
    assert out["w13_shape"] == [3, 128, 64] and out["w2_shape"] == [3, 128, 32]
    assert out["backend"] == "AITER_MXFP4_BF16" and out["experts_cls"] == out["vllm_route_experts_cls"]
    assert out["w1_scale_is_layer_scale"]
    assert out["keep_constants_of_the_layer"]       # as 0.34's route after the build (mxfp4.py 1026)
    assert out["sizes_k3_tp8"] == [3584, 384]
    assert out["pad_refused"].startswith("k3convert vLLM plugin:") and "intermediate size 96" in out["pad_refused"]


def test_real_vllm_leaves_lora_and_emulation_to_vllms_own_method(real_vllm):
    """What vLLM 0.33's get_moe_method checks before its int4 kernels (compressed_tensors_moe.py:106-130):
    with LoRA, or moe_backend 'emulation', the experts get vLLM's own method, as without the plugin."""
    out = real_vllm["with"]["rocm"]["quant_method"]
    assert out["default"] == "K3Int4AiterMoEMethod" and out["aiter"] == "K3Int4AiterMoEMethod"
    assert out["lora"] == "stock" and out["emulation"] == "stock"
    assert out["flydsl"].startswith("k3convert vLLM plugin: --moe-backend flydsl:")
    assert out["elastic-ep"].startswith("k3convert vLLM plugin: elastic expert parallelism")
    assert out["eplb"].startswith("k3convert vLLM plugin: --enable-eplb")


def test_size_problem_is_the_one_size_rule():
    """One torch-free rule (route.size_problem) for moe_method.maybe_roundup_sizes and serving.py's
    `verify --serving vllm-rocm-plugin`: 128-aligned hidden and per-rank intermediate sizes pass."""
    assert route.size_problem(3584, 384) is None and route.size_problem(3584, 3072) is None
    assert (route.size_problem(3552, 384)
            == "hidden size 3552 or per-rank intermediate size 384 is not a multiple of 128")
    assert (route.size_problem(3584, 96)
            == "hidden size 3584 or per-rank intermediate size 96 is not a multiple of 128")
    assert route.check_dims(24, 64) == "output size 24 is not a multiple of 16"
    assert route.check_dims(16, 96) == "input size 96 is not a multiple of 64 (the scale layout pairs groups of 32)"
    # serving.py's verdict through this rule: tests/servers/test_serving.py::test_plugin_refuses_sizes_its_kernel_would_pad


def test_experts_choice():
    """Who serves the experts for each --moe-backend of vLLM 0.33 (config/kernel.py MoEBackend)."""
    assert route.experts_choice(None, "auto", False) is None
    assert route.experts_choice(None, None, False) is None
    assert route.experts_choice(None, "AITER", False) is None
    assert route.experts_choice(object(), "auto", False) == "LoRA is enabled (the packed-int4 kernel has no LoRA path)"
    assert route.experts_choice(None, "emulation", False) == "moe_backend 'emulation' was chosen"
    for backend in ("triton", "flydsl", "marlin", "aiter_triton_mxfp4_bf16", "triton_unfused", "rdna3"):
        with pytest.raises(route.Refused, match=f"--moe-backend {backend}: "):
            route.experts_choice(None, backend, False)
    with pytest.raises(route.Refused, match="elastic expert parallelism"):
        route.experts_choice(None, "auto", True)
    # issue 41 item 5: EPLB's redundant experts and rearrangement move per-expert rows of every parameter
    # (vLLM 0.34 routed_experts.py 205-218 asks supports_eplb, which Mxfp4MoEMethod answers True): refused
    with pytest.raises(route.Refused, match="--enable-eplb"):
        route.experts_choice(None, "auto", False, eplb=True)
    with pytest.raises(route.Refused, match="--enable-eplb"):
        route.experts_choice(object(), "emulation", False, eplb=True)


def test_real_vllm_scheme_lookup_for_the_experts(real_vllm):
    """K3Int4Gfx942Config picks the experts' scheme with vLLM's own get_scheme_dict, as
    CompressedTensorsMoEMethod.get_moe_method does; non-int4 or ignored experts go to vLLM's methods."""
    out = real_vllm["with"]["rocm"]["scheme"]
    assert out["int4"] == "int4 g32"
    assert out["g128"].startswith("k3convert vLLM plugin: language_model.model.layers.1.block_sparse_moe.experts:")
    assert "expected group 32" in out["g128"]
    assert out["ignored"] is None and out["int8"] is None


def test_register_under_another_vllm_layout_refuses_k3_int4_on_rocm(monkeypatch):
    """If the plugin's config cannot import under some vLLM, register() still registers a config that
    refuses K3 int4 SiTU on ROCm, naming the import error, instead of letting stock vLLM serve it."""
    import converter.vllm_plugin as plugin

    registered = {}
    quant_mod = types.ModuleType("vllm.model_executor.layers.quantization")
    quant_mod.QUANTIZATION_METHODS = []
    quant_mod.register_quantization_config = lambda name: (lambda cls: registered.setdefault(name, cls))
    base = types.ModuleType("vllm.model_executor.layers.quantization.base_config")
    base.QuantizationConfig = type("QuantizationConfig", (), {})
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_rocm=lambda: True)
    for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm.model_executor.layers.quantization", quant_mod),
                      ("vllm.model_executor.layers.quantization.base_config", base), ("vllm.platforms", platforms),
                      ("converter.vllm_plugin.vllm_config", None)):     # None: importing it raises ImportError
        monkeypatch.setitem(sys.modules, name, mod)
    plugin.register()
    cls = registered[route.NAME]
    quant, cfg = k3()
    with pytest.raises(route.Refused, match=r"cannot load under this vLLM \(ModuleNotFoundError: import of converter.vllm_plugin.vllm_config"):
        cls.override_quantization_method(quant, None, hf_config=cfg)
    assert cls.override_quantization_method(quant, None, hf_config={"model_type": "mixtral"}) is None
    platforms.current_platform.is_rocm = lambda: False
    assert cls.override_quantization_method(quant, None, hf_config=cfg) is None
