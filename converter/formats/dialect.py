"""What every MXFP4 source dialect shares, and the registry that names them.

Each dialect (compressed-tensors, Quark) is one module under ``formats/`` that registers a
:class:`Dialect` by name; a profile's ``source`` names the dialect that reads it. The
dialect modules import this one and never each other, the way compressed-tensors keeps its
formats apart.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from ..errors import BadInput
from ..quant.rules import DEFAULT as DEFAULT_RULE, RULE_KEY, ScaleRule
from .match import match_name

MXFP4_FORMAT = "mxfp4-pack-quantized"
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
DROP_FLAG = "--drop-activation-quant"
# what the manifest and report say DST holds (the int4 block below); verify expects exactly this
TARGET_FORMAT = "compressed-tensors pack-quantized int4 group 32 symmetric, bf16 scales"


def quant_blocks(config: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    """Every ``quantization_config`` in the config, with its key path (top-level and nested)."""
    found = []
    for key, value in config.items():
        if key == "quantization_config" and isinstance(value, dict):
            found.append((path + (key,), value))
        elif isinstance(value, dict):
            found.extend(quant_blocks(value, path + (key,)))
    return found


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


# ---------------------------------------------------------------------------- the source

@dataclass(frozen=True)
class MXFP4Source:
    """How a checkpoint stores its MXFP4 linears, which ones, and what else its config says.

    ``packed_suffix``/``scale_suffix`` name a module's two tensors; ``scale_bias`` is the
    exponent bias of the stored E8M0 bytes (127 in OCP; compressed-tensors 0.13.0 wrote 125);
    ``dropped`` lists what ``--drop-activation-quant`` removed, verbatim, for the record.
    """

    dialect: str
    blocks: tuple[tuple[str, ...], ...]   # where the MXFP4 quantization_config blocks sit
    packed_suffix: str
    scale_suffix: str = SCALE
    scale_bias: int = 127
    scale_note: str = "OCP E8M0 (bias 127)"
    dropped: tuple[dict, ...] = ()
    dropped_tensors: tuple[str, ...] = ()  # tensor-name suffixes that only served dropped parts
    # (source suffix, output suffix) of copied tensors whose name the output's config reads
    # differently (MiMo's FP8 weight_scale_inv -> compressed-tensors' weight_scale); bytes unchanged
    renames: tuple[tuple[str, str], ...] = ()

    def selects(self, module: str) -> bool:
        raise NotImplementedError

    fp4: ClassVar[str] = "MXFP4"   # the FP4 kind (``inspect`` shows it beside ``writer``)

    @property
    def writer(self) -> str:
        """Who wrote the source's layout."""
        return self.dialect

    @property
    def source_format(self) -> str:
        """What the manifest and report say the source holds (``checkpoint.source_format`` reads it back)."""
        return format_name(self.writer, self.fp4)

    @property
    def scale_rules(self) -> tuple[ScaleRule, ...]:
        """The --scale-rule values this source converts under (every one: MXFP4 groups are exact)."""
        return tuple(ScaleRule)

    @property
    def restated_files(self) -> tuple[str, ...]:
        """Side files that only describe the source's quantization: not copied (config.json's int4 block
        is DST's one description)."""
        return ()

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str],
                    rule: str = DEFAULT_RULE) -> dict:
        """``config`` with each MXFP4 block replaced by :func:`int4_block` (written with ``rule``), through
        :meth:`rewrite`."""
        raise NotImplementedError

    def packs(self, name: str, dtype: str) -> bool:
        """Whether a tensor (name, safetensors dtype) is one of the source's packed FP4 tensors: its packed
        suffix, and U8 where that suffix is a plain ``weight`` (Quark, ModelOpt: a bf16 X.weight is unquantized).
        The pairing and ``inspect`` count by it."""
        return name.endswith("." + self.packed_suffix) and (self.packed_suffix != "weight" or dtype == "U8")

    def states(self, block: dict) -> bool:
        """Whether a quantization_config block states this source's quantization (its dialect claims it)."""
        return DIALECTS[self.dialect].claims(block)

    def rewrite(self, config: dict, make: Callable[[dict], dict]) -> dict:
        """``config`` with every statement of the source's quantization replaced by ``make(old)``: the blocks
        the reader read and any other block that :meth:`states` it, wherever a quantization_config sits (top
        level, text_config, ...). One left behind would describe DST's int4 tensors as the source's FP4."""
        paths = list(self.blocks) + [p for p, b in quant_blocks(config) if p not in self.blocks and self.states(b)]
        return with_blocks(config, paths, make)

    def record(self) -> dict[str, Any]:
        """What the manifest and report say about the source's quantization."""
        return {"dialect": self.dialect, "blocks": [dotted(p) for p in self.blocks],
                "packed_suffix": self.packed_suffix, "scale_bias": self.scale_bias,
                **({"scale_suffix": self.scale_suffix} if self.scale_suffix != SCALE else {}),
                "scale_convention": self.scale_note, "dropped": list(self.dropped),
                **({"renamed": [list(r) for r in self.renames]} if self.renames else {})}

    def tensor_problems(self, tensors: Any) -> list[str]:
        """What the dialect refuses in the checkpoint's tensors beyond the MXFP4 pairs (name -> TensorInfo),
        one line each naming file and tensor; the dialects that pass other quantized tensors through check them."""
        return []

    def seen(self, tensors: Any) -> "MXFP4Source":
        """This source, told the checkpoint's tensor names (a dialect whose config depends on them
        returns a copy that records what it needs)."""
        return self

    def out_name(self, name: str) -> str:
        """A copied tensor's name in DST (``renames``), else its own."""
        for old, new in self.renames:
            if name.endswith(old):
                return name[: -len(old)] + new
        return name


