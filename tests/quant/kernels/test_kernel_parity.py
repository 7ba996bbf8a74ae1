"""The Triton requantizer must give the CPU reference's exact bytes (and its statistics).

Runs the kernel through Triton's interpreter (TRITON_INTERPRET=1) on the CPU, so it needs
no GPU; skipped when Triton is not installed. Inputs are small: realistic MXFP4 groups
(Gaussian and Student-t weights through the OCP MX scale rule), adversarial groups (all
zero, NaN scale bytes, extreme exponents, all +6, single outliers, every low level, ties),
several tensors of uneven sizes per batch, and the kernel's alternative code paths; each for
both code ranges (``optimal``, and ``optimal-pm7``: the same kernel with the [-7, 7] tables).

The interpreter must be switched on before ``triton`` is first imported, and the session's
conftest imports it (through compressed-tensors -> transformers -> torch._inductor), so the
kernel runs in one child process started with the variable set; the comparison with the
CPU reference happens here.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from interpreted import run_interpreted  # noqa: E402

from converter.quant.requant import requantize as cpu_requantize  # noqa: E402


def _mx_groups(rng: np.random.Generator, n: int, dist: str = "gauss") -> tuple[np.ndarray, np.ndarray]:
    """Realistic MXFP4 groups: weights -> OCP scale 2**(floor(log2 amax) - 2) -> E2M1."""
    if dist == "t3":
        w = rng.standard_t(3, (n, 32))
    else:
        w = rng.standard_normal((n, 32))
    w *= np.exp2(rng.integers(-12, 4, (n, 1)))
    amax = np.abs(w).max(1)
    e = np.floor(np.log2(amax)) - 2
    x = np.abs(w) / np.exp2(e)[:, None]
    mags = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    codes = np.abs(x[..., None] - mags).argmin(-1) + 8 * (w < 0)
    return _pack(codes), (e + 127).astype(np.uint8)


def _pack(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _adversarial(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    rows, scales = [], []

    def add(codes, s):
        rows.append(np.broadcast_to(np.asarray(codes, dtype=np.uint8), (32,)))
        scales.append(s)

    for s in (0, 1, 2, 126, 127, 128, 200, 252, 253, 254, 255):
        add(0, s)                                  # all zero (also -0 below)
        add(8, s)
        add(7, s)                                  # all +6
        add(15, s)                                 # all -6
        one = np.zeros(32, dtype=np.uint8)
        one[rng.integers(32)] = 7                  # single outlier
        add(one, s)
        one = np.zeros(32, dtype=np.uint8)
        one[rng.integers(32)] = 9                  # single -0.5: level 1
        add(one, s)
        for lv in range(1, 8):                     # every level, random signs
            add(rng.integers(0, lv + 1, 32) | (rng.integers(0, 2, 32) << 3), s)
    for pattern in ([6, 14], [7, 15], [7, 5], [6, 4, 2], [7, 6, 5, 4], [3, 11], [1, 9, 2]):
        for s in (1, 127, 254):                    # few distinct values: exact ties
            add(rng.choice(pattern, 32), s)
    for _ in range(64):                            # uniformly random codes and scales
        add(rng.integers(0, 16, 32), int(rng.integers(0, 256)))
    codes = np.stack(rows)
    return _pack(codes), np.array(scales, dtype=np.uint8)


def _cases() -> dict[str, tuple[np.ndarray, np.ndarray, list[int], dict]]:
    """name -> (packed, scales, offsets, kernel knobs); deterministic."""
    cases = {}
    rng = np.random.default_rng(1)
    parts = [_mx_groups(rng, n, d) for n, d in ((1, "gauss"), (700, "gauss"), (129, "t3"),
                                                (1500, "t3"), (64, "gauss"), (255, "gauss"))]
    packed = np.concatenate([p for p, _ in parts])
    scales = np.concatenate([s for _, s in parts])
    offsets = [0]
    for i, (p, _) in enumerate(parts):
        offsets.append(offsets[-1] + len(p))
        if i == 2:
            offsets.append(offsets[-1])            # an empty tensor in the middle
    cases["realistic"] = (packed, scales, offsets, {})

    rng = np.random.default_rng(2)
    packed, scales = _adversarial(rng)
    g = len(packed)
    cases["adversarial"] = (packed, scales, [0, 5, 6, g // 2, g], {})

    rng = np.random.default_rng(3)
    a_p, a_s = _adversarial(rng)
    r_p, r_s = _mx_groups(rng, 600, "t3")
    packed = np.concatenate([r_p, a_p])
    scales = np.concatenate([r_s, a_s])
    offs = [0, 300, 301, len(packed)]
    for name, knobs in KNOB_CASES.items():
        cases[name] = (packed, scales, offs, knobs)
    # optimal-pm7: the realistic and adversarial batches, and the exact fallback, with its tables
    for name in ("realistic", "adversarial", "force_exact"):
        p, s, o, knobs = cases[name]
        cases[f"{name}_pm7"] = (p, s, o, {**knobs, "qmin": -7})
    return cases


KNOB_CASES = {
    "force_exact": {"force_exact": True},          # the exact two-pass fallback
    "nsplit2": {"nsplit": 2},
    "bg64": {"block_groups": 64},
    "bg256": {"block_groups": 256, "programs_per_sm": 1},
}


def _amd_cases() -> dict[str, dict]:
    """launch_config's AMD blockings not already run by the interpreter default (issue 9)."""
    from converter.kernels.triton_requant import launch_config

    def blocking(cfg: dict) -> tuple[int, int]:
        return cfg["block_groups"], cfg["nsplit"]

    seen, cases = {blocking(launch_config("interpreter"))}, {}
    for arch in ("gfx942", "gfx90a", "gfx950", "gfx1100"):   # gfx1100: the unmeasured-arch fallback
        cfg = launch_config(arch)
        if blocking(cfg) not in seen:
            seen.add(blocking(cfg))
            cases[f"amd_{arch}"] = cfg
    return cases


