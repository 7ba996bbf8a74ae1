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
from dataclasses import dataclass
from typing import Mapping

from .checks import Check
from .errors import BadInput
from .formats import checkpoint as ckpt
from .formats.dialect import is_fp8_block_group
from .formats.safetensors_io import TensorInfo, read_header
from .plan import PACKED, SCALE
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
    Rule("tp-intermediate", f"intermediate size divisible by TP, per-rank size a multiple of {GROUP}",
         _both(f"{V}fused_moe/config.py 1352: assert intermediate_size % tp_size == 0; {V_WNA16}.create_weights "
               f"254: num_groups_w2 = intermediate_size_per_partition // group_size",
               f"{S_LAYER} 427: assert intermediate_size % moe_tp_size == 0; {S_WNA16} 158: "
               f"num_groups_w2 = intermediate_size_per_partition // group_size"),
         "use a TP size that fits, or expert parallelism (which does not split experts)"),
    Rule("config-sizes", "config's MoE sizes match the tensors",
         _both(f"{V}models/kimi_k3/amd/linear.py 207-221: FusedMoE sized from moe_intermediate_size and "
               f"routed_expert_hidden_size (else hidden_size), then copy_",
               "the server sizes (E, ...) params from config, then copy_ the tensors into them"),
         "make config moe_intermediate_size / routed_expert_hidden_size (or hidden_size) match the tensors"),
    Rule("kernel", "a MoE kernel that takes the experts' activation, at int4 memory", KERNEL_WHERE,
         "for SiTU experts: on gfx942 serve with k3convert's vLLM plugin (vllm-rocm-plugin: hidden and "
         "per-rank intermediate sizes multiples of 128), on CUDA with vLLM (vllm-cuda)"),
)}


@dataclass(frozen=True)
class RuleResult:
    """The outcome of one rule. ``message``: for a failure, one line naming the rule and the fix."""

    rule: str
    ok: bool
    message: str
    note: str = ""     # worth saying on a pass (not a failure)


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


def check_serving(dst: str, server: str, tp: int) -> list[RuleResult]:
    """Every rule of ``server``'s int4 MoE path at tensor parallelism ``tp``, against DST."""
    config, tensors = load(dst)
    return evaluate(config, tensors, server, tp)


# ------------------------------------------------------------------------ the rules

def evaluate(config: dict | None, tensors: Mapping[str, TensorInfo], server: str, tp: int) -> list[RuleResult]:
    """Pure: the rule results for a config and the shards' header entries (name -> info)."""
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; one of {', '.join(SERVERS)}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    mats = _matrices(tensors)
    dtype = model_dtype(config)
    sizes, shape_problems = _layer_sizes(mats)
    found: dict[str, list[str]] = {rid: [] for rid in RULES}
    for rid, problem in [*_config_problems(config), *_tensor_problems(mats, DTYPES.get(dtype, dtype.upper())),
                         *_name_problems(mats, config), *(("expert-shapes", p) for p in shape_problems),
                         *_size_problems(sizes, config, tp),
                         *(("names", p) for p in lookup_problems(config, sizes, SERVER_INFO[server].family))]:
        found[rid].append(problem)
    verdict = kernel(server, config, mats, sizes, tp)
    if verdict.problem:
        found["kernel"].append(verdict.problem)
    notes = {"names": class_target_note(config, SERVER_INFO[server].family), "kernel": verdict.summary}
    return [_result(RULES[rid], server, problems, notes.get(rid) or "") for rid, problems in found.items()]


def _result(rule: Rule, server: str, problems: list[str], note: str = "") -> RuleResult:
    if not problems:
        return RuleResult(rule.id, True, f"rule {rule.id}: {note if rule.id == 'kernel' else rule.what}",
                          note if rule.id != "kernel" else "")
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return RuleResult(rule.id, False,
                      f"rule {rule.id}: {problems[0]}{more} ({server}: {rule.where[server]}): {rule.fix}")


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


