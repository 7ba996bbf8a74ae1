"""NVFP4 sources -> int4 group 32 at the optimum over bf16 scales (issue 35 §3).

Sources: auto-round 0.16.1's own NVFP4 exports of a tiny Mixtral (``tests/support/data/auto-round``, written by
its ``make_fixtures.py``), in auto-round's format and in compressed-tensors' ``nvfp4-pack-quantized``;
ModelOpt's layout is made from the latter by the inverse of compressed-tensors' own ModelOpt converter,
which then reads it back. Values are checked against compressed-tensors' NVFP4 decoder and the
requantization against an exhaustive search over every positive bf16 scale.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.quant_scheme import NVFP4A16
from safetensors.torch import load_file

from converter.errors import BadInput
from converter.formats import nvfp4
from converter.quant import nvfp4_requant as nv
from converter.verify import brute_force_min
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import ct_int4_q

# safetensors' dtype names of torch's: the header checks (Nvfp4Source.problem) applied to loaded tensors
ST_DTYPE = {"uint8": "U8", "float8_e4m3fn": "F8_E4M3", "float32": "F32"}


def modules(src: nvfp4.Nvfp4Source, tensors: dict) -> list[str]:
    """Every NVFP4 linear of loaded ``tensors``, checked by the reader's own rules (``Nvfp4Source.problem``
    on dtypes and shapes, ``global_problem`` and ``scale_problem`` on values); BadInput naming each problem."""
    def described(t):
        return None if t is None else (ST_DTYPE.get(str(t.dtype).removeprefix("torch."), str(t.dtype)),
                                       tuple(t.shape))

    suffix = "." + src.packed_suffix
    found, problems = [], []
    for name, t in sorted(tensors.items()):
        if not name.endswith(suffix) or t.dtype != torch.uint8:
            continue
        m = name[: -len(suffix)]
        scale, gs = tensors.get(f"{m}.{src.scale_suffix}"), tensors.get(f"{m}.{src.global_suffix}")
        why = src.problem(m, ("U8", tuple(t.shape)), described(scale), described(gs))
        if why is None:
            why = nvfp4.global_problem(float(gs.reshape(()))) or nvfp4.scale_problem(scale)
        if why:
            problems.append(f"tensor {name}: {why}")
        else:
            found.append(m)
    if problems:
        raise BadInput("; ".join(problems))
    return found


def global_scale(src: nvfp4.Nvfp4Source, tensors: dict, m: str) -> nv.GlobalScale:
    return nv.GlobalScale(float(tensors[f"{m}.{src.global_suffix}"].reshape(())), src.divide)


DATA = os.path.join(str(support.DATA), "auto-round")
SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4A16)


def _load(name: str) -> tuple[dict, dict]:
    root = os.path.join(DATA, name)
    with open(os.path.join(root, "config.json")) as f:
        return json.load(f), load_file(os.path.join(root, "model.safetensors"))


def ct_values(t: dict, m: str) -> torch.Tensor:
    """compressed-tensors' own NVFP4 decode of module ``m``, as ``NVFP4PackedCompressor.decompress`` does it
    (``unpack_fp4_from_uint8``, ``dequantize`` with the global scale) but in float32, not bf16."""
    packed = t[f"{m}.weight_packed"]
    x_q = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    return dequantize(x_q=x_q, scale=t[f"{m}.weight_scale"].float(), args=SCHEME.weights,
                      global_scale=t[f"{m}.weight_global_scale"], dtype=torch.float32)


# ---------------------------------------------------------------- the search

def _groups(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random NVFP4 groups plus adversarial ones: zero, one value, all equal, all at -6 (-8 reachable),
    -0 codes, block scales 448 beside a subnormal, both subnormal, nearly equal."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, 2, generator=g) * 400 + 0.01).to(torch.float8_e4m3fn)
    packed[0] = 0
    packed[1] = 0
    packed[1, 3] = 0x70
    packed[2], packed[3], packed[4], packed[5] = 0x77, 0xFF, 0x9F, 0x88
    scales[6] = torch.tensor([448.0, 2.0 ** -9])
    scales[7] = torch.tensor([2.0 ** -9, 2.0 ** -8])
    scales[8] = torch.tensor([1.0, 1.125])
    return packed, scales


@pytest.mark.parametrize("gscale", [nv.GlobalScale(1703.2871, True), nv.GlobalScale(3.7e-4, False),
                                    nv.GlobalScale(1.0, False)], ids=["ct-divide", "modelopt-multiply", "unit"])
def test_sweep_equals_the_exhaustive_search(gscale):
    """Every group's error equals the least over all 32,512 positive normal bf16 scales; zero groups get 0."""
    packed, scales = _groups(40, 3)
    v = nv.decode(packed, scales, gscale).reshape(-1, 32)
    got = nv.optimal(v, nv.search(packed, scales, gscale))
    best, _ = nv.brute_force(v)
    assert not ((got.err2 - best).abs() > 1e-12 * best + 1e-300).any()
    assert got.scale[0] == 0 and not got.q[0].any() and not got.out_of_range.any()


