"""converter.quant.int4_pm7: the ``optimal-pm7`` optimum of int4 groups already stored (the vLLM plugin's
repair for a kernel that misreads code -8), checked against verify.brute_force_min, the project's
independent exact search over every positive normal bf16 scale."""
from __future__ import annotations

import torch

from converter.quant.int4_pm7 import CHUNK_GROUPS, repair_groups_
from converter.verify import brute_force_min


def groups(g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (g, 32), dtype=torch.int8, generator=gen)
    codes[: g // 4] = torch.randint(-7, 8, (g // 4, 32), dtype=torch.int8, generator=gen)  # no -8
    codes[g // 4: g // 2, 1:] = torch.randint(-2, 3, (g // 4, 31), dtype=torch.int8, generator=gen)
    codes[g // 4: g // 2, 0] = -8                         # one -8 among small codes
    scales = (2.0 ** torch.randint(-20, 4, (g,), generator=gen) * (1 + torch.rand(g, generator=gen))).to(torch.bfloat16)
    scales[5] = -scales[5]                                # a negative scale: -q may be +8
    return codes, scales


def test_the_repair_is_the_exact_pm7_optimum_of_the_stored_values():
    codes, scales = groups(200, 0)
    values = codes.double() * scales.double()[:, None]
    c, s = codes.clone(), scales.clone()
    got = repair_groups_(c, s)
    has = (codes == -8).any(1)
    assert got.repaired == int(has.sum()) and got.groups == 200
    assert not (c == -8).any() and (c >= -7).all() and (c <= 7).all()
    assert torch.equal(c[~has], codes[~has]) and torch.equal(s[~has], scales[~has])
    err = ((c.double() * s.double()[:, None] - values) ** 2).sum(1)
    assert torch.equal(err[has], brute_force_min(values[has], qmin=-7))    # exact, not close
    assert abs(got.err2 - float(err.sum())) <= 1e-12 * got.err2      # per-group sums exact; their total
    assert abs(got.ref2 - float((values[has] ** 2).sum())) <= 1e-12 * got.ref2
    assert 0 < got.rel_rmse < 0.2


def test_a_group_of_one_minus8_among_small_codes_keeps_its_small_codes():
    """-8 with codes in [-2, 2]: the optimum keeps the other values where they were as best it can;
    its error is never above clamping -8 to -7 (the simplest repair)."""
    codes, scales = groups(64, 1)
    rows = slice(16, 32)
    values = codes[rows].double() * scales[rows].double()[:, None]
    c, s = codes.clone(), scales.clone()
    repair_groups_(c, s)
    err = ((c[rows].double() * s[rows].double()[:, None] - values) ** 2).sum(1)
    clamp = ((codes[rows].clamp(-7, 7).double() * scales[rows].double()[:, None] - values) ** 2).sum(1)
    assert (err <= clamp).all() and (err < clamp).any()


def test_zero_scale_and_many_groups():
    codes, scales = groups(CHUNK_GROUPS + 100, 2)     # more than one chunk of groups
    scales[7] = 0
    codes[7, 0] = -8
    c, s = codes.clone(), scales.clone()
    got = repair_groups_(c, s)
    assert not (c == -8).any() and s[7] == 0 and got.repaired == int((codes == -8).any(1).sum())
