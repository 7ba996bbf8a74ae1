"""Will a server load DST, and run it with the right kernel? vLLM 0.33.0 and SGLang 0.5.23, per target.

Every rule below was read from the servers' released wheels (Python files; ``docs/serving.md``
cites file and line) or shown by building vLLM's own Kimi K3 classes
(``tests/test_vllm_quant_methods.py``). Besides the checkpoint's format, tensors and sizes, two
rules model what the servers decide from it: ``names`` (the name each server looks the experts'
scheme up by) and ``kernel`` (which MoE method and kernel DST gets on that target, whether it
takes the checkpoint's activation, and what the experts cost in memory per rank). The check
reads only config.json and the shard headers (no tensor data), so it takes seconds on the
1.5 TB model. A failed rule gives one line: the rule, what is wrong, where the server enforces
it, and what to change.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from .checks import Check
from .errors import BadInput
from .formats import checkpoint as ckpt
from .formats.dialect import is_fp8_block_group
from .formats.safetensors_io import TensorInfo, read_header
from . import fp8_tp
from .loaders import refusals as loader_refusals
from .plan import PACKED, SCALE
from .topology import WHERE as SPLIT_WHERE
from .topology import Topology, local_experts, pp_stages
from .vllm_plugin import route as plugin_route


@dataclass(frozen=True)
class Server:
    """A server release on one target, and the MoE method its code gives our DST's experts."""

    family: str       # "vllm" or "sglang": whose rule texts apply
    release: str
    target: str
    method: str


SERVER_INFO: dict[str, Server] = {
    "vllm-rocm": Server("vllm", "vLLM 0.33.0", "ROCm gfx942 (MI300X/MI325X)", "CompressedTensorsWNA16MoEMethod"),
    "vllm-rocm-plugin": Server("vllm", "vLLM 0.33.0 + k3convert plugin",
                               "ROCm gfx942, VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1",
                               f"{plugin_route.NAME} (converter/vllm_plugin)"),
    "vllm-cuda": Server("vllm", "vLLM 0.33.0", "CUDA, compute capability >= 7.5", "CompressedTensorsWNA16MoEMethod"),
    "sglang-rocm": Server("sglang", "SGLang 0.5.23", "ROCm (HIP)", "CompressedTensorsWNA16TritonMoE"),
    "sglang-cuda": Server("sglang", "SGLang 0.5.23", "CUDA", "CompressedTensorsWNA16MoE (Marlin)"),
}
SERVERS = tuple(SERVER_INFO)
BITS = 4
GROUP = 32                       # k3convert's target; see rule group-size
PACK = 32 // BITS                # int4 values per int32 word
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
DEFAULT_DTYPE = "bfloat16"       # what the servers use when config states none (and K3 ships)
# model types whose server loader maps experts.E.w1/w2/w3 only (vLLM and SGLang kimi_linear/kimi_k3)
W123_MODELS = ("kimi_linear", "kimi_k3")
SCHEMES = {"w123": ("w1", "w3", "w2"), "proj": ("gate_proj", "up_proj", "down_proj")}
ROLE = {name: role for names in SCHEMES.values() for name, role in zip(names, ("gate", "up", "down"))}
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
# the experts' module class each server matches class-name targets against ("Linear" is mapped onto it)
MOE_CLASS = {"vllm": "RoutedExperts", "sglang": "FusedMoE"}
KIMI_PAD_WHERE = ("vllm 0.33.0 models/kimi_k3/amd/linear.py 227-236 and 349-357, nvidia/model.py 419-428 and "
                  "571-584")
# activations vLLM's WNA16 kernels take: TritonWNA16Experts' allow-list, and apply_moe_activation's
TRITON_ACTS = frozenset({"silu", "gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave", "swiglustep",
                         "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul"})
APPLY_ACTS = TRITON_ACTS | {"situ"}

SERVED_VLLM = "0.33.0"            # the vLLM release the vllm-* rules were read from
V = "vllm 0.33.0 "
V_CT = V + "compressed_tensors/compressed_tensors.py"
V_MOE = V + "compressed_tensors_moe.py get_moe_method"
V_WNA16 = V + "compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod"
V_ORACLE = V + "fused_moe/oracle/int_wna16.py"
V_LAYER = V + "fused_moe FusedMoE"
S = "sglang 0.5.23 "
S_CT = S + "compressed_tensors/compressed_tensors.py"
S_WNA16 = S + "compressed_tensors_wNa16_moe.py CompressedTensorsWNA16MoE"
S_LAYER = S + "moe/fused_moe_triton/layer.py FusedMoE"


@dataclass(frozen=True)
class Rule:
    """One requirement of the servers' int4 MoE path, where each server enforces it, the fix."""

    id: str
    what: str
    where: Mapping[str, str]
    fix: str


def _both(vllm: str, sglang: str) -> dict[str, str]:
    """The same rule text for every server of a family."""
    return {name: vllm if srv.family == "vllm" else sglang for name, srv in SERVER_INFO.items()}


KERNEL_WHERE = {
    "vllm-rocm": f"{V_ORACLE} 126-143: on gfx942 RDNA3, FlashInfer-TRTLLM, Marlin, Humming are not for this "
                 f"device; TritonWNA16Experts (experts/triton_moe.py 681-693) has no situ; EMULATION "
                 f"(experts/int4_emulation_moe.py, oracle 1413-1460) dequantizes to bf16 at load",
    "vllm-rocm-plugin": "converter/vllm_plugin/route.py decide: AITER flydsl_a16w4_gemm1 with Situv2 "
                        "(beta, linear_beta) on the int4 experts as stored; refuses what it does not understand",
    "vllm-cuda": f"{V_ORACLE} 126-143: FlashInfer-TRTLLM takes silu/swigluoai only (experts/trtllm_mxint4_moe.py "
                 f"69-73); MarlinExperts takes situ (experts/marlin_moe.py 623-626, fused_moe/activation.py 122-136) "
                 f"if hidden % 128 == 0 and per-rank intermediate % group == 0 (quantization/utils/marlin_utils.py "
                 f"356-387)",
    "sglang-rocm": f"{S_CT} 919-923 -> CompressedTensorsWNA16TritonMoE, whose apply_weights asserts "
                   f"activation == 'silu' (compressed_tensors_wNa16_moe.py 558)",
    "sglang-cuda": f"{S_CT} 924-951 -> CompressedTensorsWNA16MoE (Marlin; Triton on SM100 by default), whose "
                   f"apply_weights assert activation == 'silu' (compressed_tensors_wNa16_moe.py 454, 558)",
}

