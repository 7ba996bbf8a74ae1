"""Check a converted DST before anyone serves or uploads it: bytes, structure, activation, numbers.

Three layers, each reported as a pass/fail line with the problems it found:
checksums (every shard against the manifest), structure (every file under DST named by the
manifest with its recorded digest, index, config, tensor shapes and dtypes, SiTU stated
everywhere a loader looks, the figure table), and, given the source, every file recomputed
from SRC (``outputs.expected``, what finalize writes) and a re-decode of sampled experts
through a path independent of the converter's own reader (``safetensors.safe_open`` +
compressed-tensors' unpacker), whose error must match the figures the conversion recorded
and whose groups must be exactly optimal.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .checks import Check, VerifyResult
from .errors import BadInput, ConvertError, VerifyFailed
from .formats import checkpoint as ckpt
from .formats.safetensors_io import Header, TensorInfo, read_header
from .digest import ALGORITHM as DIGEST_ALGORITHM, file_digest
from .formats.dialect import EXPERT_TARGET, TARGET_FORMAT, is_fp8_block_group, source_name
from .formats.json_input import ListOf, MapOf, Nullable, type_problems
from .manifest import MANIFEST, REPORT, TENSOR_TABLE, json_bytes, read_json, read_rows
from .outputs import BOOKKEEPING, CONFIG, Expected, accepted, expected, listing, named_by
from .safepath import open_regular, plain_name, read_regular, regular_problem
from .plan import PACKED, README, SCALE, SHAPE, build_plan, metadata_value
from .quant.rules import OPTIMA, RULE_KEY, RULES as SCALE_RULES, recorded_rule
from .serving import serving_check
from .validate import error_ratio, ratio_line

REL_TOL = 1e-6         # re-decoded relative RMSE vs the recorded figure
OPT_GROUPS = 8         # groups per tensor checked against a brute-force optimum
OPT_TENSORS = 8        # tensors whose groups are checked that way (the first sampled ones)


# --------------------------------------------------------------------------- loading

# The types of the DST fields verify reads (formats.json_input.type_problems): a field of
# another type fails verification naming it (exit 5), never a TypeError further on.
_FINGERPRINT = {"size": int, "edge_blake2b": str, "mtime_ns": int}
MANIFEST_TYPES = {
    "tool": str, "version": str, "status": str, "complete": bool, "source_format": str, "target_format": str,
    "digest_algorithm": str, "activation": dict, "options": dict,
    "source": {"path": str, "shards": MapOf(_FINGERPRINT), "profile": dict,
               "quantization": {"dialect": str, "packed_suffix": str, "scale_bias": int, "blocks": ListOf(str)}},
    "shards": MapOf({"bytes": int, "digest": str}),
    "files": MapOf({"bytes": int, "digest": str}),
}
INDEX_TYPES = {"metadata": {"total_size": int}, "weight_map": MapOf(str)}
CONFIG_TYPES = {"text_config": Nullable(dict)}
BLOCK_TYPES = {
    "quant_method": str, "format": str, "quantization_status": str, "ignore": ListOf(str),
    "config_groups": MapOf({"targets": ListOf(str), "format": Nullable(str),
                            "input_activations": Nullable(dict), "output_activations": Nullable(dict),
                            "weights": Nullable({"num_bits": int, "type": str, "symmetric": bool, "strategy": str,
                                                 "group_size": int, "dynamic": bool, "actorder": Nullable(str)})}),
}
REPORT_TYPES = {"tensors": int}
ROW_TYPES = {"name": str, "rel_rmse": float, "max_abs": float}


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


def _read_obj(path: str, check: Check | None, types: Any = None) -> dict | None:
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


@dataclass
class _Dst:
    path: str
    manifest: dict
    index: dict | None
    config: dict | None
    headers: dict[str, Header]                  # shard name -> header (readable ones)
    where: dict[str, tuple[str, TensorInfo]]    # tensor -> (shard, info), over all shards


def _load(dst: str, files: Check, index_c: Check, config_c: Check) -> _Dst:
    dst = os.path.abspath(dst)
    if not os.path.isdir(dst):
        raise BadInput("not a directory", file=dst)
    manifest = _read_obj(os.path.join(dst, MANIFEST), None, MANIFEST_TYPES)
    if manifest is None:
        raise BadInput(f"no {MANIFEST}: not a k3convert output directory", file=dst)
    index = _read_obj(os.path.join(dst, ckpt.INDEX), index_c, INDEX_TYPES)
    config = _read_obj(os.path.join(dst, "config.json"), config_c, CONFIG_TYPES)
    for path, block in ckpt.quant_blocks(config or {}):
        _typed(block, BLOCK_TYPES, os.path.join(dst, "config.json"), ckpt.dotted(path))
    # shard names read from DST's own files are untrusted too: nothing outside DST is opened
    names = {plain_name(n, os.path.join(dst, MANIFEST)) for n in manifest.get("shards") or {}}
    wm = (index or {}).get("weight_map")
    if index is not None and not isinstance(wm, dict):
        index_c.fail(f"{ckpt.INDEX} has no weight_map")
    elif index is not None:
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
    return _Dst(dst, manifest, index, config, headers, where)


# --------------------------------------------------------------------------- (a) bytes

def _check_manifest(d: _Dst) -> Check:
    c = Check("manifest")
    m = d.manifest
    if m.get("tool") != "k3convert":
        c.fail(f"tool is {m.get('tool')!r}, not 'k3convert'")
    if m.get("complete") is not True:
        c.fail(f"not complete (status {m.get('status')!r}): finish the conversion first")
    elif m.get("status") != "complete":
        c.fail(f"complete, but status is {m.get('status')!r}, not 'complete'")
    # what the manifest says DST holds and how its digests were taken: exactly what this tool writes
    if m.get("target_format") != TARGET_FORMAT:
        c.fail(f"target_format is {m.get('target_format')!r}, not {TARGET_FORMAT!r}")
    if m.get("digest_algorithm") != DIGEST_ALGORITHM:
        c.fail(f"digest_algorithm is {m.get('digest_algorithm')!r}: the checksums are taken as "
               f"{DIGEST_ALGORITHM!r}")
    dialect = ((m.get("source") or {}).get("quantization") or {}).get("dialect")
    if dialect not in ckpt.DIALECTS or m.get("source_format") != f"{dialect} MXFP4":
        c.fail(f"source_format is {m.get('source_format')!r}, source.quantization.dialect {dialect!r}: "
               f"expected one of {', '.join(repr(f'{n} MXFP4') for n in sorted(ckpt.DIALECTS))}, naming the dialect")
    if m.get("complete") is True:  # every source shard has its output shard of the same name, and no other
        listed = set((m.get("source") or {}).get("shards") or {})
        for name in sorted(listed - set(m.get("shards") or {})):
            c.fail(f"{name}: source.shards lists it, but shards has no output for it")
        for name in sorted(set(m.get("shards") or {}) - listed):
            c.fail(f"{name}: an output shard of no source shard in source.shards")
    c.summary = f"status {m.get('status')!r}, {m.get('tool')} {m.get('version')}, {len(m.get('shards') or {})} shards"
    return c


def _check_checksums(d: _Dst, workers: int) -> Check:
    c = Check("checksums")
    shards = d.manifest.get("shards") or {}
    todo = []
    for name, rec in sorted(shards.items()):
        path = os.path.join(d.path, name)
        if not os.path.exists(path):
            c.fail(f"{name}: missing")
        elif os.path.getsize(path) != rec.get("bytes"):
            c.fail(f"{name}: {os.path.getsize(path)} bytes, manifest says {rec.get('bytes')}")
        else:
            todo.append((name, path, rec.get("digest")))
    # each shard's chunks are hashed in parallel (converter.digest); a few shards at a time
    # keep several disks busy
    with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
        for (name, _, want), got in zip(todo, pool.map(lambda t: file_digest(t[1]), todo)):
            if got != want:
                c.fail(f"{name}: digest {got} does not match the manifest's {want}")
    indexed = set(((d.index or {}).get("weight_map") or {}).values())
    for name in sorted(indexed - set(shards)):
        c.fail(f"{name}: named by {ckpt.INDEX} but has no manifest entry (no checksum to check)")
    total = sum(int(r.get("bytes") or 0) for r in shards.values())
    c.summary = f"{len(shards)} shard(s), {total / 1e9:.3f} GB: digests (chunked SHA-256) and sizes against the manifest"
    return c


def _check_listing(d: _Dst, c: Check) -> list[str]:
    """Every file under DST against the manifest (``outputs.listing``): one it does not name fails
    (upload would publish it), a temporary is named, not failed (upload never sends one), and
    each file it records beside the shards has its size and digest. Returns the accepted files.
    Only files the walk found are opened: the manifest's names are untrusted."""
    found = listing(d.path)
    named = named_by(d.manifest)
    unnamed = [f for f in found.files if f not in named]
    if "files" not in d.manifest:  # then no file beside the shards can be told from a stray one
        c.fail(f"{MANIFEST} records no files beside the shards (written by an older k3convert): run "
               f"`k3convert finalize DST` to record them ({len(unnamed)} file(s) unnamed)")
    else:
        c.problems += [f"{f}: a file that {MANIFEST} does not name (upload would publish it): remove it"
                       for f in unnamed]
    for f in found.links:
        c.fail(f"{f} is a symlink (to {os.readlink(os.path.join(d.path, f))}): refusing what may lie outside DST")
    if found.temporaries:
        c.notes.append(f"left by an interrupted run, not part of the output (never uploaded; the finalize that "
                       f"completes DST removes them): {', '.join(found.temporaries)}")
    present = set(found.files)
    for rel, rec in sorted((d.manifest.get("files") or {}).items()):
        path = os.path.join(d.path, rel)
        if rel not in present:
            c.fail(f"{rel}: named by {MANIFEST} but missing")
        elif why := regular_problem(path):
            c.fail(f"{rel}: {why}")
        elif os.path.getsize(path) != rec.get("bytes"):
            c.fail(f"{rel}: {os.path.getsize(path)} bytes, {MANIFEST} says {rec.get('bytes')}")
        elif file_digest(path) != rec.get("digest"):
            c.fail(f"{rel}: its digest does not match {MANIFEST}'s (edited after the conversion?)")
    return accepted(found, d.manifest)


