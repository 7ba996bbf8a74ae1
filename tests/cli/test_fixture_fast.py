"""Issue 33 §3: the demo's output passes the launch check it teaches, and Draw.GROUPS (the
fast fixture of `make-fixture --real-dims` and the demo) is deterministic and draws what
Draw.WEIGHTS draws, as compressed-tensors decodes it."""
from __future__ import annotations

import os
import re

import pytest
import torch

from converter.fixture import Draw, FixtureSpec, make_fixture
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import all_tensors, ct_mxfp4_values, run_cli, tree_hash

LAUNCH = ["--no-checksums", "--serving", "vllm-rocm-plugin", "--tp", "8", "--ep"]
README = os.path.join(str(support.REPO), "README.md")
# two MoE layers of 2 experts, 12 tensors of 512 x 512: 3M weights, enough for histograms to agree to ~1%
HIST = FixtureSpec(layers=3, experts=2, hidden=128, inter=512, latent=512, shards=1, vocab=64, seed=5)


def test_demo_output_passes_the_launch_check_readme_teaches(tmp_path):
    """Its 192 intermediate (24 a rank at TP 8) once failed `verify --serving vllm-rocm-plugin --tp 8 --ep`."""
    work = tmp_path / "demo"
    r = run_cli("demo", "--dir", work)
    assert r.exit_code == 0, (r.output, r.exception)
    dst = work / "kimi-k3-fixture-int4"
    command = f"k3convert verify {dst} {' '.join(LAUNCH)}"
    assert command in r.stderr, r.stderr  # the demo says which launch check it passes, as a command
    v = run_cli("verify", dst, *LAUNCH)
    assert v.exit_code == 0 and v.stdout.splitlines()[-1] == "result: PASS", v.output
    assert re.search(r"PASS  serving +vllm-rocm-plugin at TP 8 \+ EP", v.stdout), v.stdout
    with open(README) as f:  # the check README teaches (8x MI325X) is that one, and it says the demo passes it
        text = f.read()
    assert re.search(rf"^ *k3convert verify \S+ {' '.join(LAUNCH)} +# 8x MI325X$", text, re.M)
    said = f"keeps it and says where; its output passes `k3convert verify DST {' '.join(LAUNCH)}`"
    assert said in text


def test_demo_fails_when_its_output_fails_the_launch_check(tmp_path, monkeypatch):
    """The demo runs the check it announces: the old shape (192 intermediate) exits 5, naming the rule."""
    monkeypatch.setattr(FixtureSpec, "demo", classmethod(lambda cls, **kw: cls(**kw)))
    r = run_cli("demo", "--dir", tmp_path / "d")
    assert r.exit_code == 5, (r.output, r.exception)
    assert re.search(r"serving: .*\b24\b.*\b256\b", r.stderr), r.stderr  # KimiMoE pads 24 to 256 a rank


def test_real_dims_and_demo_dims_are_exclusive(tmp_path):
    r = run_cli("make-fixture", tmp_path / "f", "--real-dims", "--demo-dims")
    assert r.exit_code == 2 and "--real-dims and --demo-dims" in r.stderr, r.output
    assert not os.path.exists(tmp_path / "f")


def test_only_the_named_shapes_draw_groups():
    """FixtureSpec()'s bytes (every test's fixtures) are Draw.WEIGHTS's, unchanged."""
    assert FixtureSpec().draw is Draw.WEIGHTS
    assert FixtureSpec.real_dims().draw is Draw.GROUPS and FixtureSpec.demo().draw is Draw.GROUPS
    assert FixtureSpec.real_dims(draw=Draw.WEIGHTS).draw is Draw.WEIGHTS


def test_groups_are_deterministic_by_seed(tmp_path):
    spec = FixtureSpec(layers=3, experts=2, hidden=128, inter=256, latent=128, shards=2, seed=3, draw=Draw.GROUPS)
    make_fixture(str(tmp_path / "a"), spec)
    make_fixture(str(tmp_path / "b"), spec)
    make_fixture(str(tmp_path / "c"), FixtureSpec(**{**spec.__dict__, "seed": 4}))
    a, b, c = (tree_hash(str(tmp_path / x)) for x in "abc")
    assert a == b
    shards = [k for k in a if k.endswith(".safetensors")]
    assert len(shards) == 2 and all(a[k] != c[k] for k in shards)


