"""What plain ``verify`` and ``verify --source`` accept and refuse: a DST that is not exactly what
k3convert writes fails with exit 5, naming the file and the field (docs/reliability.md D24-D26, R6-R8,
R15, R17, T3; each test failed before its fix).

A tamperer edits DST twice: once leaving the manifest as it is (plain ``verify`` must catch it against
the manifest's own record), once also making the manifest agree (only ``verify --source`` can catch
it, by recomputing from SRC what DST must hold). Digests in the tests are computed by conftest's own
``chunked_sha256``.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import zstandard
from dst_helpers import CONFIG, MOD, cli_verify, copy_dst, edit_json, quant_block
from safetensors.torch import save_file

from converter.verify import verify
from tests.conftest import (
    INDEX,
    MANIFEST,
    REPORT,
    TABLE,
    assert_clean_error,
    chunked_sha256,
    load_shard,
    read_json,
    run_cli,
    shard_names,
    sync_index,
    write_json,
)


def restamp(dst: str, *rels: str) -> None:
    """Make the manifest's record of each file agree with the file as it now is (a careful tamperer)."""
    m = read_json(os.path.join(dst, MANIFEST))
    for rel in rels:
        for table in ("shards", "files"):
            if rel in m.get(table, {}):
                path = os.path.join(dst, rel)
                m[table][rel].update(bytes=os.path.getsize(path), digest=chunked_sha256(path))
    write_json(os.path.join(dst, MANIFEST), m)


def problems(dst: str) -> list[str]:
    """What plain verify finds: DST against its own manifest."""
    return verify(dst).problems


@pytest.fixture
def dst(converted, tmp_path):
    return copy_dst(converted, tmp_path)


def _groups(c):
    return quant_block(c)["config_groups"]


def _first_shard(m):
    return next(iter(m["shards"].values()))


# ---------------------------------------- D24, D25, T3: what DST's config and manifest declare

# (file, edit, what the failing check says): verify exits 5 and names it
STRICT = {
    "targets-miss-the-experts": (CONFIG, lambda c: _groups(c)["group_0"].update(targets=["re:.*self_attn.*"]),
                                 "do not select 24 converted module(s)"),
    "targets-select-bf16": (CONFIG, lambda c: _groups(c)["group_0"]["targets"].append("re:.*embed_tokens$"),
                            "select 1 module(s) that are not int4 (a loader would look for int4 tensors): language_model.model.embed_tokens"),
    "ignore-drops-an-expert": (CONFIG, lambda c: quant_block(c)["ignore"].append(f"{MOD}"),
                               f"do not select 1 converted module(s) (a loader would read them as bf16): {MOD}"),
    "status-frozen": (CONFIG, lambda c: quant_block(c).update(quantization_status="frozen"),
                      "quantization_status is 'frozen', not 'compressed'"),
    "actorder-group": (CONFIG, lambda c: _groups(c)["group_0"]["weights"].update(actorder="group"),
                       "weights.actorder is 'group', expected None"),
    "dynamic-true": (CONFIG, lambda c: _groups(c)["group_0"]["weights"].update(dynamic=True),
                     "weights.dynamic is True, expected False"),
    "manifest-status": (MANIFEST, lambda m: m.update(status="failed-validation"),
                        "complete, but status is 'failed-validation'"),
    "manifest-target-format": (MANIFEST, lambda m: m.update(target_format="int8"), "target_format is 'int8'"),
    "manifest-source-format": (MANIFEST, lambda m: m.update(source_format="quark MXFP4"),
                               "source_format is 'quark MXFP4'"),
    "manifest-digest": (MANIFEST, lambda m: m.update(digest_algorithm="md5"), "digest_algorithm is 'md5'"),
}


@pytest.mark.parametrize("case", sorted(STRICT))
def test_verify_is_strict_about_what_dst_declares(dst, case):
    name, edit, needle = STRICT[case]
    ok = run_cli("verify", dst, "--no-checksums")
    assert ok.exit_code == 0, ok.output  # the undamaged copy passes: the damage below is what fails
    edit_json(os.path.join(dst, name), edit)
    r = run_cli("verify", dst, "--no-checksums")
    assert r.exit_code == 5, r.output
    assert "Traceback" not in r.output and needle in r.output, r.output