# --------------------------------------------------------------------------- (b) structure

def _check_index(d: _Dst, c: Check) -> None:
    wm = (d.index or {}).get("weight_map")
    if not isinstance(wm, dict):
        return
    for name in sorted(set(wm.values())):
        if not os.path.exists(os.path.join(d.path, name)):
            c.fail(f"{name}: named by {ckpt.INDEX} but missing")
    for shard, h in sorted(d.headers.items()):
        for t in sorted(h.tensors):
            if t not in wm:
                c.fail(f"{shard}: tensor {t} is not in {ckpt.INDEX}")
            elif wm[t] != shard:
                c.fail(f"{shard}: tensor {t} is indexed under {wm[t]}")
    for t, shard in sorted(wm.items()):
        if shard in d.headers and t not in d.headers[shard].tensors:
            c.fail(f"{ckpt.INDEX}: {t} -> {shard}, but that shard has no such tensor")
    for name in sorted(set(d.manifest.get("shards") or {}) - set(wm.values())):
        c.fail(f"{name}: in the manifest but not in {ckpt.INDEX}")
    total = sum(i.nbytes for h in d.headers.values() for i in h.tensors.values())
    stated = ((d.index or {}).get("metadata") or {}).get("total_size")
    if stated != total:
        c.fail(f"{ckpt.INDEX}: metadata.total_size is {stated}, the shards hold {total} bytes of tensors")
    c.summary = f"{len(wm)} tensors in {len(set(wm.values()))} shard(s), total_size {stated}"


