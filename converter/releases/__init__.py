"""What is true of each server release, as data: one module per release, one registry.

A release module holds everything that release's code was read to say: the file-and-line citation
behind every rule (``CITES``, keyed by fact, paths inside the server's package) and the few facts
that change behaviour (``Facts``: which model types its Kimi classes build, whether its KimiMoE
crashes on padding, where its aiter kernel lives). Adding a release is adding a module and its
proofs (tests run against every release in ``VLLM``); code never spells a version.
"""
from __future__ import annotations

from . import sglang_0_5_23, vllm_0_33, vllm_0_34
from .release import Facts, Family, MoeActivation, Release, Replicated, Utilization, release_series

__all__ = ["Facts", "Family", "MoeActivation", "Release", "Replicated", "Utilization", "release_series"]

VLLM: tuple[Release, ...] = (vllm_0_33.RELEASE, vllm_0_34.RELEASE)     # oldest first
NEWEST_VLLM = VLLM[-1]
SGLANG = sglang_0_5_23.RELEASE


def vllm_release(version: str) -> Release | None:
    """The proven vLLM release of this version's series (every 0.34.x build is 0.34.0's), else None."""
    series = release_series(version)
    return next((r for r in VLLM if r.series == series), None)


def proven_vllm() -> str:
    """'0.33.x, 0.34.x': the series the plugin and the serving check were proven on."""
    return ", ".join(f"{r.series[0]}.{r.series[1]}.x" for r in VLLM)


def all_kimi_model_types() -> tuple[str, ...]:
    """Every model_type some proven vLLM builds with its Kimi K3 classes (K3, K3.1, their drafts)."""
    return tuple(dict.fromkeys(t for r in VLLM for t in (*r.facts.kimi_model_types, *r.facts.kimi_mtp_types)))


def unbuilt(release: Release, model_type: object) -> str | None:
    """Why ``release`` cannot build a Kimi model type a proven vLLM builds ("builds no model of
    model_type 'kimi_k31' (first in vLLM 0.34.0)"), or None: the plugin and the serving check say
    the same thing of K3.1 under 0.33."""
    facts = release.facts
    if model_type not in all_kimi_model_types() or model_type in (*facts.kimi_model_types, *facts.kimi_mtp_types):
        return None
    first = next((r.version for r in VLLM if model_type in r.facts.kimi_model_types), None)
    return f"builds no model of model_type {model_type!r}" + (f" (first in vLLM {first})" if first else "")
