"""Check "config": every quantization_config block is compressed-tensors pack-quantized int4 g32
symmetric, is the block the converter writes for DST's modules, and its targets/ignore lists select
exactly the converted modules (``selection``)."""
from __future__ import annotations

from typing import Any

from ..checks import Check
from ..formats import checkpoint as ckpt
from ..formats.dialect import (
    fp8_block_group,
    int4_block,
    int4_targets,
    is_fp8_block_group,
)
from ..quant.rules import RULE_KEY
from .context import Context
from .dst import Dst, converted_modules
from .selection import selection_problems
from .source_files import differences


def int4_block_problems(block: dict) -> list[str]:
    """Why a quantization_config block is not compressed-tensors pack-quantized int4 g32 symmetric."""
    out = []
    if ckpt.is_mxfp4(block) or "mxfp4" in str(block.get("format", "")).lower() or block.get("quant_method") == "mxfp4":
        return ["still describes MXFP4"]
    if block.get("quant_method") != "compressed-tensors":
        out.append(f"quant_method is {block.get('quant_method')!r}, not 'compressed-tensors'")
    if block.get("format") != "pack-quantized":
        out.append(f"format is {block.get('format')!r}, not 'pack-quantized'")
    if block.get("quantization_status") != "compressed":  # "frozen": a loader reads the weights as bf16
        out.append(f"quantization_status is {block.get('quantization_status')!r}, not 'compressed'")
    groups = block.get("config_groups") or {}
    if not groups:
        out.append("has no config_groups")
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    for gname, g in groups.items():
        g = g if isinstance(g, dict) else {}
        if is_fp8_block_group(g):   # the source's FP8 linears, kept as they were (formats/fp8_mxfp4.py)
            continue
        if g.get("format", "pack-quantized") != "pack-quantized":
            out.append(f"config_groups.{gname}.format is {g.get('format')!r}")
        w = g.get("weights") or {}
        out += [f"config_groups.{gname}.weights.{k} is {w.get(k)!r}, expected {v!r}"
                for k, v in want.items() if w.get(k) != v]
        # absent means the default (compressed-tensors QuantizationArgs): static, contiguous groups
        out += [f"config_groups.{gname}.weights.{k} is {w.get(k)!r}, expected {v!r}"
                for k, v in (("dynamic", False), ("actorder", None)) if w.get(k, v) != v]
        if g.get("input_activations"):
            out.append(f"config_groups.{gname} quantizes input activations (W4A16 expected)")
    return out


def written_block_problems(block: dict, converted: list[str], kept: list[str], shown: int = 5) -> list[str]:
    """Where the block differs from the one the converter writes for DST's modules (``int4_block``):
    targets recomputed from the converted modules; an ignore list that holds the kept experts under
    both names and nothing that catches a converted layer's experts under vLLM's (``int4_targets``).
    What only SRC knows is taken as DST says: the source's other ignore entries, its kv-cache and
    MoE-sparsity fields, the FP8 group's targets (``fp8_group_problems``); the scale rule is
    ``dst.scale_rule``'s."""
    ignore = block.get("ignore") or []
    targets, want_ignore = int4_targets(converted, kept, ignore)
    keep = {k: block[k] for k in ("kv_cache_scheme", "moe_sparsity_config") if block.get(k) is not None}
    want = int4_block(targets, ignore, keep)
    if RULE_KEY in block:
        want[RULE_KEY] = block[RULE_KEY]
    else:
        del want[RULE_KEY]
    for name, g in (block.get("config_groups") or {}).items():
        if is_fp8_block_group(g):
            want["config_groups"][name] = _fp8_group(g)
    out = differences(block, want, says="the converter writes")
    lacks, catches = sorted(set(want_ignore) - set(ignore)), sorted(set(ignore) - set(want_ignore))
    if lacks:
        out.append(f"ignore lacks {len(lacks)} kept expert name(s) the converter writes: {', '.join(lacks[:shown])}")
    if catches:
        out.append(f"ignore entries {catches[:shown]} catch converted experts under the name vLLM asks their "
                   "scheme of; the converter writes none such")
    return out[:shown]


def _fp8_group(g: dict) -> Any:
    """The FP8 group the converter writes for the targets and weight block ``g`` names (``g`` itself
    when its block size is not two integers: the types check names that)."""
    bs = g["weights"].get("block_structure")
    ok = isinstance(bs, list) and len(bs) == 2 and all(type(x) is int for x in bs)
    return fp8_block_group(g.get("targets") or [], bs) if ok else g


def fp8_modules(d: Dst) -> list[str]:
    """Modules DST holds as FP8 block linears: an e4m3 weight beside an fp32 weight_scale."""
    out = []
    for t, (_, info) in d.where.items():
        scale = d.where.get(f"{t}_scale")
        if t.endswith(".weight") and info.dtype == "F8_E4M3" and scale is not None and scale[1].dtype == "F32":
            out.append(t[: -len(".weight")])
    return sorted(out)


def fp8_group_problems(blocks: list[tuple[tuple[str, ...], dict]], fp8: list[str]) -> list[str]:
    """The FP8 block group (formats/fp8_mxfp4.py) names exactly the FP8 linears DST holds, by name."""
    named = sorted({t for _, b in blocks for g in (b.get("config_groups") or {}).values()
                    if is_fp8_block_group(g) for t in g.get("targets") or []})
    out = []
    if set(named) - set(fp8):
        out.append(f"the FP8 group targets {sorted(set(named) - set(fp8))[:5]}, which hold no e4m3 weight and "
                   "fp32 weight_scale")
    if set(fp8) - set(named):
        out.append(f"{len(set(fp8) - set(named))} FP8 linear(s) that no FP8 group names (a loader would read the "
                   f"e4m3 bytes as bf16): {sorted(set(fp8) - set(named))[:5]}")
    return out


def run(ctx: Context) -> list[Check]:
    d, c = ctx.dst, ctx.check("config")
    if d.config is None:
        return [c]  # loading said why
    blocks = ckpt.quant_blocks(d.config)
    if not blocks:
        c.fail("no quantization_config (top-level or nested)")
    for path, block in blocks:
        c.problems += [f"{'.'.join(path)} {p}" for p in int4_block_problems(block)]
    fp8 = fp8_modules(d)
    if not c.problems:
        converted = converted_modules(d)
        weights = {t[:-7]: info for t, (_, info) in d.where.items() if t.endswith(".weight")}
        kept = sorted(m for m, info in weights.items() if len(info.shape) == 2)   # as plan.output_config
        for path, block in blocks:
            c.problems += [f"{'.'.join(path)}.{p}" for p in written_block_problems(block, converted, kept)]
        plain = sorted(set(weights) - set(fp8))
        c.problems += selection_problems(blocks, converted, plain, loader=ctx.loader_matcher,
                                         not_linear=[m for m in plain if len(weights[m].shape) != 2])
        c.problems += fp8_group_problems(blocks, fp8)
    c.summary = "quantization_config at " + (", ".join(".".join(p) for p, _ in blocks) or "nowhere")
    if blocks:
        c.summary += ("; selection by compressed-tensors' is_match" if ctx.loader_matcher else
                      "; selection by is_match's rules (--source: by is_match itself)")
    return [c]