def int4_block_problems(block: dict) -> list[str]:
    """Why a quantization_config block is not compressed-tensors pack-quantized int4 g32 symmetric."""
    out = []
    if ckpt.is_mxfp4(block) or "mxfp4" in str(block.get("format", "")).lower() or block.get("quant_method") == "mxfp4":
        return ["still describes MXFP4"]
    if block.get("quant_method") != "compressed-tensors":
        out.append(f"quant_method is {block.get('quant_method')!r}, not 'compressed-tensors'")
    if block.get("format") != "pack-quantized":
        out.append(f"format is {block.get('format')!r}, not 'pack-quantized'")
    if block.get("quantization_status") != "compressed":  # "frozen": a loader reads the weights as bf16
        out.append(f"quantization_status is {block.get('quantization_status')!r}, not 'compressed'")
    groups = block.get("config_groups") or {}
    if not groups:
        out.append("has no config_groups")
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    for gname, g in groups.items():
        g = g if isinstance(g, dict) else {}
        if is_fp8_block_group(g):   # the source's FP8 linears, kept as they were (formats/fp8_mxfp4.py)
            continue
        if g.get("format", "pack-quantized") != "pack-quantized":
            out.append(f"config_groups.{gname}.format is {g.get('format')!r}")
        w = g.get("weights") or {}
        out += [f"config_groups.{gname}.weights.{k} is {w.get(k)!r}, expected {v!r}"
                for k, v in want.items() if w.get(k) != v]
        # absent means the default (compressed-tensors QuantizationArgs): static, contiguous groups
        out += [f"config_groups.{gname}.weights.{k} is {w.get(k)!r}, expected {v!r}"
                for k, v in (("dynamic", False), ("actorder", None)) if w.get(k, v) != v]
        if g.get("input_activations"):
            out.append(f"config_groups.{gname} quantizes input activations (W4A16 expected)")
    return out


def fp8_modules(d: _Dst) -> list[str]:
    """Modules DST holds as FP8 block linears: an e4m3 weight beside an fp32 weight_scale."""
    out = []
    for t, (_, info) in d.where.items():
        scale = d.where.get(f"{t}_scale")
        if t.endswith(".weight") and info.dtype == "F8_E4M3" and scale is not None and scale[1].dtype == "F32":
            out.append(t[: -len(".weight")])
    return sorted(out)


def fp8_group_problems(blocks: list[tuple[tuple[str, ...], dict]], fp8: list[str]) -> list[str]:
    """The FP8 block group (formats/fp8_mxfp4.py) names exactly the FP8 linears DST holds, by name."""
    named = sorted({t for _, b in blocks for g in (b.get("config_groups") or {}).values()
                    if is_fp8_block_group(g) for t in g.get("targets") or []})
    out = []
    if set(named) - set(fp8):
        out.append(f"the FP8 group targets {sorted(set(named) - set(fp8))[:5]}, which hold no e4m3 weight and "
                   "fp32 weight_scale")
    if set(fp8) - set(named):
        out.append(f"{len(set(fp8) - set(named))} FP8 linear(s) that no FP8 group names (a loader would read the "
                   f"e4m3 bytes as bf16): {sorted(set(fp8) - set(named))[:5]}")
    return out


def _check_config(d: _Dst, c: Check) -> Check:
    if d.config is None:
        return c  # _load said why
    blocks = ckpt.quant_blocks(d.config)
    if not blocks:
        c.fail("no quantization_config (top-level or nested)")
    for path, block in blocks:
        c.problems += [f"{'.'.join(path)} {p}" for p in int4_block_problems(block)]
    fp8 = fp8_modules(d)
    if not c.problems:
        c.problems += selection_problems(blocks, converted_modules(d),
                                         sorted({t[:-7] for t in d.where if t.endswith(".weight")} - set(fp8)))
        c.problems += fp8_group_problems(blocks, fp8)
    c.summary = "quantization_config at " + (", ".join(".".join(p) for p, _ in blocks) or "nowhere")
    return c


def _name_matcher():
    """compressed-tensors' own ``is_match`` (the loader's rule), else ours (same ``re:`` semantics)."""
    try:
        from compressed_tensors.utils.match import is_match
        return is_match
    except ImportError:
        def is_match(name, module, targets, ignore=()):
            cls = type(module).__name__
            return any(ckpt._matches(name, t) or t == cls for t in targets) and \
                not any(ckpt._matches(name, i) or i == cls for i in ignore)
        return is_match


CHECKED_BY_LOADER = 256  # converted modules whose fast verdict compressed-tensors' is_match re-decides


def _class_names(module) -> set[str]:
    """The class names compressed-tensors' ``_match_class`` matches a module by (LinearBase counts as Linear)."""
    import torch.nn as nn

    names = {c.__name__ for c in type(module).__mro__ if isinstance(c, type) and issubclass(c, nn.Module)}
    return names | ({"Linear"} if "LinearBase" in names else set())