def _experts(root: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every expert's E2M1 codes and E8M0 bytes, and their values as compressed-tensors decodes them."""
    t = {k: v for k, (_, v) in all_tensors(root).items()}
    names = sorted(k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed"))
    packed = [t[n + ".weight_packed"] for n in names]
    scales = [t[n + ".weight_scale"] for n in names]
    codes = torch.cat([torch.stack((p & 15, p >> 4), -1).reshape(-1) for p in packed])
    values = torch.cat([ct_mxfp4_values(p, s).reshape(-1) for p, s in zip(packed, scales)])
    return codes.long(), torch.cat([s.reshape(-1) for s in scales]).long(), values


def _hist(x: torch.Tensor, bins: int) -> torch.Tensor:
    return torch.bincount(x, minlength=bins).double() / x.numel()


def test_groups_decode_to_what_encoding_each_weight_gives(tmp_path):
    """Same code and scale histograms and value quantiles as Draw.WEIGHTS (Student-t weights encoded),
    read back through compressed-tensors; every E2M1 code appears and the scales vary."""
    make_fixture(str(tmp_path / "w"), HIST)
    make_fixture(str(tmp_path / "g"), FixtureSpec(**{**HIST.__dict__, "draw": Draw.GROUPS}))
    (cw, sw, vw), (cg, sg, vg) = _experts(str(tmp_path / "w")), _experts(str(tmp_path / "g"))
    assert cg.numel() == cw.numel() == 12 * 512 * 512
    hw, hg = _hist(cw, 16), _hist(cg, 16)
    assert (hg > 1e-4).all(), hg  # every code, both signs of every level
    assert 0.5 * (hw - hg).abs().sum() < 0.01, (hw, hg)  # total variation distance
    assert abs(hg[:8].sum() - 0.5) < 0.01  # as many positive codes as negative ones
    kw, kg = _hist(sw, 256), _hist(sg, 256)
    assert (kg > 0).sum() >= 5 and (kg > 0.05).sum() >= 3 and kg.max() < 0.7, kg  # the scales vary, as Student-t's
    assert 0.5 * (kw - kg).abs().sum() < 0.02, (kw.nonzero().flatten(), kg.nonzero().flatten())
    assert torch.isfinite(vg).all()
    q = torch.tensor([0.5, 0.9, 0.99, 0.999], dtype=torch.float64)
    qw, qg = torch.quantile(vw.abs()[::7], q), torch.quantile(vg.abs()[::7], q)
    assert torch.allclose(qg, qw, rtol=0.1), (qw, qg)  # heavy tails included


@pytest.mark.parametrize("draw", list(Draw))
def test_each_draw_writes_the_same_layout(draw, tmp_path):
    """Same names, shapes and shards: only the bytes differ."""
    spec = FixtureSpec(layers=3, experts=2, shards=2, draw=draw)
    make_fixture(str(tmp_path / "x"), spec)
    make_fixture(str(tmp_path / "y"), FixtureSpec(**{**spec.__dict__, "draw": Draw.WEIGHTS}))
    x, y = all_tensors(str(tmp_path / "x")), all_tensors(str(tmp_path / "y"))
    layout = [{k: (s, v.shape, v.dtype) for k, (s, v) in t.items()} for t in (x, y)]
    assert layout[0] == layout[1]


def test_make_fixture_draw_option(tmp_path):
    """`--draw weights` gives the bytes of fixtures before Draw.GROUPS (benchmarks measured on them)."""
    shape = ["--demo-dims", "--layers", "2", "--experts", "1", "--shards", "1"]
    spec = FixtureSpec.demo(layers=2, experts=1, shards=1)
    for draw, flags in ((Draw.WEIGHTS, ["--draw", "weights"]), (Draw.GROUPS, [])):
        r = run_cli("make-fixture", tmp_path / draw.value, *shape, *flags)
        assert r.exit_code == 0, r.output
        make_fixture(str(tmp_path / f"lib-{draw.value}"), FixtureSpec(**{**spec.__dict__, "draw": draw}))
        assert tree_hash(str(tmp_path / draw.value)) == tree_hash(str(tmp_path / f"lib-{draw.value}"))
    assert tree_hash(str(tmp_path / "weights")) != tree_hash(str(tmp_path / "groups"))
