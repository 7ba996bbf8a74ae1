"""The Hugging Face checkpoint directory: config.json, the shard index, the MXFP4 dialects.

What converts is decided here from the source's own quantization config, never from
hard-coded names (SPEC §1, §3). Anything the config says that a weight-only int4 output
cannot carry (activation quantization, transforms, sparsity, other formats) is refused,
or dropped only behind an explicit flag and recorded: never changed silently.
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import BadInput
from ..safepath import plain_name, source_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SITU_FIELDS = ("hidden_act", "activation_situ_beta", "activation_situ_linear_beta")
MXFP4_FORMAT = "mxfp4-pack-quantized"
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
DROP_FLAG = "--drop-activation-quant"


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


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors semantics: ``re:`` patterns match from the start, others exactly."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


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

    def selects(self, module: str) -> bool:
        raise NotImplementedError

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str]) -> dict:
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """What the manifest and report say about the source's quantization."""
        return {"dialect": self.dialect, "blocks": [dotted(p) for p in self.blocks],
                "packed_suffix": self.packed_suffix, "scale_bias": self.scale_bias,
                "scale_convention": self.scale_note, "dropped": list(self.dropped)}


def int4_weights() -> dict[str, Any]:
    return {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False, "actorder": None, "observer": "minmax"}


def int4_block(targets: list[str], ignore: list[str], keep: dict[str, Any] | None = None) -> dict:
    """The compressed-tensors pack-quantized int4 group-32 block that replaces an MXFP4 one."""
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
    }


@dataclass(frozen=True)
class CompressedTensorsSource(MXFP4Source):
    """compressed-tensors ``mxfp4-pack-quantized``: ``X.weight_packed`` + ``X.weight_scale``."""

    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def selects(self, module: str) -> bool:
        """Targets are ``re:`` patterns, exact names, or layer class names (which any packed
        module satisfies); the ignore list wins."""
        if any(_matches(module, p) for p in self.ignore):
            return False
        return any(not p.startswith("re:") and p[:1].isupper() or _matches(module, p) for p in self.targets)

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str]) -> dict:
        """Every MXFP4 block replaced (same ignore list, kv-cache and MoE-sparsity kept)."""
        out = copy.deepcopy(config)
        for path in self.blocks:
            parent = out
            for key in path[:-1]:
                parent = parent[key]
            old = parent[path[-1]]
            targets = [t for g in old["config_groups"].values() for t in g.get("targets", [])]
            keep = {k: old[k] for k in ("kv_cache_scheme", "moe_sparsity_config") if old.get(k) is not None}
            parent[path[-1]] = int4_block(list(dict.fromkeys(targets)) or ["Linear"], old.get("ignore", []), keep)
        return out


# compressed-tensors versions whose MXFP4 scale bytes are not OCP E8M0 (docs/mxfp4_dialects.md)
_CT_ALIAS = ("0.12.3a20251023", "0.12.3a20251203")   # MXFP4 was an NVFP4 alias: float scales
_CT_BIAS125 = ("0.12.3a20251204", "0.13.1a20260108")  # E8M0 written with bias 125 (a double -2)


def ct_scale_convention(block: dict, where: str) -> tuple[int, str]:
    """(bias, description) of the E8M0 bytes a compressed-tensors release wrote.

    Only the ``version`` in the config tells: the bytes themselves look the same. No version
    (Kimi K3's config has none) is read as OCP, as vLLM and SGLang read it.
    """
    from packaging.version import InvalidVersion, Version

    raw = block.get("version")
    if raw is None:
        return 127, "OCP E8M0 (bias 127; the config names no compressed-tensors version)"
    try:
        v = Version(str(raw))
    except InvalidVersion:
        raise BadInput(f"{where}.version {raw!r} is not a version: cannot tell how its MXFP4 scales "
                       "were written") from None
    if v.is_devrelease and v.base_version in ("0.12.3", "0.13.1"):
        raise BadInput(f"{where}.version {raw}: a development build from the months when compressed-tensors "
                       "changed its MXFP4 scale encoding; which one it wrote cannot be told: re-export it")
    if v < Version(_CT_ALIAS[0]):
        raise BadInput(f"{where}.version {raw}: compressed-tensors had no MXFP4 format then; the config "
                       "cannot be trusted")
    if v <= Version(_CT_ALIAS[1]):
        raise BadInput(f"{where}.version {raw}: this compressed-tensors nightly stored MXFP4 scales as "
                       "floats (an NVFP4 alias), not E8M0: re-export it with compressed-tensors >= 0.14")
    if v <= Version(_CT_BIAS125[1]):
        return 125, (f"compressed-tensors {raw} E8M0 with bias 125 (corrected exactly: +2, "
                     "see docs/mxfp4_dialects.md)")
    return 127, f"OCP E8M0 (bias 127; compressed-tensors {raw})"


