"""auto-round's own format (``quant_method: "auto-round"``) with MXFP4 weights, as auto-round 0.16.1 writes it.

``quantize_and_save(format="auto_round")`` with an ``mx_fp`` scheme goes to
``export_to_autoround/export_to_nvfp_mx.py`` ``save_quantized_as_fp`` (chosen in
``export/formats/backends/autoround.py`` 200-207), which writes ``packing_format
"auto_round:llm_compressor"``, auto-round's own scheme keys (``bits``, ``group_size``, ``data_type``,
``sym``, ``act_*``) and per-layer overrides in ``extra_config`` (177-250). Its tensors are the same
bytes as compressed-tensors' ``mxfp4-pack-quantized``: ``X.weight_packed`` uint8, element 2j in the low
nibble (``qlinear_fp.py`` 234-264), ``X.weight_scale`` uint8 = shared exponent + 127 (171). Which
Linear holds what follows auto-round's loader (``inference/convert_model.py`` ``get_layer_config``
263-404): an ``extra_config`` key that names a module exactly applies to it, any other key is a regex
searched in the name (first in file order wins), and a module under ``block_name_to_quantize`` that no
key names takes the block's own scheme. docs/mxfp4_dialects.md §10.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import BadInput
from .dialect import (
    DEFAULT_RULE,
    PACKED,
    Dialect,
    MXFP4Source,
    dotted,
    drop_or_refuse,
    int4_block,
    int4_targets,
    quant_blocks,
    register,
)
from .json_input import MapOf, Nullable, type_problems

QUANT_METHOD = "auto-round"
PACKING_FORMAT = "auto_round:llm_compressor"   # save_quantized_as_fp's backend for mx_fp and nv_fp (autoround.py 207)
# QuantizationScheme's fields (auto_round/schemes.py) that a layer config may override
SCHEME_KEYS = ("bits", "group_size", "sym", "data_type", "act_bits", "act_group_size", "act_sym",
               "act_data_type", "act_dynamic")
DEFAULTS = {"sym": True, "act_bits": 16}       # QuantizationScheme's defaults where the config omits a key
# keys that change what the weights mean at run time, or quantize what a W4A16 output cannot carry
_TRANSFORMS = ("rotation_config",)
_KV_OR_ATTENTION = ("static_kv_dtype", "static_attention_dtype")
ACTIVATION_TENSORS = (".input_global_scale", ".input_scale")   # static activation scales (qlinear_fp.py 123-130)

_SCHEME = {"bits": int, "group_size": Nullable(int), "sym": Nullable(bool), "data_type": Nullable(str),
           "act_bits": Nullable(int), "act_group_size": Nullable(int), "act_sym": Nullable(bool),
           "act_data_type": Nullable(str), "act_dynamic": Nullable(bool)}
BLOCK_TYPES = {**_SCHEME, "packing_format": Nullable(str), "block_name_to_quantize": Nullable(str),
               "extra_config": Nullable(MapOf({k: Nullable(v.spec if isinstance(v, Nullable) else v)
                                               for k, v in _SCHEME.items()}))}


def _is_mxfp4(cfg: dict) -> bool:
    """A resolved layer scheme that auto-round packs as MXFP4 (qlinear_fp.py: ``is_mx_fp`` and 4 bits)."""
    return cfg.get("bits") == 4 and "mx_fp" in str(cfg.get("data_type") or "").lower() \
        and cfg.get("group_size") == 32 and cfg.get("sym", True) is True


def _is_nvfp4(cfg: dict) -> bool:
    """A resolved layer scheme that auto-round packs as NVFP4 (qlinear_fp.py 154-162: ``is_nv_fp``, 4 bits, 16s)."""
    return cfg.get("bits") == 4 and "nv_fp" in str(cfg.get("data_type") or "").lower() \
        and cfg.get("group_size") == 16 and cfg.get("sym", True) is True


WEIGHT_KINDS = {"MXFP4": _is_mxfp4, "NVFP4": _is_nvfp4}   # what a source of each kind converts


def _quantized(cfg: dict) -> bool:
    return isinstance(cfg.get("bits"), int) and cfg["bits"] < 16


@dataclass(frozen=True)
class AutoRoundSource(MXFP4Source):
    """auto-round's scheme and its per-layer overrides, resolved per module as its loader does."""

    default: dict = field(default_factory=dict)
    block_names: tuple[str, ...] = ()
    extra: tuple[tuple[str, dict], ...] = ()     # extra_config, file order
    exact: frozenset[str] = frozenset()          # its keys that name a module of the checkpoint
    kind: str = "MXFP4"                          # the weights converted: a key of WEIGHT_KINDS

    def config_for(self, module: str) -> dict | None:
        """The module's scheme (None: auto-round leaves it unquantized)."""
        cfg = dict(self.extra).get(module) if module in self.exact else None
        if cfg is None:
            cfg = next((c for k, c in self.extra if k not in self.exact and _search(k, module)), None)
        in_block = any(module.startswith(b) for b in self.block_names)
        if cfg is None and not in_block:
            return None
        return {**self.default, **{k: v for k, v in (cfg or {}).items() if v is not None}}

    def selects(self, module: str) -> bool:
        cfg = self.config_for(module)
        return cfg is not None and WEIGHT_KINDS[self.kind](cfg)

    def seen(self, tensors: Any) -> "AutoRoundSource":
        """The checkpoint's module names tell which ``extra_config`` keys are exact names (auto-round's
        ``_expand_regex_config``: a key that is no layer's name is a regex)."""
        modules = {n.rsplit(".", 1)[0] for n in tensors}
        return replace(self, exact=frozenset(k for k, _ in self.extra if k in modules))

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str],
                    rule: str = DEFAULT_RULE) -> dict:
        """The auto-round block replaced by compressed-tensors int4 whose targets and ignore select
        exactly the converted modules, under the checkpoint's names and vLLM's (``int4_targets``)."""
        block = int4_block(*int4_targets(converted, unconverted), rule=rule)
        return self.rewrite(config, lambda _old: copy.deepcopy(block))


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:   # auto-round skips an invalid regex silently (inference/utils.py 42-46)
        return False


