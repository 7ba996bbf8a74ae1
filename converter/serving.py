"""Will a server load DST? The int4 W4A16 MoE path of vLLM and SGLang on ROCm (gfx942).

Every rule below was read from the servers' own source; ``docs/serving.md`` cites, for each,
the file, the function and the condition it asserts, and says where a rule is our choice
rather than the server's. The check reads only config.json and the shard headers (no tensor
data), so it takes seconds on the 1.5 TB model. A failed rule gives one line: the rule, what
is wrong, where the server enforces it, and what to change.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from .errors import BadInput
from .formats import checkpoint as ckpt
from .formats.safetensors_io import TensorInfo, read_header
from .plan import PACKED, SCALE

if TYPE_CHECKING:
    from .verify import Check

SERVERS = ("vllm-rocm", "sglang-rocm")
BITS = 4
GROUP = 32                       # k3convert's target; see rule group-size
PACK = 32 // BITS                # int4 values per int32 word
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
DEFAULT_DTYPE = "bfloat16"       # what the servers use when config states none (and K3 ships)
# model types whose server loader maps experts.E.w1/w2/w3 only (vLLM and SGLang kimi_linear.py)
W123_MODELS = ("kimi_linear", "kimi_k3")
SCHEMES = {"w123": ("w1", "w3", "w2"), "proj": ("gate_proj", "up_proj", "down_proj")}
ROLE = {name: role for names in SCHEMES.values() for name, role in zip(names, ("gate", "up", "down"))}
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")

V_CT = "vllm compressed_tensors.py"
V_MOE = "vllm compressed_tensors_moe.py get_moe_method"
V_WNA16 = "vllm CompressedTensorsWNA16MoEMethod"
V_MARLIN = "vllm CompressedTensorsWNA16MarlinMoEMethod.create_weights"
V_LAYER = "vllm fused_moe/layer.py FusedMoE"
S_CT = "sglang compressed_tensors.py"
S_WNA16 = "sglang CompressedTensorsWNA16MoE"
S_LAYER = "sglang fused_moe_triton/layer.py FusedMoE"


@dataclass(frozen=True)
class Rule:
    """One requirement of the servers' int4 MoE path, where each server enforces it, the fix."""

    id: str
    what: str
    where: Mapping[str, str]
    fix: str


def _both(vllm: str, sglang: str) -> dict[str, str]:
    return {"vllm-rocm": vllm, "sglang-rocm": sglang}


