"""The model card's serving section (issue 33 §1): every launch it recommends passes `verify --serving`
with the same flags, every one it refuses fails with the line it quotes, and the versions it names come
from the release data.

Two DSTs: a Kimi K3 one at the demo's dims (the plugin's launches pass there, stock vLLM on ROCm and
SGLang refuse) and a MiniMax-M3 one (not the plugin's: stock vLLM passes, SGLang refuses). The card's
text is parsed back, so what is checked is what a reader copies.
"""
from __future__ import annotations

import dataclasses
import re

import minimax_m3_fixture as mm3
import pytest
from click.testing import CliRunner

from converter.cli import main
from converter.fixture import FixtureSpec, make_fixture
from converter.hub.upload import model_card
from converter.releases import SGLANG, VLLM
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.servers import launches

REPO = "someone/model-int4"
_SECTION = re.compile(r"^### `(?P<server>[a-z-]+)`", re.M)
_PASSES = re.compile(r"^# .*: passes on (?P<releases>.+)$")
_REFUSED = re.compile(r"^- `(?P<flags>[^`]+)` \([^)]*\) on (?P<releases>[^:]+): (?P<why>.+)$")
_MORE = re.compile(r" \(and \d+ more\)$")


@pytest.fixture(scope="module")
def k3_dst(tmp_path_factory):
    root = tmp_path_factory.mktemp("card-k3")
    src, dst = str(root / "src"), str(root / "dst")
    make_fixture(src, FixtureSpec.demo())
    convert(src, dst, Options())
    return dst


@pytest.fixture(scope="module")
def minimax_dst(tmp_path_factory):
    """MiniMax-M3 with 8 experts, 8 heads and 256 intermediate: sizes a TP 8 launch can take."""
    root = tmp_path_factory.mktemp("card-mm3")
    src, dst = str(root / "src"), str(root / "dst")
    saved = dict(mm3.TEXT)
    mm3.TEXT.update(num_local_experts=8, num_attention_heads=8, num_key_value_heads=8, intermediate_size=256,
                    shared_intermediate_size=256)
    try:
        mm3.write(src)
    finally:
        mm3.TEXT.clear()
        mm3.TEXT.update(saved)
    convert(src, dst, Options())
    return dst


def _release_versions(names: str) -> list[str | None]:
    """'vLLM 0.33.0, vLLM 0.34.0' -> ['0.33.0', '0.34.0']; SGLang's release -> [None] (no --vllm-version)."""
    out: list[str | None] = []
    for name in (n.strip() for n in names.split(",")):
        if name == SGLANG.name:
            out.append(None)
        else:
            release = next(r for r in VLLM if r.name == name)   # a name the data does not hold fails here
            out.append(release.version)
    return out


Line = tuple[str, list[str], list[str | None]]        # server, the serve line's flags, release versions


def parse(card: str) -> tuple[list[Line], list[tuple[str, list[str], list[str | None], str]]]:
    """(recommended, refused): (server, the serve line's flags, releases) and (..., the quoted line)."""
    serving = card[card.index("## Serving"):card.index("### Any other server")]
    recommended, refused = [], []
    parts = _SECTION.split(serving)[1:]
    for server, text in zip(parts[::2], parts[1::2]):
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(("vllm serve ", "python -m sglang.launch_server ")):
                words = line.split()
                flags = words[words.index(REPO) + 1:]
                said = next(_PASSES.match(x) for x in reversed(lines[:i]) if _PASSES.match(x))
                recommended.append((server, flags, _release_versions(said["releases"])))
            elif m := _REFUSED.match(line):
                refused.append((server, m["flags"].split(), _release_versions(m["releases"]), _MORE.sub("", m["why"])))
    return recommended, refused


def _verify(dst: str, server: str, flags: list[str], version: str | None):
    args = ["verify", dst, "--no-checksums", "--serving", server, *flags]
    return CliRunner().invoke(main, args + (["--vllm-version", version] if version else []))