RULES: dict[str, Rule] = {r.id: r for r in (
    Rule("format", "quant_method compressed-tensors, format pack-quantized",
         _both(f"{V_MOE} 90-102: format == pack_quantized and bits in (4, 8), else ValueError",
               f"{S_WNA16}.__init__ 83-90: quant_format == pack_quantized, else ValueError"),
         "set quant_method 'compressed-tensors' and format 'pack-quantized' (block and config_groups)"),
    Rule("num-bits", "weights.num_bits 4",
         _both(f"{V_WNA16}: packed_factor = 32 / num_bits sizes the int32 params (line 66)",
               f"{S_WNA16}: packed_factor = 32 // num_bits sizes the int32 params (line 77)"),
         "set weights.num_bits 4 (the shards hold eight 4-bit values per int32)"),
    Rule("type", "weights.type int",
         _both(f"{V_CT} _is_mxfp4 440-456: type float + 4 bits + group 32 routes to the MXFP4 MoE method",
               f"{S_WNA16}: decodes the nibbles as int (uint4b8) whatever the type says"),
         "set weights.type 'int'"),
    Rule("symmetric", "weights.symmetric true",
         _both(f"{V_WNA16}.create_weights 256-277: asymmetric makes weight_zero_point params, which the "
               f"shards do not have",
               f"{S_CT} _is_wNa16_group_channel requires symmetric; {S_WNA16}.__init__ asserts it"),
         "set weights.symmetric true (zero point 8, no weight_zero_point tensors)"),
    Rule("strategy", "weights.strategy group",
         _both(f"{V_WNA16}.__init__ 127: assert weight_quant.strategy == 'group' (non-Marlin backends)",
               f"{S_WNA16}.create_weights 155: strategy 'channel' makes one scale per row, not [out, in/32]"),
         "set weights.strategy 'group'"),
    Rule("group-size", f"weights.group_size {GROUP}",
         _both(f"k3convert's target (the gfx950 flydsl method and the plugin require group_size == {GROUP})",
               f"k3convert's target; the scale shapes and TP sizes below assume {GROUP}"),
         f"convert with group size {GROUP} and set weights.group_size {GROUP}"),
    Rule("actorder", "weights.actorder null",
         _both(f"{V_ORACLE} 164, 201-205: RDNA3 and TRITON refuse actorder group",
               f"{S_WNA16}.create_weights 141: any actorder loads full-K w2 scales, which the ROCm Triton "
               f"path does not shard"),
         "set weights.actorder null"),
    Rule("static", "weights.dynamic false",
         _both(f"{V_CT} _is_wNa16_group_channel 698-708: is_static = not weight_quant.dynamic",
               f"{S_CT} _is_wNa16_group_channel: is_static = not weight_quant.dynamic"),
         "set weights.dynamic false"),
    Rule("input-activations", "input_activations null (W4A16)",
         _both(f"{V_CT} _is_wNa16_group_channel 698-708: input_quant is None, else a W4A8 method or "
               f"'Unsupported FusedMoe scheme'",
               f"{S_CT}: ignores input_activations under pack-quantized, so they would not be served"),
         "set config_groups.*.input_activations null"),
    Rule("names", "the experts' scheme, looked up as <layer>.experts.0.gate_proj|up_proj|down_proj, is int4",
         _both(f"{V_MOE} 35-58: asks the scheme of f'{{layer}}.0.{{gate|up|down}}_proj' (RoutedExperts' "
               f"ckpt names, kimi_k3 passes none), ignored -> UnquantizedFusedMoEMethod, mixed -> ValueError; "
               f"targets match by re.match/equality/class name (compressed_tensors/utils.py 73-111)",
               f"{S_CT} get_moe_scheme 882-898: asks the scheme of layer_name + '.0.gate_proj|up_proj|"
               f"down_proj', ignored -> unquantized, mixed -> ValueError"),
         "select the routed experts by a pattern that also matches <layer>.experts.0.gate_proj|up_proj|"
         "down_proj (k3convert writes re:.*\\.experts\\.\\d+\\.(w1|w2|w3|gate_proj|up_proj|down_proj)$) "
         "and ignore nothing that matches those names"),
    Rule("packed", "weight_packed int32 [out, in/8]",
         _both(f"{V_WNA16}.create_weights 170-210: int32 (E, out, in // 8), N-first, filled by copy_",
               f"{S_WNA16}.create_weights: int32 (E, in // 8, out) filled by copy_ (shape must match)"),
         "store weight_packed as int32 [out, in/8] (convert with k3convert)"),
    Rule("scale-dtype", "weight_scale in the model dtype",
         _both(f"{V_WNA16}.create_weights 285-306: scales are params_dtype; copy_ casts anything else",
               f"{S_WNA16}.create_weights: scales are params_dtype; copy_ casts anything else"),
         "store weight_scale in the model dtype (config torch_dtype)"),
    Rule("scale-shape", f"weight_scale [out, in/{GROUP}]",
         _both(f"{V_WNA16}.create_weights 254-255, 285-306: scale (E, out, in // group_size), filled by copy_",
               f"{S_WNA16}.create_weights 158-159: scale (E, in // group_size, out), filled by copy_"),
         f"store weight_scale as [out, in/{GROUP}]"),
    Rule("expert-names", "experts named experts.E.w1/w2/w3 or gate_proj/up_proj/down_proj",
         _both(f"{V}models/kimi_k3/amd/linear.py 974-978: fused_moe_make_expert_params_mapping maps "
               f"w1/w2/w3 (fused_moe/layer.py 466-484)",
               f"{S}models/kimi_k3.py 3169-3172: FusedMoE.make_expert_params_mapping maps w1/w2/w3"),
         "name routed experts <layer>.experts.E.w1 (gate), .w3 (up), .w2 (down)"),
    Rule("expert-shapes", "every expert of a layer has gate, up, down of one shape",
         _both(f"{V_LAYER} weight loaders: one (E, ...) param per layer, narrow + copy_",
               f"{S_LAYER}._load_w13/_load_w2: one (E, ...) param per layer, narrow + copy_"),
         "give every expert w1, w3 [inter, hidden] and w2 [hidden, inter], the same in each layer"),
    Rule("hidden-group", f"expert hidden size a multiple of {GROUP}",
         _both(f"{V_WNA16}.create_weights 255: num_groups_w13 = hidden_size // group_size",
               f"{S_WNA16}.create_weights 159: num_groups_w13 = hidden_size // group_size"),
         f"the experts' hidden (input) size must be a multiple of {GROUP}"),
    Rule("tp-intermediate", f"intermediate size divisible by the MoE's TP, per-rank size a multiple of {GROUP}",
         _both(f"{V}fused_moe/config.py 1352: assert intermediate_size % tp_size == 0 (the MoE's tp_size: dp*tp "
               f"without EP, 1 with EP, 1211-1245); {V_WNA16}.create_weights "
               f"254: num_groups_w2 = intermediate_size_per_partition // group_size",
               f"{S_LAYER} 427: assert intermediate_size % moe_tp_size == 0; {S_WNA16} 158: "
               f"num_groups_w2 = intermediate_size_per_partition // group_size"),
         "use a TP size that fits, or expert parallelism (--ep: whole experts per rank)"),
    Rule("config-sizes", "config's MoE sizes match the tensors",
         _both(f"{V}models/kimi_k3/amd/linear.py 207-221: FusedMoE sized from moe_intermediate_size and "
               f"routed_expert_hidden_size (else hidden_size), then copy_",
               "the server sizes (E, ...) params from config, then copy_ the tensors into them"),
         "make config moe_intermediate_size / routed_expert_hidden_size (or hidden_size) match the tensors"),
    Rule("kernel", "a MoE kernel that takes the experts' activation, at int4 memory", KERNEL_WHERE,
         "for SiTU experts: on gfx942 serve with k3convert's vLLM plugin (vllm-rocm-plugin: hidden and "
         "per-rank intermediate sizes multiples of 128), on CUDA with vLLM (vllm-cuda)"),
    Rule("loader", "the model's vLLM loader accepts the config at this topology",
         _both("the model's classes, per model type (converter/loaders.py LOADERS cites each line); the FP8 "
               "block linears' per-rank sizes (converter/fp8_tp.py LINEARS: fp8_utils.py validate_fp8_block_shape)",
               "not modelled: SGLang's model loaders were not read"),
         "choose a TP size the model's loader accepts (the TP sizes that pass are listed)"),
)}
# the rules whose outcome depends on the topology (the TP sizes that pass are found by re-running these)
TOPOLOGY_RULES = ("tp-intermediate", "kernel", "loader")


@dataclass(frozen=True)
class RuleResult:
    """The outcome of one rule. ``message``: for a failure, one short line naming the rule and what
    is wrong; ``detail``: where each server enforces it (file and line) and the fix (``--verbose``)."""

    rule: str
    ok: bool
    message: str
    note: str = ""     # worth saying on a pass (not a failure)
    detail: str = ""


