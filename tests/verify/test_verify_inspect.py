"""`k3convert verify` and `k3convert inspect` on a real conversion of the small fixture.

Every failure case damages one thing in a copy of a good DST and checks that verify names it,
so a check that silently passes everything would fail here.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys

import pytest
import torch
from click.testing import CliRunner

from converter.cli import main
from converter.digest import file_digest
from converter.errors import BadInput, VerifyFailed
from converter.fixture import FixtureSpec, make_fixture
from converter.formats import mxfp4
from converter.inspect import inspect_path
from converter.run.plan import build_plan
from converter.state.files import MANIFEST
from converter.state.records import read_rows, write_json, write_rows
from converter.verify import brute_force_min, spread, verify
from converter.verify.optimum import _all_bf16_scales

INDEX = "model.safetensors.index.json"
TABLE = "k3convert_tensors.jsonl.zst"


@pytest.fixture
def converted(converted_default):
    return converted_default


@pytest.fixture
def dst(converted, tmp_path):
    """A private copy of the good DST, free to damage."""
    out = str(tmp_path / "dst")
    shutil.copytree(converted[1], out)
    return out


def _json(path):
    with open(path) as f:
        return json.load(f)


def _shard_names(dst):
    return sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _rewrite_header(path, edit):
    """Apply ``edit`` to a shard's header JSON and write the file back (data unchanged)."""
    head, start = _header(path)
    edit(head)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _refresh_checksum(dst, shard):
    """Make the manifest agree with a modified shard: isolates the other checks."""
    m = _json(os.path.join(dst, MANIFEST))
    p = os.path.join(dst, shard)
    m["shards"][shard].update(digest=file_digest(p), bytes=os.path.getsize(p))
    write_json(os.path.join(dst, MANIFEST), m)


def _failed(result):
    return {c.name for c in result.checks if not c.ok}


# ----------------------------------------------------------------------------- a good DST

def test_good_dst_passes_with_source(converted):
    src, dst = converted
    r = verify(dst, src, sample=4)
    assert r.ok, r.format()
    assert r.sampled == 4
    assert "compressed_tensors" in r.decoder          # the independent reader was used
    statuses = {c.name: c.status for c in r.checks}
    assert statuses["re-decode"] == statuses["optimality"] == statuses["passthrough"] == "PASS"
    assert "72 quantized module" in r.check("tensors").summary


def test_cli_verify_exit_codes(converted, tmp_path):
    src, dst = converted
    ok = CliRunner().invoke(main, ["verify", dst, "--source", src, "--sample", "2"])
    assert ok.exit_code == 0, ok.output
    assert "result: PASS" in ok.output and "FAIL" not in ok.output
    missing = CliRunner().invoke(main, ["verify", str(tmp_path / "nope")])
    assert missing.exit_code == 2


def test_fallback_int4_reader_when_compressed_tensors_is_missing(converted, monkeypatch):
    """The re-decode still works, and says it used the converter's own int4 decoder."""
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import now raises ImportError
    src, dst = converted
    r = verify(dst, src, sample=2, checksums=False)
    assert r.ok, r.format()
    assert r.decoder.startswith("converter.formats.int4.decode")


# ----------------------------------------------------------------------------- (a) checksums

def test_one_corrupt_byte_is_a_checksum_mismatch_naming_the_shard(dst):
    shard = _shard_names(dst)[1]
    path = os.path.join(dst, shard)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    r = verify(dst)
    assert _failed(r) == {"checksums"}
    assert any(shard in p and "digest" in p for p in r.check("checksums").problems)
    res = CliRunner().invoke(main, ["verify", dst])
    assert res.exit_code == 5 and shard in res.output


def test_truncated_and_missing_shards(dst):
    a, b = _shard_names(dst)[:2]
    with open(os.path.join(dst, a), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(dst, a)) - 10)
    os.unlink(os.path.join(dst, b))
    r = verify(dst)
    probs = " ".join(r.problems)
    assert f"{a}: " in probs and "bytes, manifest says" in probs
    assert f"{b}: missing" in probs