def selection_problems(blocks: list[tuple[tuple[str, ...], dict]], converted: list[str], plain: list[str],
                       shown: int = 5) -> list[str]:
    """Whether the config's targets and ignore lists select exactly the converted modules.

    Decided by compressed-tensors' matcher on the module names a loader sees: a converted
    module (a Linear) must be selected by some group; a module left in bf16 (``X.weight``) must
    not be selected by name, or a loader would look for int4 tensors it lacks. Class targets
    ("Linear") are left to the ignore list for bf16 modules: names alone cannot tell a Linear.

    At K3 scale (70k expert modules) one ``is_match`` call a module costs seconds, so a fast pass
    decides each module with the same rules (exact names as a set, ``re:`` patterns compiled and
    matched from the start, class names against the module's classes); ``is_match`` then decides
    every module the fast pass failed, every bf16 and non-expert module, and a spread of
    ``CHECKED_BY_LOADER`` experts. Should it disagree with the fast pass on any of them, it decides
    every module: the loader's matcher has the last word.
    """
    import re

    import torch.nn as nn

    is_match = _name_matcher()
    linear, unknown = nn.Linear(1, 1, device="meta"), nn.Module()
    kinds = {id(linear): _class_names(linear), id(unknown): _class_names(unknown)}

    def fast_rule(patterns: list[str]):
        names = {p for p in patterns if not p.startswith("re:")}
        rx = [p[3:] for p in patterns if p.startswith("re:")]
        if rx and not any(re.search(r"\\\d|\(\?P=", p) for p in rx):  # one alternation: no backreference renumbered
            try:
                rx = [re.compile("|".join(f"(?:{p})" for p in rx))]
            except re.error:  # e.g. a global flag that must come first: one pattern at a time
                rx = [re.compile(p) for p in rx]
        else:
            rx = [re.compile(p) for p in rx]
        by_class = {k: bool(names & cls) for k, cls in kinds.items()}
        return lambda name, module: name in names or by_class[id(module)] or any(r.match(name) for r in rx)

    def split(patterns: list[str]) -> tuple[set[str], list[str]]:
        """Exact names (match_name is then equality: a set lookup, for lists of 100k names) and the rest."""
        exact = {p for p in patterns if not p.startswith("re:") and "." in p}
        return exact, [p for p in patterns if p not in exact]

    groups = [(g.get("targets") or [], b.get("ignore") or []) for _, b in blocks
              for g in (b.get("config_groups") or {}).values() if not is_fp8_block_group(g)]
    fast = [(fast_rule(t), fast_rule(i)) for t, i in groups]
    loader = [(split(t), split(i)) for t, i in groups]

    def hits(name: str, module, rule: tuple[set[str], list[str]]) -> bool:
        return name in rule[0] or bool(rule[1]) and is_match(name, module, rule[1])

    def by_loader(name: str, module) -> bool:
        return any(hits(name, module, t) and not hits(name, module, i) for t, i in loader)

    def by_fast(name: str, module) -> bool:
        return any(t(name, module) and not i(name, module) for t, i in fast)

    expert = re.compile(EXPERT_TARGET[3:]).match
    experts = [m for m in converted if expert(m)]
    checked = set(spread(experts, CHECKED_BY_LOADER)) | (set(converted) - set(experts))
    verdict = {m: by_fast(m, linear) for m in converted}
    plain_verdict = {m: by_fast(m, unknown) for m in plain}
    checked |= {m for m, ok in verdict.items() if not ok}
    agree = all(by_loader(m, linear) == verdict[m] for m in sorted(checked)) and \
        all(by_loader(m, unknown) == ok for m, ok in plain_verdict.items())
    if not agree:
        verdict = {m: by_loader(m, linear) for m in converted}
        plain_verdict = {m: by_loader(m, unknown) for m in plain}

    out = []
    lost = [m for m in converted if not verdict[m]]
    if lost:
        out.append(f"the targets/ignore lists do not select {len(lost)} converted module(s) (a loader would read "
                   f"them as bf16): {', '.join(lost[:shown])}" + (" ..." if len(lost) > shown else ""))
    extra = [m for m in plain if plain_verdict[m]]
    if extra:
        out.append(f"the targets select {len(extra)} module(s) that are not int4 (a loader would look for "
                   f"int4 tensors): {', '.join(extra[:shown])}" + (" ..." if len(extra) > shown else ""))
    return out


def _ignore_patterns(config: dict | None) -> list[str]:
    return [i for _, b in ckpt.quant_blocks(config or {}) for i in b.get("ignore") or []]


def converted_modules(d: _Dst) -> list[str]:
    """Every module that has a weight_packed tensor, sorted."""
    return sorted(t[: -len(PACKED) - 1] for t in d.where if t.endswith("." + PACKED))


def _check_tensors(d: _Dst) -> Check:
    c = Check("tensors")
    modules = converted_modules(d)
    ignore = _ignore_patterns(d.config)
    fds: dict[str, int] = {}
    try:
        for m in modules:
            shard, p = d.where[f"{m}.{PACKED}"]
            s = d.where.get(f"{m}.{SCALE}")
            sh = d.where.get(f"{m}.{SHAPE}")
            if p.dtype != "I32" or len(p.shape) != 2:
                c.fail(f"{m}.{PACKED}: {p.dtype}{list(p.shape)}, expected 2-D I32 (MXFP4 left unconverted?)")
                continue
            rows, cols = p.shape[0], p.shape[1] * 8
            if cols % 32:
                c.fail(f"{m}.{PACKED}: in-dim {cols} is not a multiple of the group size 32")
            if s is None:
                c.fail(f"{m}: no {SCALE}")
            elif s[1].dtype != "BF16" or s[1].shape != (rows, cols // 32):
                c.fail(f"{m}.{SCALE}: {s[1].dtype}{list(s[1].shape)}, expected BF16{[rows, cols // 32]}")
            if sh is None:
                c.fail(f"{m}: no {SHAPE}")
            elif sh[1].dtype != "I64" or sh[1].shape != (2,):
                c.fail(f"{m}.{SHAPE}: {sh[1].dtype}{list(sh[1].shape)}, expected I64[2]")
            else:
                if sh[0] not in fds:
                    fds[sh[0]] = os.open(os.path.join(d.path, sh[0]), os.O_RDONLY)
                raw = os.pread(fds[sh[0]], 16, sh[1].start)
                value = [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)]
                if value != [rows, cols]:
                    c.fail(f"{m}.{SHAPE}: holds {value}, but {PACKED} is for [{rows}, {cols}]")
            if any(ckpt._matches(m, pat) for pat in ignore):
                c.fail(f"{m}: quantized, but the config's ignore list excludes it (a loader would read it as bf16)")
    finally:
        for fd in fds.values():
            os.close(fd)
    for t, (_, info) in sorted(d.where.items()):  # leftovers: an int4 shape or an E8M0 scale alone
        orphan = (t.endswith("." + SHAPE) or t.endswith("." + SCALE) and info.dtype == "U8") and \
            f"{t.rsplit('.', 1)[0]}.{PACKED}" not in d.where
        if orphan:
            c.fail(f"{t}: {info.dtype}{list(info.shape)} with no {PACKED} beside it")
    c.summary = f"{len(modules)} quantized module(s): I32 packed, BF16 scale, I64 shape, consistent"
    return c


