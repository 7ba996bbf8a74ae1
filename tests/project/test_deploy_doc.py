"""docs/deploy.md and README's serve step (issue 33 §5): what a deployer needs is on the page, the
versions named are the release data's, and the vLLM lines cited for `--trust-remote-code` say what
the page says they do.

The citation test reads vLLM's released files where K3CONVERT_VLLM033_SRC / K3CONVERT_VLLM034_SRC
point at them (the `vllm/` package of each wheel) and holds the files cited; it skips otherwise
(scripts/tools/fetch_server_sources.sh does not keep these files, so CI's REQUIRE switch does not apply).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from converter.releases import VLLM
from converter.state.files import MANIFEST

ROOT = Path(__file__).parents[2]
DEPLOY = (ROOT / "docs" / "deploy.md").read_text()
FLAT = " ".join(DEPLOY.split())
README = " ".join((ROOT / "README.md").read_text().split())


def test_each_proven_release_has_its_image_and_aiter_pin():
    rows = [line for line in DEPLOY.splitlines() if line.startswith("| 0.")]
    for r in VLLM:
        (row,) = [x for x in rows if x.startswith(f"| {r.version} (")]
        assert r.facts.aiter_pin in row and f"vllm/vllm-openai-rocm:v{r.version}" in row, row
    assert len(rows) == len(VLLM)     # a release the data does not prove has no row


def test_readme_serve_step_names_the_proven_releases_and_their_pins():
    step = README[README.index("3. **Serve**"):README.index("4. **Success**")]
    for r in VLLM:
        assert f"{r.series[0]}.{r.series[1]}" in step and r.facts.aiter_pin in step, step
    assert "vLLM 0.33's ROCm image" not in step


def test_download_step_and_disk():
    assert "hf download moonshotai/Kimi-K3 --local-dir /models/Kimi-K3" in DEPLOY
    experts = 92 * 896 * 3 * 3072 * 3584                          # docs/spec.md §1
    output = 1.45e12 + experts * (4.5 - 4.25) / 8                   # the bits each expert weight gains
    assert f"about **{output / 1e12:.2f} TB**" in FLAT and "about **1.45 TB**" in FLAT
    assert "about **3 TB** for both" in FLAT and "--dry-run" in DEPLOY


def test_two_nodes_interfaces_same_path_and_agreement():
    launch = DEPLOY[DEPLOY.index("**2x8 MI300X: DP 2 x TP 8 + EP**"):DEPLOY.index("**2x8 MI300X: PP 2 x TP 8**")]
    assert launch.count("export NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0") == 2   # on each node
    assert "the model at the **same path**" in FLAT
    assert f"sha256sum /models/Kimi-K3-int4/{MANIFEST}" in DEPLOY
    assert "k3convert verify /models/Kimi-K3-int4 --no-checksums" in DEPLOY


def test_convert_on_cpu_where_the_rocm_kernel_never_ran():
    assert "`--devices cpu`" in DEPLOY and "never run on ROCm" in FLAT


# (wheel, file, line, text the line holds) for every line the --trust-remote-code paragraph cites
CITED = [
    ("K3CONVERT_VLLM033_SRC", "model_executor/models/registry.py", 488, '"KimiK3ForConditionalGeneration": ('),
    ("K3CONVERT_VLLM034_SRC", "model_executor/models/registry.py", 489, '"KimiK3ForConditionalGeneration": ('),
    ("K3CONVERT_VLLM034_SRC", "model_executor/models/registry.py", 493, '"KimiK31ForConditionalGeneration": ('),
    ("K3CONVERT_VLLM034_SRC", "model_executor/models/registry.py", 495, '"KimiK3ForConditionalGeneration",'),
    ("K3CONVERT_VLLM033_SRC", "transformers_utils/config.py", 151, 'kimi_k3="KimiK3Config"'),
    ("K3CONVERT_VLLM034_SRC", "transformers_utils/config.py", 152, 'kimi_k31="KimiK3Config"'),
    ("K3CONVERT_VLLM033_SRC", "transformers_utils/config.py", 426, "if model_type in _CONFIG_REGISTRY:"),
    ("K3CONVERT_VLLM033_SRC", "transformers_utils/config.py", 442, "trust_remote_code = False"),
    ("K3CONVERT_VLLM034_SRC", "transformers_utils/config.py", 459, "if model_type in _CONFIG_REGISTRY:"),
    ("K3CONVERT_VLLM034_SRC", "transformers_utils/config.py", 475, "trust_remote_code = False"),
    ("K3CONVERT_VLLM033_SRC", "tokenizers/registry.py", 56, '"kimi_k3": ("hf", "CachedHfTokenizer")'),
    ("K3CONVERT_VLLM034_SRC", "tokenizers/registry.py", 58, '"kimi_k3": ("hf", "CachedHfTokenizer")'),
    ("K3CONVERT_VLLM034_SRC", "tokenizers/hf.py", 173, "def from_pretrained("),
    ("K3CONVERT_VLLM034_SRC", "tokenizers/hf.py", 196, "does not exist or is not currently imported."),
]


def test_the_page_cites_each_line():
    para = FLAT[FLAT.index("**`--trust-remote-code`: not for the model.**"):FLAT.index("**8x MI325X, one node")]
    spans = [(int(a), int(b or a)) for a, b in re.findall(r"\b(\d{2,4})(?:-(\d{2,4}))?\b", para)]
    for _, rel, line, _ in CITED:
        assert rel.split("/")[-1] in para and any(a <= line <= b for a, b in spans), (rel, line)


@pytest.mark.parametrize("env, rel, line, text", CITED,
                         ids=[f"{e[-7:-4]}:{r.split('/')[-1]}:{n}" for e, r, n, _ in CITED])
def test_the_cited_vllm_lines_say_so(env, rel, line, text):
    root = os.environ.get(env)
    path = Path(root or "/nonexistent", rel)
    if not path.is_file():
        pytest.skip(f"{env} unset or without {rel} (the `vllm/` package of that release's wheel)")
    assert text in path.read_text().splitlines()[line - 1], (env, rel, line)
