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


def test_scales_near_the_largest_bf16_keep_candidates_finite():
    """Scales within 2^3 of bf16's largest finite: the candidates past it are masked, the optimum is
    still the exact one over the finite scales."""
    codes, scales = groups(64, 3)
    scales = (2.0 ** torch.randint(124, 128, (64,)) * (1 + torch.rand(64))).to(torch.bfloat16)
    scales = torch.where(torch.isfinite(scales), scales, torch.tensor(2.0 ** 127, dtype=torch.bfloat16))
    codes[:16] = 0
    codes[:16, 0] = -8            # alone: S = 8|s| with code -1 is exact, but past the largest finite
    values = codes.double() * scales.double()[:, None]
    c, s = codes.clone(), scales.clone()
    got = repair_groups_(c, s)
    has = (codes == -8).any(1)
    assert got.repaired == int(has.sum()) and torch.isfinite(s.float()).all() and not (c == -8).any()
    err = ((c.double() * s.double()[:, None] - values) ** 2).sum(1)
    assert torch.equal(err[has], brute_force_min(values[has], qmin=-7))


def test_the_bytes_do_not_depend_on_step_or_tile_sizes(monkeypatch):
    """The GPU takes large steps and tiles and one batched matmul, the CPU small steps and a matmul per
    class: the repaired bytes must be the same. Tiny steps and tiles (many padded tiles, a class split
    over steps), the batched form and the GPU's sizes, on the CPU, against the defaults."""
    import converter.quant.int4_pm7 as pm7

    codes, scales = groups(3000, 4)
    c1, s1 = codes.clone(), scales.clone()
    a = repair_groups_(c1, s1)
    for step, tile, gpu in ((6, 3, False), (6, 3, True), (512, 256, True), (1 << 18, 256, True)):
        monkeypatch.setattr(pm7, "step_groups", lambda device: (step, tile))
        monkeypatch.setattr(pm7, "batched", lambda device: gpu)   # the GPU's batched matmul, on the CPU
        c2, s2 = codes.clone(), scales.clone()
        b = repair_groups_(c2, s2)
        assert torch.equal(c1, c2) and torch.equal(s1.view(torch.int16), s2.view(torch.int16)), (step, tile, gpu)
        assert a.repaired == b.repaired and abs(a.err2 - b.err2) <= 1e-12 * a.err2


def test_steps_by_device_are_bounded():
    """CPU: the small steps it was measured with; a GPU: large steps within the stated transient budget."""
    import converter.quant.int4_pm7 as pm7
    from converter.vllm_plugin import repair

    assert pm7.step_groups(torch.device("cpu")) == (pm7.CHUNK_GROUPS, pm7.TILE_CPU)
    step, tile = pm7.step_groups(torch.device("cuda"))
    assert step % tile == 0 and pm7.CHUNK_GROUPS < step <= pm7.GPU_STEP_GROUPS
    assert step * pm7.STEP_BYTES_PER_GROUP <= pm7.GPU_STEP_BYTES
    assert repair.experts_per_step(torch.device("cpu"), 10 ** 9) == repair.CHUNK
    per = 768 * 3584 // 32 * repair.BYTES_PER_GROUP                 # one K3 TP 8 w13 expert
    n = repair.experts_per_step(torch.device("cuda"), per)
    assert n > repair.CHUNK and n * per <= repair.GPU_CHUNK_BYTES
    assert repair.experts_per_step(torch.device("cuda"), 2 * repair.GPU_CHUNK_BYTES) == 1


def test_repair_ct_bytes_do_not_depend_on_experts_per_step(monkeypatch):
    """repair.repair_ct_ takes many experts per step on a GPU, CHUNK on the CPU: same bytes, same figure."""
    from converter.vllm_plugin import repair

    codes, scales = groups(5 * 8 * 4, 5)                  # 5 experts of 8 rows of 4 groups
    words = repair.codes_to_words(codes.view(5, 8, 128))
    sc = scales.view(5, 8, 4)
    w1, s1 = words.clone(), sc.clone()
    a = repair.repair_ct_(w1, s1)
    monkeypatch.setattr(repair, "experts_per_step", lambda device, nbytes: 3)
    w2, s2 = words.clone(), sc.clone()
    b = repair.repair_ct_(w2, s2)
    assert torch.equal(w1, w2) and torch.equal(s1.view(torch.int16), s2.view(torch.int16))
    assert a.repaired == b.repaired > 0 and abs(a.ref2 - b.ref2) <= 1e-12 * a.ref2
    values = codes.double() * scales.double()[:, None]
    assert abs(a.ref2 - float((values ** 2).sum())) <= 1e-12 * a.ref2   # ref2: every group's stored values


def test_repair_ct_of_a_slice_of_rows():
    """A few rows of one expert (contiguous, a size-1 dim with another stride: copy_ onto its own
    storage raised "refer to a single memory location" on 74b0137) are repaired in place."""
    from converter.vllm_plugin import repair

    codes, scales = groups(3 * 8 * 4, 6)
    words = repair.codes_to_words(codes.view(3, 8, 128))
    sc = scales.view(3, 8, 4).clone()
    whole_w, whole_s = words.clone(), sc.clone()
    repair.repair_ct_(whole_w, whole_s)
    got = repair.repair_ct_(words[1:2, :5], sc[1:2, :5])
    assert got.repaired > 0
    assert torch.equal(words[1, :5], whole_w[1, :5]) and torch.equal(sc[1, :5], whole_s[1, :5])
    assert torch.equal(words[1, 5:], repair.codes_to_words(codes.view(3, 8, 128))[1, 5:])