def format_name(writer: str, fp4: str) -> str:
    """``source_format``: the layout's writer, then the FP4 kind."""
    return f"{writer} {fp4}"


def mxfp4_format(dialect: str) -> str:
    """``source_format`` of an MXFP4 source of ``dialect``."""
    return format_name(dialect, MXFP4Source.fp4)


def source_name(name: str, renames: Any) -> str:
    """The source tensor a DST tensor was copied from: the inverse of ``MXFP4Source.out_name`` for
    the (source suffix, output suffix) pairs the manifest records."""
    for old, new in renames:
        if name.endswith(new) and not name.endswith(old):
            return name[: -len(new)] + old
    return name


def int4_weights() -> dict[str, Any]:
    return {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False, "actorder": None, "observer": "minmax"}


# A routed expert under every name a loader gives it: the checkpoint's (experts.E.w1|w2|w3 or
# gate_proj|up_proj|down_proj) and vLLM's, which asks for the scheme of <layer>.experts.0.gate_proj|
# up_proj|down_proj whatever the checkpoint calls them (docs/serving.md, "Names").
EXPERT_TARGET = r"re:.*\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"
VLLM_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def vllm_lookup_name(expert_module: str) -> str:
    """The name vLLM's compressed-tensors MoE method asks the scheme of, for a layer's experts."""
    head, proj = expert_module.rsplit(".", 1)
    layer = head.rsplit(".", 1)[0]
    return f"{layer}.0.{VLLM_PROJ.get(proj, proj)}"