def _group_is_mxfp4(group: dict, block: dict) -> bool:
    w = group.get("weights") or {}
    fmt = group.get("format") or block.get("format")
    return fmt == MXFP4_FORMAT and (w.get("num_bits"), w.get("type"), w.get("group_size")) == (4, "float", 32)


def _ct_problems(block: dict, where: str, drop: bool, dropped: list[dict]) -> list[str]:
    """Why a compressed-tensors MXFP4 block cannot become weight-only int4 (empty: it can)."""
    out = []
    if block.get("quantization_status", "compressed") != "compressed":
        out.append(f"{where}.quantization_status is {block.get('quantization_status')!r}: only packed "
                   "('compressed') checkpoints hold MXFP4 bytes")
    for key in ("transform_config", "sparsity_config"):
        value = block.get(key)
        if value and not (key == "sparsity_config" and isinstance(value, dict)
                          and value.get("format") in (None, "dense")):
            out.append(f"{where}.{key} is set ({json.dumps(value)[:80]}): an int4 output cannot carry it")
    for name, g in (block.get("config_groups") or {}).items():
        g = g if isinstance(g, dict) else {}
        w = g.get("weights") or {}
        at = f"{where}.config_groups.{name}"
        if not _group_is_mxfp4(g, block):
            out.append(f"{at} is not MXFP4 (format {g.get('format') or block.get('format')!r}, weights "
                       f"{w.get('num_bits')}-bit {w.get('type')}): only checkpoints whose quantized weights "
                       "are all MXFP4 are converted")
            continue
        if w.get("actorder") not in (None, "static") or w.get("dynamic") not in (None, False) \
                or w.get("strategy", "group") != "group" or w.get("scale_dtype") not in (None, "uint8", "torch.uint8"):
            out.append(f"{at}.weights is not plain MXFP4 ({json.dumps(w, sort_keys=True)})")
        for kind in ("input_activations", "output_activations"):
            if g.get(kind):
                drop_or_refuse(f"{at}.{kind}", g[kind], f"{kind.replace('_', ' ')} ({_describe(g[kind])})",
                               drop, dropped, out)
    return out


def drop_or_refuse(where: str, spec: Any, what: str, drop: bool, dropped: list[dict], problems: list[str]) -> None:
    """Quantization a weight-only int4 output cannot carry: recorded verbatim when the user
    asked to drop it, else a problem that says how to."""
    if drop:
        dropped.append({"where": where, "what": spec})
    else:
        problems.append(f"{where} quantizes {what}; k3convert writes weight-only int4 (W4A16): "
                        f"pass {DROP_FLAG} to convert anyway")


def _describe(args: dict) -> str:
    bits = f"{args.get('num_bits')}-bit {args.get('type')}"
    gs = f", group {args['group_size']}" if args.get("group_size") else ""
    return f"{bits}{gs}, {'dynamic' if args.get('dynamic') else 'static'}"


