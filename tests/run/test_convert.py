"""End-to-end conversion, checked with compressed-tensors and safetensors as the readers."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig

from converter.errors import OutputError, ThresholdExceeded
from converter.fixture import make_fixture
from converter.formats import int4
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.state.records import read_rows
from tests.conftest import (
    INDEX,
    MANIFEST,
    REPORT,
    SPEC,
    TABLE,
    all_tensors,
    assert_clean_error,
    chunked_sha256,
    ct_int4_q,
    ct_mxfp4_encode,
    ct_mxfp4_values,
    expert_modules,
    load_shard,
    raw_header,
    read_json,
    run_cli,
    sha256,
    shard_names,
    tensor_bytes,
    tree_hash,
    write_json,
)

SITU = ("hidden_act", "activation_situ_beta", "activation_situ_linear_beta")
SIDE_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json", "modeling_kimi_k3.py")


def _int4_scheme(config: dict):
    """The int4 scheme as compressed-tensors parses it from the converted config."""
    qc = QuantizationConfig.model_validate(config["text_config"]["quantization_config"])
    assert list(qc.config_groups) == ["group_0"]
    return qc.config_groups["group_0"]


def _pairs(converted):
    """(module, mxfp4 values float64, int4 q int8, int4 scale bf16, packed int32, shape) per expert."""
    src, dst = all_tensors(converted.src), all_tensors(converted.dst)
    for module in sorted(expert_modules(converted.src)):
        w_mx = ct_mxfp4_values(src[f"{module}.weight_packed"][1], src[f"{module}.weight_scale"][1])
        packed, scale, shape = (dst[f"{module}.{k}"][1] for k in ("weight_packed", "weight_scale", "weight_shape"))
        yield module, w_mx, ct_int4_q(packed, shape), scale, packed, shape


# ------------------------------------------------------------------ 1. numbers

def test_int4_decodes_identically_with_compressed_tensors(converted):
    scheme = _int4_scheme(read_json(os.path.join(converted.dst, "config.json")))
    n = 0
    for module, w_mx, q, scale, packed, shape in _pairs(converted):
        ours = int4.decode(packed, scale)  # float32, exact
        assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
        # compressed-tensors' unpack_from_int32 with the stored weight_shape, times the scale
        ct = q.double() * scale.double().repeat_interleave(32, dim=1)
        assert torch.equal(ct, ours.double()), module
        # compressed-tensors' own decompression path, driven by the scheme from our config.json
        sd = {"weight_packed": packed, "weight_scale": scale.float(), "weight_shape": shape}
        assert torch.equal(PackedQuantizationCompressor.decompress(sd, scheme)["weight"], ours), module
        sd["weight_scale"] = scale  # as stored (bf16): one rounding of the exact product
        assert torch.equal(PackedQuantizationCompressor.decompress(sd, scheme)["weight"], ours.bfloat16()), module
        # and it is a requantization of the source, not noise
        assert torch.isfinite(ours).all()
        assert float((ours.double() - w_mx).norm() / w_mx.norm()) < 0.2, module
        n += 1
    assert n == (SPEC.layers - 1) * SPEC.experts * 3


def _rtn_err2(w: torch.Tensor, divisor: float) -> torch.Tensor:
    """Per-group squared error of round-to-nearest with bf16 scale amax/divisor: [groups]."""
    g = w.reshape(-1, 32)
    s = (g.abs().amax(1, keepdim=True) / divisor).to(torch.bfloat16).double()
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)).clamp(-8, 7), 0.0)
    return ((q * s - g) ** 2).sum(1)


def test_error_figures_match_report_and_beat_rtn(converted):
    rows = {r["name"]: r for r in read_rows(os.path.join(converted.dst, TABLE))}
    report = read_json(os.path.join(converted.dst, REPORT))
    mine, per_layer = {}, {}
    tot_ours = tot_rtn = 0.0
    for module, w_mx, q, scale, _, _ in _pairs(converted):
        w_q = q.double() * scale.double().repeat_interleave(32, dim=1)
        diff2 = ((w_q - w_mx) ** 2).reshape(-1, 32).sum(1)
        ref2 = float((w_mx ** 2).sum())
        rel = math.sqrt(float(diff2.sum()) / ref2)
        row = rows[f"{module}.weight_packed"]
        assert row["rel_rmse"] == pytest.approx(rel, rel=1e-9), module
        assert row["max_abs"] == pytest.approx(float((w_q - w_mx).abs().max()), rel=1e-12), module
        assert row["snr_db"] == pytest.approx(-20 * math.log10(rel), rel=1e-9), module
        assert row["nonfinite"] == 0
        # optimal per group over bf16 scales, so never worse than RTN with any bf16 scale
        for divisor in (7.5, 7.0, 8.0):
            rtn = _rtn_err2(w_mx, divisor)
            assert bool((diff2 <= rtn * (1 + 1e-12)).all()), (module, divisor)
        rtn75 = float(_rtn_err2(w_mx, 7.5).sum())
        assert rel < math.sqrt(rtn75 / ref2), module
        tot_ours, tot_rtn = tot_ours + float(diff2.sum()), tot_rtn + rtn75
        mine[f"{module}.weight_packed"] = rel
        per_layer.setdefault(row["layer"], []).append(rel)
        assert f".layers.{row['layer']}." in module
    # docs/spec.md §5: RTN amax/7.5 is ~1.2x the optimal RMS error on Student-t MXFP4 weights
    assert math.sqrt(tot_rtn / tot_ours) > 1.05
    assert set(rows) == set(mine)  # the table covers exactly the converted tensors
    worst = max(mine, key=mine.get)
    assert report["tensors"] == len(mine)
    assert report["worst"]["tensor"] == worst
    assert report["worst"]["rel_rmse"] == pytest.approx(mine[worst], rel=1e-9)
    assert report["rel_rmse_mean"] == pytest.approx(sum(mine.values()) / len(mine), rel=1e-9)
    assert [r["layer"] for r in report["layers"]] == sorted(per_layer)
    for r in report["layers"]:
        rels = per_layer[r["layer"]]
        assert r["tensors"] == len(rels)
        assert r["rel_rmse_worst"] == pytest.approx(max(rels), rel=1e-9)
        assert r["rel_rmse_mean"] == pytest.approx(sum(rels) / len(rels), rel=1e-9)
    assert converted.summary.worst["tensor"] == worst


# ------------------------------------------------------------------ 2. structure

def test_shards_and_tensors(converted):
    assert shard_names(converted.dst) == shard_names(converted.src)
    assert not [f for f in os.listdir(converted.dst) if f.endswith(".partial")]
    src, dst = all_tensors(converted.src), all_tensors(converted.dst)
    modules = expert_modules(converted.src)
    assert modules
    expected = set()
    for name, (shard, t) in src.items():
        module = name.rsplit(".", 1)[0]
        if module in modules:
            continue
        expected.add(name)
        assert dst[name][0] == shard, name  # same shard
        assert dst[name][1].dtype == t.dtype and dst[name][1].shape == t.shape, name
        assert tensor_bytes(dst[name][1]) == tensor_bytes(t), f"{name} not byte-identical"
    for module, shard in modules.items():
        packed_src = src[f"{module}.weight_packed"][1]
        out_f, in_f = packed_src.shape[0], packed_src.shape[1] * 2
        p, s, sh = (dst[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape"))
        assert p[0] == s[0] == sh[0] == shard, module
        assert p[1].dtype == torch.int32 and tuple(p[1].shape) == (out_f, in_f // 8), module
        assert s[1].dtype == torch.bfloat16 and tuple(s[1].shape) == (out_f, in_f // 32), module
        assert sh[1].dtype == torch.int64 and sh[1].tolist() == [out_f, in_f], module
        expected |= {f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape"}
    assert set(dst) == expected


def test_raw_bytes_of_copied_tensors_via_header_offsets(converted):
    """Read the data regions through the headers, independently of safe_open."""
    for shard in shard_names(converted.src):
        sh, s0 = raw_header(os.path.join(converted.src, shard))
        dh, d0 = raw_header(os.path.join(converted.dst, shard))
        sb = open(os.path.join(converted.src, shard), "rb").read()
        db = open(os.path.join(converted.dst, shard), "rb").read()
        ends = [v["data_offsets"][1] for k, v in dh.items() if k != "__metadata__"]
        assert d0 + max(ends) == len(db)  # no trailing garbage, nothing missing
        for name, e in sh.items():
            if name == "__metadata__" or name.endswith((".weight_packed", ".weight_scale")):
                continue
            (a, b), (c, d) = e["data_offsets"], dh[name]["data_offsets"]
            assert sb[s0 + a:s0 + b] == db[d0 + c:d0 + d], name


def test_index(converted):
    index = read_json(os.path.join(converted.dst, INDEX))
    dst = all_tensors(converted.dst)
    assert index["weight_map"] == {name: shard for name, (shard, _) in dst.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in dst.values())
    src_index = read_json(os.path.join(converted.src, INDEX))
    assert set(index["weight_map"].values()) == set(src_index["weight_map"].values())


def _check_int4_block(block: dict, source_block: dict) -> None:
    """docs/spec.md §3: pack-quantized int4 group 32 symmetric, same ignore list."""
    assert block["quant_method"] == "compressed-tensors"
    assert block["format"] == "pack-quantized"
    assert block["quantization_status"] == "compressed"
    assert block["ignore"] == source_block["ignore"]
    assert list(block["config_groups"]) == ["group_0"]
    g = block["config_groups"]["group_0"]
    # the routed experts by a pattern that also matches vLLM's names for them (docs/serving.md, "Names")
    assert g["targets"] == [r"re:.*\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"]
    assert g["format"] == "pack-quantized"
    assert g["input_activations"] is None and g["output_activations"] is None
    w = g["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert w["dynamic"] is False and w["actorder"] is None
    assert "mxfp4" not in json.dumps(block)
    # compressed-tensors accepts it and reads the same scheme
    qc = QuantizationConfig.model_validate(block)
    args = qc.config_groups["group_0"].weights
    assert (args.num_bits, args.type, args.symmetric, args.group_size, args.strategy) == (4, "int", True, 32, "group")


def _without_quant(cfg: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    cfg.pop("quantization_config", None)
    cfg.get("text_config", {}).pop("quantization_config", None)
    return cfg


def test_config_nested_block_replaced(converted):
    src = read_json(os.path.join(converted.src, "config.json"))
    out = read_json(os.path.join(converted.dst, "config.json"))
    assert "quantization_config" not in src and "quantization_config" not in out
    _check_int4_block(out["text_config"]["quantization_config"], src["text_config"]["quantization_config"])
    assert _without_quant(out) == _without_quant(src)  # everything else kept


def test_config_top_level_and_nested_both_replaced(src_copy, tmp_path):
    cfg_path = os.path.join(src_copy, "config.json")
    cfg = read_json(cfg_path)
    top = json.loads(json.dumps(cfg["text_config"]["quantization_config"]))
    top["ignore"] = top["ignore"] + ["re:.*some_other_module.*"]  # tell the two blocks apart
    cfg["quantization_config"] = top
    write_json(cfg_path, cfg)
    dst = str(tmp_path / "dst")
    summary = convert(src_copy, dst, Options())
    assert summary.complete
    out = read_json(os.path.join(dst, "config.json"))
    _check_int4_block(out["quantization_config"], top)
    _check_int4_block(out["text_config"]["quantization_config"], cfg["text_config"]["quantization_config"])
    assert _without_quant(out) == _without_quant(cfg)
    assert "mxfp4" not in json.dumps(out)


def test_situ_activation_stated_everywhere(converted):
    src_cfg = read_json(os.path.join(converted.src, "config.json"))["text_config"]
    out_cfg = read_json(os.path.join(converted.dst, "config.json"))["text_config"]
    manifest = read_json(os.path.join(converted.dst, MANIFEST))
    report = read_json(os.path.join(converted.dst, REPORT))
    for key in SITU:
        assert key in src_cfg
        assert out_cfg[key] == src_cfg[key]
        assert manifest["activation"][key] == src_cfg[key]
        assert report["activation"][key] == src_cfg[key]
    for shard in shard_names(converted.dst):
        _, meta = load_shard(os.path.join(converted.dst, shard))
        assert meta.get("format") == "pt", shard  # transformers/vLLM require it
        assert meta["hidden_act"] == src_cfg["hidden_act"], shard
        assert float(meta["activation_situ_beta"]) == src_cfg["activation_situ_beta"], shard
        assert float(meta["activation_situ_linear_beta"]) == src_cfg["activation_situ_linear_beta"], shard


def test_side_files_manifest_and_untouched_source(converted):
    for f in SIDE_FILES:
        assert sha256(os.path.join(converted.dst, f)) == sha256(os.path.join(converted.src, f)), f
    manifest = read_json(os.path.join(converted.dst, MANIFEST))
    assert manifest["complete"] is True and manifest["status"] == "complete"
    assert set(manifest["shards"]) == set(shard_names(converted.src))
    for name, rec in manifest["shards"].items():
        assert rec["digest"] == chunked_sha256(os.path.join(converted.dst, name)), name
        assert rec["bytes"] == os.path.getsize(os.path.join(converted.dst, name)), name
    assert converted.summary.complete
    assert converted.summary.shards_done == converted.summary.shards_total == len(shard_names(converted.src))
    assert converted.src_after == converted.src_before  # source unchanged, nothing added
    assert converted.src_before  # (and the hash saw files)


# ------------------------------------------------------------------ 3. determinism

@pytest.mark.parametrize("workers", [1, 2])  # in-process, and two worker processes
def test_deterministic(converted, tmp_path, workers):
    again = str(tmp_path / "again")
    events = []
    convert(converted.src, again, Options(workers=workers), lambda k, f: events.append((k, f)))
    assert len(dict(events)["plan"]["devices"]) == workers
    for f in shard_names(converted.dst) + [INDEX, "config.json"]:
        assert sha256(os.path.join(again, f)) == sha256(os.path.join(converted.dst, f)), f


# ------------------------------------------------------------------ 4. resume / refusal

def _shard_state(dst):
    return {s: (sha256(os.path.join(dst, s)), os.stat(os.path.join(dst, s)).st_mtime_ns) for s in shard_names(dst)}


def test_rerun_on_complete_dst_is_noop(converted, tmp_path):
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    before = _shard_state(dst)
    events = []
    summary = convert(converted.src, dst, Options(), lambda k, f: events.append((k, f)))
    kinds = [k for k, _ in events]
    plan = dict(events)["plan"]
    assert plan["todo"] == 0 and plan["shards"] == len(before)
    assert "start" not in kinds and "done" not in kinds
    assert _shard_state(dst) == before
    assert summary.complete and read_json(os.path.join(dst, MANIFEST))["complete"] is True


@pytest.mark.parametrize("change", ["other-source", "other-options"])
def test_dst_with_different_conversion_refused(converted, tmp_path, change):
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    before = tree_hash(dst)
    if change == "other-source":
        other = str(tmp_path / "other")
        shutil.copytree(converted.src, other)
        args, opts = (other, dst), Options()
    else:
        args, opts = (converted.src, dst), Options(sample_experts=1)
    with pytest.raises(OutputError) as e:
        convert(*args, opts)
    assert dst in str(e.value) and "--overwrite" in str(e.value)
    assert tree_hash(dst) == before


def test_different_conversion_cli_exit_4_then_overwrite(converted, tmp_path):
    from converter.fixture import FixtureSpec
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    with open(os.path.join(dst, "stale.txt"), "w") as f:
        f.write("left by someone")
    before = tree_hash(dst)
    other = str(tmp_path / "other")
    spec = FixtureSpec(**{**SPEC.__dict__, "seed": SPEC.seed + 1})
    make_fixture(other, spec, encoder=ct_mxfp4_encode)

    r = run_cli("mxfp4-to-int4", other, "-o", dst, "--progress", "none")
    assert_clean_error(r, dst, "--overwrite", code=OutputError.exit_code)
    assert OutputError.exit_code == 4
    assert tree_hash(dst) == before

    r = run_cli("mxfp4-to-int4", other, "-o", dst, "--progress", "none", "--overwrite")
    assert r.exit_code == 0, r.output
    manifest = read_json(os.path.join(dst, MANIFEST))
    assert manifest["complete"] is True and manifest["source"]["path"] == os.path.abspath(other)
    assert not os.path.exists(os.path.join(dst, "stale.txt"))
    # DST now holds a conversion of the other source
    src_t, dst_t = all_tensors(other), all_tensors(dst)
    changed = 0
    for module in expert_modules(other):
        w_mx = ct_mxfp4_values(src_t[f"{module}.weight_packed"][1], src_t[f"{module}.weight_scale"][1])
        w_q = int4.decode(dst_t[f"{module}.weight_packed"][1], dst_t[f"{module}.weight_scale"][1]).double()
        assert float((w_q - w_mx).norm() / w_mx.norm()) < 0.2, module
    for s in shard_names(dst):
        changed += sha256(os.path.join(dst, s)) != before[s]
    assert changed == len(shard_names(dst))


@pytest.mark.parametrize("where", ["dst-inside-src", "dst-is-src", "src-inside-dst"])
def test_dst_and_src_nested_refused(src_copy, tmp_path, where):
    before = tree_hash(src_copy)
    if where == "src-inside-dst":
        outer = str(tmp_path / "outer")
        src = os.path.join(outer, "src")
        shutil.move(src_copy, src)
        dst = outer
        before = tree_hash(src)
    else:
        src = src_copy
        dst = os.path.join(src_copy, "out") if where == "dst-inside-src" else src_copy
    with pytest.raises(OutputError):
        convert(src, dst, Options())
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none")
    assert_clean_error(r, "must not contain each other", code=OutputError.exit_code)
    assert tree_hash(src) == before
    assert not os.path.exists(os.path.join(src, "out"))


# ------------------------------------------------------------------ 5. --max-rel-rmse

def test_max_rel_rmse_exit_3_names_tensor(converted, tmp_path):
    rows = {r["name"]: r["rel_rmse"] for r in read_rows(os.path.join(converted.dst, TABLE))}
    limit = min(rows.values()) / 2  # below every tensor's error
    dst = str(tmp_path / "dst")
    args = ("mxfp4-to-int4", converted.src, "-o", dst, "--progress", "none", "--max-rel-rmse", str(limit))
    r = run_cli(*args)
    err = assert_clean_error(r, "--max-rel-rmse", str(limit), code=ThresholdExceeded.exit_code)
    assert ThresholdExceeded.exit_code == 3
    named = [n for n in rows if f"tensor {n}:" in err]
    assert len(named) == 1, err
    assert f"{rows[named[0]]:.4f}" in err
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is False

    # Running the same command again must not turn the failure into success, however
    # many shards earlier runs left behind.
    for _ in range(len(shard_names(converted.src)) + 1):
        r = run_cli(*args)
        assert_clean_error(r, "--max-rel-rmse", code=ThresholdExceeded.exit_code)
        assert read_json(os.path.join(dst, MANIFEST))["complete"] is False

    # another threshold is another conversion (recorded in run.json, R1): refused, naming both values;
    # with --overwrite and a threshold the data meets, the same DST completes
    r = run_cli(*args[:-2])
    assert_clean_error(r, f"--max-rel-rmse {limit!r} (recorded) vs 0.15", code=4)
    r = run_cli(*args[:-2], "--overwrite")
    assert r.exit_code == 0, r.output
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is True
    for s in shard_names(converted.dst):
        assert sha256(os.path.join(dst, s)) == sha256(os.path.join(converted.dst, s)), s