def _problems(block: dict, where: str, drop: bool, dropped: list[dict], kind: str = "MXFP4") -> list[str]:
    out = []
    fmt = block.get("packing_format")
    if fmt != PACKING_FORMAT:
        out.append(f"{where}.packing_format is {fmt!r}: k3convert reads auto-round's {kind} export "
                   f"({PACKING_FORMAT!r}); other packings hold other layouts")
    for key in _TRANSFORMS:
        if block.get(key):
            out.append(f"{where}.{key} is set: the weights are rotated and a server must undo it at run time; "
                       "an int4 output cannot carry it")
    for key in _KV_OR_ATTENTION:
        if block.get(key):
            drop_or_refuse(f"{where}.{key}", block[key], f"the KV cache or attention ({block[key]})", drop, dropped,
                           out)
    default = {**DEFAULTS, **{k: block[k] for k in SCHEME_KEYS if block.get(k) is not None}}
    layers = [(where, default)] + [(f"{where}.extra_config[{k!r}]", {**default, **{a: b for a, b in c.items()
                                                                                  if b is not None}})
                                   for k, c in (block.get("extra_config") or {}).items()]
    for at, cfg in layers:
        if _quantized(cfg) and not WEIGHT_KINDS[kind](cfg):
            out.append(f"{at} quantizes weights as {cfg.get('bits')}-bit {cfg.get('data_type')} group "
                       f"{cfg.get('group_size')}: only {kind} weights (and unquantized modules) are converted")
            continue
        act = {k: cfg.get(k) for k in SCHEME_KEYS if k.startswith("act_")}
        if _quantized(cfg) and isinstance(act.get("act_bits"), int) and act["act_bits"] < 16:
            what = (f"input activations ({act['act_bits']}-bit {act.get('act_data_type')}, group "
                    f"{act.get('act_group_size')}, {'dynamic' if act.get('act_dynamic') else 'static'})")
            drop_or_refuse(at, act, what, drop, dropped, out)
    return out


def auto_round_source(config: dict, config_path: str, drop: bool = False, kind: str = "MXFP4") -> AutoRoundSource:
    """The auto-round description of the source whose ``kind`` weights convert, or one refusal naming
    every problem."""
    blocks = [(p, b) for p, b in quant_blocks(config) if b.get("quant_method") == QUANT_METHOD]
    if len(blocks) != 1:
        raise BadInput(f"{len(blocks)} auto-round quantization_config blocks: expected one", file=config_path)
    path, block = blocks[0]
    where = dotted(path)
    dropped: list[dict] = []
    problems = type_problems(block, BLOCK_TYPES, where) or _problems(block, where, drop, dropped, kind)
    if problems:
        raise BadInput("; ".join(problems), file=config_path)
    names = block.get("block_name_to_quantize")
    default = {**DEFAULTS, **{k: block[k] for k in SCHEME_KEYS if block.get(k) is not None}}
    return AutoRoundSource(
        dialect="auto-round", blocks=(path,), packed_suffix=PACKED,
        scale_note="OCP E8M0 (bias 127; auto-round's own packer, qlinear_fp.py 171: exponent + 127)",
        dropped=tuple(dropped), dropped_tensors=ACTIVATION_TENSORS if dropped else (),
        default=default, block_names=tuple(n for n in (names or "").split(",") if n),
        extra=tuple((k, dict(v)) for k, v in (block.get("extra_config") or {}).items()), kind=kind)


def is_auto_round_mxfp4(block: dict) -> bool:
    """Whether an auto-round block's own scheme is MXFP4 (its reader names any field that disagrees)."""
    return block.get("quant_method") == QUANT_METHOD and "mx_fp" in str(block.get("data_type") or "").lower() \
        and block.get("bits") == 4


register(Dialect(QUANT_METHOD, lambda b: b.get("quant_method") == QUANT_METHOD, is_auto_round_mxfp4,
                 auto_round_source))
