"""Does the plugin take this checkpoint on this machine? Pure decisions, no vLLM import.

`decide` answers None (stay out of the way: stock vLLM decides), or the plugin's method name, or
raises `Refused` with one line saying why the plugin will not serve a checkpoint it is meant for.
The facts about the machine (platform, GPU, aiter, vLLM version) are gathered by `vllm_config.py`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..formats import kimi_dsa
from ..formats.activation_fields import (
    SITU_FIELDS,
    ActivationConflict,
    config_field,
    find as find_activation,
)
from ..releases import NEWEST_VLLM, Release, all_kimi_model_types, proven_vllm, unbuilt, vllm_release

NAME = "k3convert-int4-gfx942"
GEMM1_PARAMS = ("act", "situ_beta", "situ_linear_beta")
KERNEL_MODULE = NEWEST_VLLM.facts.gemm1_module   # where every proven release's route imports gemm1 from
PREFIX = "k3convert vLLM plugin:"
# A child of vLLM's "vllm" logger: vLLM configures only that one (docs/vllm_plugin.md), so a logger
# named after this package would print nothing below WARNING, and that without vLLM's format.
LOGGER = "vllm.k3convert_plugin"
GROUP = 32        # int4 group size the kernel reads
SHUFFLE_N = 16    # rows per aiter (16, 16) preshuffle tile
ALIGN = NEWEST_VLLM.facts.align   # vLLM's route rounds AITER_MXFP4_BF16 K3 SiTU sizes up to this


class Refused(RuntimeError):
    """The checkpoint is one the plugin is meant for, but it will not serve it here."""

    def __init__(self, why: str):
        super().__init__(f"{PREFIX} {why}")


@dataclass(frozen=True)
class Machine:
    """What vLLM and aiter report on this process's machine (gathered only for K3 int4 checkpoints)."""
    is_rocm: bool
    on_gfx942: bool = False
    aiter_moe_enabled: bool = False
    vllm_version: str = ""
    gemm1: Callable[..., Any] | None = None    # aiter's flydsl_a16w4_gemm1, None if it cannot be imported
    gemm1_error: str = ""                      # why it could not be imported (aiter's own words)
    gpu: str = ""                              # the GPU's name as vLLM reports it, for messages
    aiter_found: bool = True                   # vLLM found the aiter package (_aiter_ops.py is_aiter_found)
    aiter_silu_int4: bool = False              # aiter still has SILU_INT4_MODULE (found, never imported)


def check_dims(n: int, k: int) -> str | None:
    """Why an [N, K] expert matrix cannot take the plugin's layout, or None."""
    if n % SHUFFLE_N:
        return f"output size {n} is not a multiple of {SHUFFLE_N}"
    if k % (2 * GROUP):
        return f"input size {k} is not a multiple of {2 * GROUP} (the scale layout pairs groups of {GROUP})"
    return None


def size_problem(hidden: int, inter_per_rank: int) -> str | None:
    """Why experts of this hidden and per-rank intermediate size do not fit the kernel unpadded, or None.

    The words on disk fix the shapes, so the plugin pads nothing: what vLLM's route would round up, or
    what the layout cannot tile (w13 is [2I, H], w2 [H, I]), is refused. Used by moe_method and by
    `verify --serving vllm-rocm-plugin`.
    """
    if hidden % ALIGN or inter_per_rank % ALIGN:
        return (f"hidden size {hidden} or per-rank intermediate size {inter_per_rank} is not a multiple "
                f"of {ALIGN}")
    return check_dims(2 * inter_per_rank, hidden) or check_dims(hidden, inter_per_rank)


def situ_fields(hf_config: Any) -> dict[str, Any]:
    """K3's SiTU fields where vLLM's KimiMoE reads them, by the converter's own reader
    (converter.formats.activation_fields); a field stated at top level beside text_config is refused: vLLM
    would build the experts from text_config's (KimiLinearConfig's default hidden_act is silu)."""
    try:
        return {k: v for k, (v, _) in find_activation(hf_config, SITU_FIELDS).items()}
    except ActivationConflict as e:
        raise Refused(f"config.json {e}") from None


# Kimi K3, K3.1 and the MTP draft as vLLM's speculative config renames it: every proven release's
# Kimi K3 classes (the same KimiDecoderLayer/KimiMoE, the same SiTU experts; docs/vllm_plugin.md).
K3_MODEL_TYPES = all_kimi_model_types()


def is_kimi_k3(hf_config: Any) -> bool:
    """A model some proven vLLM builds with its Kimi K3 classes."""
    return hf_config is not None and config_field(hf_config, "model_type") in K3_MODEL_TYPES


