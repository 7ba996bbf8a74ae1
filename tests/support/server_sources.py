"""vLLM 0.33's and aiter's own layout code, loaded from their released sources (never copied here).

Shared by tests/vllm_plugin/test_vllm_plugin.py and tests/support/vllm_plugin_probe.py (which runs without pytest): the
expected bytes of every layout test come from these, not from the plugin.
"""
from __future__ import annotations

import ast
import types
from pathlib import Path

import torch

FLYDSL = "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a16_flydsl.py"
MXFP4 = "model_executor/layers/quantization/mxfp4.py"


def released_file(env: str, rel: str) -> Path:
    """``rel`` under the released sources that ``env`` names (scripts/tools/fetch_server_sources.sh), else a
    skip saying what is missing: a failure under K3CONVERT_REQUIRE_VLLM=1 (CI fetches them)."""
    import os

    import pytest

    root = os.environ.get(env)
    if root and Path(root, rel).is_file():
        return Path(root, rel)
    why = f"{env} unset or without {rel} (run scripts/tools/fetch_server_sources.sh)"
    if os.environ.get("K3CONVERT_REQUIRE_VLLM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def functions(path: Path, names: set[str], namespace: dict, cls: str | None = None) -> dict:
    """Compile only the named top-level functions (or methods of `cls`) of a file we did not write."""
    tree = ast.parse(Path(path).read_text())
    scope = tree.body if cls is None else next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in found} == names, f"{path} lacks {names - {n.name for n in found}}"
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


# the layout functions the tests take from aiter/ops/shuffle.py; the first is in every release, the
# other two only in ROCm builds (PyPI's amd-aiter 0.1.7.post2.dev18 has neither)
AITER_LAYOUT = ("shuffle_weight", "pack_int8_to_packed_int4", "shuffle_scale_for_int4")


def aiter_shuffle(path: Path) -> types.ModuleType:
    """aiter's own aiter/ops/shuffle.py, whichever release: only its torch imports and the layout
    functions (``AITER_LAYOUT``, those it has) are run. Importing the file whole would run its other
    imports: from v0.1.20 on it imports ``aiter.jit`` (line 7), which needs a ROCm build of aiter."""
    tree = ast.parse(Path(path).read_text(), str(path))

    def torch_import(n: ast.stmt) -> bool:
        if isinstance(n, ast.Import):
            return all(a.name.split(".")[0] == "torch" for a in n.names)
        return isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch"
    body = [n for n in tree.body if torch_import(n)
            or isinstance(n, ast.FunctionDef) and n.name in AITER_LAYOUT]
    assert AITER_LAYOUT[0] in {n.name for n in body if isinstance(n, ast.FunctionDef)}, f"{path} has no shuffle_weight"
    mod = types.ModuleType("aiter_shuffle_layout")
    mod.__file__ = str(path)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), mod.__dict__)
    return mod


def vllm_flydsl(flydsl_path: Path, shuffle_weight) -> dict:
    """vLLM 0.33's CT int4 -> FlyDSL helpers and method, with aiter's real shuffle_weight."""
    ns = {"torch": torch, "shuffle_weight": shuffle_weight,
          "replace_parameter": lambda lyr, name, t: setattr(lyr, name, t)}
    names = {"_unpack_gptq_int32_to_signed_int4", "_pack_shuffled_int8_to_packed_int4_no_perm",
             "_gptq_int32_to_flydsl_packed"}
    functions(flydsl_path, names, ns)
    functions(flydsl_path, {"process_weights_after_loading"}, ns, cls="CompressedTensorsW4A16FlydslMoEMethod")
    return ns


def vllm_scale_relayout(ns: dict):
    """shuffle_scale_for_int4's contract ([E, G, N] -> [E, G/2, N, 2]) computed by vLLM's own FlyDSL
    scale relayout, run through the method that holds it."""
    def shuffle_scale_for_int4(scale, group_size=32):
        assert group_size == 32
        e, g, n = scale.shape
        dummy = torch.zeros(e, 4, 16, dtype=torch.int32)
        lyr = types.SimpleNamespace(w13_weight_packed=dummy, w2_weight_packed=dummy.clone(),
                                    w13_weight_scale=scale, w2_weight_scale=scale)
        ns["process_weights_after_loading"](types.SimpleNamespace(group_size=32), lyr)
        return lyr.w13_weight_scale.view(e, g // 2, n, 2)
    return shuffle_scale_for_int4
