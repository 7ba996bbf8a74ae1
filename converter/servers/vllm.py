"""vLLM: which MoE method and kernel its code gives DST's int4 experts, per target and release.

Stock vLLM on ROCm and CUDA runs the WNA16 backend oracle (``oracle``); on gfx942 with the
k3convert plugin the plugin's own decision (converter/vllm_plugin/route.py) runs first, against
the release asked about. Where each step is enforced is the release's data (``releases/``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..errors import BadInput
from ..formats import checkpoint as ckpt, kimi_dsa
from ..releases import MoeActivation, Release, unbuilt
from ..vllm_plugin import route as plugin_route
from .context import Context, activation
from .headers import GROUP, model_types, nonzero_values
from .memory import Memory, expert_memory, kimi_fused, kimi_min_per_rank, kimi_padding
from .rules import TARGETS, Problem, Server, Verdict
from .sglang import clamp_limits
from .topology import Topology

# activations vLLM's WNA16 kernels take: TritonWNA16Experts' allow-list, and apply_moe_activation's
TRITON_ACTS = frozenset({"silu", "gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave", "swiglustep",
                         "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul"})
APPLY_ACTS = TRITON_ACTS | {"situ"}

# The plugin's load-time kernel self-test (converter/vllm_plugin/moe_method.py _will_self_test): the
# first routed-experts layer each rank lays out, through the layer's own kernel; with DP+EP all2all it
# runs the local expert kernel with the layer's expert mask, no collective.
SELF_TEST = "self-test runs"
SELF_TEST_ALL2ALL = "self-test runs (local kernel, no all2all)"


def moe_activation(config: dict | None, hidden_act: str, release: Release) -> tuple[str, MoeActivation | None, str]:
    """(the activation the kernel oracle is asked for, the release's override for the model or None,
    its parameters as a phrase)."""
    hit = next((release.facts.moe_activations[t] for t in sorted(model_types(config))
                if t in release.facts.moe_activations), None)
    if hit is None:
        return hidden_act, None, ""
    fields = {k: v for k, (v, _) in ckpt.activation_fields(config or {}, tuple(hit.defaults)).items()
              if k in hit.defaults}
    if hit.when and not nonzero_values(fields.get(hit.when)):
        return hidden_act, None, ""

    def shown(v: object) -> str:
        return ", ".join(f"{x:g}" for x in nonzero_values(v)) if isinstance(v, list) else str(v)
    said = [f"{k.removeprefix('swiglu_')} {shown(fields.get(k, d))}{'' if k in fields else ' (default)'}"
            for k, d in hit.defaults.items()]
    said += [f"{k.removeprefix('swiglu_')} {v} (fixed)" for k, v in hit.fixed.items()]
    return hit.name, hit, ", ".join(said)


def _with_activation(v: Verdict, server: Server, hit: MoeActivation | None, said: str) -> Verdict:
    """The activation the model passes: its parameters in the summary, its source lines in the detail."""
    if hit is None:
        return v
    detail = "; ".join(x for x in (v.detail, f"the activation: {server.release.cite(hit.cite)}") if x)
    return v.amend(said=f"; FusedMoE gets activation {hit.name} ({said})", detail=detail)


def int4_text(mem: Memory) -> str:
    return f"int4 as stored, {mem.int4 / 1e9:.3g} GB per rank"


def oracle(server: Server, act: str, mem: Memory, topo: Topology, marlin: bool) -> Verdict:
    """vLLM's WNA16 backend oracle for our weight key (int4 group 32, symmetric, no zero points)."""
    rel, method = server.release, server.method
    if act not in APPLY_ACTS:
        return Verdict(method, outcome=": no backend", problem=f"no WNA16 MoE backend takes activation {act!r}",
                       detail=rel.cite("oracle.none"))
    memory = f"; {int4_text(mem)}"
    if marlin:
        return Verdict(f"{method} -> MARLIN (Humming first on SM90 if installed)", f", takes {act}", memory,
                       detail=rel.cite("oracle.marlin"))
    if act in TRITON_ACTS:
        return Verdict(f"{method} -> TRITON (TritonWNA16Experts)", f", {act}", memory,
                       detail=rel.cite("oracle.triton"))
    why = "Marlin is CUDA-only and TRITON has no situ" if server.target.target.startswith("ROCm") else \
        "Marlin needs hidden % 128 == 0 and per-rank intermediate % 32 == 0, TRITON has no situ"
    return Verdict(f"{method} -> EMULATION",
                   problem=f"EMULATION: bf16 dequantization at load, {mem.bf16 / 1e9:.3g} GB per rank at {topo.text()}",
                   detail=f"{server.release_text} on {server.target.target} gives the experts {method} -> EMULATION "
                          f"({why}): {mem.text()}, {mem.split()}")


