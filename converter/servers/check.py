"""The serving check: every rule of a server's int4 MoE path against DST, at a launch topology.

One entry, ``serving_check(config, tensors, request)``, gives `verify` its Check; ``evaluate`` the
rule results (tests and scripts). The rules that depend on the topology are re-run at every TP
size to list the ones that pass.
"""
from __future__ import annotations

from typing import Callable, Mapping

from ..checks import Check
from ..formats import kimi_dsa
from ..formats.safetensors_io import TensorInfo
from ..releases import Family
from . import fp8_tp, headers, sglang, vllm
from .context import Context
from .headers import DTYPES, GROUP
from .loaders import refusals as loader_refusals
from .memory import Fit, Rest, expert_memory, experts_of, fit, kimi_fused, kimi_min_per_rank, rest_of
from .rules import RULES, TOPOLOGY_RULES, Problem, RuleResult, ServingRequest, Verdict, result
from .topology import SPLITS, Topology

# one module per server family, behind one function: (context, topology) -> Verdict
FAMILIES: dict[Family, Callable[[Context, Topology], Verdict]] = {Family.VLLM: vllm.verdict,
                                                                  Family.SGLANG: sglang.verdict}


def context(config: dict | None, tensors: Mapping[str, TensorInfo], request: ServingRequest,
            weigh_rest: bool = False) -> Context:
    """Everything the topology does not change, computed once. The other weights' bytes (a pass over
    every header) only where they are compared with a GPU, or asked for (``weigh_rest``: the card's
    per-rank figure, on CUDA too)."""
    server = request.server
    mats = headers.matrices(tensors)
    dtype = headers.model_dtype(config)
    sizes, shape_problems = headers.layer_sizes(mats)
    fixed: dict[str, list[Problem]] = {rid: [] for rid in RULES}
    for rid, problem in [*headers.config_problems(config),
                         *headers.tensor_problems(mats, DTYPES.get(dtype, dtype.upper())),
                         *headers.name_problems(mats, config), *(("expert-shapes", p) for p in shape_problems),
                         *headers.size_problems(sizes, config),
                         *(("names", p) for p in headers.lookup_problems(config, sizes, server.family))]:
        fixed[rid].append((problem, ""))
    fp8, block = headers.fp8_linears(config, tensors)
    indexer = kimi_dsa.indexer_names(config, tensors)
    if server.family is Family.VLLM:
        fixed["loader"] += vllm.model_problems(config, indexer, server)
        fixed["loader"] += fp8_tp.fused_refusals(config, fp8, (
            n[: -len(".weight")] for n in tensors if n.endswith(".weight")), server.release)
    gpus = request.gpus()
    weigh = bool(gpus) or (weigh_rest and server.family is Family.VLLM)
    return Context(config, mats, sizes, experts_of(mats, sizes, config), fixed, server, fp8, block,
                   rest=rest_of(tensors, mats, server.release, config, server.target.platform) if weigh else Rest(0),
                   gpus=gpus, budget=request.budget(), indexer=indexer)


