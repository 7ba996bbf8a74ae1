"""The model card's serving section: the launches `verify --serving` proves for DST, and those it refuses.

Nothing here decides what a server does: each launch of a small fixed set (``LAUNCHES``) is put to
the serving check's rules (``servers.check``: the results `verify --serving` reports) on DST's config
and shard headers, under every proven release of its server (``releases``). A launch that
passes is written as the command to run; one that fails as one line, the check's own first problem.
The versions named come from the release data (version, the aiter its ROCm image pins), never from
strings here.

The set is the layouts README and docs/deploy.md teach, on nodes of 8 GPUs: the k3convert plugin at
TP 8 + EP (one node) and DP 2 x TP 8 + EP (two nodes), only for the checkpoints the plugin is for
(``vllm_plugin.route.is_k3_int4``); stock vLLM on ROCm and on CUDA at TP 8 and TP 8 + EP; SGLang at TP 8
(its DP/EP split is not modelled). Each line is re-checked by ``k3convert verify DST --no-checksums
--serving SERVER`` with the line's own parallelism flags (vLLM's spellings are accepted there).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from ..formats import checkpoint as ckpt
from ..formats.safetensors_io import TensorInfo
from ..releases import SGLANG, VLLM, Family, Release, all_kimi_model_types
from ..vllm_plugin import route as plugin_route
from .check import context, evaluate_at, rank_fit
from .context import Context
from .memory import GIB, Fit
from .rules import TARGETS, ServingRequest
from .topology import Topology

PLUGIN = "vllm-rocm-plugin"
PLUGIN_ENV = "VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1"   # without both the plugin refuses (route.decide)
PLUGIN_INSTALL = "pip install --no-deps /path/to/k3convert"   # k3convert is not on PyPI: a checkout or its wheel
TWO_NODES = ("--data-parallel-size-local 1 --data-parallel-address HEAD --data-parallel-rpc-port 13345 on both "
             "nodes (HEAD: the first node's address), --data-parallel-start-rank 1 --headless on the second")


@dataclass(frozen=True)
class Launch:
    """One launch the card may recommend: a server (``rules.TARGETS``) at a topology, and where it runs."""

    server: str
    topology: Topology
    where: str            # "one node of 8 GPUs"

    def flags(self) -> str:
        """The server's own parallelism flags, as `verify --serving` also takes them."""
        if TARGETS[self.server].family is Family.SGLANG:
            return f"--tp {self.topology.tp}"
        return self.topology.flags()

    def command(self, repo: str) -> str:
        if TARGETS[self.server].family is Family.SGLANG:
            return f"python -m sglang.launch_server --model-path {repo} {self.flags()}"
        return f"vllm serve {repo} {self.flags()}"


ONE_NODE, TWO_NODE = "one node of 8 GPUs", "two nodes of 8 GPUs"
LAUNCHES: tuple[Launch, ...] = (
    Launch(PLUGIN, Topology(8, ep=True), ONE_NODE),
    Launch(PLUGIN, Topology(8, dp=2, ep=True), TWO_NODE),
    Launch("vllm-rocm", Topology(8), ONE_NODE),
    Launch("vllm-rocm", Topology(8, ep=True), ONE_NODE),
    Launch("vllm-cuda", Topology(8), ONE_NODE),
    Launch("vllm-cuda", Topology(8, ep=True), ONE_NODE),
    Launch("sglang-rocm", Topology(8), ONE_NODE),
    Launch("sglang-cuda", Topology(8), ONE_NODE),
)


@dataclass(frozen=True)
class Outcome:
    """What the serving check says of one launch under one release."""

    launch: Launch
    release: Release
    problem: str | None     # the check's first problem line (and how many more); None: every rule passes
    fit: Fit | None = None  # one rank's weights against the GPUs the check knows (ROCm: MI300X, MI325X)


def releases_of(server: str) -> tuple[Release, ...]:
    """The proven releases of a server's family, oldest first."""
    return VLLM if TARGETS[server].family is Family.VLLM else (SGLANG,)