def int4_targets(converted: list[str], kept: list[str], inherited_ignore: Sequence[str] = ()
                 ) -> tuple[list[str], list[str]]:
    """targets and ignore that select exactly the converted modules, both for compressed-tensors
    on the checkpoint's names and for vLLM on its own (fused layers, MTP, vLLM's expert names):
    routed experts by one pattern, any other converted module by exact name, never a class name.
    The source's ignore entries are kept unless one would catch a converted layer's experts under
    vLLM's name; kept experts the pattern catches are ignored under both names."""
    experts = [m for m in converted if match_name(m, EXPERT_TARGET)]
    others = sorted(set(converted) - set(experts))
    lookups = {vllm_lookup_name(m) for m in experts}
    ignore = [p for p in inherited_ignore if not any(match_name(n, p) for n in lookups)]
    kept_experts = [m for m in kept if match_name(m, EXPERT_TARGET)]
    ignore += sorted({*kept_experts, *(vllm_lookup_name(m) for m in kept_experts)} - set(ignore))
    return ([EXPERT_TARGET] if experts else []) + others, ignore


def with_blocks(config: dict, paths: Sequence[tuple[str, ...]], make: Callable[[dict], dict]) -> dict:
    """A copy of ``config`` whose quantization blocks at ``paths`` are ``make(old block)``: how every
    dialect writes the output's config (the rest of config.json kept as it is)."""
    out = copy.deepcopy(config)
    for path in paths:
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = make(parent[path[-1]])
    return out


def int4_block(targets: list[str], ignore: list[str], keep: dict[str, Any] | None = None,
               rule: str = DEFAULT_RULE) -> dict:
    """The compressed-tensors pack-quantized int4 group-32 block that replaces an MXFP4 one; it names
    the scale rule that wrote the codes (``RULE_KEY``), for ``inspect`` and ``verify``."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": list(targets), "format": "pack-quantized",
            "input_activations": None, "output_activations": None, "weights": int4_weights(),
        }},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        **(keep or {}),
        RULE_KEY: rule,
    }


FP8_BLOCK_FORMAT = "float-quantized"


def fp8_block_group(targets: list[str], block: list[int]) -> dict:
    """The compressed-tensors group that describes FP8 block-quantized linears passed through as
    they are (llm-compressor's FP8_BLOCK scheme): e4m3 weights with one fp32 scale per block,
    activations quantized at run time per token and group of ``block[1]``."""
    return {"targets": list(targets), "format": FP8_BLOCK_FORMAT,
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                        "block_structure": list(block), "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                  "group_size": block[1], "dynamic": True, "observer": None},
            "output_activations": None}


def is_fp8_block_group(group: Any) -> bool:
    """A group written by :func:`fp8_block_group`: source FP8 linears kept, not int4 experts."""
    w = group.get("weights") if isinstance(group, dict) else None
    return isinstance(w, dict) and group.get("format") == FP8_BLOCK_FORMAT and w.get("num_bits") == 8 \
        and w.get("type") == "float" and w.get("strategy") == "block"


def drop_or_refuse(where: str, spec: Any, what: str, drop: bool, dropped: list[dict], problems: list[str]) -> None:
    """Quantization a weight-only int4 output cannot carry: recorded verbatim when the user
    asked to drop it, else a problem that says how to."""
    if drop:
        dropped.append({"where": where, "what": spec})
    else:
        problems.append(f"{where} quantizes {what}; k3convert writes weight-only int4 (W4A16): "
                        f"pass {DROP_FLAG} to convert anyway")


# ---------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Dialect:
    """One source dialect: which quantization_config blocks are its own, whether one holds
    MXFP4 weights, and the reader that turns the config into an :class:`MXFP4Source`."""

    name: str
    claims: Callable[[dict], bool]                       # the block is written in this dialect
    is_mxfp4: Callable[[dict], bool]                     # ... and quantizes weights as MXFP4
    read: Callable[[dict, str, bool], MXFP4Source]       # (config, config_path, drop) -> source


DIALECTS: dict[str, Dialect] = {}


def register(d: Dialect) -> Dialect:
    DIALECTS[d.name] = d
    return d


def named(name: str, where: str | None = None) -> Dialect:
    """The registered dialect called ``name`` (a profile's ``source``), or BadInput."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise BadInput(f"no MXFP4 dialect named {name!r} (known: {', '.join(sorted(DIALECTS))})",
                       file=where) from None
