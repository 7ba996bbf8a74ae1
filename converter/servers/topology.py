"""How vLLM splits a MoE model over ranks: TP, DP, EP and PP, as its released code does it.

Pure arithmetic, no vLLM import, so `verify --serving` can say what each rank holds. Each rule is
cited by the release's ``split.*`` keys (``releases/``): EP is on when --enable-expert-parallel is
given and dp * tp > 1 (``split.ep``); without EP the MoE's TP is flattened across DP, tp_size =
dp * tp, and every rank holds every expert (``split.tp``); with EP, ep_size = dp * tp, the MoE's
tp_size is 1 and experts are dealt out evenly, the first ``num_experts % ep_size`` ranks one more
(``split.experts``); EP with DP > 1 dispatches tokens through an all2all backend
(``split.all2all``); PP cuts ``num_hidden_layers`` into equal stages, the remainder one each to
the stages before the last (``split.pp``). Attention layers, and Kimi's ``KimiMoE`` padding, see
only the TP group, never DP.
"""
from __future__ import annotations

from dataclasses import dataclass

SPLITS = ("ep", "tp", "experts", "all2all", "pp")     # the release's citation keys are split.<name>


@dataclass(frozen=True)
class Topology:
    """A vLLM launch: --tensor-parallel-size, --data-parallel-size, --pipeline-parallel-size,
    --enable-expert-parallel."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: bool = False     # --enable-expert-parallel given

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def ep_on(self) -> bool:
        """EP is in force (the flag alone does nothing on one MoE rank)."""
        return self.ep and self.dp * self.tp > 1

    @property
    def moe_tp(self) -> int:
        """The MoE's tp_size: how many ways each expert's intermediate dim is split."""
        return 1 if self.ep_on else self.dp * self.tp

    @property
    def ep_size(self) -> int:
        """How many ranks the experts are dealt over (1: every rank holds every expert)."""
        return self.dp * self.tp if self.ep_on else 1

    @property
    def all2all(self) -> bool:
        """Tokens are dispatched to the experts' ranks through an all2all backend."""
        return self.ep_on and self.dp > 1

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp

    def text(self) -> str:
        """'DP 2 x TP 8 + EP', 'PP 2 x TP 8', 'TP 8'."""
        parts = [f"{k} {v}" for k, v in (("DP", self.dp), ("PP", self.pp)) if v > 1] + [f"TP {self.tp}"]
        return " x ".join(parts) + (" + EP" if self.ep else "")

    def flags(self) -> str:
        """The vllm serve flags of this topology."""
        out = [f"--tensor-parallel-size {self.tp}"]
        if self.dp > 1:
            out.insert(0, f"--data-parallel-size {self.dp}")
        if self.pp > 1:
            out.append(f"--pipeline-parallel-size {self.pp}")
        if self.ep:
            out.append("--enable-expert-parallel")
        return " ".join(out)

    def with_tp(self, tp: int) -> "Topology":
        return Topology(tp, self.dp, self.pp, self.ep)


def local_experts(num_experts: int, ep_size: int) -> int:
    """The most experts any rank holds (expert_map_manager.py 66-69)."""
    return num_experts // ep_size + (1 if num_experts % ep_size else 0)


def pp_stages(num_layers: int, pp: int) -> list[range]:
    """The layer indices of each pipeline stage (get_pp_indices without VLLM_PP_LAYER_PARTITION)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append(range(start, start + n))
        start += n
    return out
