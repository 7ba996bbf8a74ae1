"""SGLang: which MoE method its code gives DST's int4 experts, and what it does with a SwiGLU clamp.

Both its int4 MoE paths assert SiLU; the clamp models (Ling, GLM-5) reach the kernel by different
fields on the Triton (ROCm; CUDA SM100 by default) and Marlin (CUDA) paths.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput
from ..formats import checkpoint as ckpt
from .context import Context, activation
from .headers import model_types, nonzero_values
from .memory import expert_memory
from .rules import Verdict
from .topology import Topology


@dataclass(frozen=True)
class Clamp:
    """How a model's SGLang MoE passes the experts a SwiGLU clamp: the config field, the
    MoeRunnerConfig field it becomes, and the release's citation key."""

    field: str
    runner_field: str
    cite: str


CLAMPS = {
    "bailing_hybrid": Clamp("expert_swiglu_limit_list", "gemm1_clamp_limit", "clamp.bailing"),
    "glm5_next": Clamp("swiglu_limit", "swiglu_limit", "clamp.glm5"),
}
CLAMPS["bailing_moe_v3"] = CLAMPS["bailing_hybrid"]
CLAMPS["glm5_next_text"] = CLAMPS["glm5_next"]


def clamp_limits(config: dict | None) -> tuple[Clamp | None, list[float], str]:
    """(the model's Clamp, the distinct non-zero limits, "field 7, 10") of a clamped model."""
    hit = next((CLAMPS[t] for t in sorted(model_types(config)) if t in CLAMPS), None)
    if hit is None:
        return None, [], ""
    value = ckpt.activation_fields(config or {}, (hit.field,)).get(hit.field, (None,))[0]
    limits = nonzero_values(value)
    return hit, limits, f"{hit.field} {', '.join(f'{v:g}' for v in limits)}"


def _clamp(ctx: Context, base: Verdict) -> Verdict:
    """What SGLang's int4 MoE paths do with the model's SwiGLU clamp: the Triton path (ROCm; CUDA
    SM100 by default) applies gemm1_clamp_limit and takes swiglu_limit only as DeepSeek-V4's 10 with
    a CUDA/XPU-only kernel when no expert is filtered; Marlin (CUDA) applies swiglu_limit only."""
    hit, limits, said = clamp_limits(ctx.config)
    if hit is None or not limits:
        return base
    rel, rocm = ctx.server.release, ctx.server.name == "sglang-rocm"
    src = f"the model passes it as {hit.runner_field} ({rel.cite(hit.cite)})"
    fused = rel.cite("fused")
    if hit.runner_field == "gemm1_clamp_limit":
        if rocm:
            return base.amend(act=f"{base.act} with the clamp ({said}; silu(gate) clamped after silu, vLLM clamps "
                                  f"the gate before it)", detail=f"{src}; {fused} 759-762, 411-417")
        return base.amend(memory="", outcome=": Marlin drops the clamp",
                          problem=f"{said} is dropped by Marlin (wrong numerics); SGLang's Triton path (SM100 "
                                  f"default, --moe-runner-backend triton) applies it",
                          detail=f"{src}; {rel.cite('clamp.marlin-drops')}")
    if rocm:
        why, lines = ((f"asserts swiglu_limit == 10 ({said})", "768") if limits != [10.0] else
                      ("clamps swiglu_limit with a CUDA/XPU-only kernel when no expert is filtered (no EP)",
                       "777-782: assert _is_cuda or _is_xpu"))
        return base.amend(memory="", outcome=": AssertionError at the first forward",
                          problem=f"SGLang's ROCm Triton MoE {why}: AssertionError at the first forward",
                          detail=f"{src}; {fused} 763-782 ({lines})")
    note = "" if limits == [10.0] else f"; on SM100 the default Triton path asserts swiglu_limit == 10 ({fused} 768)"
    return base.amend(act=f"{base.act} with the clamp ({said}, Marlin: fused_marlin_moe.py 356-361){note}", detail=src)


def verdict(ctx: Context, topo: Topology) -> Verdict:
    """The MoE method SGLang gives the experts: it asserts SiLU, then the clamp decides."""
    server = ctx.server
    try:
        act = activation(ctx.config)
    except BadInput as e:
        return Verdict(server.method, outcome=": activation not read", problem=str(e))
    name = act["hidden_act"]
    rel = server.release
    if name == "situ" and act.get("activation_situ_beta") is None:
        return Verdict(server.method, outcome=": SiTU",
                       problem="hidden_act is situ but activation_situ_beta is missing", detail=rel.cite("situ.beta"))
    if name != "silu":
        return Verdict(server.method, outcome=": asserts silu",
                       problem=f"{server.method} asserts activation == 'silu'; hidden_act is {name!r}",
                       detail=f"{server.release_text} on {server.target.target} gives the experts {server.method}, "
                              f"whose apply_weights asserts activation == 'silu' (compressed_tensors_wNa16_moe.py "
                              f"{rel.cite('kernel.asserts-silu.' + server.name)}): the first forward with "
                              f"hidden_act {name!r} raises AssertionError")
    mem = expert_memory(ctx.experts, topo)
    base = Verdict(server.method, ", int4 Triton/Marlin kernel, silu",
                   f": int4 as stored, {mem.int4 / 1e9:.3g} GB per rank")
    return _clamp(ctx, base)
