"""The int4 scale rules ``--scale-rule`` chooses between (torch-free: the CLI and coordinator read it)."""
from __future__ import annotations

RULES = {
    "optimal": "the exact least-squares optimum per group (docs/maths.md)",
    "optimal-pm7": "the exact least-squares optimum per group over codes [-7, 7]: never code -8, which no "
                   "int4 MoE kernel on AMD gfx942 (AITER) has been run with (docs/maths.md)",
    "vllm-gfx942": "bit-identical to vLLM 0.33's gfx942 load-time requantization (aiter per_1x32_i4_quant)",
}
DEFAULT = "optimal"
RULE_KEY = "k3convert_scale_rule"  # in the output quantization_config: compressed-tensors and vLLM ignore it
# The exact optima, by their lowest code (the highest is 7): one search, two code ranges. A run of any
# other rule (the server's) still computes the default optimum, for the report's comparison.
OPTIMA = {"optimal": -8, "optimal-pm7": -7}


def optimum_qmin(rule: str) -> int:
    """Lowest code of the optimum a run of ``rule`` computes: its own, or for the server rule the
    default optimum (``optimal``) that its report compares it with."""
    return OPTIMA.get(rule, OPTIMA[DEFAULT])


def recorded_rule(record: dict) -> str:
    """The scale rule a manifest (or a run's options) records: its ``scale_rule``, else its
    ``options.scale_rule``, else the default (outputs written before the option existed)."""
    return record.get("scale_rule") or (record.get("options") or {}).get("scale_rule") or DEFAULT
