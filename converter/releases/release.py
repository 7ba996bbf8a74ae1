"""A server release as a value: its family, version, citations and the facts code branches on."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Mapping


class Family(enum.Enum):
    """Whose code a server runs: the rule texts and the kernel choice differ per family."""

    VLLM = "vllm"
    SGLANG = "sglang"


@dataclass(frozen=True)
class MoeActivation:
    """The activation a model's vLLM class gives FusedMoE where it is not config hidden_act."""

    name: str
    defaults: Mapping[str, float]              # config fields passed with it; vLLM's value where config omits one
    cite: str                                  # the release's citation key
    fixed: Mapping[str, float] = field(default_factory=dict)   # passed whatever the config says
    when: str = ""                             # only when this config field holds a non-zero value


@dataclass(frozen=True)
class Utilization:
    """How a vLLM release resolves --gpu-memory-utilization when the flag is not given."""

    default: float                             # unset, and no extensible KV cache
    cite: str                                  # the release's citation key
    extensible: float | None = None            # unset, with the extensible KV cache on (None: the release has none)
    extensible_on: tuple[str, ...] = ()        # platforms ("ROCm", "CUDA") where that KV cache is on by default

    def resolve(self, platform: str) -> float:
        """The value vLLM uses on ``platform`` when the flag is not given (the default configuration)."""
        return self.extensible if self.extensible is not None and platform in self.extensible_on else self.default

    def rule(self, platform: str) -> str:
        """How the release arrives at ``resolve(platform)``, in one phrase."""
        if self.extensible is None or platform not in self.extensible_on:
            return f"default {self.default:g}"
        return (f"default: {self.extensible:g} with its extensible KV cache, on by default on {platform} "
                f"(else {self.default:g})")


@dataclass(frozen=True)
class Replicated:
    """Checkpoint modules a release's model classes keep whole on every TP rank (a ReplicatedLinear, a
    ``disable_tp`` linear, a replicated shard of a merged linear, a norm): their bytes count on each rank."""

    pattern: str                               # a regex searched in the tensor name
    cite: str                                  # the release's citation key
    unless: str = ""                           # a named condition (servers/memory.py SHARDED_WHEN) that shards it


@dataclass(frozen=True)
class Facts:
    """What a vLLM release does that the plugin and the serving check branch on."""

    kimi_model_types: tuple[str, ...] = ()     # model_type values its Kimi K3 classes are built for
    kimi_mtp_types: tuple[str, ...] = ()       # the draft's model_type as its speculative config renames it
    kimi_padding_crashes: bool = False         # KimiMoE crashes zeroing a padded per-rank intermediate
    gemm1_module: str = ""                     # the aiter module its gfx942 K3 route imports gemm1 from
    align: int = 128                           # its route rounds K3 SiTU sizes up to this
    kimi_dsa: bool = False                     # its Kimi classes (CUDA: nvidia/) load K3.1's DSA indexer
    rocm_kimi_dsa: bool = False                # its ROCm Kimi classes (amd/) load K3.1's DSA indexer
    aiter_pin: str = ""                        # the aiter its ROCm image builds (docs/deploy.md)
    moe_activations: Mapping[str, MoeActivation] = field(default_factory=dict)   # by model_type
    utilization: Utilization | None = None     # --gpu-memory-utilization when not given (None: not read)
    replicated: Mapping[tuple[str, str], tuple[Replicated, ...]] = field(default_factory=dict)  # (model_type, platform)


@dataclass(frozen=True)
class Release:
    """One server release: its family, version, citations and facts."""

    family: Family
    version: str
    cites: Mapping[str, str] = field(repr=False)
    facts: Facts = field(default_factory=Facts, repr=False)
    wheel: str = ""                            # the released file the citations were read from

    @property
    def name(self) -> str:
        """'vLLM 0.33.0', 'SGLang 0.5.23'."""
        return f"{'vLLM' if self.family is Family.VLLM else 'SGLang'} {self.version}"

    @property
    def series(self) -> tuple[int, int]:
        s = release_series(self.version)
        assert s is not None, self.version
        return s

    def cite(self, key: str) -> str:
        """One fact's citation, ``$V`` spelled out ("vllm 0.33.0"); a missing key is a bug."""
        return self.cites[key].replace("$V", f"{self.family.value} {self.version}")


def release_series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ('0.33.1+rocm7.0' -> (0, 33)), None if unreadable."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\D|$)", version or "")
    return (int(m[1]), int(m[2])) if m else None
