"""What the routed experts cost a rank: bytes as stored and dequantized, at a vLLM topology.

vLLM's KimiMoE pads a small per-rank intermediate size (``kimi_fused``); EP deals whole experts,
otherwise the MoE's TP splits each expert; PP gives each stage its layers (topology.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..formats.safetensors_io import TensorInfo
from ..releases import Release, Replicated
from ..vllm_plugin import route as plugin_route
from .headers import W123_MODELS, Matrix, config_size, model_types
from .loaders import text_config
from .topology import Topology, local_experts, pp_stages

_ITEMSIZE = {"I32": 4, "BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I64": 8}


def _nbytes(info) -> int:
    n = _ITEMSIZE.get(info.dtype, 1)
    for d in info.shape:
        n *= d
    return n



_LAYER_NO = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Experts:
    """The routed experts as the headers give them, all ranks together, per MoE layer: expert count
    and bytes (int4 + scales as stored; bf16 dequantized), and the model's decoder layer count."""

    sizes: Mapping[str, tuple[int, int]]
    count: Mapping[str, int]
    int4: Mapping[str, int]
    bf16: Mapping[str, int]
    num_layers: int


def experts_of(mats: list[Matrix], sizes: Mapping[str, tuple[int, int]], config: dict | None) -> Experts:
    """One pass over the headers (K3: 247,296 matrices); the per-topology figures are then per layer."""
    ids: dict[str, set[int]] = {}
    int4: dict[str, int] = {}
    bf16: dict[str, int] = {}
    for m in mats:
        p, shape = m.expert, m.shape
        if p is None or p[0] not in sizes or shape is None:
            continue
        ids.setdefault(p[0], set()).add(p[1])
        int4[p[0]] = int4.get(p[0], 0) + _nbytes(m.packed) + (_nbytes(m.scale) if m.scale is not None else 0)
        bf16[p[0]] = bf16.get(p[0], 0) + shape[0] * shape[1] * 2
    stated = config_size(config, "num_hidden_layers")
    numbers = [int(g[1]) for layer in sizes if (g := _LAYER_NO.search(layer))]
    layers = stated[1] if stated else max(numbers, default=0) + 1
    return Experts(dict(sizes), {k: len(v) for k, v in ids.items()}, int4, bf16, max(layers, 1))


@dataclass(frozen=True)
class Memory:
    """The routed experts' bytes on the fullest rank: as stored (int4 + scales) and dequantized to bf16."""

    int4: int
    bf16: int
    layers: int              # MoE layers on that rank (its pipeline stage)
    all_layers: int
    local: int               # experts a rank holds (of the largest layer)
    experts: int
    per_rank_inter: int      # intermediate channels a rank holds per expert (KimiMoE's padding included)
    inter: int
    padded: bool = False     # KimiMoE padded the intermediate dim

    def text(self) -> str:
        return f"{self.bf16 / 1e9:.3g} GB per rank bf16 (int4 as stored: {self.int4 / 1e9:.3g} GB)"

    def split(self) -> str:
        """What a rank holds, in one phrase."""
        pad = " (padded)" if self.padded else ""
        return (f"{self.local}/{self.experts} experts x {self.per_rank_inter}{pad} of {self.inter} intermediate, "
                f"{self.layers}/{self.all_layers} MoE layers")


def kimi_fused(inter: int, tp: int, minimum: int) -> int:
    """The intermediate size vLLM's KimiMoE gives its FusedMoE: ``minimum * tp`` when inter / tp is
    below ``minimum`` at TP > 1 (models/kimi_k3/amd/linear.py 227-236, the TP group only), else inter."""
    padded = plugin_route.kimi_padded(inter, tp, minimum) if minimum else None
    return padded[1] * tp if padded else inter