def release_of(vllm_version: str, model_type: Any) -> Release:
    """The proven release of this vLLM, which must build this model type; else Refused naming the proven."""
    release = vllm_release(vllm_version)
    if release is None:
        raise Refused(f"proven on vLLM {proven_vllm()}, found vLLM {vllm_version or 'unknown'}: its model, MoE "
                      f"and kernel code were not checked; serve with a proven vLLM, or VLLM_PLUGINS= (empty) to "
                      f"turn the plugin off")
    if why := unbuilt(release, model_type):
        raise Refused(f"vLLM {vllm_version} {why}: serve it with a release that builds it")
    return release


def int4_groups(quant_cfg: Mapping) -> list[tuple[str, Mapping]]:
    """(group name, weights args) of every config group with integer 4-bit weights."""
    out = []
    for name, group in (quant_cfg.get("config_groups") or {}).items():
        w = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(w, Mapping) and w.get("type", "int") == "int" and w.get("num_bits") == 4:
            out.append((name, group))
    return out


def scheme_problem(weights: Mapping, input_activations: Any, fmt: Any) -> str | None:
    """Why an int4 weight scheme is not int4 group-32 symmetric pack-quantized weight-only, or None."""
    if fmt not in (None, "pack-quantized"):
        return f"format {fmt!r} (expected 'pack-quantized')"
    if weights.get("strategy") != "group" or weights.get("group_size") != 32:
        return f"strategy {weights.get('strategy')!r} group_size {weights.get('group_size')!r} (expected group 32)"
    if weights.get("symmetric") is not True:
        return "asymmetric weights (expected symmetric: the kernel has no zero points)"
    if weights.get("actorder") not in (None, False):
        return f"actorder {weights.get('actorder')!r} (expected none: the kernel reads groups in order)"
    if weights.get("dynamic") not in (None, False):
        return "dynamic weight quantization (expected static)"
    if input_activations:
        return "quantized input activations (the kernel is weight-only, bf16 activations)"
    return None


# ROCm/aiter's FlyDSL MoE module before #4646, which deleted it. From #4502 to #4646 aiter already had
# KERNEL_MODULE with flydsl_a16w4_gemm1(act, situ_beta, situ_linear_beta), so the signature check
# passes, but fused_moe built packed-int4 stage 1 with this module's compile_moe_gemm1, which takes no
# activation and computes SiLU. No tag holds that window; nightly builds do (docs/deploy.md, the pairs).
SILU_INT4_MODULE = "aiter.ops.flydsl.kernels.moe_gemm_2stage"


def aiter_window_problem(silu_int4_module: bool) -> str | None:
    """Why an aiter that still has the pre-#4646 packed-int4 stage 1 cannot serve SiTUv2, or None.

    Decided from the module's presence alone, before any kernel runs, whatever K3CONVERT_SELFTEST says.
    """
    if not silu_int4_module:
        return None
    return (f"the installed aiter still has {SILU_INT4_MODULE} (a build between ROCm/aiter #4502 and #4646): "
            "its fused_moe runs packed-int4 stage 1 there, which computes SiLU, not K3's SiTUv2, whatever "
            "flydsl_a16w4_gemm1 accepts; install aiter v0.1.20 or later (docs/deploy.md); " + OFF)


def gemm1_problem(gemm1: Callable[..., Any] | None, error: str = "") -> str | None:
    """Why aiter's packed-int4 stage-1 entry point cannot compute SiTUv2, or None."""
    if gemm1 is None:
        why = f": {error}" if error else ""
        return f"aiter has no {KERNEL_MODULE}.flydsl_a16w4_gemm1 (no packed-int4 a16w4 MoE path){why}"
    try:
        params = inspect.signature(gemm1).parameters
    except (TypeError, ValueError):
        return "aiter's flydsl_a16w4_gemm1 has no readable signature"
    missing = [p for p in GEMM1_PARAMS if p not in params]
    if missing:
        return (f"aiter's flydsl_a16w4_gemm1 takes no {', '.join(missing)}: it would compute SiLU, "
                "not K3's SiTUv2; install an aiter with the SiTUv2 packed-int4 pipeline")
    return None


# --moe-backend values under which the plugin's AITER kernel serves the experts (vLLM's default, and
# AITER by name); "emulation" is vLLM's own reference method, which the plugin hands the experts to.
PLUGIN_BACKENDS = ("auto", "aiter")
EMULATION = "emulation"
OFF = "VLLM_PLUGINS= (empty) turns the plugin off"


