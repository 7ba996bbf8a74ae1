"""The servers, the rules of their int4 MoE path, and the typed values a check passes around.

A ``Server`` is a target (ROCm gfx942, CUDA) under one release of one family; where each rule is
enforced is that release's data (``releases/``), so one rule table serves every release.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..releases import NEWEST_VLLM, SGLANG, VLLM, Family, Release, vllm_release
from .headers import GROUP
from .memory import ROCM_GPUS, Budget
from .topology import Topology

PLUGIN_METHOD = "k3convert-int4-gfx942 (converter/vllm_plugin)"
MAX_GPU_GB = 1e6      # --gpu-memory's bound: a petabyte per GPU is no GPU, and inf or 1e300 GB no number of bytes


@dataclass(frozen=True)
class Target:
    """A server on one target, and the MoE method its code gives our DST's experts."""

    name: str
    family: Family
    target: str
    method: str
    label: str = ""       # what is added to the release ("+ k3convert plugin")

    @property
    def platform(self) -> str:
        """'ROCm' or 'CUDA': the key of the release facts that differ by platform."""
        return "ROCm" if self.target.startswith("ROCm") else "CUDA"


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("vllm-rocm", Family.VLLM, "ROCm gfx942 (MI300X/MI325X)", "CompressedTensorsWNA16MoEMethod"),
    Target("vllm-rocm-plugin", Family.VLLM, "ROCm gfx942, VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1",
           PLUGIN_METHOD, " + k3convert plugin"),
    Target("vllm-cuda", Family.VLLM, "CUDA, compute capability >= 7.5", "CompressedTensorsWNA16MoEMethod"),
    Target("sglang-rocm", Family.SGLANG, "ROCm (HIP)", "CompressedTensorsWNA16TritonMoE"),
    Target("sglang-cuda", Family.SGLANG, "CUDA", "CompressedTensorsWNA16MoE (Marlin)"),
)}
SERVERS = tuple(TARGETS)


@dataclass(frozen=True)
class Server:
    """A target under one release: what a serving check is asked about."""

    target: Target
    release: Release

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def family(self) -> Family:
        return self.target.family

    @property
    def method(self) -> str:
        return self.target.method

    @property
    def release_text(self) -> str:
        """'vLLM 0.34.0 + k3convert plugin'."""
        return self.release.name + self.target.label


@dataclass(frozen=True)
class ServingRequest:
    """One `verify --serving` question, validated once: which server, release and launch."""

    server: Server
    topology: Topology
    verbose: bool = False
    gpu_memory: float | None = None      # GB per GPU (1e9 bytes); None: MI300X and MI325X on ROCm
    utilization: float | None = None     # vLLM's --gpu-memory-utilization; None: the release's own default

    @classmethod
    def parse(cls, name: str, tp: int | Topology = 1, *, vllm: str | None = None, verbose: bool = False,
              gpu_memory: float | None = None, utilization: float | None = None) -> "ServingRequest":
        """``name`` one of SERVERS; ``vllm`` a proven release ('0.33', '0.34.0'; the newest when None).
        ValueError with the choices otherwise; DP, PP and EP are modelled for vLLM only."""
        if gpu_memory is not None and not (math.isfinite(gpu_memory) and 0 < gpu_memory <= MAX_GPU_GB):
            raise ValueError(f"--gpu-memory must be a positive number of GB up to {MAX_GPU_GB:g}, got {gpu_memory!r}")
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}")
        if name not in TARGETS:
            raise ValueError(f"unknown server {name!r}; one of {', '.join(SERVERS)}")
        target = TARGETS[name]
        topo = tp if isinstance(tp, Topology) else Topology(tp)
        if target.family is Family.SGLANG:
            if topo.dp > 1 or topo.pp > 1 or topo.ep:
                raise ValueError(f"--dp, --pp and --ep are modelled for the vllm-* servers only, not {name}")
            release = SGLANG
        else:
            found = NEWEST_VLLM if vllm is None else vllm_release(vllm)
            if found is None:
                raise ValueError(f"vLLM {vllm} is not a release the rules were read from; one of "
                                 f"{', '.join(r.version for r in VLLM)}")
            release = found
        return cls(Server(target, release), topo, verbose, gpu_memory, utilization)

    def budget(self) -> Budget:
        """The utilization vLLM runs at: the one given, else the release's own on the target's platform."""
        return Budget.of(self.utilization, self.server.release, self.server.target.platform)

    def gpus(self) -> dict[str, int]:
        """The GPUs a launch is checked against (name -> bytes): the one given, else ROCm's two."""
        if self.gpu_memory is not None:
            return {f"{self.gpu_memory:g} GB GPU": int(self.gpu_memory * 1e9)}
        return dict(ROCM_GPUS) if self.server.target.target.startswith("ROCm") else {}


@dataclass(frozen=True)
class Rule:
    """One requirement of the servers' int4 MoE path; where each release enforces it is its data."""

    id: str
    what: str
    fix: str

    def where(self, server: Server) -> str:
        key = f"kernel.{server.name}" if self.id == "kernel" else f"rule.{self.id}"
        return server.release.cite(key)


