"""Reading tensors back for the numeric checks (torch, imported only by them): by name through
``safetensors.safe_open``, and int4 through compressed-tensors' unpacker (a path independent of
the converter's own reader)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Tensors:
    """Tensors by name through safetensors.safe_open, one open handle per file."""

    def __init__(self, root: str, weight_map: dict[str, str]):
        self.root, self.wm = root, weight_map
        self.handles: dict[str, Any] = {}   # shard -> safe_open handle

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = self.wm.get(name)
        if shard is None:
            raise KeyError(name)
        if shard not in self.handles:
            self.handles[shard] = safe_open(os.path.join(self.root, shard), framework="pt")
        return self.handles[shard].get_tensor(name)


def int4_reader() -> tuple[str, Any]:
    """compressed-tensors' own unpacker when importable (the independent path), else ours."""
    import torch

    try:
        import compressed_tensors
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        def read(words: torch.Tensor, scales: torch.Tensor, shape: list[int]) -> torch.Tensor:
            q = unpack_from_int32(words, 4, torch.Size(shape))
            return q.double() * scales.double().repeat_interleave(32, dim=1)

        return f"compressed_tensors {compressed_tensors.__version__} unpack_from_int32", read
    except ImportError:
        from ..formats import int4

        def read(words: torch.Tensor, scales: torch.Tensor, shape: list[int]) -> torch.Tensor:
            return int4.decode(words, scales).double()  # q * bf16 is exact in float32

        return "converter.formats.int4.decode (compressed_tensors not importable)", read