def plugin_applies(config: dict | None) -> bool:
    """The plugin's own test: a compressed-tensors int4 Kimi K3 with SiTU experts (else it stays out)."""
    blocks = [b for _, b in ckpt.quant_blocks(config or {})]
    return plugin_route.is_k3_int4(blocks[0] if blocks else None, None, config or {})


def launches_for(config: dict | None) -> tuple[Launch, ...]:
    """LAUNCHES, without the plugin's where it stays out (stock vLLM serves alone there)."""
    keep = plugin_applies(config)
    return tuple(x for x in LAUNCHES if keep or x.server != PLUGIN)


def outcomes(config: dict | None, tensors: Mapping[str, TensorInfo]) -> list[Outcome]:
    """Every launch under every proven release of its server, as the serving check judges it: the
    problem lines are the check's (``verify --serving`` fails with the same ones). The headers are
    read into one context per server and release (seconds each on K3), then every launch is judged."""
    out = []
    contexts: dict[tuple[str, str], Context] = {}
    for launch in launches_for(config):
        for release in releases_of(launch.server):
            vllm = release.version if release.family is Family.VLLM else None
            key = (launch.server, release.version)
            if key not in contexts:
                request = ServingRequest.parse(launch.server, vllm=vllm)
                contexts[key] = context(config, tensors, request, weigh_rest=True)
            ctx = contexts[key]
            failed = [r.message for r in evaluate_at(ctx, launch.topology) if not r.ok]
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            out.append(Outcome(launch, release, failed[0] + more if failed else None,
                               None if failed else _fit(ctx, launch.topology)))
    return out


def _fit(ctx: Context, topo: Topology) -> Fit | None:
    """The check's own per-rank weights; where it knows no GPU (CUDA), against none, for the figure."""
    return rank_fit(ctx if ctx.gpus else dataclasses.replace(ctx, gpus={"no GPU": 0}), topo)


def _memory(f: Fit | None) -> str:
    """'195 GB of weights per rank (routed experts 191, the rest 3.75);
    fits MI325X 256 GiB (57.7 GB left for the KV cache); not MI300X 192 GiB
    (5.53 GB short) (gpu_memory_utilization 0.92: vLLM 0.33.0's default 0.92)'."""
    if f is None:
        return ""
    text = (f"{f.weights / 1e9:.3g} GB of weights per rank (routed experts {f.experts / 1e9:.3g}, the rest "
            f"{(f.rest + f.replicated) / 1e9:.3g})")
    known = {g: b for g, b in f.gpus.items() if b}
    if not known:
        return text
    fits = [f"{g} {b / GIB:g} GiB ({f.margin(g)})" for g, b in known.items() if f.left(g) >= 0]
    short = [f"{g} {b / GIB:g} GiB ({f.margin(g)})" for g, b in known.items() if f.left(g) < 0]
    return (text + (f"; fits {', '.join(fits)}" if fits else "") + (f"; not {', '.join(short)}" if short else "")
            + f" (gpu_memory_utilization {f.utilization:g}: {f.budget.basis})")


def release_text(release: Release, server: str) -> str:
    """'vLLM 0.34.0 (its ROCm image pins aiter v0.1.28.post1)' on ROCm; the release alone elsewhere."""
    pin = release.facts.aiter_pin if TARGETS[server].target.startswith("ROCm") else ""
    return release.name + (f" (its ROCm image pins aiter {pin})" if pin else "")


def _names(releases: list[Release]) -> str:
    return ", ".join(r.name for r in releases)