# ----------------------------------------------------------------------------- (b) structure

def test_deleted_index_entry_is_a_structure_failure(dst):
    idx = _json(os.path.join(dst, INDEX))
    victim = sorted(idx["weight_map"])[5]
    del idx["weight_map"][victim]
    write_json(os.path.join(dst, INDEX), idx)
    r = verify(dst)
    assert "index" in _failed(r)
    assert any(victim in p and "not in" in p for p in r.check("index").problems)


def test_wrong_total_size(dst):
    idx = _json(os.path.join(dst, INDEX))
    idx["metadata"]["total_size"] += 1
    write_json(os.path.join(dst, INDEX), idx)
    assert any("total_size" in p for p in verify(dst).check("index").problems)


def test_hidden_act_removed_from_config_fails(dst):
    cfg = _json(os.path.join(dst, "config.json"))
    del cfg["text_config"]["hidden_act"]
    write_json(os.path.join(dst, "config.json"), cfg)
    r = verify(dst)
    assert "situ" in _failed(r)
    assert any("hidden_act" in p for p in r.check("situ").problems)
    assert CliRunner().invoke(main, ["verify", dst]).exit_code == 5


def test_situ_missing_from_one_shards_metadata(dst):
    shard = _shard_names(dst)[0]
    _rewrite_header(os.path.join(dst, shard), lambda h: h["__metadata__"].pop("activation_situ_beta"))
    _refresh_checksum(dst, shard)
    r = verify(dst)
    assert _failed(r) == {"situ"}
    assert any(shard in p and "activation_situ_beta" in p for p in r.check("situ").problems)


def test_nested_block_left_as_mxfp4_fails(dst, converted):
    """The llm-compressor defect: a fresh top-level block, the nested one still MXFP4."""
    cfg = _json(os.path.join(dst, "config.json"))
    src_cfg = _json(os.path.join(converted[0], "config.json"))
    cfg["quantization_config"] = cfg["text_config"]["quantization_config"]
    cfg["text_config"]["quantization_config"] = src_cfg["text_config"]["quantization_config"]
    write_json(os.path.join(dst, "config.json"), cfg)
    r = verify(dst)
    assert _failed(r) == {"config", "files"}  # files: config.json's digest in the manifest
    assert r.check("config").problems == ["text_config.quantization_config still describes MXFP4"]


def test_asymmetric_or_other_group_size_fails(dst):
    cfg = _json(os.path.join(dst, "config.json"))
    w = cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
    w.update(symmetric=False, group_size=128)
    write_json(os.path.join(dst, "config.json"), cfg)
    probs = verify(dst).check("config").problems
    assert any("symmetric" in p for p in probs) and any("group_size" in p for p in probs)


def test_bad_weight_shape_and_scale_dtype(dst):
    shard = _shard_names(dst)[0]
    head, _ = _header(os.path.join(dst, shard))
    module = sorted(n for n in head if n.endswith(".weight_scale"))[0][: -len(".weight_scale")]

    def edit(h):
        h[f"{module}.weight_scale"]["dtype"] = "F16"  # same size, wrong dtype
    _rewrite_header(os.path.join(dst, shard), edit)
    _refresh_checksum(dst, shard)
    r = verify(dst)
    assert _failed(r) == {"tensors"}
    assert any(module in p and "expected BF16" in p for p in r.check("tensors").problems)


def test_incomplete_manifest_fails_and_unreadable_manifest_is_bad_input(dst):
    """An incomplete manifest fails its check; one that is not JSON fails verification (exit 5: DST is
    damaged, issue 40's round-4 item); none at all is bad input (not a k3convert output)."""
    m = _json(os.path.join(dst, MANIFEST))
    m["complete"] = False
    write_json(os.path.join(dst, MANIFEST), m)
    assert "manifest" in _failed(verify(dst))
    with open(os.path.join(dst, MANIFEST), "w") as f:
        f.write("{not json")
    with pytest.raises(VerifyFailed, match="is not valid JSON"):
        verify(dst)
    os.unlink(os.path.join(dst, MANIFEST))
    with pytest.raises(BadInput):
        verify(dst)


