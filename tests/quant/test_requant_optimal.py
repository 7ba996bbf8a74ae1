"""The requantizer is exactly error-optimal: checked against brute force over every bf16 scale,
for both code ranges ([-8, 7]: ``optimal``; [-7, 7]: ``optimal-pm7``)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from converter.quant.requant import STAT_FIELDS, requantize
from converter.quant.tables import E2M1_VALUES

ALL_BF16_POSITIVE = torch.arange(0x0080, 0x7F80, dtype=torch.int32)  # every positive normal bf16


def decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 groups -> float64 values [G, 32], written independently of converter.quant."""
    codes = torch.stack((packed & 15, packed >> 4), dim=2).reshape(packed.shape[0], 32).long()
    lut = torch.from_numpy(E2M1_VALUES)
    return lut[codes] * torch.pow(2.0, scales.double() - 127)[:, None]


def brute_force(values: torch.Tensor, qmin: int = -8) -> tuple[torch.Tensor, torch.Tensor]:
    """Min squared error over every positive normal bf16 scale (codes in ``[qmin, 7]``), and the
    largest scale reaching it."""
    scales = (ALL_BF16_POSITIVE << 16).view(torch.float32).double()
    best_err = torch.full((values.shape[0],), float("inf"), dtype=torch.float64)
    best_scale = torch.zeros(values.shape[0], dtype=torch.float64)
    for chunk in scales.split(2048):
        q = torch.clamp(torch.round(values[:, None, :] / chunk[None, :, None]), qmin, 7)
        err = ((q * chunk[None, :, None] - values[:, None, :]) ** 2).sum(2)  # [G, S]
        e, _ = err.min(1)
        # the largest scale among the minima in this chunk (chunks ascend)
        last = (err == e[:, None]).to(torch.int64).cumsum(1).argmax(1)
        s = chunk[last]
        better = e < best_err
        tie = e == best_err
        best_scale = torch.where(better | tie, s, best_scale)
        best_err = torch.minimum(e, best_err)
    return best_err, best_scale


def int4_values(res_packed: torch.Tensor, res_scales: torch.Tensor) -> torch.Tensor:
    q = torch.stack((res_packed & 15, res_packed >> 4), 2).reshape(res_packed.shape[0], 32).double() - 8
    return q * res_scales.double()[:, None]


def adversarial_groups(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    def group(codes, s):
        codes = np.asarray(codes, dtype=np.uint8)
        return codes[0::2] | (codes[1::2] << 4), s
    cases = [
        group([0] * 32, 127), group([8] * 32, 3),          # all zero (+0 and -0)
        group([7] * 32, 127), group([15] * 32, 127),        # all +6, all -6
        group([7] + [0] * 31, 127), group([15] + [1] * 31, 100),  # single outlier
        group([6] + [9] * 31, 127), group([14] + [1] * 31, 127),  # +4 / -4 outliers
        group(list(range(16)) * 2, 127),                     # every code
        group([7, 15] * 16, 120), group([6, 7, 5] * 10 + [1, 9], 130),
        group(rng.integers(0, 16, 32), 6), group(rng.integers(0, 16, 32), 7),   # tiny exponents
        group(rng.integers(0, 16, 32), 252), group([1, 2, 3] * 10 + [4, 5], 253),  # huge exponents
    ]
    packed = torch.from_numpy(np.stack([c[0] for c in cases]))
    scales = torch.tensor([c[1] for c in cases], dtype=torch.uint8)
    return packed, scales


def random_groups(rng: np.random.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform codes, and codes of quantized Student-t data (largest |value| 4 or 6)."""
    uniform = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    w = rng.standard_t(4, size=(n, 32))
    e = np.floor(np.log2(np.abs(w).max(1, keepdims=True))) - 2
    mag = np.abs(w) / 2.0**e
    levels = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    code = np.abs(mag[..., None] - levels).argmin(-1) | ((w < 0) * 8)
    student = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    packed = torch.from_numpy(np.concatenate([uniform, student]))
    scales = torch.from_numpy(rng.integers(100, 140, 2 * n).astype(np.uint8))
    return packed, scales


def two_value_groups() -> tuple[torch.Tensor, torch.Tensor]:
    """Every top code (both signs) with every smaller non-zero code at 1, 8, 16 or 31 copies: the
    histograms nearest the LPs' vertices, where a wrongly pruned multiplier would show."""
    rows = []
    for top in range(1, 8):
        for sign in (0, 8):
            for c in [c for c in range(1, 16) if 0 < (c & 7) < top]:
                for k in (1, 8, 16, 31):
                    rows.append([top | sign] * (32 - k) + [c] * k)
    codes = np.array(rows, dtype=np.uint8)
    packed = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))
    return packed, torch.full((len(rows),), 127, dtype=torch.uint8)