def _check_situ(d: _Dst) -> Check:
    """SPEC §4: the activation must be stated in config, in every shard, and in the manifest."""
    c = Check("situ")
    if d.config is None:
        c.fail("no config.json: the expert activation cannot be stated")
        return c
    mact = d.manifest.get("activation")
    mact = mact if isinstance(mact, dict) else {}
    try:   # the optional fields the manifest states (MiniMax swiglu_beta) are read and type-checked too
        act = ckpt.activation(d.config, os.path.join(d.path, "config.json"), optional=tuple(mact))
    except BadInput as e:
        c.fail(str(e))
        return c
    for shard, h in sorted(d.headers.items()):
        for k, v in act.items():
            if h.metadata.get(k) != metadata_value(v):
                c.fail(f"{shard}: metadata {k} is {h.metadata.get(k)!r}, config says {v!r}")
    for k, v in act.items():
        if k not in mact or str(mact[k]) != str(v):
            c.fail(f"{MANIFEST}: activation.{k} is {mact.get(k)!r}, config says {v!r}")
    for k in mact:
        if k not in act:
            c.fail(f"{MANIFEST}: activation.{k} is {mact[k]!r}, config.json does not state it")
    c.summary = ", ".join(f"{k}={v}" for k, v in act.items()) + \
        f" (config, {len(d.headers)} shard metadata, manifest)"
    return c


def table_rows(table: list[dict], path: str) -> dict[str, dict]:
    """The figure table's rows by tensor name; VerifyFailed naming the first line that lacks a field of
    ROW_TYPES or holds one of another type. One inline type test a row; the detailed check on failure."""
    rows: dict[str, dict] = {}
    num = (int, float)
    for i, r in enumerate(table):
        if not (type(r) is dict and type(r.get("name")) is str and type(r.get("rel_rmse")) in num
                and type(r.get("max_abs")) in num):
            _typed(r, ROW_TYPES, path, f"line {i + 1}")
            missing = [k for k in ROW_TYPES if k not in r]
            if missing:
                raise VerifyFailed(f"line {i + 1} has no {', '.join(missing)}", file=path)
        rows[r["name"]] = r
    return rows


def _check_figures(d: _Dst) -> tuple[Check, dict[str, dict]]:
    c = Check("figures")
    path = os.path.join(d.path, TENSOR_TABLE)
    rows: dict[str, dict] = {}
    if not os.path.exists(path):
        c.fail(f"{TENSOR_TABLE} is missing")
        return c, rows
    try:
        table = read_rows(path)
    except Exception as e:  # zstd or JSON damage: a problem of DST, not a crash
        c.fail(f"{TENSOR_TABLE} is unreadable ({e})")
        return c, rows
    rows = table_rows(table, path)
    want = {f"{m}.{PACKED}" for m in converted_modules(d)}
    for n in sorted(want - set(rows)):
        c.fail(f"{n}: converted but has no row in {TENSOR_TABLE}")
    for n in sorted(set(rows) - want):
        c.fail(f"{n}: row in {TENSOR_TABLE} but no such converted tensor")
    for n, r in sorted(rows.items()):
        if r.get("nonfinite") or not math.isfinite(r.get("rel_rmse", math.nan)):
            c.fail(f"{n}: non-finite values or error recorded")
    report = _read_obj(os.path.join(d.path, REPORT), c, REPORT_TYPES)
    if report is not None and report.get("tensors") != len(rows):
        c.fail(f"{REPORT} counts {report.get('tensors')} tensors, {TENSOR_TABLE} has {len(rows)}")
    worst = max((r["rel_rmse"] for r in rows.values()), default=0.0)
    c.summary = f"{len(rows)} per-tensor rows, worst relative RMSE {worst:.4f}"
    if line := ratio_line(error_ratio(list(rows.values())), scale_rule(d)):
        c.notes.append(line)
    return c, rows


# --------------------------------------------------------------------------- (c) re-decode

def _int4_reader() -> tuple[str, Any]:
    """compressed-tensors' own unpacker when importable (the independent path), else ours."""
    try:
        import compressed_tensors
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        def read(words: torch.Tensor, scales: torch.Tensor, shape: list[int]) -> torch.Tensor:
            q = unpack_from_int32(words, 4, torch.Size(shape))
            return q.double() * scales.double().repeat_interleave(32, dim=1)

        return f"compressed_tensors {compressed_tensors.__version__} unpack_from_int32", read
    except ImportError:
        from .formats import int4

        def read(words: torch.Tensor, scales: torch.Tensor, shape: list[int]) -> torch.Tensor:
            return int4.decode(words, scales).double()  # q * bf16 is exact in float32

        return "converter.formats.int4.decode (compressed_tensors not importable)", read


