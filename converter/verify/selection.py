"""Whether a config's targets and ignore lists select exactly the converted modules, decided by
compressed-tensors' rule (``formats.match``), its loader's own ``is_match`` having the last word."""
from __future__ import annotations

from collections.abc import Collection

from ..formats.dialect import EXPERT_TARGET, is_fp8_block_group
from ..formats.match import (
    LINEAR,
    MODULE,
    BadPattern,
    CtRule,
    class_names,
    ct_is_match,
    match_name,
)
from .sample import spread

CHECKED_BY_LOADER = 256  # converted modules whose fast verdict compressed-tensors' is_match re-decides


def _name_matcher():
    """compressed-tensors' own ``is_match`` (the loader's), else the same rule from ``formats.match``."""
    try:
        from compressed_tensors.utils.match import is_match
        return is_match
    except ImportError:
        return lambda name, module, targets, ignore=(): ct_is_match(name, class_names(module), targets, ignore)


def selection_problems(blocks: list[tuple[tuple[str, ...], dict]], converted: list[str], plain: list[str],
                       shown: int = 5, *, not_linear: Collection[str] = (), loader: bool = True) -> list[str]:
    """Whether the config's targets and ignore lists select exactly the converted modules.

    Decided by compressed-tensors' matcher on the module names a loader sees: a converted
    module (a Linear) must be selected by some group; a module left in bf16 (``X.weight``) must
    not be, or a loader would look for int4 tensors it lacks. A bf16 module is a torch Linear to
    the loader (a "Linear" target selects it) unless listed in ``not_linear`` (a norm: its class
    is known only as a Module); names alone cannot tell an embedding, which counts as a Linear.

    At K3 scale (70k expert modules) one ``is_match`` call a module costs seconds, so a fast pass
    decides each module with the same rule compiled (``match.CtRule``). With ``loader``, ``is_match``
    then decides every module the fast pass failed, every bf16 and non-expert module, and a spread
    of ``CHECKED_BY_LOADER`` experts; should it disagree with the fast pass on any of them, it
    decides every module: the loader's matcher has the last word. Without ``loader`` the fast pass
    decides alone and neither torch nor compressed-tensors (seconds to import) is loaded.
    """
    groups = [(g.get("targets") or [], b.get("ignore") or []) for _, b in blocks
              for g in (b.get("config_groups") or {}).values() if not is_fp8_block_group(g)]
    try:
        rules = [CtRule.of(t, i) for t, i in groups]
    except BadPattern as e:
        return [f"{e}: a loader's re.match raises on it"]
    other = set(not_linear)
    kind = {m: MODULE if m in other else LINEAR for m in plain}

    def by_fast(name: str, classes: frozenset[str]) -> bool:
        return any(rule(name, classes) for rule in rules)

    verdict = {m: by_fast(m, LINEAR) for m in converted}
    plain_verdict = {m: by_fast(m, kind[m]) for m in plain}
    if loader:
        verdict, plain_verdict = _by_loader(groups, converted, kind, verdict, plain_verdict)

    out = []
    lost = [m for m in converted if not verdict[m]]
    if lost:
        out.append(f"the targets/ignore lists do not select {len(lost)} converted module(s) (a loader would read "
                   f"them as bf16): {', '.join(lost[:shown])}" + (" ..." if len(lost) > shown else ""))
    extra = [m for m in plain if plain_verdict[m]]
    if extra:
        out.append(f"the targets select {len(extra)} module(s) that are not int4 (a loader would look for "
                   f"int4 tensors): {', '.join(extra[:shown])}" + (" ..." if len(extra) > shown else ""))
    return out


def _by_loader(groups: list[tuple[list[str], list[str]]], converted: list[str], kind: dict[str, frozenset[str]],
               verdict: dict[str, bool], plain_verdict: dict[str, bool]) -> tuple[dict, dict]:
    """The fast verdicts where compressed-tensors' ``is_match`` agrees on every module it re-decides,
    else its verdicts on every module."""
    from torch import nn

    is_match = _name_matcher()
    module_of = {LINEAR: nn.Linear(1, 1, device="meta"), MODULE: nn.Module()}

    def split(patterns: list[str]) -> tuple[set[str], list[str]]:
        """Dotted plain names (no class has a dot: is_match is then equality, a set lookup for lists
        of 100k names) and the rest, for is_match."""
        exact = {p for p in patterns if not p.startswith("re:") and "." in p}
        return exact, [p for p in patterns if p not in exact]

    loader = [(split(t), split(i)) for t, i in groups]

    def hits(name: str, module, rule: tuple[set[str], list[str]]) -> bool:
        return name in rule[0] or bool(rule[1]) and is_match(name, module, rule[1])

    def by_loader(name: str, module) -> bool:
        return any(hits(name, module, t) and not hits(name, module, i) for t, i in loader)

    experts = [m for m in converted if match_name(m, EXPERT_TARGET)]
    checked = set(spread(experts, CHECKED_BY_LOADER)) | (set(converted) - set(experts))
    checked |= {m for m, ok in verdict.items() if not ok}
    linear = module_of[LINEAR]
    agree = all(class_names(m) == k for k, m in module_of.items()) and \
        all(by_loader(m, linear) == verdict[m] for m in sorted(checked)) and \
        all(by_loader(m, module_of[kind[m]]) == ok for m, ok in plain_verdict.items())
    if agree:
        return verdict, plain_verdict
    return {m: by_loader(m, linear) for m in converted}, {m: by_loader(m, module_of[kind[m]]) for m in kind}
