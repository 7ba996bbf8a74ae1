"""Helpers and fixtures the tests share: checkpoint builders, the local Hub, the simulated aiter, the
server-source readers, and the scripts that run inside vLLM's own environments.

tests/conftest.py puts this folder on ``sys.path``, so a test imports a helper by its module name
(``import aiter_sim``) and the scripts here that run as files in other environments (``vllm_scripts/``,
``vllm_serve.py``, ``vllm_plugin_probe.py``) import the same modules the same way.
"""
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
DATA = SUPPORT / "data"
