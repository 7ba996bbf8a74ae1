"""The model card of issue 40 (H10): a Hub-sourced conversion named by its repository and commit, an
NVFP4 source called NVFP4 (and not exact), the plugin installed from what is shipped, and each serving
line's "weights per rank" counting every weight a rank holds."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer

from converter.fixture import FixtureSpec, make_fixture
from converter.formats.safetensors_io import read_header
from converter.hub.card import model_card
from tests.conftest import run_cli
from tests.hub.test_card import k3_dst, minimax_dst  # noqa: F401  (module fixtures: the plugin's K3; MiniMax-M3 for stock vLLM)
from tests.models.test_nvfp4_convert import _ct_quant, _tensors, write_source

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hub_dst(tmp_path_factory):
    """A conversion of ``org/kimi-k3-mini`` straight from a local Hub, and the commit it resolved to."""
    root = tmp_path_factory.mktemp("card-hub")
    src, dst = str(root / "kimi"), str(root / "out")
    make_fixture(src, FixtureSpec(layers=3, experts=4, shards=3, seed=7))
    with HubServer(lifetime=600) as hub:
        commit = hub.add("org/kimi-k3-mini", src).sha
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(root / "cache"), "K3CONVERT_QUIET": "1",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "K3CONVERT_WORKERS": "1"}
        r = subprocess.run([sys.executable, "-m", "converter", "mxfp4-to-int4", "org/kimi-k3-mini", "-o", dst],
                           env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    return dst, commit


def test_h10_a_hub_sourced_card_names_the_repository_and_commit(hub_dst):
    """H10: the card of `mxfp4-to-int4 ORG/NAME` was titled by the commit id, had no base_model, and its
    command named the commit as a local folder."""
    dst, commit = hub_dst
    card = model_card(dst, repo_id="someone/k3-int4")
    assert card.startswith("---\nbase_model: org/kimi-k3-mini\nbase_model_relation: quantized\n"), card[:200]
    assert "\n# kimi-k3-mini — int4 (group 32) routed experts\n" in card
    assert f"An int4 version of **org/kimi-k3-mini** at commit `{commit}`" in card
    assert f"`k3convert mxfp4-to-int4 org/kimi-k3-mini@{commit} -o out " in card
    assert commit not in card.split("\n# ")[1].splitlines()[0]


@pytest.fixture(scope="module")
def nvfp4_dst(tmp_path_factory):
    root = tmp_path_factory.mktemp("card-nvfp4")
    src = write_source(str(root / "src"), _tensors(), _ct_quant(False))
    dst = str(root / "out")
    r = run_cli("mxfp4-to-int4", src, "-o", dst)
    assert r.exit_code == 0, r.output
    return dst


def test_h10_an_nvfp4_card_says_nvfp4_and_not_exact(nvfp4_dst):
    """H10: an NVFP4 source's card said "published as MXFP4" and "an exact search"."""
    card = model_card(nvfp4_dst, repo_id="someone/m-int4")
    assert "MXFP4" not in card, [x for x in card.splitlines() if "MXFP4" in x]
    assert "exact search" not in card and "Not exact" in card
    assert "published as NVFP4" in card and "## Error against the NVFP4 weights" in card
    assert "(`compressed-tensors NVFP4` →" in card


def test_h10_the_plugin_installs_from_what_is_shipped_not_a_package_name(k3_dst):  # noqa: F811
    """H10: the plugin line was `pip install --no-deps k3convert`, a package that is not published."""
    card = model_card(k3_dst, repo_id="someone/k3-int4")
    block = card[card.index("### `vllm-rocm-plugin`"):card.index("### `vllm-rocm`:")]
    assert "\npip install --no-deps /path/to/k3convert    # a checkout or wheel of k3convert (not on PyPI)" in block
    assert "pip install --no-deps k3convert" not in card


_PER_RANK = re.compile(r"^#   (?:vLLM [\d.]+: )?(?P<all>[\d.e+-]+) GB of weights per rank \(routed experts (?P<experts>[\d.e+-]+), "
                       r"the rest (?P<rest>[\d.e+-]+)\)")


def _per_rank(card: str, server: str) -> dict[str, tuple[float, float, float]]:
    """The figure under each passing launch of ``server``'s block: flags -> (all, experts, rest) in GB."""
    block = card[card.index(f"### `{server}`"):]
    block = block[: block.index("\n### ", 5)]
    out, fig = {}, None
    for line in block.splitlines():
        if m := _PER_RANK.match(line):
            fig = (float(m["all"]), float(m["experts"]), float(m["rest"]))
        elif line.startswith("vllm serve ") and fig is not None:
            out[" ".join(line.split()[3:])] = fig
            fig = None
    return out


def test_h10_weights_per_rank_count_every_weight_on_cuda_as_on_rocm(minimax_dst):  # noqa: F811
    """H10: the CUDA line's "weights per rank" counted the routed experts only (the other weights were
    summed only where a GPU size is checked, ROCm). Every launch of vLLM now counts what a rank holds:
    its experts and the rest, the replicated weights (norms: 1-D) whole; the same launch, the same figure."""
    card = model_card(minimax_dst, repo_id="someone/m-int4")
    cuda, rocm = _per_rank(card, "vllm-cuda"), _per_rank(card, "vllm-rocm")
    assert cuda and cuda.keys() == rocm.keys(), (cuda, rocm)
    tensors = {}
    for name in sorted(os.listdir(minimax_dst)):
        if name.endswith(".safetensors"):
            tensors.update(read_header(os.path.join(minimax_dst, name)).tensors)
    whole = sum(t.nbytes for n, t in tensors.items() if len(t.shape) <= 1) / 1e9
    for flags, (total, experts, rest) in cuda.items():
        assert rocm[flags] == (total, experts, rest), flags
        assert rest > 0 and rest >= whole * 0.999 and abs(total - experts - rest) <= 0.01 * total, (flags, cuda)
