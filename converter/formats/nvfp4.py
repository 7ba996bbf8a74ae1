"""NVFP4 sources: which linears hold NVFP4 weights, and their values, in the three layouts read.

NVFP4 is E2M1 codes (two a byte, element 2j in the low nibble), one FP8 E4M3 scale per 16 inputs and
one FP32 scale per tensor. The layouts differ in names and in how the FP32 scale applies
(docs/nvfp4.md, with the evidence):

* compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor, auto-round's ``llm_compressor`` format):
  ``X.weight_packed`` U8, ``X.weight_scale`` F8_E4M3, ``X.weight_global_scale`` F32; value =
  code * scale / global (``forward_helpers.py`` ``scale = scale / global_scale``);
* auto-round's own format, ``data_type "nv_fp"``: the same tensors and rule (``qlinear_fp.py`` 154-188);
* ModelOpt (``quant_method "modelopt"``, ``quant_algo "NVFP4"``): ``X.weight`` U8, ``X.weight_scale``
  F8_E4M3, ``X.weight_scale_2`` F32; value = code * scale * scale_2 (compressed-tensors' own converter,
  ``entrypoints/convert/converters/modelopt_nvfp4.py`` 82-130: ``weight_global_scale = 1 / weight_scale_2``).

Input activation scales (``input_global_scale``, ``input_scale``) serve W4A4 only and are dropped,
like every other activation quantization, only with ``--drop-activation-quant``.
"""
from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ClassVar

from ..errors import BadInput
from ..quant.rules import DEFAULT as DEFAULT_RULE, ScaleRule
from .auto_round import QUANT_METHOD as AUTO_ROUND, AutoRoundSource, auto_round_source
from .dialect import (
    DROP_FLAG,
    Dialect,
    MXFP4Source,
    dotted,
    drop_or_refuse,
    format_name,
    int4_block,
    int4_targets,
    quant_blocks,
    register,
)
from .match import LINEAR, CtRule

NVFP4_FORMAT = "nvfp4-pack-quantized"
GROUP, BLOCK = 32, 16   # the int4 group written; NVFP4's block (quant/nvfp4_requant.py, imported when used)
NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 16}


class Layout(Enum):
    COMPRESSED_TENSORS = "compressed-tensors nvfp4-pack-quantized"
    AUTO_ROUND = "auto-round nv_fp"
    MODELOPT = "ModelOpt NVFP4"


DIALECT = "nvfp4"   # the registered name profiles and the manifest use for every NVFP4 layout
_WRITER = {Layout.COMPRESSED_TENSORS: "compressed-tensors", Layout.AUTO_ROUND: "auto-round",
           Layout.MODELOPT: "ModelOpt"}
Described = tuple[str, tuple[int, ...]]   # (safetensors dtype, shape) of a tensor


def global_problem(g: float) -> str | None:
    """Why a global scale's value cannot be decoded, or None."""
    return None if 0 < g < math.inf else f"{g!r}: a global scale must be one finite positive number"


def scale_problem(scales: Any) -> str | None:
    """Why loaded block scales (float8_e4m3fn ``[out, in/16]``) cannot be decoded: the first NaN or
    negative one, by row and block; or None."""
    import torch

    f = scales.float()
    bad = (torch.isnan(f) | (f < 0)).nonzero()
    if not len(bad):
        return None
    r, g = (int(x) for x in bad[0])
    return f"block {g} of row {r}: a NaN or negative E4M3 scale"


def nvfp4_format(layout: Layout) -> str:
    """What the manifest and report call a source of ``layout`` (``source_format``)."""
    return format_name(_WRITER[layout], Nvfp4Source.fp4)


