"""vLLM plugin: serve k3convert int4 experts on ROCm gfx942 through AITER's packed-int4 SiTU kernel.

Importing this package imports nothing from vLLM (the converter works without it); vLLM calls
`register` from its `vllm.general_plugins` entry point in every process, and only then is vLLM
touched. See docs/vllm_plugin.md.
"""
from __future__ import annotations

import logging

from .route import NAME

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point: register the quantization config (idempotent: vLLM may load plugins twice)."""
    try:
        from vllm.model_executor.layers.quantization import (
            QUANTIZATION_METHODS,
            register_quantization_config,
        )
        if NAME in QUANTIZATION_METHODS:
            return
        from .vllm_config import K3Int4Gfx942Config
    except ImportError as exc:   # another vLLM layout: nothing registered, stock vLLM decides
        logger.warning("k3convert vLLM plugin not registered: %s", exc)
        return
    register_quantization_config(NAME)(K3Int4Gfx942Config)
