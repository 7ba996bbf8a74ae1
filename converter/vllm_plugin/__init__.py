"""vLLM plugin: serve k3convert int4 experts on ROCm gfx942 through AITER's packed-int4 SiTU kernel.

Importing this package imports nothing from vLLM (the converter works without it); vLLM calls
`register` from its `vllm.general_plugins` entry point in every process, and only then is vLLM
touched. See docs/vllm_plugin.md.
"""
from __future__ import annotations

import logging
from typing import Any

from ..releases import proven_vllm
from .route import NAME, Refused, is_k3_int4

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point: register the quantization config (idempotent: vLLM may load plugins twice).

    Under a vLLM whose layout the plugin cannot import, a config that refuses K3 int4 SiTU
    checkpoints on ROCm is registered instead, so that stock vLLM never serves them silently
    (it would dequantize the experts to bf16 or compute SiLU), and the import error is kept.
    """
    try:
        from vllm.model_executor.layers.quantization import (
            QUANTIZATION_METHODS,
            register_quantization_config,
        )
    except ImportError as exc:   # no registry at all: no plugin can take part in the choice
        logger.error("k3convert vLLM plugin not registered (this vLLM has no quantization registry: %s); "
                     "a k3convert int4 Kimi K3 is not protected from stock vLLM's choice of kernel", exc)
        return
    if NAME in QUANTIZATION_METHODS:
        return
    config_cls: type
    try:
        from .vllm_config import K3Int4Gfx942Config as config_cls
    except ImportError as exc:
        logger.error("k3convert vLLM plugin: %s; it refuses k3convert int4 Kimi K3 checkpoints on ROCm", exc)
        config_cls = _refusing_config(f"{type(exc).__name__}: {exc}".splitlines()[0])
    register_quantization_config(NAME)(config_cls)


def _refusing_config(why: str) -> type:
    """A registered config whose only act is to refuse K3 int4 SiTU on ROCm, naming the import error."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class K3Int4Refusing(QuantizationConfig):
        @classmethod
        def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: str | None,
                                         hf_config: Any = None) -> str | None:
            if not is_k3_int4(hf_quant_cfg, user_quant, hf_config):
                return None
            from vllm.platforms import current_platform

            if current_platform.is_rocm():
                raise Refused(f"cannot load under this vLLM ({why}); it was proven on vLLM {proven_vllm()}")
            return None

    return K3Int4Refusing