def _check_card(dst: str) -> tuple[list, list]:
    recommended, refused = parse(model_card(dst, repo_id=REPO))
    for server, flags, versions in recommended:
        for v in versions:
            r = _verify(dst, server, flags, v)
            assert r.exit_code == 0, (server, flags, v, r.output)
    for server, flags, versions, why in refused:
        for v in versions:
            r = _verify(dst, server, flags, v)
            assert r.exit_code == 5 and why in r.output, (server, flags, v, why, r.output)
    return recommended, refused


def test_k3_card_recommends_only_what_verify_serving_passes(k3_dst):
    recommended, refused = _check_card(k3_dst)
    plugin = {" ".join(f) for s, f, _ in recommended if s == "vllm-rocm-plugin"}
    assert plugin == {"--tensor-parallel-size 8 --enable-expert-parallel",
                      "--data-parallel-size 2 --tensor-parallel-size 8 --enable-expert-parallel"}
    assert all(v == [r.version for r in VLLM] for s, _, v in recommended if s == "vllm-rocm-plugin")
    refused_servers = {s for s, *_ in refused}
    assert {"vllm-rocm", "sglang-rocm", "sglang-cuda"} <= refused_servers
    assert any("EMULATION" in why for s, _, _, why in refused if s == "vllm-rocm")
    assert any("asserts activation == 'silu'" in why for s, _, _, why in refused if s == "sglang-rocm")


def test_k3_card_plugin_block_installs_without_deps_and_sets_aiter(k3_dst):
    card = model_card(k3_dst, repo_id=REPO)
    block = card[card.index("### `vllm-rocm-plugin`"):card.index("### `vllm-rocm`:")]
    assert "pip install --no-deps /path/to/k3convert    # a checkout or wheel of k3convert (not on PyPI)" in block
    assert "export VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1" in block
    assert block.index("export VLLM_ROCM_USE_AITER") < block.index("vllm serve")
    assert "--trust-remote-code" not in card.replace("the model needs no `--trust-remote-code`", "")
    assert "vLLM and SGLang load directly" not in card


def test_minimax_card_has_no_plugin_and_proves_stock_vllm(minimax_dst):
    recommended, refused = _check_card(minimax_dst)
    servers = {s for s, *_ in recommended}
    assert servers == {"vllm-rocm", "vllm-cuda"}
    assert {s for s, *_ in refused} == {"sglang-rocm", "sglang-cuda"}
    card = model_card(minimax_dst, repo_id=REPO)
    assert "vllm-rocm-plugin" not in card and "pip install" not in card
    assert "stays out of this model" in card


def test_a_small_k3_card_recommends_nothing_and_says_why(tmp_path):
    """At the default fixture dims (per-rank intermediate 24) every launch fails: no serve line at all,
    each refusal quoted."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_fixture(src, FixtureSpec(layers=3, experts=4))
    convert(src, dst, Options())
    recommended, refused = _check_card(dst)
    assert recommended == [] and len(refused) >= len(launches.LAUNCHES)
    card = model_card(dst, repo_id=REPO)
    assert "vllm serve" not in card and "No launch below passes" in card
    assert "KimiMoE pads intermediate 24 to 256" in card


def test_versions_come_from_the_release_data(k3_dst, monkeypatch):
    """The releases and aiter pins the card names are the release data's: change the data, the card follows."""
    card = model_card(k3_dst, repo_id=REPO)
    for r in VLLM:
        assert f"{r.name} (its ROCm image pins aiter {r.facts.aiter_pin})" in card
    moved = tuple(dataclasses.replace(r, facts=dataclasses.replace(r.facts, aiter_pin=f"v9.{i}.0"))
                  for i, r in enumerate(VLLM))
    monkeypatch.setattr(launches, "VLLM", moved)
    card = model_card(k3_dst, repo_id=REPO)
    for i, r in enumerate(VLLM):
        assert f"{r.name} (its ROCm image pins aiter v9.{i}.0)" in card
        assert r.facts.aiter_pin not in card


