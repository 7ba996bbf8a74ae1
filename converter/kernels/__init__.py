"""The requantization kernels, chosen by device: numba on the CPU, Triton on a GPU.

Every pair gives the torch reference's bytes (``converter.quant.requant`` for the optimum,
``converter.quant.server_rule`` for the server's rule). Kernels are imported lazily, so that
a machine without Triton or a GPU can still use the CPU path and the coordinator stays torch-free.
"""
from __future__ import annotations

import functools
from typing import Callable

__all__ = ["nvfp4_requantizer", "nvfp4_searcher", "requantizer", "server_requantizer"]


def requantizer(device: str, qmin: int = -8) -> Callable:
    """The exact-optimum kernel for ``device``, over codes ``[qmin, 7]`` (``rules.optimum_qmin``)."""
    requantize: Callable
    if device.startswith("cpu"):
        from ..quant.cpu_kernel import requantize
    else:
        from .triton_requant import requantize
    return requantize if qmin == -8 else functools.partial(requantize, qmin=qmin)


def server_requantizer(device: str) -> Callable:
    """The server's load-time rule (``--scale-rule vllm-gfx942``, and the report's comparison)."""
    if device.startswith("cpu"):
        from ..quant.cpu_kernel import server_requantize
        return server_requantize
    from .triton_server_rule import requantize
    return requantize


def nvfp4_searcher(device: str) -> Callable:
    """NVFP4 -> int4 group scales ``(packed, block_scales, gscale)`` on ``device``'s tensors: the numba
    kernel (every core) or the Triton one, the same bytes (docs/nvfp4.md §3)."""
    if device.startswith("cpu"):
        from ..quant.nvfp4_requant import search
        return search
    from .triton_nvfp4 import search as gpu_search
    return gpu_search


def nvfp4_requantizer(device: str) -> Callable:
    """One NVFP4 module as int4 group 32 ``(packed, block_scales, gscale)``, computed on ``device``."""
    if device.startswith("cpu"):
        from ..quant.nvfp4_requant import requantize_module
        return requantize_module
    from .triton_nvfp4 import requantize_module as gpu_module
    return functools.partial(gpu_module, device=device)