# ----------------------------------------------------------------------------- (c) re-decode

def test_table_figure_off_by_1e_4_is_caught(dst, converted):
    path = os.path.join(dst, TABLE)
    rows = read_rows(path)
    rows[7]["rel_rmse"] *= 1 + 1e-4
    write_rows(path, rows)
    r = verify(dst, converted[0], sample=None, checksums=False)
    assert _failed(r) == {"files", "re-decode"}  # files: the table's digest in the manifest
    assert any(rows[7]["name"] in p for p in r.check("re-decode").problems)


def test_wrong_int4_values_with_matching_checksum_are_caught(dst, converted):
    """A converter bug that writes wrong nibbles (and hashes them faithfully) fails re-decode."""
    shard = _shard_names(dst)[0]
    path = os.path.join(dst, shard)
    head, start = _header(path)
    name = sorted(n for n in head if n.endswith(".weight_packed"))[3]
    begin = start + head[name]["data_offsets"][0]
    with open(path, "r+b") as f:  # move one q by +1 in every word of the first row's first group
        f.seek(begin)
        words = bytearray(f.read(16))
        for k in range(0, 16, 4):
            words[k] = (words[k] & 0xF0) | ((words[k] & 0x0F) + 1 if (words[k] & 0x0F) < 15 else 14)
        f.seek(begin)
        f.write(words)
    _refresh_checksum(dst, shard)
    r = verify(dst, converted[0], sample=None)
    assert "checksums" not in _failed(r)
    assert "re-decode" in _failed(r)
    module = name[: -len(".weight_packed")]
    assert any(module in p for p in r.check("re-decode").problems)


def test_changed_source_is_reported(converted, tmp_path):
    src, good = converted
    other = str(tmp_path / "src2")
    make_fixture(other, FixtureSpec(seed=1))
    r = verify(good, other, sample=1, checksums=False)
    assert "source" in _failed(r) and "re-decode" in _failed(r)


@pytest.mark.parametrize("qmin", [-8, -7])
def test_pruned_brute_force_equals_the_full_sweep(qmin):
    """The [a/16, 2a] pruning in brute_force_min loses nothing, for codes [-8, 7] and [-7, 7]
    (optimal-pm7): compare with every bf16 scale."""
    w = torch.randn(6, 64) * torch.logspace(-3, 1, 6)[:, None]
    w[0, :32] = 0
    vals = mxfp4.decode(*mxfp4.encode(w)).double().reshape(-1, 32)
    full = torch.full((vals.shape[0],), float("inf"), dtype=torch.float64)
    for s in _all_bf16_scales().split(4096):
        q = torch.clamp(torch.round(vals[:, None, :] / s[None, :, None]), qmin, 7)
        full = torch.minimum(full, ((q * s[None, :, None] - vals[:, None, :]) ** 2).sum(2).min(1).values)
    full = torch.where(vals.abs().amax(1) == 0, torch.zeros_like(full), full)
    assert torch.equal(brute_force_min(vals, qmin), full)
    if qmin == -7:  # the ranges differ on these groups: the check would see a -8 pass for -7
        assert not torch.equal(brute_force_min(vals), full)


def test_spread():
    assert spread(list(range(10)), 3) == [0, 4, 9] or spread(list(range(10)), 3) == [0, 5, 9]
    assert spread([1, 2], None) == [1, 2] and spread([1, 2], 0) == []


def test_raise_if_failed(dst):
    os.unlink(os.path.join(dst, INDEX))
    r = verify(dst)
    with pytest.raises(VerifyFailed) as e:
        r.raise_if_failed()
    assert e.value.exit_code == 5 and INDEX in str(e.value)


# ----------------------------------------------------------------------------- inspect

