"""The Hugging Face checkpoint directory: config.json, the shard index, the other files.

What converts is decided here from the source's own quantization config (targets, ignore)
and the tensors present, never from hard-coded names (SPEC §1, §3).
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import BadInput

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SITU_FIELDS = ("hidden_act", "activation_situ_beta", "activation_situ_linear_beta")
MXFP4_FORMAT = "mxfp4-pack-quantized"


def load_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise BadInput("missing", file=path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"not valid JSON ({e})", file=path) from None
    if not isinstance(obj, dict):
        raise BadInput("expected a JSON object", file=path)
    return obj


def quant_blocks(config: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict]]:
    """Every ``quantization_config`` in the config, with its key path (top-level and nested)."""
    found = []
    for key, value in config.items():
        if key == "quantization_config" and isinstance(value, dict):
            found.append((path + (key,), value))
        elif isinstance(value, dict):
            found.extend(quant_blocks(value, path + (key,)))
    return found


def _weights_args(block: dict) -> list[dict]:
    groups = block.get("config_groups") or {}
    return [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]


def is_mxfp4(block: dict) -> bool:
    """compressed-tensors MXFP4: 4-bit float weights in groups of 32 with E8M0 scales."""
    if block.get("quant_method") != "compressed-tensors":
        return False
    groups = (block.get("config_groups") or {}).values()
    fmt_ok = block.get("format") == MXFP4_FORMAT or any(
        isinstance(g, dict) and g.get("format") == MXFP4_FORMAT for g in groups)
    return fmt_ok and any(
        w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == 32
        for w in _weights_args(block))


@dataclass(frozen=True)
class SourceQuant:
    """What the source's quantization config says about the MXFP4 tensors."""

    paths: tuple[tuple[str, ...], ...]  # where MXFP4 blocks sit in config.json
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def selects(self, module: str) -> bool:
        """compressed-tensors semantics: ``re:`` patterns match from the start; other
        targets are exact names or layer class names (which any packed module satisfies)."""
        if any(_matches(module, p) for p in self.ignore):
            return False
        return any(not p.startswith("re:") and p[:1].isupper() or _matches(module, p) for p in self.targets)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def source_quant(config: dict, config_path: str) -> SourceQuant:
    """The MXFP4 description of the source, or a clear refusal."""
    blocks = quant_blocks(config)
    if not blocks:
        raise BadInput("no quantization_config (top-level or nested): not an MXFP4 checkpoint", file=config_path)
    mx = [(p, b) for p, b in blocks if is_mxfp4(b)]
    if not mx:
        p, b = blocks[0]
        raise BadInput(
            f"{'.'.join(p)} says quant_method={b.get('quant_method')!r}, format={b.get('format')!r}: "
            f"only compressed-tensors {MXFP4_FORMAT} (4-bit float, group 32) is converted",
            file=config_path)
    targets, ignore = [], []
    for _, b in mx:
        for g in (b.get("config_groups") or {}).values():
            targets += [t for t in g.get("targets", []) if t not in targets]
        ignore += [i for i in b.get("ignore", []) if i not in ignore]
    return SourceQuant(tuple(p for p, _ in mx), tuple(targets) or ("Linear",), tuple(ignore))


def activation_fields(config: dict) -> dict[str, tuple[Any, str]]:
    """Each activation field present: (value, "text_config" or "top-level"), nested first."""
    found = {}
    for key in SITU_FIELDS:
        for where, scope in (("text_config", config.get("text_config") or {}), ("top-level", config)):
            if key in scope:
                found[key] = (scope[key], where)
                break
    return found


def activation(config: dict, config_path: str) -> dict[str, Any]:
    """The expert activation and its parameters (SPEC §4), from text_config or top level.

    Refuses a checkpoint whose activation cannot be stated: a kernel that assumes SiLU
    would load the result fine and produce garbage.
    """
    act = {key: value for key, (value, _) in activation_fields(config).items()}
    if "hidden_act" not in act:
        raise BadInput("no hidden_act in text_config or at top level: cannot state the expert activation",
                       file=config_path)
    if act["hidden_act"] == "situ":
        missing = [k for k in SITU_FIELDS[1:] if k not in act]
        if missing:
            raise BadInput(f"hidden_act is 'situ' but {', '.join(missing)} missing", file=config_path)
    return act


def int4_block(source_block: dict, quant: SourceQuant) -> dict:
    """The compressed-tensors pack-quantized int4 group-32 block that replaces an MXFP4 one."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": list(quant.targets),
                "format": "pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None, "observer": "minmax",
                },
            }
        },
        "ignore": list(source_block.get("ignore", quant.ignore)),
        "kv_cache_scheme": source_block.get("kv_cache_scheme"),
        **({"version": source_block["version"]} if "version" in source_block else {}),
    }


def int4_config(config: dict, quant: SourceQuant) -> dict:
    """config.json for the output: every MXFP4 block replaced, everything else kept."""
    out = copy.deepcopy(config)
    for path in quant.paths:
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = int4_block(parent[path[-1]], quant)
    return out


def weight_map(src: str) -> dict[str, str]:
    """tensor name -> shard file, from the index (or the single-file checkpoint)."""
    index = os.path.join(src, INDEX)
    if os.path.exists(index):
        wm = load_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise BadInput("no weight_map", file=index)
        return wm
    single = os.path.join(src, SINGLE)
    if os.path.exists(single):
        from .safetensors_io import read_header
        return {name: SINGLE for name in read_header(single).tensors}
    raise BadInput(f"neither {INDEX} nor {SINGLE} found", file=src)
