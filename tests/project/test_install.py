"""Installing k3convert into an environment that already has torch (a ROCm or vLLM image) leaves that
torch alone (issue 33 §2): the plugin's `pip install --no-deps`, and a plain `pip install` whose
ranges (pyproject `dependencies`) the present torch satisfies.

A throwaway venv with ``--system-site-packages`` stands in for the image: it sees this Python's torch
and every other dependency. pip runs offline (``--no-index``, ``--no-build-isolation``), so nothing
can be fetched: a range the environment did not satisfy would fail the install here instead of
downloading a torch. The package is built from a copy of the files it ships (pyproject, README,
converter/, configs/), so the checkout gets no build/ or egg-info.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = ("pyproject.toml", "README.md", "converter", "configs")
PROBE = """
import json, importlib.metadata as m, torch, converter
eps = [e.value for e in m.entry_points(group="vllm.general_plugins") if e.name == "k3convert"]
print(json.dumps({"torch": torch.__version__, "torch_file": torch.__file__, "converter": converter.__file__,
                  "plugin": eps}))
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> str:
    """A copy of what the package ships, to build from."""
    src = tmp_path_factory.mktemp("install") / "k3convert"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SHIPPED:
        path = os.path.join(ROOT, name)
        (shutil.copytree(path, src / name, ignore=ignore) if os.path.isdir(path) else shutil.copy(path, src / name))
    return str(src)


@pytest.fixture
def image(tmp_path) -> str:
    """A fresh venv that sees this Python's packages (torch among them); its python. pip and setuptools
    are the system's too (no ensurepip: its bundled setuptools would shadow the system's)."""
    if sys.prefix != sys.base_prefix:
        pytest.skip("already inside a venv: --system-site-packages would see the base Python, not this one")
    venv.EnvBuilder(system_site_packages=True).create(tmp_path / "venv")
    return str(tmp_path / "venv" / "bin" / "python")


def _pip(python: str, *args: str) -> None:
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
                        "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _probe(python: str) -> dict:
    r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _own_packages(python: str) -> set[str]:
    """Distributions installed into the venv itself (not the system site it sees)."""
    r = subprocess.run([python, "-c", "import json, importlib.metadata as m, sys\n"
                        "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions(path=["
                        "p for p in sys.path if p.startswith(sys.prefix) and p.endswith('site-packages')]))))"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout))


@pytest.mark.parametrize("how", [["--no-deps"], []], ids=["plugin-no-deps", "with-deps-from-ranges"])
def test_install_leaves_the_images_torch_alone(image, sources, how):
    python = image
    _pip(python, *how, sources)
    got = _probe(python)
    assert (got["torch"], got["torch_file"]) == (torch.__version__, torch.__file__)   # the image's, unchanged
    assert got["converter"].startswith(os.path.dirname(os.path.dirname(python)))      # installed in the venv
    assert got["plugin"] == ["converter.vllm_plugin:register"]                         # vLLM will load it
    own = _own_packages(python)
    assert "k3convert" in own and "torch" not in own and not any(p.startswith("nvidia-") for p in own), own