def test_inspect_source(converted):
    src, _ = converted
    info = inspect_path(src)
    plan = build_plan(src)
    assert info["format"] == "mxfp4-source"
    assert info["plan"]["bytes_out"] == plan.bytes_out and info["plan"]["tensors_to_convert"] == 72
    assert info["quantized_modules"] == 72 and info["shard_count"] == 3
    assert info["quantization_configs"][0]["where"] == "text_config.quantization_config"
    assert info["situ"]["activation_situ_linear_beta"] == {"value": 25.0, "where": "text_config"}


def test_inspect_output_and_cli_json(converted):
    _, dst = converted
    res = CliRunner().invoke(main, ["inspect", dst, "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["format"] == "k3convert-int4" and info["k3convert"]["complete"] is True
    assert info["dtypes"]["I32"] == 72 and info["situ_in_shard_metadata"] == "3 of 3 shard(s)"
    assert "plan" not in info
    text = CliRunner().invoke(main, ["inspect", dst]).output
    assert "k3convert int4 output" in text and "hidden_act=situ" in text


def test_inspect_other_format(converted, tmp_path):
    src, _ = converted
    other = str(tmp_path / "fp8")
    shutil.copytree(src, other)
    cfg = _json(os.path.join(other, "config.json"))
    cfg["text_config"]["quantization_config"] = {"quant_method": "fp8", "format": "float-quantized"}
    write_json(os.path.join(other, "config.json"), cfg)
    info = inspect_path(other)
    assert info["format"] == "other" and "quant_method='fp8'" in info["description"]
    assert CliRunner().invoke(main, ["inspect", str(tmp_path / "nope")]).exit_code == 2


# ---------------------------------------------------------------- the fast passes (K3 scale)

def test_fast_type_pass_agrees_with_the_detailed_one():
    """verify's fast pass (``_conforms``) says fine exactly where ``type_problems`` finds nothing."""
    from converter.formats.json_input import ListOf, MapOf, Nullable, type_problems
    from converter.verify import INDEX_TYPES, MANIFEST_TYPES, ROW_TYPES
    from converter.verify.dst import _conforms

    cases = [
        (INDEX_TYPES, {"metadata": {"total_size": 5}, "weight_map": {"a": "s1", "b": "s2"}}),
        (INDEX_TYPES, {"metadata": {"total_size": True}, "weight_map": {}}),   # a boolean is no integer
        (INDEX_TYPES, {"metadata": {"total_size": 5.0}, "weight_map": {}}),    # nor is a float
        (INDEX_TYPES, {"weight_map": {"a": "s1", "b": 3}}),
        (INDEX_TYPES, {"weight_map": ["s1"]}),
        (INDEX_TYPES, [1]),
        (ROW_TYPES, {"name": "x", "rel_rmse": 1, "max_abs": 0.5}),             # a number takes an integer
        (ROW_TYPES, {"name": "x", "rel_rmse": False, "max_abs": 0.5}),
        (ROW_TYPES, {"name": 1, "rel_rmse": 0.1}),
        (MANIFEST_TYPES, {"shards": {"a": {"bytes": 1, "digest": "d"}}, "complete": True}),
        (MANIFEST_TYPES, {"shards": {"a": {"bytes": "1", "digest": "d"}}}),
        (MANIFEST_TYPES, {"source": {"quantization": {"blocks": ["a", 2]}}}),
        (MANIFEST_TYPES, {"source": {"quantization": {"blocks": None}}}),
        ({"x": Nullable(ListOf(MapOf(int)))}, {"x": None}),
        ({"x": Nullable(ListOf(MapOf(int)))}, {"x": [{"a": 1}, {"b": True}]}),
        ({"x": ListOf(float)}, {"x": [1, 2.5, True]}),
    ]
    for spec, value in cases:
        assert _conforms(value, spec) == (type_problems(value, spec) == []), (spec, value)


def test_table_rows_names_the_line():
    from converter.verify import table_rows

    good = [{"name": "a", "rel_rmse": 0.1, "max_abs": 1}, {"name": "b", "rel_rmse": 0, "max_abs": 0.0}]
    assert list(table_rows(good, "t")) == ["a", "b"]
    for bad, needle in (({"name": "c", "rel_rmse": "0.1", "max_abs": 1.0}, "field line 3.rel_rmse is a string"),
                        ({"name": "c", "max_abs": 1.0}, "line 3 has no rel_rmse"),
                        ({"name": "c", "rel_rmse": None, "max_abs": 1.0}, "field line 3.rel_rmse is null")):
        with pytest.raises(VerifyFailed, match=needle):
            table_rows(good + [bad], "t")


def _k3_selection(layers: int = 61, experts: int = 384):
    from converter.fixture import _tensors, config
    from converter.formats.compressed_tensors import compressed_tensors_source

    spec = FixtureSpec(layers=layers + 1, experts=experts)
    listed = list(_tensors(spec))
    converted = sorted({n for n, _, k in listed if k == "packed"})
    plain = sorted(n[:-7] for n, _, k in listed if k == "bf16" and n.endswith(".weight"))
    src = config(spec)
    return compressed_tensors_source(src, "config.json").int4_config(src, converted, []), converted, plain


@pytest.mark.parametrize("edit", ["none", "ignore-one-expert", "ignore-by-class", "exact-targets", "dotless-target",
                                  "partial-regex", "select-bf16", "ignore-layer", "flag-target", "backref-ignore"])
def test_fast_selection_equals_the_loaders_matcher_on_every_module(edit, monkeypatch):
    """selection_problems decides most experts without compressed-tensors' ``is_match``: its verdicts
    equal ``is_match`` on every module (CHECKED_BY_LOADER large: the loader decides all)."""
    from converter.formats.checkpoint import quant_blocks
    from converter.verify import selection as v

    cfg, converted, plain = _k3_selection(layers=6, experts=64)
    block = cfg["text_config"]["quantization_config"]
    group = block["config_groups"]["group_0"]
    one = converted[len(converted) // 2 + 1]  # not among the experts the loader re-decides
    {"none": lambda: None,
     "ignore-one-expert": lambda: block["ignore"].append(one),
     "ignore-by-class": lambda: block["ignore"].append("Linear"),
     "exact-targets": lambda: group.update(targets=converted[:-1]),
     "dotless-target": lambda: group["targets"].append("lm_head"),
     "partial-regex": lambda: group.update(targets=[r"re:experts\.\d+"]),   # re.match: from the start only
     "select-bf16": lambda: group["targets"].append("re:.*norm$"),
     "ignore-layer": lambda: block["ignore"].append(r"re:.*layers\.3\."),
     "flag-target": lambda: group["targets"].append("re:(?i).*NORM$"),          # a flag that must come first
     "backref-ignore": lambda: block["ignore"].append(r"re:(l)anguage_mode\1\.model\.layers\.3\.")}[edit]()
    blocks = quant_blocks(cfg)
    fast = v.selection_problems(blocks, converted, plain)
    monkeypatch.setattr(v, "CHECKED_BY_LOADER", 10**9)
    assert fast == v.selection_problems(blocks, converted, plain)
    assert (fast == []) == (edit in ("none", "dotless-target")), fast
    if edit == "ignore-one-expert":
        assert fast == [f"the targets/ignore lists do not select 1 converted module(s) (a loader would read them "
                        f"as bf16): {one}"]


def test_fast_selection_defers_to_the_loader_when_they_disagree(monkeypatch):
    """Should compressed-tensors' matcher ever decide a sampled module otherwise, it decides all."""
    from converter.formats.checkpoint import quant_blocks
    from converter.verify import selection as v

    cfg, converted, plain = _k3_selection(layers=2, experts=8)
    lost = converted[3]
    fake = lambda name, module, patterns, ignore=(): v.EXPERT_TARGET in patterns and name != lost  # noqa: E731
    monkeypatch.setattr(v, "_name_matcher", lambda: fake)
    assert v.selection_problems(quant_blocks(cfg), converted, [])[0].endswith(f"as bf16): {lost}")