RULES: dict[str, Rule] = {r.id: r for r in (
    Rule("format", "quant_method compressed-tensors, format pack-quantized",
         "set quant_method 'compressed-tensors' and format 'pack-quantized' (block and config_groups)"),
    Rule("num-bits", "weights.num_bits 4", "set weights.num_bits 4 (the shards hold eight 4-bit values per int32)"),
    Rule("type", "weights.type int", "set weights.type 'int'"),
    Rule("symmetric", "weights.symmetric true",
         "set weights.symmetric true (zero point 8, no weight_zero_point tensors)"),
    Rule("strategy", "weights.strategy group", "set weights.strategy 'group'"),
    Rule("group-size", f"weights.group_size {GROUP}",
         f"convert with group size {GROUP} and set weights.group_size {GROUP}"),
    Rule("actorder", "weights.actorder null", "set weights.actorder null"),
    Rule("static", "weights.dynamic false", "set weights.dynamic false"),
    Rule("input-activations", "input_activations null (W4A16)", "set config_groups.*.input_activations null"),
    Rule("names", "the experts' scheme, looked up as <layer>.experts.0.gate_proj|up_proj|down_proj, is int4",
         "select the routed experts by a pattern that also matches <layer>.experts.0.gate_proj|up_proj|"
         "down_proj (k3convert writes re:.*\\.experts\\.\\d+\\.(w1|w2|w3|gate_proj|up_proj|down_proj)$) "
         "and ignore nothing that matches those names"),
    Rule("packed", "weight_packed int32 [out, in/8]",
         "store weight_packed as int32 [out, in/8] (convert with k3convert)"),
    Rule("scale-dtype", "weight_scale in the model dtype",
         "store weight_scale in the model dtype (config torch_dtype)"),
    Rule("scale-shape", f"weight_scale [out, in/{GROUP}]", f"store weight_scale as [out, in/{GROUP}]"),
    Rule("expert-names", "experts named experts.E.w1/w2/w3 or gate_proj/up_proj/down_proj",
         "name routed experts <layer>.experts.E.w1 (gate), .w3 (up), .w2 (down)"),
    Rule("expert-shapes", "every expert of a layer has gate, up, down of one shape",
         "give every expert w1, w3 [inter, hidden] and w2 [hidden, inter], the same in each layer"),
    Rule("hidden-group", f"expert hidden size a multiple of {GROUP}",
         f"the experts' hidden (input) size must be a multiple of {GROUP}"),
    Rule("tp-intermediate", f"intermediate size divisible by the MoE's TP, per-rank size a multiple of {GROUP}",
         "use a TP size that fits, or expert parallelism (--ep: whole experts per rank)"),
    Rule("config-sizes", "config's MoE sizes match the tensors",
         "make config moe_intermediate_size / routed_expert_hidden_size (or hidden_size) match the tensors"),
    Rule("kernel", "a MoE kernel that takes the experts' activation, at int4 memory",
         "for SiTU experts: on gfx942 serve with k3convert's vLLM plugin (vllm-rocm-plugin: hidden and "
         "per-rank intermediate sizes multiples of 128), on CUDA with vLLM (vllm-cuda)"),
    Rule("loader", "the model's vLLM loader accepts the config at this topology",
         "choose a TP size the model's loader accepts (the TP sizes that pass are listed)"),
    Rule("memory", "one rank's weights fit the GPU at --gpu-memory-utilization",
         "spread the experts over more GPUs (--ep, a larger TP or DP, PP) or use GPUs with more memory"),
)}
# the rules whose outcome depends on the topology (the TP sizes that pass are found by re-running these)
TOPOLOGY_RULES = ("tp-intermediate", "kernel", "loader", "memory")

Problem = tuple[str, str]     # (one short line, the long why: source lines, figures)


@dataclass(frozen=True)
class RuleResult:
    """The outcome of one rule. ``message``: for a failure, one short line naming the rule and what
    is wrong; ``detail``: where each server enforces it (file and line) and the fix (``--verbose``)."""

    rule: str
    ok: bool
    message: str
    note: str = ""     # worth saying on a pass (not a failure)
    detail: str = ""


def result(rule: Rule, problems: list[Problem], note: str = "") -> RuleResult:
    if not problems:
        return RuleResult(rule.id, True, f"rule {rule.id}: {note if rule.id == 'kernel' else rule.what}",
                          note if rule.id != "kernel" else "")
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    if len(problems) > 1:   # every one, each with its source, under --verbose
        why = "; ".join(dict.fromkeys(f"{p} ({d})" if d else p for p, d in problems))
    else:
        why = problems[0][1]
    return RuleResult(rule.id, False, f"rule {rule.id}: {problems[0][0]}{more}", detail=why)


@dataclass(frozen=True)
class Verdict:
    """What a server's code does with the experts, in parts, so that a later finding amends one part
    (the clamp the activation, the padding the outcome) instead of editing the text. ``problem`` is
    one short line (None: it serves right); ``detail`` the source lines and figures behind it."""

    kernel: str                  # the method and backend: "CompressedTensorsWNA16MoEMethod -> MARLIN"
    act: str = ""                # what the kernel does with the activation: ", takes situ"
    memory: str = ""             # "; int4 as stored, 1.85 GB per rank"
    said: str = ""               # how the model hands FusedMoE its activation, where it differs from config
    outcome: str = ""            # ": refused at load", ": padded channels hold garbage"
    problem: str | None = None
    detail: str = ""

    @property
    def summary(self) -> str:
        return f"{self.kernel}{self.act}{self.memory}{self.said}{self.outcome}"

    def amend(self, **parts: Any) -> "Verdict":
        return dataclasses.replace(self, **parts)
