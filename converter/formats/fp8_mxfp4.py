"""vLLM's FP8 config carrying MXFP4 routed experts (MiMo-V2.x FP4: ``quant_method: fp8``,
``store_dtype: mxfp4``, ``mxfp4_block_size: 32``; Ling-3.0-flash-fp4: ``quant_method: fp8``,
``scale_fmt: ue8m0``, ``routed_experts_quant_method: mxfp4``), registered as the dialect "fp8-mxfp4".

Ling (vLLM's ``models/bailing_moe_v3.py``; lines in docs/serving.md): ``_configure_ling_fp8_quant_config`` (222-260)
sets ``store_dtype = "mxfp4"`` when ``routed_experts_quant_method == "mxfp4"`` and ``is_scale_e8m0`` when
``scale_fmt == "ue8m0"`` (the FP8 linears' ``weight_scale_inv`` are then F8_E8M0, ``fp8.py`` 330-339);
its experts' E8M0 scales are ``X.weight_scale_inv``, renamed to ``weight_scale`` at load (263-281).

What vLLM does with such a checkpoint (``model_executor/layers/quantization/fp8.py``):
``Fp8Config.get_quant_method`` gives every routed-experts layer ``Mxfp4MoEMethod`` when
``store_dtype == "mxfp4"`` (199-204; on gfx942 EMULATION, ``fused_moe/oracle/mxfp4.py`` 443-447)
and every other linear ``Fp8LinearMethod``, block-quantized by ``weight_block_size`` with
``X.weight`` e4m3 and ``X.weight_scale_inv`` fp32 (338-339), unless ``ignored_layers`` /
``modules_to_not_convert`` names it (exact match). An expert is ``X.weight`` uint8 ``[out, in/2]``
+ ``X.weight_scale`` E8M0 uint8 ``[out, in/32]``: the OCP bytes (``mimo_v2.py`` 854-864 maps
``experts.E.gate_proj|up_proj|down_proj``).

The output is compressed-tensors: the experts int4 (group 0), the FP8 linears described as they
are (group 1, ``dialect.fp8_block_group``): vLLM's compressed-tensors FP8 scheme registers
``weight_scale`` (``compressed_tensors_w8a8_fp8.py`` 127-134) and ``mimo_v2.py``'s loader skips a
name it has no parameter for (958-960, 979-980), so each ``weight_scale_inv`` is written as
``weight_scale``, bytes unchanged (docs/mimo.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import BadInput
from .dialect import (
    DEFAULT_RULE,
    EXPERT_TARGET,
    SCALE,
    Dialect,
    MXFP4Source,
    dotted,
    fp8_block_group,
    int4_block,
    int4_targets,
    quant_blocks,
    register,
)
from .match import match_name

FP8_SCALE, CT_SCALE = ".weight_scale_inv", "." + SCALE
BF16_VALUES = ("each e4m3 value times its block's fp32 scale in fp32, rounded to bf16 (round to nearest even): exact "
               "when the block scales are powers of two (scale_fmt ue8m0), else within 2^-8 of the value, relative "
               "(bf16's unit roundoff), against e4m3's own 2^-4")


def _is_fp8(block: dict) -> bool:
    return block.get("quant_method") == "fp8"


def _ling(block: dict) -> bool:
    """Ling's spelling: ``routed_experts_quant_method`` (bailing_moe_v3.py 252-260), experts' scales
    under ``weight_scale_inv``."""
    return block.get("routed_experts_quant_method") is not None


def _is_mxfp4_experts(block: dict) -> bool:
    return _is_fp8(block) and (block.get("store_dtype") == "mxfp4"
                               or block.get("routed_experts_quant_method") == "mxfp4")


@dataclass(frozen=True)
class Fp8Mxfp4Source(MXFP4Source):
    """The FP8 block's ignore list and block size, and (once ``seen``) its FP8 linears."""

    ignored: tuple[str, ...] = ()
    ignore_suffix: bool = False     # Ling: ignored_layers match as suffixes (bailing_moe_v3.py 236)
    weight_block: tuple[int, int] = (128, 128)
    fp8_modules: tuple[str, ...] = ()
    bf16_modules: tuple[str, ...] = ()   # FP8 linears written as bf16 (items.Fp8Dequant), not in fp8_modules
    bf16_why: tuple[str, ...] = ()       # why, one line per reason (the manifest's fp8_to_bf16)

    def selects(self, module: str) -> bool:
        """Routed experts only (Fp8Config gives Mxfp4MoEMethod to the experts layer alone), unless
        the experts layer (``<layer>.experts``) or the module is ignored."""
        layer = module.rsplit(".", 2)[0]
        if self.ignore_suffix:
            return match_name(module, EXPERT_TARGET) and not any(n.endswith(i) for n in (layer, module)
                                                                 for i in self.ignored)
        return match_name(module, EXPERT_TARGET) and layer not in self.ignored and module not in self.ignored

    def seen(self, tensors: Any) -> "Fp8Mxfp4Source":
        """Every FP8 linear (a ``weight_scale_inv`` beside it), less the experts where Ling stores their
        MXFP4 scales under that name too."""
        fp8 = (n[: -len(FP8_SCALE)] for n in tensors if n.endswith(FP8_SCALE))
        return replace(self, fp8_modules=tuple(sorted(m for m in fp8 if not self._expert_scale(m))))

    def with_bf16(self, bf16: set[str], why: list[str]) -> "Fp8Mxfp4Source":
        """This source with the FP8 linears ``bf16`` (chosen by the plan from what vLLM does with them:
        ``run.plan``) moved out of ``fp8_modules``, ``why`` recorded."""
        return replace(self, fp8_modules=tuple(m for m in self.fp8_modules if m not in bf16),
                       bf16_modules=tuple(sorted(bf16)), bf16_why=tuple(why))

    def record(self) -> dict[str, Any]:
        """The dialect's record, and the FP8 linears written as bf16 with why and how exactly."""
        out = super().record()
        if self.bf16_modules:
            out["fp8_to_bf16"] = {"modules": list(self.bf16_modules), "why": list(self.bf16_why),
                                  "values": BF16_VALUES}
        return out

    def _expert_scale(self, module: str) -> bool:
        """Whether ``module.weight_scale_inv`` is a routed expert's MXFP4 scale (Ling), not an FP8 linear's."""
        return self.scale_suffix == FP8_SCALE[1:] and self.selects(module)

    def tensor_problems(self, tensors: Any) -> list[str]:
        """Each FP8 linear as vLLM's Fp8LinearMethod loads it (fp8.py 338-339): ``X.weight`` F8_E4M3 and
        ``X.weight_scale_inv`` F32, one per weight block; and no ``X.weight_scale`` beside it, the name the
        scale is written under in DST (two tensors of one name: a worker error, or an index that drops one)."""
        out = []
        for name, t in tensors.items():
            if not name.endswith(FP8_SCALE):
                continue
            module = name[: -len(FP8_SCALE)]
            if self._expert_scale(module):   # Ling: an MXFP4 expert's E8M0 scale, paired by plan
                continue
            where, w, clash = f"file {t.path}, tensor {name}", tensors.get(f"{module}.weight"), \
                tensors.get(module + CT_SCALE)
            if clash is not None:
                out.append(f"file {clash.path}, tensor {clash.name}: beside {name} ({t.path}), which k3convert "
                           f"writes as {clash.name}: two tensors of one name in DST; remove one of them")
            elif t.dtype != "F32":
                out.append(f"{where}: {t.dtype}, expected F32 (the FP8 block scale vLLM's Fp8LinearMethod loads)")
            elif w is None:
                out.append(f"{where}: no {module}.weight for it in any shard")
            elif w.dtype != "F8_E4M3":
                out.append(f"file {w.path}, tensor {w.name}: {w.dtype} beside the FP8 block scale {name}, expected "
                           "F8_E4M3 (the e4m3 weight vLLM's Fp8LinearMethod loads)")
            elif len(w.shape) != 2 or t.shape != tuple(-(-d // b) for d, b in zip(w.shape, self.weight_block)):
                out.append(f"{where}: shape {list(t.shape)}, expected one scale per {list(self.weight_block)} block "
                           f"of the weight {list(w.shape)}")
        return out

    def int4_config(self, config: dict, converted: list[str], unconverted: list[str],
                    rule: str = DEFAULT_RULE) -> dict:
        """The FP8 block replaced by compressed-tensors: int4 experts (group 0, ``int4_targets``) and
        the FP8 linears by exact name (group 1: vLLM matches a fused layer through its shards'
        names, ``compressed_tensors/utils.py`` 73-111); the rest (norms, router, embeddings, head)
        matches no target and loads as bf16, as it did under Fp8Config."""
        targets, ignore = int4_targets(converted, unconverted)

        def make(_old: dict) -> dict:
            block = int4_block(targets, ignore, rule=rule)
            if self.fp8_modules:
                block["config_groups"]["group_1"] = fp8_block_group(list(self.fp8_modules), list(self.weight_block))
            return block
        return self.rewrite(config, make)


def fp8_mxfp4_source(config: dict, config_path: str, drop: bool = False) -> Fp8Mxfp4Source:
    """The description of an FP8-config checkpoint with MXFP4 experts, or one refusal naming every problem."""
    blocks = [(p, b) for p, b in quant_blocks(config) if _is_fp8(b)]
    if len(blocks) != 1:
        raise BadInput(f"{len(blocks)} fp8 quantization_config blocks: expected one", file=config_path)
    path, b = blocks[0]
    where, problems = dotted(path), []
    ling = _ling(b)
    if ling and b.get("routed_experts_quant_method") != "mxfp4":
        problems.append(f"{where}.routed_experts_quant_method is {b.get('routed_experts_quant_method')!r}: vLLM "
                        "takes 'mxfp4' only (bailing_moe_v3.py 252-258)")
    elif not ling and b.get("store_dtype") != "mxfp4":
        problems.append(f"{where}.store_dtype is {b.get('store_dtype')!r}: only MXFP4 experts (store_dtype "
                        "'mxfp4') are converted")
    if b.get("mxfp4_block_size", 32) != 32:
        problems.append(f"{where}.mxfp4_block_size is {b.get('mxfp4_block_size')!r}: MXFP4 groups are 32")
    if b.get("activation_scheme") != "dynamic":
        problems.append(f"{where}.activation_scheme is {b.get('activation_scheme')!r}: vLLM's block FP8 takes "
                        "'dynamic' only (fp8.py 124-130)")
    block = b.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(x) is int and x > 0 for x in block)):
        problems.append(f"{where}.weight_block_size is {block!r}: expected two positive integers")
    ignored = b.get("ignored_layers") or b.get("modules_to_not_convert") or []
    if not (isinstance(ignored, list) and all(isinstance(x, str) for x in ignored)):
        problems.append(f"{where}.ignored_layers is not a list of module names")
    text = found if isinstance(found := config.get("text_config"), dict) else config
    if (text.get("attention_projection_layout") or config.get("attention_projection_layout")) == "fused_qkv":
        problems.append("attention_projection_layout is 'fused_qkv': vLLM's MiMo loader shards that fused, "
                        "pre-chunked qkv_proj only under Fp8Config (mimo_v2.py 387-392 reads "
                        "quant_config.weight_block_size, 1012-1050 keys on qkv_proj.weight_scale_inv); under "
                        "compressed-tensors it would load Q, K and V mixed: not converted")
    if problems:
        raise BadInput("; ".join(problems), file=config_path)
    return Fp8Mxfp4Source(dialect="fp8-mxfp4", blocks=(path,), packed_suffix="weight",
                          scale_suffix=FP8_SCALE[1:] if ling else CT_SCALE[1:],
                          scale_note="OCP E8M0 (bias 127; vLLM Fp8Config " + (
                              "routed_experts_quant_method mxfp4, scales X.weight_scale_inv)" if ling
                              else "store_dtype mxfp4)"),
                          renames=((FP8_SCALE, CT_SCALE),), ignored=tuple(ignored), weight_block=tuple(block or ()),
                          ignore_suffix=ling)


register(Dialect("fp8-mxfp4", _is_fp8, _is_mxfp4_experts, fp8_mxfp4_source))