@pytest.mark.parametrize("qmin", [-8, -7])
@pytest.mark.parametrize("source", ["adversarial", "random", "two-value"])
def test_matches_brute_force_over_every_bf16_scale(source, qmin):
    rng = np.random.default_rng(1234)
    packed, scales = {"adversarial": lambda: adversarial_groups(rng), "random": lambda: random_groups(rng, 150),
                      "two-value": two_value_groups}[source]()
    res = requantize(packed, scales, qmin=qmin)
    assert res.stats[0, STAT_FIELDS.index("nan_scale")] == 0
    assert res.stats[0, STAT_FIELDS.index("out_of_range")] == 0
    values = decode(packed, scales)
    ours = ((int4_values(res.packed, res.scales) - values) ** 2).sum(1)
    best_err, best_scale = brute_force(values, qmin)
    nonzero = values.abs().amax(1) > 0
    # the range is the one searched: -8 (nibble 0) is written only when allowed, and then it is used
    assert bool((torch.cat((res.packed & 15, res.packed >> 4), 1) == 0).any()) == (qmin == -8)
    assert torch.equal(ours, best_err), (ours - best_err).abs().max()
    # same scale as the brute force's tie rule (largest scale among the optima)
    assert torch.equal(res.scales.double()[nonzero], best_scale[nonzero])
    assert torch.all(res.scales.double()[~nonzero] == 0)
    # figures agree with a direct computation
    assert res.stats[0, 0].item() == pytest.approx(float(ours.sum()), rel=1e-12)
    assert res.stats[0, 1].item() == pytest.approx(float((values**2).sum()), rel=1e-12)


def test_bad_scales_are_counted_not_written():
    packed = torch.full((4, 16), 0x77, dtype=torch.uint8)  # all +6: best m = 6
    packed[1] = 0x11  # all +0.5: best m = 0.5
    scales = torch.tensor([255, 0, 254, 127], dtype=torch.uint8)
    res = requantize(packed, scales, [0, 1, 4])
    assert res.stats[0, STAT_FIELDS.index("nan_scale")] == 1
    # s=0: 2**-127 * 0.5 is subnormal; s=254: 2**127 * 6 overflows bf16
    assert res.stats[1, STAT_FIELDS.index("out_of_range")] == 2
    assert torch.isfinite(res.scales.float()).all()


def test_deterministic_and_chunk_independent(monkeypatch):
    rng = np.random.default_rng(7)
    packed, scales = random_groups(rng, 3000)
    a = requantize(packed, scales)
    import converter.quant.requant as r
    monkeypatch.setattr(r, "CHUNK_GROUPS", 257)
    b = r.requantize(packed, scales, [0, 1000, 6000])
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))


def test_forbidding_minus_8_costs_error_where_the_optimum_uses_it():
    """The two ranges differ exactly where the [-8, 7] optimum writes -8: there [-7, 7] is worse,
    elsewhere the bytes are the same (so the two searches cannot be mixed up)."""
    rng = np.random.default_rng(5)
    packed, scales = random_groups(rng, 2000)
    a, b = requantize(packed, scales), requantize(packed, scales, qmin=-7)
    values = decode(packed, scales)
    ea = ((int4_values(a.packed, a.scales) - values) ** 2).sum(1)
    eb = ((int4_values(b.packed, b.scales) - values) ** 2).sum(1)
    uses8 = (torch.cat((a.packed & 15, a.packed >> 4), 1) == 0).any(1)
    assert 0 < int(uses8.sum()) < len(uses8)
    assert torch.all(eb[uses8] > ea[uses8])
    assert torch.equal(a.packed[~uses8], b.packed[~uses8]) and torch.equal(a.scales[~uses8], b.scales[~uses8])