def _retarget(dst: str, edit) -> None:
    """Edit DST's int4 block, then make the manifest agree (a careful tamperer)."""
    path = os.path.join(dst, "config.json")
    cfg = read_json(path)
    edit(cfg["text_config"]["quantization_config"])
    write_json(path, cfg)
    restamp(dst, "config.json")


def _bf16_linears(dst: str) -> list[str]:
    """DST's bf16 modules with a 2-D weight: torch Linears to compressed-tensors' loader."""
    from safetensors import safe_open

    out = []
    for s in shard_names(dst):
        with safe_open(os.path.join(dst, s), "pt") as f:
            out += [n[:-7] for n in f.keys() if n.endswith(".weight") and len(f.get_slice(n).get_shape()) == 2]  # noqa: SIM118 (safe_open)
    return sorted(out)


def test_t3_a_linear_target_selects_the_bf16_linears(converted, tmp_path):
    """targets ["Linear"]: compressed-tensors' is_match selects every bf16 Linear for int4; plain verify,
    verify with the loader's own matcher, and upload --dry-run all refuse it."""
    from compressed_tensors.utils.match import is_match
    from torch import nn

    dst = copy_dst(converted, tmp_path)
    _retarget(dst, lambda b: b["config_groups"]["group_0"].update(targets=["Linear"]))
    block = read_json(os.path.join(dst, "config.json"))["text_config"]["quantization_config"]
    selected = [m for m in _bf16_linears(dst) if is_match(m, nn.Linear(1, 1, device="meta"), ["Linear"], block["ignore"])]
    assert selected  # what the loader does with this config
    for found in (problems(dst), verify(dst, loader_matcher=True).problems):
        assert any(f"select {len(selected)} module(s) that are not int4" in p and selected[0] in p for p in found), found
        assert any("group_0.targets is ['Linear'], the converter writes ['re:" in p for p in found), found
    r = run_cli("upload", dst, "someone/k3-int4", "--dry-run")
    assert r.exit_code == 5 and "not int4" in r.output, r.output


def test_t3_a_config_other_than_the_converters_fails_plain_verify(converted, tmp_path):
    """targets ["Linear"] with every bf16 Linear ignored by name selects exactly the converted modules
    for compressed-tensors, but vLLM asks int4 of its fused layers under names the list lacks: the
    block is held to what the converter writes for DST's modules."""
    dst = copy_dst(converted, tmp_path)
    linears = _bf16_linears(dst)

    def edit(b):
        b["config_groups"]["group_0"]["targets"] = ["Linear"]
        b["ignore"] = sorted(set(b["ignore"]) | set(linears))
    _retarget(dst, edit)
    found = problems(dst)
    assert not any("not int4" in p or "do not select" in p for p in found), found   # is_match: exactly right
    assert any("quantization_config.config_groups.group_0.targets is ['Linear'], the converter writes" in p
               for p in found), found
    r = run_cli("upload", dst, "someone/k3-int4", "--dry-run")
    assert r.exit_code == 5 and "the converter writes" in r.output, r.output


@pytest.mark.parametrize("edit, needle", [
    (lambda b: b["config_groups"]["group_0"]["weights"].update(observer="mse"), "weights.observer is 'mse'"),
    (lambda b: b.update(sparsity_config={"format": "dense"}), "sparsity_config is {'format': 'dense'}"),
    (lambda b: b["ignore"].append("re:.*experts.0.gate_proj"), "catch converted experts under the name vLLM asks"),
])
def test_t3_other_fields_the_converter_does_not_write(converted, tmp_path, edit, needle):
    dst = copy_dst(converted, tmp_path)
    _retarget(dst, edit)
    assert any(needle in p for p in problems(dst)), problems(dst)


def test_t3_the_converters_own_config_passes(converted):
    assert problems(converted.dst) == []


# ---------------------------------------- D26: a field of the wrong type is named

