"""Whether a config's targets and ignore lists select exactly the converted modules, decided the
way compressed-tensors' loader decides (``compressed_tensors.utils.match.is_match``)."""
from __future__ import annotations

import re

from ..formats import checkpoint as ckpt
from ..formats.dialect import EXPERT_TARGET, is_fp8_block_group
from .sample import spread

CHECKED_BY_LOADER = 256  # converted modules whose fast verdict compressed-tensors' is_match re-decides
# The class names compressed-tensors' ``_match_class`` matches a module by (``_class_names``): a
# converted module is a torch.nn.Linear; a module left in bf16 is known only as a Module.
LINEAR_CLASSES = frozenset({"Linear", "Module"})
MODULE_CLASSES = frozenset({"Module"})


def _name_matcher():
    """compressed-tensors' own ``is_match`` (the loader's rule), else ours (same ``re:`` semantics)."""
    try:
        from compressed_tensors.utils.match import is_match
        return is_match
    except ImportError:
        def is_match(name, module, targets, ignore=()):
            cls = type(module).__name__
            return any(ckpt._matches(name, t) or t == cls for t in targets) and \
                not any(ckpt._matches(name, i) or i == cls for i in ignore)
        return is_match


def _class_names(module) -> set[str]:
    """The class names compressed-tensors' ``_match_class`` matches a module by (LinearBase counts as Linear)."""
    import torch.nn as nn

    names = {c.__name__ for c in type(module).__mro__ if isinstance(c, type) and issubclass(c, nn.Module)}
    return names | ({"Linear"} if "LinearBase" in names else set())


def _fast_rule(patterns: list[str]):
    """``(name, class names) -> bool`` with is_match's rules: exact names as a set, ``re:`` patterns
    compiled and matched from the start, class names against the module's classes."""
    names = {p for p in patterns if not p.startswith("re:")}
    rx = [p[3:] for p in patterns if p.startswith("re:")]
    if rx and not any(re.search(r"\\\d|\(\?P=", p) for p in rx):  # one alternation: no backreference renumbered
        try:
            rx = [re.compile("|".join(f"(?:{p})" for p in rx))]
        except re.error:  # e.g. a global flag that must come first: one pattern at a time
            rx = [re.compile(p) for p in rx]
    else:
        rx = [re.compile(p) for p in rx]
    by_class = {k: bool(names & k) for k in (LINEAR_CLASSES, MODULE_CLASSES)}
    return lambda name, classes: name in names or by_class[classes] or any(r.match(name) for r in rx)


def selection_problems(blocks: list[tuple[tuple[str, ...], dict]], converted: list[str], plain: list[str],
                       shown: int = 5, *, loader: bool = True) -> list[str]:
    """Whether the config's targets and ignore lists select exactly the converted modules.

    Decided by compressed-tensors' matcher on the module names a loader sees: a converted
    module (a Linear) must be selected by some group; a module left in bf16 (``X.weight``) must
    not be selected by name, or a loader would look for int4 tensors it lacks. Class targets
    ("Linear") are left to the ignore list for bf16 modules: names alone cannot tell a Linear.

    At K3 scale (70k expert modules) one ``is_match`` call a module costs seconds, so a fast pass
    decides each module with the same rules (``_fast_rule``). With ``loader``, ``is_match`` then
    decides every module the fast pass failed, every bf16 and non-expert module, and a spread of
    ``CHECKED_BY_LOADER`` experts; should it disagree with the fast pass on any of them, it decides
    every module: the loader's matcher has the last word. Without ``loader`` the fast pass decides
    alone and neither torch nor compressed-tensors (seconds to import) is loaded.
    """
    groups = [(g.get("targets") or [], b.get("ignore") or []) for _, b in blocks
              for g in (b.get("config_groups") or {}).values() if not is_fp8_block_group(g)]
    fast = [(_fast_rule(t), _fast_rule(i)) for t, i in groups]

    def by_fast(name: str, classes: frozenset) -> bool:
        return any(t(name, classes) and not i(name, classes) for t, i in fast)

    verdict = {m: by_fast(m, LINEAR_CLASSES) for m in converted}
    plain_verdict = {m: by_fast(m, MODULE_CLASSES) for m in plain}
    if loader:
        verdict, plain_verdict = _by_loader(groups, converted, plain, verdict, plain_verdict)

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


def _by_loader(groups: list[tuple[list[str], list[str]]], converted: list[str], plain: list[str],
               verdict: dict[str, bool], plain_verdict: dict[str, bool]) -> tuple[dict, dict]:
    """The fast verdicts where compressed-tensors' ``is_match`` agrees on every module it re-decides,
    else its verdicts on every module."""
    import torch.nn as nn

    is_match = _name_matcher()
    linear, unknown = nn.Linear(1, 1, device="meta"), nn.Module()

    def split(patterns: list[str]) -> tuple[set[str], list[str]]:
        """Exact names (match_name is then equality: a set lookup, for lists of 100k names) and the rest."""
        exact = {p for p in patterns if not p.startswith("re:") and "." in p}
        return exact, [p for p in patterns if p not in exact]

    loader = [(split(t), split(i)) for t, i in groups]

    def hits(name: str, module, rule: tuple[set[str], list[str]]) -> bool:
        return name in rule[0] or bool(rule[1]) and is_match(name, module, rule[1])

    def by_loader(name: str, module) -> bool:
        return any(hits(name, module, t) and not hits(name, module, i) for t, i in loader)

    expert = re.compile(EXPERT_TARGET[3:]).match
    experts = [m for m in converted if expert(m)]
    checked = set(spread(experts, CHECKED_BY_LOADER)) | (set(converted) - set(experts))
    checked |= {m for m, ok in verdict.items() if not ok}
    agree = _class_names(linear) == LINEAR_CLASSES and _class_names(unknown) == MODULE_CLASSES and \
        all(by_loader(m, linear) == verdict[m] for m in sorted(checked)) and \
        all(by_loader(m, unknown) == ok for m, ok in plain_verdict.items())
    if agree:
        return verdict, plain_verdict
    return {m: by_loader(m, linear) for m in converted}, {m: by_loader(m, unknown) for m in plain}
