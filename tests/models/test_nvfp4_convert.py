"""`mxfp4-to-int4` on NVFP4 MoE sources, end to end (issue 35 §3, docs/nvfp4.md).

The source is a tiny Mixtral-shaped MoE whose experts are NVFP4, quantized and packed by
compressed-tensors' own ``NVFP4PackedCompressor`` (global scale by its ``generate_gparam``); the ModelOpt
source holds the same bytes under ModelOpt's names (``weight``, ``weight_scale``, ``weight_scale_2`` = 1 /
global). Outputs are decoded by compressed-tensors' own pack-quantized decompressor, driven by the
scheme it parses from the output config.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from compressed_tensors.compressors import NVFP4PackedCompressor, PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import NVFP4A16
from compressed_tensors.quantization.utils.helpers import generate_gparam
from safetensors.torch import save_file

from converter.quant import nvfp4_requant as nv
from converter.state.records import read_rows
from converter.verify import verify
from tests.conftest import (
    INDEX,
    MANIFEST,
    REPORT,
    TABLE,
    all_tensors,
    assert_clean_error,
    assert_not_complete,
    ct_int4_q,
    heavy_tailed,
    read_json,
    run_cli,
    tensor_bytes,
    tree_hash,
    write_json,
)
from tests.formats.test_nvfp4 import to_modelopt

HIDDEN, INTER, EXPERTS, LAYERS, VOCAB = 64, 96, 4, 2, 32
SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4A16)
EXPERT_RE = r"re:.*experts\.\d+\.(w1|w2|w3)$"
EXPERTS_OF = [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}"
              for i in range(LAYERS) for e in range(EXPERTS) for w in ("w1", "w2", "w3")]
STRADDLED = "model.layers.1.block_sparse_moe.experts.0.w2"   # its two scales sit in the other shard
MODELOPT_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                   "exclude_modules": ["lm_head", "*self_attn*", "*block_sparse_moe.gate"]}


def ct_nvfp4_encode(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """float [out, in] -> weight_packed U8, weight_scale E4M3, weight_global_scale F32 by compressed-tensors:
    the global scale is ``generate_gparam`` (448 * 6 / amax), each block's scale amax * global / 6 in E4M3."""
    gs = generate_gparam(-w.abs().max().reshape(1), w.abs().max().reshape(1))
    amax = w.reshape(w.shape[0], -1, 16).abs().amax(-1)
    scale = (amax * gs / 6).clamp(min=2.0 ** -9).to(torch.float8_e4m3fn)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale.float(), "weight_global_scale": gs},
                                        SCHEME)
    return {k: sd[k] for k in ("weight_packed", "weight_scale", "weight_global_scale")}


def _config(quant: dict) -> dict:
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
            "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
            "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": VOCAB, "quantization_config": quant}


def _ct_quant(w4a4: bool) -> dict:
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
               "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    inputs = {**weights, "dynamic": "local", "observer": "static_minmax"} if w4a4 else None
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": [EXPERT_RE], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": "nvfp4-pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def _tensors(w4a4: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(35)
    t = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN).bfloat16(),
         "model.norm.weight": torch.ones(HIDDEN).bfloat16(), "lm_head.weight": torch.randn(VOCAB, HIDDEN).bfloat16()}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
        for proj, rows in (("q_proj", HIDDEN), ("k_proj", 32), ("v_proj", 32), ("o_proj", HIDDEN)):
            t[f"{p}.self_attn.{proj}.weight"] = heavy_tailed(rows, HIDDEN).bfloat16()
        t[f"{p}.block_sparse_moe.gate.weight"] = heavy_tailed(EXPERTS, HIDDEN).bfloat16()
    for m in EXPERTS_OF:
        shape = (HIDDEN, INTER) if m.endswith("w2") else (INTER, HIDDEN)
        t.update({f"{m}.{k}": v for k, v in ct_nvfp4_encode(heavy_tailed(*shape)).items()})
        if w4a4:
            t[f"{m}.input_global_scale"] = torch.tensor([1234.5])
    return t