RULES: dict[str, Rule] = {r.id: r for r in (
    Rule("format", "quant_method compressed-tensors, format pack-quantized",
         _both(f"{V_MOE}: format == pack_quantized else ValueError",
               f"{S_WNA16}.__init__: quant_format == pack_quantized else ValueError"),
         "set quant_method 'compressed-tensors' and format 'pack-quantized' (block and config_groups)"),
    Rule("num-bits", "weights.num_bits 4",
         _both(f"{V_WNA16}: packed_factor = 32 // num_bits sizes the int32 params",
               f"{S_WNA16}: packed_factor = 32 // num_bits sizes the int32 params"),
         "set weights.num_bits 4 (the shards hold eight 4-bit values per int32)"),
    Rule("type", "weights.type int",
         _both(f"{V_CT} _is_mxfp4: type float + 4 bits + group 32 routes to the MXFP4 MoE method",
               f"{S_WNA16}: decodes the nibbles as int (uint4b8) whatever the type says"),
         "set weights.type 'int'"),
    Rule("symmetric", "weights.symmetric true",
         _both(f"{V_WNA16}.__init__: assert weight_quant.symmetric",
               f"{S_CT} _is_wNa16_group_channel requires symmetric; {S_WNA16}.__init__ asserts it"),
         "set weights.symmetric true (zero point 8, no weight_zero_point tensors)"),
    Rule("strategy", "weights.strategy group",
         _both(f"{V_WNA16}.__init__: assert weight_quant.strategy == 'group'",
               f"{S_WNA16}.create_weights: strategy 'channel' makes one scale per row, not [out, in/32]"),
         "set weights.strategy 'group'"),
    Rule("group-size", f"weights.group_size {GROUP}",
         _both(f"k3convert's target (vllm flydsl gfx950 path requires group_size == {GROUP})",
               f"k3convert's target; the scale shapes and TP sizes below assume {GROUP}"),
         f"convert with group size {GROUP} and set weights.group_size {GROUP}"),
    Rule("actorder", "weights.actorder null",
         _both(f"{V_MOE}: actorder group/dynamic -> ValueError; {V_WNA16}: assert actorder != 'group'",
               f"{S_WNA16}.create_weights: any actorder loads full-K w2 scales, which the ROCm Triton "
               f"path does not shard"),
         "set weights.actorder null"),
    Rule("static", "weights.dynamic false",
         _both(f"{V_CT} _is_wNa16_group_channel: is_static = not weight_quant.dynamic",
               f"{S_CT} _is_wNa16_group_channel: is_static = not weight_quant.dynamic"),
         "set weights.dynamic false"),
    Rule("input-activations", "input_activations null (W4A16)",
         _both(f"{V_CT} _is_wNa16_group_channel: input_quant is None, else a W4A8 method or "
               f"'Unsupported FusedMoe scheme'",
               f"{S_CT}: ignores input_activations under pack-quantized, so they would not be served"),
         "set config_groups.*.input_activations null"),
    Rule("packed", "weight_packed int32 [out, in/8]",
         _both(f"{V_WNA16}.create_weights: int32 (E, in // 8, out) filled by copy_ (shape must match)",
               f"{S_WNA16}.create_weights: int32 (E, in // 8, out) filled by copy_ (shape must match)"),
         "store weight_packed as int32 [out, in/8] (convert with k3convert)"),
    Rule("scale-dtype", "weight_scale in the model dtype",
         _both(f"{V_WNA16}.create_weights: scales are params_dtype; copy_ casts anything else",
               f"{S_WNA16}.create_weights: scales are params_dtype; copy_ casts anything else"),
         "store weight_scale in the model dtype (config torch_dtype)"),
    Rule("scale-shape", f"weight_scale [out, in/{GROUP}]",
         _both(f"{V_WNA16}.create_weights: scale (E, in // group_size, out), filled by copy_",
               f"{S_WNA16}.create_weights: scale (E, in // group_size, out), filled by copy_"),
         f"store weight_scale as [out, in/{GROUP}]"),
    Rule("expert-names", "experts named experts.E.w1/w2/w3 or gate_proj/up_proj/down_proj",
         _both(f"{V_LAYER}.make_expert_params_mapping: 'experts.{{E}}.{{ckpt name}}.'; "
               f"models/kimi_linear.py maps w1/w2/w3",
               f"{S_LAYER}.make_expert_params_mapping; models/kimi_linear.py maps w1/w2/w3"),
         "name routed experts <layer>.experts.E.w1 (gate), .w3 (up), .w2 (down)"),
    Rule("expert-shapes", "every expert of a layer has gate, up, down of one shape",
         _both(f"{V_LAYER}._load_w13/_load_w2: one (E, ...) param per layer, narrow + copy_",
               f"{S_LAYER}._load_w13/_load_w2: one (E, ...) param per layer, narrow + copy_"),
         "give every expert w1, w3 [inter, hidden] and w2 [hidden, inter], the same in each layer"),
    Rule("hidden-group", f"expert hidden size a multiple of {GROUP}",
         _both(f"{V_MARLIN}: hidden_size % group_size -> ValueError; {V_WNA16}: hidden_size // group_size",
               f"{S_WNA16}.create_weights: num_groups_w13 = hidden_size // group_size"),
         f"the experts' hidden (input) size must be a multiple of {GROUP}"),
    Rule("tp-intermediate", f"intermediate size divisible by TP, per-rank size a multiple of {GROUP}",
         _both(f"{V_LAYER}: assert intermediate_size % tp_size == 0; {V_MARLIN}: "
               f"intermediate_size_per_partition % group_size -> ValueError",
               f"{S_LAYER}: assert intermediate_size % moe_tp_size == 0; {S_WNA16}: "
               f"num_groups_w2 = intermediate_size_per_partition // group_size"),
         "use a TP size that fits, or expert parallelism (which does not split experts)"),
    Rule("config-sizes", "config's MoE sizes match the tensors",
         _both("the server sizes (E, ...) params from config, then copy_ the tensors into them",
               "the server sizes (E, ...) params from config, then copy_ the tensors into them"),
         "make config moe_intermediate_size / routed_expert_hidden_size (or hidden_size) match the tensors"),
)}


@dataclass(frozen=True)
class RuleResult:
    """The outcome of one rule. ``message``: for a failure, one line naming the rule and the fix."""

    rule: str
    ok: bool
    message: str


@dataclass(frozen=True)
class _Matrix:
    """A quantized module as its headers describe it."""

    module: str
    packed: TensorInfo
    scale: TensorInfo | None

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
                         *_size_problems(sizes, config, tp)]:
        found[rid].append(problem)
    return [_result(RULES[rid], server, problems) for rid, problems in found.items()]


def _result(rule: Rule, server: str, problems: list[str]) -> RuleResult:
    if not problems:
        return RuleResult(rule.id, True, f"rule {rule.id}: {rule.what}")
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
    return [_Matrix(n[: -len(suffix)], info, tensors.get(n[: -len(suffix)] + "." + SCALE))
            for n, info in sorted(tensors.items()) if n.endswith(suffix)]


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
           for m in mats if _parse(m.module) is None]
    schemes = Counter(next(s for s, names in SCHEMES.items() if p[2] in names)
                      for p in map(_parse, (m.module for m in mats)) if p)
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
        p = _parse(m.module)
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


# ------------------------------------------------------------------------ for `verify`

def serving_check(config: dict | None, tensors: Mapping[str, TensorInfo], server: str, tp: int) -> Check:
    """The rules as one ``verify`` Check named "serving" (one problem line per failed rule)."""
    from .verify import Check  # verify imports this module lazily: no import cycle

    results = evaluate(config, tensors, server, tp)
    c = Check("serving", f"{server} int4 W4A16 MoE path at --tp {tp}: "
                         f"{sum(r.ok for r in results)}/{len(results)} rules pass")
    for r in results:
        if not r.ok:
            c.fail(r.message)
    return c