# (file, edit, field named): one line, exit 5, never a traceback
WRONG_TYPE = {
    "manifest-array": (MANIFEST, lambda m: [1], "the file is an array, expected an object"),
    "config-array": (CONFIG, lambda c: [1], "the file is an array, expected an object"),
    "shard-bytes-string": (MANIFEST, lambda m: _first_shard(m).update(bytes="big"),
                           ".bytes is a string (\"big\"), expected an integer"),
    "manifest-shards-array": (MANIFEST, lambda m: m.update(shards=[1]), "field shards is an array"),
    "manifest-complete-string": (MANIFEST, lambda m: m.update(complete="yes"), "field complete is a string"),
    "manifest-scale-bias-string": (MANIFEST, lambda m: m["source"]["quantization"].update(scale_bias="127"),
                                   "field source.quantization.scale_bias is a string"),
    "index-weight-map-number": (INDEX, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): 3}),
                                "is an integer (3), expected a string"),
    "index-total-size-string": (INDEX, lambda i: i["metadata"].update(total_size="1"),
                                "field metadata.total_size is a string"),
    "config-targets-string": (CONFIG, lambda c: _groups(c)["group_0"].update(targets="Linear"),
                              "field text_config.quantization_config.config_groups.group_0.targets is a string"),
    "config-groups-array": (CONFIG, lambda c: quant_block(c).update(config_groups=[1]),
                            "field text_config.quantization_config.config_groups is an array"),
    "config-text-config-array": (CONFIG, lambda c: c.update(text_config=[1]), "field text_config is an array"),
    "report-tensors-string": (REPORT, lambda r: r.update(tensors="24"), "field tensors is a string"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPE))
def test_verify_names_a_field_of_the_wrong_type(dst, case):
    name, edit, needle = WRONG_TYPE[case]
    edit_json(os.path.join(dst, name), edit)
    assert_clean_error(run_cli("verify", dst, "--no-checksums"), name, needle, code=5)


# ---------------------------------------- R6, R7: verify --source recomputes config and side files from SRC

@pytest.mark.parametrize("field,value", [("num_experts_per_token", 3), ("moe_intermediate_size", 128),
                                         ("num_hidden_layers", 2)])
def test_r6_config_fields_outside_the_quantization_block(converted, tmp_path, field, value):
    dst = copy_dst(converted, tmp_path)
    path = os.path.join(dst, "config.json")
    cfg = read_json(path)
    assert field in cfg["text_config"] and cfg["text_config"][field] != value
    cfg["text_config"][field] = value
    write_json(path, cfg)
    assert any("config.json" in p for p in problems(dst)), "plain verify: config.json against the manifest"
    restamp(dst, "config.json")
    assert problems(dst) == []  # the manifest now agrees: only SRC can tell
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5, r.output
    assert f"text_config.{field}" in r.output and "config.json" in r.output, r.output


def test_r6_verify_source_passes_an_untouched_dst(converted):
    """The guard: recomputing DST from SRC agrees with what the converter wrote, field for field."""
    r = cli_verify(converted.dst, converted.src)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("name", ["modeling_kimi_k3.py", "chat_template.jinja", "tokenizer_config.json"])
def test_r7_side_files_are_byte_identical(converted, tmp_path, name):
    dst = copy_dst(converted, tmp_path)
    with open(os.path.join(dst, name), "ab") as f:
        f.write(b"\n# edited\n")
    assert any(name in p for p in problems(dst)), "plain verify: the side file against the manifest"
    restamp(dst, name)
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5 and name in r.output, r.output


def test_r7_side_file_removed_or_not_from_source(converted, tmp_path):
    """A side file missing from DST, and one in DST (named by the manifest) that SRC does not have."""
    dst = copy_dst(converted, tmp_path)
    os.unlink(os.path.join(dst, "chat_template.jinja"))
    assert any("chat_template.jinja" in p for p in problems(dst))
    dst2 = str(tmp_path / "dst2")
    shutil.copytree(converted.dst, dst2)
    with open(os.path.join(dst2, "extra.py"), "w") as f:
        f.write("print('not from SRC')\n")
    m = read_json(os.path.join(dst2, MANIFEST))
    m.setdefault("files", {})["extra.py"] = {}
    write_json(os.path.join(dst2, MANIFEST), m)
    restamp(dst2, "extra.py")
    r = cli_verify(dst2, converted.src)
    assert r.exit_code == 5 and "extra.py" in r.output, r.output


# ---------------------------------------- R8: every shard SRC gives, in the layout SRC gives