@dataclass(frozen=True)
class Nvfp4Source(MXFP4Source):
    """Where a checkpoint keeps its NVFP4 linears, which ones, and how to read their values.

    An :class:`MXFP4Source` for the plan and the manifest (same suffix fields, same int4 output config);
    ``global_suffix`` and ``divide`` say where the per-tensor FP32 scale is and how it applies."""

    layout: Layout = Layout.COMPRESSED_TENSORS
    global_suffix: str = "weight_global_scale"
    divide: bool = True                            # value = ... / global (else * global)
    rule: Callable[[str], bool] = field(compare=False, default=lambda m: True)

    fp4: ClassVar[str] = "NVFP4"

    @property
    def writer(self) -> str:
        return _WRITER[self.layout]

    @property
    def scale_rules(self) -> tuple[ScaleRule, ...]:
        """The optimum over codes [-8, 7] only: a group spans two E4M3 blocks, so it is not exact, and the
        other rules are not offered for it (docs/nvfp4.md)."""
        return (ScaleRule.OPTIMAL,)

    @property
    def restated_files(self) -> tuple[str, ...]:
        """ModelOpt's exporter describes the NVFP4 quantization again in ``hf_quant_config.json``:
        copied, it would describe DST's int4 weights as NVFP4."""
        return (MODELOPT_FILE,) if self.layout is Layout.MODELOPT else ()

    def selects(self, module: str) -> bool:
        return self.rule(module)

    def states(self, block: dict) -> bool:
        return is_nvfp4(block)

    def problem(self, m: str, packed: Described, scale: Described | None, gs: Described | None) -> str | None:
        """Why module ``m``'s three tensors (dtype and shape, from a header or loaded) are not an NVFP4
        linear this tool converts, or None. ``packed`` is a ``packed_suffix`` tensor (``packs``)."""
        if packed[0] != "U8":
            return f"expected U8 packed E2M1 codes, got {packed[0]}"
        if scale is None or gs is None:
            return f"packed NVFP4 needs {self.scale_suffix} and {self.global_suffix} beside it"
        if not self.selects(m):
            return f"packed NVFP4, but the quantization config does not select {m}"
        if scale[0] != "F8_E4M3" or gs[0] != "F32":
            return f"expected F8_E4M3 {self.scale_suffix} and F32 {self.global_suffix}, got {scale[0]} and {gs[0]}"
        shape = packed[1]
        if len(shape) != 2 or not shape[0] or not shape[1] or (2 * shape[1]) % GROUP \
                or tuple(scale[1]) != (shape[0], 2 * shape[1] // BLOCK):
            return (f"shape {list(shape)} with scale {list(scale[1])}: expected in-dim a multiple of {GROUP} and "
                    f"scale [out, in/{BLOCK}]")
        if math.prod(gs[1]) != 1:
            return f"{self.global_suffix} must be one finite positive number"
        return None

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str],
                    rule: str = DEFAULT_RULE) -> dict:
        """Each NVFP4 block replaced by the int4 block every MXFP4 dialect writes (``int4_block``); a
        compressed-tensors ignore list and kv-cache scheme are kept as its MXFP4 dialect keeps them,
        ModelOpt's fnmatch excludes are not compressed-tensors patterns and are not carried."""
        ct = self.layout is Layout.COMPRESSED_TENSORS

        def make(old: dict) -> dict:
            keep = {k: old[k] for k in ("kv_cache_scheme",) if ct and old.get(k) is not None}
            return int4_block(*int4_targets(converted, unconverted, (old.get("ignore") or []) if ct else []), keep,
                              rule)
        return self.rewrite(config, make)

    def record(self) -> dict[str, Any]:
        return {"dialect": self.dialect, "layout": self.layout.value, "blocks": [dotted(p) for p in self.blocks],
                "packed_suffix": self.packed_suffix, "scale_suffix": self.scale_suffix,
                "global_suffix": self.global_suffix, "global_applies": "divide" if self.divide else "multiply",
                "scale_convention": self.scale_note, "dropped": list(self.dropped)}


def _source(layout: Layout, blocks: tuple, packed: str, global_suffix: str, divide: bool, rule: Callable[[str], bool],
            dropped: tuple, dropped_tensors: tuple) -> Nvfp4Source:
    note = f"E4M3 scale per {BLOCK}, FP32 {global_suffix} ({'divides' if divide else 'multiplies'})"
    return Nvfp4Source(dialect=DIALECT, blocks=blocks, packed_suffix=packed, scale_note=note, dropped=dropped,
                       dropped_tensors=dropped_tensors, layout=layout, global_suffix=global_suffix, divide=divide,
                       rule=rule)