@dataclass(frozen=True)
class _Matrix:
    """A quantized module as its headers describe it."""

    module: str
    packed: TensorInfo
    scale: TensorInfo | None
    expert: tuple[str, int, str] | None = None   # _parse(module), parsed once

    @property
    def shape(self) -> tuple[int, int] | None:
        """Logical [out, in]: from an int32 weight_packed, else from the scale's groups."""
        if self.packed.dtype == "I32" and len(self.packed.shape) == 2:
            return self.packed.shape[0], self.packed.shape[1] * PACK
        if self.scale is not None and len(self.scale.shape) == 2:
            return self.scale.shape[0], self.scale.shape[1] * GROUP
        return None


# ------------------------------------------------------------------------ loading (headers only)

def load(dst: str) -> tuple[dict | None, dict[str, TensorInfo]]:
    """config.json (None when missing) and every tensor's header entry in DST."""
    dst = os.path.abspath(dst)
    if not os.path.isdir(dst):
        raise BadInput("not a directory", file=dst)
    config_path = os.path.join(dst, "config.json")
    config = ckpt.load_json(config_path) if os.path.exists(config_path) else None
    tensors: dict[str, TensorInfo] = {}
    for shard in sorted(set(ckpt.weight_map(dst).values())):   # refuses names that are not plain files
        for name, info in read_header(os.path.join(dst, shard)).tensors.items():
            tensors.setdefault(name, info)
    return config, tensors


def check_serving(dst: str, server: str, tp: int | Topology) -> list[RuleResult]:
    """Every rule of ``server``'s int4 MoE path at ``tp`` (a TP size, or a whole Topology), against DST."""
    config, tensors = load(dst)
    return evaluate(config, tensors, server, tp)


# ------------------------------------------------------------------------ the rules

Problem = tuple[str, str]     # (one short line, the long why: source lines, figures)


@dataclass(frozen=True)
class _Context:
    """What the headers and config say, computed once; the topology rules are re-run against it."""

    config: dict | None
    mats: list["_Matrix"]
    sizes: dict[str, tuple[int, int]]
    experts: "Experts"
    fixed: dict[str, list[Problem]]     # the rules that do not depend on the topology
    server: str
    fp8: dict[str, tuple[int, int]] = field(default_factory=dict)   # FP8 block linears: module -> [out, in]
    block: tuple[int, int] | None = None                             # their block_structure

    @property
    def family(self) -> str:
        return SERVER_INFO[self.server].family


def topology(server: str, tp: int | Topology) -> Topology:
    """``tp`` as a Topology; DP, PP and EP are modelled for vLLM only (SGLang's split was not read)."""
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; one of {', '.join(SERVERS)}")
    topo = tp if isinstance(tp, Topology) else Topology(tp)
    if SERVER_INFO[server].family != "vllm" and (topo.dp > 1 or topo.pp > 1 or topo.ep):
        raise ValueError(f"--dp, --pp and --ep are modelled for the vllm-* servers only, not {server}")
    return topo


def _context(config: dict | None, tensors: Mapping[str, TensorInfo], server: str) -> _Context:
    topology(server, 1)
    mats = _matrices(tensors)
    dtype = model_dtype(config)
    sizes, shape_problems = _layer_sizes(mats)
    fixed: dict[str, list[Problem]] = {rid: [] for rid in RULES}
    for rid, problem in [*_config_problems(config), *_tensor_problems(mats, DTYPES.get(dtype, dtype.upper())),
                         *_name_problems(mats, config), *(("expert-shapes", p) for p in shape_problems),
                         *_size_problems(sizes, config),
                         *(("names", p) for p in lookup_problems(config, sizes, SERVER_INFO[server].family))]:
        fixed[rid].append((problem, ""))
    return _Context(config, mats, sizes, experts_of(mats, sizes, config), fixed, server, *_fp8_linears(config, tensors))


def _fp8_linears(config: dict | None, tensors: Mapping[str, TensorInfo]
                 ) -> tuple[dict[str, tuple[int, int]], tuple[int, int] | None]:
    """The FP8 block group's linears (fp8-mxfp4 outputs: formats/fp8_mxfp4.py) with their weights'
    [out, in] from the headers, and the group's block_structure."""
    shapes: dict[str, tuple[int, int]] = {}
    block = None
    for _, b in ckpt.quant_blocks(config or {}):
        for g in (b.get("config_groups") or {}).values() if isinstance(b.get("config_groups"), dict) else ():
            if not is_fp8_block_group(g):
                continue
            bs = g["weights"].get("block_structure")
            if isinstance(bs, list) and len(bs) == 2 and all(type(x) is int and x > 0 for x in bs):
                block = (bs[0], bs[1])
            for t in g.get("targets") or []:
                w = tensors.get(f"{t}.weight") if isinstance(t, str) else None
                if w is not None and len(w.shape) == 2:
                    shapes[t] = (w.shape[0], w.shape[1])
    return shapes, block


def _fp8_refusals(ctx: "_Context", topo: Topology) -> list[Problem]:
    """vLLM's compressed-tensors FP8 block scheme refuses per-rank sizes that are not whole blocks
    (converter/fp8_tp.py); for Ling's shared experts, say the FP8 source was padded instead."""
    found = fp8_tp.refusals(ctx.config, ctx.fp8, ctx.block, topo)
    if not found:
        return []
    layer, why, where = found[0]
    more = f" (and {len(found) - 1} more FP8 linears)" if len(found) > 1 else ""
    pad = fp8_tp.ling_padded(ctx.config, topo.tp, ctx.block) if ".shared_experts." in layer + "." else None
    source = (f"; the FP8 source loads here: vLLM pads its shared experts' intermediate {pad[0]} to {pad[1]} "
              f"({fp8_tp.LING_PAD})") if pad else ""
    detail = "; ".join(f"{lay}: {w} ({wh})" for lay, w, wh in found)
    return [(f"{layer}: {why} at TP {topo.tp}{more}: vLLM's compressed-tensors FP8 scheme refuses it", detail + source)]


def evaluate(config: dict | None, tensors: Mapping[str, TensorInfo], server: str,
             tp: int | Topology) -> list[RuleResult]:
    """Pure: the rule results for a config and the shards' header entries (name -> info) at ``tp``."""
    topo = topology(server, tp)
    return _evaluate(_context(config, tensors, server), topo)


def _topology_problems(ctx: _Context, topo: Topology) -> tuple[dict[str, list[Problem]], "Verdict"]:
    """The rules that depend on the topology, at ``topo``, and the kernel verdict."""
    found: dict[str, list[Problem]] = {rid: [] for rid in TOPOLOGY_RULES}
    found["tp-intermediate"] += _split_problems(ctx, topo)
    verdict = _kernel(ctx, topo)
    if verdict.problem:
        found["kernel"].append((verdict.problem, verdict.detail))
    if ctx.family == "vllm":
        found["loader"] += loader_refusals(ctx.config, topo) + _fp8_refusals(ctx, topo)
    return found, verdict


def _evaluate(ctx: _Context, topo: Topology) -> list[RuleResult]:
    moving, verdict = _topology_problems(ctx, topo)
    notes = {"names": class_target_note(ctx.config, ctx.family), "kernel": verdict.summary}
    return [_result(RULES[rid], ctx.server, ctx.fixed[rid] + moving.get(rid, []), notes.get(rid) or "")
            for rid in RULES]


def passing_tp(ctx: _Context, topo: Topology, limit: int = 64) -> list[int] | None:
    """The TP sizes up to ``limit`` at which every rule passes with topo's DP, PP and EP, found by
    running the topology rules at each; None when a rule that no TP size changes fails."""
    if any(ctx.fixed.values()):
        return None
    return [t for t in range(1, limit + 1)
            if not any(_topology_problems(ctx, topo.with_tp(t))[0].values())]


def _result(rule: Rule, server: str, problems: list[Problem], note: str = "") -> RuleResult:
    if not problems:
        return RuleResult(rule.id, True, f"rule {rule.id}: {note if rule.id == 'kernel' else rule.what}",
                          note if rule.id != "kernel" else "")
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    if len(problems) > 1:   # every one, each with its source, under --verbose
        why = "; ".join(dict.fromkeys(f"{p} ({d})" if d else p for p, d in problems))
    else:
        why = problems[0][1]
    return RuleResult(rule.id, False, f"rule {rule.id}: {problems[0][0]}{more}", detail=why)


