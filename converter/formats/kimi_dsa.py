"""Kimi K3.1's DSA (sparse attention): does the config's ``dsa_config`` agree with the indexer tensors?

vLLM 0.34 reads ``text_config.dsa_config`` only (KimiLinearDSAConfig.from_dict: a dict whose
``dsa_layers`` (or ``layers``) lists the 1-based decoder layers with an indexer; without them it
raises TypeError; null means no DSA), and each such layer's checkpoint holds
``self_attn.indexer.{wq_b, wk, weights_proj, k_norm}`` (docs/serving.md, "Kimi K3.1"). One rule,
used by ``verify --serving`` and by the vLLM plugin's route: a config and tensors that disagree are
refused before any server loads them, and a release whose ROCm classes have no DSA
(``Facts.rocm_kimi_dsa``) is refused for a K3.1 on ROCm in one line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..releases import VLLM, Release, all_kimi_model_types
from .activation_fields import config_field, text_config

INDEXER_PARTS = ("wq_b", "wk", "weights_proj", "k_norm")
INDEXER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:dsa_)?indexer\.(\w+)\.")
PLACE = "text_config.dsa_config"


@dataclass(frozen=True)
class Dsa:
    """What the config and (where known) the tensors say of DSA."""

    layers: tuple[int, ...] | None           # 0-based decoder layers dsa_config gives an indexer; None: no DSA
    unusable: str | None = None              # why a stated dsa_config is not one vLLM reads as DSA
    raises: bool = False                     # vLLM reads that dsa_config and raises (not: ignores it)
    indexer: Mapping[int, frozenset[str]] | None = None   # layer -> indexer parts in the tensors; None: unknown
    example: str = ""                        # one indexer tensor's name
    num_layers: int | None = None            # num_hidden_layers (indexers past it: the MTP draft's)

    @property
    def wanted(self) -> bool:
        """A DSA model: a usable dsa_config or indexer tensors."""
        return bool(self.layers) or bool(self.indexer)

    @property
    def count(self) -> int:
        return sum(len(v) for v in (self.indexer or {}).values())


def read(config: Any, tensors: Iterable[str] | None = None) -> Dsa:
    """The DSA a config states (a dict, or vLLM's config objects) and the indexer tensors among ``tensors``."""
    text = text_config(config)
    nested = text is not config
    found = config_field(text, "dsa_config")
    where = PLACE if nested else "dsa_config"
    unusable, raises = None, False
    if nested and config_field(config, "dsa_config") is not None and found is None:
        unusable = f"dsa_config is stated at top level, where vLLM does not read it (it reads {PLACE})"
    layers: tuple[int, ...] | None = None
    if found is not None:
        listed = config_field(found, "dsa_layers")
        listed = config_field(found, "layers") if listed is None else listed
        raises = True
        if not isinstance(found, Mapping) and not hasattr(found, "dsa_layers"):
            unusable = f"{where} is {found!r}, not a mapping"
        elif not listed:
            unusable = (f"{where} has no dsa_layers (vLLM's KimiLinearDSAConfig.from_dict raises TypeError "
                        f"without them)")
        elif not isinstance(listed, (list, tuple)) or \
                not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in listed):
            unusable = f"{where}.dsa_layers {listed!r} is not a list of 1-based layer numbers"
        else:
            layers, raises = tuple(sorted({x - 1 for x in listed})), False
    stated = config_field(text, "num_hidden_layers")
    num_layers = stated if isinstance(stated, int) and not isinstance(stated, bool) else None
    if tensors is None:
        return Dsa(layers, unusable, raises, num_layers=num_layers)
    indexer: dict[int, set[str]] = {}
    example = ""
    for name in tensors:
        if m := INDEXER.search(name):
            indexer.setdefault(int(m[1]), set()).add(m[2])
            example = example or name
    return Dsa(layers, unusable, raises, {k: frozenset(v) for k, v in indexer.items()}, example, num_layers)


def indexer_names(config: Any, tensors: Iterable[str]) -> tuple[str, ...]:
    """The DSA indexer tensors of a Kimi checkpoint (all ``read`` looks at), found once: () for other models."""
    if config_field(config, "model_type") not in all_kimi_model_types():
        return ()
    return tuple(n for n in tensors if INDEXER.search(n))


def mismatch(dsa: Dsa) -> str | None:
    """Why the config's DSA and the indexer tensors disagree (or the config's dsa_config cannot be read),
    else None. Where the tensors are unknown (None) only the config is judged."""
    if dsa.unusable and (dsa.raises or dsa.indexer is None or dsa.indexer):
        return dsa.unusable + (f", yet {dsa.count} DSA indexer tensors are there (e.g. {dsa.example})"
                               if dsa.count else "")
    if dsa.indexer is None:
        return None
    if dsa.layers is None:
        return (f"{dsa.count} DSA indexer tensors (e.g. {dsa.example}) but no {PLACE}: vLLM builds no "
                f"indexer for them") if dsa.indexer else None
    missing = [(layer, parts) for layer in dsa.layers
               if (parts := [p for p in INDEXER_PARTS if p not in dsa.indexer.get(layer, ())])]
    if missing:
        layer, parts = missing[0]
        more = f" (and {len(missing) - 1} more layers)" if len(missing) > 1 else ""
        return (f"{PLACE} lists layer {layer + 1} but its self_attn.indexer.{{{', '.join(parts)}}} tensors "
                f"(layers.{layer}) are missing{more}: vLLM would leave that indexer unloaded")
    top = dsa.num_layers if dsa.num_layers is not None else max(dsa.indexer) + 1
    extra = sorted(x for x in set(dsa.indexer) - set(dsa.layers) if x < top)
    if extra:
        more = f" (and {len(extra) - 1} more layers)" if len(extra) > 1 else ""
        return f"DSA indexer tensors in layers.{extra[0]}, which {PLACE}.dsa_layers does not list{more}"
    return None


def problem(config: Any, tensors: Iterable[str] | None, release: Release, rocm: bool) -> tuple[str, str] | None:
    """(the one line, the release's citation key) a vLLM release gives this checkpoint's DSA, or None: the
    config and tensors disagree (``mismatch``), or it is a DSA model (K3.1) where the release's Kimi
    classes for that platform have no DSA (``Facts.kimi_dsa``, ``Facts.rocm_kimi_dsa``). Other models'
    indexers (DeepSeek V3.2's, GLM-5's) are their classes' business: only Kimi model types are judged."""
    if config_field(config, "model_type") not in all_kimi_model_types():
        return None
    dsa = read(config, tensors)
    if why := mismatch(dsa):
        return why, "kimi.dsa-config"
    loads = release.facts.rocm_kimi_dsa if rocm else release.facts.kimi_dsa
    if loads or not (dsa.wanted or dsa.unusable and dsa.indexer is None):
        return None
    found = f"its {dsa.count} indexer tensors (e.g. {dsa.example})" if dsa.count else f"asked for by {PLACE}"
    classes = "ROCm Kimi classes" if rocm else "Kimi classes"
    where = [f"{r.name} on {'ROCm' if r.facts.rocm_kimi_dsa else 'CUDA'}" for r in VLLM if r.facts.kimi_dsa]
    return (f"{release.name}'s {classes} cannot load Kimi K3.1's DSA indexer, {found}: KeyError at load; "
            f"serve K3.1 with {' or '.join(where) or 'no proven vLLM'}", "kimi.dsa-rocm" if rocm else "kimi.dsa-none")
