"""What the headers and config say, computed once per check; the topology rules re-run against it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..formats import checkpoint as ckpt
from .headers import Matrix
from .memory import Budget, Experts, Rest
from .rules import Problem, Server


@dataclass(frozen=True)
class Context:
    config: dict | None
    mats: list[Matrix]
    sizes: dict[str, tuple[int, int]]
    experts: Experts
    fixed: dict[str, list[Problem]]     # the rules that do not depend on the topology
    server: Server
    fp8: dict[str, tuple[int, int]] = field(default_factory=dict)   # FP8 block linears: module -> [out, in]
    block: tuple[int, int] | None = None                             # their block_structure
    rest: Rest = Rest(0)                                             # every weight but the experts, as split
    gpus: dict[str, int] = field(default_factory=dict)               # the GPUs the memory rule checks
    budget: Budget = Budget(1.0, "not modelled")                     # --gpu-memory-utilization, as resolved
    indexer: tuple[str, ...] = ()                                    # Kimi K3.1's DSA indexer tensors


def activation(config: dict | None) -> dict[str, Any]:
    """hidden_act (lower-case; the servers' default 'silu' when absent) and SiTU's betas, read where
    the model reads them (converter.formats.activation_fields): BadInput for a field stated at top level only."""
    fields = {k: v for k, (v, _) in ckpt.activation_fields(config or {}).items()}
    fields["hidden_act"] = str(fields.get("hidden_act", "silu")).lower()
    return fields

