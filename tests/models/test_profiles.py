"""Model profiles (issue 10 §1): chosen from config.json or by --profile, recorded in the manifest,
shown by `inspect`, and an incomplete K3 download caught in preflight, naming what is missing.

The expected counts and names are derived here from the fixture's own config and index (and,
for the real model, from docs/spec.md's numbers), never from the profile code under test.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import pytest

from converter import profiles
from converter.fixture import FixtureSpec, config as k3_config
from converter.inspect import format_info, inspect_path
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import (
    INDEX,
    MANIFEST,
    REPORT,
    SPEC,
    assert_clean_error,
    assert_not_complete,
    expert_modules,
    read_json,
    rewrite_shard,
    run_cli,
    sync_index,
    tree_hash,
    write_json,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CT013 = os.path.join(str(support.DATA), "ct013-mxfp4")
BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "profiles")
K3_MODULE = "language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}"  # docs/spec.md §1
CT_FIELDS = ("quantization_config.quant_method = 'compressed-tensors'",
             "quantization_config.format = 'mxfp4-pack-quantized'")


def k3_inventory(spec: FixtureSpec = SPEC) -> dict[str, tuple[int, int]]:
    """Every routed expert matrix a K3-shaped checkpoint must hold, from docs/spec.md's layout."""
    shapes = {"w1": (spec.inter, spec.latent), "w2": (spec.latent, spec.inter), "w3": (spec.inter, spec.latent)}
    return {K3_MODULE.format(layer=layer, expert=e, proj=p): s
            for layer in range(1, spec.layers) for e in range(spec.experts) for p, s in shapes.items()}


def cli_convert(src: str, dst: str, *args: str):
    return run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", *args)


def refused(src: str, tmp_path, *needles: str, args: tuple[str, ...] = (), one_line: bool = True) -> str:
    """A preflight refusal: exit 2, one clean message naming every needle, DST never created,
    the source untouched."""
    before = tree_hash(src)
    dst = str(tmp_path / "dst")
    err = assert_clean_error(cli_convert(src, dst, *args), *needles, code=2, one_line=one_line)
    assert not os.path.exists(dst), "preflight failure wrote DST"
    assert tree_hash(src) == before
    return err


def converts(src: str, dst: str, *args: str) -> dict:
    """Convert through the CLI; returns the complete manifest."""
    r = cli_convert(src, dst, *args)
    assert r.exit_code == 0, (r.output, r.exception)
    manifest = read_json(os.path.join(dst, MANIFEST))
    assert manifest["complete"] is True
    return manifest


def ct013_copy(tmp_path, name: str = "ct013") -> str:
    """The real compressed-tensors 0.13.0 checkpoint (Mixtral-like config), without its reference file."""
    src = str(tmp_path / name)
    os.makedirs(src)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(CT013, f), os.path.join(src, f))
    return src


def drop_modules(src: str, modules: list[str], from_index: bool = True) -> None:
    """Delete every tensor of ``modules`` from the shards that hold them (and from the index)."""
    wm = read_json(os.path.join(src, INDEX))["weight_map"]
    names = [n for m in modules for n in (f"{m}.weight_packed", f"{m}.weight_scale")]
    for shard in sorted({wm[n] for n in names}):
        rewrite_shard(os.path.join(src, shard), lambda t: [t.pop(n) for n in names if n in t])
    if from_index:
        sync_index(src)


# ------------------------------------------------------------------ 1. chosen from config.json

def test_k3_fixture_picks_kimi_k3_and_the_manifest_and_report_record_it(converted):
    assert read_json(os.path.join(converted.src, "config.json"))["model_type"] == "kimi_k3"
    recorded = read_json(os.path.join(converted.dst, MANIFEST))["source"]["profile"]
    assert (recorded["name"], recorded["file"]) == ("kimi-k3", "kimi-k3.toml")
    why = recorded["reason"]
    assert "model_type = 'kimi_k3'" in why and "--profile" not in why
    assert all(f"text_config.{f}" in why for f in CT_FIELDS), why
    assert read_json(os.path.join(converted.dst, REPORT))["profile"] == recorded