def spread(items: list, k: int | None) -> list:
    """``k`` items evenly spaced over ``items`` (first and last included); all when k is None."""
    n = len(items)
    if k is None or k >= n:
        return list(items)
    if k <= 0:
        return []
    if k == 1:
        return [items[n // 2]]
    return [items[round(i * (n - 1) / (k - 1))] for i in range(k)]


_ALL_BF16 = None


def _all_bf16_scales() -> torch.Tensor:
    """Every positive normal bf16 value, in float64 (the scales an int4 group may have)."""
    global _ALL_BF16
    if _ALL_BF16 is None:
        bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32) << 16
        _ALL_BF16 = bits.view(torch.float32).double()
    return _ALL_BF16


def brute_force_min(values: torch.Tensor, qmin: int = -8) -> torch.Tensor:
    """Least squared error of each group [G, 32] over every positive normal bf16 scale S, with
    codes in ``[qmin, 7]`` (-7: ``optimal-pm7``; the bounds below hold for both ranges).

    Only S in [a/16, 2a] (a = the group's largest |value|) can win, so only those are tried.
    S > 2a rounds everything to 0 (error sum v^2), which S = a (bf16: an MXFP4 value) never
    exceeds. S < a/16 caps |q S| at 8 S < a/2, an error above a^2/4 on the largest value,
    while some bf16 S in [a/7, a/6.9] (bf16 steps are <= 2^-7 relative) covers every value
    within S/2: a total below 32 (a/13.8)^2 < a^2/4. tests/test_verify_inspect.py checks
    the pruned search against the full one.
    """
    scales = _all_bf16_scales()
    out = torch.zeros(values.shape[0], dtype=torch.float64)
    for i, v in enumerate(values):
        a = float(v.abs().max())
        if a == 0:
            continue
        s = scales[(scales >= a / 16) & (scales <= 2 * a)]
        q = torch.clamp(torch.round(v[None, :] / s[:, None]), qmin, 7)
        out[i] = ((q * s[:, None] - v[None, :]) ** 2).sum(1).min()
    return out


def _has_minus_8(words: torch.Tensor) -> bool:
    """Whether packed int4 words hold code -8 (nibble 0; a zero group is nibble 8, code 0)."""
    b = words.contiguous().view(torch.uint8)
    return bool(((b & 15) == 0).any() or ((b >> 4) == 0).any())


SHOWN_DIFFERENCES = 5  # field differences named per file


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where a JSON value read from DST differs from the one SRC gives, as dotted field paths."""
    if got == want:
        return []
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for k in sorted(set(got) | set(want), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in got:
                out.append(f"{p} is missing, SRC gives {_short(want[k])}")
            elif k not in want:
                out.append(f"{p} is {_short(got[k])}, SRC gives no such field")
            else:
                out += differences(got[k], want[k], p)
        return out
    return [f"{path or 'the document'} is {_short(got)}, SRC gives {_short(want)}"]


def _short(value: Any, limit: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _shard_problem(path: str, want: Expected, name: str, header: Header) -> str | None:
    """Why DST's shard ``name`` is not laid out as SRC gives it (header bytes and size), or None."""
    layout = want.shards[name].layout
    with os.fdopen(open_regular(path), "rb") as f:
        head = f.read(len(layout.header))
        size = os.fstat(f.fileno()).st_size
    if head == layout.header and size == layout.file_size:
        return None
    have, expect = set(header.tensors), {t.name for t in layout.tensors}
    for what, names in (("lacks", expect - have), ("holds the extra", have - expect)):
        if names:
            return f"{name}: {what} tensor(s) {', '.join(sorted(names)[:SHOWN_DIFFERENCES])}"
    if diff := differences(header.metadata, layout.metadata, "metadata"):
        return f"{name}: {diff[0]}"
    return f"{name}: {size} bytes, header of {len(head)}: SRC gives {layout.file_size} bytes and another " \
        "header (a tensor's dtype, shape, offset or order)"


def _document_problem(name: str, raw: bytes, parsed: Any, want: Any) -> str | None:
    """Why DST's JSON file ``name`` (its bytes, and as read) is not what SRC gives, naming fields."""
    if raw == json_bytes(want):
        return None
    diff = (differences(parsed, want) if parsed is not None else []) or ["other bytes than SRC gives"]
    more = f" (and {len(diff) - SHOWN_DIFFERENCES} more)" if len(diff) > SHOWN_DIFFERENCES else ""
    return f"{name}: " + "; ".join(diff[:SHOWN_DIFFERENCES]) + more


def _from_source(src: str, d: _Dst, files: list[str]) -> Check:
    """Recompute from SRC what DST must hold (``outputs.expected``, the list finalize writes) and
    compare every file: each shard's header and size, config.json and the index byte for byte
    (naming the fields that differ), each side file byte for byte, and no file besides."""
    c = Check("from source")
    opts = d.manifest.get("options") or {}
    plan = build_plan(src, opts.get("profile"), bool(opts.get("drop_activation_quant")))  # BadInput: exit 2
    want = expected(plan, scale_rule(d))
    have = set(files)
    for name in sorted(want.names - have):
        c.fail(f"{name}: SRC gives it, DST lacks it")
    for name in sorted(have - want.names - set(BOOKKEEPING) - {README}):
        c.fail(f"{name}: in DST, but SRC gives no such file")
    parsed = {ckpt.INDEX: d.index, CONFIG: d.config}  # as _load read them (None: it said why)
    for name in sorted(have & want.names):
        path = os.path.join(d.path, name)
        try:
            if name in want.shards:  # an unreadable header: the files check says why
                why = _shard_problem(path, want, name, d.headers[name]) if name in d.headers else None
            elif name in want.documents:
                why = _document_problem(name, read_regular(path), parsed.get(name), want.documents[name])
            elif file_digest(path) != file_digest(os.path.join(src, want.side_files[name])):
                why = f"{name}: differs from SRC's {want.side_files[name]} (side files are copied byte-identical)"
            else:
                why = None
        except ConvertError as e:  # a FIFO or device in place of the file
            why = str(e)
        if why:
            c.fail(why)
    c.summary = (f"{len(want.shards)} shard layout(s), {len(want.documents)} derived file(s) and "
                 f"{len(want.side_files)} side file(s) recomputed from SRC, compared with DST's, no other file")
    return c


def _source_identity(src: str, d: _Dst) -> Check:
    c = Check("source")
    recorded = (d.manifest.get("source") or {}).get("shards") or {}
    from .manifest import file_fingerprint
    for name, fp in sorted(recorded.items()):
        path = os.path.join(src, plain_name(name, os.path.join(d.path, MANIFEST)))
        if not os.path.exists(path):
            c.fail(f"{name}: not in {src}")
            continue
        now = file_fingerprint(path)
        if (now["size"], now["edge_blake2b"]) != (fp.get("size"), fp.get("edge_blake2b")):
            c.fail(f"{name}: differs from the file converted (size or first/last MiB changed)")
    c.summary = f"{src}: {len(recorded)} shard(s) against the manifest's fingerprints"
    return c


class _Tensors:
    """Tensors by name through safetensors.safe_open, one open handle per file."""

    def __init__(self, root: str, weight_map: dict[str, str]):
        self.root, self.wm, self.handles = root, weight_map, {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = self.wm.get(name)
        if shard is None:
            raise KeyError(name)
        if shard not in self.handles:
            self.handles[shard] = safe_open(os.path.join(self.root, shard), framework="pt")
        return self.handles[shard].get_tensor(name)


def scale_rule(d: _Dst) -> str:
    """The scale rule DST was written with (manifest; config must agree), default ``optimal``."""
    rule = recorded_rule(d.manifest)
    if rule not in SCALE_RULES:
        raise VerifyFailed(f"scale_rule {rule!r} is not one of {', '.join(SCALE_RULES)}",
                           file=os.path.join(d.path, MANIFEST))
    for path, block in ckpt.quant_blocks(d.config or {}):
        said = block.get(RULE_KEY)
        if said is not None and said != rule:
            raise VerifyFailed(f"{ckpt.dotted(path)}.{RULE_KEY} is {said!r}, the manifest says {rule!r}",
                               file=os.path.join(d.path, "config.json"))
    return rule


def _same_as_rule(m: str, packed, scales, bias: int, words, int4_scales, check: Check) -> int:
    """Compare DST's bytes of module ``m`` with the server rule on the source bytes; groups compared."""
    from .formats.mxfp4 import to_ocp
    from .quant import server_rule

    g = packed.numel() // 16
    s = to_ocp(scales.reshape(-1), bias)
    want = server_rule.requantize(packed.reshape(g, 16), s)
    got_q = words.contiguous().view(torch.uint8).reshape(-1, 16)
    got_s = int4_scales.contiguous().view(torch.int16).reshape(-1)
    if got_q.shape[0] != g or got_s.numel() != g:
        check.fail(f"{m}: {got_q.shape[0]} int4 group(s), the source has {g}")
        return 0
    differ = int(((got_q != want.packed).any(dim=1) | (got_s != want.scales.view(torch.int16))).sum())
    if differ:
        check.fail(f"{m}: {differ} of {g} group(s) differ from the server rule on the source bytes")
    return g


def _redecode(src: str, d: _Dst, rows: dict[str, dict], sample: int | None, result: VerifyResult) -> list[Check]:
    from .formats import mxfp4

    src_wm = ckpt.weight_map(src)   # BadInput (exit 2) when the source is unreadable
    ident = _source_identity(src, d)
    c = Check("re-decode")
    rule = scale_rule(d)
    opt = Check("optimality" if rule in OPTIMA else "scale rule")  # vllm-gfx942 is not the optimum
    copy = Check("passthrough")
    result.decoder, read_int4 = _int4_reader()
    s_t, d_t = _Tensors(src, src_wm), _Tensors(d.path, {t: s for t, (s, _) in d.where.items()})
    # the source's dialect, as the conversion recorded it: tensor names and E8M0 bias
    quant = (d.manifest.get("source") or {}).get("quantization") or {}
    packed_suffix, bias = quant.get("packed_suffix", PACKED), int(quant.get("scale_bias", 127))
    names = spread(sorted(rows), sample)
    worst_dev, opt_groups = 0.0, 0
    for i, name in enumerate(names):
        m = name[: -len(PACKED) - 1]
        try:
            src_packed, src_scales = s_t.get(f"{m}.{packed_suffix}"), s_t.get(f"{m}.{SCALE}")
            w = mxfp4.decode(src_packed, src_scales, bias, torch.float64)
        except KeyError as e:
            c.fail(f"{m}: the source has no {e.args[0]}")
            continue
        try:
            shape = d_t.get(f"{m}.{SHAPE}").tolist()
            if shape != list(w.shape):
                c.fail(f"{m}: {SHAPE} {shape}, the source is {list(w.shape)}")
                continue
            words, int4_scales = d_t.get(f"{m}.{PACKED}"), d_t.get(f"{m}.{SCALE}")
            wq = read_int4(words, int4_scales, shape)
        except Exception as e:  # missing or malformed output tensors: the structure checks say which
            c.fail(f"{m}: cannot be read back ({type(e).__name__}: {e})")
            continue
        bad = int((~torch.isfinite(wq)).sum())
        if bad:
            c.fail(f"{m}: {bad} non-finite int4 value(s)")
            continue
        diff = wq - w
        err2, ref2 = float((diff * diff).sum()), float((w * w).sum())
        rel = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
        want = rows[name]["rel_rmse"]
        dev = abs(rel - want) / max(abs(want), 1e-30) if rel != want else 0.0
        worst_dev = max(worst_dev, dev)
        if dev > REL_TOL:
            c.fail(f"{name}: re-decoded relative RMSE {rel:.9g}, table says {want:.9g} (off by {dev:.2e} relative)")
        max_abs = float(diff.abs().max()) if diff.numel() else 0.0
        if abs(max_abs - rows[name]["max_abs"]) > REL_TOL * max(rows[name]["max_abs"], 1e-30):
            c.fail(f"{name}: re-decoded max abs error {max_abs:.9g}, table says {rows[name]['max_abs']:.9g}")
        if OPTIMA.get(rule, -8) > -8 and _has_minus_8(words):
            opt.fail(f"{m}: code -8 written, outside the {rule} rule's range [{OPTIMA[rule]}, 7]")
        if rule not in OPTIMA:
            opt_groups += _same_as_rule(m, src_packed, src_scales, bias, words, int4_scales, opt)
        elif i < OPT_TENSORS:
            g_err = (diff * diff).reshape(-1, 32).sum(1)
            picks = torch.unique(torch.cat((g_err.topk(min(OPT_GROUPS // 2, g_err.numel())).indices,
                                            torch.linspace(0, g_err.numel() - 1, OPT_GROUPS // 2).long())))
            best = brute_force_min(w.reshape(-1, 32)[picks], OPTIMA[rule])
            for g, e, b in zip(picks.tolist(), g_err[picks].tolist(), best.tolist()):
                if e > b * (1 + 1e-12) + 1e-300:
                    opt.fail(f"{m}: group {g} has squared error {e:.6g}, the best bf16 scale gives {b:.6g}")
            opt_groups += len(picks)
    result.sampled = len(names)
    c.summary = (f"{len(names)} of {len(rows)} tensor(s) from the source bytes; largest deviation from the "
                 f"table {worst_dev:.1e} (limit {REL_TOL:g}); int4 read by {result.decoder}")
    opt.summary = f"{opt_groups} group(s) of {min(len(names), OPT_TENSORS)} tensor(s) vs every bf16 scale" \
        + (f" (codes [{OPTIMA[rule]}, 7]; no -8 in {len(names)} tensor(s))" if OPTIMA[rule] > -8 else "") \
        if rule in OPTIMA else f"{opt_groups} group(s) of {len(names)} tensor(s) byte-identical to the {rule} rule " \
        "(quant/server_rule.py) applied to the source bytes"
    if not names:
        c.skipped = opt.skipped = True

    produced = {f"{m}.{x}" for m in converted_modules(d) for x in (PACKED, SCALE, SHAPE)}
    others = spread(sorted(t for t in d.where if t not in produced), sample)
    renamed = [tuple(r) for r in quant.get("renamed") or [] if isinstance(r, list) and len(r) == 2]
    for t in others:
        try:
            a, b = s_t.get(source_name(t, renamed)), d_t.get(t)
        except KeyError:
            copy.fail(f"{t}: not in the source")
            continue
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.reshape(-1).view(torch.uint8),
                                                                        b.reshape(-1).view(torch.uint8)):
            copy.fail(f"{t}: differs from the source ({b.dtype}{list(b.shape)} vs {a.dtype}{list(a.shape)})")
    copy.summary = f"{len(others)} non-expert tensor(s) byte-identical to the source"
    return [ident, c, opt, copy]


# --------------------------------------------------------------------------- entry point

def verify(dst: str, source: str | None = None, sample: int | None = 8, *, checksums: bool = True,
           workers: int = 4, serving: tuple[str, int] | None = None) -> VerifyResult:
    """Verify DST; problems are listed in the result (BadInput only when DST or SRC is unreadable).

    ``sample``: converted tensors re-decoded when ``source`` is given (None: every one).
    ``checksums=False`` skips hashing the shards (the structural checks stay).
    ``serving=(server, tp)`` adds the "serving" check: the rules of that server's int4 MoE path.
    """
    files, index, config = Check("files"), Check("index"), Check("config")
    d = _load(dst, files, index, config)
    result = VerifyResult(d.path)
    result.checks.append(_check_manifest(d))
    if checksums:
        result.checks.append(_check_checksums(d, workers))
    else:
        result.checks.append(Check("checksums", "not computed (structure only)", skipped=True))
    result.files = _check_listing(d, files)
    files.summary = (f"{len(result.files)} file(s), each named by the manifest; {len(d.headers)} shard(s) with "
                     "readable safetensors headers")
    _check_index(d, index)
    result.checks += [files, index, _check_config(d, config), _check_tensors(d), _check_situ(d)]
    figs, rows = _check_figures(d)
    result.checks.append(figs)
    if source is not None:
        src = os.path.abspath(source)
        if not os.path.isdir(src):
            raise BadInput("not a directory", file=src)
        result.checks.append(_from_source(src, d, result.files))
        result.checks += _redecode(src, d, rows, sample, result)
    else:
        where = (d.manifest.get("source") or {}).get("path")
        result.checks.append(Check("re-decode", f"not run: give --source (the manifest names {where})",
                                   skipped=True))
    if serving is not None:
        result.checks.append(serving_check(d.config, {t: info for t, (_, info) in d.where.items()}, *serving))
    return result