def compressed_tensors_source(config: dict, config_path: str, drop: bool = False) -> CompressedTensorsSource:
    """The compressed-tensors MXFP4 description of the source, or one refusal naming every problem."""
    blocks = [(p, b) for p, b in quant_blocks(config) if b.get("quant_method") == "compressed-tensors"]
    problems: list[str] = []
    dropped: list[dict] = []
    targets: list[str] = []
    ignore: list[str] = []
    conventions = set()
    for path, b in blocks:
        where = dotted(path)
        problems += _ct_problems(b, where, drop, dropped)
        try:
            conventions.add(ct_scale_convention(b, where))
        except BadInput as e:
            problems.append(str(e))
        for g in (b.get("config_groups") or {}).values():
            targets += [t for t in (g or {}).get("targets", []) if t not in targets]
        ignore += [i for i in b.get("ignore", []) if i not in ignore]
    if len(conventions) > 1:
        problems.append("the quantization_config blocks name compressed-tensors versions that wrote MXFP4 "
                        "scales differently")
    if problems:
        raise BadInput("; ".join(problems), file=config_path)
    bias, note = conventions.pop() if conventions else (127, "OCP E8M0 (bias 127)")
    return CompressedTensorsSource(
        dialect="compressed-tensors", blocks=tuple(p for p, _ in blocks), packed_suffix=PACKED,
        scale_bias=bias, scale_note=note, dropped=tuple(dropped), targets=tuple(targets) or ("Linear",),
        ignore=tuple(ignore))


def is_mxfp4(block: dict) -> bool:
    """Whether a quantization_config block describes MXFP4 weights (compressed-tensors or Quark)."""
    if block.get("quant_method") == "quark":
        return "fp4" in json.dumps(block.get("global_quant_config") or block.get("layer_quant_config") or {})
    groups = (block.get("config_groups") or {}).values()
    return block.get("quant_method") == "compressed-tensors" and any(
        isinstance(g, dict) and _group_is_mxfp4(g, block) for g in groups)


def dialect(config: dict, config_path: str) -> str:
    """Which MXFP4 dialect config.json describes: "compressed-tensors" or "quark"; else BadInput."""
    blocks = quant_blocks(config)
    if not blocks:
        raise BadInput("no quantization_config (top-level or nested): not an MXFP4 checkpoint", file=config_path)
    for _, b in blocks:
        if b.get("quant_method") == "quark":
            return "quark"
    if any(is_mxfp4(b) for _, b in blocks):
        return "compressed-tensors"
    p, b = blocks[0]
    hint = " (gpt-oss's MXFP4 layout, which k3convert does not read)" if b.get("quant_method") == "mxfp4" else ""
    raise BadInput(f"{dotted(p)} says quant_method={b.get('quant_method')!r}, format={b.get('format')!r}{hint}: "
                   f"k3convert converts compressed-tensors {MXFP4_FORMAT} and AMD Quark MXFP4 checkpoints",
                   file=config_path)


def mxfp4_source(config: dict, config_path: str, drop: bool = False) -> MXFP4Source:
    """The source description for whichever dialect config.json uses."""
    if dialect(config, config_path) == "quark":
        from .quark import quark_source
        return quark_source(config, config_path, drop)
    return compressed_tensors_source(config, config_path, drop)


# ---------------------------------------------------------------------------- activation

def activation_fields(config: dict, keys: tuple[str, ...] = ()) -> dict[str, tuple[Any, str]]:
    """Each activation field present (SiTU's, and ``keys``): (value, "text_config" or "top-level"),
    nested first."""
    found = {}
    for key in dict.fromkeys(SITU_FIELDS + tuple(keys)):
        for where, scope in (("text_config", config.get("text_config") or {}), ("top-level", config)):
            if key in scope:
                found[key] = (scope[key], where)
                break
    return found


def activation(config: dict, config_path: str, required: tuple[str, ...] = ("hidden_act",)) -> dict[str, Any]:
    """The expert activation and its parameters (SPEC §4), from text_config or top level.

    Refuses a checkpoint whose activation cannot be stated: a kernel that assumes SiLU
    would load the result fine and produce garbage.
    """
    act = {key: value for key, (value, _) in activation_fields(config, required).items()}
    if act.get("hidden_act") == "situ":
        required = tuple(dict.fromkeys(required + SITU_FIELDS))
    missing = [k for k in required if k not in act]
    if missing:
        said = f"hidden_act is {act['hidden_act']!r} but " if "hidden_act" in act else ""
        raise BadInput(f"{said}{', '.join(missing)} missing in text_config and at top level: cannot state "
                       "the expert activation", file=config_path)
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