@pytest.mark.parametrize("qmin", [-8, -7])
def test_numba_kernel_gives_the_reference_bytes(qmin):
    """The fast CPU kernel (int32 class scores) and the float reference agree byte for byte."""
    from converter.quant import cpu_kernel

    rng = np.random.default_rng(99)
    packed, scales = random_groups(rng, 20000)
    adv_p, adv_s = adversarial_groups(rng)
    packed, scales = torch.cat([adv_p, packed]), torch.cat([adv_s, scales])
    offsets = [0, 15, 7000, 7001, packed.shape[0]]
    ref = requantize(packed, scales, offsets, qmin=qmin)
    fast = cpu_kernel.requantize(packed, scales, offsets, qmin=qmin)
    assert torch.equal(fast.packed, ref.packed)
    assert torch.equal(fast.scales.view(torch.int16), ref.scales.view(torch.int16))
    torch.testing.assert_close(fast.stats, ref.stats, rtol=1e-12, atol=0)


_SAME_BYTES_CHILD = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from tests.quant.test_requant_optimal import adversarial_groups, random_groups
from converter.quant import cpu_kernel
from converter.quant.requant import requantize
rng = np.random.default_rng(7)
packed, scales = random_groups(rng, 5000)
adv_p, adv_s = adversarial_groups(rng)
packed, scales = torch.cat([adv_p, packed]), torch.cat([adv_s, scales])
for qmin in (-8, -7):
    off = [0, 15, packed.shape[0]]
    ref, fast = requantize(packed, scales, off, qmin=qmin), cpu_kernel.requantize(packed, scales, off, qmin=qmin)
    assert torch.equal(fast.packed, ref.packed), "bytes differ"
    assert torch.equal(fast.scales.view(torch.int16), ref.scales.view(torch.int16)), "scales differ"
    torch.testing.assert_close(fast.stats, ref.stats, rtol=1e-12, atol=0)
print("same bytes")
"""


def test_numba_kernel_same_bytes_on_a_plain_x86_64_build(tmp_path):
    """The kernel's SSE2 path (a CPU without AVX2, as numba compiles for a generic x86-64) gives the
    reference's bytes too; the host's own path is the test above."""
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the SSE2 path is x86's")
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": "+64bit,+sse,+sse2,+cmov,+cx8,+fxsr,+mmx",
           "NUMBA_CACHE_DIR": str(tmp_path)}
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _SAME_BYTES_CHILD, here], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "same bytes" in r.stdout, r.stderr[-3000:]


def test_candidate_table_is_what_the_lps_derive():
    """Re-run the proof that pruned the bf16 multipliers (scripts/tools/derive_candidates.py)."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "tools" / "derive_candidates.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("qmin", [-8, -7])
def test_pruned_candidates_lose_nothing_against_every_multiplier_in_range(qmin):
    """Many more histograms than the brute force can take: the LP-pruned search picks the same
    multiplier as a search over all 975 bf16 multipliers in [1/16, 12] (outside it none can win:
    docs/maths.md), on 60,000 random histograms of sparse and dense code subsets (exact float64
    scores, same priority order)."""
    from converter.quant.candidates import BY_QMIN
    from converter.quant.requant import choose
    from converter.quant.tables import bf16_bits_to_float, score_table

    bits = np.arange(0x4140, 0x3D80 - 1, -1, dtype=np.uint32)  # 12 down to 1/16: priority order
    _, score = score_table(bf16_bits_to_float(bits), qmin)
    rng = np.random.default_rng(11)
    hists = []
    for n in (2, 3, 5, 16):  # codes present
        for _ in range(15000):
            codes = rng.choice(16, n, replace=False)
            hists.append(np.bincount(codes[rng.choice(n, 32, p=rng.dirichlet(np.ones(n) * 0.5))], minlength=16))
    h = np.stack(hists)
    h = h[(h[:, 1:8] + h[:, 9:16]).sum(1) > 0]  # all-zero groups have no multiplier to choose
    full = bits[np.argmin(h.astype(np.float64) @ score, axis=1)]  # argmin: the first, largest m
    best, _ = choose(torch.from_numpy(h.astype(np.int32)), qmin)
    ours = np.array(BY_QMIN[qmin][0], dtype=np.uint32)[best.numpy()]
    assert np.array_equal(ours, full), np.flatnonzero(ours != full)[:10]