def experts_choice(lora_config: Any, moe_backend: Any, elastic_ep: bool, eplb: bool = False) -> str | None:
    """Who serves the routed experts: None (the plugin), or why vLLM's own method must; raises Refused.

    vLLM's CompressedTensorsMoEMethod.get_moe_method (docs/vllm_plugin.md) uses its
    own int4 kernels only without LoRA and honours a chosen emulation backend: the plugin does the same.
    Any other explicit backend would be ignored by the plugin's kernel or, served by vLLM, compute
    SiLU (flydsl) or refuse SiTU (triton): refused. Elastic EP rebuilds the method as vLLM's
    FusedMoEModularMethod, which reads `layer.w13_weight` (fused_moe_modular_method.py:112, absent
    from the int4 layout): refused. So is EPLB (--enable-eplb), whatever serves the experts: vLLM's own
    int4 methods take it only on TRITON, which has no SiTU, and the plugin's layout was never run with its
    redundant experts or its rearrangement (docs/vllm_plugin.md).
    """
    if eplb:
        raise Refused("--enable-eplb: expert load balancing (redundant experts, experts moved between ranks "
                      "while serving) was never run on the packed-int4 layout, and vLLM's own int4 MoE methods "
                      "take it only with TRITON, which computes no SiTU; serve without --enable-eplb")
    backend = str(getattr(moe_backend, "value", moe_backend) or "auto").lower()
    if lora_config is not None:
        return "LoRA is enabled (the packed-int4 kernel has no LoRA path)"
    if backend == EMULATION:
        return "moe_backend 'emulation' was chosen"
    if backend not in PLUGIN_BACKENDS:
        raise Refused(f"--moe-backend {backend}: the plugin serves K3's int4 SiTU experts with AITER "
                      f"({' or '.join(PLUGIN_BACKENDS)}) or hands them to vLLM's {EMULATION}; no other vLLM "
                      "backend computes SiTU on these weights; drop the flag")
    if elastic_ep:
        raise Refused("elastic expert parallelism rebuilds the experts as vLLM's FusedMoEModularMethod, "
                      "which reads w13_weight, not the packed int4 layout; serve without --enable-elastic-ep")
    return None


def is_k3_int4(quant_cfg: Any, user_quant: str | None, hf_config: Any) -> bool:
    """A compressed-tensors int4 Kimi K3 (or MTP draft) with SiTU experts: the checkpoints the plugin is for.

    Decided from the configs alone, so nothing about the machine is asked (nor aiter imported) for any
    other checkpoint.
    """
    if not isinstance(quant_cfg, Mapping) or user_quant not in (None, NAME, "compressed-tensors"):
        return False
    if quant_cfg.get("quant_method") != "compressed-tensors" or not is_kimi_k3(hf_config):
        return False
    return bool(int4_groups(quant_cfg)) and situ_fields(hf_config).get("hidden_act") == "situ"


def decide(quant_cfg: Mapping | None, user_quant: str | None, hf_config: Any,
           machine: Machine | Callable[[], Machine],
           tensors: Iterable[str] | Callable[[], Iterable[str] | None] | None = None) -> str | None:
    """The override_quantization_method answer for this checkpoint on this machine.

    None where the plugin is not meant for the checkpoint (stock vLLM decides) or on CUDA/CPU, whose
    stock vLLM serves SiTU int4 (Marlin) or has no ROCm kernel question. On ROCm a K3 int4 SiTU
    checkpoint is served by the plugin or refused in one line: stock vLLM there would dequantize it
    to bf16 (EMULATION: out of memory at K3's size) or, with --moe-backend flydsl on gfx950, compute SiLU.
    A K3 int4 config whose SiTU fields sit at top level beside text_config is refused on every platform
    (`situ_fields`): vLLM would build its experts from text_config's, SiLU by default.
    ``tensors``: the checkpoint's tensor names where known (its index), or a callable that reads them
    (called only here, for a K3 int4 checkpoint on ROCm, like ``machine``), for K3.1's DSA rule
    (formats/kimi_dsa.py, the rule `verify --serving` runs): a K3.1 this release's ROCm classes
    cannot load, or whose dsa_config and indexer tensors disagree, is refused before the load.
    """
    if quant_cfg is None or not is_k3_int4(quant_cfg, user_quant, hf_config):   # is_k3_int4: a Mapping
        return None
    m = machine() if callable(machine) else machine
    if not m.is_rocm:
        return None
    if not m.on_gfx942:
        raise Refused(f"this GPU ({m.gpu or 'not gfx942'}) is not gfx942: the packed-int4 SiTU kernel the plugin "
                      "uses is vLLM's gfx942 route, and stock vLLM here would dequantize the experts to bf16 or "
                      "compute SiLU (--moe-backend flydsl); on gfx950 serve the MXFP4 original; " + OFF)
    if not m.aiter_found:
        raise Refused("aiter is not installed: vLLM's AITER switches answer None without it (_aiter_ops.py "
                      "if_aiter_supported), whatever VLLM_ROCM_USE_AITER says; install ROCm/aiter (an image "
                      "with aiter, e.g. vLLM's ROCm image) and set VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1; "
                      + OFF)
    if not m.aiter_moe_enabled:
        raise Refused("AITER MoE is off: set VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1 (stock vLLM would "
                      "dequantize the int4 experts to bf16: about 4x their memory); " + OFF)
    release = release_of(m.vllm_version, config_field(hf_config, "model_type"))
    names = tensors() if callable(tensors) else tensors
    if found := kimi_dsa.problem(hf_config, names, release, rocm=True):
        raise Refused(found[0])
    if (why := gemm1_problem(m.gemm1, m.gemm1_error)) is not None:
        raise Refused(why)
    if (why := aiter_window_problem(m.aiter_silu_int4)) is not None:
        raise Refused(why)
    for name, group in int4_groups(quant_cfg):
        why = scheme_problem(group["weights"], group.get("input_activations"),
                             group.get("format", quant_cfg.get("format")))
        if why is not None:
            raise Refused(f"quantization_config.config_groups.{name}: {why}")
    if situ_fields(hf_config).get("activation_situ_linear_beta") is None:
        raise Refused("config.json has no activation_situ_linear_beta (K3's SiTUv2 needs it)")
    return NAME


