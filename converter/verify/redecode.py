"""Checks "re-decode" and "optimality" / "scale rule" (with --source): sampled experts decoded from
SRC's MXFP4 bytes and from DST's int4 (``reader``) must give the error the figure table records
(to REL_TOL), and their groups must be the exact optimum (or the server rule's bytes)."""
from __future__ import annotations

import math

from ..checks import Check
from ..formats import checkpoint as ckpt
from ..formats.nvfp4 import DIALECT as NVFP4
from ..quant.rules import OPTIMA
from ..run.plan import PACKED, SCALE, SHAPE
from .context import Context
from .dst import scale_rule
from .optimum import brute_force_min, has_minus_8, same_as_rule
from .reader import Tensors, int4_reader
from .sample import spread

REL_TOL = 1e-6         # re-decoded relative RMSE vs the recorded figure
OPT_GROUPS = 8         # groups per tensor checked against a brute-force optimum
OPT_TENSORS = 8        # tensors whose groups are checked that way (the first sampled ones)


def nvfp4_module(s_t: Tensors, m: str, quant: dict, device):
    """Module ``m``'s NVFP4 values in float64 (``nvfp4_requant.decode``) on ``device`` and the scales the
    conversion's own search (``kernels.nvfp4_searcher``: numba, or the Triton kernel on a GPU) gives its groups; names
    and how the global scale applies as the manifest's source record says; KeyError names a missing tensor."""
    from ..kernels import nvfp4_searcher
    from ..quant.nvfp4_requant import GlobalScale, decode

    g = s_t.get(f"{m}.{quant['global_suffix']}")
    gs = GlobalScale(float(g.reshape(())), quant.get("global_applies") == "divide")
    packed = s_t.get(f"{m}.{quant['packed_suffix']}").to(device)
    scales = s_t.get(f"{m}.{quant.get('scale_suffix', SCALE)}").to(device)
    return decode(packed, scales, gs), nvfp4_searcher(packed.device.type)(packed, scales, gs)