def expert_memory(experts: Experts, topo: Topology, kimi_min: int = 0) -> Memory:
    """The fullest rank's routed experts: EP deals whole experts over dp*tp ranks, else the MoE's TP
    (dp*tp) splits each expert's intermediate dim; PP gives each stage its layers (topology.py)."""
    stages = pp_stages(experts.num_layers, topo.pp)
    totals = [[0.0, 0.0, 0] for _ in stages]
    local = n = per_rank = inter_max = 0
    padded = False
    for layer, (inter, _) in sorted(experts.sizes.items()):
        if layer not in experts.count:
            continue
        g = _LAYER_NO.search(layer)
        stage = next((i for i, r in enumerate(stages) if g and int(g[1]) in r), len(stages) - 1)
        e = experts.count[layer]
        held = local_experts(e, topo.ep_size)
        fused = kimi_fused(inter, topo.tp, kimi_min)
        rank_inter = fused // topo.moe_tp
        padded |= fused != inter
        share = held / e * rank_inter / inter
        t = totals[stage]
        t[0] += experts.int4[layer] * share
        t[1] += experts.bf16[layer] * share
        t[2] += 1
        if e >= n:
            local, n, per_rank, inter_max = held, e, rank_inter, inter
    int4, bf16, layers = max(totals, key=lambda t: t[0])
    return Memory(round(int4), round(bf16), int(layers), sum(int(t[2]) for t in totals), local, n, per_rank, inter_max,
                  padded)


def kimi_min_per_rank(config: dict | None) -> int:
    """vLLM KimiMoE's minimum per-rank intermediate size for a Kimi checkpoint, 0 for other models."""
    if not model_types(config) & set(W123_MODELS):
        return 0
    return plugin_route.kimi_min_per_rank(text_config(config))


def kimi_padding(sizes: Mapping[str, tuple[int, int]], tp: int, minimum: int) -> list[tuple[str, tuple[int, int]]]:
    """(layer, (real per-rank intermediate, padded)) for every MoE layer vLLM's KimiMoE pads at ``tp``."""
    if not minimum:
        return []
    return [(layer, padded) for layer, (inter, _) in sorted(sizes.items())
            if (padded := plugin_route.kimi_padded(inter, tp, minimum))]


GIB = 1 << 30
# the GPUs a ROCm launch is checked against: MI300X and MI325X, 8 HBM stacks of 24 and 32 GiB
ROCM_GPUS = {"MI300X": 192 * GIB, "MI325X": 256 * GIB}


@dataclass(frozen=True)
class Budget:
    """The share of each GPU vLLM takes (--gpu-memory-utilization), and where the value comes from."""

    value: float
    basis: str               # "--gpu-memory-utilization 0.9", "vLLM 0.34.0's: unset, it resolves to 1 ..."

    @classmethod
    def of(cls, given: float | None, release: Release, platform: str) -> "Budget":
        """The value given, else the release's own resolution on ``platform`` (``Facts.utilization``)."""
        rule = release.facts.utilization
        if given is not None or rule is None:
            value = given if given is not None else 1.0
            return cls(value, f"--gpu-memory-utilization {value!r}" if given is not None else "not modelled")
        return cls(rule.resolve(platform), f"{release.name}'s {rule.rule(platform)}")


# conditions under which a release shards a module it otherwise keeps whole (Replicated.unless), on the
# text config and the TP size: KimiMoE's routed_expert_up_proj (models/kimi_k3/amd/linear.py shard_up_proj)
SHARDED_WHEN: dict[str, Callable[[Mapping, int], bool]] = {
    "kimi_up_proj_sharded": lambda cfg, tp: (
        tp > 1 and isinstance(cfg.get("hidden_size"), int) and cfg["hidden_size"] % tp == 0
        and ("num_shared_experts" not in cfg or cfg["num_shared_experts"] is not None)
        and cfg.get("routed_scaling_factor", 1.0) == 1.0),
}