def _ct_problems(block: dict, where: str, drop: bool, dropped: list[dict]) -> list[str]:
    out = []
    if block.get("quantization_status", "compressed") != "compressed":
        out.append(f"{where}.quantization_status is {block.get('quantization_status')!r}: only packed checkpoints")
    for key in ("transform_config", "sparsity_config"):
        value = block.get(key)
        if value and not (key == "sparsity_config" and value.get("format") in (None, "dense")):
            out.append(f"{where}.{key} is set ({json.dumps(value)[:80]}): an int4 output cannot carry it")
    for name, g in (block.get("config_groups") or {}).items():
        at, w = f"{where}.config_groups.{name}", (g.get("weights") or {})
        if ((g.get("format") or block.get("format")) != NVFP4_FORMAT
                or any(w.get(k) != v for k, v in NVFP4_WEIGHTS.items())):
            out.append(f"{at} is not {NVFP4_FORMAT} FP4 group 16 ({json.dumps(w, sort_keys=True)[:80]}): only "
                       "checkpoints whose quantized weights are all NVFP4 are converted")
            continue
        if w.get("strategy") not in (None, "tensor_group") or w.get("symmetric") is False \
                or w.get("dynamic") not in (None, False) \
                or w.get("scale_dtype") not in (None, "torch.float8_e4m3fn"):
            out.append(f"{at}.weights is not plain NVFP4 ({json.dumps(w, sort_keys=True)[:120]})")
        for kind in ("input_activations", "output_activations"):
            if g.get(kind):
                drop_or_refuse(f"{at}.{kind}", g[kind], f"{kind.replace('_', ' ')} ({g[kind].get('num_bits')}-bit "
                               f"{g[kind].get('type')}, group {g[kind].get('group_size')})", drop, dropped, out)
    return out


def _compressed_tensors(blocks: list, config_path: str, drop: bool) -> Nvfp4Source:
    dropped: list[dict] = []
    problems, targets, ignore = [], [], []
    for path, b in blocks:
        problems += _ct_problems(b, dotted(path), drop, dropped)
        for g in (b.get("config_groups") or {}).values():
            targets += [t for t in g.get("targets") or [] if t not in targets]
        ignore += [i for i in b.get("ignore") or [] if i not in ignore]
    if problems:
        raise BadInput("; ".join(problems), file=config_path)
    rule = CtRule.of(tuple(targets) or ("Linear",), tuple(ignore))
    return _source(Layout.COMPRESSED_TENSORS, tuple(p for p, _ in blocks), "weight_packed", "weight_global_scale",
                   True, lambda m: bool(rule(m, LINEAR)), tuple(dropped), (".input_global_scale",) if dropped else ())


MODELOPT_FILE = "hf_quant_config.json"


def modelopt_statement(obj: Any, path: str) -> dict:
    """``hf_quant_config.json`` (``path``: ModelOpt up to 0.27 states its quantization only there, as NVIDIA's
    published FP4 checkpoints do) as the quantization_config block :func:`read` reads: its ``quantization``
    object under ``quant_method "modelopt"``. A file that cannot mean ModelOpt NVFP4 is refused naming it;
    ``group_size`` and ``exclude_modules`` are checked by the reader, as in config.json."""
    q = obj.get("quantization") if isinstance(obj, dict) else None
    if not isinstance(q, dict):
        raise BadInput("no 'quantization' object: not ModelOpt's statement of a quantization", file=path)
    if str(q.get("quant_algo", "")).upper() != "NVFP4":
        raise BadInput(f"quantization.quant_algo is {json.dumps(q.get('quant_algo'))[:40]}: k3convert reads "
                       "ModelOpt NVFP4 (group 16) only", file=path)
    return {"quant_method": "modelopt", **q}


