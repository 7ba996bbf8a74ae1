"""Which source tensors make one module to convert: an MXFP4 module's packed and scale tensors, an NVFP4
one's three, found in any shard; what is left without its partner, or would clash with what DST
writes, is a problem named by file and tensor."""
from __future__ import annotations

from ..formats import checkpoint as ckpt
from ..formats.checkpoint import PACKED, SCALE, SHAPE
from ..formats.nvfp4 import Nvfp4Source
from ..formats.safetensors_io import TensorInfo
from .items import UNQUANTIZED, Convert, Nvfp4Convert

# E8M0 scale bytes as a uint8 tensor or as safetensors' F8_E8M0 (Ling's weight_scale_inv): the same bytes
E8M0_DTYPES = ("U8", "F8_E8M0")


def pair_mxfp4(tensors: dict[str, TensorInfo], source: ckpt.MXFP4Source, problems: list[str],
          unread: set[str]) -> dict[str, Convert]:
    """Every MXFP4 module of the checkpoint, its packed and scale tensors found in any shard
    (``unread``: tensors of shards already reported missing or broken, not reported again)."""
    suffix = "." + source.packed_suffix
    converts: dict[str, Convert] = {}
    for name, t in tensors.items():
        if not source.packs(name, t.dtype):  # Quark, MiMo's fp8 config: a bf16 X.weight is unquantized
            continue
        module = name[: -len(suffix)]
        scale = tensors.get(f"{module}.{source.scale_suffix}")
        where = f"file {t.path}, tensor {name}"
        if not source.selects(module):
            problems.append(f"{where}: packed MXFP4, but the source's quantization config does not select "
                            f"{module} (refusing to guess what it is)")
            continue
        if scale is None:
            if f"{module}.{source.scale_suffix}" not in unread:
                problems.append(f"{where}: no {source.scale_suffix} for it in any shard")
            continue
        if t.dtype != "U8" or scale.dtype not in E8M0_DTYPES:
            problems.append(f"{where}: expected uint8 packed and scale, got {t.dtype} and {scale.dtype}")
            continue
        if len(t.shape) != 2 or len(scale.shape) != 2:
            problems.append(f"{where}: expected 2-D packed and scale, got {list(t.shape)} and {list(scale.shape)}")
            continue
        rows, cols = t.shape[0], 2 * t.shape[1]
        if not rows or not cols:  # the kernels and the int4 layout need at least one group
            problems.append(f"{where}: shape [{rows}, {cols}] has a zero dimension: not a weight matrix")
            continue
        if cols % 32:
            problems.append(f"{where}: in-dim {cols} is not a multiple of 32")
            continue
        if scale.shape != (rows, cols // 32):
            problems.append(f"{where}: packed {list(t.shape)} and scale {list(scale.shape)} do not match "
                            f"(expected scale [{rows}, {cols // 32}])")
            continue
        converts[module] = Convert(module, t, scale, rows, cols)
    problems += collisions(tensors, converts)
    problems += orphans(tensors, converts, source, ((source.scale_suffix, E8M0_DTYPES),), unread)
    return converts


def pair_nvfp4(tensors: dict[str, TensorInfo], source: Nvfp4Source, problems: list[str], unread: set[str]
           ) -> dict[str, Convert]:
    """Every NVFP4 module of the checkpoint, its three tensors found in any shard, each apart from the others
    (transformers' ``save_pretrained`` writes a module's global scale first, so a shard cut leaves it alone at
    the end of the previous shard: docs/nvfp4.md). ``Nvfp4Source.problem`` checks them from the headers;
    their values are checked as each module is read, tensor by tensor, in ``run.shard``."""
    def described(t: TensorInfo | None) -> tuple[str, tuple[int, ...]] | None:
        return None if t is None else (t.dtype, tuple(t.shape))

    suffix = "." + source.packed_suffix
    converts: dict[str, Convert] = {}
    for name, t in tensors.items():
        if not source.packs(name, t.dtype):   # ModelOpt: a bf16 X.weight is unquantized
            continue
        m = name[: -len(suffix)]
        scale, gs = tensors.get(f"{m}.{source.scale_suffix}"), tensors.get(f"{m}.{source.global_suffix}")
        if (scale is None and f"{m}.{source.scale_suffix}" in unread) or (gs is None and f"{m}.{source.global_suffix}"
                                                                          in unread):
            continue
        why = source.problem(m, (t.dtype, tuple(t.shape)), described(scale), described(gs))
        if why:
            problems.append(f"file {t.path}, tensor {name}: {why}")
        elif scale is not None and gs is not None:
            converts[m] = Nvfp4Convert(m, t, scale, t.shape[0], 2 * t.shape[1], gs, source.divide)
    problems += collisions(tensors, converts)
    problems += orphans(tensors, converts, source,
                        ((source.scale_suffix, ("F8_E4M3",)), (source.global_suffix, ("F32",))), unread)
    return converts


def orphans(tensors: dict[str, TensorInfo], converts: dict[str, Convert], source: ckpt.MXFP4Source,
            parts: tuple[tuple[str, tuple[str, ...]], ...], unread: set[str]) -> list[str]:
    """Scale tensors (``parts``: suffix and dtypes) of a selected module whose packed tensor is in no
    shard: copied, they would pass through as data."""
    out = []
    ends = [("." + suffix, dtypes) for suffix, dtypes in parts]
    for name, t in tensors.items():   # one pass over the checkpoint's ~497k names
        for end, dtypes in ends:
            if not name.endswith(end) or t.dtype not in dtypes:
                continue
            m = name[: -len(end)]
            packed = f"{m}.{source.packed_suffix}"
            if m not in converts and packed not in tensors and packed not in unread and source.selects(m):
                out.append(f"file {t.path}, tensor {name}: no {source.packed_suffix} for it in any shard")
    return out


def collisions(tensors: dict[str, TensorInfo], converts: dict[str, Convert]) -> list[str]:
    """Source tensors that would clash with a converted module in DST, or describe it twice.

    The names DST writes for module X (X.weight_packed, X.weight_scale, X.weight_shape) and X's
    plain X.weight: any of them in SRC other than the packed and scale tensors converted is refused.
    Checked per converted module, not per tensor: four dictionary look-ups each.
    """
    out = []
    for module, c in converts.items():
        consumed = {t.name for t in c.tensors}
        for suffix in (PACKED, SCALE, SHAPE, UNQUANTIZED):
            name = f"{module}.{suffix}"
            t = tensors.get(name)
            if t is None or name in consumed:
                continue
            what = ("a second weight of the module" if suffix == UNQUANTIZED
                    else "k3convert writes a tensor of that name for the converted module")
            out.append(f"file {t.path}, tensor {name}: beside the MXFP4 pair {c.packed.name} / {c.scale.name}: "
                       f"{what}; remove one of them")
    return out
