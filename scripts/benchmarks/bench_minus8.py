"""What forbidding int4 code -8 costs: ``optimal`` vs ``optimal-pm7`` vs ``vllm-gfx942`` vs ``repaired``.

Issue 18 §4. AITER's int4 MoE kernel (MI300X/MI325X) has never been run with code -8, so a user may
want the exact optimum over [-7, 7] instead of [-8, 7]. Three figures per rule, each against the MXFP4
original:

* **weights** (K3's routed-expert shapes, w1/w3 [3072, 3584] and w2 [3584, 3072], MXFP4 by the OCP
  recipe from Student-t weights scaled by 1/sqrt(fan-in): 4 degrees of freedom as ``make-fixture``
  draws them, 2 as ``bench_scale_rule.py`` does): relative RMSE (the kernels' exact sums), and how
  often the [-8, 7] optimum uses -8 (groups, codes);
* **expert output**: ||y_int4 - y|| / ||y|| with K3's SiTU-GLU (docs/spec.md §4, beta 4, linear beta 25),
  y = w2 (SiTU(w1 x) * 25 tanh(w3 x / 25)), in float64, for ``--tokens`` Gaussian inputs;
* **model level** (``--kl``): KL(MXFP4 || int4) and top-1 agreement of next-token distributions of
  the tiny Mixtral and Qwen3-MoE models of ``tests/support/moe_compare.py``, each converted by the CLI with
  each rule and run by transformers on the CPU (torch's reference MoE, SiLU experts: these models
  are not K3; vLLM's CPU forward is not run here), averaged over ``--seeds`` random models.

The row ``repaired`` is what the vLLM plugin serves when its self-test finds that the kernel misreads
-8: the ``optimal`` conversion with every group that uses -8 re-optimized at load over [-7, 7] from
the stored int4 (converter.quant.int4_pm7, the plugin's own function); its ``vs stored`` column is the
figure the plugin's warning states (relative weight RMSE against the stored int4).

    PYTHONPATH=. python scripts/benchmarks/bench_minus8.py [--experts 2] [--tokens 64] [--kl] [--seeds 4]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "benchmarks"))
from bench_cpu_kernel import realistic_groups  # noqa: E402  (bench_scale_rule's data: Student-t, 2 dof)

from converter.fixture import _student_t  # noqa: E402  (make-fixture's weights: Student-t, 4 dof)
from converter.formats.mxfp4 import decode, encode  # noqa: E402
from converter.quant import cpu_kernel  # noqa: E402
from converter.quant.int4_pm7 import repair_groups_  # noqa: E402

RULES = {"optimal": lambda p, s: cpu_kernel.requantize(p, s),
         "optimal-pm7": lambda p, s: cpu_kernel.requantize(p, s, qmin=-7),
         "vllm-gfx942": cpu_kernel.server_requantize}
REPAIR_TIME = {"s": 0.0, "groups": 0}   # the repair's own time, on this machine's CPU
REPAIRED = "repaired"         # optimal, repaired at load by the vLLM plugin (int4_pm7)
INTER, LATENT = 3072, 3584   # K3's moe_intermediate_size and routed_expert_hidden_size
BETA, LINEAR_BETA = 4.0, 25.0


def mxfp4_matrix(rows: int, cols: int, dist: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 [rows, cols] matrix: packed [rows * cols / 32, 16], scales [rows * cols / 32]."""
    if dist == "t2":  # scaled by 2**-6 ~ 1/sqrt(fan-in) through the E8M0 bytes: the same MXFP4 codes
        p, s = realistic_groups(rows * cols // 32, seed)
        return p, s - 6
    w = _student_t(torch.Generator().manual_seed(seed), rows, cols) / math.sqrt(cols)
    p, s = encode(w)
    return p.reshape(-1, 16).contiguous(), s.reshape(-1).contiguous()


def int4_decode(res, rows: int, cols: int) -> torch.Tensor:
    q = torch.stack((res.packed & 15, res.packed >> 4), -1).reshape(-1, 32).double() - 8
    return (q * res.scales.double()[:, None]).reshape(rows, cols)


def repaired_decode(res, rows: int, cols: int) -> torch.Tensor:
    """The ``optimal`` result after the plugin's load-time repair (groups using -8 re-optimized)."""
    codes = (torch.stack((res.packed & 15, res.packed >> 4), -1).reshape(-1, 32).to(torch.int16) - 8).to(torch.int8)
    scales = res.scales.clone()
    t0 = time.perf_counter()
    got = repair_groups_(codes, scales)
    REPAIR_TIME["s"] += time.perf_counter() - t0
    REPAIR_TIME["groups"] += got.groups
    return (codes.double() * scales.double()[:, None]).reshape(rows, cols)


def repair_checkpoint(dst: str) -> None:
    """Rewrite an ``optimal`` output's int4 tensors as the plugin repairs them at load (in place)."""
    from safetensors.torch import load_file, save_file

    from converter.vllm_plugin.repair import repair_ct_

    for f in sorted(os.listdir(dst)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(dst, f)
        with open(path, "rb") as fh:      # keep the header metadata (compressed-tensors reads format)
            n = struct.unpack("<Q", fh.read(8))[0]
            meta = json.loads(fh.read(n)).get("__metadata__")
        t = load_file(path)
        for name in [k for k in t if k.endswith(".weight_packed")]:
            base = name[: -len("weight_packed")]
            repair_ct_(t[name].unsqueeze(0), t[base + "weight_scale"].unsqueeze(0))
        save_file(t, path, metadata=meta)


def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """K3's expert activation (docs/spec.md §4)."""
    return BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * (LINEAR_BETA * torch.tanh(u / LINEAR_BETA))


def expert_figures(dist: str, experts: int, tokens: int) -> dict[str, dict[str, float]]:
    acc = {r: {"err2": 0.0, "ref2": 0.0, "out_num": 0.0, "out_den": 0.0} for r in (*RULES, REPAIRED)}
    vs_stored = {"err2": 0.0, "ref2": 0.0}
    minus8_groups = minus8_codes = groups = 0
    for e in range(experts):
        shapes = {"w1": (INTER, LATENT), "w3": (INTER, LATENT), "w2": (LATENT, INTER)}
        src = {n: mxfp4_matrix(*shape, dist, 1000 * e + i) for i, (n, shape) in enumerate(shapes.items())}
        ref_w = {n: decode(p.reshape(shape[0], -1), s.reshape(shape[0], -1), dtype=torch.float64)
                 for (n, (p, s)), shape in zip(src.items(), shapes.values())}
        x = torch.randn(tokens, LATENT, generator=torch.Generator().manual_seed(e), dtype=torch.float64)
        y_ref = situ_glu(x @ ref_w["w1"].T, x @ ref_w["w3"].T) @ ref_w["w2"].T
        for rule, fn in RULES.items():
            w = {}
            for n, (p, s) in src.items():
                res = fn(p, s)
                acc[rule]["err2"] += float(res.stats[0, 0])
                acc[rule]["ref2"] += float(res.stats[0, 1])
                w[n] = int4_decode(res, *shapes[n])
                if rule == "optimal":
                    nib = torch.cat((res.packed & 15, res.packed >> 4), 1) == 0  # nibble 0: code -8
                    minus8_groups += int(nib.any(1).sum())
                    minus8_codes += int(nib.sum())
                    groups += nib.shape[0]
                    stored = w[n]
                    rep = repaired_decode(res, *shapes[n])
                    w.setdefault(REPAIRED, {})[n] = rep
                    ref = ref_w[n]
                    acc[REPAIRED]["err2"] += float(((rep - ref) ** 2).sum())
                    acc[REPAIRED]["ref2"] += float((ref ** 2).sum())
                    vs_stored["err2"] += float(((rep - stored) ** 2).sum())
                    vs_stored["ref2"] += float((stored ** 2).sum())
            rep = w.pop(REPAIRED, None)
            y = situ_glu(x @ w["w1"].T, x @ w["w3"].T) @ w["w2"].T
            acc[rule]["out_num"] += float(((y - y_ref) ** 2).sum())
            acc[rule]["out_den"] += float((y_ref ** 2).sum())
            if rep is not None:
                y = situ_glu(x @ rep["w1"].T, x @ rep["w3"].T) @ rep["w2"].T
                acc[REPAIRED]["out_num"] += float(((y - y_ref) ** 2).sum())
                acc[REPAIRED]["out_den"] += float((y_ref ** 2).sum())
    out = {r: {"rel_rmse": math.sqrt(a["err2"] / a["ref2"]), "out_rel": math.sqrt(a["out_num"] / a["out_den"])}
           for r, a in acc.items()}
    out[REPAIRED]["vs_stored"] = math.sqrt(vs_stored["err2"] / vs_stored["ref2"])
    out["optimal"]["minus8_groups"] = minus8_groups / groups
    out["optimal"]["minus8_codes"] = minus8_codes / (32 * groups)
    return out


def model_kl(seeds: int) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per arch and rule, (KL, top-1) of each seed's model (tests/support/moe_compare.py's pipeline)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import moe_compare as mc

    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    tokens = mc.prompts()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in mc.ARCHS:
            out[arch] = {r: [] for r in RULES}
            for seed in range(seeds):
                src = mc.make_source(arch, os.path.join(tmp, f"{arch}{seed}"), seed)
                ref = mc.transformers_run(src, tokens, 1)[0]
                for rule in RULES:
                    dst = mc.convert_ours(src, os.path.join(tmp, f"{arch}{seed}-{rule}"), rule)
                    out[arch][rule].append(mc.kl_top1(ref, mc.transformers_run(dst, tokens, 1)[0]))
                    if rule == "optimal":
                        rep = os.path.join(tmp, f"{arch}{seed}-{REPAIRED}")
                        shutil.copytree(dst, rep)
                        repair_checkpoint(rep)
                        out[arch].setdefault(REPAIRED, []).append(
                            mc.kl_top1(ref, mc.transformers_run(rep, tokens, 1)[0]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=2, help="K3-shaped experts per distribution")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kl", action="store_true", help="also the model-level KL (tiny models, transformers)")
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    for dist in ("t4", "t2"):
        f = expert_figures(dist, args.experts, args.tokens)
        print(f"\nStudent-t {dist[1]} dof, {args.experts} K3 expert(s) (w1, w3 [{INTER}, {LATENT}], w2 [{LATENT}, "
              f"{INTER}]), {args.tokens} tokens, SiTU-GLU")
        print(f"  optimal uses -8 in {100 * f['optimal']['minus8_groups']:.1f}% of groups, "
              f"{100 * f['optimal']['minus8_codes']:.2f}% of codes")
        print(f"  {'rule':<12} {'weight relRMSE':>14} {'vs optimal':>10} {'expert out err':>14} {'vs optimal':>10}")
        for rule, r in f.items():
            print(f"  {rule:<12} {r['rel_rmse']:>14.5f} {r['rel_rmse'] / f['optimal']['rel_rmse']:>9.3f}x "
                  f"{r['out_rel']:>14.5f} {r['out_rel'] / f['optimal']['out_rel']:>9.3f}x")
        print(f"  {REPAIRED}: relative weight RMSE vs the stored int4 (the plugin's warning figure) "
              f"{f[REPAIRED]['vs_stored']:.5f}; repair time {REPAIR_TIME['s']:.2f} s for {REPAIR_TIME['groups']} "
              f"groups on {torch.get_num_threads()} CPU thread(s)")
        REPAIR_TIME.update(s=0.0, groups=0)
    if args.kl:
        kl = model_kl(args.seeds)
        print(f"\nmodel level: KL(MXFP4 || int4) nats and top-1 agreement, mean of {args.seeds} random models "
              "(tests/support/moe_compare.py, transformers)")
        for arch, rules in kl.items():
            for rule, vals in rules.items():
                k, t = np.mean([v[0] for v in vals]), np.mean([v[1] for v in vals])
                per = " ".join(f"{v[0]:.4f}" for v in vals)
                print(f"  {arch:<10} {rule:<12} KL {k:.4f}  top-1 {t:.3f}   (per model: {per})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
