"""What a DST says to a server, from config.json and the shard headers only (no tensor data).

The experts as matrices (name, int32 words, scales), their per-layer sizes, and every rule of the
int4 MoE path that depends on the checkpoint alone, not on the topology or the server's kernel.
Reading headers only is what makes `verify --serving` take seconds on the 1.5 TB model.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from ..errors import BadInput
from ..formats import checkpoint as ckpt, match
from ..formats.checkpoint import PACKED, SCALE
from ..formats.dialect import is_fp8_block_group
from ..formats.safetensors_io import TensorInfo, read_header
from ..releases import Family, all_kimi_model_types

BITS = 4
GROUP = 32                       # k3convert's target; see rule group-size
PACK = 32 // BITS                # int4 values per int32 word
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
DEFAULT_DTYPE = "bfloat16"       # what the servers use when config states none (and K3 ships)
# model types whose server loader maps experts.E.w1/w2/w3 only (vLLM and SGLang kimi_linear, every Kimi K3)
W123_MODELS = ("kimi_linear", *all_kimi_model_types())
SCHEMES = {"w123": ("w1", "w3", "w2"), "proj": ("gate_proj", "up_proj", "down_proj")}
ROLE = {name: role for names in SCHEMES.values() for name, role in zip(names, ("gate", "up", "down"))}
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
# the experts' module class each server matches class-name targets against ("Linear" is mapped onto it)
MOE_CLASS = {Family.VLLM: "RoutedExperts", Family.SGLANG: "FusedMoE"}


@dataclass(frozen=True)
class Matrix:
    """A quantized module as its headers describe it."""

    module: str
    packed: TensorInfo
    scale: TensorInfo | None
    expert: tuple[str, int, str] | None = None   # parse(module), parsed once

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


def config_problems(config: dict | None) -> list[tuple[str, str]]:
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


def matrices(tensors: Mapping[str, TensorInfo]) -> list[Matrix]:
    """Every module with a weight_packed, sorted by name."""
    suffix = "." + PACKED
    return [Matrix(m, info, tensors.get(m + "." + SCALE), parse(m))
            for n, info in sorted(tensors.items()) if n.endswith(suffix) for m in (n[: -len(suffix)],)]


def tensor_problems(mats: list[Matrix], dtype: str) -> list[tuple[str, str]]:
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



def parse(module: str) -> tuple[str, int, str] | None:
    """(layer prefix, expert id, projection name) for a routed-expert module name."""
    m = _EXPERT.match(module)
    return (m["layer"], int(m["e"]), m["proj"]) if m and m["proj"] in ROLE else None


def nonzero_values(value: object) -> list[float]:
    """The distinct non-zero numbers of a config value (a number, or a per-layer list with nulls)."""
    values = value if isinstance(value, list) else [value]
    return sorted({float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v})


def model_types(config: dict | None) -> set[str]:
    config = config or {}
    return {str(t) for t in (config.get("model_type"), (config.get("text_config") or {}).get("model_type")) if t}


def name_problems(mats: list[Matrix], config: dict | None) -> list[tuple[str, str]]:
    if not mats:
        return [("expert-names", "no quantized expert matrices (no *.weight_packed tensors)")]
    out = [("expert-names", f"{m.module} is quantized but is not named <layer>.experts.E.<w1|w2|w3|"
                            f"gate_proj|up_proj|down_proj>")
           for m in mats if m.expert is None]
    scheme_of = {name: s for s, names in SCHEMES.items() for name in names}
    schemes = Counter(scheme_of[m.expert[2]] for m in mats if m.expert)
    kimi = sorted(model_types(config) & set(W123_MODELS))
    if len(schemes) > 1:
        out.append(("expert-names", f"experts mix w1/w2/w3 ({schemes['w123']}) and gate_proj/up_proj/down_proj "
                                    f"({schemes['proj']}) names; a model's loader maps one"))
    elif kimi and schemes.get("proj"):
        out.append(("expert-names", f"model_type {kimi[0]} loads experts as w1/w2/w3, "
                                    f"but {schemes['proj']} are named gate_proj/up_proj/down_proj"))
    return out


def layer_sizes(mats: list[Matrix]) -> tuple[dict[str, tuple[int, int]], list[str]]:
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


def config_size(config: dict | None, *keys: str) -> tuple[str, int] | None:
    """The first of ``keys`` present in text_config or at top level."""
    config = config or {}
    for key in keys:
        for scope in (config.get("text_config") or {}, config):
            if isinstance(scope.get(key), int):
                return key, scope[key]
    return None


def size_problems(sizes: dict[str, tuple[int, int]], config: dict | None) -> list[tuple[str, str]]:
    """Sizes from the tensor shapes (the truth), checked per distinct (intermediate, hidden)."""
    out = []
    cfg_inter = config_size(config, "moe_intermediate_size")
    # Kimi K3's experts run in a latent space: routed_expert_hidden_size, not hidden_size
    cfg_hidden = config_size(config, "routed_expert_hidden_size", "hidden_size")
    for (inter, hidden), layers in by_size(sizes).items():
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




def by_size(sizes: dict[str, tuple[int, int]]) -> dict[tuple[int, int], list[str]]:
    out: dict[tuple[int, int], list[str]] = {}
    for layer, size in sorted(sizes.items()):
        out.setdefault(size, []).append(layer)
    return out




def fp8_linears(config: dict | None, tensors: Mapping[str, TensorInfo]
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



def lookup_problems(config: dict | None, sizes: Mapping[str, tuple[int, int]], family: Family) -> list[str]:
    """Per MoE layer and compressed-tensors block: the three names the server asks the experts'
    scheme of must all be selected (else unquantized experts, or a mixed-scheme ValueError)."""
    out = []
    for path, block in ckpt.quant_blocks(config or {}):
        if block.get("quant_method") != "compressed-tensors":
            continue
        groups = found if isinstance(found := block.get("config_groups"), dict) else {}
        targets = [t for g in groups.values() if isinstance(g, dict) for t in g.get("targets") or []
                   if isinstance(t, str)]
        ignore = [i for i in block.get("ignore") or [] if isinstance(i, str)]
        for layer in sorted(sizes):
            whys = [match.experts_why_not(f"{layer}.0.{p}", MOE_CLASS[family], targets, ignore)
                    for p in SCHEMES["proj"]]
            short = "…" + layer.rsplit(".", 1)[-1]      # the layer is named in the detail (--verbose)
            if all(whys):
                out.append(f"{ckpt.dotted(path)}: {(whys[0] or '').replace(layer, short)}: the layer's experts load "
                           f"unquantized")
            elif any(whys):
                out.append(f"{ckpt.dotted(path)}: {next(w for w in whys if w).replace(layer, short)}, but not the "
                           f"other projections: mixed schemes, ValueError at load")
    return out


def class_target_note(config: dict | None, family: Family) -> str:
    """A class-name target reaches every layer of that class the ignore list misses, under the
    server's own names (fused layers, the MTP draft's model.layers.N): not provable from the
    checkpoint alone, so said, not failed."""
    classes = sorted({t for _, b in ckpt.quant_blocks(config or {}) for g in (b.get("config_groups") or {}).values()
                      if isinstance(g, dict) for t in g.get("targets") or []
                      if isinstance(t, str) and not t.startswith("re:") and "." not in t})
    if not classes:
        return ""
    return (f"targets {classes} select by class: {family.value} quantizes every such layer its ignore list misses, "
            f"under its own module names (fused layers, the MTP draft); "
            f"tests/vllm_plugin/test_vllm_quant_methods.py shows one that goes wrong")