# vLLM's KimiMoE pads the per-rank intermediate size up to this at TP > 1 unless the config says
# otherwise (models/kimi_k3/amd/linear.py 227-236, nvidia/model.py 419-428: getattr(config, KIMI_MIN_KEY, 256))
KIMI_MIN_PER_RANK = 256
KIMI_MIN_KEY = "min_moe_intermediate_per_partition"
PADDING_FIX = ("serve with a TP size of at most 12 (K3: 3072 / TP >= 256), e.g. --tensor-parallel-size 8 "
               "--pipeline-parallel-size 2, or --data-parallel-size 2 --tensor-parallel-size 8 "
               "--enable-expert-parallel")


def kimi_min_per_rank(text_cfg: Any) -> int:
    """KimiMoE's minimum per-rank intermediate size for this (text) config."""
    value = config_field(text_cfg, KIMI_MIN_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else KIMI_MIN_PER_RANK


def kimi_per_rank(inter: int, tp: int, minimum: int = KIMI_MIN_PER_RANK) -> int:
    """vLLM KimiMoE's per-rank intermediate size: inter / tp, padded up to ``minimum`` at TP > 1."""
    return max(inter // tp, minimum) if tp > 1 else inter


def kimi_padded(inter: int, tp: int, minimum: int = KIMI_MIN_PER_RANK) -> tuple[int, int] | None:
    """(real per-rank intermediate size, padded size) where vLLM's KimiMoE pads at ``tp``, else None."""
    per, pad = inter // tp, kimi_per_rank(inter, tp, minimum)
    return None if pad == per else (per, pad)


def padding_crashes(vllm_version: str) -> bool:
    """Whether this vLLM's KimiMoE crashes building a padded layer: it zeroes the padding through
    `self.experts.w13_weight_packed`, but self.experts is the MoE runner, which holds no such attribute
    (the release's ``kimi_padding_crashes``; seen running vLLM's own KimiMoE). By release series."""
    release = vllm_release(vllm_version)
    return release is not None and release.facts.kimi_padding_crashes


def padding_refusal(inter: int, tp: int, minimum: int, vllm_version: str) -> str | None:
    """Why the plugin refuses this split under this vLLM (its KimiMoE would crash padding it), or None."""
    padded = kimi_padded(inter, tp, minimum)
    if padded is None or not padding_crashes(vllm_version):
        return None
    return (f"at TP {tp} vLLM {vllm_version}'s KimiMoE pads the per-rank intermediate size {padded[0]} to "
            f"{padded[1]} and cannot build that layer (it zeroes the padding through "
            f"the MoE runner, which has no w13_weight_packed: AttributeError); {PADDING_FIX}")


def real_channels(ckpt_inter: int, moe_tp_size: int, moe_tp_rank: int) -> int:
    """The intermediate channels vLLM's loader puts on this MoE rank (routed_experts.py
    _load_w13/_load_w2: the unpadded per-rank size, the last rank may get fewer); the rest of a padded
    per-rank size stays padding."""
    per = ckpt_inter // moe_tp_size
    return max(0, min(per, ckpt_inter - per * moe_tp_rank))
