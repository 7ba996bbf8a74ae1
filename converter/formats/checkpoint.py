"""The Hugging Face checkpoint directory: config.json, the shard index, which MXFP4 dialect.

What converts is decided from the source's own quantization config, never from hard-coded
names (docs/spec.md §1, §3), by the dialect's own module (compressed_tensors.py, quark.py, registered
in dialect.py); the names they export are re-exported here for the rest of the tool.
Anything the config says that a weight-only int4 output cannot carry (activation
quantization, transforms, sparsity, other formats) is refused, or dropped only behind an
explicit flag and recorded: never changed silently.
"""
from __future__ import annotations

import math
import os
from typing import Any

from ..errors import BadInput
from ..safepath import plain_name, source_file
from . import (  # noqa: F401  (importing a dialect registers it)
    activation_fields as activation_reader,
    auto_round,
    compressed_tensors,
    fp8_mxfp4,
    json_input,
    nvfp4,
    quark,
)
from .dialect import (  # noqa: F401
    DIALECTS,
    DROP_FLAG,
    EXPERT_TARGET,
    MXFP4_FORMAT,
    PACKED,
    SCALE,
    SHAPE,
    MXFP4Source,
    dotted,
    mxfp4_format,
    named,
    quant_blocks,
)
from .match import match_name  # noqa: F401

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SITU_FIELDS = activation_reader.SITU_FIELDS


def load_json(path: str) -> dict:
    """A source JSON file (config, index) as an object; numbers bounded (json_input)."""
    try:
        obj = json_input.load_file(path)
    except FileNotFoundError:
        raise BadInput("missing", file=path) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise BadInput(f"not valid JSON ({e})", file=path) from None
    if not isinstance(obj, dict):
        raise BadInput(f"expected a JSON object, found {json_input.type_name(obj)}", file=path)
    return obj


def stated(src: str, config: dict, config_path: str, roots: tuple[str, ...] | None = None) -> tuple[dict, str]:
    """config.json as a conversion reads it, and the file that states its quantization (named in refusals):
    config.json itself; or, where config.json holds no quantization_config and SRC holds ModelOpt's
    ``hf_quant_config.json`` (ModelOpt up to 0.27), that file's statement as config.json's top-level
    quantization_config (``nvfp4.modelopt_statement``; the output's config.json then states int4 there)."""
    path = os.path.join(src, nvfp4.MODELOPT_FILE)
    if quant_blocks(config) or not os.path.lexists(path):
        return config, config_path
    path = source_file(src, nvfp4.MODELOPT_FILE, roots)
    return {**config, "quantization_config": nvfp4.modelopt_statement(load_json(path), path)}, path


def is_mxfp4(block: dict) -> bool:
    """Whether a quantization_config block describes MXFP4 weights, in any registered dialect."""
    return any(d.claims(block) and d.is_mxfp4(block) for d in DIALECTS.values())


def dialect(config: dict, config_path: str) -> str:
    """The registered dialect whose MXFP4 blocks config.json holds, by name (``nvfp4`` for NVFP4 blocks of
    any layout, docs/nvfp4.md); else BadInput.

    One checkpoint, one dialect: blocks of two dialects (a top-level Quark block beside a
    nested compressed-tensors one) are refused by name, never read as either.
    """
    blocks = quant_blocks(config)
    if not blocks:
        raise BadInput("no quantization_config (top-level or nested): not an MXFP4 checkpoint", file=config_path)
    claimed = {p: d for p, b in blocks for d in DIALECTS.values() if d.claims(b)}
    names = set(d.name for d in claimed.values())
    if len(names) > 1:
        said = ", ".join(f"{dotted(p)} is {d.name}" for p, d in claimed.items())
        raise BadInput(f"mixed quantization dialects ({said}): k3convert reads a checkpoint written in one",
                       file=config_path)
    for p, b in blocks:
        if p in claimed and claimed[p].is_mxfp4(b):
            return claimed[p].name
    if any(nvfp4.is_nvfp4(b) for _, b in blocks):
        return nvfp4.DIALECT   # E2M1 with FP8 scales per 16 (docs/nvfp4.md): its reader names what it refuses
    if names == {"quark"}:
        return "quark"  # its reader names what is not MXFP4
    p, b = blocks[0]
    hint = " (gpt-oss's MXFP4 layout, which k3convert does not read)" if b.get("quant_method") == "mxfp4" else ""
    raise BadInput(f"{dotted(p)} says quant_method={b.get('quant_method')!r}, format={b.get('format')!r}{hint}: "
                   f"k3convert converts compressed-tensors {MXFP4_FORMAT}, AMD Quark MXFP4 and vLLM fp8 (store_dtype "
                   f"mxfp4, or routed_experts_quant_method mxfp4) checkpoints",
                   file=config_path)