def test_mixtral_like_compressed_tensors_source_picks_the_generic_profile(tmp_path):
    src = ct013_copy(tmp_path)
    assert read_json(os.path.join(src, "config.json"))["model_type"] == "mixtral"
    recorded = converts(src, str(tmp_path / "out"))["source"]["profile"]
    assert (recorded["name"], recorded["file"]) == ("compressed-tensors-mxfp4", "compressed-tensors-mxfp4.toml")
    assert all(f in recorded["reason"] for f in CT_FIELDS) and "model_type" not in recorded["reason"]


def test_inspect_shows_the_profile_and_why_for_source_and_output(converted):
    wm = read_json(os.path.join(converted.src, INDEX))["weight_map"]
    straddled = sum(wm[f"{m}.weight_packed"] != wm[f"{m}.weight_scale"] for m in expert_modules(converted.src))
    assert straddled > 0  # the fixture cuts shards by size, as Hugging Face writers do
    res = run_cli("inspect", converted.src, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["profile"]["name"] == "kimi-k3" and "model_type = 'kimi_k3'" in info["profile"]["reason"]
    assert info["plan"]["modules_split_across_shards"] == straddled
    assert "bias 127" in info["plan"]["scale_convention"] and info["plan"]["dropped"] == []
    text = run_cli("inspect", converted.src).stdout
    assert f"profile:      kimi-k3 (kimi-k3.toml): {info['profile']['reason']}" in text
    assert f"; {straddled} module(s) with tensors in more than one shard" in text

    recorded = read_json(os.path.join(converted.dst, MANIFEST))["source"]["profile"]
    out = json.loads(run_cli("inspect", converted.dst, "--json").stdout)
    assert out["k3convert"]["profile"] == recorded
    assert f"profile:      kimi-k3 (kimi-k3.toml): {recorded['reason']}" in run_cli("inspect", converted.dst).stdout


def test_inspect_names_the_profile_even_when_preflight_fails(src_copy):
    drop_modules(src_copy, sorted(expert_modules(src_copy))[:1])
    info = inspect_path(src_copy)
    assert info["profile"]["name"] == "kimi-k3"
    assert "expected 24 expert matrices, found 23" in info["plan"]["error"]
    assert "profile:      kimi-k3" in format_info(info)


# ------------------------------------------------------------------ 2. --profile

def test_profile_option_overrides_on_a_k3_fixture(fixture_src, tmp_path):
    manifest = converts(fixture_src, str(tmp_path / "out"), "--profile", "compressed-tensors-mxfp4")
    recorded = manifest["source"]["profile"]
    assert recorded["name"] == "compressed-tensors-mxfp4" and recorded["reason"] == "chosen by --profile"
    # --profile is recorded as what the profile is (issue 25 S3): its name and its file's digest;
    # where it was found is kept to rebuild the plan (finalize, verify --source), never compared
    prof = manifest["options"]["profile"]
    assert prof["name"] == "compressed-tensors-mxfp4" and len(prof["sha256"]) == 64
    assert os.path.samefile(prof["file"], os.path.join(profiles.bundled_dir(), "compressed-tensors-mxfp4.toml"))


def test_profile_of_another_dialect_is_refused(fixture_src, tmp_path):
    refused(fixture_src, tmp_path, "'quark-mxfp4'", "quark", "compressed-tensors",
            args=("--profile", "quark-mxfp4"))


def test_unknown_profile_is_refused_naming_the_known_ones(fixture_src, tmp_path):
    known = []
    for path in sorted(glob.glob(os.path.join(BUNDLED, "*.toml"))):
        with open(path, "rb") as f:
            known.append(tomllib.load(f)["name"])
    assert {"kimi-k3", "compressed-tensors-mxfp4", "quark-mxfp4"} <= set(known)
    refused(fixture_src, tmp_path, "'nosuch'", *known, args=("--profile", "nosuch"))


CUSTOM = """\
name = "my-k3"
source = "compressed-tensors"
[match]
model_type = "kimi_k3"
[activation]
required = ["hidden_act", "activation_situ_beta", "activation_situ_linear_beta"]
[inventory]
module = "language_model.model.layers.{{layer}}.block_sparse_moe.experts.{{expert}}.{{proj}}"
layers = ["text_config.first_k_dense_replace", "text_config.num_hidden_layers"]
experts = "text_config.num_experts"
[inventory.shapes]
{shapes}
"""
K3_SHAPES = """\
w1 = ["text_config.moe_intermediate_size", "text_config.routed_expert_hidden_size"]
w2 = ["text_config.routed_expert_hidden_size", "text_config.moe_intermediate_size"]
w3 = ["text_config.moe_intermediate_size", "text_config.routed_expert_hidden_size"]
"""


def test_user_written_profile_file(fixture_src, tmp_path):
    path = tmp_path / "profiles" / "custom.toml"
    path.parent.mkdir()
    path.write_text(CUSTOM.format(shapes=K3_SHAPES))
    recorded = converts(fixture_src, str(tmp_path / "out"), "--profile", str(path))["source"]["profile"]
    assert (recorded["name"], recorded["file"], recorded["reason"]) == ("my-k3", "custom.toml", "chosen by --profile")
    # the file's inventory is the one applied: one that also wants a w4 per expert finds none
    path.write_text(CUSTOM.format(shapes=K3_SHAPES + K3_SHAPES.splitlines()[0].replace("w1", "w4")))
    n = len(k3_inventory())
    refused(fixture_src, tmp_path, f"expected {n * 4 // 3:,} expert matrices, found {n:,}",
            "layers.1.block_sparse_moe.experts.0.w4 (not in the index)", args=("--profile", str(path)))


@pytest.mark.parametrize("text, needle", [
    ("name = \n", "not valid TOML"),
    ('name = "x"\n', "lacks 'source'"),
    ('source = "compressed-tensors"\n', "lacks 'name'"),
    ('name = "x"\nsource = "compressed-tensors"\n[inventory]\nexperts = "text_config.num_experts"\n', "[inventory]"),
    (CUSTOM.format(shapes=K3_SHAPES).replace("{layer}", "{layr}"), "[inventory]"),
])
def test_broken_profile_file_is_one_line_naming_it(fixture_src, tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    refused(fixture_src, tmp_path, f"file {path}", needle, args=("--profile", str(path)))


def test_missing_profile_file(fixture_src, tmp_path):
    path = str(tmp_path / "nope.toml")
    refused(fixture_src, tmp_path, f"file {path}", "cannot read profile", args=("--profile", path))


def test_k3_profile_requires_the_situ_fields(src_copy, tmp_path):
    """The kimi-k3 profile's activation fields: a K3 config without the SiTU betas is refused even
    when hidden_act does not say situ; the generic profile only needs hidden_act."""
    cfg_path = os.path.join(src_copy, "config.json")
    cfg = read_json(cfg_path)
    cfg["text_config"]["hidden_act"] = "silu"
    del cfg["text_config"]["activation_situ_beta"], cfg["text_config"]["activation_situ_linear_beta"]
    write_json(cfg_path, cfg)
    refused(src_copy, tmp_path, f"file {cfg_path}", "activation_situ_beta", "activation_situ_linear_beta")
    manifest = converts(src_copy, str(tmp_path / "out"), "--profile", "compressed-tensors-mxfp4")
    assert manifest["activation"] == {"hidden_act": "silu"}


# ------------------------------------------------------------------ 3. incomplete download

def test_real_k3_inventory_and_the_issue_message():
    """The real model's numbers (docs/spec.md §1): 92 MoE layers x 896 experts x 3 = 247,296."""
    spec = FixtureSpec(layers=93, experts=896, hidden=7168, inter=3072, latent=3584)
    expected = profiles.expected_modules(profiles.named("kimi-k3"), k3_config(spec))
    assert expected == k3_inventory(spec) and len(expected) == 247_296
    gone = [K3_MODULE.format(layer=57, expert=e, proj="w2") for e in (3, 4, 5)]
    found = {m: s for m, s in expected.items() if m not in gone}
    where = {f"{m}.weight_packed": "model-00057-of-00096.safetensors" for m in gone}
    (msg,) = profiles.inventory_problems(expected, found, where)
    assert msg.startswith("expected 247,296 expert matrices, found 247,293: missing ")
    assert all(f"{m} (the index puts it in model-00057-of-00096.safetensors)" in msg for m in gone)


def test_missing_expert_modules_are_named(src_copy, tmp_path):
    inventory = k3_inventory()
    assert sorted(inventory) == sorted(expert_modules(src_copy))
    gone = [m for i, m in enumerate(inventory) if i in (0, 10, 23)]  # first, middle, last; 3 shards' worth
    drop_modules(src_copy, gone)
    n = len(inventory)
    err = refused(src_copy, tmp_path, f"expected {n:,} expert matrices, found {n - 3:,}: missing",
                  *(f"{m} (not in the index)" for m in gone))
    assert "more" not in err


def test_more_than_eight_missing_gives_the_count_of_the_rest(src_copy, tmp_path):
    inventory = list(k3_inventory())
    gone = inventory[::2][:11]
    drop_modules(src_copy, gone)
    err = refused(src_copy, tmp_path, f"found {len(inventory) - 11:,}", " and 3 more")
    assert all(m + " " in err for m in gone[:8]) and not any(m + " " in err for m in gone[8:])


def test_module_in_the_index_but_not_in_the_shard_is_reported_once(src_copy, tmp_path):
    module = next(m for m in k3_inventory() if m.endswith("experts.2.w2"))
    wm = read_json(os.path.join(src_copy, INDEX))["weight_map"]
    drop_modules(src_copy, [module], from_index=False)
    names = [f"{module}.weight_packed", f"{module}.weight_scale"]
    err = refused(src_copy, tmp_path, "2 problem(s)", one_line=False)
    for n in names:
        line = f"file {os.path.join(src_copy, wm[n])}, tensor {n}: in {INDEX} but not in the shard"
        assert err.count(line) == 1 and err.count(n) == 1, err
    assert "expert matrices" not in err and len(err.splitlines()) == 3


def test_expert_shape_that_differs_from_the_config(src_copy, tmp_path):
    module = next(m for m in k3_inventory() if m.endswith("experts.1.w1"))
    assert read_json(os.path.join(src_copy, "config.json"))["text_config"]["moe_intermediate_size"] == SPEC.inter
    wm = read_json(os.path.join(src_copy, INDEX))["weight_map"]
    for suffix in ("weight_packed", "weight_scale"):
        name = f"{module}.{suffix}"
        rewrite_shard(os.path.join(src_copy, wm[name]), lambda t: t.__setitem__(name, t[name][:32].clone()))
    sync_index(src_copy)
    refused(src_copy, tmp_path, f"module {module}", f"[32, {SPEC.latent}]", f"[{SPEC.inter}, {SPEC.latent}]")


# ------------------------------------------------------------------ 4. no inventory

def test_profile_without_inventory_converts_any_number_of_experts(src_copy, tmp_path):
    """The same incomplete checkpoint that kimi-k3 refuses converts under the generic profile:
    it cannot know which experts a model of unknown family should have."""
    gone = list(k3_inventory())[5:12]
    drop_modules(src_copy, gone)
    dst = str(tmp_path / "out")
    manifest = converts(src_copy, dst, "--profile", "compressed-tensors-mxfp4")
    assert sum(r["converted"] for r in manifest["shards"].values()) == len(k3_inventory()) - len(gone)
    wm = read_json(os.path.join(dst, INDEX))["weight_map"]
    assert not any(n.startswith(tuple(m + "." for m in gone)) for n in wm)


def test_orphan_scale_without_inventory_is_refused(src_copy, tmp_path):
    module = list(k3_inventory())[4]
    name = f"{module}.weight_packed"
    wm = read_json(os.path.join(src_copy, INDEX))["weight_map"]
    rewrite_shard(os.path.join(src_copy, wm[name]), lambda t: t.pop(name))
    sync_index(src_copy)
    dst = str(tmp_path / "dst")
    r = cli_convert(src_copy, dst, "--profile", "compressed-tensors-mxfp4")
    assert_clean_error(r, f"{module}.weight_scale", code=2)
    assert_not_complete(dst)
