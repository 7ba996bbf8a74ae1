"""The plugin's load-time kernel self-test (converter/vllm_plugin/selftest.py) and its padding rule,
against a simulated AITER kernel (tests/support/aiter_sim.py) that decodes its input by inverting aiter's
own layout helpers (aiter's shuffle_weight, vLLM 0.33's packer and scale relayout; see
tests/support/server_sources.py). A correct kernel passes; one that computes SiLU, ignores linear_beta,
reads -8 as +8, reads a permuted layout, computes remote experts, or meets vLLM's padding as vLLM
leaves it, is refused, and the refusal names the fault where one alternative explains it.
"""
from __future__ import annotations

import gc
import os
import weakref

import aiter_sim
import pytest
import server_sources
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from converter.vllm_plugin import layout, repair, route, selftest

BETA, LINEAR_BETA = 4.0, 25.0


@pytest.fixture(scope="module")
def helpers() -> aiter_sim.Helpers:
    shuffle = server_sources.aiter_shuffle(server_sources.released_file("K3CONVERT_AITER_SRC", "ops/shuffle.py"))
    ns = server_sources.vllm_flydsl(server_sources.released_file("K3CONVERT_VLLM033_SRC", server_sources.FLYDSL), shuffle.shuffle_weight)
    return aiter_sim.Helpers(shuffle.shuffle_weight, ns["_pack_shuffled_int8_to_packed_int4_no_perm"],
                             server_sources.vllm_scale_relayout(ns))


