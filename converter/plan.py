"""Preflight: read every header, decide what converts, and fix each output shard's layout.

Everything that can be checked without reading tensor data is checked here, and all
problems are reported together, before any shard is converted.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Union

from . import __version__
from .errors import BadInput
from .formats import checkpoint as ckpt
from .formats.safetensors_io import Header, Layout, OutTensor, TensorInfo, read_header

PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT = re.compile(r"experts\.(\d+)\.")


@dataclass(frozen=True)
class Convert:
    """One MXFP4 linear ``module`` -> int4: its two source tensors and logical shape."""

    module: str
    packed: TensorInfo
    scale: TensorInfo
    rows: int
    cols: int

    @property
    def groups(self) -> int:
        return self.rows * self.cols // 32

    def outputs(self) -> list[OutTensor]:
        return [
            OutTensor(f"{self.module}.{PACKED}", "I32", (self.rows, self.cols // 8)),
            OutTensor(f"{self.module}.{SCALE}", "BF16", (self.rows, self.cols // 32)),
            OutTensor(f"{self.module}.{SHAPE}", "I64", (2,)),
        ]

    @property
    def layer(self) -> int | None:
        m = _LAYER.search(self.module)
        return int(m.group(1)) if m else None

    @property
    def expert(self) -> int | None:
        m = _EXPERT.search(self.module)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Copy:
    """A tensor that passes through byte-identical."""

    info: TensorInfo


Item = Union[Convert, Copy]


@dataclass
class ShardPlan:
    name: str                 # file name, the same in SRC and DST
    header: Header
    items: list[Item]         # in source data order
    metadata: dict[str, str]  # the output shard's safetensors metadata
    layout: Layout = field(init=False)

    def __post_init__(self) -> None:
        tensors = []
        for it in self.items:
            tensors += it.outputs() if isinstance(it, Convert) else [
                OutTensor(it.info.name, it.info.dtype, it.info.shape)]
        self.layout = Layout(tensors, self.metadata)

    @property
    def converts(self) -> list[Convert]:
        return [it for it in self.items if isinstance(it, Convert)]

    @property
    def bytes_in(self) -> int:
        return self.header.file_size

    @property
    def bytes_out(self) -> int:
        return self.layout.file_size


@dataclass
class Plan:
    src: str
    config: dict[str, Any]
    quant: ckpt.SourceQuant
    activation: dict[str, Any]
    shards: list[ShardPlan]
    other_files: list[str]    # copied byte-identical (tokenizer, chat template, *.py, ...)

    @property
    def bytes_in(self) -> int:
        return sum(s.bytes_in for s in self.shards)

    @property
    def bytes_out(self) -> int:
        return sum(s.bytes_out for s in self.shards)

    @property
    def n_convert(self) -> int:
        return sum(len(s.converts) for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        return {t.name: s.name for s in self.shards for t in s.layout.tensors}


def shard_metadata(source: dict[str, str], activation: dict[str, Any]) -> dict[str, str]:
    """Each output shard states the format, the tool and the activation (SPEC §4)."""
    meta = dict(source)
    meta.setdefault("format", "pt")
    meta.update({k: str(v) for k, v in activation.items()})
    meta["quantization"] = "compressed-tensors pack-quantized int4 group 32 (routed experts)"
    meta["converted_by"] = f"k3convert {__version__}"
    return meta


def _shard_items(header: Header, quant: ckpt.SourceQuant, problems: list[str]) -> list[Item]:
    """Pair each selected module's packed/scale tensors; everything else is copied."""
    tensors = header.tensors
    path = header.path
    converts: dict[str, Convert] = {}
    for name, t in tensors.items():
        if not name.endswith("." + PACKED):
            continue
        module = name[: -len(PACKED) - 1]
        if not quant.selects(module):
            continue
        scale = tensors.get(f"{module}.{SCALE}")
        where = f"file {path}, tensor {name}"
        if scale is None:
            problems.append(f"{where}: no {SCALE} beside it in the same shard")
            continue
        if t.dtype != "U8" or scale.dtype != "U8":
            problems.append(f"{where}: expected uint8 packed and scale, got {t.dtype} and {scale.dtype}")
            continue
        if len(t.shape) != 2 or len(scale.shape) != 2:
            problems.append(f"{where}: expected 2-D packed and scale, got {list(t.shape)} and {list(scale.shape)}")
            continue
        rows, cols = t.shape[0], 2 * t.shape[1]
        if cols % 32:
            problems.append(f"{where}: in-dim {cols} is not a multiple of 32")
            continue
        if scale.shape != (rows, cols // 32):
            problems.append(f"{where}: packed {list(t.shape)} and scale {list(scale.shape)} do not match "
                            f"(expected scale [{rows}, {cols // 32}])")
            continue
        converts[module] = Convert(module, t, scale, rows, cols)
    produced = {o.name for c in converts.values() for o in c.outputs()}
    items: list[tuple[int, Item]] = [(c.packed.start, c) for c in converts.values()]
    items += [(t.start, Copy(t)) for n, t in tensors.items() if n not in produced]
    items.sort(key=lambda x: x[0])
    return [it for _, it in items]


def shard_plan(src: str, shard: str, quant: ckpt.SourceQuant, act: dict[str, Any],
               problems: list[str]) -> ShardPlan:
    """One shard's plan from its header (also used by worker processes, from the name alone)."""
    header = read_header(os.path.join(src, shard))
    return ShardPlan(shard, header, _shard_items(header, quant, problems), shard_metadata(header.metadata, act))


def build_plan(src: str) -> Plan:
    """Check the whole source and plan the conversion, or raise BadInput listing every problem."""
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise BadInput("not a directory", file=src)
    config_path = os.path.join(src, "config.json")
    config = ckpt.load_json(config_path)
    quant = ckpt.source_quant(config, config_path)
    act = ckpt.activation(config, config_path)
    wm = ckpt.weight_map(src)
    problems: list[str] = []
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    shards = []
    for shard in sorted(by_shard):
        path = os.path.join(src, shard)
        if not os.path.exists(path):
            problems.append(f"file {path}: missing, but {ckpt.INDEX} names it for {len(by_shard[shard])} tensors")
            continue
        try:
            sp = shard_plan(src, shard, quant, act, problems)
        except BadInput as e:
            problems.append(str(e))
            continue
        problems += [f"file {path}, tensor {name}: in {ckpt.INDEX} but not in the shard"
                     for name in by_shard[shard] if name not in sp.header.tensors]
        shards.append(sp)
    if not problems and not any(s.converts for s in shards):
        problems.append(f"directory {src}: the quantization config selects no weight_packed/weight_scale pair")
    if problems:
        raise BadInput(f"{len(problems)} problem(s) in {src}:\n  " + "\n  ".join(problems)
                       if len(problems) > 1 else problems[0])
    skip = {"config.json", ckpt.INDEX} | set(by_shard)
    others = sorted(
        os.path.relpath(os.path.join(d, f), src)
        for d, _, files in os.walk(src) for f in files
        if os.path.relpath(os.path.join(d, f), src) not in skip and not f.startswith("k3convert_"))
    return Plan(src, config, quant, act, shards, others)
