"""What is in a checkpoint directory (or one shard): format, shards, tensors, quantization, SiTU.

Headers and JSON only, no tensor data, so it is instant on a 1.5 TB checkpoint. For an MXFP4
source it also runs the preflight (build_plan) and states what a conversion would produce.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any

from . import profiles
from .errors import BadInput, ConvertError
from .formats import checkpoint as ckpt, nvfp4
from .formats.safetensors_io import read_header
from .quant.rules import recorded_rule
from .run.plan import PACKED
from .run.validate import ratio_line
from .safepath import regular_problem
from .state.files import MANIFEST, REPORT
from .state.records import read_json

MXFP4_SOURCE = "mxfp4-source"
K3_OUTPUT = "k3convert-int4"
INT4_OTHER = "int4-pack-quantized"
OTHER = "other"
UNQUANTIZED = "unquantized"


# what states a block's format and weights where it has no compressed-tensors config_groups (auto-round's own
# format, ModelOpt), and its ignore list under other names
_FORMAT_KEYS = ("format", "packing_format", "quant_algo")
_WEIGHT_KEYS = ("num_bits", "bits", "type", "data_type", "group_size", "symmetric", "sym", "strategy")
_IGNORE_KEYS = ("ignore", "exclude_modules")


def _block_summary(path: tuple[str, ...], block: dict, where: str | None = None) -> dict[str, Any]:
    """A quantization_config block for the reader; ``where``: the file that states it, if not config.json."""
    groups = [g.get("weights") or {} for g in (block.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [w for w in groups if isinstance(w, dict)] or [block]
    return {
        "where": where or ".".join(path),
        "quant_method": block.get("quant_method"),
        "format": next((block[k] for k in _FORMAT_KEYS if block.get(k) is not None), None),
        "weights": [{k: w.get(k) for k in _WEIGHT_KEYS if k in w} for w in weights],
        "ignore": list(next((block[k] for k in _IGNORE_KEYS if isinstance(block.get(k), list)), [])),
    }


def read_source(config: dict, stated_in: str) -> tuple[ckpt.MXFP4Source | None, str | None]:
    """The source as a conversion reads it (``checkpoint.dialect``, then its reader; activation quantization
    taken as dropped, which the plan shows as needing the flag), or None and the reader's refusal (None
    where no dialect claims the config: not a source)."""
    try:
        name = ckpt.dialect(config, stated_in)
    except BadInput:
        return None, None
    try:
        return ckpt.mxfp4_source(config, stated_in, True, name), None
    except BadInput as e:
        return None, str(e)


def _detect(blocks: list[tuple[tuple[str, ...], dict]], has_manifest: bool, source: ckpt.MXFP4Source | None,
            refused: str | None, stated_in: str) -> tuple[str, str]:
    """(kind, a sentence) from the source as a conversion reads it (``read_source``), the quantization blocks
    and the presence of a k3convert manifest."""
    if source is not None:
        writer, fp4 = source.writer, source.fp4
        where = "" if os.path.basename(stated_in) == "config.json" else f", stated in {os.path.basename(stated_in)}"
        return MXFP4_SOURCE, (f"{fp4} source ({writer}{where}): k3convert converts this"
                              + (" (docs/nvfp4.md)" if isinstance(source, nvfp4.Nvfp4Source) else ""))
    if refused:
        return OTHER, f"other: k3convert refuses it: {refused}"
    if not blocks:
        return UNQUANTIZED, "no quantization_config (unquantized, or not a checkpoint k3convert knows)"
    from .verify import int4_block_problems  # imports torch (seconds): not for a source

    if all(not int4_block_problems(b) for _, b in blocks):
        if has_manifest:
            return K3_OUTPUT, "k3convert int4 output (compressed-tensors pack-quantized int4, group 32, symmetric)"
        return INT4_OTHER, "compressed-tensors pack-quantized int4 group 32 (no k3convert manifest)"
    described = "; ".join(f"{'.'.join(p)}: quant_method={b.get('quant_method')!r}, format={b.get('format')!r}"
                          for p, b in blocks)
    hint = ""
    if any(b.get("quant_method") == "mxfp4" for _, b in blocks):
        hint = " (gpt-oss MXFP4 layout: k3convert does not convert it)"
    return OTHER, f"other: {described}{hint}"


def _situ(config: dict) -> dict[str, Any]:
    try:
        return {k: {"value": v, "where": w} for k, (v, w) in ckpt.activation_fields(config).items()}
    except BadInput as e:   # stated where the model does not read it: inspect shows why, the plan refuses it
        return {"refused": {"value": str(e), "where": "config.json"}}


def _shard_file(path: str) -> dict[str, Any]:
    h = read_header(path)
    dtypes = Counter(t.dtype for t in h.tensors.values())
    return {
        "path": os.path.abspath(path), "kind": "safetensors shard", "bytes": h.file_size,
        "tensors": len(h.tensors), "dtypes": dict(sorted(dtypes.items())),
        "quantized_modules": sum(n.endswith("." + PACKED) for n in h.tensors),
        "metadata": h.metadata,
    }


def inspect_path(path: str) -> dict[str, Any]:
    """Describe a checkpoint directory or a single .safetensors file (raises BadInput if unreadable)."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        return _shard_file(path)
    if not os.path.isdir(path):
        why = regular_problem(path) if os.path.exists(path) else None  # a FIFO or device: say what it is
        raise BadInput(why or "no such file or directory", file=path)
    config_path = os.path.join(path, "config.json")
    config = ckpt.load_json(config_path) if os.path.exists(config_path) else {}
    try:   # ModelOpt <= 0.27 states its quantization in hf_quant_config.json only
        config, stated_in = ckpt.stated(path, config, config_path)
        source, refused = read_source(config, stated_in)
    except BadInput as e:
        stated_in, source, refused = config_path, None, str(e)
    try:
        manifest = read_json(os.path.join(path, MANIFEST))
    except ConvertError:
        manifest = {"unreadable": True}
    if manifest is not None and not isinstance(manifest, dict):  # valid JSON, not an object
        manifest = {"unreadable": True}
    blocks = ckpt.quant_blocks(config)
    kind, description = _detect(blocks, manifest is not None, source, refused, stated_in)
    if manifest and not manifest.get("unreadable") and not os.path.exists(os.path.join(path, ckpt.INDEX)):
        # an unfinished k3convert output: no index yet, the manifest names the shards done
        wm = {t: n for n in sorted(manifest.get("shards") or {}) if os.path.exists(os.path.join(path, n))
              for t in read_header(os.path.join(path, n)).tensors}
        total = len((manifest.get("source") or {}).get("shards") or {})
        kind, description = K3_OUTPUT, (f"k3convert int4 output, unfinished: {len(manifest.get('shards') or {})} "
                                        f"of {total} shard(s) done (status {manifest.get('status')!r})")
    else:
        wm = ckpt.weight_map(path)
    dtypes: Counter[str] = Counter()
    shards, total_bytes, modules, metadata_situ = [], 0, 0, 0
    for name in sorted(set(wm.values())):
        p = os.path.join(path, name)
        if not os.path.exists(p):
            shards.append({"name": name, "missing": True})
            continue
        h = read_header(p)
        n_mod = sum(t.endswith("." + PACKED) for t in h.tensors) if source is None else \
            sum(source.packs(n, t.dtype) for n, t in h.tensors.items())
        shards.append({"name": name, "bytes": h.file_size, "tensors": len(h.tensors), "quantized_modules": n_mod})
        dtypes.update(t.dtype for t in h.tensors.values())
        total_bytes += h.file_size
        modules += n_mod
        metadata_situ += all(k in h.metadata for k in ckpt.SITU_FIELDS[:1])
    others = []
    for d, dirs, files in os.walk(path):
        dirs[:] = [x for x in dirs if not x.startswith(".")]  # .k3convert state, .cache
        others += [os.path.relpath(os.path.join(d, f), path) for f in files]
    others = sorted(set(others) - set(wm.values()))
    info: dict[str, Any] = {
        "path": path, "format": kind, "description": description,
        "model_type": config.get("model_type"), "architectures": config.get("architectures"),
        "shards": shards, "shard_count": len(shards),
        "tensors": len(wm), "quantized_modules": modules, "dtypes": dict(sorted(dtypes.items())),
        "bytes": total_bytes, "other_files": others,
        "packed_suffix": source.packed_suffix if source is not None else PACKED,
        "quantization_configs": [_block_summary(p, b, None if stated_in == config_path else
                                                os.path.basename(stated_in)) for p, b in blocks],
        "situ": _situ(config),
        "situ_in_shard_metadata": f"{metadata_situ} of {len(shards)} shard(s)",
    }
    if kind == MXFP4_SOURCE:
        info["profile"] = _profile(config, config_path)
        info["plan"] = _plan(path)
    if manifest is not None:
        report = None
        try:
            report = read_json(os.path.join(path, REPORT))
        except ConvertError:
            pass
        recorded = manifest.get("source") or {}
        quant = recorded.get("quantization") or {}
        info["k3convert"] = {
            "complete": manifest.get("complete"), "status": manifest.get("status"),
            "version": manifest.get("version"), "source": recorded.get("path"),
            "profile": recorded.get("profile"), "scale_convention": quant.get("scale_convention"),
            "dropped": [d.get("where") for d in quant.get("dropped") or []]
            + list(recorded.get("dropped_tensors") or []),
            "dequantized": [m for m in recorded.get("dequantized") or [] if isinstance(m, str)],
            "activation": manifest.get("activation"),
            "worst": (report or {}).get("worst"), "rel_rmse_mean": (report or {}).get("rel_rmse_mean"),
            "scale_rule": recorded_rule(manifest),
            "compare_rule": (report or {}).get("compare_rule"),
            "cmp_rel_rmse_mean": (report or {}).get("cmp_rel_rmse_mean"),
            "cmp_ratio": (report or {}).get("cmp_ratio"),
        }
    return info


