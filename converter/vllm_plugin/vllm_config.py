"""The registered quantization config: compressed-tensors everywhere, but K3's int4 routed experts
take the AITER packed-int4 method. Imports vLLM (only from `register`); the MoE method module, which
pulls in vLLM's MXFP4 and AITER code, is imported only when that route is taken.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)

from . import route
from .aiter_info import has_module

logger = init_logger(route.LOGGER)


def machine() -> route.Machine:
    """Facts about this process's machine, each read the way vLLM's own gfx942 route reads it.

    Called only for a K3 int4 SiTU checkpoint (route.decide), so aiter is imported for nothing else.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_rocm():
        return route.Machine(is_rocm=False)
    import vllm

    try:
        from vllm.platforms.rocm import on_gfx942
        gfx942 = bool(on_gfx942())
    except Exception:  # noqa: BLE001 - an unknown vLLM or platform is simply not gfx942 to us
        gfx942 = False
    try:
        gpu = str(current_platform.get_device_name())
    except Exception:  # noqa: BLE001 - for messages only
        gpu = ""
    found = True
    try:
        from vllm import _aiter_ops
        found = bool(getattr(_aiter_ops, "IS_AITER_FOUND", True))   # find_spec("aiter"), _aiter_ops.py 113-123
        # None (not False) without aiter: if_aiter_supported (_aiter_ops.py 279-291) skips the switch
        moe_on = bool(_aiter_ops.rocm_aiter_ops.is_fused_moe_enabled())
    except Exception:  # noqa: BLE001
        moe_on = False
    gemm1, error = None, ""
    if gfx942 and moe_on:
        try:
            import importlib  # the module the release's own route imports gemm1 from (route.KERNEL_MODULE)
            gemm1 = importlib.import_module(route.KERNEL_MODULE).flydsl_a16w4_gemm1
        except Exception as exc:  # noqa: BLE001 - reported by route.gemm1_problem, aiter's words kept
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    silu_int4 = gfx942 and moe_on and has_module(route.SILU_INT4_MODULE)   # found, not imported
    return route.Machine(True, gfx942, moe_on, getattr(vllm, "__version__", ""), gemm1, error, gpu, found,
                         aiter_silu_int4=silu_int4)


def tensor_names(hf_config: Any) -> list[str] | None:
    """The checkpoint's tensor names from its index (or single file), where the model is a local folder
    (a Hub id's weights are not downloaded yet when vLLM asks): K3.1's DSA rule looks at the tensors too."""
    import os

    from ..errors import ConvertError
    from ..formats.checkpoint import weight_map

    path = getattr(hf_config, "_name_or_path", None) or getattr(hf_config, "name_or_path", None)
    if not isinstance(path, str) or not os.path.isdir(path):
        return None
    try:
        return list(weight_map(path))
    except (ConvertError, OSError, ValueError):
        return None    # vLLM's own loader says what is wrong with the files


class K3Int4Gfx942Config(CompressedTensorsConfig):
    """compressed-tensors, except Kimi K3's int4 g32 SiTU routed experts on gfx942 with AITER MoE."""

    def get_name(self) -> str:
        return route.NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        return route.decide(hf_quant_cfg, user_quant, hf_config, machine,
                            tensors=lambda: tensor_names(hf_config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            from vllm.config import get_current_vllm_config

            cfg = get_current_vllm_config()
            weights = self._int4_expert_weights(layer, prefix)
            if weights is None:
                return super().get_quant_method(layer, prefix)
            parallel = getattr(cfg, "parallel_config", None)
            why = route.experts_choice(cfg.lora_config, getattr(cfg.kernel_config, "moe_backend", None),
                                       bool(getattr(parallel, "enable_elastic_ep", False)),
                                       eplb=bool(getattr(parallel, "enable_eplb", False)))
            if why is not None:
                logger.warning_once(f"{route.PREFIX} {why}: vLLM's own compressed-tensors MoE method "
                                    "serves the experts")
                return super().get_quant_method(layer, prefix)
            from .moe_method import K3Int4AiterMoEMethod
            return K3Int4AiterMoEMethod(weights, layer.moe_config, prefix)
        return super().get_quant_method(layer, prefix)

    def _int4_expert_weights(self, layer: Any, prefix: str):
        """The experts' int4 weight args, checked as route.scheme_problem checks the JSON; None if not int4.

        Same scheme lookup as vLLM's CompressedTensorsMoEMethod.get_moe_method (`{prefix}.0.gate_proj`...).
        """
        self._add_fused_moe_to_target_scheme_map()
        names = [f"{prefix}.0.{p}" for p in (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name,
                                             layer.ckpt_down_proj_name)]
        schemes = [self.get_scheme_dict(layer, n) for n in names]
        if any(s != schemes[0] for s in schemes) or not schemes[0]:
            return None   # mixed or unquantized: vLLM's own method raises or serves it
        w = schemes[0].get("weights")
        if w is None or str(getattr(w.type, "value", w.type)) != "int" or w.num_bits != 4:
            return None
        args = w.model_dump(mode="json")
        why = route.scheme_problem(args, schemes[0].get("input_activations"), schemes[0].get("format"))
        if why is not None:
            raise route.Refused(f"{prefix}: {why}")
        return w
