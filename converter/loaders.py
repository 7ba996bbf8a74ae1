"""What each supported model's vLLM 0.33.0 loader refuses at load, from config.json and the launch.

One table, ``LOADERS``: a model's ``model_type`` (top level or ``text_config``) -> the refusals its
vLLM classes raise while the model is built, each a config field tested against the topology and
the released file and line that raises. `verify --serving vllm-*` runs them (rule ``loader``).

To add a model: read its vLLM class's ``__init__`` (and its MoE, attention and MLP classes) for
every ``raise`` / ``assert`` that depends on config or on the TP/DP/EP/PP sizes, and add one
``Refusal`` per line, keyed by each ``model_type`` the model's configs use, e.g.

    LOADERS["bailing_moe_v3"] = (Refusal("num_experts", "tp<=", V + "model_executor/models/... 120-124"),)

Kinds (``CHECKS``): ``tp<=`` (TP at most the field), ``tp|`` (TP divides the field), ``kv`` (vLLM's
KV-head rule: the field divides TP or TP divides it), ``is`` (the field is one of ``want``). A field the
config does not state is not checked (vLLM would use its class default, which we do not restate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .topology import Topology

V = "vllm 0.33.0 "
KIMI = V + "models/kimi_k3/amd/"
MINIMAX = V + "models/minimax_m3/amd/model.py"
MIMO = V + "model_executor/models/mimo_v2.py"
LING = V + "model_executor/models/bailing_moe_v3.py"
GLM5 = V + "models/glm5next/common/model.py"
QKV = V + "model_executor/layers/linear.py 1065-1071 (QKVParallelLinear: divide() asserts)"


@dataclass(frozen=True)
class Refusal:
    """One load-time refusal: ``key`` (dotted, in the text config) tested by ``kind`` against the topology."""

    key: str
    kind: str
    where: str
    want: tuple = ()     # for kind "is": the values the loader takes


def _tp_at_most(key: str, value: Any, topo: Topology, _want: tuple) -> str | None:
    return f"TP {topo.tp} > {key} {value}" if isinstance(value, int) and topo.tp > value else None


def _tp_divides(key: str, value: Any, topo: Topology, _want: tuple) -> str | None:
    return f"{key} {value} not divisible by TP {topo.tp}" if isinstance(value, int) and value % topo.tp else None


def _kv_heads(key: str, value: Any, topo: Topology, _want: tuple) -> str | None:
    if not isinstance(value, int) or value < 1:
        return None
    bad = value % topo.tp if value >= topo.tp else topo.tp % value
    return f"{key} {value} and TP {topo.tp} do not divide one another" if bad else None


def _one_of(key: str, value: Any, _topo: Topology, want: tuple) -> str | None:
    return None if value in want else f"{key} is {value!r}, not {' or '.join(map(repr, want))}"


CHECKS: dict[str, Callable[[str, Any, Topology, tuple], str | None]] = {
    "tp<=": _tp_at_most, "tp|": _tp_divides, "kv": _kv_heads, "is": _one_of,
}

# Every vLLM model: the engine refuses heads that TP does not divide before any class is built.
ENGINE = (Refusal("num_attention_heads", "tp|", V + "config/model.py 1557-1563 (verify_with_parallel_config)"),)

_KIMI = (
    Refusal("num_attention_heads", "tp|", KIMI + "linear.py 405 (MLA) and 797-799"),
    Refusal("linear_attn_config.num_heads", "tp|", KIMI + "kda.py 130-131 (KDA heads)"),
)
_MINIMAX = (
    Refusal("num_local_experts", "tp<=", MINIMAX + " 362-366 (MiniMaxM3MoE)"),
    Refusal("num_attention_heads", "tp|", MINIMAX + " 516-517 and 656-657"),
    Refusal("num_key_value_heads", "kv", MINIMAX + " 519-523 and 659-663"),
)
_MIMO = (
    Refusal("n_routed_experts", "tp<=", MIMO + " 138-142 (MiMoV2MoE)"),
    Refusal("hidden_act", "is", MIMO + " 144-148 (MiMoV2MoE: only silu)", ("silu",)),
    Refusal("num_key_value_heads", "kv", QKV),
    Refusal("swa_num_key_value_heads", "kv", QKV),
)
# Ling-3.0: no TP > experts check in its MoE (1157-1227); its MLA asserts the heads split
_LING = (Refusal("num_attention_heads", "tp|", LING + " 480 (BailingMoeV3MLAAttention)"),)
_GLM5 = (
    Refusal("hidden_act", "is", GLM5 + " 202-205 (Glm5NextMLP) and 243-247 (Glm5NextMoE: only silu)", ("silu",)),
    Refusal("num_attention_heads", "tp|", GLM5 + " 765-768 (Glm5NextModel)"),
)
LOADERS: dict[str, tuple[Refusal, ...]] = {
    "kimi_k3": _KIMI, "kimi_linear": _KIMI,
    "minimax_m3_vl": _MINIMAX, "minimax_m3_text": _MINIMAX,
    "mimo_v2_flash": _MIMO, "mimo_v2": _MIMO,
    "bailing_hybrid": _LING, "bailing_moe_v3": _LING,
    "glm5_next": _GLM5, "glm5_next_text": _GLM5,
}


def text_config(config: dict | None) -> dict:
    """The language model's fields (K3 and MiniMax-M3 VL keep them in text_config)."""
    config = config or {}
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _value(cfg: dict, key: str) -> tuple[bool, Any]:
    value: Any = cfg
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def refusals(config: dict | None, topo: Topology) -> list[tuple[str, str]]:
    """(short problem, where) for every load-time refusal the model's vLLM loader raises at ``topo``."""
    config = config or {}
    types = [t for t in (config.get("model_type"), text_config(config).get("model_type")) if isinstance(t, str)]
    table = next((LOADERS[t] for t in types if t in LOADERS), ())
    text = text_config(config)
    out, seen = [], set()
    for r in (*table, *ENGINE):
        stated, value = _value(text, r.key)
        why = CHECKS[r.kind](r.key, value, topo, r.want) if stated else None
        if why and why not in seen:
            seen.add(why)
            out.append((f"{why}: vLLM's loader refuses it", r.where))
    return out
