"""``--scale-rule vllm-gfx942``: every int4 code and bf16 scale is the server's, bit for bit.

The reference here is written straight from the server's code (vLLM 0.33
``_setup_kernel_k3_situ_gfx942``: aiter ``mxfp4_to_f32`` x ``e8m0_to_f32`` -> bf16; then aiter
``per_1x32_i4_quant`` at ROCm/aiter e4048607 aiter/ops/quant.py:207-227, copied op for op), in
plain torch, without the converter's tables. The converter's three implementations (torch
reference, numba, Triton through its interpreter) must all give its bytes.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch
from interpreted import run_interpreted
from safetensors import safe_open

from converter.quant import cpu_kernel, server_rule
from converter.quant.rules import optimum_qmin
from converter.run.options import Options
from converter.verify import verify
from tests.conftest import ct_int4_q, raw_header, read_json, run_cli

MXFP4_LIST = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


# ---------------------------------------------------------------- the reference, from the server's code

def server_reference(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 [N, K/2], E8M0 uint8 [N, K/32]) -> (int8 q [N, K], bf16 scale [N, K/32], finite [N, K/32])."""
    n, half = packed.shape
    k = half * 2
    # aiter utility/fp4_utils.py mxfp4_to_f32: low nibble first
    x = packed.repeat_interleave(2, dim=-1)
    x[..., ::2] = x[..., ::2] & 0xF
    x[..., 1::2] = x[..., 1::2] >> 4
    weight_f32 = torch.tensor(MXFP4_LIST, dtype=torch.float32)[x.long()]
    # aiter e8m0_to_f32
    scale_f32 = scale.to(torch.int32) << 23
    scale_f32[scale == 0] = 0x00400000
    scale_f32[scale == 0xFF] = 0x7F800001
    scale_f32 = scale_f32.view(torch.float32)
    weight_bf16 = (weight_f32.view(n, k // 32, 32) * scale_f32.view(n, k // 32, 1)).view(n, k).to(torch.bfloat16)
    # aiter per_1x32_i4_quant (its scale is then transposed for the kernel: layout only)
    w_groups = weight_bf16.view(n, k // 32, 32)
    w_group_max = w_groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    w_scale_raw = (w_group_max / 7.0).squeeze(-1)
    weight_qt = (w_groups / w_scale_raw.unsqueeze(-1)).round().clamp(-7, 7).to(torch.int8).view(n, k)
    finite = torch.isfinite(w_groups.float()).all(-1) & torch.isfinite(w_scale_raw.float())
    return weight_qt, w_scale_raw.to(torch.bfloat16), finite


def test_cpu_division_by_7_is_the_gpus_reciprocal_product():
    """On a CUDA/HIP tensor, ``x / 7.0`` (a CPU scalar) is ``x * float(1/7)`` in fp32 (PyTorch
    BinaryDivTrueKernel.cu); the reference above divides on the CPU. Both give the same bf16
    for every positive finite bf16 x, so the CPU reference is the server's GPU result."""
    x = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    recip = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(7.0, dtype=torch.float32)
    gpu = (x.float() * recip).to(torch.bfloat16)
    assert torch.equal((x / 7.0).view(torch.int16), gpu.view(torch.int16))
    # and a wrong spelling would show: dividing in bf16 arithmetic after rounding 1/7 to bf16
    wrong = (x.float() * torch.tensor(1 / 7, dtype=torch.bfloat16).float()).to(torch.bfloat16)
    assert not torch.equal(wrong.view(torch.int16), gpu.view(torch.int16))


# ---------------------------------------------------------------- inputs

def _every_class() -> tuple[torch.Tensor, torch.Tensor]:
    """One group per (E8M0 byte 0..254, largest |code| 0..7) holding every code that class
    allows, in two orders: every case the rule can meet, the extremes included."""
    rows_p, rows_s = [], []
    for s in range(255):
        for top in range(8):
            codes = [c for c in range(16) if (c & 7) <= top]
            group = (codes * 32)[:32]
            group[5] = top
            for order in (group, group[::-1]):
                g = torch.tensor(order, dtype=torch.uint8)
                rows_p.append(g[0::2] | (g[1::2] << 4))
                rows_s.append(s)
    return torch.stack(rows_p), torch.tensor(rows_s, dtype=torch.uint8)


def _realistic(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of Student-t weights by the OCP rule, plus uniformly random codes and exponents."""
    from converter.formats import mxfp4

    g = torch.Generator().manual_seed(seed)
    w = torch.from_numpy(np.random.default_rng(seed).standard_t(3.0, (n, 32))).float() * 0.02
    w[: n // 8] *= 2.0 ** torch.randint(-30, 20, (n // 8, 1), generator=g).float()
    p, s = mxfp4.encode(w.reshape(n // 4, 128))
    p = p.reshape(-1, 16)
    s = s.reshape(-1)
    rp = torch.randint(0, 256, (n // 4, 16), dtype=torch.uint8, generator=g)
    rs = torch.randint(90, 160, (n // 4,), dtype=torch.uint8, generator=g)
    return torch.cat([p, rp]), torch.cat([s, rs])


def _as_groups(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference output as the converter's group bytes: q + 8 nibbles, low first."""
    nib = (q.to(torch.int16) + 8).to(torch.uint8).reshape(-1, 32)
    return nib[:, 0::2] | (nib[:, 1::2] << 4), scale.reshape(-1).view(torch.int16)


def _check_against_reference(packed: torch.Tensor, scales: torch.Tensor, got) -> None:
    q, sc, finite = server_reference(packed.reshape(-1, 16), scales.reshape(-1, 1))
    want_p, want_s = _as_groups(q, sc)
    ok = finite.reshape(-1)
    assert ok.any()
    bad = ((got.packed != want_p).any(1) | (got.scales.view(torch.int16) != want_s)) & ok
    assert not bad.any(), f"{int(bad.sum())} group(s) differ, e.g. {bad.nonzero()[:5].flatten().tolist()}"
    # groups the server would turn into inf/NaN are counted, never passed off as written
    assert got.stats[:, 4].sum().item() == (~ok).sum().item()


@pytest.mark.parametrize("impl", ["torch", "numba"])
def test_every_class_matches_the_server(impl):
    packed, scales = _every_class()
    fn = server_rule.requantize if impl == "torch" else cpu_kernel.server_requantize
    res = fn(packed, scales, [0, packed.shape[0]])
    _check_against_reference(packed, scales, res)
    q = torch.stack((res.packed & 15, res.packed >> 4), -1).to(torch.int16) - 8
    assert int(q.min()) >= -7 and int(q.max()) <= 7   # the server's clamp, inside the format's [-8, 7]


@pytest.mark.parametrize("impl", ["torch", "numba"])
def test_realistic_groups_match_the_server(impl):
    packed, scales = _realistic(4096)
    fn = server_rule.requantize if impl == "torch" else cpu_kernel.server_requantize
    _check_against_reference(packed, scales, fn(packed, scales, [0, 1000, 1001, packed.shape[0]]))


def test_edge_cases():
    packed, scales = _every_class()
    res = server_rule.requantize(packed, scales)
    q, sc, finite = server_reference(packed, scales.reshape(-1, 1))
    ref_bits = sc.reshape(-1).view(torch.int16)
    top = torch.maximum(packed & 7, (packed >> 4) & 7).amax(1)
    # all-zero groups: q = 0 and the server's scale bf16(bf16(1e-6) / 7), not 0
    zero = top == 0
    floor = (torch.tensor(1e-6, dtype=torch.bfloat16).float() * (1 / 7)).to(torch.bfloat16).view(torch.int16)
    assert torch.equal(res.scales.view(torch.int16)[zero], floor.expand(int(zero.sum())))
    assert torch.equal(res.packed[zero], torch.full_like(res.packed[zero], 0x88))
    # absmax at the clamp: both sides of bf16(1e-6) occur, and a group below it keeps the floor scale
    amax = torch.tensor([MXFP4_LIST[t] for t in top.tolist()]) * torch.pow(2.0, scales.double() - 127)
    below = (amax > 0) & (amax < 9.98e-7)
    assert below.any() and (amax > 1e-6).any()
    assert torch.equal(res.scales.view(torch.int16)[below], floor.expand(int(below.sum())))
    # ties: quotients that land on k + 0.5 occur (all with odd k, so half-even = half-away-from-zero);
    # the codes there are the server's, and rounding ties towards zero would change them
    w = server_rule.server_dequant(torch.stack((packed & 15, packed >> 4), -1).reshape(-1, 32), scales)
    quot = (w / sc.reshape(-1, 1)).float()
    tie = torch.isfinite(quot) & (quot.abs() - quot.abs().floor() == 0.5)
    assert int(tie.sum()) > 100
    toward_zero = quot.abs().floor() * quot.sign()
    assert not torch.equal(q.reshape(-1, 32).float()[tie], toward_zero[tie])
    # extreme exponents: the only groups the server cannot represent are those that overflow to inf
    not_ok = ~finite.reshape(-1)
    assert set(zip(scales[not_ok].tolist(), top[not_ok].tolist())) == {
        (253, 6), (253, 7), (254, 4), (254, 5), (254, 6), (254, 7)}
    assert res.stats[0, 4].item() == not_ok.sum().item()
    assert torch.equal(res.scales.view(torch.int16)[~not_ok], ref_bits[~not_ok])


def test_optimal_kernel_reports_the_server_error_on_the_way():
    """The numba optimal kernel's fused comparison equals the rule's own error (same tables)."""
    packed, scales = _realistic(8192, seed=3)
    offsets = [0, 3000, packed.shape[0]]
    opt = cpu_kernel.requantize(packed, scales, offsets)
    srv = server_rule.requantize(packed, scales, offsets)
    torch.testing.assert_close(opt.server_err2, srv.stats[:, 0], rtol=1e-12, atol=0.0)
    assert (opt.server_err2 > opt.stats[:, 0]).all()     # the optimum is better than the server's rule
    # and the reference's squared error from its own dequantized weights agrees
    q, sc, _ = server_reference(packed[:3000].reshape(-1, 16), scales[:3000].reshape(-1, 1))
    v = server_rule.server_dequant(torch.stack((packed[:3000] & 15, packed[:3000] >> 4), -1).reshape(-1, 32),
                                   scales[:3000]).double()
    err2 = ((q.reshape(-1, 32).double() * sc.reshape(-1, 1).double() - v) ** 2).sum()
    assert math.isclose(float(err2), float(srv.stats[0, 0]), rel_tol=1e-9)


# ---------------------------------------------------------------- Triton (interpreter) = CPU

def _child_main(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from converter.kernels.triton_server_rule import requantize

    arrays = {}
    for name, (p, s) in {"classes": _every_class(), "realistic": _realistic(2048, seed=5)}.items():
        offs = [0, 7, 300, 301, p.shape[0]]
        r = requantize(p, s, offs)
        arrays[f"{name}.packed"], arrays[f"{name}.scales"] = r.packed.numpy(), r.scales.view(torch.int16).numpy()
        arrays[f"{name}.stats"] = r.stats.numpy()
    np.savez(out_path, **arrays)


def test_triton_kernel_matches_cpu(tmp_path):
    pytest.importorskip("triton")
    got = run_interpreted(__name__, tmp_path / "out.npz")
    for name, (p, s) in {"classes": _every_class(), "realistic": _realistic(2048, seed=5)}.items():
        ref = cpu_kernel.server_requantize(p, s, [0, 7, 300, 301, p.shape[0]])
        assert np.array_equal(got[f"{name}.packed"], ref.packed.numpy()), name
        assert np.array_equal(got[f"{name}.scales"], ref.scales.view(torch.int16).numpy()), name
        np.testing.assert_allclose(got[f"{name}.stats"][:, :2], ref.stats[:, :2].numpy(), rtol=1e-12, atol=0)
        assert np.array_equal(got[f"{name}.stats"][:, 2:], ref.stats[:, 2:].numpy()), name


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """A make-fixture checkpoint converted with each rule through the CLI."""
    root = tmp_path_factory.mktemp("rules")
    src = str(root / "src")
    r = run_cli("make-fixture", src, "--layers", "3", "--experts", "4", "--shards", "2")
    assert r.exit_code == 0, r.output
    out = {}
    for rule in ("optimal", "optimal-pm7", "vllm-gfx942"):
        dst = str(root / rule)
        r = run_cli("mxfp4-to-int4", src, "-o", dst, "--scale-rule", rule, "--progress", "none")
        assert r.exit_code == 0, (r.output, r.exception)
        out[rule] = (dst, r.stdout)
    return src, out


def _tensors(root: str) -> dict[str, torch.Tensor]:
    wm = read_json(os.path.join(root, "model.safetensors.index.json"))["weight_map"]
    out = {}
    for shard in sorted(set(wm.values())):
        with safe_open(os.path.join(root, shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_cli_output_is_the_servers_int4_on_every_tensor(both):
    src, out = both
    dst, stdout = out["vllm-gfx942"]
    s_t, d_t = _tensors(src), _tensors(dst)
    modules = [k[: -len(".weight_packed")] for k in d_t if k.endswith(".weight_packed")]
    assert len(modules) == 24
    for m in modules:
        q_want, s_want, finite = server_reference(s_t[f"{m}.weight_packed"], s_t[f"{m}.weight_scale"])
        assert finite.all()
        q_got = ct_int4_q(d_t[f"{m}.weight_packed"], d_t[f"{m}.weight_shape"])  # compressed-tensors decodes
        assert torch.equal(q_got, q_want), m
        assert torch.equal(d_t[f"{m}.weight_scale"].view(torch.int16), s_want.view(torch.int16)), m
    cfg = read_json(os.path.join(dst, "config.json"))
    assert cfg["text_config"]["quantization_config"]["k3convert_scale_rule"] == "vllm-gfx942"
    assert read_json(os.path.join(dst, "k3convert_manifest.json"))["scale_rule"] == "vllm-gfx942"
    # both reports show both errors, and the CLI prints the ratio
    rep = read_json(os.path.join(dst, "k3convert_report.json"))
    rep_opt = read_json(os.path.join(out["optimal"][0], "k3convert_report.json"))
    assert rep["scale_rule"] == "vllm-gfx942" and rep_opt["scale_rule"] == "optimal"
    assert math.isclose(rep["cmp_rel_rmse_mean"], rep_opt["rel_rmse_mean"], rel_tol=1e-9)
    assert math.isclose(rep_opt["cmp_rel_rmse_mean"], rep["rel_rmse_mean"], rel_tol=1e-9)
    assert rep_opt["cmp_ratio"] > 1.1 and math.isclose(rep["cmp_ratio"] * rep_opt["cmp_ratio"], 1.0, rel_tol=1e-9)
    for layer in rep_opt["layers"]:
        assert layer["cmp_rel_rmse_mean"] > layer["rel_rmse_mean"] and layer["cmp_out_rel_worst"] > 0
    assert f"server load-time int4 (vLLM gfx942): {rep_opt['cmp_ratio']:.2f}x our error" in out["optimal"][1]
    assert f"would give {rep['cmp_ratio']:.2f}x this error" in stdout
    r = run_cli("inspect", out["optimal"][0])
    assert f"{rep_opt['cmp_ratio']:.2f}x our error" in r.stdout and "scale rule:   optimal" in r.stdout


def test_resume_with_another_rule_is_refused(both):
    src, out = both
    r = run_cli("mxfp4-to-int4", src, "-o", out["vllm-gfx942"][0], "--progress", "none")
    assert r.exit_code == 4 and "holds a different conversion" in r.stderr
    with pytest.raises(Exception, match="--scale-rule"):
        Options(scale_rule="amax/7").check()


def _flip_one_code(dst: str) -> str:
    """Change one int4 nibble of one expert in DST's shard, in place; returns the module."""
    wm = read_json(os.path.join(dst, "model.safetensors.index.json"))["weight_map"]
    name = sorted(k for k in wm if k.endswith(".weight_packed"))[0]
    path = os.path.join(dst, wm[name])
    header, start = raw_header(path)
    off = start + header[name]["data_offsets"][0] + 5
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ 0x01]))
    return name[: -len(".weight_packed")]


@pytest.mark.parametrize("rule,check", [("optimal", "re-decode"), ("optimal-pm7", "re-decode"),
                                        ("vllm-gfx942", "scale rule")])
def test_verify_source_knows_the_rule(both, tmp_path, rule, check):
    import shutil

    src, out = both
    res = verify(out[rule][0], src, None)
    assert res.ok, res.problems
    assert any(c.name == check for c in res.checks)
    ratio = [n for c in res.checks for n in c.notes if "x our error" in n or "x this error" in n]
    assert ratio, "verify prints the ratio"
    dst = str(tmp_path / "dst")
    shutil.copytree(out[rule][0], dst)
    m = _flip_one_code(dst)
    bad = verify(dst, src, None, checksums=False)
    assert not bad.check(check).ok and any(m in p for p in bad.check(check).problems), bad.problems


def test_cli_optimal_pm7_writes_no_minus_8_and_is_recorded(both, tmp_path):
    """``--scale-rule optimal-pm7``: the [-7, 7] optimum of every tensor (the reference's bytes), no
    code -8 anywhere, recorded in config, manifest and report, compared with the server rule; and
    verify's optimality check refuses a planted -8."""
    import shutil

    from converter.quant import requant

    src, out = both
    dst, stdout = out["optimal-pm7"]
    s_t, d_t, o_t = _tensors(src), _tensors(dst), _tensors(out["optimal"][0])
    modules = [k[: -len(".weight_packed")] for k in d_t if k.endswith(".weight_packed")]
    minus8 = 0
    for m in modules:
        p, s = s_t[f"{m}.weight_packed"], s_t[f"{m}.weight_scale"]
        want = requant.requantize(p.reshape(-1, 16), s.reshape(-1), qmin=-7)
        got = d_t[f"{m}.weight_packed"].contiguous().view(torch.uint8).reshape(-1, 16)
        assert torch.equal(got, want.packed), m
        assert torch.equal(d_t[f"{m}.weight_scale"].view(torch.int16).reshape(-1), want.scales.view(torch.int16)), m
        assert not bool((ct_int4_q(d_t[f"{m}.weight_packed"], d_t[f"{m}.weight_shape"]) == -8).any()), m
        minus8 += int((ct_int4_q(o_t[f"{m}.weight_packed"], o_t[f"{m}.weight_shape"]) == -8).sum())
    assert minus8 > 0  # the [-8, 7] optimum of the same weights does use -8
    assert read_json(os.path.join(dst, "config.json"))["text_config"]["quantization_config"][
        "k3convert_scale_rule"] == "optimal-pm7"
    assert read_json(os.path.join(dst, "k3convert_manifest.json"))["scale_rule"] == "optimal-pm7"
    rep = read_json(os.path.join(dst, "k3convert_report.json"))
    rep_opt = read_json(os.path.join(out["optimal"][0], "k3convert_report.json"))
    assert rep["scale_rule"] == "optimal-pm7" and rep["compare_rule"] == "vllm-gfx942"
    assert math.isclose(rep["cmp_rel_rmse_mean"], rep_opt["cmp_rel_rmse_mean"], rel_tol=1e-9)
    assert rep_opt["rel_rmse_mean"] < rep["rel_rmse_mean"] < rep["cmp_rel_rmse_mean"]
    assert f"server load-time int4 (vLLM gfx942): {rep['cmp_ratio']:.2f}x our error" in stdout
    # a -8 planted in a group: the optimality check names it
    bad_dst = str(tmp_path / "planted")
    shutil.copytree(dst, bad_dst)
    wm = read_json(os.path.join(bad_dst, "model.safetensors.index.json"))["weight_map"]
    name = sorted(k for k in wm if k.endswith(".weight_packed"))[0]
    path = os.path.join(bad_dst, wm[name])
    header, start = raw_header(path)
    with open(path, "r+b") as f:
        f.seek(start + header[name]["data_offsets"][0])
        b = f.read(1)[0]
        f.seek(start + header[name]["data_offsets"][0])
        f.write(bytes([b & 0xF0]))  # low nibble 0: code -8
    res = verify(bad_dst, src, None, checksums=False)
    assert any("code -8 written" in p for p in res.check("optimality").problems), res.problems


def test_job_file_takes_the_rule(both, tmp_path):
    src, _ = both
    job = tmp_path / "job.toml"
    job.write_text(f'src = "{src}"\nscale-rule = "vllm-gfx942"\n')
    r = run_cli("mxfp4-to-int4", src, "--config", str(job), "-o", str(tmp_path / "d"), "--dry-run")
    assert r.exit_code == 0, r.output
    assert "scale_rule: vllm-gfx942" in r.stdout
    job.write_text('scale-rule = "amax7"\n')
    r = run_cli("mxfp4-to-int4", src, "--config", str(job), "--dry-run")
    assert r.exit_code == 2 and "amax7" in r.output


@pytest.mark.parametrize("rule", ["optimal", "optimal-pm7", "vllm-gfx942"])
def test_comparison_pass_gives_the_fused_figures(both, tmp_path, rule):
    """The GPU path's comparison (a second kernel over the batch, as when the optimal kernel gives
    no server error on the way), run here with the torch references: the same figures."""
    from converter.quant import requant
    from converter.run.plan import build_plan
    from converter.run.shard import ShardConverter

    src, out = both
    sp = max(build_plan(src).shards, key=lambda s: len(s.converts))
    figs, digests = {}, {}
    qmin = optimum_qmin(rule)
    for name, opt, srv in (("fused", functools.partial(cpu_kernel.requantize, qmin=qmin), cpu_kernel.server_requantize),
                           ("pass", functools.partial(requant.requantize, qmin=qmin), server_rule.requantize)):
        d = tmp_path / name
        d.mkdir()
        res = ShardConverter(opt, "cpu", 1 << 12, rule=rule, server=srv).convert(sp, str(d))
        figs[name], digests[name] = {f.name: f for f in res.figures}, res.digest
    assert digests["fused"] == digests["pass"]  # the same bytes whichever implementation
    assert figs["fused"].keys() == figs["pass"].keys() and figs["fused"]
    for n, a in figs["fused"].items():
        b = figs["pass"][n]
        assert math.isclose(a.rel_rmse, b.rel_rmse, rel_tol=1e-9) and a.cmp_rel_rmse is not None
        assert math.isclose(a.cmp_rel_rmse, b.cmp_rel_rmse, rel_tol=1e-9), n
        assert (a.cmp_out_rel is None) == (b.cmp_out_rel is None) and (a.cmp_out_rel is None or math.isclose(
            a.cmp_out_rel, b.cmp_out_rel, rel_tol=1e-9)), n
    assert any(f.cmp_out_rel is not None for f in figs["pass"].values())


def test_the_rule_is_recorded_once_and_read_back_by_one_helper():
    """The int4 block names its scale rule as the dialect writes it; manifest, run options and old
    outputs (no rule recorded) are read by one helper (quant.rules.recorded_rule)."""
    from converter.fixture import FixtureSpec, config
    from converter.formats.checkpoint import quant_blocks
    from converter.formats.compressed_tensors import compressed_tensors_source
    from converter.formats.dialect import int4_block
    from converter.quant.rules import DEFAULT, RULE_KEY, recorded_rule

    assert int4_block([], [])[RULE_KEY] == DEFAULT
    assert int4_block(["a.b"], [], {"kv_cache_scheme": {"x": 1}}, "vllm-gfx942")[RULE_KEY] == "vllm-gfx942"
    src = config(FixtureSpec())
    src["side"] = {"quantization_config": {"quant_method": "other"}}  # not a block the dialect replaces
    out = compressed_tensors_source(src, "config.json").int4_config(src, ["m.experts.0.w1"], [], "vllm-gfx942")
    rules = {".".join(p): b.get(RULE_KEY) for p, b in quant_blocks(out)}
    assert rules == {"text_config.quantization_config": "vllm-gfx942", "side.quantization_config": None}
    assert RULE_KEY not in src["text_config"]["quantization_config"]  # the source config is not changed
    assert recorded_rule({"scale_rule": "vllm-gfx942", "options": {"scale_rule": "optimal"}}) == "vllm-gfx942"
    assert recorded_rule({"options": {"scale_rule": "vllm-gfx942"}}) == "vllm-gfx942"
    assert recorded_rule({}) == recorded_rule({"scale_rule": None, "options": None}) == DEFAULT
