"""What a plan does with each source tensor or module: convert it (MXFP4 or NVFP4 to int4), write it
as exact bf16 (an MXFP4 module that is not a routed expert; an FP8 linear vLLM would load wrong), or
copy it; each item names the source tensors it consumes and the output tensors it writes."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from ..formats.checkpoint import PACKED, SCALE, SHAPE
from ..formats.safetensors_io import OutTensor, TensorInfo

UNQUANTIZED = "weight"   # a module's plain weight: beside its MXFP4 pair, a second weight of one module
_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT = re.compile(r"experts\.(\d+)\.")



@dataclass(frozen=True)
class MXFP4Module:
    """One MXFP4 linear ``module`` of the source: its two tensors (any shards) and logical shape."""

    module: str
    packed: TensorInfo
    scale: TensorInfo
    rows: int
    cols: int

    @property
    def groups(self) -> int:
        return self.rows * self.cols // 32

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        """The source tensors it consumes."""
        return (self.packed, self.scale)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def split(self) -> bool:
        """Whether a tensor it consumes sits in another shard than its packed one (read from there)."""
        return any(t.path != self.packed.path for t in self.tensors)

    @property
    def layer(self) -> int | None:
        m = _LAYER.search(self.module)
        return int(m.group(1)) if m else None

    @property
    def expert(self) -> int | None:
        m = _EXPERT.search(self.module)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Convert(MXFP4Module):
    """A module requantized to int4: DST holds its packed words, bf16 scales and shape."""

    def outputs(self) -> list[OutTensor]:
        return [
            OutTensor(f"{self.module}.{PACKED}", "I32", (self.rows, self.cols // 8)),
            OutTensor(f"{self.module}.{SCALE}", "BF16", (self.rows, self.cols // 32)),
            OutTensor(f"{self.module}.{SHAPE}", "I64", (2,)),
        ]


@dataclass(frozen=True)
class Nvfp4Convert(Convert):
    """An NVFP4 linear requantized to the same int4 outputs (docs/nvfp4.md): its packed E2M1 bytes,
    E4M3 block scales and FP32 global scale, which is consumed (folded into the bf16 scales), not copied.
    Each of the three may sit in any shard (``pairing.pair_nvfp4``)."""

    global_scale: TensorInfo
    divide: bool            # value = code * block scale / global (compressed-tensors), else * global (ModelOpt)

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return (self.packed, self.scale, self.global_scale)


@dataclass(frozen=True)
class Dequant(MXFP4Module):
    """A module that is not a routed expert, under a profile that converts routed experts only:
    DST holds its plain bf16 ``X.weight``, decoded exactly (every E2M1 value times a power of two
    is a bf16 number), so it loads unquantized as the rest of the model does (docs/decisions.md)."""

    def outputs(self) -> list[OutTensor]:
        return [OutTensor(f"{self.module}.{UNQUANTIZED}", "BF16", (self.rows, self.cols))]


@dataclass(frozen=True)
class Fp8Dequant:
    """An FP8 block linear DST holds as bf16 ``X.weight`` (``Fp8Mxfp4Source.bf16_modules``: a fused
    layer vLLM would build unquantized, or one refused at ``--fp8-bf16-at-tp``): each e4m3 value
    times its block's fp32 scale in fp32, rounded to bf16 (exact when the scales are powers of two;
    ``formats/fp8_block.py``)."""

    module: str
    weight: TensorInfo       # F8_E4M3 [rows, cols]
    scale: TensorInfo        # F32 [ceil(rows / block[0]), ceil(cols / block[1])]
    block: tuple[int, int]

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def cols(self) -> int:
        return self.weight.shape[1]

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        """The source tensors it consumes."""
        return (self.weight, self.scale)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def outputs(self) -> list[OutTensor]:
        return [OutTensor(f"{self.module}.{UNQUANTIZED}", "BF16", (self.rows, self.cols))]


@dataclass(frozen=True)
class Copy:
    """A tensor that passes through byte-identical (under ``name`` where the source dialect renames it)."""

    info: TensorInfo
    name: str = ""

    @property
    def out_name(self) -> str:
        return self.name or self.info.name

    @property
    def nbytes(self) -> int:
        return self.info.nbytes


Item = Union[Convert, Dequant, Fp8Dequant, Copy]