@dataclass(frozen=True)
class Rest:
    """Every weight that is not a routed expert's (attention, dense and shared MLPs, embeddings, norms, the
    router, the vision tower), as vLLM splits it: most by TP, some kept whole on every TP rank."""

    sharded: int                                     # bytes split by TP
    whole: tuple[tuple[Replicated, int], ...] = ()   # bytes of each module kind the release keeps whole
    text: Mapping = field(default_factory=dict)      # the text config, for Replicated.unless

    def per_rank(self, topo: Topology) -> tuple[int, int]:
        """(bytes split by TP, bytes held whole) on one rank at ``topo``; each PP stage holds its share."""
        whole = split = 0
        for row, n in self.whole:
            if row.unless and SHARDED_WHEN[row.unless](self.text, topo.tp):
                split += n
            else:
                whole += n
        return (self.sharded + split) // (topo.tp * topo.pp), whole // topo.pp


def rest_of(tensors: Mapping[str, TensorInfo], mats: list[Matrix], release: Release, config: dict | None,
            platform: str) -> Rest:
    """``Rest`` of a checkpoint under a release: the modules its classes keep whole (``Facts.replicated``,
    by model type and platform) counted apart."""
    experts = {m.module for m in mats if m.expert is not None}
    types = sorted(model_types(config))
    table = release.facts.replicated
    rows = next((table[(t, platform)] for t in types if (t, platform) in table), ())
    patterns = [re.compile(r.pattern) for r in rows]
    whole = [0] * len(rows)
    sharded = 0
    for name, info in tensors.items():
        if name.rpartition(".")[0] in experts:
            continue
        i = next((i for i, p in enumerate(patterns) if p.search(name)), None)
        if i is None:
            sharded += _nbytes(info)
        else:
            whole[i] += _nbytes(info)
    text = text_config(config)
    return Rest(sharded, tuple((r, n) for r, n in zip(rows, whole) if n), text)


@dataclass(frozen=True)
class Fit:
    """Whether one rank's weights fit each GPU at a memory utilization, and what is left for the KV cache."""

    experts: int             # bytes of routed experts on the fullest rank
    rest: int                # bytes of the other weights per rank split by TP and PP
    budget: Budget
    gpus: Mapping[str, int]  # GPU name -> bytes
    replicated: int = 0      # bytes of the weights vLLM keeps whole on every TP rank

    @property
    def utilization(self) -> float:
        return self.budget.value

    @property
    def weights(self) -> int:
        return self.experts + self.rest + self.replicated

    def left(self, gpu: str) -> float:
        """Bytes left for the KV cache and activations (negative: does not fit)."""
        return self.gpus[gpu] * self.utilization - self.weights

    @property
    def fits_any(self) -> bool:
        return any(self.left(g) >= 0 for g in self.gpus)

    def margin(self, gpu: str) -> str:
        """'14.8 GB left for the KV cache' or '2.1 GB short'."""
        left = self.left(gpu)
        return f"{left / 1e9:.3g} GB left for the KV cache" if left >= 0 else f"{-left / 1e9:.3g} GB short"

    def room(self, gpu: str) -> str:
        """'14.8 GB left for the KV cache' or 'does not fit (2.1 GB short)'."""
        return self.margin(gpu) if self.left(gpu) >= 0 else f"does not fit ({self.margin(gpu)})"

    def lines(self) -> list[str]:
        """The weights a rank holds; the room left on each GPU; where the utilization comes from."""
        whole = f", on every TP rank {self.replicated / 1e9:.3g}" if self.replicated else ""
        each = [f"{g} {b / GIB:g} GiB x {self.utilization:g}: {self.room(g)}" for g, b in self.gpus.items()]
        return [f"weights per rank {self.weights / 1e9:.3g} GB (experts {self.experts / 1e9:.3g}{whole}, split by "
                f"TP {self.rest / 1e9:.3g})", "; ".join(each),
                f"gpu_memory_utilization {self.utilization:g}: {self.budget.basis}"]

    def text(self) -> str:
        return "; ".join(self.lines())


def fit(experts: int, rest: Rest, topo: Topology, gpus: Mapping[str, int], budget: Budget) -> Fit:
    """The fullest rank: its experts (expert_memory), its TP x PP share of the weights vLLM splits, and
    the weights it keeps whole (``Rest``)."""
    split, whole = rest.per_rank(topo)
    return Fit(experts, split, budget, dict(gpus), whole)