@dataclass(frozen=True)
class _Asked:
    """What every target's verdict starts from: the config's activation, the one FusedMoE is given,
    and the experts' memory at the topology."""

    fields: dict                     # hidden_act and the SiTU betas (context.activation)
    name: str                        # the activation the kernel oracle is asked for
    hit: MoeActivation | None
    said: str
    mem: Memory
    kimi_min: int


def _rocm(ctx: Context, topo: Topology, a: _Asked) -> Verdict:
    return _with_activation(oracle(ctx.server, a.name, a.mem, topo, marlin=False), ctx.server, a.hit, a.said)


def _cuda(ctx: Context, topo: Topology, a: _Asked) -> Verdict:
    server, config, sizes, act, kimi_min = ctx.server, ctx.config, ctx.sizes, a.name, a.kimi_min
    hidden_ok = all(h % 128 == 0 for _, h in sizes.values())
    inter_ok = all((kimi_fused(i, topo.tp, kimi_min) // topo.moe_tp) % GROUP == 0 for i, _ in sizes.values())
    verdict = _with_activation(oracle(server, act, a.mem, topo, marlin=hidden_ok and inter_ok), server, a.hit, a.said)
    if verdict.problem is None and act == "silu" and (limits := clamp_limits(config)[2]):
        verdict = verdict.amend(act=f"{verdict.act} with the clamp ({limits})",
                                detail=f"{verdict.detail}; {server.release.cite('cuda.clamp')}")
    padded = kimi_padding(sizes, topo.tp, kimi_min)
    if verdict.problem is None and padded:
        _, (per, pad) = padded[0]
        return verdict.amend(outcome=": padded channels hold garbage",
                             problem=f"KimiMoE pads per-rank intermediate {per} to {pad} at TP {topo.tp}; Marlin "
                                     f"computes the unzeroed padding",
                             detail=f"vLLM's KimiMoE pads ({server.release.cite('kimi.padding')}): "
                                    f"{server.release.cite('cuda.padding-garbage')}")
    return verdict


def _plugin(ctx: Context, topo: Topology, a: _Asked) -> Verdict:
    """The plugin's own decision (converter/vllm_plugin/route.py) on a gfx942 machine with AITER MoE on,
    this release's vLLM and an aiter whose a16w4 stage-1 takes SiTUv2; stock vLLM decides when it stays out."""
    server, config, act, mem, kimi_min = ctx.server, ctx.config, a.fields, a.mem, a.kimi_min
    release = server.release
    blocks = [b for _, b in ckpt.quant_blocks(config or {})]

    def gemm1(*args, act=None, situ_beta=None, situ_linear_beta=None, **kw):   # the aiter the server needs
        raise NotImplementedError

    machine = plugin_route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=True,
                                   vllm_version=release.version, gemm1=gemm1)
    try:
        name = plugin_route.decide(blocks[0] if blocks else None, None, config or {}, machine, tensors=ctx.indexer)
    except plugin_route.Refused as e:
        return Verdict(server.method, outcome=": refused", problem=str(e),
                       detail="converter/vllm_plugin/route.py decide")
    if name is None:
        stock = oracle(Server(TARGETS["vllm-rocm"], release), act["hidden_act"], mem, topo, marlin=False)
        return stock.amend(kernel=f"plugin stays out, stock vLLM: {stock.kernel}")
    for layer, (inter, hidden) in sorted(ctx.sizes.items()):
        fused = kimi_fused(inter, topo.tp, kimi_min)
        if fused % topo.moe_tp or (fused // topo.moe_tp) % GROUP:
            continue                                        # rule tp-intermediate says it
        padded = plugin_route.kimi_padded(inter, topo.tp, kimi_min) if kimi_min else None
        if padded and (why := plugin_route.padding_refusal(inter, topo.tp, kimi_min, release.version)):
            return Verdict(server.method, outcome=": refused at load",
                           problem=f"{release.name} KimiMoE pads intermediate {padded[0]} to {padded[1]} per rank "
                                   f"at TP {topo.tp} and cannot build it",
                           detail=f"{plugin_route.PREFIX} {layer}: {why} (converter/vllm_plugin/moe_method.py "
                                  f"create_weights; {release.cite('kimi.padding')})")
        per_rank = fused // topo.moe_tp
        if why := plugin_route.size_problem(hidden, per_rank):
            return Verdict(server.method, outcome=": refused at load",
                           problem=f"the plugin refuses per-rank sizes its kernel would pad: {why}",
                           detail=f"{plugin_route.PREFIX} {layer}: {why} at {topo.text()} (MoE TP {topo.moe_tp}): "
                                  f"the plugin refuses sizes its kernel would pad (converter/vllm_plugin/"
                                  f"moe_method.py maybe_roundup_sizes, route.size_problem)")
    test = SELF_TEST_ALL2ALL if topo.all2all else SELF_TEST
    return Verdict(f"{plugin_route.NAME}: AITER a16w4 with Situv2 beta {act.get('activation_situ_beta')} "
                   f"linear_beta {act.get('activation_situ_linear_beta')}", f", {test}", f"; {int4_text(mem)}",
                   detail=release.cite("plugin.kernel"))


def verdict(ctx: Context, topo: Topology) -> Verdict:
    """The MoE method and kernel this vLLM target gives the experts, as its code selects them."""
    server = ctx.server
    try:
        act = activation(ctx.config)
        name, hit, said = moe_activation(ctx.config, act["hidden_act"], server.release)
    except BadInput as e:
        return Verdict(server.method, outcome=": activation not read", problem=str(e))
    kimi_min = kimi_min_per_rank(ctx.config)
    mem = expert_memory(ctx.experts, topo, kimi_min)
    if act["hidden_act"] == "situ" and act.get("activation_situ_beta") is None:
        return Verdict(server.method, outcome=": SiTU",
                       problem="hidden_act is situ but activation_situ_beta is missing",
                       detail=server.release.cite("situ.beta"))
    return TARGETS_VERDICT[server.name](ctx, topo, _Asked(act, name, hit, said, mem, kimi_min))


TARGETS_VERDICT = {"vllm-rocm": _rocm, "vllm-cuda": _cuda, "vllm-rocm-plugin": _plugin}


def model_problems(config: dict | None, tensors: Iterable[str], server: Server) -> list[Problem]:
    """What this release's model classes refuse whatever the topology: a Kimi model type it does not
    build (K3.1 before 0.34), and K3.1's DSA where config and indexer tensors disagree or where the
    release's classes for the target have no DSA (one rule with the plugin's route: formats/kimi_dsa.py;
    ``tensors``: the checkpoint's DSA indexer tensor names, all it reads)."""
    release, cfg = server.release, config or {}
    if why := unbuilt(release, cfg.get("model_type")):
        return [(f"{release.name} {why}", "transformers_utils/config.py, model_executor/models/registry.py of "
                 "that release")]
    found = kimi_dsa.problem(cfg, tensors, release, rocm=server.target.platform == "ROCm")
    return [(found[0], release.cite(found[1]))] if found else []