def test_the_search_can_fail():
    """The comparison above discriminates: the server's RTN rule, a coarser candidate set (powers of two
    times amax/7.5 only), and a search without code -8 each lose on some group."""
    packed, scales = _groups(40, 4)
    v = nv.decode(packed, scales, nv.GlobalScale(1.0, False)).reshape(-1, 32)
    best, _ = nv.brute_force(v)
    assert (nv.server_rule(v).err2 > best * (1 + 1e-9)).any()
    amax = v.abs().amax(1)
    coarse = (amax / 7.5).to(torch.bfloat16).double()
    q = nv.quantize(v, coarse)
    assert (((q.double() * coarse.unsqueeze(1) - v) ** 2).sum(1) > best * (1 + 1e-9)).any()
    pm7, _ = nv.brute_force(v, qmin=-7)
    assert (pm7 > best * (1 + 1e-9)).any()


def test_pack_int4_is_compressed_tensors_layout():
    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8)
    words = nv.pack_int4(q)
    assert words.dtype == torch.int32 and torch.equal(ct_int4_q(words, torch.tensor([6, 64])), q)


# ---------------------------------------------------------------- the layouts

def test_compressed_tensors_layout_decodes_as_compressed_tensors_does():
    """auto-round's llm_compressor export (nvfp4-pack-quantized): the config selects exactly the packed
    linears (attention and experts; the router and head stay bf16), and every value is
    compressed-tensors' decode (which rounds scale / global to fp32) to 1e-6; nibbles swapped it is not."""
    config, t = _load("nvfp4-llm-compressor")
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    src = nvfp4.read(config, "config.json", drop=True)
    mods = modules(src, t)
    assert len(mods) == 10 and all(("experts" in m) or ("self_attn" in m) for m in mods)
    for m in mods:
        ours = nv.decode(t[f"{m}.weight_packed"], t[f"{m}.weight_scale"], global_scale(src, t, m))
        ref = ct_values(t, m).double()
        assert torch.allclose(ours, ref, rtol=1e-6, atol=0), m
        swapped = (t[f"{m}.weight_packed"] >> 4) | (t[f"{m}.weight_packed"] << 4)
        wrong = nv.decode(swapped, t[f"{m}.weight_scale"], global_scale(src, t, m))
        assert float((wrong - ref).norm() / ref.norm()) > 0.3, m


def test_auto_rounds_own_format_reads_the_same_values():
    """auto-round's format (quant_method auto-round, data_type nv_fp) holds the same tensors: same modules,
    same values as its llm_compressor export of the same model."""
    ca, ta = _load("nvfp4")
    cb, tb = _load("nvfp4-llm-compressor")
    assert ca["quantization_config"]["quant_method"] == "auto-round" and ca["quantization_config"]["data_type"] == "nv_fp"
    a, b = nvfp4.read(ca, "config.json", drop=True), nvfp4.read(cb, "config.json", drop=True)
    assert a.layout is nvfp4.Layout.AUTO_ROUND and modules(a, ta) == modules(b, tb)
    for m in modules(a, ta):
        va = nv.decode(ta[f"{m}.weight_packed"], ta[f"{m}.weight_scale"], global_scale(a, ta, m))
        assert torch.allclose(va, ct_values(ta, m).double(), rtol=1e-6, atol=0), m


MODELOPT_NAMES = {"weight_packed": "weight", "weight_global_scale": "weight_scale_2",
                  "input_global_scale": "input_scale"}


