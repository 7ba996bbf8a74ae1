"""verify as a package of per-check modules (issue 24 §2): a plain verify loads only what its
checks need, a missing path says so, and a check is added by one module in ``CHECKS``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import converter
from converter.checks import Check
from tests.conftest import assert_clean_error, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(converter.__file__)))


def _in_child(code: str) -> dict:
    """Run ``code`` in a fresh interpreter importing this tree's converter; its last line is JSON."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plain_verify_imports_neither_torch_nor_compressed_tensors(converted_default):
    """The structural checks read headers and JSON: torch (~2 s, 200 MB) and compressed-tensors
    (transformers: ~5 s) are loaded only by the checks that decode tensors (--source)."""
    _, dst = converted_default
    got = _in_child(f"""
import json, sys
from converter.verify import verify
r = verify({dst!r})
print(json.dumps({{"ok": r.ok, "loaded": sorted(m for m in ("torch", "numba", "compressed_tensors", "transformers",
                                                           "safetensors") if m in sys.modules)}}))
""")
    assert got == {"ok": True, "loaded": []}


def test_verify_with_source_still_asks_compressed_tensors(converted_default):
    """With --source the selection is decided by compressed-tensors' is_match itself."""
    src, dst = converted_default
    got = _in_child(f"""
import json, sys
from converter.verify import verify
r = verify({dst!r}, {src!r}, sample=1, checksums=False)
print(json.dumps({{"ok": r.ok, "ct": "compressed_tensors.utils.match" in sys.modules,
                  "config": r.check("config").summary}}))
""")
    assert got["ok"] and got["ct"] and "compressed-tensors' is_match" in got["config"], got


def test_missing_dst_or_source_says_it_does_not_exist(converted_default, tmp_path):
    _, dst = converted_default
    assert_clean_error(run_cli("verify", tmp_path / "nope"), str(tmp_path / "nope"), "does not exist", code=2)
    assert_clean_error(run_cli("verify", dst, "--source", tmp_path / "nosrc"), "does not exist", code=2)
    (tmp_path / "file").write_text("x")
    assert_clean_error(run_cli("verify", tmp_path / "file"), "not a directory", code=2)


def test_a_check_is_one_module_in_the_ordered_list(converted_default, monkeypatch):
    """Every entry of CHECKS is a module with ``run``; a new one is reported in its place."""
    import types

    from converter import verify as v

    assert all(callable(getattr(m, "run", None)) for m in v.CHECKS)
    extra = types.ModuleType("extra")
    extra.run = lambda ctx: [Check("extra", f"{len(ctx.dst.headers)} shard(s)")]
    at = v.CHECKS.index(v.figures)
    monkeypatch.setattr(v, "CHECKS", v.CHECKS[:at] + (extra,) + v.CHECKS[at:])
    names = [c.name for c in v.verify(converted_default[1], checksums=False).checks]
    assert names == ["manifest", "checksums", "files", "index", "config", "tensors", "situ", "extra", "figures",
                     "re-decode"]