def loaded_layer(e: int, hidden: int, inter: int, real: int, seed: int = 0):
    """CT words and scales [E, ...] as vLLM's loader leaves them: checkpoint data in the first ``real``
    channels of each half, vLLM's padding (words 0, scales 1) in the rest. Codes include -8."""
    gen = torch.Generator().manual_seed(seed)
    c13 = torch.randint(-8, 8, (e, 2 * inter, hidden), dtype=torch.int8, generator=gen)
    c2 = torch.randint(-8, 8, (e, hidden, inter), dtype=torch.int8, generator=gen)
    w13, w2 = pack_to_int32(c13, 4), pack_to_int32(c2, 4)
    s13 = (0.01 + 0.02 * torch.rand(e, 2 * inter, hidden // 32, generator=gen)).to(torch.bfloat16)
    s2 = (0.01 + 0.02 * torch.rand(e, hidden, inter // 32, generator=gen)).to(torch.bfloat16)
    if real < inter:
        for lo, hi in ((real, inter), (inter + real, 2 * inter)):
            w13[:, lo:hi] = 0
            s13[:, lo:hi] = 1
        w2[:, :, real // 8:] = 0
        s2[:, :, real // 32:] = 1
    return w13, s13, w2, s2


def laid_out_layer(helpers, fault: str = "", e: int = 4, hidden: int = 128, inter: int = 128, real: int = 128,
                   expert_map: torch.Tensor | None = None, global_num: int | None = None, top_k: int = 4,
                   neutralize: bool = True):
    """What process_weights_after_loading does (copies, padding, layout): the laid-out tensors, the
    self-test's copies and remote ids, and the layer's kernel call (the simulated aiter)."""
    w13, s13, w2, s2 = loaded_layer(e, hidden, inter, real)
    global_num = global_num or e
    chosen, remote = selftest.choose_experts(selftest.local_ids(expert_map, global_num), global_num, top_k)
    experts = {g: selftest.expert_copy(w13[i], s13[i], w2[i], s2[i], real)
               for g in chosen for i in [g if expert_map is None else int(expert_map[g])]}
    if neutralize:
        assert layout.neutralize_padding_(w13, s13, w2, s2, real) is None
    p13, f13 = layout.convert_experts_(w13, s13)
    p2, f2 = layout.convert_experts_(w2, s2)

    mask = None if expert_map is None else torch.cat(((expert_map >= 0).int(), torch.zeros(1, dtype=torch.int32)))

    def apply(p: selftest.Probe) -> torch.Tensor:      # AITER gets vLLM's 0/1 expert mask, not the map
        return aiter_sim.moe(helpers, p13, f13, p2, f2, p.x, p.topk_weights, p.topk_ids, mask,
                             BETA, LINEAR_BETA, fault)
    return (p13, f13, p2, f2), experts, remote, apply


def run_selftest(helpers, fault: str = "", **kw) -> selftest.Outcome:
    _, experts, remote, apply = laid_out_layer(helpers, fault, **kw)
    return selftest.run(apply, experts, remote, selftest.Activation(BETA, LINEAR_BETA))


def ep_map(global_num: int, local: list[int]) -> torch.Tensor:
    m = torch.full((global_num,), -1, dtype=torch.int32)
    m[local] = torch.arange(len(local), dtype=torch.int32)
    return m


def test_a_correct_kernel_passes(helpers):
    out = run_selftest(helpers)
    assert out.problem is None, out.line()
    assert out.worst < selftest.TOL / 3 and out.minus_eight > 0


def test_a_correct_kernel_passes_at_a_padded_rank_and_under_ep(helpers):
    out = run_selftest(helpers, real=64)          # vLLM pads 64 -> 128, like 192 -> 256 at TP 16
    assert out.problem is None, out.line()
    emap = ep_map(8, [2, 3, 5, 7])
    out = run_selftest(helpers, expert_map=emap, global_num=8, real=64)
    assert out.problem is None, out.line()


@pytest.mark.parametrize("fault,named", [
    ("silu", "computes SiLU"),
    ("no-linear", "linear_beta"),
    ("minus8", "decodes int4 code -8 as 8"),
    ("layout", "matches no known fault"),
])
def test_a_faulty_kernel_is_refused_and_named(helpers, fault, named):
    out = run_selftest(helpers, fault=fault)
    assert out.problem is not None and named in out.problem, (out.line(), out.problem)


@pytest.mark.parametrize("n_local,global_num,top_k", [(112, 896, 8), (112, 896, 16), (896, 896, 16),
                                                     (7, 56, 8), (3, 8, 4), (5, 8, 2)])
def test_the_sampled_experts_span_the_rank_first_to_last(n_local, global_num, top_k):
    """The spread starts at the rank's first local expert and ends at its last (its last weight bytes),
    evenly: e.g. 0, 37, 74, 111 of 112 at EP 8 with top-k 8 (one sample: the first)."""
    ids = list(range(global_num - n_local, global_num))        # the last EP rank
    spread, remote = selftest.choose_experts(ids, global_num, top_k)
    assert spread[0] == ids[0] and (len(spread) == 1 or spread[-1] == ids[-1]), spread
    assert spread == sorted(set(spread)) and len(spread) + len(remote) <= top_k
    gaps = {b - a for a, b in zip(spread, spread[1:])}
    assert not gaps or max(gaps) - min(gaps) <= 1, spread


def test_a_fault_in_the_ranks_last_expert_is_caught(helpers):
    """Under EP (8 of 16 experts local, top-k 4: two local experts sampled), a corrupted last local
    expert fails the self-test: the spread reaches it."""
    emap = ep_map(16, list(range(8, 16)))
    tensors, experts, remote, apply = laid_out_layer(helpers, e=8, expert_map=emap, global_num=16)
    assert 15 in experts
    assert selftest.run(apply, experts, remote, selftest.Activation(BETA, LINEAR_BETA)).problem is None
    tensors[0][7].bitwise_xor_(0x11)                # every nibble of local expert 7 (global 15)
    out = selftest.run(apply, experts, remote, selftest.Activation(BETA, LINEAR_BETA))
    assert out.problem is not None, out.line()


def test_a_kernel_computing_remote_experts_is_refused(helpers):
    out = run_selftest(helpers, fault="remote", expert_map=ep_map(8, [0, 1, 2, 3]), global_num=8)
    assert out.problem is not None, out.line()


def test_padding_as_vllm_leaves_it_is_refused(helpers):
    """vLLM zeroes padded words (code -8) with scales 1, and aiter's a16wi4 path ignores the padding:
    without the plugin's neutralization those channels add -8 * x; the self-test sees it."""
    out = run_selftest(helpers, real=64, neutralize=False)
    assert out.problem is not None, out.line()


def test_minus_eight_misread_is_told_apart(helpers):
    """Only a fault that -8 read as another value explains can be repaired by leaving no -8."""
    assert run_selftest(helpers, fault="minus8").minus_eight_misread
    assert not run_selftest(helpers, fault="silu").minus_eight_misread
    assert not run_selftest(helpers, fault="layout").minus_eight_misread


def test_every_tile_variant_is_probed_and_logged(helpers):
    """aiter's untuned int4 MoE on get_padded_M's count: tile 16 up to 1024 tokens, 32 up to 8192, 64
    above; each is driven with the smallest token count of its band, and the line says which passed."""
    out = run_selftest(helpers)
    assert out.problem is None, out.line()
    assert [(v.tile, v.tokens) for v in out.variants] == [(16, 8), (32, 1025), (64, 8193)]
    assert [aiter_sim.tile(v.tokens) for v in out.variants] == [16, 32, 64]
    for part in ("tile 16 (8 tokens): passed", "tile 32 (1025 tokens): passed", "tile 64 (8193 tokens): passed"):
        assert part in out.line()


def test_tile_bands_start_where_aiters_padded_count_changes_tile():
    """Each band's first token count reaches its tile and the count before it does not: aiter pads the
    count to a power of two before its `token < 2048` / `token < 16384` tests (tests/support/aiter_sim.py)."""
    for tile, first in selftest.TILE_BANDS:
        assert aiter_sim.tile(first) == tile
        assert first == 1 or aiter_sim.tile(first - 1) != tile, (tile, first)
    assert [t for t, _ in selftest.TILE_BANDS] == sorted({aiter_sim.tile(m) for m in range(1, 140_000, 7)})


def test_the_simulated_tile_choice_is_aiters():
    """tests/aiter_sim.tile against aiter's own get_padded_M and tile literal (aiter/fused_moe.py of a
    release, under K3CONVERT_AITER_SRC), for every count up to past its last padding tier."""
    import ast
    from pathlib import Path
    root = os.environ.get("K3CONVERT_AITER_SRC")
    path = Path(root or "", "fused_moe.py")
    if not root or not path.is_file():   # not a CI failure: no aiter on the package index has this file
        pytest.skip("K3CONVERT_AITER_SRC has no fused_moe.py: the only amd-aiter on PyPI (0.1.7.post2.dev18) "
                    "predates the int4 MoE; point it at an aiter release's aiter/ (v0.1.20 or later)")
    text = path.read_text()
    assert "16 if token < 2048 else 32 if token < 16384 else 64" in text, f"{path}: the tile literal moved"
    tiers = next(n.value for n in ast.parse(text).body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", "") == "_PADDED_M_TIERS" for t in n.targets))
    ns = server_sources.functions(path, {"nextPow2", "get_padded_M"}, {"_PADDED_M_TIERS": ast.literal_eval(tiers)})
    for m in range(1, 140_000):
        token = ns["get_padded_M"](m)
        assert aiter_sim.tile(m) == (16 if token < 2048 else 32 if token < 16384 else 64), m


@pytest.mark.parametrize("fault,tile,named", [("minus8@32", 32, "decodes int4 code -8 as 8"),
                                              ("silu@64", 64, "computes SiLU"),
                                              ("minus8@64", 64, "decodes int4 code -8 as 8")])
def test_a_fault_in_one_variant_only_is_caught(helpers, fault, tile, named):
    """A kernel that is right at decode sizes and wrong only in a prefill tile is refused, naming it."""
    out = run_selftest(helpers, fault=fault)
    failed = [v.tile for v in out.variants if v.problem]
    assert failed == [tile], out.line()
    assert f"tile {tile} (" in out.problem and named in out.problem
    assert f"tile {tile} ({dict(selftest.TILE_BANDS)[tile]} tokens): FAILED" in out.line()


@pytest.mark.parametrize("tile", [32, 64])
def test_a_prefill_tile_that_mixes_rows_is_caught_although_its_probe_repeats_tokens(helpers, tile):
    """Prefill probes repeat DISTINCT distinct tokens in random order (their reference costs DISTINCT
    rows); a kernel that puts a token's result in another row still fails, as no known fault."""
    out = run_selftest(helpers, fault=f"rows@{tile}")
    assert [v.tile for v in out.variants if v.problem] == [tile], out.line()
    assert selftest.NO_KNOWN_FAULT in out.problem


def test_a_prefill_probe_repeats_few_distinct_tokens_in_random_rows(helpers):
    """Every distinct token appears, rows point at their own token, and the order is not periodic."""
    experts = {0: next(iter(laid_out_layer(helpers, "")[1].values()))}
    probe = selftest.make_probe(experts, [], selftest.Activation(BETA, LINEAR_BETA), tokens=2048)
    assert probe.x.shape[0] == 2048 and probe.rows.unique().numel() == selftest.DISTINCT
    assert torch.equal(probe.x[probe.distinct][probe.rows], probe.x)
    assert not torch.equal(probe.rows[: selftest.DISTINCT], torch.arange(selftest.DISTINCT))


@pytest.mark.parametrize("fault", ["minus8", "minus8@32"])
def test_a_minus8_misread_ends_in_a_repaired_retested_layer(helpers, fault):
    """The path moe_method takes: the self-test fails with -8 misread, the laid-out layer (and the
    test's copies) are repaired in place, and the re-run self-test passes on the same kernel; the
    figure is the layer's relative weight RMSE against the stored int4, and no -8 is left."""
    tensors, experts, remote, apply = laid_out_layer(helpers, fault)
    act = selftest.Activation(BETA, LINEAR_BETA)
    first = selftest.run(apply, experts, remote, act)
    assert first.problem is not None and first.minus_eight_misread
    got = repair.repair_layer_(*tensors, experts.values())
    assert 0 < got.repaired <= got.groups and 0 < got.rel_rmse < 0.1, got
    again = selftest.run(apply, experts, remote, act)
    assert again.problem is None, again.line()
    assert again.minus_eight == 0
    p13, f13, p2, f2 = tensors
    w13, _ = repair.unlayout_(p13.clone(), f13.clone(), 256, 128)
    w2, _ = repair.unlayout_(p2.clone(), f2.clone(), 128, 128)
    assert not (layout.ct_words_to_codes(w13) == -8).any() and not (layout.ct_words_to_codes(w2) == -8).any()


def test_repair_leaves_a_layer_without_minus8_alone(helpers):
    tensors, experts, _, _ = laid_out_layer(helpers)
    before = [t.clone() for t in tensors]
    w13, s13 = repair.unlayout_(tensors[0], tensors[1], 256, 128)
    codes = layout.ct_words_to_codes(w13)
    w13.copy_(repair.codes_to_words(torch.where(codes == -8, torch.zeros_like(codes), codes)))
    layout.convert_experts_(w13, s13)
    w2, s2 = repair.unlayout_(tensors[2], tensors[3], 128, 128)
    codes = layout.ct_words_to_codes(w2)
    w2.copy_(repair.codes_to_words(torch.where(codes == -8, torch.zeros_like(codes), codes)))
    layout.convert_experts_(w2, s2)
    snapshot = [t.clone() for t in tensors]
    got = repair.repair_layer_(*tensors)
    assert got.repaired == 0 and got.err2 == 0
    assert all(torch.equal(a, b) for a, b in zip(snapshot, tensors))
    assert not torch.equal(before[0], snapshot[0])


def test_unlayout_inverts_the_layout():
    w13, s13, _, _ = loaded_layer(3, 128, 64, 64)
    w0, s0 = w13.clone(), s13.clone()
    p, f = layout.convert_experts_(w13, s13)
    w, s = repair.unlayout_(p, f, 128, 128)
    assert torch.equal(w, w0) and torch.equal(s, s0)


def test_the_inverse_layout_index_is_not_kept_after_the_call(monkeypatch):
    """unlayout_'s index (int64 per nibble of an expert: 0.26 GiB per rank at EP 8) lives only for the
    call, not in a cache for the process's life (on a GPU it would be taken from the KV cache)."""
    made: list[weakref.ref] = []
    inverse = repair._inverse

    def spy(*args):
        out = inverse(*args)
        made.extend(weakref.ref(t) for t in out)
        return out
    monkeypatch.setattr(repair, "_inverse", spy)
    w13, s13, _, _ = loaded_layer(2, 128, 64, 64)
    w0, s0 = w13.clone(), s13.clone()
    for _ in range(2):
        p, f = layout.convert_experts_(w13, s13)
        w13, s13 = repair.unlayout_(p, f, 128, 128)
    assert torch.equal(w13, w0) and torch.equal(s13, s0)
    gc.collect()
    assert len(made) == 4 and all(r() is None for r in made)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA or ROCm)")
def test_repairing_a_layer_leaves_no_device_memory_behind():
    """After repair_layer_ on a GPU, memory_allocated is what the layer itself holds: nothing cached.
    A first layer of another shape takes what any first call keeps (cuBLAS's workspace, int4_pm7's
    7 MiB tables), not this shape's inverse layout index."""
    def layer(hidden: int, inter: int) -> list[torch.Tensor]:
        w13, s13, w2, s2 = (t.cuda() for t in loaded_layer(4, hidden, inter, inter))
        return [*layout.convert_experts_(w13, s13), *layout.convert_experts_(w2, s2)]
    repair.repair_layer_(*layer(64, 64))
    tensors = layer(128, 128)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    got = repair.repair_layer_(*tensors)
    torch.cuda.synchronize()
    assert got.repaired > 0 and torch.cuda.memory_allocated() == before


def test_minus8_refusal_switch(monkeypatch):
    monkeypatch.delenv(repair.ENV, raising=False)
    assert not repair.refuse()
    monkeypatch.setenv(repair.ENV, "refuse")
    assert repair.refuse()


def test_neutralized_padding_is_code_zero_scale_zero():
    w13, s13, w2, s2 = loaded_layer(2, 64, 64, 32)
    assert layout.neutralize_padding_(w13, s13, w2, s2, 32) is None
    codes13, codes2 = layout.ct_words_to_codes(w13), layout.ct_words_to_codes(w2)
    assert (codes13[:, 32:64] == 0).all() and (codes13[:, 96:] == 0).all() and (codes2[:, :, 32:] == 0).all()
    assert (s13[:, 32:64] == 0).all() and (s13[:, 96:] == 0).all() and (s2[:, :, 1:] == 0).all()
    assert (codes13[:, :32] != 0).any() and (s13[:, :32] != 0).all()     # real channels untouched


def test_padding_that_holds_data_is_refused():
    w13, s13, w2, s2 = loaded_layer(2, 64, 64, 64)     # every channel loaded
    assert "hold loaded data" in layout.neutralize_padding_(w13, s13, w2, s2, 32)
    assert "multiple of 32" in layout.neutralize_padding_(w13, s13, w2, s2, 48)


@pytest.mark.parametrize("tp,rank,want", [(8, 7, 384), (16, 0, 192), (16, 15, 192), (24, 23, 128),
                                          (32, 31, 96), (48, 47, 64), (1, 0, 3072)])
def test_real_channels_follow_vllms_loader(tp, rank, want):
    """K3's 3072 over vLLM's MoE TP ranks (routed_experts.py _load_w13/_load_w2 split the unpadded size)."""
    assert route.real_channels(3072, tp, rank) == want


def test_selftest_switch():
    assert selftest.enabled()
    os.environ[selftest.ENV] = "0"
    try:
        assert not selftest.enabled()
    finally:
        del os.environ[selftest.ENV]