def to_modelopt(t: dict) -> dict:
    """compressed-tensors NVFP4 tensors under ModelOpt's names, its FP32 scales inverted (ModelOpt
    multiplies by them): the inverse of compressed-tensors' ModelOptNvfp4Converter.process."""
    out = {}
    for n, x in t.items():
        m, _, p = n.rpartition(".")
        if p in MODELOPT_NAMES:
            out[f"{m}.{MODELOPT_NAMES[p]}"] = x if p == "weight_packed" else (1 / x).reshape(())
        else:
            out[n] = x
    return out


def modelopt_checkpoint() -> tuple[dict, dict]:
    """The llm_compressor export in ModelOpt's layout: X.weight (U8), X.weight_scale, X.weight_scale_2 =
    1 / weight_global_scale, X.input_scale = 1 / input_global_scale (the inverse of compressed-tensors'
    ModelOptNvfp4Converter.process)."""
    _, t = _load("nvfp4-llm-compressor")
    out = to_modelopt(t)
    config = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "exclude_modules": ["lm_head", "*block_sparse_moe.gate"]}}
    return config, out


def test_modelopt_layout_decodes_as_compressed_tensors_converter_reads_it():
    """ModelOpt multiplies by weight_scale_2: our values equal compressed-tensors' decode of what its own
    ModelOpt converter makes of the checkpoint (1e-6: its 1/x and fp32 rounding); dividing instead is
    far off."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    config, t = modelopt_checkpoint()
    src = nvfp4.read(config, "config.json", drop=True)
    assert src.layout is nvfp4.Layout.MODELOPT and not src.divide
    mods = modules(src, t)
    assert len(mods) == 10
    ct = ModelOptNvfp4Converter(ignore=["lm_head", "re:.*block_sparse_moe\\.gate$"], targets=["Linear"]).process(dict(t))
    for m in mods:
        ours = nv.decode(t[f"{m}.weight"], t[f"{m}.weight_scale"], global_scale(src, t, m))
        ref = ct_values({k: v.reshape(1) if k.endswith("global_scale") else v for k, v in ct.items()}, m).double()
        assert torch.allclose(ours, ref, rtol=1e-6, atol=0), m
        wrong = nv.decode(t[f"{m}.weight"], t[f"{m}.weight_scale"], nv.GlobalScale(global_scale(src, t, m).value, True))
        assert float((wrong - ref).norm() / ref.norm()) > 0.3, m


# ---------------------------------------------------------------- a module converted

def test_module_is_optimal_and_beats_the_server_rule():
    """Each module's int4 (read back by compressed-tensors' unpack_from_int32) is the least-squares int4
    of the NVFP4 values: every group against verify's search, the first 16 against the exhaustive one;
    its total error is below the server's RTN rule's."""
    config, t = _load("nvfp4-llm-compressor")
    src = nvfp4.read(config, "config.json", drop=True)
    for m in modules(src, t)[:3]:
        packed, scales, gs = t[f"{m}.weight_packed"], t[f"{m}.weight_scale"], global_scale(src, t, m)
        r = nv.requantize_module(packed, scales, gs)
        rows, cols = packed.shape[0], packed.shape[1] * 2
        q = ct_int4_q(r.words, torch.tensor([rows, cols])).double()
        got = (q * r.scales.double().repeat_interleave(32, dim=1)).reshape(-1, 32)
        v = nv.decode(packed, scales, gs).reshape(-1, 32)
        err = ((got - v) ** 2).sum(1)
        assert abs(float(err.sum()) - r.err2) <= 1e-9 * r.err2
        best, _ = nv.brute_force(v[:16])
        assert not ((err[:16] - best).abs() > 1e-12 * best + 1e-300).any(), m
        best = brute_force_min(v)   # verify's pruned search (bf16 scales in [a/16, 2a]), every group
        assert not ((err - best).abs() > 1e-12 * best + 1e-300).any(), m
        assert 0 < r.err2 < r.server_err2 and r.out_of_range == 0


# ---------------------------------------------------------------- refusals

def test_w4a4_needs_the_flag():
    for name in ("nvfp4", "nvfp4-llm-compressor"):
        with pytest.raises(BadInput, match="input activations.*--drop-activation-quant"):
            nvfp4.read(_load(name)[0], "config.json")
    with pytest.raises(BadInput, match="input activations.*--drop-activation-quant"):
        nvfp4.read(modelopt_checkpoint()[0], "config.json")


def test_a_packed_module_the_config_ignores_is_refused():
    config, t = _load("nvfp4-llm-compressor")
    m = "model.layers.0.self_attn.q_proj"
    config["quantization_config"]["ignore"].append(m)
    with pytest.raises(BadInput, match=f"does not select {m}"):
        modules(nvfp4.read(config, "config.json", drop=True), t)


@pytest.mark.parametrize("edit, needle", [
    (lambda t, m: t.__setitem__(f"{m}.weight_scale", t[f"{m}.weight_scale"].float()), "expected F8_E4M3"),
    (lambda t, m: t.__setitem__(f"{m}.weight_global_scale", torch.tensor([float("inf")])), "finite positive"),
    (lambda t, m: t.pop(f"{m}.weight_global_scale"), "needs weight_scale and weight_global_scale"),
    (lambda t, m: t.__setitem__(f"{m}.weight_scale", torch.full_like(t[f"{m}.weight_scale"].float(), float("nan"))
                                .to(torch.float8_e4m3fn)), "NaN or negative"),
])
def test_bad_tensors_are_named(edit, needle):
    config, t = _load("nvfp4-llm-compressor")
    m = "model.layers.0.self_attn.o_proj"
    edit(t, m)
    with pytest.raises(BadInput, match=needle) as e:
        modules(nvfp4.read(config, "config.json", drop=True), t)
    assert m in str(e.value)


def test_mxfp4_groups_beside_nvfp4_are_refused():
    config, _ = _load("nvfp4-llm-compressor")
    g = config["quantization_config"]["config_groups"]
    g["group_1"] = {**g["group_0"], "format": "mxfp4-pack-quantized", "targets": ["re:.*o_proj"],
                    "weights": {**g["group_0"]["weights"], "group_size": 32}}
    with pytest.raises(BadInput, match="group_1 is not nvfp4-pack-quantized"):
        nvfp4.read(config, "config.json", drop=True)


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-llm-compressor"])
def test_mxfp4_to_int4_converts_auto_rounds_nvfp4_exports(tmp_path, name):
    """auto-round's own exports (either format; W4A4, so with the flag) convert and verify against the
    source: every packed linear at requantize_module's bytes, the manifest naming the writer's NVFP4.
    (Before, the command refused NVFP4 checkpoints in one line.)"""
    from converter.verify import verify
    from tests.conftest import all_tensors, read_json, run_cli
    src, dst = os.path.join(DATA, name), str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--drop-activation-quant", "--progress", "none")
    assert r.exit_code == 0, (r.output, r.exception)
    assert read_json(os.path.join(dst, "k3convert_manifest.json"))["source_format"] == \
        ("auto-round NVFP4" if name == "nvfp4" else "compressed-tensors NVFP4")
    config, t = _load(name)
    out = all_tensors(dst)
    src_nv = nvfp4.read(config, "config.json", drop=True)
    mods = modules(src_nv, t)
    assert len(mods) == 10
    for m in mods:
        res = nv.requantize_module(t[f"{m}.weight_packed"], t[f"{m}.weight_scale"], global_scale(src_nv, t, m))
        assert torch.equal(out[f"{m}.weight_packed"][1], res.words) and torch.equal(out[f"{m}.weight_scale"][1],
                                                                                      res.scales), m
    assert not any(n.endswith(("global_scale", "input_global_scale")) for n in out)
    result = verify(dst, src, sample=None)
    assert result.ok, [(c.name, c.problems) for c in result.checks if not c.ok]


def test_inspect_describes_auto_rounds_own_format_as_the_conversion_reads_it():
    """Its block has no compressed-tensors ``format``: inspect shows what states it (before: "auto-round / None
    (-)"), and the format line and module count are the reader's (``MXFP4Source.source_format``, ``packs``)."""
    from tests.conftest import run_cli

    for name, fp4, data in (("nvfp4", "NVFP4", "nv_fp"), ("mxfp4", "MXFP4", "mx_fp")):
        r = run_cli("inspect", os.path.join(DATA, name))
        assert r.exit_code == 0, r.output
        assert f"{fp4} source (auto-round): k3convert converts this" in r.output
        assert f"auto-round / auto_round:llm_compressor (bits=4, data_type={data}, group_size=" in r.output
        assert "quantized modules (weight_packed): 10" in r.output
