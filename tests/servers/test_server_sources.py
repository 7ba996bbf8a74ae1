"""The reader of aiter's layout functions (tests/support/server_sources.py aiter_shuffle) takes aiter's real files.

From v0.1.20 on aiter's ``aiter/ops/shuffle.py`` imports ``aiter.jit`` (line 7), which only a ROCm build of
aiter has; importing the file whole then fails before any function is read. The file such a release ships
is built here from PyPI's amd-aiter 0.1.7.post2.dev18 (K3CONVERT_AITER_SRC): its functions, with v0.1.20's
imports (torch, torch.nn.functional as F, then ``from aiter.jit.utils.chip_info import get_gfx``) and one of
its functions that calls ``get_gfx``. Nothing of aiter is copied into the repository.
"""
from __future__ import annotations

import sys

import server_sources
import torch

V0120_HEAD = ("# SPDX-License-Identifier: MIT\n\nimport torch\nimport torch.nn.functional as F\n\n"
              "from aiter.jit.utils.chip_info import get_gfx\n\n\n")
V0120_GFX = ('\n\ndef moe_shuffle_weight(x, layout=(16, 16)):\n    if get_gfx() == "gfx1250":\n'
             '        raise NotImplementedError\n    return shuffle_weight(x, layout)\n')
# shuffle_weight's K padding as v0.1.20 has it: F.pad, so F must be in the functions' globals
V0120_PAD = ("\n\ndef shuffle_scale_for_int4(scale, group_size=32):\n    if group_size != 32:\n"
             "        raise ValueError(group_size)\n    e, g, n = scale.shape\n"
             "    return F.pad(scale, (0, 0)).view(e, g // 2, 2, n).permute(0, 1, 3, 2).contiguous()\n")


def released_shuffle() -> str:
    return server_sources.released_file("K3CONVERT_AITER_SRC", "ops/shuffle.py").read_text()


def test_reader_takes_an_aiter_file_that_imports_aiter_jit(tmp_path):
    """Pointed at a v0.1.20-shaped shuffle.py, the reader gives the same shuffle_weight as the PyPI file's,
    and its shuffle_scale_for_int4 (which needs F), without importing aiter."""
    pypi = released_shuffle()
    body = pypi[pypi.index("\nimport torch\n") + len("\nimport torch\n"):]
    path = tmp_path / "shuffle.py"
    path.write_text(V0120_HEAD + body + V0120_GFX + V0120_PAD)
    before = set(sys.modules)
    theirs = server_sources.aiter_shuffle(path)
    assert not any(m == "aiter" or m.startswith("aiter.") for m in set(sys.modules) - before)
    assert not hasattr(theirs, "moe_shuffle_weight"), "only the layout functions are read"
    plain = tmp_path / "plain.py"
    plain.write_text(pypi)
    ref = server_sources.aiter_shuffle(plain)
    x = torch.arange(2 * 32 * 64, dtype=torch.int32).remainder(251).to(torch.int8).view(2, 32, 64)
    assert torch.equal(theirs.shuffle_weight(x.clone(), (16, 16)), ref.shuffle_weight(x.clone(), (16, 16)))
    assert not torch.equal(theirs.shuffle_weight(x.clone(), (16, 16)), x)
    s = torch.arange(2 * 4 * 16, dtype=torch.float32).to(torch.bfloat16).view(2, 4, 16)
    out = theirs.shuffle_scale_for_int4(s)
    assert out.shape == (2, 2, 16, 2) and torch.equal(out[1, 1, 3], s[1, 2:4, 3])


def test_reader_refuses_a_file_without_shuffle_weight(tmp_path):
    """A file that is not aiter's layout module is one clear failure, not a half-read module."""
    path = tmp_path / "shuffle.py"
    path.write_text("import torch\nfrom aiter.jit.utils.chip_info import get_gfx\n\ndef other(x):\n    return x\n")
    try:
        server_sources.aiter_shuffle(path)
    except AssertionError as e:
        assert "no shuffle_weight" in str(e)
    else:
        raise AssertionError("a file without shuffle_weight was read")
