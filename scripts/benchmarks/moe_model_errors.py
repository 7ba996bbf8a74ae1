"""Error tables for the non-K3 models: each tiny fixture converted, every routed expert's output
(gate/up -> the model's activation -> down) compared against the MXFP4 dequantization.

    PYTHONPATH=$PWD:$PWD/tests python scripts/benchmarks/moe_model_errors.py [OUT_DIR]

MiniMax-M3 uses vLLM's swigluoai_uninterleave (models/minimax_m3/amd/model.py 306-321: gate *
sigmoid(alpha * gate) * (up + beta), gate clamped above at limit, up to [-limit, limit]) with the
config's alpha 1.702, limit 7.0 and vLLM's default beta 1.0; MiMo-V2 uses silu (gate * sigmoid(gate)
* up); Ling-3.0 and GLM-5.3 use silu clamped as vLLM's swiglu_limit_func does (fused_moe/utils.py
585-597: gate clamped above at the limit, up to [-limit, limit]) with Ling's per-layer
expert_swiglu_limit_list (7.0 on layer 1 and 10.0 on layer 2 of the fixture) and GLM's swiglu_limit 10.0. MXFP4 is decoded by compressed-tensors, int4 by compressed-tensors' unpack_from_int32.
Inputs are 256 fixed random tokens (seed 0) of unit variance. Prints one Markdown table per model.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile

import glm5_fixture
import ling_fixture
import mimo_v2_fixture
import minimax_m3_fixture
import torch
from conftest import all_tensors, ct_int4_values, ct_mxfp4_values

from converter.run.options import Options
from converter.run.pipeline import convert


def swigluoai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, beta: float = 1.0,
              limit: float = 7.0) -> torch.Tensor:
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def silu_limit(limit: float):
    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu(gate.clamp(max=limit), up.clamp(-limit, limit))
    act.__name__ = f"silu, limit {limit}"
    return act


def ling_act(expert: str):
    """Ling's clamp is per layer (bailing_moe_v3.py 1180-1182)."""
    return silu_limit(ling_fixture.LIMITS[int(expert.split(".layers.")[1].split(".")[0])])


MODELS = {  # name -> (fixture writer, packed suffix in the source, projection names gate/up/down, activation)
    "MiniMax-M3 (compressed-tensors MXFP4)": (minimax_m3_fixture.write, "weight_packed", ("w1", "w3", "w2"),
                                              swigluoai),
    "MiMo-V2 FP4 (fp8 + store_dtype mxfp4)": (mimo_v2_fixture.write, "weight", ("gate_proj", "up_proj", "down_proj"),
                                              silu),
    "Ling-3.0-flash-fp4 (fp8 ue8m0 + routed_experts_quant_method mxfp4)": (
        ling_fixture.write, "weight", ("gate_proj", "up_proj", "down_proj"), ling_act, "weight_scale_inv"),
    "GLM-5.3-Flash (AMD Quark MXFP4, amd-quark 0.13 glm5_next template)": (
        glm5_fixture.write, "weight", ("gate_proj", "up_proj", "down_proj"), silu_limit(10.0)),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def table(name: str, root: str) -> str:
    write, packed, (g, u, d), act, *scale = MODELS[name]
    scale_name = scale[0] if scale else "weight_scale"
    src, dst = os.path.join(root, "src"), os.path.join(root, "dst")
    write(src)
    convert(src, dst, Options())
    before, after = all_tensors(src), all_tensors(dst)

    def mx(m):
        return ct_mxfp4_values(before[f"{m}.{packed}"][1], before[f"{m}.{scale_name}"][1].view(torch.uint8))

    experts = sorted({n.rsplit(".", 2)[0] for n in before if n.endswith(f".{g}.{packed}") and ".experts." in n
                      and before[n][1].dtype == torch.uint8 and "shared_experts" not in n})
    rows, w_err, o_err = [], [], []
    hidden = before[f"{experts[0]}.{g}.{packed}"][1].shape[1] * 2   # two E2M1 codes a byte
    x = torch.randn(256, hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    per_expert = act is ling_act
    for e in experts:
        f = act(e) if per_expert else act
        ws = {p: (mx(f"{e}.{p}"), ct_int4_values(after, f"{e}.{p}")) for p in (g, u, d)}
        w_err += [rel(b, a) for a, b in ws.values()]
        ref = f(x @ ws[g][0].T, x @ ws[u][0].T) @ ws[d][0].T
        out = f(x @ ws[g][1].T, x @ ws[u][1].T) @ ws[d][1].T
        o_err.append(rel(out, ref))
        rows.append((e, max(rel(b, a) for a, b in ws.values()), o_err[-1]))
    what = "silu, per-layer limit" if per_expert else act.__name__
    lines = [f"### {name}: {len(experts)} routed experts, activation {what}", "",
             "| expert | worst weight rel. RMSE (int4 vs MXFP4) | expert output rel. error |", "|---|---|---|"]
    lines += [f"| `{e}` | {w:.4f} | {o:.4f} |" for e, w, o in rows]
    lines += ["", f"mean weight rel. RMSE {sum(w_err) / len(w_err):.4f}, worst {max(w_err):.4f}; mean expert output "
                  f"error {sum(o_err) / len(o_err):.4f}, worst {max(o_err):.4f} "
                  f"(SNR {-20 * math.log10(max(o_err)):.1f} dB at the worst)", ""]
    return "\n".join(lines)


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="moe-errors-")
    for i, name in enumerate(MODELS):
        print(table(name, os.path.join(root, str(i))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
