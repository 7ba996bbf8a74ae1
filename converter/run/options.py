"""A run's options and its summary: what the CLI, a job file or a library caller asks for, checked once
(``Options.check``), and what the run reports back."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .. import __version__
from ..errors import BadInput
from ..profiles import MAX_EXPERTS, Profile
from ..quant.rules import DEFAULT as SCALE_RULE_DEFAULT, ScaleRule, recorded_rule
from ..state.manifest import Status
from .plan import Plan, build_plan
from .sources import profile_argument, profile_identity


@dataclass
class Options:
    max_rel_rmse: float = 0.15   # optimal requantization of MXFP4 gives ~0.1 on real-like data
    sample_experts: int = 4      # experts per layer whose output error y = W x is measured
    devices: list[str] | None = None  # None: every visible GPU, else CPU
    workers: int | None = 1      # CPU processes when converting on the CPU; None: chosen from the machine
    workers_per_gpu: int = 2     # two shards in flight per GPU: one output file is one write stream
    overwrite: bool = False
    batch_groups: int | None = None   # groups per requantize call [default: 2**20 CPU, 2**21 GPU]
    shard_spec: str | None = None     # --shards 3,5-9: convert only these (batch jobs)
    part: str | None = None           # --part i/n
    profile: str | Profile | None = None  # model profile name or file (a recorded one: as read) [default: chosen]
    drop_activation_quant: bool = False  # convert a source that also quantizes activations, weight-only
    inline: bool | None = None        # one worker in this process [default: when torch is imported here]
    scale_rule: ScaleRule = SCALE_RULE_DEFAULT  # --scale-rule (quant/rules.py); a name is parsed here
    fp8_bf16_tp: int | None = None    # --fp8-bf16-at-tp N: FP8 linears vLLM refuses at TP N written as bf16

    def identity(self) -> dict[str, Any]:
        """Every option that changes what DST holds or whether it is complete: what must match for a
        run (a job-array part, a resume, ``finalize``) to continue or share a previous one's DST."""
        return {"version": __version__, "sample_experts": self.sample_experts,
                "profile": profile_identity(self.profile),  # what the profile is, not where it was found
                "drop_activation_quant": self.drop_activation_quant, "scale_rule": self.scale_rule,
                "max_rel_rmse": self.max_rel_rmse,
                **({"fp8_bf16_tp": self.fp8_bf16_tp} if self.fp8_bf16_tp is not None else {})}

    @classmethod
    def recorded(cls, identity: Mapping[str, Any]) -> "Options":
        """The options a DST's run.json records (``identity``), for a standalone ``finalize``."""
        return cls(profile=profile_argument(identity.get("profile")),
                   drop_activation_quant=bool(identity.get("drop_activation_quant")),
                   scale_rule=ScaleRule.parse(recorded_rule(identity)),
                   sample_experts=identity.get("sample_experts", 4),
                   max_rel_rmse=identity.get("max_rel_rmse", Options.max_rel_rmse),
                   fp8_bf16_tp=identity.get("fp8_bf16_tp"))

    def plan(self, src: str) -> Plan:
        """The preflight of SRC with these options; a scale rule the source is not converted under
        (``MXFP4Source.scale_rules``) is refused here, before any work."""
        plan = build_plan(src, self.profile, self.drop_activation_quant, self.fp8_bf16_tp)
        if (rule := ScaleRule.parse(self.scale_rule)) not in plan.source.scale_rules:
            raise BadInput(f"--scale-rule {rule}: {plan.source.source_format} sources are converted with "
                           f"{', '.join(plan.source.scale_rules)} only (docs/nvfp4.md)",
                           file=os.path.join(plan.src, "config.json"))
        return plan

    def check(self) -> None:
        """Refuse option values that would silently turn a check off (``nan`` compares false)."""
        x = self.max_rel_rmse
        if not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise BadInput(f"--max-rel-rmse {x}: expected a finite number >= 0")
        n = self.sample_experts
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_EXPERTS:
            raise BadInput(f"--sample-experts {n!r}: expected a whole number from 0 to {MAX_EXPERTS}")
        t = self.fp8_bf16_tp
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise BadInput(f"--fp8-bf16-at-tp {t!r}: expected a whole number >= 1")
        self.scale_rule = ScaleRule.parse(self.scale_rule)   # the one check of a rule name: typed from here on


@dataclass
class Summary:
    dst: str
    shards_done: int
    shards_total: int
    tensors: int
    seconds: float
    bytes_in: int
    bytes_out: int
    layers: list[dict] = field(default_factory=list)
    complete: bool = False
    scale_rule: str = SCALE_RULE_DEFAULT
    cmp_ratio: float | None = None  # the other rule's error over ours (validate.error_ratio)
    status: Status = Status.PARTIAL
    worst: dict | None = None
    bf16: int = 0   # MXFP4 modules that are not routed experts, written as exact bf16 (items.Dequant)


Event = Callable[[str, dict], None]  # (kind, fields): progress for bars and JSON logs


def default_dst(src: str) -> str:
    return os.path.abspath(src).rstrip(os.sep) + "-int4"