def _profile(config: dict, config_path: str) -> dict[str, Any]:
    """The profile a conversion would use and why (shown even when the preflight fails)."""
    try:
        p, why = profiles.choose(config, ckpt.dialect(config, config_path))
    except BadInput as e:
        return {"error": str(e)}
    return {**p.record(), "reason": why}


def _plan(path: str) -> dict[str, Any]:
    """What converting gives, by the preflight itself. A source refused only for its activation
    quantization is planned again as with --drop-activation-quant, to show what would be dropped."""
    from .run.plan import build_plan
    requires = None
    try:
        plan = build_plan(path)
    except BadInput as e:
        if ckpt.DROP_FLAG not in str(e):
            return {"error": str(e)}
        try:
            plan, requires = build_plan(path, drop_activation_quant=True), ckpt.DROP_FLAG
        except BadInput:
            return {"error": str(e)}
    return {"fp4": plan.source.fp4, "bytes_in": plan.bytes_in,
            "bytes_out": plan.bytes_out, "tensors_to_convert": plan.n_convert, "modules_to_bf16": plan.dequantized,
            "source_tensors_converted": sum(len(c.tensors) for s in plan.shards for c in s.converts),
            "activation": plan.activation, "modules_split_across_shards": plan.straddled,
            "scale_convention": plan.source.scale_note, "dropped": list(plan.source.dropped),
            "dropped_tensors": list(plan.dropped), "requires": requires}


