"""The int4 scale rules ``--scale-rule`` chooses between (torch-free: the CLI and coordinator read it).

A ``ScaleRule`` is a ``str`` (its value is what manifests, reports and configs record), made once at
the edge (``parse``) and carried as such: no code below the CLI and ``Options`` checks a rule name.
"""
from __future__ import annotations

import enum
from typing import Any, Mapping

from ..errors import BadInput


class ScaleRule(enum.StrEnum):
    OPTIMAL = "optimal"
    OPTIMAL_PM7 = "optimal-pm7"
    VLLM_GFX942 = "vllm-gfx942"

    @property
    def optimum(self) -> bool:
        """The codes written are an exact least-squares optimum (its comparison is the server rule)."""
        return self in OPTIMA

    @property
    def qmin(self) -> int:
        """Lowest code of the optimum a run of this rule computes: its own, or for the server rule the
        default optimum that its report compares it with."""
        return OPTIMA.get(self, OPTIMA[DEFAULT])

    @property
    def compared_with(self) -> "ScaleRule":
        """The rule whose error the report sets beside this one's."""
        return ScaleRule.VLLM_GFX942 if self.optimum else DEFAULT

    @classmethod
    def parse(cls, value: object, what: str = "--scale-rule") -> "ScaleRule":
        """The one place a rule name is checked: BadInput naming the choices."""
        if isinstance(value, str) and value in cls.__members__.values():
            return cls(value)
        raise BadInput(f"{what} {value!r}: expected one of {', '.join(RULES)}")


RULES = {
    ScaleRule.OPTIMAL: "the exact least-squares optimum per group (docs/maths.md)",
    ScaleRule.OPTIMAL_PM7: "the exact least-squares optimum per group over codes [-7, 7]: never code -8, which no "
                           "int4 MoE kernel on AMD gfx942 (AITER) has been run with (docs/maths.md)",
    ScaleRule.VLLM_GFX942: "bit-identical to vLLM's gfx942 load-time requantization (0.33 and 0.34: aiter "
                           "per_1x32_i4_quant)",
}
DEFAULT = ScaleRule.OPTIMAL
RULE_KEY = "k3convert_scale_rule"  # in the output quantization_config: compressed-tensors and vLLM ignore it
# The exact optima, by their lowest code (the highest is 7): one search, two code ranges. A run of any
# other rule (the server's) still computes the default optimum, for the report's comparison.
OPTIMA = {ScaleRule.OPTIMAL: -8, ScaleRule.OPTIMAL_PM7: -7}


def optimum_qmin(rule: str) -> int:
    """Lowest code of the optimum a run of ``rule`` computes (``ScaleRule.qmin``)."""
    return ScaleRule(rule).qmin


def recorded_rule(record: Mapping[str, Any]) -> str:
    """The scale rule name a manifest (or a run's options) records: its ``scale_rule``, else its
    ``options.scale_rule``, else the default (outputs written before the option existed). Not parsed:
    its readers say which file holds a name that is not a rule."""
    return record.get("scale_rule") or (record.get("options") or {}).get("scale_rule") or DEFAULT