def write_source(root: str, tensors: dict[str, torch.Tensor], quant: dict) -> str:
    """Two shards (layer 0 and the embedding; the rest), one module's scales in the other shard."""
    os.makedirs(root)
    first = {n for n in tensors if n.startswith(("model.layers.0.", "model.embed_tokens"))
             or n.startswith(STRADDLED) and not n.endswith(("weight_packed", ".weight"))}
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if n in first},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in first}}
    for name, part in shards.items():
        save_file(part, os.path.join(root, name), metadata={"format": "pt"})
    write_json(os.path.join(root, INDEX), {"metadata": {}, "weight_map": {n: s for s, p in shards.items() for n in p}})
    write_json(os.path.join(root, "config.json"), _config(quant))
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("nvfp4")
    t = _tensors()
    out = {"compressed-tensors": write_source(str(base / "ct"), t, _ct_quant(False)),
           "modelopt": write_source(str(base / "modelopt"), to_modelopt(t), MODELOPT_CONFIG)}
    for root in out.values():
        write_json(os.path.join(root, "tokenizer_config.json"), {"model_max_length": 256})
    # ModelOpt's exporter states the quantization again beside config.json
    write_json(os.path.join(out["modelopt"], "hf_quant_config.json"),
               {"producer": {"name": "modelopt"},
                "quantization": {k: v for k, v in MODELOPT_CONFIG.items() if k != "quant_method"}})
    return out


FLAGS = {"compressed-tensors": (), "modelopt": ("--drop-activation-quant",)}   # ModelOpt NVFP4 is W4A4
NAMES = {"compressed-tensors": ("weight_packed", "weight_global_scale", True),
         "modelopt": ("weight", "weight_scale_2", False)}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, str]:
    out = {}
    for layout, src in sources.items():
        dst = str(tmp_path_factory.mktemp("out") / layout)
        r = run_cli("mxfp4-to-int4", src, "-o", dst, *FLAGS[layout])
        assert r.exit_code == 0, (r.output, r.exception)
        out[layout] = dst
    return out