def _bf16_line(modules: list[str], how: str) -> list[str]:
    """The MXFP4 modules that are not routed experts, kept exactly as bf16 (items.Dequant)."""
    if not modules:
        return []
    more = f", ... ({len(modules)} in all)" if len(modules) > 3 else ""
    return [f"  bf16:         {len(modules)} MXFP4 module(s) that are not routed experts {how} as exact bf16: "
            f"{', '.join(modules[:3])}{more}"]


def _profile_line(p: dict[str, Any] | None) -> list[str]:
    if not p:
        return []
    if "error" in p:
        return [f"  profile:      none matches: {p['error']}"]
    return [f"  profile:      {p.get('name')} ({p.get('file')}): {p.get('reason')}"]


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def missing_shards(info: dict[str, Any]) -> list[str]:
    """Shards the checkpoint's index names that are not there (inspect then exits 2: bad input)."""
    return [s["name"] for s in info.get("shards") or [] if s.get("missing")]


def format_info(info: dict[str, Any]) -> str:
    """The readable summary the CLI prints."""
    if info.get("kind") == "safetensors shard":
        lines = [f"{info['path']}: safetensors shard, {_gb(info['bytes'])}, {info['tensors']} tensors "
                 f"({', '.join(f'{k} {v}' for k, v in info['dtypes'].items())}), "
                 f"{info['quantized_modules']} quantized module(s)"]
        lines += [f"  metadata {k}: {v}" for k, v in sorted(info["metadata"].items())]
        return "\n".join(lines)
    lines = [f"{info['path']}",
             f"  format:       {info['description']}",
             f"  model:        {info.get('model_type') or '-'} {info.get('architectures') or ''}".rstrip(),
             f"  shards:       {info['shard_count']} ({_gb(info['bytes'])})",
             f"  tensors:      {info['tensors']} ({', '.join(f'{k} {v}' for k, v in info['dtypes'].items())}); "
             f"quantized modules ({info.get('packed_suffix', PACKED)}): {info['quantized_modules']}"]
    missing = missing_shards(info)
    if missing:
        lines.append(f"  MISSING:      {', '.join(missing)}")
    if not info["quantization_configs"]:
        lines.append("  quantization: none")
    for b in info["quantization_configs"]:
        w = "; ".join(", ".join(f"{k}={v}" for k, v in x.items()) for x in b["weights"]) or "-"
        lines.append(f"  quantization: {b['where']}: {b['quant_method']} / {b['format']} ({w}); "
                     f"{len(b['ignore'])} ignore pattern(s)")
    if info["situ"]:
        lines.append("  activation:   "
                     + ", ".join(f"{k}={v['value']} ({v['where']})" for k, v in info["situ"].items()))
    else:
        lines.append("  activation:   not stated in config.json (no hidden_act)")
    lines.append(f"  shard metadata states hidden_act: {info['situ_in_shard_metadata']}")
    lines += _profile_line(info.get("profile"))
    plan = info.get("plan")
    if plan and "error" in plan:
        lines.append(f"  conversion:   preflight fails: {plan['error']}")
    elif plan:
        lines.append(f"  conversion:   {plan['tensors_to_convert']} {plan['fp4']} matrices to convert "
                     f"({plan['source_tensors_converted']} source tensors); output {_gb(plan['bytes_out'])} "
                     f"from {_gb(plan['bytes_in'])}; {plan['modules_split_across_shards']} module(s) with "
                     "tensors in more than one shard")
        lines += _bf16_line(plan["modules_to_bf16"], "to be written")
        lines.append(f"  scales:       {plan['scale_convention']}")
        dropped = [d["where"] for d in plan["dropped"]] + plan["dropped_tensors"]
        if dropped:
            lines.append(f"  dropped:      {', '.join(dropped)} (only with {plan['requires'] or ckpt.DROP_FLAG})")
    k3 = info.get("k3convert")
    if k3:
        worst = k3.get("worst") or {}
        lines.append(f"  k3convert:    {'complete' if k3.get('complete') else 'NOT complete'} "
                     f"(status {k3.get('status')}, version {k3.get('version')}), source {k3.get('source')}")
        lines += _profile_line(k3.get("profile"))
        if k3.get("scale_convention"):
            lines.append(f"  scales:       {k3['scale_convention']} (source)")
        if k3.get("dropped"):
            lines.append(f"  dropped:      {', '.join(k3['dropped'])}")
        lines += _bf16_line(k3.get("dequantized") or [], "written")
        if worst:
            lines.append(f"  error:        relative RMSE mean {k3.get('rel_rmse_mean'):.4f}, worst "
                         f"{worst.get('rel_rmse'):.4f} ({worst.get('tensor')})")
        lines.append(f"  scale rule:   {k3.get('scale_rule')}")
        if isinstance(k3.get("cmp_ratio"), (int, float)):
            lines.append(f"  compare:      {ratio_line(k3['cmp_ratio'], k3.get('scale_rule'))}")
    return "\n".join(lines)