def _modelopt(blocks: list, config_path: str, drop: bool) -> Nvfp4Source:
    """ModelOpt's config, flat in config.json or as hf_quant_config.json's ``quantization`` object; every
    statement of it (a config may state it at top level and in text_config) checked, their excludes joined."""
    problems: list[str] = []
    dropped: list[dict] = []
    exclude: list[str] = []
    for path, block in blocks:
        where = dotted(path)
        q: dict = block["quantization"] if isinstance(block.get("quantization"), dict) else block
        if str(q.get("quant_algo", "")).upper() != "NVFP4" or q.get("group_size", 16) != 16:
            problems.append(f"{where}: quant_algo {q.get('quant_algo')!r} group {q.get('group_size')!r}: only "
                            "ModelOpt NVFP4 (group 16) is read")
        if q.get("kv_cache_quant_algo"):
            drop_or_refuse(f"{where}.kv_cache_quant_algo", q["kv_cache_quant_algo"], "the KV cache", drop, dropped,
                           problems)
        # NVFP4 quantizes the inputs too (W4A4: X.input_scale); a weight-only output drops them
        drop_or_refuse(f"{where}.quant_algo", "NVFP4", "input activations (4-bit NVFP4, static per-tensor scale)",
                       drop, dropped, problems)
        patterns = q.get("exclude_modules") or q.get("ignore") or []
        if not isinstance(patterns, list) or not all(isinstance(x, str) for x in patterns):
            problems.append(f"{where}.exclude_modules is {json.dumps(patterns)[:80]}: expected a list of names")
            continue
        exclude += [x for x in patterns if x not in exclude]
    if problems:
        raise BadInput("; ".join(problems), file=config_path)
    return _source(Layout.MODELOPT, tuple(p for p, _ in blocks), "weight", "weight_scale_2", False,
                   lambda m: not any(fnmatch.fnmatchcase(m, p) for p in exclude),
                   tuple(dropped), (".input_scale", ".k_scale", ".v_scale") if dropped else ())


def is_nvfp4(block: dict) -> bool:
    """Whether a quantization_config block (any of the three layouts) says NVFP4."""
    if block.get("quant_method") == "compressed-tensors":
        groups = block.get("config_groups") or {}
        return block.get("format") == NVFP4_FORMAT or any(isinstance(g, dict) and g.get("format") == NVFP4_FORMAT
                                                           for g in groups.values())
    if block.get("quant_method") == AUTO_ROUND:
        return "nv_fp" in str(block.get("data_type") or "").lower() and block.get("bits") == 4
    if block.get("quant_method") == "modelopt":
        q: dict = block["quantization"] if isinstance(block.get("quantization"), dict) else block
        return str(q.get("quant_algo", "")).upper() == "NVFP4"
    return False


def read(config: dict, config_path: str, drop: bool = False) -> Nvfp4Source:
    """The NVFP4 description of the source, or one refusal naming every problem."""
    blocks = [(p, b) for p, b in quant_blocks(config) if is_nvfp4(b)]
    methods = {str(b.get("quant_method")) for _, b in blocks}
    if not blocks:
        raise BadInput("no NVFP4 quantization_config (compressed-tensors nvfp4-pack-quantized, auto-round nv_fp "
                       "or ModelOpt NVFP4)", file=config_path)
    if len(methods) > 1:
        raise BadInput(f"NVFP4 described by several writers ({', '.join(sorted(methods))}): expected one",
                       file=config_path)
    method = methods.pop()
    if method == "compressed-tensors":
        return _compressed_tensors(blocks, config_path, drop)
    if method == "modelopt":
        return _modelopt(blocks, config_path, drop)
    ar: AutoRoundSource = auto_round_source(config, config_path, drop, kind="NVFP4")
    return _source(Layout.AUTO_ROUND, ar.blocks, "weight_packed", "weight_global_scale", True, ar.selects,
                   ar.dropped, (".input_global_scale",) if ar.dropped else ())


# Registered so that profiles and manifests can name it; it claims no block: ``checkpoint.dialect``
# names it for a config that ``is_nvfp4`` (the MXFP4 dialects claim the same blocks as not MXFP4).
register(Dialect(DIALECT, lambda _b: False, lambda _b: False, read))


__all__ = ["DIALECT", "DROP_FLAG", "MODELOPT_FILE", "Layout", "Nvfp4Source", "is_nvfp4", "modelopt_statement",
           "nvfp4_format", "read"]
