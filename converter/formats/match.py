"""Which modules a compressed-tensors config's targets and ignore lists select: one rule, with a
named variant for each loader whose rule differs.

A target or ignore entry is a ``re:`` pattern (``re.match``: from the start of the name, not to
its end), else a module name compared exactly, else a class name. Both loaders agree on names
(:func:`match_name`); they differ on classes and on the order of the checks:

=====================  =========================================  =========================================
variant                what a class target matches                 ignore list
=====================  =========================================  =========================================
compressed-tensors     the exact name of a class in the module's   by name and by class, like targets
(``ct_is_match``,      MRO; vLLM's ``LinearBase`` counts as
``CtRule``)            ``Linear``
vLLM (``vllm_group``,  the class's own name: ``re.match``, or the  by name only, first; a fused layer is
``experts_why_not``)   target contained in it case-blind; a        ignored only if all its shards are
                       ``Linear`` target also reaches the experts  (else ValueError)
                       (``RoutedExperts``)
=====================  =========================================  =========================================

Sources, each read for this module (tests/formats/test_match.py runs both against them on a table of
configs):

- compressed-tensors 0.20.1 ``compressed_tensors/utils/match.py``: ``is_match``, ``match_name``,
  ``_match_class``.
- vLLM 0.33.0 and 0.34.0 (the same text): ``model_executor/layers/quantization/compressed_tensors/
  utils.py`` ``should_ignore_layer`` 53-70, ``find_matched_target`` 73-111, ``_find_first_match``
  114-130, ``_match_fused_layer`` 133-176; ``quantization/utils/config_utils.py``
  ``find_matching_patterns`` and ``is_equal_or_regex_match`` (0.33.0: 384-420, 432-452);
  ``compressed_tensors/compressed_tensors.py`` ``from_config`` 235-270 (its group filter),
  ``_add_fused_moe_to_target_scheme_map`` 221-232 and ``get_scheme_dict`` 998-1031, which its MoE
  method calls for ``<layer>.0.<gate|up|down>_proj`` (``compressed_tensors_moe.py`` 35-47).

Where only names are known (a checkpoint, not a model), a module's classes are :data:`LINEAR`
(every int4 module, and every bf16 2-D weight: torch Linears to a loader) or :data:`MODULE`.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

RE = "re:"
LINEAR = frozenset({"Linear", "Module"})   # torch.nn.Linear's classes (its MRO's nn.Module names)
MODULE = frozenset({"Module"})             # a module known by name only (a norm): no class target but Module
VLLM_EXPERTS = "RoutedExperts"             # the class vLLM maps a "Linear" target onto
NO_FUSED: Mapping[str, Sequence[str]] = MappingProxyType({})


class BadPattern(re.error):
    """A ``re:`` target or ignore entry that is not a regular expression (the loaders' re.match raises)."""


@functools.lru_cache(maxsize=4096)
def _regex(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise BadPattern(f"{RE}{pattern!s} is not a regular expression ({e})") from None


def match_name(name: str, pattern: str) -> bool:
    """Both loaders' name rule: a ``re:`` pattern ``re.match``es the name, anything else equals it."""
    if pattern.startswith(RE):
        return _regex(pattern[3:]).match(name) is not None
    return name == pattern


# ---------------------------------------------------------------------------- compressed-tensors

def ct_class(classes: Collection[str], pattern: str) -> bool:
    """compressed-tensors' ``_match_class``: one of the module's class names, exactly."""
    return pattern in classes or pattern == "Linear" and "LinearBase" in classes


def class_names(module: Any) -> frozenset[str]:
    """The class names ``_match_class`` sees on a torch module (its MRO's nn.Module classes)."""
    from torch import nn

    return frozenset(c.__name__ for c in type(module).__mro__ if isinstance(c, type) and issubclass(c, nn.Module))


def _alternation(regexes: list[str]) -> list[re.Pattern]:
    """The patterns as one ``(?:a)|(?:b)`` (re.match of it = any re.match), unless a numbered group
    reference would be renumbered or the union does not compile (a global flag, a repeated group name)."""
    compiled = [_regex(p) for p in regexes]   # each alone first: a bad one is an error, as in the loaders
    if len(regexes) > 1 and not any(re.search(r"\\\d|\(\?P=|\(\?\(", p) for p in regexes):
        try:
            return [re.compile("|".join(f"(?:{p})" for p in regexes))]
        except re.error:
            pass
    return compiled


@dataclass(frozen=True)
class Patterns:
    """A target or ignore list compiled once: plain entries as a set (for lists of 100k names), the
    ``re:`` entries as one alternation."""

    plain: frozenset[str]
    regexes: tuple[re.Pattern, ...]
    _classes: dict = field(default_factory=dict, compare=False, repr=False)   # classes -> by_class

    @classmethod
    def of(cls, patterns: Iterable[str]) -> Patterns:
        patterns = list(patterns)
        return cls(frozenset(p for p in patterns if not p.startswith(RE)),
                   tuple(_alternation([p[3:] for p in patterns if p.startswith(RE)])))

    def by_name(self, name: str) -> bool:
        if name in self.plain:
            return True
        for r in self.regexes:
            if r.match(name):
                return True
        return False

    def by_class(self, classes: frozenset[str]) -> bool:
        hit = self._classes.get(classes)
        if hit is None:
            hit = self._classes[classes] = any(ct_class(classes, p) for p in self.plain)
        return hit


@dataclass(frozen=True)
class CtRule:
    """compressed-tensors' ``is_match`` for one (targets, ignore) pair, compiled: ``rule(name, classes)``."""

    targets: Patterns
    ignore: Patterns

    @classmethod
    def of(cls, targets: Iterable[str], ignore: Iterable[str] = ()) -> CtRule:
        return cls(Patterns.of(targets), Patterns.of(ignore))

    def __call__(self, name: str, classes: frozenset[str]) -> bool:
        t, i = self.targets, self.ignore
        return (t.by_class(classes) or t.by_name(name)) and not (i.by_class(classes) or i.by_name(name))


def ct_is_match(name: str, classes: Collection[str], targets: Iterable[str], ignore: Iterable[str] = ()) -> bool:
    """compressed-tensors' ``is_match`` for a module known by its name and class names (compiled for
    one call: ``CtRule`` for many)."""
    return CtRule.of(targets, ignore)(name, frozenset(classes))


# ---------------------------------------------------------------------------- vLLM

class MixedShards(ValueError):
    """vLLM's should_ignore_layer: the ignore list catches some shards of a fused layer, not all."""


def vllm_match(value: str, pattern: str, contains: bool = False) -> bool:
    """vLLM's ``is_equal_or_regex_match`` (no fnmatch): re.match, else equality, or with
    ``contains`` the pattern inside the value, case-blind."""
    if pattern.startswith(RE):
        return match_name(value, pattern)
    return pattern.lower() in value.lower() if contains else pattern == value


def vllm_ignored(name: str, ignore: Sequence[str], fused: Mapping[str, Sequence[str]] = NO_FUSED) -> bool:
    """Whether vLLM skips layer ``name`` (``should_ignore_layer``): an entry matches it, else, for a
    fused layer (its last component a key of ``fused``), entries match all its shards (some but not
    all: MixedShards)."""
    if any(vllm_match(name, p) for p in ignore):
        return True
    proj = name.split(".")[-1]
    if proj not in fused:
        return False
    shards = [any(vllm_match(name.replace(proj, s), p) for p in ignore) for s in fused[proj]]
    if any(shards) and not all(shards):
        raise MixedShards(f"Found different quantization schemes for the shards of {name}. "
                          "vLLM requires all to use the same scheme.")
    return all(shards)


def vllm_target(name: str, cls: str, targets: Sequence[str],
                fused: Mapping[str, Sequence[str]] = NO_FUSED) -> str | None:
    """The target vLLM picks for layer ``name`` of class ``cls`` (``find_matched_target``): the first
    matching the name, else the fused layer's if every shard matches one, else the first matching
    the class name (contained, case-blind)."""
    def first(value: str, contains: bool = False) -> str | None:
        return next((t for t in targets if vllm_match(value, t, contains)), None)

    def fused_match() -> str | None:
        key = next((k for k in fused if name.endswith(k)), None)
        per_shard = [first(name.replace(key, s)) for s in fused[key]] if key is not None else [None]
        return per_shard[0] if all(per_shard) else None

    return first(name) or fused_match() or first(cls, contains=True)


def vllm_targets(groups: Mapping[str, Sequence[str]], experts_class: str = VLLM_EXPERTS) -> dict[str, str]:
    """vLLM's target -> config group map (``from_config``): a group whose one target names an
    Attention class is dropped, a later group naming a target takes it, and a ``Linear`` target also
    reaches ``experts_class`` (``_add_fused_moe_to_target_scheme_map``, once a MoE layer is built)."""
    out = {t: g for g, targets in groups.items()
           if not (len(targets) == 1 and targets[0].endswith("Attention")) for t in targets}
    if "Linear" in out and experts_class not in out:
        out[experts_class] = out["Linear"]
    return out


def vllm_group(name: str, cls: str, groups: Mapping[str, Sequence[str]], ignore: Sequence[str],
               fused: Mapping[str, Sequence[str]] = NO_FUSED, experts_class: str = VLLM_EXPERTS) -> str | None:
    """The config group whose scheme vLLM gives layer ``name`` of class ``cls`` (``get_scheme_dict``),
    None when ignored or matched by no target."""
    if vllm_ignored(name, ignore, fused):
        return None
    by_target = vllm_targets(groups, experts_class)
    target = vllm_target(name, cls, list(by_target), fused)
    return None if target is None else by_target[target]


def experts_why_not(name: str, experts_class: str, targets: Sequence[str], ignore: Sequence[str]) -> str | None:
    """Why a server gives no scheme to the experts it asks about under ``name`` (``<layer>.0.gate_proj``),
    None when it gives one: vLLM's rule, with ``Linear`` mapped onto ``experts_class`` (the class the
    server maps it onto: vLLM's RoutedExperts, SGLang's FusedMoE)."""
    hit = next((p for p in ignore if vllm_match(name, p)), None)
    if hit is not None:
        return f"ignore entry {hit!r} matches {name}"
    if vllm_group(name, experts_class, {"group": targets}, (), experts_class=experts_class) is None:
        return f"no target matches {name}"
    return None