def source_format(quantization: dict) -> str | None:
    """The ``source_format`` a source of this manifest ``quantization`` record states (the source
    classes' own property), or None for a dialect this tool does not know."""
    name = quantization.get("dialect")
    if name == nvfp4.DIALECT:
        layout = next((x for x in nvfp4.Layout if x.value == quantization.get("layout")), None)
        return nvfp4.nvfp4_format(layout) if layout else None
    return mxfp4_format(name) if name in DIALECTS else None


def mxfp4_source(config: dict, config_path: str, drop: bool = False, dialect_name: str | None = None
                 ) -> MXFP4Source:
    """The source description, read by the dialect the profile names (else the config's own)."""
    name = dialect_name or dialect(config, config_path)
    return named(name, config_path).read(config, config_path, drop)


# ---------------------------------------------------------------------------- activation

def activation_fields(config: dict, keys: tuple[str, ...] = (), config_path: str | None = None
                      ) -> dict[str, tuple[Any, str]]:
    """Each activation field the model reads (SiTU's, and ``keys``): (value, "text_config" or
    "top-level"); a field stated at top level beside a text_config that lacks it or says otherwise
    is refused (converter.formats.activation_fields, the one reader)."""
    try:
        return activation_reader.find(config, SITU_FIELDS + tuple(keys))
    except activation_reader.ActivationConflict as e:
        raise BadInput(str(e), file=config_path) from None


NULLABLE_ACTIVATION = ("activation_situ_linear_beta",)   # null: the up projection is not clipped (vLLM's SituAndMul)
# one value per layer, 0 or null for none (Ling: vLLM's models/bailing_moe_v3.py; docs/serving.md)
PER_LAYER_ACTIVATION = ("expert_swiglu_limit_list",)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def activation_type_problem(key: str, value: Any) -> str | None:
    """Why an activation field's value is not what servers read it as, or None: ``hidden_act`` a
    name, every other field a finite number (a string "4.0" or a list would be written into shard
    metadata and the manifest as text, and a server would refuse or misread it)."""
    if key == "hidden_act":
        return None if isinstance(value, str) and value else "expected a non-empty string"
    if value is None and key in NULLABLE_ACTIVATION:
        return None
    if key in PER_LAYER_ACTIVATION:
        ok = isinstance(value, list) and len(value) <= 4096 and all(v is None or _finite(v) for v in value)
        return None if ok else "expected a list of finite numbers (or null), one per layer"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "expected a finite number" + (" or null" if key in NULLABLE_ACTIVATION else "")
    return None


def activation(config: dict, config_path: str, required: tuple[str, ...] = ("hidden_act",),
               optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The expert activation and its parameters (docs/spec.md §4), where the model reads them
    (``activation_fields``), every field stated type-checked, the optional ones included.

    Refuses a checkpoint whose activation cannot be stated: a kernel that assumes SiLU
    would load the result fine and produce garbage.
    """
    fields = activation_fields(config, tuple(required) + tuple(optional), config_path)
    wrong = [f"{where}.{key} is {value!r}: {why}" if where == "text_config" else f"{key} is {value!r}: {why}"
             for key, (value, where) in fields.items() if (why := activation_type_problem(key, value))]
    if wrong:
        raise BadInput("activation field of the wrong type: " + "; ".join(wrong), file=config_path)
    act = {key: value for key, (value, _) in fields.items()}
    if act.get("hidden_act") == "situ":
        required = tuple(dict.fromkeys(tuple(required) + SITU_FIELDS))
    missing = [k for k in required if k not in act]
    if missing:
        said = f"hidden_act is {act['hidden_act']!r} but " if "hidden_act" in act else ""
        where = "in text_config" if activation_reader.nested(config) is not None else "in config.json"
        raise BadInput(f"{said}{', '.join(missing)} missing {where}: cannot state the expert activation",
                       file=config_path)
    return act


# ---------------------------------------------------------------------------- the shards

def weight_map(src: str) -> dict[str, str]:
    """tensor name -> shard file, from the index (or the single-file checkpoint).

    The index is untrusted: every shard it names must be a plain file name inside SRC.
    """
    index = os.path.join(src, INDEX)
    if os.path.exists(index):
        source_file(src, INDEX)
        wm = load_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise BadInput("no weight_map", file=index)
        for shard in wm.values():
            plain_name(shard, index)
        return wm
    single = os.path.join(src, SINGLE)
    if os.path.exists(single):
        from .safetensors_io import read_header
        return {name: SINGLE for name in read_header(source_file(src, SINGLE)).tensors}
    raise BadInput(f"neither {INDEX} nor {SINGLE} found", file=src)
