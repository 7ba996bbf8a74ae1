"""What vLLM refuses per rank in our output's FP8 block linears (the fp8-mxfp4 dialect's group_1).

vLLM's compressed-tensors FP8 scheme validates every block-FP8 linear's per-rank sizes while the
layer is built (``compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py`` 103-114 calls
``quantization/utils/fp8_utils.py`` ``validate_fp8_block_shape`` 1296-1344): at TP > 1 a row-parallel
layer's per-rank input and a column-parallel layer's per-rank outputs must be whole blocks, and a
merged layer (gate_up, qkv) must have whole blocks in every output but the last even at TP 1. Nothing
waives it under compressed-tensors: ``linear.py`` 562-581 (``_maybe_allow_fp8_block_shape_mismatch``)
allows a merged layer's mismatch only when the quant config has ``weight_block_size`` (Fp8Config), and
Ling's shared-expert padding (``bailing_moe_v3.py`` 299-320, 1186-1198, 1547-1552) and head-wise g_proj
replication (541-552) run only under a block Fp8Config (``_is_block_fp8_config`` 222-228). So the FP8
source may load at a TP where our compressed-tensors output is refused.

One table, ``LINEARS``: a model type -> each FP8 linear's checkpoint name (its last part) -> the vLLM
layer class it is built as (``Linear``), with the file and line. A module fused with siblings
(``gate_proj`` + ``up_proj``) is a merged layer only when a sibling is in the FP8 group too (Ling's
MLA ``q_proj`` is alone, its KDA ``q_proj`` is fused with ``k_proj``/``v_proj``). Sizes come from the
tensors' headers (``X.weight`` e4m3 ``[out, in]``), the block from the group's ``block_structure``.

The same table says which layers vLLM fuses, whatever their quantization: a fused layer takes the FP8
group's scheme only when every shard is a target (``compressed_tensors/utils.py`` 133-176), else it
is built unquantized and loads an FP8 shard's e4m3 values with its scale dropped (``mixed_fusions``:
Ling's KDA ``qkvb_proj`` when the source keeps ``b_proj`` out of FP8, ``bailing_moe_v3.py`` 691,
710-720). verify refuses such an output (``fused_refusals``); the converter writes those FP8 shards
as bf16 (``bf16_modules``), and with ``--fp8-bf16-at-tp N`` every FP8 linear refused at TP N
(``refused_modules``), so the output loads there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping

from ..releases import Release
from .topology import Topology


@dataclass(frozen=True)
class Linear:
    """How vLLM builds one checkpoint linear: ``kind`` column | row | replicated | merged (TP-split,
    ``fused`` names its shards in order) | merged-replicated (``disable_tp``) | qkv (QKVParallelLinear,
    ``fused`` q, k, v); ``alone``: the kind when no sibling of ``fused`` is in the FP8 group."""

    kind: str
    cite: str                  # the release's citation key
    fused: tuple[str, ...] = ()
    alone: str = ""


_MLP = {"gate_proj": ("gate_proj", "up_proj"), "up_proj": ("gate_proj", "up_proj")}


def _ling() -> dict[str, Linear]:
    mlp, kda = "fp8.ling.mlp", "fp8.ling.kda"
    qkvb = ("q_proj", "k_proj", "v_proj", "b_proj")
    out = {p: Linear("merged", mlp, _MLP[p]) for p in _MLP}
    out |= {"down_proj": Linear("row", mlp),
            "q_proj": Linear("merged", kda, qkvb, alone="column"),   # MLA q_proj alone: 487-493
            **{p: Linear("merged", kda, qkvb) for p in ("k_proj", "v_proj", "b_proj")},
            "q_a_proj": Linear("merged-replicated", "fp8.ling.qkv-a",
                               ("q_a_proj", "kv_a_proj_with_mqa")),
            "kv_a_proj_with_mqa": Linear("merged-replicated", "fp8.ling.kv-a", ("q_a_proj", "kv_a_proj_with_mqa"),
                                         alone="replicated"),
            "q_b_proj": Linear("column", "fp8.ling.q-b"),
            "kv_b_proj": Linear("column", "fp8.ling.kv-b"),
            "g_proj": Linear("column", "fp8.ling.g"),
            "f_proj": Linear("column", "fp8.ling.f"),
            "dense": Linear("row", "fp8.ling.dense"),
            "o_proj": Linear("row", "fp8.ling.o")}
    return out


def _mimo() -> dict[str, Linear]:
    mlp, qkv = "fp8.mimo.mlp", "fp8.mimo.qkv"
    out = {p: Linear("merged", mlp, _MLP[p]) for p in _MLP}
    out |= {"down_proj": Linear("row", mlp), "o_proj": Linear("row", "fp8.mimo.o"),
            **{p: Linear("qkv", qkv, ("q_proj", "k_proj", "v_proj")) for p in ("q_proj", "k_proj", "v_proj")}}
    return out


def _mimo_kv_heads(config: Mapping[str, Any], layer: int) -> int | None:
    """MiMo's KV heads of a decoder layer: the swa_ fields where hybrid_layer_pattern is 1
    (mimo_v2.py 408-436, 500)."""
    pattern = config.get("hybrid_layer_pattern")
    swa = isinstance(pattern, list) and 0 <= layer < len(pattern) and pattern[layer] == 1
    kv = config.get("swa_num_key_value_heads" if swa else "num_key_value_heads")
    return kv if isinstance(kv, int) and kv > 0 else None


_LING_T, _MIMO_T = _ling(), _mimo()
LINEARS: dict[str, dict[str, Linear]] = {"bailing_moe_v3": _LING_T, "bailing_hybrid": _LING_T,
                                         "mimo_v2_flash": _MIMO_T, "mimo_v2": _MIMO_T}
KV_HEADS: dict[str, Callable[[Mapping[str, Any], int], int | None]] = {"mimo_v2_flash": _mimo_kv_heads,
                                                                        "mimo_v2": _mimo_kv_heads}


def _table(config: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Linear] | None]:
    """(the text config, the model type's LINEARS table or None)."""
    config = dict(config or {})
    text = found if isinstance(found := config.get("text_config"), dict) else config
    types = [t for t in (config.get("model_type"), text.get("model_type")) if isinstance(t, str)]
    return text, next((LINEARS[t] for t in types if t in LINEARS), None)


def mixed_fusions(config: Mapping[str, Any] | None, fp8: Collection[str], modules: Iterable[str]
                  ) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(parent, FP8 shards, other shards) of every layer vLLM fuses from checkpoint linears of which
    some are in the FP8 group and some are not (``modules``: every linear's checkpoint name). Under
    compressed-tensors vLLM builds such a layer unquantized (``fp8.fused-mixed``): it then loads the
    FP8 shards' e4m3 values with their scales dropped. Ling's KDA fuses q, k, v and b always
    (``fp8.ling.kda-fused``), so a source that keeps ``b_proj`` out of FP8 gives exactly that."""
    _, table = _table(config)
    if table is None:
        return []
    present: dict[str, set[str]] = {}
    for module in modules:
        parent, _, name = module.rpartition(".")
        if name in table:
            present.setdefault(parent, set()).add(name)
    out = []
    for parent, names in sorted(present.items()):
        seen: set[tuple[str, ...]] = set()
        for name in sorted(names):
            fused = table[name].fused
            shards = tuple(s for s in fused if s in names)
            if len(shards) < 2 or fused in seen:
                continue
            seen.add(fused)
            quant = tuple(s for s in shards if f"{parent}.{s}" in fp8)
            if quant and len(quant) < len(shards):
                out.append((parent, quant, tuple(s for s in shards if s not in quant)))
    return out


def fused_refusals(config: Mapping[str, Any] | None, fp8: Collection[str], modules: Iterable[str],
                   release: Release) -> list[tuple[str, str]]:
    """verify --serving's (problem, where) for each mixed fusion (``mixed_fusions``): silent wrong
    values, at every TP."""
    _, table = _table(config)
    out = []
    for parent, quant, other in mixed_fusions(config, fp8, modules):
        cites = [release.cite("fp8.fused-mixed")]
        if table is not None and "b_proj" in table[quant[0]].fused:   # mixed_fusions: none without a table
            cites.insert(0, release.cite("fp8.ling.kda-fused"))
        out.append((f"{parent}.{'+'.join(quant + other)}: vLLM fuses these into one layer, unquantized because "
                    f"{', '.join(other)} {'is' if len(other) == 1 else 'are'} not in the FP8 group, and loads the "
                    f"e4m3 values of {', '.join(quant)} with their weight_scale dropped (silently wrong weights, at "
                    "every TP): convert again, k3convert now writes them as bf16",
                    "; ".join(cites)))
    return out


def bf16_modules(config: Mapping[str, Any] | None, fp8: Collection[str], modules: Iterable[str]) -> set[str]:
    """The FP8 linears the converter writes as bf16 so that vLLM's fused layer is consistently
    unquantized: the FP8 shards of every mixed fusion."""
    return {f"{parent}.{s}" for parent, quant, _ in mixed_fusions(config, fp8, modules) for s in quant}


def refused_modules(config: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, int]],
                    block: tuple[int, int] | None, topo: Topology, release: Release) -> set[str]:
    """The checkpoint names of every FP8 linear in a layer ``refusals`` names at ``topo`` (each
    shard of a refused fused layer): written as bf16 they load there (``--fp8-bf16-at-tp``)."""
    out = set()
    for layer, _, _ in refusals(config, shapes, block, topo, release):
        parent, _, names = layer.rpartition(".")
        out |= {f"{parent}.{n}" for n in names.split("+")}
    return out


def written_as_bf16(config: Mapping[str, Any], fp8: Collection[str], block: tuple[int, int] | None,
                    tensors: Mapping[str, Any], tp: int | None, release: Release) -> tuple[set[str], list[str]]:
    """The FP8 linears a conversion writes as bf16, and why: always the FP8 shards of a layer vLLM
    fuses with a linear that is not FP8 (``bf16_modules``: under compressed-tensors vLLM builds it
    unquantized and would load their e4m3 values unscaled, e.g. Ling's KDA qkvb_proj when the source
    keeps b_proj out of FP8); with ``tp`` (``--fp8-bf16-at-tp``) also every FP8 linear vLLM's
    compressed-tensors FP8 scheme refuses at TP ``tp``. ``tensors``: the source's, by name."""
    linears = [n[: -len(".weight")] for n, t in tensors.items() if n.endswith(".weight") and len(t.shape) == 2]
    mixed = bf16_modules(config, fp8, linears)
    why = [f"{len(mixed)} FP8 linear(s) that vLLM fuses with a linear that is not FP8 (it would build the fused "
           "layer unquantized and load their e4m3 values unscaled)"] if mixed else []
    refused: set[str] = set()
    if tp is not None:
        weights = {m: tensors.get(f"{m}.weight") for m in fp8}   # the plan's tensor check names a bad one
        shapes = {m: tuple(w.shape) for m, w in weights.items() if w is not None and len(w.shape) == 2}
        refused = refused_modules(config, shapes, block, Topology(tp), release) - mixed
        why.append(f"--fp8-bf16-at-tp {tp}: {len(refused)} FP8 linear(s) vLLM's compressed-tensors FP8 scheme "
                   f"refuses at TP {tp}")
    return mixed | refused, why


def _layer(module: str) -> int | None:
    """The decoder layer index in ``...layers.N....`` (None outside the layers)."""
    parts = module.split(".")
    i = next((i for i, p in enumerate(parts[:-1]) if p == "layers"), None)
    return int(parts[i + 1]) if i is not None and parts[i + 1].isdigit() else None


def _partitions(kind: str, shards: list[tuple[str, int]], tp: int, kv: int | None
                ) -> tuple[list[int], bool] | str:
    """(per-rank output partitions, whether vLLM counts the layer as TP-split), or a divide() refusal."""
    if kind == "qkv":
        if kv is None:
            return [], False
        parts = []
        for name, out in shards:   # K/V: kv // tp heads a rank, or one replicated head (linear.py 1065-1071)
            if name == "q_proj" and out % tp:
                return f"q_proj output {out} not divisible by TP {tp}"
            parts.append(out // tp if name == "q_proj" or tp < kv else out // kv)
        return parts, tp > 1
    split = kind in ("column", "merged")
    for name, out in shards:
        if split and out % tp:
            return f"{name} output {out} not divisible by TP {tp}"
    return [out // tp if split else out for _, out in shards], split and tp > 1


def refusals(config: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, int]], block: tuple[int, int] | None,
             topo: Topology, release: Release) -> list[tuple[str, str, str]]:
    """(vLLM layer, short problem, where) for every FP8 block linear whose per-rank sizes vLLM's
    compressed-tensors FP8 scheme refuses at ``topo`` (its TP group: linears see TP only, never DP).
    ``shapes``: the FP8 group's modules (checkpoint names) -> weight [out, in]; ``block``: [block_n, block_k]."""
    text, table = _table(config)
    config = dict(config or {})
    types = [t for t in (config.get("model_type"), text.get("model_type")) if isinstance(t, str)]
    kv_of = next((KV_HEADS[t] for t in types if t in KV_HEADS), None)
    if table is None or block is None:
        return []
    bn, bk, tp = block[0], block[1], topo.tp
    divide, validate = release.cite("fp8.divide"), release.cite("fp8.validate")
    out, done = [], set()
    for module in sorted(shapes):
        parent, _, name = module.rpartition(".")
        spec = table.get(name)
        if spec is None:
            continue
        present = [s for s in spec.fused if f"{parent}.{s}" in shapes]
        kind = spec.kind if len(present) > 1 or not spec.alone else spec.alone
        group = present if kind in ("merged", "merged-replicated", "qkv") else [name]
        key = (parent, tuple(group))
        if key in done:
            continue
        done.add(key)
        layer = ".".join(filter(None, (parent, "+".join(group))))
        if kind == "row":
            inp = shapes[module][1]
            if inp % tp:
                out.append((layer, f"input {inp} not divisible by TP {tp}", divide))
            elif tp > 1 and (inp // tp) % bk:
                out.append((layer, f"per-rank input {inp}/{tp}={inp // tp} is not whole {bk}-blocks",
                            f"{release.cite(spec.cite)}; {validate}"))
            continue
        if kind == "replicated":
            continue
        kv = kv_of(text, _layer(module) or 0) if kind == "qkv" and kv_of else None
        got = _partitions(kind, [(s, shapes[f"{parent}.{s}"][0]) for s in group], tp, kv)
        if isinstance(got, str):
            out.append((layer, got, divide))
            continue
        parts, split = got
        merged = len(parts) > 1
        check = parts if split else parts[:-1] if merged else []
        bad = [(s, p) for s, p in zip(group, check) if p % bn]
        if bad:
            what = ", ".join(f"{s} {p}" for s, p in bad)
            per = "per-rank output" if split else "output"
            out.append((layer, f"{per} {what} not whole {bn}-blocks", f"{release.cite(spec.cite)}; {validate}"))
    return out


def ling_padded(config: Mapping[str, Any] | None, tp: int, block: tuple[int, int] | None) -> tuple[int, int] | None:
    """(shared-expert intermediate, what vLLM pads it to) when the FP8 source would be padded at ``tp``
    and our output is not (None when no padding was needed)."""
    config = dict(config or {})
    text = found if isinstance(found := config.get("text_config"), dict) else config
    if not ({config.get("model_type"), text.get("model_type")} & {"bailing_moe_v3", "bailing_hybrid"}) or not block:
        return None
    size, n = text.get("moe_shared_expert_intermediate_size"), text.get("num_shared_experts")
    if not (isinstance(size, int) and isinstance(n, int)):
        return None
    inter = size * n
    align = tp * math.lcm(*block)
    padded = -(-inter // align) * align
    return (inter, padded) if padded != inter else None
