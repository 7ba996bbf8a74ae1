"""AMD Quark MXFP4 exports (``quant_method: "quark"``), as amd-quark 0.13 writes them.

An MXFP4 Linear ``X`` is ``X.weight`` uint8 ``[out, in/2]`` (element 2j in the low nibble, as
in OCP) and ``X.weight_scale`` uint8 ``[out, in/32]`` (E8M0, bias 127): the same bytes as
compressed-tensors', under other names. Which modules are MXFP4 follows Quark's own
precedence: ``exclude``, then the first ``layer_quant_config`` pattern that matches (fnmatch,
in file order), then ``layer_type_quant_config["Linear"]``, then the global config.
docs/quark.md has the evidence for every fact used here.
"""
from __future__ import annotations

import copy
import fnmatch
import json
from dataclasses import dataclass
from typing import Any

from ..errors import BadInput
from .dialect import (
    DEFAULT_RULE,
    Dialect,
    MXFP4Source,
    dotted,
    drop_or_refuse,
    int4_block,
    int4_targets,
    quant_blocks,
    register,
)
from .json_input import ListOf, MapOf, Nullable, type_problems

# per-module tensors that serve only activation / KV-cache quantization
ACTIVATION_TENSORS = (".input_scale", ".output_scale", ".input_zero_point", ".output_zero_point")
_ONLINE_TRANSFORMS = ("rotation", "quarot", "spinquant", "hadamard")  # need kernels a W4A16 server lacks


# the types of the fields read below (a layer config's specs are checked by is_mxfp4_spec/_spec)
QUARK_BLOCK_TYPES = {"exclude": Nullable(ListOf(str)), "export": Nullable(dict), "global_quant_config": Nullable(dict),
                     "layer_quant_config": Nullable(MapOf(dict)), "layer_type_quant_config": Nullable(MapOf(dict)),
                     "kv_cache_quant_config": Nullable(dict), "algo_config": Nullable(dict)}


def is_mxfp4_spec(spec: Any) -> bool:
    """OCP MX FP4: fp4 elements in groups of 32 along the input, with E8M0 scales."""
    return isinstance(spec, dict) and spec.get("dtype") == "fp4" and spec.get("qscheme") == "per_group" \
        and spec.get("group_size") == 32 and spec.get("scale_format") == "e8m0" \
        and spec.get("mx_element_dtype") is None


@dataclass(frozen=True)
class QuarkSource(MXFP4Source):
    """Quark's layer configs, in its precedence order, to tell which Linear is MXFP4."""

    exclude: tuple[str, ...] = ()
    layer_configs: tuple[tuple[str, dict], ...] = ()   # layer_quant_config, file order
    linear_config: dict | None = None                  # layer_type_quant_config["Linear"]
    global_config: dict | None = None

    def config_for(self, module: str) -> dict | None:
        if any(fnmatch.fnmatchcase(module, p) for p in self.exclude):
            return None
        for pattern, cfg in self.layer_configs:
            if fnmatch.fnmatchcase(module, pattern):
                return cfg
        return self.linear_config or self.global_config

    def selects(self, module: str) -> bool:
        cfg = self.config_for(module)
        return cfg is not None and is_mxfp4_spec(cfg.get("weight"))

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str],
                    rule: str = DEFAULT_RULE) -> dict:
        """The Quark block replaced by compressed-tensors int4 whose targets and ignore select
        exactly the converted modules, under the checkpoint's names and vLLM's (``int4_targets``)."""
        block = int4_block(*int4_targets(converted, unconverted), rule=rule)
        return self.rewrite(config, lambda _old: copy.deepcopy(block))


def _layer_configs(block: dict) -> list[tuple[str, dict]]:
    """Every layer config of the block with where it sits, for the checks below."""
    found = [("global_quant_config", block.get("global_quant_config"))]
    found += [(f"layer_quant_config[{k!r}]", v) for k, v in (block.get("layer_quant_config") or {}).items()]
    found += [(f"layer_type_quant_config[{k!r}]", v) for k, v in (block.get("layer_type_quant_config") or {}).items()]
    return [(w, c) for w, c in found if c]