def fitting_tp(inter: int, limit: int = 64) -> list[int]:
    """TP sizes up to ``limit`` at which every rank holds whole groups of the intermediate dim."""
    return [t for t in range(1, limit + 1) if inter % t == 0 and (inter // t) % GROUP == 0]


def _size_problems(sizes: dict[str, tuple[int, int]], config: dict | None, tp: int) -> list[tuple[str, str]]:
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
        if inter % tp or (inter // tp) % GROUP:
            per = f"{inter}/{tp}={inter / tp:g}"
            fits = ", ".join(map(str, fitting_tp(inter))) or "none"
            out.append(("tp-intermediate", f"per-rank intermediate size {per} ({src}) is not "
                                           f"a multiple of group size {GROUP} at --tp {tp}; TP sizes that fit: {fits}"))
        if cfg_inter and cfg_inter[1] != inter:
            out.append(("config-sizes", f"config {cfg_inter[0]} is {cfg_inter[1]}, but the experts' "
                                        f"intermediate size is {inter} ({src})"))
        if cfg_hidden and cfg_hidden[1] != hidden:
            out.append(("config-sizes", f"config {cfg_hidden[0]} is {cfg_hidden[1]}, but the experts' "
                                        f"hidden size is {hidden} ({src})"))
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
            if all(whys):
                out.append(f"{ckpt.dotted(path)}: {whys[0]}: the layer's experts load unquantized")
            elif any(whys):
                out.append(f"{ckpt.dotted(path)}: {next(w for w in whys if w)}, but not the other projections: "
                           f"the server raises 'All MoE projections need to have same quantization scheme'")
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


@dataclass(frozen=True)
class Memory:
    """The routed experts' bytes per rank: as stored (int4 + scales) and dequantized to bf16."""

    int4: int
    bf16: int
    layers: int

    def text(self, tp: int) -> str:
        return (f"{self.bf16 / 1e9:.3g} GB per rank of routed experts over {self.layers} MoE layer(s) at --tp {tp} "
                f"(int4 as stored: {self.int4 / 1e9:.3g} GB)")


def expert_memory(mats: list["_Matrix"], sizes: Mapping[str, tuple[int, int]], tp: int,
                  kimi_min: int = 0) -> Memory:
    """From the headers: each MoE layer's expert tensors, split over ``tp`` along the intermediate
    dim (all experts on every rank). ``kimi_min``: vLLM's KimiMoE pads the per-rank intermediate
    up to this at TP > 1 (models/kimi_k3/amd/linear.py 227-236), and the padding is stored too."""
    int4, bf16 = 0.0, 0.0
    for m in mats:
        p = m.expert
        shape = m.shape
        if p is None or p[0] not in sizes or shape is None:
            continue
        inter = sizes[p[0]][0]
        share = (plugin_route.kimi_per_rank(inter, tp, kimi_min) if kimi_min else inter / tp) / inter
        int4 += (_nbytes(m.packed) + (_nbytes(m.scale) if m.scale is not None else 0)) * share
        bf16 += shape[0] * shape[1] * 2 * share
    return Memory(round(int4), round(bf16), len(sizes))


@dataclass(frozen=True)
class Verdict:
    """What a server's code does with the experts: the kernel, and why it is wrong (or None)."""

    summary: str
    problem: str | None = None


def activation(config: dict | None) -> dict:
    """hidden_act (lower-case; the servers' default 'silu' when absent) and SiTU's betas."""
    fields = {k: v for k, (v, _) in ckpt.activation_fields(config or {}).items()}
    fields["hidden_act"] = str(fields.get("hidden_act", "silu")).lower()
    return fields


def kernel(server: str, config: dict | None, mats: list["_Matrix"], sizes: Mapping[str, tuple[int, int]],
           tp: int) -> Verdict:
    """The MoE method and kernel ``server`` gives these experts, as its code selects them."""
    srv = SERVER_INFO[server]
    try:   # read where the model reads them (converter.activation_fields): a top-level-only field is refused
        act = activation(config)
        vname, said = vllm_moe_activation(config, act)   # what the model's FusedMoE is given (issue 20)
    except BadInput as e:
        return Verdict(f"{srv.method}: activation not read", str(e))
    name = act["hidden_act"]
    kimi_min = kimi_min_per_rank(config) if srv.family == "vllm" else 0
    mem = expert_memory(mats, sizes, tp, kimi_min=kimi_min)
    int4 = f"{mem.int4 / 1e9:.3g} GB per rank of int4 experts at --tp {tp}"
    if name == "situ" and act.get("activation_situ_beta") is None:
        return Verdict(f"{srv.method}: SiTU", "hidden_act is situ but activation_situ_beta is missing: vLLM's "
                                              "SiTU asserts it (fused_moe/activation.py 361-370), SGLang's SituAndMul "
                                              "needs it")
    if server == "vllm-rocm-plugin":
        return _plugin(config, act, mem, tp, int4, sizes, kimi_min)
    if server == "vllm-rocm":
        return _said(_vllm_oracle(srv, vname, mem, tp, int4, marlin=False), said)
    if server == "vllm-cuda":
        hidden_ok = all(h % 128 == 0 for _, h in sizes.values())
        inter_ok = all((i // tp) % GROUP == 0 for i, _ in sizes.values())
        verdict = _said(_vllm_oracle(srv, vname, mem, tp, int4, marlin=hidden_ok and inter_ok), said)
        padded = kimi_padding(sizes, tp, kimi_min)
        if verdict.problem is None and padded:
            layer, (per, pad) = padded[0]
            fits = ", ".join(str(t) for t in fitting_tp(sizes[layer][0]) if not kimi_padding(sizes, t, kimi_min))
            return Verdict(f"{verdict.summary.split(':')[0]}: padded channels hold garbage",
                           f"vLLM's KimiMoE pads the per-rank intermediate size {per} to {pad} at --tp {tp} "
                           f"({KIMI_PAD_WHERE}): its zeroing looks the int4 words up on the MoE runner, finds "
                           f"none and zeroes nothing, so the padded words stay as torch.empty left them "
                           f"(compressed_tensors_moe_wna16.py 183-207) with scales of 1 (282, 298), and Marlin "
                           f"computes every padded channel (fused_moe/oracle/int_wna16.py 651-659 masks nothing); "
                           f"TP sizes without padding: {fits or 'none'}")
        return verdict
    line = "558" if server == "sglang-rocm" else "454 (Marlin), 558 (Triton)"
    if name != "silu":
        return Verdict(f"{srv.method}: asserts silu",
                       f"{srv.release} on {srv.target} gives the experts {srv.method}, whose apply_weights asserts "
                       f"activation == 'silu' (compressed_tensors_wNa16_moe.py {line}): the first forward with "
                       f"hidden_act {name!r} raises AssertionError")
    return Verdict(f"{srv.method}, int4 Triton/Marlin kernel, silu: {int4}")


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
    return name, f"; the model passes FusedMoE activation {name} ({said}; vllm 0.33.0 {where})"


def _said(v: Verdict, said: str) -> Verdict:
    return Verdict(v.summary + said, v.problem)


def _vllm_oracle(srv: Server, act: str, mem: Memory, tp: int, int4: str, marlin: bool) -> Verdict:
    """vLLM's WNA16 backend oracle (fused_moe/oracle/int_wna16.py 126-143, 338-363) for our weight key
    (int4 group 32, symmetric, no zero points)."""
    if act not in APPLY_ACTS:
        return Verdict(f"{srv.method}: no backend", f"no WNA16 MoE backend takes activation {act!r} "
                                                    f"(NotImplementedError at start-up)")
    if marlin:
        return Verdict(f"{srv.method} -> MARLIN (MarlinExperts; Humming ranks first on SM90 if installed), "
                       f"takes {act}: {int4}")
    if act in TRITON_ACTS:
        return Verdict(f"{srv.method} -> TRITON (TritonWNA16Experts), {act}: {int4}")
    why = "Marlin is CUDA-only and TRITON has no situ" if srv.target.startswith("ROCm") else \
        "Marlin needs hidden % 128 == 0 and per-rank intermediate % 32 == 0, TRITON has no situ"
    return Verdict(f"{srv.method} -> EMULATION",
                   f"{srv.release} on {srv.target} gives the experts {srv.method} -> EMULATION ({why}): "
                   f"bf16 dequantization at load, {mem.text(tp)}")


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


def _plugin(config: dict | None, act: dict, mem: Memory, tp: int, int4: str,
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
        return Verdict(f"{srv.method}: refused", str(e))
    if name is None:
        stock = _vllm_oracle(SERVER_INFO["vllm-rocm"], act["hidden_act"], mem, tp, int4, marlin=False)
        return Verdict(f"plugin stays out, stock vLLM: {stock.summary}", stock.problem)
    for layer, (inter, hidden) in sorted(sizes.items()):
        splits = inter % tp == 0 and (inter // tp) % GROUP == 0     # else rule tp-intermediate says it
        if kimi_min and splits and (why := plugin_route.padding_refusal(inter, tp, kimi_min, SERVED_VLLM)):
            return Verdict(f"{srv.method}: refused at load", f"{plugin_route.PREFIX} {layer}: {why} "
                                                             f"(converter/vllm_plugin/moe_method.py create_weights)")
        per_rank = plugin_route.kimi_per_rank(inter, tp, kimi_min) if kimi_min else inter // tp
        if why := plugin_route.size_problem(hidden, per_rank):
            return Verdict(f"{srv.method}: refused at load",
                           f"{plugin_route.PREFIX} {layer}: {why} at --tp {tp}: the plugin refuses sizes its "
                           f"kernel would pad (converter/vllm_plugin/moe_method.py maybe_roundup_sizes)")
    return Verdict(f"{srv.method}: AITER a16w4 (flydsl_a16w4_gemm1) with Situv2 beta "
                   f"{act.get('activation_situ_beta')} linear_beta {act.get('activation_situ_linear_beta')}, "
                   f"no dequantization: {int4}")


# ------------------------------------------------------------------------ for `verify`

def serving_check(config: dict | None, tensors: Mapping[str, TensorInfo], server: str, tp: int) -> Check:
    """The rules as one ``verify`` Check named "serving" (one problem line per failed rule)."""
    results = evaluate(config, tensors, server, tp)
    srv = SERVER_INFO[server]
    c = Check("serving", f"{server} ({srv.release}, {srv.target}) at --tp {tp}: "
                         f"{sum(r.ok for r in results)}/{len(results)} rules pass")
    for r in results:
        if not r.ok:
            c.fail(r.message)
        elif r.rule == "kernel":
            c.notes.append(r.message.removeprefix("rule kernel: "))
        if r.note:
            c.notes.append(r.note)
    return c