KNOB_CASES.update(_amd_cases())


def _child_main(out_path: str) -> None:
    """Runs in the child process (interpreter on): every case through the kernel."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from converter.kernels.triton_requant import requantize

    arrays = {}
    for name, (packed, scales, offsets, knobs) in _cases().items():
        r = requantize(torch.from_numpy(packed), torch.from_numpy(scales), offsets, **knobs)
        arrays[f"{name}.packed"] = r.packed.numpy()
        arrays[f"{name}.scales"] = r.scales.view(torch.int16).numpy()
        arrays[f"{name}.stats"] = r.stats.numpy()
    # bad inputs must be refused
    p = torch.zeros(4, 16, dtype=torch.uint8)
    s = torch.zeros(4, dtype=torch.uint8)
    refused = []
    for args in (([0, 3],), ([0, 3, 2, 4],)):
        try:
            requantize(p, s, *args)
        except ValueError:
            refused.append(True)
    try:
        requantize(p.to(torch.int16), s)
    except TypeError:
        refused.append(True)
    empty = requantize(torch.zeros(0, 16, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8))
    arrays["refused"] = np.array(refused)
    arrays["empty.stats_shape"] = np.array(empty.stats.shape)
    np.savez(out_path, **arrays)


@pytest.fixture(scope="module")
def kernel_out(tmp_path_factory) -> dict[str, np.ndarray]:
    return run_interpreted(__name__, tmp_path_factory.mktemp("kernel") / "out.npz")


def _check(kernel_out: dict[str, np.ndarray], name: str) -> None:
    packed, scales, offsets, knobs = _cases()[name]
    qmin = knobs.get("qmin", -8)
    ref = cpu_requantize(torch.from_numpy(packed), torch.from_numpy(scales), offsets, qmin=qmin)
    got_p = torch.from_numpy(kernel_out[f"{name}.packed"])
    got_s = torch.from_numpy(kernel_out[f"{name}.scales"])
    got_st = torch.from_numpy(kernel_out[f"{name}.stats"])
    bad = (got_p != ref.packed).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"int4 bytes differ in groups {bad[:10].tolist()}"
    bad = (got_s != ref.scales.view(torch.int16)).nonzero().flatten()
    assert bad.numel() == 0, f"scales differ in groups {bad[:10].tolist()}"
    assert got_st.shape == ref.stats.shape and got_st.dtype == torch.float64
    # sums differ only in order; max_abs and both counts are exact
    torch.testing.assert_close(got_st[:, :2], ref.stats[:, :2], rtol=1e-12, atol=0.0)
    assert torch.equal(got_st[:, 2:], ref.stats[:, 2:])
    # the range is the one asked for: -8 (nibble 0) never written under [-7, 7], and used otherwise
    nibbles = torch.cat((got_p & 15, got_p >> 4), 1)
    zero_group = got_s == 0
    assert bool((nibbles[~zero_group] == 0).any()) == (qmin == -8)


@pytest.mark.parametrize("name", ["realistic", "adversarial", "force_exact"])
def test_symmetric_range(kernel_out, name):
    """optimal-pm7 through the same kernel (its [-7, 7] tables): the reference's bytes."""
    _check(kernel_out, f"{name}_pm7")


def test_realistic_batch_uneven_tensors(kernel_out):
    _check(kernel_out, "realistic")


def test_adversarial_groups(kernel_out):
    _check(kernel_out, "adversarial")


@pytest.mark.parametrize("name", sorted(KNOB_CASES))
def test_code_paths(kernel_out, name):
    _check(kernel_out, name)


def test_empty_and_bad_offsets(kernel_out):
    assert kernel_out["refused"].tolist() == [True, True, True]
    assert kernel_out["empty.stats_shape"].tolist() == [1, 5]