def _remove_shard_with_its_traces(dst: str, shard: str) -> None:
    """The reproduction: the shard, its manifest entry, index entries, total_size, table rows and report count."""
    gone = {n for n, s in read_json(os.path.join(dst, INDEX))["weight_map"].items() if s == shard}
    size = sum(t.nbytes for t in _header_tensors(os.path.join(dst, shard)))
    os.unlink(os.path.join(dst, shard))
    index = read_json(os.path.join(dst, INDEX))
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard}
    index["metadata"]["total_size"] -= size
    write_json(os.path.join(dst, INDEX), index)
    table = os.path.join(dst, TABLE)
    with open(table, "rb") as f:
        rows = [json.loads(x) for x in zstandard.ZstdDecompressor().decompress(f.read()).splitlines() if x]
    rows = [r for r in rows if r["name"] not in gone]
    with open(table, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    report = read_json(os.path.join(dst, REPORT))
    report["tensors"] = len(rows)
    write_json(os.path.join(dst, REPORT), report)
    m = read_json(os.path.join(dst, MANIFEST))
    del m["shards"][shard]
    write_json(os.path.join(dst, MANIFEST), m)
    restamp(dst, INDEX, TABLE, REPORT)


def _header_tensors(path: str):
    from converter.formats.safetensors_io import read_header
    return read_header(path).tensors.values()


def test_r8_a_removed_shard_with_its_traces_fails(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    shard = shard_names(dst)[-1]
    _remove_shard_with_its_traces(dst, shard)
    found = problems(dst)
    assert any(shard in p for p in found), found  # the manifest's source still lists it
    m = read_json(os.path.join(dst, MANIFEST))
    del m["source"]["shards"][shard]
    write_json(os.path.join(dst, MANIFEST), m)
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5 and shard in r.output, r.output


@pytest.mark.parametrize("edit", ["drop a bf16 tensor", "shard metadata"])
def test_r8_verify_source_holds_each_shard_to_the_layout_src_gives(converted, tmp_path, edit):
    """Every module SRC gives, in its shard, with the shard's metadata: a passthrough tensor
    removed (index, total_size and digests made to agree) or a metadata field changed fails."""
    dst = copy_dst(converted, tmp_path)
    wm = read_json(os.path.join(dst, INDEX))["weight_map"]
    name = next(n for n in sorted(wm) if n.endswith("norm.weight"))
    shard = wm[name]

    def change(tensors, meta):
        if edit == "drop a bf16 tensor":
            del tensors[name]
        else:
            meta["quantization"] = "bf16"

    tensors, meta = load_shard(os.path.join(dst, shard))
    change(tensors, meta)
    save_file(tensors, os.path.join(dst, shard), metadata=meta)
    sync_index(dst)
    restamp(dst, shard, INDEX)
    r = cli_verify(dst, converted.src)
    assert r.exit_code == 5, r.output
    assert shard in r.output and (name if edit == "drop a bf16 tensor" else "metadata.quantization") in r.output, r.output


# ---------------------------------------- R15, R17: files nobody names, temporaries

@pytest.mark.parametrize("name", ["model-00004-of-00003.safetensors", "notes.txt", "sub/extra.safetensors"])
def test_r15_a_file_nobody_names_fails_verify_and_upload(converted, tmp_path, name):
    dst = copy_dst(converted, tmp_path)
    os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
    shutil.copy(os.path.join(dst, shard_names(dst)[0]), os.path.join(dst, name))
    r = cli_verify(dst)
    assert r.exit_code == 5 and name in r.output, r.output
    r = run_cli("upload", dst, "someone/k3-int4", "--dry-run")
    assert r.exit_code == 5 and name in r.output, r.output


def test_r17_verify_names_temporaries_left_in_a_complete_dst(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    left = ["config.json.tmp4242", "chat_template.jinja.tmp4242", shard_names(dst)[0] + ".partial"]
    for rel in left:
        open(os.path.join(dst, rel), "wb").close()
    r = cli_verify(dst)
    assert r.exit_code == 0, r.output  # never part of the output, never uploaded: named, not failed
    for rel in left:
        assert rel in r.output, (rel, r.output)
    assert not set(left) & set(verify(dst).files)
