"""Where config.json states the expert activation: the one reader for the converter, ``verify
--serving`` and the vLLM plugin's route, so that the three cannot disagree (issue 25, S6).

A config with a ``text_config`` describes its language model there, and vLLM builds the model from
that sub-config alone: ``get_hf_text_config`` (transformers_utils/config.py; docs/serving.md);
``KimiK3Config`` and ``MiniMaxM3Config`` make ``text_config`` from the nested dict
(transformers_utils/configs/kimi_k3.py 99-104, minimax_m3.py 140-144) and keep top-level keys on
the outer config, which the MoE never reads (models/kimi_k3/amd/linear.py 237-242, 751). A field
stated at top level only would therefore not reach the kernel (K3 would fall back to
KimiLinearConfig's ``hidden_act="silu"``, kimi_linear.py 21): it is refused, as is a field stated
in both places with different values. A config without ``text_config`` is read at top level.

Pure: no vLLM import; reads config.json dicts and vLLM's config objects alike (an object's
``text_config`` holds every field, defaults included, so there a top-level field shows as a conflict).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

TEXT, TOP = "text_config", "top-level"
SITU_FIELDS = ("hidden_act", "activation_situ_beta", "activation_situ_linear_beta")   # K3's expert activation
WHY = "vLLM builds the language model (and its experts) from text_config alone"


class ActivationConflict(ValueError):
    """An activation field stated where the model does not read it, or twice with different values."""


def _lookup(scope: Any, key: str) -> tuple[bool, Any]:
    if isinstance(scope, Mapping):
        return (True, scope[key]) if key in scope else (False, None)
    return (True, getattr(scope, key)) if hasattr(scope, key) else (False, None)


def nested(config: Any) -> Any:
    """The config's text_config (a dict or an object), or None for a flat config."""
    found, value = _lookup(config, TEXT) if config is not None else (False, None)
    return value if found and value is not None and not isinstance(value, (str, int, float, list)) else None


def config_field(config: Any, key: str) -> Any:
    """``key`` of a config.json dict or of vLLM's config object (None where absent): the one getter."""
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def text_config(config: Any) -> Any:
    """Where the language model's fields are read: the config's text_config, else the config itself."""
    text = nested(config)
    return config if text is None else text


def find(config: Any, keys: Iterable[str]) -> dict[str, tuple[Any, str]]:
    """Each of ``keys`` the model reads: key -> (value, "text_config" or "top-level"), absent keys left out.

    Raises ActivationConflict naming every field stated at top level beside a text_config that
    lacks it or says otherwise."""
    text = nested(config)
    found: dict[str, tuple[Any, str]] = {}
    problems = []
    for key in dict.fromkeys(keys):
        top, top_value = _lookup(config, key) if config is not None else (False, None)
        if text is None:
            if top:
                found[key] = (top_value, TOP)
            continue
        inner, value = _lookup(text, key)
        if top and not inner:
            problems.append(f"top-level {key} is {top_value!r} but text_config has no {key}")
        elif top and value != top_value:
            problems.append(f"text_config.{key} is {value!r} but top-level {key} is {top_value!r}")
        elif inner:
            found[key] = (value, TEXT)
    if problems:
        raise ActivationConflict("activation fields: " + "; ".join(problems) + f": {WHY} (state them there, once)")
    return found
