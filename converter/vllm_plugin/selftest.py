"""A numeric self-test of the routed-experts kernel on the user's own GPU, run once at load (torch only).

Why: nobody here can run AITER's packed-int4 SiTU kernel, and signature checks cannot tell a kernel
that computes SiLU, decodes code -8 as something else, reads another layout or lets padded channels
through from a correct one. So after the first routed-experts layer is laid out, a few tokens go
through the layer's own ``apply`` (the very kernel call the model makes) and are compared with a
float32 reference computed from the checkpoint's int4 codes and scales as compressed-tensors defines
them (value = q * scale) and SiTU-GLU with the config's betas (docs/spec.md §4). Tokens are scaled so that
the gate and up projections reach the ranges where SiTU differs from SiLU and linear_beta clips.
One probe per kernel variant serving reaches (aiter's M tile, chosen by token count: TILE_BANDS), so a
prefill-only fault is caught too. On a mismatch the alternatives that explain it (SiLU, no linear_beta,
-8 read as 0 or +8) are tried per variant, so the refusal names the fault it found, and a fault that
only -8 explains can be repaired (repair.py) instead of refused.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from . import layout

ENV = "K3CONVERT_SELFTEST"     # "0": skip (logged)
TOL = 0.03                     # worst per-token relative L2 error a bf16 a16w4 kernel may show
TOKEN_RMS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)   # target RMS of each token's gate projection
MAX_LOCAL = 8                  # local experts sampled when remote ones fill the rest of top-k
MINUS_EIGHT_FIX = ("convert with `--scale-rule optimal-pm7` (codes in [-7, 7], docs/convert.md: Which scale rule)")
# aiter's untuned int4 MoE picks its M tile from the token count padded up to a power of two
# (get_padded_M, below 32768): `16 if token < 2048 else 32 if token < 16384 else 64` on the padded count,
# so tile 16 up to 1024 tokens, 32 from 1025, 64 from 8193 (literals there, not exposed; file and lines:
# docs/vllm_plugin.md). Each band is probed with its smallest count: a partial last tile too.
TILE_BANDS = ((16, 1), (32, 1025), (64, 8193))   # (tile, smallest token count that reaches it)
DECODE_TOKENS = len(TOKEN_RMS)                      # the smallest band is probed with 8 tokens
DISTINCT = 256   # distinct tokens of a bigger probe; its other rows repeat them in random order


def probe_tokens(first_tokens: int) -> int:
    """The token count a band (its smallest count: TILE_BANDS) is probed with."""
    return max(first_tokens, DECODE_TOKENS)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True)
class Expert:
    """One expert's int4 as loaded (compressed-tensors words, bf16 scales), real channels only."""

    w13_words: torch.Tensor    # int32 [2I, H/8]: rows [0, I) gate, [I, 2I) up
    w13_scales: torch.Tensor   # bf16 [2I, H/32]
    w2_words: torch.Tensor     # int32 [H, I/8]
    w2_scales: torch.Tensor    # bf16 [H, I/32]


@dataclass(frozen=True)
class Activation:
    beta: float
    linear_beta: float | None
    kind: str = "situ"         # "situ" or "silu" (the alternative a faulty kernel computes)


def dequant(words: torch.Tensor, scales: torch.Tensor, minus_eight: float = -8.0) -> torch.Tensor:
    """compressed-tensors int4 (q + 8 per nibble) -> float32 q * scale; ``minus_eight`` is the value
    code -8 takes (-8 for the format; other values model a kernel that reads it wrongly)."""
    q = layout.ct_words_to_codes(words).float()
    if minus_eight != -8.0:
        q = torch.where(q == -8, torch.full_like(q, minus_eight), q)
    return q * scales.float().repeat_interleave(layout.GROUP, dim=-1)


def glu(h13: torch.Tensor, act: Activation) -> torch.Tensor:
    """SiTU-GLU (vLLM's SituAndMul.forward_native, in float32) or SiLU-GLU on [gate | up]."""
    g, u = h13.chunk(2, dim=-1)
    if act.kind == "silu":
        return torch.nn.functional.silu(g) * u
    a = act.beta * torch.tanh(g / act.beta) * torch.sigmoid(g)
    if act.linear_beta is not None:
        u = act.linear_beta * torch.tanh(u / act.linear_beta)
    return a * u


def reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              experts: Mapping[int, Expert], act: Activation, minus_eight: float = -8.0) -> torch.Tensor:
    """float32 [T, H]: sum over each token's chosen experts of weight * w2 @ glu(w13 @ x).

    Experts not in ``experts`` (remote under expert parallelism) contribute nothing: another rank
    computes them.
    """
    xf = x.float()
    out = torch.zeros(x.shape[0], experts_hidden(experts, x), dtype=torch.float32, device=x.device)
    for e, ex in experts.items():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xf[tok] @ dequant(ex.w13_words, ex.w13_scales, minus_eight).T
        y = glu(h, act) @ dequant(ex.w2_words, ex.w2_scales, minus_eight).T
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out


def local_ids(expert_map: torch.Tensor | None, global_num: int) -> list[int]:
    """Global ids of this rank's experts (vLLM's expert_map: global -> local index, -1 remote)."""
    if expert_map is None:
        return list(range(global_num))
    return [int(e) for e in (expert_map >= 0).nonzero().flatten()]


def expert_copy(w13_words: torch.Tensor, w13_scales: torch.Tensor, w2_words: torch.Tensor,
                w2_scales: torch.Tensor, real: int) -> Expert:
    """One expert's int4 as loaded (CT order, before the in-place layout), its ``real`` channels only."""
    inter = w13_words.shape[0] // 2
    rows = torch.cat((torch.arange(real), inter + torch.arange(real))).to(w13_words.device)
    return Expert(w13_words.index_select(0, rows), w13_scales.index_select(0, rows),
                  w2_words[:, : real // 8].clone(), w2_scales[:, : real // layout.GROUP].clone())


def experts_hidden(experts: Mapping[int, Expert], x: torch.Tensor) -> int:
    ex = next(iter(experts.values()), None)
    return x.shape[1] if ex is None else ex.w2_words.shape[0]


@dataclass(frozen=True)
class Probe:
    """Tokens and routing that reach local experts (and remote ones under expert parallelism)."""

    x: torch.Tensor             # bf16 [T, H]
    topk_weights: torch.Tensor  # float32 [T, k]
    topk_ids: torch.Tensor      # int32 [T, k], global expert ids
    local: tuple[int, ...]      # the global ids whose int4 the reference holds
    remote: tuple[int, ...]
    rows: torch.Tensor | None = None      # int64 [T]: the distinct token row t repeats (None: all distinct)
    distinct: torch.Tensor | None = None  # int64 [D]: a row holding each distinct token


def probe_reference(probe: Probe, experts: Mapping[int, Expert], act: Activation,
                    minus_eight: float = -8.0) -> torch.Tensor:
    """The float32 reference for every row of ``probe``, computed once per distinct token: a prefill
    probe's kernel call sees thousands of rows, its reference costs a few hundred."""
    if probe.rows is None:
        return reference(probe.x, probe.topk_weights, probe.topk_ids, experts, act, minus_eight)
    d = probe.distinct
    base = reference(probe.x[d], probe.topk_weights[d], probe.topk_ids[d], experts, act, minus_eight)
    return base[probe.rows]


def choose_experts(local_ids: list[int], global_num: int, top_k: int) -> tuple[list[int], list[int]]:
    """Local experts to hold in the reference and remote ones to route to, top_k distinct at most."""
    local_set = set(local_ids)
    remote_all = [e for e in range(global_num) if e not in local_set]
    n_local = min(len(local_ids), top_k if not remote_all else max(1, min(MAX_LOCAL, top_k // 2)))
    last = len(local_ids) - 1      # first and last included: the rank's last weight bytes are probed too
    spread = [local_ids[(i * last) // max(1, n_local - 1)] for i in range(n_local)]
    n_remote = min(top_k - n_local, len(remote_all))
    remote = [remote_all[(i * len(remote_all)) // n_remote] for i in range(n_remote)] if n_remote else []
    return spread, remote


def make_probe(experts: Mapping[int, Expert], remote: list[int], act: Activation,
               seed: int = 0, tokens: int = DECODE_TOKENS) -> Probe:
    """Token t's gate projection has RMS TOKEN_RMS[t % 8]; token t routes to every chosen expert,
    rotated by t. Above DISTINCT tokens, DISTINCT distinct tokens fill the rows in random order (each at
    least once): the kernel still runs the variant of the full token count and every row is compared,
    while a row that took another row's data still differs from its own reference (255 in 256)."""
    if tokens > DISTINCT:
        base = make_probe(experts, remote, act, seed, DISTINCT)
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        order = torch.randperm(tokens, generator=gen)
        rows = torch.randint(0, DISTINCT, (tokens,), generator=gen)
        rows[order[:DISTINCT]] = torch.arange(DISTINCT)
        device = base.x.device
        rows, distinct = rows.to(device), order[:DISTINCT].to(device)
        return Probe(base.x[rows], base.topk_weights[rows], base.topk_ids[rows], base.local, base.remote,
                     rows, distinct)
    device = next(iter(experts.values())).w13_words.device
    hidden = next(iter(experts.values())).w13_words.shape[1] * 8
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(experts) + list(remote)
    order = torch.tensor(ids, dtype=torch.int32)
    shift = (torch.arange(tokens)[:, None] + torch.arange(len(ids))[None, :]) % len(ids)
    topk_ids = order[shift].to(device)
    topk_weights = (0.5 + torch.rand(tokens, len(ids), generator=gen)).to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device)
    gate = torch.cat([x @ dequant(ex.w13_words, ex.w13_scales).T[:, : ex.w13_words.shape[0] // 2]
                      for ex in experts.values()], dim=1)
    rms = gate.pow(2).mean(dim=1).sqrt().clamp_min(1e-30)
    target = torch.tensor(TOKEN_RMS, device=device).repeat((tokens + len(TOKEN_RMS) - 1) // len(TOKEN_RMS))
    x = (x * (target[:tokens] / rms)[:, None]).to(torch.bfloat16)
    return Probe(x, topk_weights, topk_ids, tuple(experts), tuple(remote))


def rel_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per token ||got - want|| / ||want|| (inf where got is not finite)."""
    g = got.float()
    err = (g - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
    return torch.where(torch.isfinite(g).all(dim=1), err, torch.full_like(err, float("inf")))


def count_minus_eight(experts: Mapping[int, Expert]) -> int:
    """How many int4 codes of the sampled experts are -8 (nibble 0)."""
    n = 0
    for ex in experts.values():
        for w in (ex.w13_words, ex.w2_words):
            n += int((layout.ct_words_to_codes(w) == -8).sum())
    return n


@dataclass(frozen=True)
class Variant:
    """One kernel variant the server reaches: aiter's M tile for ``tokens`` tokens."""

    tile: int
    tokens: int
    worst: float
    problem: str | None        # None: passed
    minus_eight: float | None = None   # the value the kernel gives code -8, where that explains the fault

    def line(self) -> str:
        return f"tile {self.tile} ({self.tokens} tokens): {'passed' if self.problem is None else 'FAILED'}, " \
               f"worst {self.worst:.3g}"


@dataclass(frozen=True)
class Outcome:
    variants: tuple[Variant, ...]
    minus_eight: int           # codes -8 in the sampled experts
    seconds: float
    bands: str = "aiter's tile thresholds as read from its source (TILE_BANDS)"

    @property
    def worst(self) -> float:
        return max(v.worst for v in self.variants)

    @property
    def problem(self) -> str | None:
        """None when every variant passed; else each failing variant's diagnosis."""
        by_problem: dict[str, list[Variant]] = {}
        for v in self.variants:
            if v.problem:
                by_problem.setdefault(v.problem, []).append(v)
        parts = [f"{'tiles' if len(vs) > 1 else 'tile'} {', '.join(str(v.tile) for v in vs)} "
                 f"({', '.join(str(v.tokens) for v in vs)} tokens): {why}" for why, vs in by_problem.items()]
        return "; ".join(parts) or None

    @property
    def minus_eight_misread(self) -> bool:
        """Every failing variant is explained by code -8 read as another value (so a repair that
        leaves no -8 makes it correct)."""
        bad = [v for v in self.variants if v.problem]
        return bool(bad) and all(v.minus_eight is not None for v in bad)

    def line(self) -> str:
        return (f"{'; '.join(v.line() for v in self.variants)} (limit {TOL}); {self.minus_eight} codes -8 "
                f"exercised, {self.seconds * 1e3:.0f} ms")


def _explanations(probe: Probe, got: torch.Tensor, experts: Mapping[int, Expert], act: Activation,
                  n_minus8: int) -> list[tuple[str, float | None]]:
    """(why, value -8 is read as or None) for every known fault whose reference the output matches."""
    candidates: list[tuple[str, Activation, float]] = [
        ("it computes SiLU, not K3's SiTU: the installed aiter's int4 stage 1 ignores the activation; install "
         "an aiter whose packed-int4 stage 1 applies it (ROCm/aiter 4bbc57db1a, #4646, or later)",
         Activation(act.beta, act.linear_beta, "silu"), -8.0),
    ]
    if act.linear_beta is not None:
        candidates.append(("it ignores SiTU's linear_beta (the up projection is not clipped); install an aiter "
                           "whose flydsl_a16w4_gemm1 applies situ_linear_beta",
                           Activation(act.beta, None), -8.0))
    if n_minus8:
        for value in (0.0, 8.0):
            candidates.append((f"it decodes int4 code -8 as {value:g}", act, value))
    found = []
    for why, alt, m8 in candidates:
        err = rel_errors(got, probe_reference(probe, experts, alt, m8))
        if float(err.max()) <= TOL:
            found.append((why, None if m8 == -8.0 else m8))
    return found


NO_KNOWN_FAULT = ("matches no known fault (a layout this plugin does not write, padded channels that are not "
                  "zero, or remote experts computed locally); please report it with this line")


def diagnose(probe: Probe, got: torch.Tensor, experts: Mapping[int, Expert], act: Activation,
             n_minus8: int) -> str:
    """Name the fault: the alternative reference the kernel's output matches, if any."""
    found = _explanations(probe, got, experts, act, n_minus8)
    return "; ".join(why for why, _ in found) if found else NO_KNOWN_FAULT


def variant_experts(experts: Mapping[int, Expert], remote: list[int], tile: int
                    ) -> tuple[dict[int, Expert], list[int]]:
    """The experts a band is probed with: all sampled ones at decode size, else one local and one
    remote expert (the kernel variant, not the expert count, is what a bigger token count tests;
    few experts, and DISTINCT distinct tokens, keep the float32 reference to a few GFLOP)."""
    if tile == TILE_BANDS[0][0]:
        return dict(experts), list(remote)
    first = next(iter(experts))
    return {first: experts[first]}, list(remote[:1])


def run(apply: Callable[[Probe], torch.Tensor], experts: Mapping[int, Expert], remote: list[int],
        act: Activation, bands: tuple[tuple[int, int], ...] = TILE_BANDS) -> Outcome:
    """Run ``apply`` (the layer's own kernel call) on a probe per kernel variant (``bands``: aiter's tile
    and the smallest token count reaching it) and compare each with the reference."""
    start = time.perf_counter()
    n8 = count_minus_eight(experts)
    out = []
    for tile, first_tokens in bands:
        exps, rem = variant_experts(experts, remote, tile)
        probe = make_probe(exps, rem, act, tokens=probe_tokens(first_tokens))
        want = probe_reference(probe, exps, act)
        got = apply(probe)
        if got.device.type == "cuda":
            torch.cuda.synchronize(got.device)
        worst = float(rel_errors(got, want).max())
        problem, m8 = None, None
        if not worst <= TOL:
            found = _explanations(probe, got, exps, act, count_minus_eight(exps))
            problem = "; ".join(why for why, _ in found) if found else NO_KNOWN_FAULT
            values = [v for _, v in found if v is not None]
            m8 = values[0] if values else None
        out.append(Variant(tile, probe.x.shape[0], worst, problem, m8))
    return Outcome(tuple(out), n8, time.perf_counter() - start)