def test_the_uploaded_readme_is_the_checked_card(k3_dst, tmp_path):
    """What `upload` commits as README.md carries the same proven lines (through the Hub stand-in)."""
    import shutil

    from hub_standin import RecordingApi

    from converter.hub.upload import upload

    dst = str(tmp_path / "dst")
    shutil.copytree(k3_dst, dst)
    api = RecordingApi()
    upload(dst, REPO, api=api)
    readme = api.committed["README.md"].decode()
    assert readme == model_card(dst, repo_id=REPO)
    recommended, _ = parse(readme)
    assert ("vllm-rocm-plugin", ["--tensor-parallel-size", "8", "--enable-expert-parallel"],
            [r.version for r in VLLM]) in recommended


def test_k31_card_passes_only_where_a_release_builds_it(tmp_path):
    """Kimi K3.1: vLLM 0.34 builds it (CUDA passes there), 0.33 does not, and 0.34's ROCm classes have
    no DSA: the plugin's lines are all refused. Each verdict is re-checked with its own --vllm-version."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_fixture(src, FixtureSpec.demo(model_type="kimi_k31"))
    convert(src, dst, Options())
    recommended, refused = _check_card(dst)
    newest, oldest = VLLM[-1].version, VLLM[0].version
    assert {(s, v) for s, _, vs in recommended for v in vs} == {("vllm-cuda", newest)}
    plugin = {v: why for s, _, vs, why in refused if s == "vllm-rocm-plugin" for v in vs}
    assert "cannot load Kimi K3.1's DSA indexer" in plugin[newest] and "builds no model of model_type 'kimi_k31'" in plugin[oldest]


def test_a_tokenizer_in_repository_code_asks_for_trust_remote_code(k3_dst, tmp_path):
    import json
    import shutil

    dst = str(tmp_path / "dst")
    shutil.copytree(k3_dst, dst)
    assert "add `--trust-remote-code`" not in model_card(dst, repo_id=REPO)
    with open(f"{dst}/tokenizer_config.json", "w") as f:
        json.dump({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}, f)
    assert "The tokenizer is this repository's own code" in model_card(dst, repo_id=REPO)
    with open(f"{dst}/tokenizer_config.json", "w") as f:
        f.write("{not json")     # untrusted: unreadable counts as no custom code, and the card is still written
    assert "add `--trust-remote-code`" not in model_card(dst, repo_id=REPO)


def test_the_card_states_each_releases_memory_at_its_own_default():
    """Issue 41 item 3 on the card: K3 at TP 8 + EP passes on both releases, but 0.33.0 (0.92) fits no
    MI300X while 0.34.0 (1.0) does: one memory line per release, each with its GB for the KV cache."""
    from types import SimpleNamespace

    from converter.servers import launches
    from tests.servers.test_serving import k3_headers
    config, tensors = k3_headers(layers=92, experts=896)
    config["text_config"]["num_hidden_layers"] = 93
    tensors["language_model.model.embed_tokens.weight"] = SimpleNamespace(dtype="BF16", shape=(15_000_000_000 // 7168,
                                                                                                7168))
    text = launches.section(config, tensors, "ORG/K3-int4")
    block = text[text.index("# TP 8 + EP, one node"):text.index("vllm serve ORG/K3-int4 --tensor-parallel-size 8 --enable")]
    old = next(x for x in block.splitlines() if x.startswith("#   vLLM 0.33.0: "))
    new = next(x for x in block.splitlines() if x.startswith("#   vLLM 0.34.0: "))
    assert "not MI300X 192 GiB (5.53 GB short)" in old and "gpu_memory_utilization 0.92" in old, old
    assert "fits MI300X 192 GiB (11 GB left for the KV cache)" in new and "gpu_memory_utilization 1:" in new, new