def _scheme(dst: str):
    qc = QuantizationConfig.model_validate(read_json(os.path.join(dst, "config.json"))["quantization_config"])
    assert list(qc.config_groups) == ["group_0"]
    return qc.config_groups["group_0"]


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_output_is_requantize_module_read_by_compressed_tensors(layout, sources, converted):
    """Every expert: compressed-tensors' pack-quantized decompressor gives exactly our int4 values times the
    bf16 scales, the bytes are ``requantize_module``'s on the source tensors, and the table's relative RMSE
    (against the FP4 values) and the server rule's are its figures."""
    src, dst = all_tensors(sources[layout]), all_tensors(converted[layout])
    packed_name, global_name, divide = NAMES[layout]
    assert src[f"{STRADDLED}.{packed_name}"][0] != src[f"{STRADDLED}.weight_scale"][0]   # read across shards
    scheme = _scheme(converted[layout])
    rows = {r["name"]: r for r in read_rows(os.path.join(converted[layout], TABLE))}
    assert len(rows) == len(EXPERTS_OF)
    for m in EXPERTS_OF:
        packed, scale, shape = (dst[f"{m}.{k}"][1] for k in ("weight_packed", "weight_scale", "weight_shape"))
        ours = ct_int4_q(packed, shape).double() * scale.double().repeat_interleave(32, dim=1)
        sd = {"weight_packed": packed, "weight_scale": scale.float(), "weight_shape": shape}
        assert torch.equal(PackedQuantizationCompressor.decompress(sd, scheme)["weight"].double(), ours), m
        gs = nv.GlobalScale(float(src[f"{m}.{global_name}"][1].reshape(())), divide)
        r = nv.requantize_module(src[f"{m}.{packed_name}"][1], src[f"{m}.weight_scale"][1], gs)
        assert torch.equal(packed, r.words) and torch.equal(scale, r.scales), m
        fp4 = nv.decode(src[f"{m}.{packed_name}"][1], src[f"{m}.weight_scale"][1], gs)
        err2 = float(((ours - fp4) ** 2).sum())
        assert abs(err2 - r.err2) <= 1e-9 * r.err2, m
        row = rows[f"{m}.weight_packed"]
        assert row["rel_rmse"] == pytest.approx(math.sqrt(err2 / float((fp4 ** 2).sum())), rel=1e-9)
        assert row["cmp_rel_rmse"] == pytest.approx(math.sqrt(r.server_err2 / r.ref2), rel=1e-12)
        assert 0 < row["rel_rmse"] < row["cmp_rel_rmse"] < 0.2, m
    manifest = read_json(os.path.join(converted[layout], MANIFEST))
    assert manifest["source_format"] == {"compressed-tensors": "compressed-tensors NVFP4",
                                         "modelopt": "ModelOpt NVFP4"}[layout]
    assert read_json(os.path.join(converted[layout], REPORT))["source_format"] == manifest["source_format"]


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_every_other_tensor_byte_identical_and_the_scales_consumed(layout, sources, converted):
    src, dst = all_tensors(sources[layout]), all_tensors(converted[layout])
    experts = tuple(f"{m}." for m in EXPERTS_OF)
    kept = {n for n in src if not n.startswith(experts)}
    assert kept and {n for n in dst if not n.startswith(experts)} == kept
    for n in kept:
        assert tensor_bytes(dst[n][1]) == tensor_bytes(src[n][1]) and dst[n][1].dtype == src[n][1].dtype, n
    assert {n.rsplit(".", 1)[1] for n in dst if n.startswith(experts)} == {"weight_packed", "weight_scale",
                                                                           "weight_shape"}
    config = read_json(os.path.join(converted[layout], "config.json"))["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["num_bits"] == 4 and config["format"] == "pack-quantized"


def test_modelopt_and_compressed_tensors_agree(converted):
    """The same bytes in either layout give the same int4 model, up to the global scale's 1/x in FP32."""
    a, b = all_tensors(converted["compressed-tensors"]), all_tensors(converted["modelopt"])
    for m in EXPERTS_OF:
        va, vb = ((ct_int4_q(t[f"{m}.weight_packed"][1], t[f"{m}.weight_shape"][1]).double()
                   * t[f"{m}.weight_scale"][1].double().repeat_interleave(32, dim=1)) for t in (a, b))
        assert float((va - vb).norm() / va.norm()) < 1e-2, m


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_verify_source_passes_and_a_flipped_word_fails(layout, sources, converted, tmp_path):
    r = verify(converted[layout], sources[layout], sample=None)
    assert r.ok, [(c.name, c.problems) for c in r.checks if not c.ok]
    assert run_cli("verify", converted[layout], "--serving", "vllm-rocm").exit_code == 0   # the same int4 layout
    assert r.check("re-decode").summary.startswith(f"{len(EXPERTS_OF)} of {len(EXPERTS_OF)}")
    assert int(r.check("optimality").summary.split()[0]) > 0   # sampled groups held to the brute force
    # and every group to the conversion's own search (issue 42 §3)
    assert r.check("optimality").summary.endswith("at the search's optimum (kernels.nvfp4_searcher, cpu)")
    dst = str(tmp_path / "dst")
    shutil.copytree(converted[layout], dst)
    m = EXPERTS_OF[5]
    shard = read_json(os.path.join(dst, INDEX))["weight_map"][f"{m}.weight_packed"]
    path = os.path.join(dst, shard)
    with open(path, "rb") as f:
        (n,) = __import__("struct").unpack("<Q", f.read(8))
        start = 8 + n + json.loads(f.read(n))[f"{m}.weight_packed"]["data_offsets"][0]
    with open(path, "r+b") as f:   # one nibble of one word, moved by one code
        f.seek(start)
        b = f.read(1)[0]
        f.seek(start)
        f.write(bytes([(b & 0xF0) | ((b & 0x0F) ^ 1)]))
    r = verify(dst, sources[layout], sample=None, checksums=False)
    failed = {c.name for c in r.checks if not c.ok}
    assert "re-decode" in failed and any(m in p for p in r.check("re-decode").problems)
    # the word's group is sampled (group 0 of one of the first 8 tensors) and now beaten by brute force
    assert "optimality" in failed and any(f"{m}: group 0 " in p for p in r.check("optimality").problems)
    assert any(f"{m}: 1 of " in p and "differ from the search's optimum" in p for p in r.check("optimality").problems)


def test_verify_holds_the_manifest_to_the_sources_own_format(converted, tmp_path):
    """source_format says NVFP4 and the writer; an MXFP4 claim for the same source fails the manifest check."""
    dst = str(tmp_path / "dst")
    shutil.copytree(converted["modelopt"], dst)
    path = os.path.join(dst, MANIFEST)
    manifest = read_json(path)
    assert manifest["source"]["quantization"]["dialect"] == "nvfp4"
    write_json(path, {**manifest, "source_format": "nvfp4 MXFP4"})
    r = verify(dst, None, checksums=False)
    assert "expected 'ModelOpt NVFP4'" in " ".join(r.check("manifest").problems)


def test_w4a4_is_refused_without_the_flag_and_its_input_scales_dropped_with_it(tmp_path):
    src = write_source(str(tmp_path / "src"), _tensors(w4a4=True), _ct_quant(True))
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none")
    assert_clean_error(r, "input activations", "--drop-activation-quant", code=2)
    assert_not_complete(dst)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--drop-activation-quant")
    assert r.exit_code == 0, (r.output, r.exception)
    names = set(read_json(os.path.join(dst, INDEX))["weight_map"])
    assert not any(n.endswith("input_global_scale") for n in names)
    assert read_json(os.path.join(dst, "config.json"))["quantization_config"]["config_groups"]["group_0"][
        "input_activations"] is None


def _tiny_scales(t: dict, m: str) -> None:
    """Block scales at E4M3's least subnormal under a global scale of 3e38: every value is below bf16's
    normal range, so no bf16 scale can hold the group."""
    t[f"{m}.weight_scale"] = torch.full_like(t[f"{m}.weight_scale"].float(), 2.0 ** -9).to(torch.float8_e4m3fn)
    t[f"{m}.weight_global_scale"] = torch.tensor([3e38])


def _nan_scale(t: dict, m: str) -> None:
    s = t[f"{m}.weight_scale"].clone()
    s.view(torch.uint8)[3, 1] = 0x7F   # E4M3 NaN
    t[f"{m}.weight_scale"] = s


@pytest.mark.parametrize("edit, tensor, needle", [
    (_tiny_scales, "weight_scale", "outside bf16"),
    (_nan_scale, "weight_scale", "block 1 of row 3: a NaN or negative E4M3 scale"),
    (lambda t, m: t.__setitem__(f"{m}.weight_global_scale", torch.tensor([float("inf")])), "weight_global_scale",
     "finite positive"),
    # before: a packed tensor that is not U8 was passed over, then copied through as data beside its scales
    (lambda t, m: t.__setitem__(f"{m}.weight_packed", t[f"{m}.weight_packed"].view(torch.int8)), "weight_packed",
     "expected U8 packed E2M1 codes, got I8"),
], ids=["outside-bf16", "nan-block-scale", "inf-global", "packed-not-u8"])
def test_bad_values_are_one_line_naming_file_and_tensor(tmp_path, edit, tensor, needle):
    """Found from the headers, or as the module is read or requantized: refused in one line, the shard not
    written, nothing complete."""
    t = _tensors()
    m = "model.layers.1.block_sparse_moe.experts.2.w3"
    edit(t, m)
    src = write_source(str(tmp_path / "src"), t, _ct_quant(False))
    dst, before = str(tmp_path / "dst"), tree_hash(src)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--workers", "1")
    assert_clean_error(r, "model-00002-of-00002.safetensors", f"tensor {m}.{tensor}:", needle, code=2)
    assert_not_complete(dst)
    assert not os.path.exists(os.path.join(dst, "model-00002-of-00002.safetensors")) and tree_hash(src) == before


def test_another_scale_rule_is_refused(sources, tmp_path):
    """At the edge, before DST is made: the dry run and the run alike."""
    for dry in ((), ("--dry-run",)):
        r = run_cli("mxfp4-to-int4", sources["compressed-tensors"], "-o", str(tmp_path / "dst"), "--scale-rule",
                    "vllm-gfx942", "--progress", "none", *dry)
        assert_clean_error(r, "--scale-rule vllm-gfx942", "NVFP4", code=2)
        assert not os.path.exists(tmp_path / "dst")


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_side_files_copied_but_not_modelopts_restated_quantization(layout, sources, converted):
    """hf_quant_config.json describes the NVFP4 weights: copied, it would contradict config.json's int4
    block (DST's one description of its quantization); every other side file is copied."""
    assert os.path.exists(os.path.join(converted[layout], "tokenizer_config.json"))
    assert not os.path.exists(os.path.join(converted[layout], "hf_quant_config.json"))
    assert os.path.exists(os.path.join(sources["modelopt"], "hf_quant_config.json"))   # the source keeps it


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_inspect_names_an_nvfp4_source_and_what_converting_reads(layout, sources):
    r = run_cli("inspect", sources[layout])
    assert r.exit_code == 0, r.output
    who = {"compressed-tensors": "compressed-tensors", "modelopt": "ModelOpt"}[layout]
    assert f"NVFP4 source ({who}): k3convert converts this" in r.output
    n = len(EXPERTS_OF)
    assert f"{n} NVFP4 matrices to convert ({3 * n} source tensors)" in r.output   # packed, E4M3, FP32 each
    # counted as the conversion pairs them (before: "quantized modules (weight_packed): 0" for ModelOpt)
    assert f"quantized modules ({NAMES[layout][0]}): {n}" in r.output
    block = {"compressed-tensors": "quantization_config: compressed-tensors / nvfp4-pack-quantized",
             "modelopt": "quantization_config: modelopt / NVFP4 (group_size=16); 3 ignore pattern(s)"}[layout]
    assert block in r.output, r.output


def test_a_modelopt_config_stated_twice_is_replaced_everywhere(sources, tmp_path):
    """issue 40 H9: ModelOpt's statement at top level and in text_config (as a multimodal config nests it).
    Both are read, and both become the int4 block: before, text_config still said NVFP4 over int4 tensors
    (exit 0, then verify's config check failed)."""
    from converter.formats.checkpoint import quant_blocks
    from converter.verify import int4_block_problems

    src = str(tmp_path / "src")
    shutil.copytree(sources["modelopt"], src)
    config = read_json(os.path.join(src, "config.json"))
    config["text_config"] = {"model_type": "mixtral", "hidden_act": "silu",
                             "quantization_config": {**MODELOPT_CONFIG, "exclude_modules": ["lm_head", "*self_attn*"]}}
    write_json(os.path.join(src, "config.json"), config)
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--drop-activation-quant", "--progress", "none")
    assert r.exit_code == 0, (r.output, r.exception)
    out = read_json(os.path.join(dst, "config.json"))
    blocks = quant_blocks(out)
    assert [p for p, _ in blocks] == [("quantization_config",), ("text_config", "quantization_config")]
    assert all(not int4_block_problems(b) for _, b in blocks), blocks
    assert blocks[0][1] == blocks[1][1]
    assert [d["where"] for d in read_json(os.path.join(dst, MANIFEST))["source"]["quantization"]["dropped"]] == \
        ["quantization_config.quant_algo", "text_config.quantization_config.quant_algo"]
    res = verify(dst, src, sample=None)
    assert res.ok, [(c.name, c.problems) for c in res.checks if not c.ok]


def _modelopt_027(sources, root: str, statement: dict | str | None = None) -> str:
    """The ModelOpt source as ModelOpt <= 0.27 writes it: no quantization_config in config.json, the
    statement only in hf_quant_config.json (``statement``: that file's ``quantization`` object, or its text)."""
    shutil.copytree(sources["modelopt"], root)
    config = read_json(os.path.join(root, "config.json"))
    del config["quantization_config"]
    write_json(os.path.join(root, "config.json"), config)
    q = statement if statement is not None else {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                                 "exclude_modules": MODELOPT_CONFIG["exclude_modules"]}
    path = os.path.join(root, "hf_quant_config.json")
    if isinstance(q, str):
        with open(path, "w") as f:
            f.write(q)
    else:
        write_json(path, {"producer": {"name": "modelopt", "version": "0.27.1"}, "quantization": q})
    return root


def test_modelopt_stated_only_in_hf_quant_config_converts_as_config_json_stated(sources, converted, tmp_path):
    """ModelOpt <= 0.27 (NVIDIA's published FP4 checkpoints): hf_quant_config.json is the statement. The
    output is the 0.47-style source's, tensor for tensor and config for config: config.json states
    compressed-tensors int4 at top level, and hf_quant_config.json is not carried (it would say NVFP4 over
    int4 weights). Before: "no quantization_config ...: not an MXFP4 checkpoint"."""
    src = _modelopt_027(sources, str(tmp_path / "src"))
    r = run_cli("inspect", src)
    assert r.exit_code == 0, r.output
    assert "NVFP4 source (ModelOpt, stated in hf_quant_config.json): k3convert converts this" in r.output
    assert f"quantized modules (weight): {len(EXPERTS_OF)}" in r.output   # ModelOpt's packed U8 X.weight
    assert "quantization: hf_quant_config.json: modelopt / NVFP4" in r.output
    assert f"{len(EXPERTS_OF)} NVFP4 matrices to convert" in r.output
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--drop-activation-quant", "--progress", "none")
    assert r.exit_code == 0, (r.output, r.exception)
    a, b = all_tensors(converted["modelopt"]), all_tensors(dst)
    assert set(a) == set(b) and all(tensor_bytes(a[n][1]) == tensor_bytes(b[n][1]) for n in a)
    want = read_json(os.path.join(converted["modelopt"], "config.json"))
    assert read_json(os.path.join(dst, "config.json")) == want
    assert want["quantization_config"]["quant_method"] == "compressed-tensors"
    assert not os.path.exists(os.path.join(dst, "hf_quant_config.json"))
    assert os.path.exists(os.path.join(dst, "tokenizer_config.json"))
    res = verify(dst, src, sample=None)
    assert res.ok, [(c.name, c.problems) for c in res.checks if not c.ok]


@pytest.mark.parametrize("statement, needle", [
    ({"quant_algo": "FP8", "group_size": 16}, "quant_algo is \"FP8\""),
    ({"quant_algo": "NVFP4", "group_size": 32}, "group 32: only ModelOpt NVFP4 (group 16)"),
    ({"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": "lm_head"}, "exclude_modules is \"lm_head\""),
    ([], "no 'quantization' object"),
    ("{not json", "not valid JSON"),
], ids=["fp8", "group-32", "exclude-not-a-list", "no-quantization", "not-json"])
def test_an_hf_quant_config_that_cannot_mean_nvfp4_is_refused_naming_it(sources, tmp_path, statement, needle):
    """One line naming hf_quant_config.json, exit 2, DST not made; inspect says the same."""
    src = _modelopt_027(sources, str(tmp_path / "src"), statement if not isinstance(statement, list) else None)
    if isinstance(statement, list):   # the file holds no quantization object at all
        write_json(os.path.join(src, "hf_quant_config.json"), {"producer": {"name": "modelopt"}})
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--drop-activation-quant", "--progress", "none")
    assert_clean_error(r, "hf_quant_config.json", needle, code=2)
    assert not os.path.exists(dst)
    r = run_cli("inspect", src)
    assert "k3convert refuses it" in r.output and "hf_quant_config.json" in r.output and needle in r.output, r.output


def test_a_changed_hf_quant_config_is_a_changed_source(sources, tmp_path):
    """The file that states the quantization is part of what DST is a conversion of: a rerun (a resume, a
    job part) after it changed is refused naming it, as for config.json."""
    src = _modelopt_027(sources, str(tmp_path / "src"))
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--drop-activation-quant", "--progress", "none", "--shards", "1")
    assert r.exit_code == 0, (r.output, r.exception)
    statement = read_json(os.path.join(src, "hf_quant_config.json"))
    statement["quantization"]["exclude_modules"].append("*vision_tower*")   # selects the same modules
    write_json(os.path.join(src, "hf_quant_config.json"), statement)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--drop-activation-quant", "--progress", "none")
    assert r.exit_code != 0 and "hf_quant_config.json" in r.stderr, r.stderr


@pytest.mark.parametrize("batch_groups", [HIDDEN * INTER // 32 - 1, HIDDEN * INTER // 32])
def test_modules_over_the_pooled_buffer_size_convert_the_same(batch_groups, sources, converted, tmp_path):
    """A module larger than a pooled buffer reads into and writes from buffers of its own; one that fits
    takes pooled ones, reused across the 24 modules: either way the same DST shards as the default run."""
    from converter.run.options import Options
    from converter.run.pipeline import convert

    dst = str(tmp_path / "out")
    convert(sources["compressed-tensors"], dst, Options(batch_groups=batch_groups))
    shards = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    assert shards and shards == sorted(n for n in os.listdir(converted["compressed-tensors"]) if n.endswith(".safetensors"))
    for n in shards:
        with open(os.path.join(dst, n), "rb") as a, open(os.path.join(converted["compressed-tensors"], n), "rb") as b:
            assert a.read() == b.read(), n
