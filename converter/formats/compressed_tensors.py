"""compressed-tensors ``mxfp4-pack-quantized`` sources: ``X.weight_packed`` + ``X.weight_scale``.

Registered as the dialect "compressed-tensors". Which modules convert follows the config's own
targets and ignore list; which E8M0 bias the bytes carry follows its ``version``
(docs/mxfp4_dialects.md).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from ..errors import BadInput
from .dialect import (
    DEFAULT_RULE,
    MXFP4_FORMAT,
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
from .json_input import ListOf, MapOf, Nullable, type_problems
from .match import LINEAR, CtRule


@dataclass(frozen=True)
class CompressedTensorsSource(MXFP4Source):
    """compressed-tensors ``mxfp4-pack-quantized``: ``X.weight_packed`` + ``X.weight_scale``."""

    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def selects(self, module: str) -> bool:
        """compressed-tensors' own rule (``match.CtRule``) on a packed module, which its loader made
        from a torch Linear: a class target selects it if it names Linear or Module."""
        return self._rule(module, LINEAR)

    @functools.cached_property
    def _rule(self) -> CtRule:
        return CtRule.of(self.targets, self.ignore)

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str],
                    rule: str = DEFAULT_RULE) -> dict:
        """Every MXFP4 block replaced (kv-cache and MoE-sparsity kept); targets name exactly the
        converted modules, and the ignore list is the source's less what vLLM would misread
        (``int4_targets``)."""
        def make(old: dict) -> dict:
            keep = {k: old[k] for k in ("kv_cache_scheme", "moe_sparsity_config") if old.get(k) is not None}
            return int4_block(*int4_targets(converted, unconverted, old.get("ignore") or []), keep, rule)
        return self.rewrite(config, make)


# compressed-tensors versions whose MXFP4 scale bytes are not OCP E8M0 (docs/mxfp4_dialects.md)
_CT_ALIAS = ("0.12.3a20251023", "0.12.3a20251203")   # MXFP4 was an NVFP4 alias: float scales
_CT_BIAS125 = ("0.12.3a20251204", "0.13.1a20260108")  # E8M0 written with bias 125 (a double -2)


# Writers that pack MXFP4 with their own code and only describe it with compressed-tensors' config
# classes: the config's ``version`` then names the compressed-tensors that wrote the JSON, not the bytes.
# auto-round 0.16 (model-free export, ``provider: "auto-round"``, utils/model_free_utils.py 2586-2589,
# 2744-2752) writes each E8M0 byte as shared exponent + 127 (export/export_to_autoround/qlinear_fp.py
# 44, 170) whatever compressed-tensors is installed.
OWN_PACKERS = {"auto-round": "auto-round's own packer (qlinear_fp.py: exponent + 127)"}


def ct_scale_convention(block: dict, where: str) -> tuple[int, str]:
    """(bias, description) of the E8M0 bytes a compressed-tensors release wrote.

    Only the ``version`` in the config tells: the bytes themselves look the same. No version
    (Kimi K3's config has none) is read as OCP, as vLLM and SGLang read it. A config whose
    ``provider`` packed the bytes itself (``OWN_PACKERS``) is OCP whatever its version says.
    """
    from packaging.version import InvalidVersion, Version

    provider = block.get("provider")
    if isinstance(provider, str) and provider in OWN_PACKERS:
        return 127, f"OCP E8M0 (bias 127; {OWN_PACKERS[provider]}, config by compressed-tensors {block.get('version')})"
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


MXFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 32}  # what mxfp4-pack-quantized stores

# the types of the fields read below (compressed-tensors' own QuantizationConfig types)
_ARGS = Nullable({"num_bits": int, "type": str, "group_size": Nullable(int), "strategy": Nullable(str),
                  "symmetric": Nullable(bool), "actorder": Nullable(str), "scale_dtype": Nullable(str)})
CT_BLOCK_TYPES = {
    "quant_method": str, "format": Nullable(str), "quantization_status": Nullable(str), "version": Nullable(str),
    "ignore": Nullable(ListOf(str)), "transform_config": Nullable(dict), "sparsity_config": Nullable(dict),
    "kv_cache_scheme": Nullable(dict), "moe_sparsity_config": Nullable(dict),
    "config_groups": Nullable(MapOf({"targets": Nullable(ListOf(str)), "format": Nullable(str), "weights": _ARGS,
                                     "input_activations": _ARGS, "output_activations": _ARGS})),
}


def _declares_mxfp4(group: dict, block: dict) -> bool:
    """The group's format (else the block's) says mxfp4-pack-quantized: its weights args must then agree."""
    return (group.get("format") or block.get("format")) == MXFP4_FORMAT


def _group_is_mxfp4(group: dict, block: dict) -> bool:
    w = group.get("weights") or {}
    return _declares_mxfp4(group, block) and all(w.get(k) == v for k, v in MXFP4_WEIGHTS.items())


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
        if not _declares_mxfp4(g, block):
            fmt_at = f"{at}.format" if g.get("format") else f"{where}.format"
            out.append(f"{fmt_at} is {g.get('format') or block.get('format')!r}, not {MXFP4_FORMAT!r}: only "
                       "checkpoints whose quantized weights are all MXFP4 are converted")
            continue
        wrong = [f"{at}.weights.{k} is {w.get(k)!r}, expected {v!r}" for k, v in MXFP4_WEIGHTS.items()
                 if w.get(k) != v]
        if wrong:
            out.append("; ".join(wrong) + f" ({MXFP4_FORMAT} holds 4-bit float weights in groups of 32)")
            continue
        if w.get("actorder") not in (None, "static") or w.get("dynamic") not in (None, False) \
                or w.get("strategy", "group") != "group" or w.get("scale_dtype") not in (None, "uint8", "torch.uint8"):
            out.append(f"{at}.weights is not plain MXFP4 ({json.dumps(w, sort_keys=True)})")
        for kind in ("input_activations", "output_activations"):
            if g.get(kind):
                drop_or_refuse(f"{at}.{kind}", g[kind], f"{kind.replace('_', ' ')} ({_describe(g[kind])})",
                               drop, dropped, out)
    return out


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
        wrong = type_problems(b, CT_BLOCK_TYPES, where)
        if wrong:  # the checks below read these fields: name them instead
            problems += wrong
            continue
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


def is_ct_mxfp4(block: dict) -> bool:
    """Whether a compressed-tensors block says it is MXFP4, itself or in a config group (its reader
    then names any field that disagrees)."""
    groups = block.get("config_groups")
    return block.get("quant_method") == "compressed-tensors" and (block.get("format") == MXFP4_FORMAT or (
        isinstance(groups, dict) and any(isinstance(g, dict) and _declares_mxfp4(g, block) for g in groups.values())))


register(Dialect("compressed-tensors", lambda b: b.get("quant_method") == "compressed-tensors", is_ct_mxfp4,
                 compressed_tensors_source))