def _problems(block: dict, where: str, drop: bool, dropped: list[dict]) -> list[str]:
    out = []
    fmt = (block.get("export") or {}).get("weight_format", "real_quantized")
    if fmt != "real_quantized":
        out.append(f"{where}.export.weight_format is {fmt!r}: only 'real_quantized' exports hold MXFP4 bytes")
    for at, cfg in _layer_configs(block):
        w = cfg.get("weight")
        if w is not None and not is_mxfp4_spec(w):
            out.append(f"{where}.{at} quantizes weights as {_spec(w)}: only MXFP4 weights (and unquantized "
                       "modules) are converted")
        if cfg.get("bias") is not None:
            out.append(f"{where}.{at} quantizes the bias: an int4 output cannot carry it")
        for kind in ("input_tensors", "output_tensors"):
            if cfg.get(kind) is not None:
                _drop_or_refuse(f"{where}.{at}.{kind}", cfg[kind], drop, dropped, out)
    for key in ("kv_cache_quant_config", "softmax_quant_spec"):
        if block.get(key):
            _drop_or_refuse(f"{where}.{key}", block[key], drop, dropped, out)
    algo = json.dumps(block.get("algo_config") or "").lower()
    if any(t in algo for t in _ONLINE_TRANSFORMS):
        out.append(f"{where}.algo_config applies a rotation that a server must undo at run time: not converted")
    return out


def _spec(spec: Any) -> str:
    if isinstance(spec, list):
        return "several specs (two-level quantization)"
    if spec and "dtype" not in spec:  # kv_cache_quant_config: {pattern: layer config}
        return ", ".join(f"{p}: {_spec(c.get('output_tensors') or {})}" for p, c in spec.items())
    group = f" group {spec['group_size']}" if spec.get("group_size") else ""
    return f"{spec.get('dtype')} {spec.get('qscheme')}" + group


def _drop_or_refuse(where: str, spec: Any, drop: bool, dropped: list[dict], problems: list[str]) -> None:
    what = _spec(spec) if isinstance(spec, (dict, list)) else str(spec)
    drop_or_refuse(where, spec, f"activations or the KV cache ({what})", drop, dropped, problems)


def quark_source(config: dict, config_path: str, drop: bool = False) -> QuarkSource:
    """The Quark MXFP4 description of the source, or one refusal naming every problem."""
    blocks = [(p, b) for p, b in quant_blocks(config) if b.get("quant_method") == "quark"]
    if len(blocks) != 1:
        raise BadInput(f"{len(blocks)} Quark quantization_config blocks: expected one", file=config_path)
    path, block = blocks[0]
    dropped: list[dict] = []
    problems = type_problems(block, QUARK_BLOCK_TYPES, dotted(path)) or _problems(block, dotted(path), drop, dropped)
    if problems:
        raise BadInput("; ".join(problems), file=config_path)
    linear = (block.get("layer_type_quant_config") or {}).get("Linear")
    return QuarkSource(
        dialect="quark", blocks=(path,), packed_suffix="weight", scale_note="OCP E8M0 (bias 127; Quark)",
        dropped=tuple(dropped), dropped_tensors=ACTIVATION_TENSORS if dropped else (),
        exclude=tuple(block.get("exclude") or ()), layer_configs=tuple((block.get("layer_quant_config") or {}).items()),
        linear_config=linear, global_config=block.get("global_quant_config"))


def is_quark_mxfp4(block: dict) -> bool:
    """Whether a Quark block quantizes some weights as fp4."""
    return "fp4" in json.dumps(block.get("global_quant_config") or block.get("layer_quant_config") or {})


register(Dialect("quark", lambda b: b.get("quant_method") == "quark", is_quark_mxfp4, quark_source))