def model_dtype(config: dict | None) -> str:
    """The dtype a server runs the model in: config torch_dtype/dtype (top level or text_config)."""
    for scope in ((config or {}), (config or {}).get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if isinstance(scope.get(key), str):
                return scope[key].removeprefix("torch.")
    return DEFAULT_DTYPE


_WANT = (  # rule, weights key, required value, compressed-tensors' default when the key is absent
    ("num-bits", "num_bits", BITS, 8),
    ("type", "type", "int", "int"),
    ("symmetric", "symmetric", True, True),
    ("strategy", "strategy", "group", None),
    ("group-size", "group_size", GROUP, None),
    ("actorder", "actorder", None, None),
    ("static", "dynamic", False, False),
)


def _config_problems(config: dict | None) -> list[tuple[str, str]]:
    """Every config rule, in every quantization_config block (top-level and nested)."""
    if config is None:
        return [(rid, "no config.json") for rid in ("format", *(w[0] for w in _WANT), "input-activations")]
    blocks = ckpt.quant_blocks(config)
    if not blocks:
        return [("format", "config.json has no quantization_config (top-level or nested)")]
    out = []
    for path, block in blocks:
        where = ".".join(path)
        if block.get("quant_method") != "compressed-tensors":
            out.append(("format", f"{where}.quant_method is {block.get('quant_method')!r}"))
        groups = block.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            out.append(("format", f"{where} has no config_groups"))
            continue
        for gname, g in groups.items():
            g = g if isinstance(g, dict) else {}
            if is_fp8_block_group(g):   # source FP8 linears kept (MiMo): not the experts' group
                continue
            gwhere = f"{where}.config_groups.{gname}"
            fmt = g.get("format") or block.get("format")   # a group's format overrides the block's
            if fmt != "pack-quantized":
                out.append(("format", f"{gwhere} format is {fmt!r}"))
            w = g.get("weights") or {}
            for rid, key, want, default in _WANT:
                got = w.get(key, default)
                if key == "strategy" and got is None and w.get("group_size"):
                    got = "group"   # compressed-tensors infers it from group_size
                if got != want and not (key == "actorder" and got is False):
                    out.append((rid, f"{gwhere}.weights.{key} is {json.dumps(got)}, not {json.dumps(want)}"))
            if g.get("input_activations"):
                out.append(("input-activations", f"{gwhere}.input_activations is set (activations quantized)"))
    return out


def _matrices(tensors: Mapping[str, TensorInfo]) -> list[_Matrix]:
    """Every module with a weight_packed, sorted by name."""
    suffix = "." + PACKED
    return [_Matrix(m, info, tensors.get(m + "." + SCALE), _parse(m))
            for n, info in sorted(tensors.items()) if n.endswith(suffix) for m in (n[: -len(suffix)],)]


def _tensor_problems(mats: list[_Matrix], dtype: str) -> list[tuple[str, str]]:
    out = []
    for m in mats:
        p, s, shape = m.packed, m.scale, m.shape
        if p.dtype != "I32" or len(p.shape) != 2:
            out.append(("packed", f"{m.module}.{PACKED} is {p.dtype}{list(p.shape)}, not I32 [out, in/{PACK}]"))
        if s is None:
            out.append(("scale-shape", f"{m.module} has no {SCALE}"))
            continue
        if s.dtype != dtype:
            out.append(("scale-dtype", f"{m.module}.{SCALE} is {s.dtype}, the model dtype is {dtype}"))
        want = None if shape is None else (shape[0], -(-shape[1] // GROUP))
        if want is None or s.shape != want:
            out.append(("scale-shape", f"{m.module}.{SCALE} is {list(s.shape)}, not "
                                       f"{list(want) if want else '[out, in/32]'}"))
    return out


def _parse(module: str) -> tuple[str, int, str] | None:
    """(layer prefix, expert id, projection name) for a routed-expert module name."""
    m = _EXPERT.match(module)
    return (m["layer"], int(m["e"]), m["proj"]) if m and m["proj"] in ROLE else None


def _model_types(config: dict | None) -> set[str]:
    config = config or {}
    return {str(t) for t in (config.get("model_type"), (config.get("text_config") or {}).get("model_type")) if t}


def _name_problems(mats: list[_Matrix], config: dict | None) -> list[tuple[str, str]]:
    if not mats:
        return [("expert-names", "no quantized expert matrices (no *.weight_packed tensors)")]
    out = [("expert-names", f"{m.module} is quantized but is not named <layer>.experts.E.<w1|w2|w3|"
                            f"gate_proj|up_proj|down_proj>")
           for m in mats if m.expert is None]
    scheme_of = {name: s for s, names in SCHEMES.items() for name in names}
    schemes = Counter(scheme_of[m.expert[2]] for m in mats if m.expert)
    kimi = sorted(_model_types(config) & set(W123_MODELS))
    if len(schemes) > 1:
        out.append(("expert-names", f"experts mix w1/w2/w3 ({schemes['w123']}) and gate_proj/up_proj/down_proj "
                                    f"({schemes['proj']}) names; a model's loader maps one"))
    elif kimi and schemes.get("proj"):
        out.append(("expert-names", f"model_type {kimi[0]} loads experts as w1/w2/w3, "
                                    f"but {schemes['proj']} are named gate_proj/up_proj/down_proj"))
    return out


def _layer_sizes(mats: list[_Matrix]) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Per MoE layer, (intermediate, hidden) from its experts' shapes, and what is inconsistent."""
    layers: dict[str, dict[int, dict[str, tuple[int, int] | None]]] = {}
    for m in mats:
        p = m.expert
        if p:
            layers.setdefault(p[0], {}).setdefault(p[1], {})[ROLE[p[2]]] = m.shape
    sizes, problems = {}, []
    for layer, experts in sorted(layers.items()):
        for e, roles in sorted(experts.items()):
            missing = [r for r in ("gate", "up", "down") if r not in roles]
            if missing:
                problems.append(f"{layer}.{e} has no {'/'.join(missing)} projection")
        gate_up = Counter(s for roles in experts.values() for r in ("gate", "up") if (s := roles.get(r)))
        if not gate_up:
            continue
        inter, hidden = gate_up.most_common(1)[0][0]
        sizes[layer] = (inter, hidden)
        for e, roles in sorted(experts.items()):
            for r, s in sorted(roles.items()):
                want = (hidden, inter) if r == "down" else (inter, hidden)
                if s is not None and s != want:
                    problems.append(f"{layer}.{e} {r} is {list(s)}, the layer's experts are "
                                    f"gate/up {[inter, hidden]}, down {[hidden, inter]}")
    return sizes, problems


def _config_size(config: dict | None, *keys: str) -> tuple[str, int] | None:
    """The first of ``keys`` present in text_config or at top level."""
    config = config or {}
    for key in keys:
        for scope in (config.get("text_config") or {}, config):
            if isinstance(scope.get(key), int):
                return key, scope[key]
    return None


def _size_problems(sizes: dict[str, tuple[int, int]], config: dict | None) -> list[tuple[str, str]]:
    """Sizes from the tensor shapes (the truth), checked per distinct (intermediate, hidden)."""
    out = []
    cfg_inter = _config_size(config, "moe_intermediate_size")
    # Kimi K3's experts run in a latent space: routed_expert_hidden_size, not hidden_size
    cfg_hidden = _config_size(config, "routed_expert_hidden_size", "hidden_size")
    for (inter, hidden), layers in _by_size(sizes).items():
        src = f"tensor shapes of {len(layers)} MoE layer{'s' * (len(layers) > 1)}"
        if hidden % GROUP:
            out.append(("hidden-group", f"expert hidden size {hidden} (in-dim of w1/w3, {src}) "
                                        f"is not a multiple of group size {GROUP}"))
        if cfg_inter and cfg_inter[1] != inter:
            out.append(("config-sizes", f"config {cfg_inter[0]} is {cfg_inter[1]}, but the experts' "
                                        f"intermediate size is {inter} ({src})"))
        if cfg_hidden and cfg_hidden[1] != hidden:
            out.append(("config-sizes", f"config {cfg_hidden[0]} is {cfg_hidden[1]}, but the experts' "
                                        f"hidden size is {hidden} ({src})"))
    return out


def _split_problems(ctx: "_Context", topo: Topology) -> list[Problem]:
    """vLLM's FusedMoEConfig asserts intermediate_size % tp_size == 0 for the MoE's tp_size (dp*tp
    without EP, 1 with EP), and the scales need whole groups per rank. For Kimi on vLLM the size
    split is KimiMoE's, padded (models/kimi_k3/amd/linear.py 227-236)."""
    out = []
    kimi_min = kimi_min_per_rank(ctx.config) if ctx.family == "vllm" else 0
    moe_tp = topo.moe_tp if ctx.family == "vllm" else topo.tp
    for (inter, _), layers in _by_size(ctx.sizes).items():
        fused = kimi_fused(inter, topo.tp, kimi_min)
        if fused % moe_tp or (fused // moe_tp) % GROUP:
            per = f"{fused}/{moe_tp}={fused / moe_tp:g}"
            out.append((f"per-rank intermediate size {per} is not whole groups of {GROUP} at MoE TP {moe_tp}",
                        f"MoE TP {moe_tp} at {topo.text()} ({SPLIT_WHERE['ep' if topo.ep_on else 'tp']}); "
                        f"{len(layers)} MoE layer(s) of intermediate {inter} (tensor shapes)"))
    return out


def _by_size(sizes: dict[str, tuple[int, int]]) -> dict[tuple[int, int], list[str]]:
    out: dict[tuple[int, int], list[str]] = {}
    for layer, size in sorted(sizes.items()):
        out.setdefault(size, []).append(layer)
    return out


# ------------------------------------------------------------------------ names (scheme lookup)

def _selects(name: str, cls: str, targets: list[str], ignore: list[str]) -> str | None:
    """Which way the servers' compressed-tensors matcher answers for one looked-up name: None if a
    target selects it, else why not (vLLM ct/utils.py 53-111 and config_utils.py 432-452; SGLang
    compressed_tensors/utils.py 105-190, the same): ignore first (re.match or equality), then a
    target by name, then by class name (re.match, or contained case-blind; "Linear" is also
    mapped onto the experts' class)."""
    hit = next((p for p in ignore if ckpt._matches(name, p)), None)
    if hit is not None:
        return f"ignore entry {hit!r} matches {name}"
    if any(ckpt._matches(name, t) for t in targets):
        return None
    classes = [t for t in targets if t.startswith("re:") and ckpt._matches(cls, t)
               or not t.startswith("re:") and (t.lower() in cls.lower() or t == "Linear")]
    return None if classes else f"no target matches {name}"


def lookup_problems(config: dict | None, sizes: Mapping[str, tuple[int, int]], family: str) -> list[str]:
    """Per MoE layer and compressed-tensors block: the three names the server asks the experts'
    scheme of must all be selected (else unquantized experts, or a mixed-scheme ValueError)."""
    out = []
    for path, block in ckpt.quant_blocks(config or {}):
        if block.get("quant_method") != "compressed-tensors":
            continue
        groups = block.get("config_groups") if isinstance(block.get("config_groups"), dict) else {}
        targets = [t for g in groups.values() if isinstance(g, dict) for t in g.get("targets") or []
                   if isinstance(t, str)]
        ignore = [i for i in block.get("ignore") or [] if isinstance(i, str)]
        for layer in sorted(sizes):
            whys = [_selects(f"{layer}.0.{p}", MOE_CLASS[family], targets, ignore) for p in SCHEMES["proj"]]
            short = "…" + layer.rsplit(".", 1)[-1]      # the layer is named in the detail (--verbose)
            if all(whys):
                out.append(f"{ckpt.dotted(path)}: {whys[0].replace(layer, short)}: the layer's experts load "
                           f"unquantized")
            elif any(whys):
                out.append(f"{ckpt.dotted(path)}: {next(w for w in whys if w).replace(layer, short)}, but not the "
                           f"other projections: mixed schemes, ValueError at load")
    return out


def class_target_note(config: dict | None, family: str) -> str:
    """A class-name target reaches every layer of that class the ignore list misses, under the
    server's own names (fused layers, the MTP draft's model.layers.N): not provable from the
    checkpoint alone, so said, not failed."""
    classes = sorted({t for _, b in ckpt.quant_blocks(config or {}) for g in (b.get("config_groups") or {}).values()
                      if isinstance(g, dict) for t in g.get("targets") or []
                      if isinstance(t, str) and not t.startswith("re:") and "." not in t})
    if not classes:
        return ""
    return (f"targets {classes} select by class: {family} quantizes every such layer its ignore list misses, "
            f"under its own module names (fused layers, the MTP draft); tests/test_vllm_quant_methods.py shows "
            f"one that goes wrong")


# ------------------------------------------------------------------------ kernel and memory

_ITEMSIZE = {"I32": 4, "BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I64": 8}


def _nbytes(info) -> int:
    n = _ITEMSIZE.get(info.dtype, 1)
    for d in info.shape:
        n *= d
    return n


_LAYER_NO = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Experts:
    """The routed experts as the headers give them, all ranks together, per MoE layer: expert count
    and bytes (int4 + scales as stored; bf16 dequantized), and the model's decoder layer count."""

    sizes: Mapping[str, tuple[int, int]]
    count: Mapping[str, int]
    int4: Mapping[str, int]
    bf16: Mapping[str, int]
    num_layers: int


def experts_of(mats: list["_Matrix"], sizes: Mapping[str, tuple[int, int]], config: dict | None) -> Experts:
    """One pass over the headers (K3: 247,296 matrices); the per-topology figures are then per layer."""
    ids: dict[str, set[int]] = {}
    int4: dict[str, int] = {}
    bf16: dict[str, int] = {}
    for m in mats:
        p, shape = m.expert, m.shape
        if p is None or p[0] not in sizes or shape is None:
            continue
        ids.setdefault(p[0], set()).add(p[1])
        int4[p[0]] = int4.get(p[0], 0) + _nbytes(m.packed) + (_nbytes(m.scale) if m.scale is not None else 0)
        bf16[p[0]] = bf16.get(p[0], 0) + shape[0] * shape[1] * 2
    stated = _config_size(config, "num_hidden_layers")
    numbers = [int(g[1]) for layer in sizes if (g := _LAYER_NO.search(layer))]
    layers = stated[1] if stated else max(numbers, default=0) + 1
    return Experts(dict(sizes), {k: len(v) for k, v in ids.items()}, int4, bf16, max(layers, 1))


@dataclass(frozen=True)
class Memory:
    """The routed experts' bytes on the fullest rank: as stored (int4 + scales) and dequantized to bf16."""

    int4: int
    bf16: int
    layers: int              # MoE layers on that rank (its pipeline stage)
    all_layers: int
    local: int               # experts a rank holds (of the largest layer)
    experts: int
    per_rank_inter: int      # intermediate channels a rank holds per expert (KimiMoE's padding included)
    inter: int
    padded: bool = False     # KimiMoE padded the intermediate dim

    def text(self) -> str:
        return f"{self.bf16 / 1e9:.3g} GB per rank bf16 (int4 as stored: {self.int4 / 1e9:.3g} GB)"

    def split(self) -> str:
        """What a rank holds, in one phrase."""
        pad = " (padded)" if self.padded else ""
        return (f"{self.local}/{self.experts} experts x {self.per_rank_inter}{pad} of {self.inter} intermediate, "
                f"{self.layers}/{self.all_layers} MoE layers")


def kimi_fused(inter: int, tp: int, minimum: int) -> int:
    """The intermediate size vLLM's KimiMoE gives its FusedMoE: ``minimum * tp`` when inter / tp is
    below ``minimum`` at TP > 1 (models/kimi_k3/amd/linear.py 227-236, the TP group only), else inter."""
    padded = plugin_route.kimi_padded(inter, tp, minimum) if minimum else None
    return padded[1] * tp if padded else inter


def expert_memory(experts: Experts, topo: Topology, kimi_min: int = 0) -> Memory:
    """The fullest rank's routed experts: EP deals whole experts over dp*tp ranks, else the MoE's TP
    (dp*tp) splits each expert's intermediate dim; PP gives each stage its layers (topology.py)."""
    stages = pp_stages(experts.num_layers, topo.pp)
    totals = [[0.0, 0.0, 0] for _ in stages]
    local = n = per_rank = inter_max = 0
    padded = False
    for layer, (inter, _) in sorted(experts.sizes.items()):
        if layer not in experts.count:
            continue
        g = _LAYER_NO.search(layer)
        stage = next((i for i, r in enumerate(stages) if g and int(g[1]) in r), len(stages) - 1)
        e = experts.count[layer]
        held = local_experts(e, topo.ep_size)
        fused = kimi_fused(inter, topo.tp, kimi_min)
        rank_inter = fused // topo.moe_tp
        padded |= fused != inter
        share = held / e * rank_inter / inter
        t = totals[stage]
        t[0] += experts.int4[layer] * share
        t[1] += experts.bf16[layer] * share
        t[2] += 1
        if e >= n:
            local, n, per_rank, inter_max = held, e, rank_inter, inter
    int4, bf16, layers = max(totals, key=lambda t: t[0])
    return Memory(round(int4), round(bf16), layers, sum(t[2] for t in totals), local, n, per_rank, inter_max,
                  padded)


@dataclass(frozen=True)
class Verdict:
    """What a server's code does with the experts: the kernel, and why it is wrong (or None).
    ``problem`` is one short line; ``detail`` the source lines and figures behind it."""

    summary: str
    problem: str | None = None
    detail: str = ""


def activation(config: dict | None) -> dict:
    """hidden_act (lower-case; the servers' default 'silu' when absent) and SiTU's betas."""
    fields = {k: v for k, (v, _) in ckpt.activation_fields(config or {}).items()}
    fields["hidden_act"] = str(fields.get("hidden_act", "silu")).lower()
    return fields


def kernel(server: str, config: dict | None, mats: list["_Matrix"], sizes: Mapping[str, tuple[int, int]],
           tp: int | Topology) -> Verdict:
    """The MoE method and kernel ``server`` gives these experts, as its code selects them."""
    topo = topology(server, tp)
    ctx = _Context(config, mats, dict(sizes), experts_of(mats, sizes, config), {}, server)
    return _kernel(ctx, topo)


def _int4(mem: Memory, topo: Topology) -> str:
    return f"int4 as stored, {mem.int4 / 1e9:.3g} GB per rank"


def _kernel(ctx: _Context, topo: Topology) -> Verdict:
    server, config, sizes = ctx.server, ctx.config, ctx.sizes
    srv = SERVER_INFO[server]
    try:   # read where the model reads them (converter.activation_fields): a top-level-only field is refused
        act = activation(config)
        vname, said = vllm_moe_activation(config, act)   # what the model's FusedMoE is given (issue 20)
    except BadInput as e:
        return Verdict(f"{srv.method}: activation not read", str(e))
    name = act["hidden_act"]
    kimi_min = kimi_min_per_rank(config) if srv.family == "vllm" else 0
    mem = expert_memory(ctx.experts, topo, kimi_min)
    int4 = _int4(mem, topo)
    if name == "situ" and act.get("activation_situ_beta") is None:
        return Verdict(f"{srv.method}: SiTU", "hidden_act is situ but activation_situ_beta is missing",
                       "vLLM's SiTU asserts it (fused_moe/activation.py 361-370), SGLang's SituAndMul needs it")
    if server == "vllm-rocm-plugin":
        return _plugin(config, act, mem, topo, int4, sizes, kimi_min)
    if server == "vllm-rocm":
        return _said(_vllm_oracle(srv, vname, mem, topo, int4, marlin=False), said)
    if server == "vllm-cuda":
        hidden_ok = all(h % 128 == 0 for _, h in sizes.values())
        inter_ok = all((kimi_fused(i, topo.tp, kimi_min) // topo.moe_tp) % GROUP == 0 for i, _ in sizes.values())
        verdict = _said(_vllm_oracle(srv, vname, mem, topo, int4, marlin=hidden_ok and inter_ok), said)
        if verdict.problem is None and name == "silu" and (limits := clamp_limits(config)[2]):
            verdict = Verdict(verdict.summary.replace(", takes silu;", f", takes silu with the clamp ({limits});")
                              .replace(", silu;", f", silu with the clamp ({limits});"),
                              detail=f"{verdict.detail}; {VLLM_CUDA_CLAMP}")
        padded = kimi_padding(sizes, topo.tp, kimi_min)
        if verdict.problem is None and padded:
            layer, (per, pad) = padded[0]
            return Verdict(f"{verdict.summary.split(':')[0]}: padded channels hold garbage",
                           f"KimiMoE pads per-rank intermediate {per} to {pad} at TP {topo.tp}; Marlin computes "
                           f"the unzeroed padding",
                           f"vLLM's KimiMoE pads ({KIMI_PAD_WHERE}): its zeroing looks the int4 words up on the "
                           f"MoE runner, finds none and zeroes nothing, so the padded words stay as torch.empty "
                           f"left them (compressed_tensors_moe_wna16.py 183-207) with scales of 1 (282, 298), and "
                           f"Marlin computes every padded channel (fused_moe/oracle/int_wna16.py 651-659 masks "
                           f"nothing)")
        return verdict
    line = "558" if server == "sglang-rocm" else "454 (Marlin), 558 (Triton)"
    if name != "silu":
        return Verdict(f"{srv.method}: asserts silu",
                       f"{srv.method} asserts activation == 'silu'; hidden_act is {name!r}",
                       f"{srv.release} on {srv.target} gives the experts {srv.method}, whose apply_weights asserts "
                       f"activation == 'silu' (compressed_tensors_wNa16_moe.py {line}): the first forward with "
                       f"hidden_act {name!r} raises AssertionError")
    return _sglang_clamp(server, config, f"{srv.method}, int4 Triton/Marlin kernel, silu", int4)


# vLLM 0.33.0 on CUDA: every default WNA16 backend applies FusedMoE's swiglu_limit; FlashInfer's is opt-in and drops it
VLLM_CUDA_CLAMP = ("the clamp reaches the kernel: CompressedTensorsWNA16MoEMethod passes layer.swiglu_limit as "
                   "gemm1_clamp_limit (compressed_tensors_moe_wna16.py 495, 506), ApplyMoEActivationConfig carries it "
                   "(fused_moe/activation.py 176-197, modular_kernel.py 525) and MARLIN/TRITON apply silu(min(gate, "
                   "limit)) * clamp(up) (MARLIN: experts/marlin_moe.py 783-785, modular_kernel.py 933-951, "
                   "activation.py 350-356; TRITON: experts/triton_moe.py 219-225), Humming too "
                   "(quantization/utils/humming/activation.py 99-101); only VLLM_USE_FLASHINFER_MOE_INT4=1 on SM100 "
                   "(envs.py 1685, flashinfer_mxint4_moe.py 24-31) picks FlashInfer TRT-LLM MxInt4, called with "
                   "gemm1_clamp_limit=None (flashinfer_mxint4_moe.py 252): leave it unset")
# Models whose SGLang 0.5.23 MoE passes the experts a SwiGLU clamp: the config field, the
# MoeRunnerConfig field it becomes, and where (sglang 0.5.23 paths).
SGLANG_CLAMP = {
    "bailing_hybrid": ("expert_swiglu_limit_list", "gemm1_clamp_limit",
                       "models/bailing_moe_v3.py 436-439, 469-478, 568-579 (BailingMoE: each layer's limit as "
                       "gemm1_clamp_limit)"),
    "glm5_next": ("swiglu_limit", "swiglu_limit",
                  "models/glm5_next.py 102, 748-756 (Glm5NextMoE is DeepseekV2MoE), models/deepseek_v2.py 753-767 "
                  "(swiglu_limit)"),
}
SGLANG_CLAMP["bailing_moe_v3"] = SGLANG_CLAMP["bailing_hybrid"]
SGLANG_CLAMP["glm5_next_text"] = SGLANG_CLAMP["glm5_next"]
S_FUSED = "sglang 0.5.23 layers/moe/moe_runner/triton_utils/fused_moe.py"


def clamp_limits(config: dict | None) -> tuple[tuple[str, str, str] | None, list[float], str]:
    """(SGLANG_CLAMP's entry, the distinct non-zero limits, "field 7, 10") of a clamped model."""
    hit = next((SGLANG_CLAMP[t] for t in sorted(_model_types(config)) if t in SGLANG_CLAMP), None)
    if hit is None:
        return None, [], ""
    value = ckpt.activation_fields(config or {}, (hit[0],)).get(hit[0], (None,))[0]
    values = value if isinstance(value, list) else [value]
    limits = sorted({float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v})
    return hit, limits, f"{hit[0]} {', '.join(f'{v:g}' for v in limits)}"


def _sglang_clamp(server: str, config: dict | None, summary: str, int4: str) -> Verdict:
    """What SGLang's int4 MoE paths do with the model's SwiGLU clamp: the Triton path (ROCm; CUDA
    SM100 by default) applies gemm1_clamp_limit (fused_moe.py 759-762) and takes swiglu_limit only as
    DeepSeek-V4's 10 with a CUDA/XPU-only kernel when no expert is filtered (763-782); Marlin (CUDA)
    applies swiglu_limit only (compressed_tensors_wNa16_moe.py 493, fused_marlin_moe.py 356-361)."""
    hit, limits, said = clamp_limits(config)
    if not limits:
        return Verdict(f"{summary}: {int4}")
    _, field, where = hit
    src = f"the model passes it as {field} (sglang 0.5.23 {where})"
    if field == "gemm1_clamp_limit":
        if server == "sglang-rocm":
            return Verdict(f"{summary} with the clamp ({said}; silu(gate) clamped after silu, vLLM clamps the gate "
                           f"before it): {int4}", detail=f"{src}; {S_FUSED} 759-762, 411-417")
        return Verdict(f"{summary}: Marlin drops the clamp",
                       f"{said} is dropped by Marlin (wrong numerics); SGLang's Triton path (SM100 default, "
                       f"--moe-runner-backend triton) applies it",
                       f"{src}; CompressedTensorsWNA16MoE.apply_weights passes fused_marlin_moe clamp_limit="
                       f"moe_runner_config.swiglu_limit only (sglang 0.5.23 compressed_tensors_wNa16_moe.py 493), "
                       f"None here, so fused_marlin_moe.py 356-361 is skipped and plain silu_and_mul runs (362-363)")
    if server == "sglang-rocm":
        why, lines = ((f"asserts swiglu_limit == 10 ({said})", "768") if limits != [10.0] else
                      ("clamps swiglu_limit with a CUDA/XPU-only kernel when no expert is filtered (no EP)",
                       "777-782: assert _is_cuda or _is_xpu"))
        return Verdict(f"{summary}: AssertionError at the first forward",
                       f"SGLang's ROCm Triton MoE {why}: AssertionError at the first forward",
                       f"{src}; {S_FUSED} 763-782 ({lines})")
    note = "" if limits == [10.0] else f"; on SM100 the default Triton path asserts swiglu_limit == 10 ({S_FUSED} 768)"
    return Verdict(f"{summary} with the clamp ({said}, Marlin: fused_marlin_moe.py 356-361){note}: {int4}",
                   detail=src)


# Models whose vLLM MoE passes FusedMoE an activation other than config hidden_act, and the
# config fields it passes with it (vLLM's defaults where the config omits one).
VLLM_MOE_ACTIVATION = {
    "minimax_m3_vl": ("swigluoai_uninterleave", {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0},
                      "models/minimax_m3/amd/model.py 454-479; defaults "
                      "transformers_utils/configs/minimax_m3.py 36-41"),
}
VLLM_MOE_ACTIVATION["minimax_m3_text"] = VLLM_MOE_ACTIVATION["minimax_m3_vl"]


def vllm_moe_activation(config: dict | None, act: dict) -> tuple[str, str]:
    """The activation vLLM's model class gives its FusedMoE (what the kernel oracle is asked), and
    its parameters as a phrase ("" when it is config hidden_act)."""
    hit = next((VLLM_MOE_ACTIVATION[t] for t in sorted(_model_types(config)) if t in VLLM_MOE_ACTIVATION), None)
    if hit is None:
        return act["hidden_act"], ""
    name, defaults, where = hit
    fields = {k: v for k, (v, _) in ckpt.activation_fields(config or {}, tuple(defaults)).items() if k in defaults}
    said = ", ".join(f"{k.removeprefix('swiglu_')} {fields.get(k, d)}{'' if k in fields else ' (default)'}"
                     for k, d in defaults.items())
    return name, f"; FusedMoE gets activation {name} ({said}; vllm 0.33.0 {where})"


def _said(v: Verdict, said: str) -> Verdict:
    """The activation the model passes: its parameters in the summary, its source lines in the detail."""
    if not said:
        return v
    phrase, where = said.rsplit("; vllm 0.33.0 ", 1)
    detail = "; ".join(x for x in (v.detail, f"the activation: vllm 0.33.0 {where.rstrip(')')}") if x)
    return Verdict(v.summary + phrase + ")", v.problem, detail)


def _vllm_oracle(srv: Server, act: str, mem: Memory, topo: Topology, int4: str, marlin: bool) -> Verdict:
    """vLLM's WNA16 backend oracle (fused_moe/oracle/int_wna16.py 126-143, 338-363) for our weight key
    (int4 group 32, symmetric, no zero points)."""
    if act not in APPLY_ACTS:
        return Verdict(f"{srv.method}: no backend", f"no WNA16 MoE backend takes activation {act!r}",
                       "NotImplementedError at start-up (fused_moe/oracle/int_wna16.py 338-363)")
    if marlin:
        return Verdict(f"{srv.method} -> MARLIN (Humming first on SM90 if installed), takes {act}; {int4}",
                       detail="fused_moe/oracle/int_wna16.py 126-143; experts/marlin_moe.py 592-594, 623-626")
    if act in TRITON_ACTS:
        return Verdict(f"{srv.method} -> TRITON (TritonWNA16Experts), {act}; {int4}",
                       detail="fused_moe/oracle/int_wna16.py 126-143; experts/triton_moe.py 681-693")
    why = "Marlin is CUDA-only and TRITON has no situ" if srv.target.startswith("ROCm") else \
        "Marlin needs hidden % 128 == 0 and per-rank intermediate % 32 == 0, TRITON has no situ"
    return Verdict(f"{srv.method} -> EMULATION",
                   f"EMULATION: bf16 dequantization at load, {mem.bf16 / 1e9:.3g} GB per rank at {topo.text()}",
                   f"{srv.release} on {srv.target} gives the experts {srv.method} -> EMULATION ({why}): "
                   f"{mem.text()}, {mem.split()}")


def kimi_min_per_rank(config: dict | None) -> int:
    """vLLM KimiMoE's minimum per-rank intermediate size for a Kimi checkpoint, 0 for other models."""
    if not _model_types(config) & set(W123_MODELS):
        return 0
    return plugin_route.kimi_min_per_rank(plugin_route.text_config(config or {}))


def kimi_padding(sizes: Mapping[str, tuple[int, int]], tp: int, minimum: int) -> list[tuple[str, tuple[int, int]]]:
    """(layer, (real per-rank intermediate, padded)) for every MoE layer vLLM's KimiMoE pads at ``tp``."""
    if not minimum:
        return []
    return [(layer, padded) for layer, (inter, _) in sorted(sizes.items())
            if (padded := plugin_route.kimi_padded(inter, tp, minimum))]


# The plugin's load-time kernel self-test (converter/vllm_plugin/moe_method.py _will_self_test): the
# first routed-experts layer each rank lays out, through the layer's own kernel; with DP+EP all2all it
# runs the local expert kernel with the layer's expert mask, no collective (issue 23 section 1).
SELF_TEST = "self-test runs"
SELF_TEST_ALL2ALL = "self-test runs (local kernel, no all2all)"


def _plugin(config: dict | None, act: dict, mem: Memory, topo: Topology, int4: str,
            sizes: Mapping[str, tuple[int, int]], kimi_min: int) -> Verdict:
    """The plugin's own decision (converter/vllm_plugin/route.py) on a gfx942 machine with AITER MoE on,
    vLLM 0.33 and an aiter whose a16w4 stage-1 takes SiTUv2; stock vLLM decides when it stays out."""
    srv = SERVER_INFO["vllm-rocm-plugin"]
    blocks = [b for _, b in ckpt.quant_blocks(config or {})]

    def gemm1(*args, act=None, situ_beta=None, situ_linear_beta=None, **kw):   # the aiter the server needs
        raise NotImplementedError

    machine = plugin_route.Machine(is_rocm=True, on_gfx942=True, aiter_moe_enabled=True, vllm_version=SERVED_VLLM,
                                   gemm1=gemm1)
    try:
        name = plugin_route.decide(blocks[0] if blocks else None, None, config or {}, machine)
    except plugin_route.Refused as e:
        return Verdict(f"{srv.method}: refused", str(e), "converter/vllm_plugin/route.py decide")
    if name is None:
        stock = _vllm_oracle(SERVER_INFO["vllm-rocm"], act["hidden_act"], mem, topo, int4, marlin=False)
        return Verdict(f"plugin stays out, stock vLLM: {stock.summary}", stock.problem, stock.detail)
    for layer, (inter, hidden) in sorted(sizes.items()):
        fused = kimi_fused(inter, topo.tp, kimi_min)
        if fused % topo.moe_tp or (fused // topo.moe_tp) % GROUP:
            continue                                        # rule tp-intermediate says it
        padded = plugin_route.kimi_padded(inter, topo.tp, kimi_min) if kimi_min else None
        if padded and (why := plugin_route.padding_refusal(inter, topo.tp, kimi_min, SERVED_VLLM)):
            return Verdict(f"{srv.method}: refused at load",
                           f"vLLM {SERVED_VLLM} KimiMoE pads intermediate {padded[0]} to {padded[1]} per rank at "
                           f"TP {topo.tp} and cannot build it",
                           f"{plugin_route.PREFIX} {layer}: {why} (converter/vllm_plugin/moe_method.py "
                           f"create_weights; {KIMI_PAD_WHERE})")
        per_rank = fused // topo.moe_tp
        if why := plugin_route.size_problem(hidden, per_rank):
            return Verdict(f"{srv.method}: refused at load",
                           f"the plugin refuses per-rank sizes its kernel would pad: {why}",
                           f"{plugin_route.PREFIX} {layer}: {why} at {topo.text()} (MoE TP {topo.moe_tp}): the "
                           f"plugin refuses sizes its kernel would pad (converter/vllm_plugin/moe_method.py "
                           f"maybe_roundup_sizes, route.size_problem)")
    test = SELF_TEST_ALL2ALL if topo.all2all else SELF_TEST
    return Verdict(f"{plugin_route.NAME}: AITER a16w4 with Situv2 beta {act.get('activation_situ_beta')} "
                   f"linear_beta {act.get('activation_situ_linear_beta')}, {test}; {int4}",
                   detail="converter/vllm_plugin/moe_method.py: aiter flydsl_a16w4_gemm1 (vLLM 0.33.0 "
                          "quantization/mxfp4.py _setup_kernel_k3_situ_gfx942 builds the same kernel); self-test: "
                          "moe_method.py _will_self_test")


# ------------------------------------------------------------------------ for `verify`

def _launch(topo: Topology) -> str:
    """How vLLM splits the experts at ``topo``, in one line."""
    how = (f"EP {topo.ep_size}" + (" (all2all)" if topo.all2all else "")) if topo.ep_on else f"MoE TP {topo.moe_tp}"
    return how + (f", PP {topo.pp}" if topo.pp > 1 else "")


def serving_check(config: dict | None, tensors: Mapping[str, TensorInfo], server: str, tp: int | Topology,
                  verbose: bool = False) -> Check:
    """The rules as one ``verify`` Check named "serving": one short problem line per failed rule; the
    TP sizes that pass (each found by running the rules at it); with ``verbose`` the source lines."""
    topo = topology(server, tp)
    ctx = _context(config, tensors, server)
    results = _evaluate(ctx, topo)
    c = Check("serving", f"{server} at {topo.text()}: {sum(r.ok for r in results)}/{len(results)} rules pass")
    for r in results:
        if not r.ok:
            c.fail(r.message)
        elif r.rule == "kernel":
            c.notes.append(r.message.removeprefix("rule kernel: "))
        if r.note:
            c.notes.append(r.note)
    vllm = ctx.family == "vllm"
    if vllm:
        mem = expert_memory(ctx.experts, topo, kimi_min_per_rank(config))
        c.notes.append(f"{topo.text()}, {topo.gpus} GPUs: {_launch(topo)}; per rank {mem.split()}")
    failed = {r.rule for r in results if not r.ok}
    if failed and failed <= set(TOPOLOGY_RULES):
        c.notes.append(_advice(ctx, topo))
    if verbose:
        srv = SERVER_INFO[server]
        c.notes.append(f"server: {srv.release}, {srv.target}")
        if vllm:
            c.notes += [f"split: {SPLIT_WHERE[k]}" for k in ("ep", "tp", "experts", "all2all", "pp")]
        for r in results:
            if not r.ok:
                c.notes += [f"rule {r.rule}: {r.detail}" * bool(r.detail), f"rule {r.rule} is enforced by "
                            f"{RULES[r.rule].where[server]}", f"rule {r.rule} fix: {RULES[r.rule].fix}"]
        c.notes = [n for n in c.notes if n]
        kernel_detail = _topology_problems(ctx, topo)[1].detail
        c.notes.append(f"rule kernel: {RULES['kernel'].where[server]}" + (f"; {kernel_detail}" if kernel_detail
                                                                          and "kernel" not in failed else ""))
    elif failed:
        c.notes.append("--verbose: where the server enforces each rule (file and line), and the fix")
    return c


def _advice(ctx: _Context, topo: Topology) -> str:
    """The TP sizes that pass at topo's DP/PP/EP (and with EP toggled, where that differs)."""
    rest = [f"{k} {v}" for k, v in (("DP", topo.dp), ("PP", topo.pp)) if v > 1] + ["EP"] * topo.ep
    where = f" with {', '.join(rest)}" if rest else ""
    sizes = passing_tp(ctx, topo) or []
    out = f"TP sizes that pass{where}: {', '.join(map(str, sizes)) or 'none up to 64'}"
    if ctx.family == "vllm":
        other = Topology(topo.tp, topo.dp, topo.pp, not topo.ep)
        alt = passing_tp(ctx, other) or []
        if alt and alt != sizes:
            out += f"; {'without' if topo.ep else 'with'} EP: {', '.join(map(str, alt))}"
    return out
