"""The requantization kernels, chosen by device: numba on the CPU, Triton on a GPU.

Every pair gives the torch reference's bytes (``converter.quant.requant`` for the optimum,
``converter.quant.server_rule`` for the server's rule). Kernels are imported lazily, so that
a machine without Triton or a GPU can still use the CPU path and the coordinator stays torch-free.
"""
from __future__ import annotations

import functools
from typing import Callable

__all__ = ["requantizer", "server_requantizer"]


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
