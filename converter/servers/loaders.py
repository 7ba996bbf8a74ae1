"""What each supported model's vLLM loader refuses at load, from config.json and the launch.

One table, ``LOADERS``: a model's ``model_type`` (top level or ``text_config``) -> the refusals its
vLLM classes raise while the model is built, each a config field tested against the topology and
the key of the release's citation (``releases/``) of the line that raises. `verify --serving vllm-*` runs them
(rule ``loader``).

To add a model: read its vLLM class's ``__init__`` (and its MoE, attention and MLP classes) for
every ``raise`` / ``assert`` that depends on config or on the TP/DP/EP/PP sizes, and add one
``Refusal`` per line, keyed by each ``model_type`` the model's configs use, e.g.

    LOADERS["bailing_moe_v3"] = (Refusal("num_experts", "tp<=", "loader.ling.experts"),)

and the citation ``"loader.ling.experts": "$V model_executor/models/... 120-124"`` in each release module.

Kinds (``CHECKS``): ``tp<=`` (TP at most the field), ``tp|`` (TP divides the field), ``kv`` (vLLM's
KV-head rule: the field divides TP or TP divides it), ``is`` (the field is one of ``want``). A field the
config does not state is not checked (vLLM would use its class default, which we do not restate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..releases import Release, all_kimi_model_types
from .topology import Topology


@dataclass(frozen=True)
class Refusal:
    """One load-time refusal: ``key`` (dotted, in the text config) tested by ``kind`` against the topology."""

    key: str
    kind: str
    cite: str            # the release's citation key
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
ENGINE = (Refusal("num_attention_heads", "tp|", "loader.engine.heads"),)

_KIMI = (
    Refusal("num_attention_heads", "tp|", "loader.kimi.heads"),
    Refusal("linear_attn_config.num_heads", "tp|", "loader.kimi.kda-heads"),
)
_MINIMAX = (
    Refusal("num_local_experts", "tp<=", "loader.minimax.experts"),
    Refusal("num_attention_heads", "tp|", "loader.minimax.heads"),
    Refusal("num_key_value_heads", "kv", "loader.minimax.kv-heads"),
)
_MIMO = (
    Refusal("n_routed_experts", "tp<=", "loader.mimo.experts"),
    Refusal("hidden_act", "is", "loader.mimo.act", ("silu",)),
    Refusal("num_key_value_heads", "kv", "loader.qkv"),
    Refusal("swa_num_key_value_heads", "kv", "loader.qkv"),
)
# Ling-3.0: no TP > experts check in its MoE (1157-1227); its MLA asserts the heads split
_LING = (Refusal("num_attention_heads", "tp|", "loader.ling.heads"),)
_GLM5 = (
    Refusal("hidden_act", "is", "loader.glm5.act", ("silu",)),
    Refusal("num_attention_heads", "tp|", "loader.glm5.heads"),
)
LOADERS: dict[str, tuple[Refusal, ...]] = {
    "kimi_linear": _KIMI, **{t: _KIMI for t in all_kimi_model_types()},
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


def refusals(config: dict | None, topo: Topology, release: Release) -> list[tuple[str, str]]:
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
            out.append((f"{why}: vLLM's loader refuses it", release.cite(r.cite)))
    return out