def run(ctx: Context) -> list[Check]:
    d = ctx.dst
    if ctx.source is None:
        where = (d.manifest.get("source") or {}).get("path")
        return [Check("re-decode", f"not run: give --source (the manifest names {where})", skipped=True)]
    import torch

    from ..formats import mxfp4

    src, rows, result = ctx.source, ctx.rows, ctx.result
    src_wm = ckpt.weight_map(src)   # BadInput (exit 2) when the source is unreadable
    c = Check("re-decode")
    rule = scale_rule(d)
    opt = Check("optimality" if rule.optimum else "scale rule")  # vllm-gfx942 is not the optimum
    result.decoder, read_int4 = int4_reader()
    s_t, d_t = Tensors(src, src_wm), Tensors(d.path, {t: s for t, (s, _) in d.where.items()})
    # the source's dialect, as the conversion recorded it: tensor names and E8M0 bias
    quant = (d.manifest.get("source") or {}).get("quantization") or {}
    packed_suffix, bias = quant.get("packed_suffix", PACKED), int(quant.get("scale_bias", 127))
    scale_suffix = quant.get("scale_suffix", SCALE)   # Ling: X.weight_scale_inv
    nvfp4_source = quant.get("dialect") == NVFP4   # E4M3 scales per 16 and a global scale (docs/nvfp4.md)
    names = spread(sorted(rows), ctx.sample)
    worst_dev, opt_groups = 0.0, 0
    # NVFP4: every group is held to the conversion's search, on a GPU when there is one (docs/nvfp4.md §5)
    on = torch.device("cuda" if nvfp4_source and torch.cuda.is_available() else "cpu")
    searched = 0
    for i, name in enumerate(names):
        m = name[: -len(PACKED) - 1]
        try:
            if nvfp4_source:
                w, searched_s = nvfp4_module(s_t, m, quant, on)
            else:
                src_packed, src_scales = s_t.get(f"{m}.{packed_suffix}"), s_t.get(f"{m}.{scale_suffix}")
                if src_scales.dtype == torch.float8_e8m0fnu:   # safetensors F8_E8M0: the same bytes as uint8
                    src_scales = src_scales.view(torch.uint8)
                w = mxfp4.decode(src_packed, src_scales, bias, torch.float64)
        except KeyError as e:
            c.fail(f"{m}: the source has no {e.args[0]}")
            continue
        try:
            shape = d_t.get(f"{m}.{SHAPE}").tolist()
            if shape != list(w.shape):
                c.fail(f"{m}: {SHAPE} {shape}, the source is {list(w.shape)}")
                continue
            words, int4_scales = d_t.get(f"{m}.{PACKED}").to(on), d_t.get(f"{m}.{SCALE}").to(on)
            wq = read_int4(words, int4_scales, shape)
        except Exception as e:  # missing or malformed output tensors: the structure checks say which
            c.fail(f"{m}: cannot be read back ({type(e).__name__}: {e})")
            continue
        bad = int((~torch.isfinite(wq)).sum())
        if bad:
            c.fail(f"{m}: {bad} non-finite int4 value(s)")
            continue
        diff = wq - w
        err2, ref2 = float((diff * diff).sum()), float((w * w).sum())
        rel = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
        want = rows[name]["rel_rmse"]
        dev = abs(rel - want) / max(abs(want), 1e-30) if rel != want else 0.0
        worst_dev = max(worst_dev, dev)
        if dev > REL_TOL:
            c.fail(f"{name}: re-decoded relative RMSE {rel:.9g}, table says {want:.9g} (off by {dev:.2e} relative)")
        max_abs = float(diff.abs().max()) if diff.numel() else 0.0
        if abs(max_abs - rows[name]["max_abs"]) > REL_TOL * max(rows[name]["max_abs"], 1e-30):
            c.fail(f"{name}: re-decoded max abs error {max_abs:.9g}, table says {rows[name]['max_abs']:.9g}")
        if nvfp4_source and rule.optimum:
            from ..quant.nvfp4_requant import quantize

            groups = w.reshape(-1, 32)
            same = (wq.reshape(-1, 32) == quantize(groups, searched_s).double() * searched_s.unsqueeze(1)).all(1)
            same &= int4_scales.reshape(-1).double() == searched_s
            if not bool(same.all()):
                opt.fail(f"{m}: {int((~same).sum())} of {same.numel()} group(s) differ from the search's optimum")
            searched += same.numel()
        if rule.optimum and rule.qmin > -8 and has_minus_8(words):
            opt.fail(f"{m}: code -8 written, outside the {rule} rule's range [{rule.qmin}, 7]")
        if not rule.optimum and nvfp4_source:
            opt.fail(f"{m}: an NVFP4 source is converted at the optimum only, DST's config says {rule}")
        elif not rule.optimum:
            opt_groups += same_as_rule(m, src_packed, src_scales, bias, words, int4_scales, opt)
        elif i < OPT_TENSORS:
            g_err = (diff * diff).reshape(-1, 32).sum(1).cpu()
            picks = torch.unique(torch.cat((g_err.topk(min(OPT_GROUPS // 2, g_err.numel())).indices,
                                            torch.linspace(0, g_err.numel() - 1, OPT_GROUPS // 2).long())))
            best = brute_force_min(w.reshape(-1, 32)[picks.to(on)].cpu(), OPTIMA[rule])
            for g, err, b in zip(picks.tolist(), g_err[picks].tolist(), best.tolist()):
                if err > b * (1 + 1e-12) + 1e-300:
                    opt.fail(f"{m}: group {g} has squared error {err:.6g}, the best bf16 scale gives {b:.6g}")
            opt_groups += len(picks)
    result.sampled = len(names)
    c.summary = (f"{len(names)} of {len(rows)} tensor(s) from the source bytes; largest deviation from the "
                 f"table {worst_dev:.1e} (limit {REL_TOL:g}); int4 read by {result.decoder}")
    opt.summary = f"{opt_groups} group(s) of {min(len(names), OPT_TENSORS)} tensor(s) vs every bf16 scale" \
        + (f" (codes [{OPTIMA[rule]}, 7]; no -8 in {len(names)} tensor(s))" if OPTIMA[rule] > -8 else "") \
        if rule in OPTIMA else f"{opt_groups} group(s) of {len(names)} tensor(s) byte-identical to the {rule} rule " \
        "(quant/server_rule.py) applied to the source bytes"
    if searched:
        opt.summary += f"; all {searched} group(s) at the search's optimum (kernels.nvfp4_searcher, {on.type})"
    if not names:
        c.skipped = opt.skipped = True
    return [c, opt]