def section(config: dict | None, tensors: Mapping[str, TensorInfo], repo: str,
            custom_tokenizer: bool = False) -> str:
    """The card's serving section for DST (config and headers), ``repo`` its Hub id; ``custom_tokenizer``:
    its tokenizer_config.json maps a class to the repository's code (``auto_map``)."""
    found = outcomes(config, tensors)
    servers = list(dict.fromkeys(o.launch.server for o in found))
    proven = "; ".join(release_text(r, "vllm-rocm" if r.family is Family.VLLM else "sglang-rocm")
                       for r in (*VLLM, SGLANG))
    model_type = (config or {}).get("model_type")
    remote = ("vLLM builds this architecture from its own model registry (docs/deploy.md of k3convert cites it), "
              "so the model needs no `--trust-remote-code`." if model_type in all_kimi_model_types() else
              "The lines carry no `--trust-remote-code`; add it only where the server does not build "
              f"`{model_type}` from its own code.")
    if custom_tokenizer:
        remote += (" The tokenizer is this repository's own code (`auto_map` in `tokenizer_config.json`): add "
                   "`--trust-remote-code` to each line for it.")
    out = [
        "## Serving",
        "",
        "Each line below was put to k3convert's serving check (`k3convert verify DST --no-checksums --serving "
        "SERVER` with the line's own parallelism flags, and `--vllm-version` for vLLM): the rules of that "
        "server's int4 MoE path, read from each release's code, against this checkpoint's config and shard "
        f"headers. Releases checked: {proven}. The check reads code; it does not run a GPU. {remote}",
    ]
    if all(o.problem for o in found):
        out += ["", "No launch below passes: `k3convert verify DST --no-checksums --serving SERVER` names the TP "
                "sizes that pass for each server, `--verbose` where the server enforces each rule."]
    if not plugin_applies(config):
        out += ["", "k3convert's vLLM plugin is for Kimi K3 int4 experts with SiTU only: it stays out of this "
                "model, and stock vLLM serves it as the lines below say."]
    for server in servers:
        mine = [o for o in found if o.launch.server == server]
        out += ["", f"### `{server}`: {_title(server)}", ""]
        out += _server_block(server, mine, repo)
    return "\n".join(out) + "\n"


def _title(server: str) -> str:
    t = TARGETS[server]
    family = "vLLM" if t.family is Family.VLLM else "SGLang"
    return f"{family}{t.label}, {t.target}"


def _server_block(server: str, mine: list[Outcome], repo: str) -> list[str]:
    launches = list(dict.fromkeys(o.launch for o in mine))
    passing = {x: [o.release for o in mine if o.launch == x and o.problem is None] for x in launches}
    out: list[str] = []
    if any(passing.values()):
        code = ["```bash"]
        if server == PLUGIN:
            code += [f"{PLUGIN_INSTALL}    # a checkout or wheel of k3convert (not on PyPI): the plugin, into the "
                     "ROCm image's Python; its vLLM, torch, aiter stay",
                     f"export {PLUGIN_ENV}"]
        for x in launches:
            if passing[x]:
                code.append(f"# {x.topology.text()}, {x.where}: passes on {_names(passing[x])}")
                fits = [(o.release, _memory(o.fit)) for o in mine if o.launch == x and o.problem is None and o.fit]
                several = len({text for _, text in fits}) > 1    # the releases' utilizations differ
                shown: set[str] = set()
                for release, text in fits:
                    if text not in shown:
                        shown.add(text)
                        code.append(f"#   {release.name + ': ' if several else ''}{text}")
                if x.topology.dp > 1:
                    code.append(f"# two nodes: add {TWO_NODES}")
                code.append(x.command(repo))
        out += code + ["```", ""]
        proven = [r for r in releases_of(server) if any(r in rs for rs in passing.values())]
        out += ["Proven (by the check) on: " + "; ".join(release_text(r, server) for r in proven) + "."]
    refused: dict[tuple[Launch, str], list[Release]] = {}   # one line per launch and problem, its releases
    for o in mine:
        if o.problem is not None:
            refused.setdefault((o.launch, o.problem), []).append(o.release)
    if refused:
        out += [""] if any(passing.values()) else []
        out += ["Refused by the check (one line each, the check's own):", ""]
        out += [f"- `{x.flags()}` ({x.topology.text()}) on {_names(rels)}: {why}"
                for (x, why), rels in refused.items()]
    return out
