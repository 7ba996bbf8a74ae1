"""GPU kernels (Triton) for the conversion's hot loop.

``triton_requant.requantize`` is the device twin of ``converter.quant.requant.requantize``:
same signature, same bytes. It is imported lazily so that machines without Triton (or
without a GPU) can still use the CPU reference.
"""
from __future__ import annotations

__all__ = ["requantize"]


def requantize(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - thin lazy re-export
    """Lazy proxy for :func:`converter.kernels.triton_requant.requantize`."""
    from .triton_requant import requantize as _requantize

    return _requantize(*args, **kwargs)
