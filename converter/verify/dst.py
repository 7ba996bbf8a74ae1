"""DST as verify reads it: its manifest, index, config and shard headers, each type-checked.

Every check reads DST through ``Dst``; loading finds the first problems (a missing or corrupt
index or config, an unreadable shard header), which the files, index and config checks report.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..checks import Check
from ..errors import BadInput, ConvertError, VerifyFailed
from ..formats import checkpoint as ckpt
from ..formats.json_input import ListOf, MapOf, Nullable, type_problems
from ..formats.safetensors_io import Header, TensorInfo, read_header
from ..quant.rules import RULE_KEY, RULES as SCALE_RULES, ScaleRule, recorded_rule
from ..run.plan import PACKED
from ..safepath import plain_name
from ..state.files import MANIFEST
from ..state.manifest import Manifest
from ..state.records import read_json

# The types of the DST fields verify reads (formats.json_input.type_problems): a field of
# another type fails verification naming it (exit 5), never a TypeError further on.
MANIFEST_TYPES = Manifest.TYPES
INDEX_TYPES = {"metadata": {"total_size": int}, "weight_map": MapOf(str)}
CONFIG_TYPES = {"text_config": Nullable(dict)}
BLOCK_TYPES = {
    "quant_method": str, "format": str, "quantization_status": str, "ignore": ListOf(str),
    "config_groups": MapOf({"targets": ListOf(str), "format": Nullable(str),
                            "input_activations": Nullable(dict), "output_activations": Nullable(dict),
                            "weights": Nullable({"num_bits": int, "type": str, "symmetric": bool, "strategy": str,
                                                 "group_size": int, "dynamic": bool, "actorder": Nullable(str)})}),
}


def _conforms(value: Any, spec: Any) -> bool:
    """True only where ``type_problems`` finds nothing: the fast pass (a weight map of 497k names is
    one ``type(v) is str`` each, not one call), so the detailed walk runs only on a failure."""
    if isinstance(spec, Nullable):
        return value is None or _conforms(value, spec.spec)
    if isinstance(spec, dict):
        return type(value) is dict and all(k not in value or _conforms(value[k], s) for k, s in spec.items())
    if isinstance(spec, (MapOf, ListOf)):
        kind, items = (dict, lambda v: v.values()) if isinstance(spec, MapOf) else (list, iter)
        if type(value) is not kind:
            return False
        s = spec.spec
        if isinstance(s, type) and s is not float:  # bool is its own type: int excludes booleans here too
            return all(type(v) is s for v in items(value))
        return all(_conforms(v, s) for v in items(value))
    return type(value) is spec or spec is float and type(value) is int


def _typed(obj: Any, types: Any, path: str, where: str = "") -> None:
    """VerifyFailed (exit 5) naming every field of ``obj`` whose type is not what verify reads."""
    if _conforms(obj, types):
        return
    problems = type_problems(obj, types, where)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise VerifyFailed("; ".join(problems[:3]) + more, file=path)


def read_obj(path: str, check: Check | None, types: Any = None) -> dict | None:
    """A JSON file of DST; a missing or corrupt one is a problem of ``check`` (or unreadable input);
    one that is not an object, or has a field of another type than ``types`` says, VerifyFailed."""
    try:
        obj = read_json(path)
    except ConvertError as e:
        if check is None:
            raise BadInput(str(e)) from None   # it names the file and why (not JSON, a FIFO, ...)
        check.fail(f"{os.path.basename(path)} cannot be read as JSON ({e})")
        return None
    if obj is None and check is not None:
        check.fail(f"{os.path.basename(path)} is missing")
    if obj is not None:
        _typed(obj, types or {}, path)
    return obj


def read_manifest(dst: str) -> dict | None:
    """DST's manifest (None: absent). One that is not JSON (a truncated write, a faulty copy) fails
    verification like any other damaged file of DST (exit 5), with verify's own advice: not the
    converter's --overwrite (which would throw the converted shards away); a rerun of the
    conversion writes it anew."""
    path = os.path.join(dst, MANIFEST)
    try:
        return read_obj(path, None, MANIFEST_TYPES)
    except BadInput:
        if not os.path.isfile(path):   # a FIFO, a folder, unreadable: as read_obj says
            raise
        raise VerifyFailed("is not valid JSON (truncated or corrupt): DST fails verification; run the conversion "
                           "again (the same mxfp4-to-int4 command) to write it anew", file=path) from None


def existing_dir(path: str) -> str:
    """``path`` made absolute; BadInput (exit 2) saying whether it is missing or not a directory."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise BadInput("not a directory" if os.path.exists(path) else "does not exist", file=path)
    return path


@dataclass
class Dst:
    path: str
    manifest: dict
    index: dict | None
    config: dict | None
    headers: dict[str, Header]                  # shard name -> header (readable ones)
    where: dict[str, tuple[str, TensorInfo]]    # tensor -> (shard, info), over all shards


def load(dst: str, files: Check, index_c: Check, config_c: Check) -> Dst:
    """Read DST's JSON files and shard headers; what cannot be read is a problem of the given checks."""
    dst = existing_dir(dst)
    manifest = read_manifest(dst)
    if manifest is None:
        raise BadInput(f"no {MANIFEST}: not a k3convert output directory", file=dst)
    index = read_obj(os.path.join(dst, ckpt.INDEX), index_c, INDEX_TYPES)
    config = read_obj(os.path.join(dst, "config.json"), config_c, CONFIG_TYPES)
    for where_in, block in ckpt.quant_blocks(config or {}):
        _typed(block, BLOCK_TYPES, os.path.join(dst, "config.json"), ckpt.dotted(where_in))
    # shard names read from DST's own files are untrusted too: nothing outside DST is opened
    names = {plain_name(n, os.path.join(dst, MANIFEST)) for n in manifest.get("shards") or {}}
    wm = (index or {}).get("weight_map")
    if index is not None and not isinstance(wm, dict):
        index_c.fail(f"{ckpt.INDEX} has no weight_map")
    elif isinstance(wm, dict):   # index is not None
        names |= {plain_name(n, os.path.join(dst, ckpt.INDEX)) for n in wm.values()}
    headers: dict[str, Header] = {}
    where: dict[str, tuple[str, TensorInfo]] = {}
    for name in sorted(names):
        path = os.path.join(dst, name)
        if not os.path.exists(path):
            continue  # reported by the checksum and index checks
        try:
            headers[name] = read_header(path)
        except BadInput as e:
            files.fail(f"{name}: unreadable safetensors header ({e})")
            continue
        for t, info in headers[name].tensors.items():
            where.setdefault(t, (name, info))
    return Dst(dst, manifest, index, config, headers, where)


def converted_modules(d: Dst) -> list[str]:
    """Every module that has a weight_packed tensor, sorted."""
    return sorted(t[: -len(PACKED) - 1] for t in d.where if t.endswith("." + PACKED))


def scale_rule(d: Dst) -> ScaleRule:
    """The scale rule DST was written with (manifest; config must agree), default ``optimal``."""
    name = recorded_rule(d.manifest)
    if name not in SCALE_RULES:
        raise VerifyFailed(f"scale_rule {name!r} is not one of {', '.join(SCALE_RULES)}",
                           file=os.path.join(d.path, MANIFEST))
    rule = ScaleRule(name)
    for path, block in ckpt.quant_blocks(d.config or {}):
        said = block.get(RULE_KEY)
        if said is not None and said != rule:
            raise VerifyFailed(f"{ckpt.dotted(path)}.{RULE_KEY} is {said!r}, the manifest says {rule!r}",
                               file=os.path.join(d.path, "config.json"))
    return rule
