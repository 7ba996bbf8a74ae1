"""The int4 scale rules ``--scale-rule`` chooses between (torch-free: the CLI and coordinator read it)."""
from __future__ import annotations

RULES = {
    "optimal": "the exact least-squares optimum per group (docs/maths.md)",
    "vllm-gfx942": "bit-identical to vLLM 0.33's gfx942 load-time requantization (aiter per_1x32_i4_quant)",
}
DEFAULT = "optimal"
RULE_KEY = "k3convert_scale_rule"  # in the output quantization_config: compressed-tensors and vLLM ignore it


def recorded_rule(record: dict) -> str:
    """The scale rule a manifest (or a run's options) records: its ``scale_rule``, else its
    ``options.scale_rule``, else the default (outputs written before the option existed)."""
    return record.get("scale_rule") or (record.get("options") or {}).get("scale_rule") or DEFAULT