def _split_problems(ctx: Context, topo: Topology) -> list[Problem]:
    """vLLM's FusedMoEConfig asserts intermediate_size % tp_size == 0 for the MoE's tp_size (dp*tp
    without EP, 1 with EP), and the scales need whole groups per rank. For Kimi on vLLM the size
    split is KimiMoE's, padded."""
    out = []
    vllm_family = ctx.server.family is Family.VLLM
    kimi_min = kimi_min_per_rank(ctx.config) if vllm_family else 0
    moe_tp = topo.moe_tp if vllm_family else topo.tp
    for (inter, _), layers in headers.by_size(ctx.sizes).items():
        fused = kimi_fused(inter, topo.tp, kimi_min)
        if fused % moe_tp or (fused // moe_tp) % GROUP:
            per = f"{fused}/{moe_tp}={fused / moe_tp:g}"
            out.append((f"per-rank intermediate size {per} is not whole groups of {GROUP} at MoE TP {moe_tp}",
                        f"MoE TP {moe_tp} at {topo.text()} "
                        f"({ctx.server.release.cite('split.' + ('ep' if topo.ep_on else 'tp'))}); "
                        f"{len(layers)} MoE layer(s) of intermediate {inter} (tensor shapes)"))
    return out


def _fp8_refusals(ctx: Context, topo: Topology) -> list[Problem]:
    """vLLM's compressed-tensors FP8 block scheme refuses per-rank sizes that are not whole blocks
    (fp8_tp.py); for Ling's shared experts, say the FP8 source was padded instead."""
    release = ctx.server.release
    found = fp8_tp.refusals(ctx.config, ctx.fp8, ctx.block, topo, release)
    if not found:
        return []
    layer, why, _ = found[0]
    more = f" (and {len(found) - 1} more FP8 linears)" if len(found) > 1 else ""
    pad = fp8_tp.ling_padded(ctx.config, topo.tp, ctx.block) if ".shared_experts." in layer + "." else None
    source = (f"; the FP8 source loads here: vLLM pads its shared experts' intermediate {pad[0]} to {pad[1]} "
              f"({release.cite('fp8.ling-pad')})") if pad else ""
    detail = "; ".join(f"{lay}: {w} ({wh})" for lay, w, wh in found)
    return [(f"{layer}: {why} at TP {topo.tp}{more}: vLLM's compressed-tensors FP8 scheme refuses it", detail + source)]


def rank_fit(ctx: Context, topo: Topology) -> Fit | None:
    """One rank's weights against the GPUs (vLLM only: its split is the one modelled)."""
    if ctx.server.family is not Family.VLLM or not ctx.gpus:
        return None
    experts = expert_memory(ctx.experts, topo, kimi_min_per_rank(ctx.config)).int4
    return fit(experts, ctx.rest, topo, ctx.gpus, ctx.budget)


def topology_problems(ctx: Context, topo: Topology) -> tuple[dict[str, list[Problem]], Verdict]:
    """The rules that depend on the topology, at ``topo``, and the kernel verdict."""
    found: dict[str, list[Problem]] = {rid: [] for rid in TOPOLOGY_RULES}
    found["tp-intermediate"] += _split_problems(ctx, topo)
    verdict = FAMILIES[ctx.server.family](ctx, topo)
    if verdict.problem:
        found["kernel"].append((verdict.problem, verdict.detail))
    if ctx.server.family is Family.VLLM:
        found["loader"] += loader_refusals(ctx.config, topo, ctx.server.release) + _fp8_refusals(ctx, topo)
    f = rank_fit(ctx, topo)
    if f is not None and not f.fits_any:
        found["memory"].append((f"{f.weights / 1e9:.3g} GB of weights per rank at {topo.text()} fit no "
                                f"{' or '.join(f.gpus)} at gpu_memory_utilization {f.utilization:g}", f.text()))
    return found, verdict


def _evaluate(ctx: Context, topo: Topology) -> list[RuleResult]:
    moving, verdict = topology_problems(ctx, topo)
    notes = {"names": headers.class_target_note(ctx.config, ctx.server.family), "kernel": verdict.summary}
    return [result(RULES[rid], ctx.fixed[rid] + moving.get(rid, []), notes.get(rid) or "") for rid in RULES]


def evaluate_at(ctx: Context, topo: Topology) -> list[RuleResult]:
    """The rule results at ``topo`` against a context built once (``context``): many launches, one
    read of the headers (the model card checks several; converter.servers.launches)."""
    return _evaluate(ctx, topo)


def evaluate(config: dict | None, tensors: Mapping[str, TensorInfo], request: ServingRequest) -> list[RuleResult]:
    """Pure: the rule results for a config and the shards' header entries (name -> info)."""
    return _evaluate(context(config, tensors, request), request.topology)


def check_serving(dst: str, request: ServingRequest) -> list[RuleResult]:
    """Every rule of the request's server at its topology, against DST on disk (headers only)."""
    config, tensors = headers.load(dst)
    return evaluate(config, tensors, request)


def passing_tp(ctx: Context, topo: Topology, limit: int = 64) -> list[int] | None:
    """The TP sizes up to ``limit`` at which every rule passes with topo's DP, PP and EP, found by
    running the topology rules at each; None when a rule that no TP size changes fails."""
    if any(ctx.fixed.values()):
        return None
    return [t for t in range(1, limit + 1) if not any(topology_problems(ctx, topo.with_tp(t))[0].values())]


def _launch(topo: Topology) -> str:
    """How vLLM splits the experts at ``topo``, in one line."""
    how = (f"EP {topo.ep_size}" + (" (all2all)" if topo.all2all else "")) if topo.ep_on else f"MoE TP {topo.moe_tp}"
    return how + (f", PP {topo.pp}" if topo.pp > 1 else "")


def serving_check(config: dict | None, tensors: Mapping[str, TensorInfo], request: ServingRequest) -> Check:
    """The rules as one ``verify`` Check named "serving": one short problem line per failed rule; the
    TP sizes that pass (each found by running the rules at it); with ``verbose`` the source lines."""
    server, topo = request.server, request.topology
    ctx = context(config, tensors, request)
    results = _evaluate(ctx, topo)
    c = Check("serving", f"{server.name} at {topo.text()}: {sum(r.ok for r in results)}/{len(results)} rules pass")
    for r in results:
        if not r.ok:
            c.fail(r.message)
        elif r.rule == "kernel":
            c.notes.append(r.message.removeprefix("rule kernel: "))
        if r.note:
            c.notes.append(r.note)
    is_vllm = server.family is Family.VLLM
    if is_vllm:
        mem = expert_memory(ctx.experts, topo, kimi_min_per_rank(config))
        c.notes.append(f"{topo.text()}, {topo.gpus} GPUs: {_launch(topo)}; per rank {mem.split()}")
        if (f := rank_fit(ctx, topo)) is not None:
            c.notes += f.lines()
    failed = {r.rule for r in results if not r.ok}
    if failed and failed <= set(TOPOLOGY_RULES):
        c.notes.append(_advice(ctx, topo))
    if request.verbose:
        c.notes.append(f"server: {server.release_text}, {server.target.target}")
        if is_vllm:
            c.notes += [f"split: {server.release.cite('split.' + k)}" for k in SPLITS]
            util = server.release.facts.utilization
            if ctx.gpus and util is not None and request.utilization is None:
                c.notes.append(f"memory: gpu_memory_utilization {server.release.cite(util.cite)}")
            c.notes += [f"memory: kept whole on every TP rank, {server.release.cite(row.cite)}"
                        for row, _ in ctx.rest.whole]
        for r in results:
            if not r.ok:
                c.notes += [f"rule {r.rule}: {r.detail}" * bool(r.detail), f"rule {r.rule} is enforced by "
                            f"{RULES[r.rule].where(server)}", f"rule {r.rule} fix: {RULES[r.rule].fix}"]
        c.notes = [n for n in c.notes if n]
        kernel_detail = topology_problems(ctx, topo)[1].detail
        c.notes.append(f"rule kernel: {RULES['kernel'].where(server)}" + (f"; {kernel_detail}" if kernel_detail
                                                                          and "kernel" not in failed else ""))
    elif failed:
        c.notes.append("--verbose: where the server enforces each rule (file and line), and the fix")
    return c


def _advice(ctx: Context, topo: Topology) -> str:
    """The TP sizes that pass at topo's DP/PP/EP (and with EP toggled, where that differs)."""
    rest = [f"{k} {v}" for k, v in (("DP", topo.dp), ("PP", topo.pp)) if v > 1] + ["EP"] * topo.ep
    where = f" with {', '.join(rest)}" if rest else ""
    sizes = passing_tp(ctx, topo) or []
    out = f"TP sizes that pass{where}: {', '.join(map(str, sizes)) or 'none up to 64'}"
    if ctx.server.family is Family.VLLM:
        other = Topology(topo.tp, topo.dp, topo.pp, not topo.ep)
        alt = passing_tp(ctx, other) or []
        if alt and alt != sizes:
            out += f"; {'without' if topo.ep else 'with'} EP: {', '.join(map(str, alt))}"
    return out
