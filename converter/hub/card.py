"""The model card (README.md) ``upload`` writes for DST: what a server must know (int4 g32 symmetric,
the expert activation as the config states it), where the model came from (a Hub source by its repo
and commit), how it was converted from which format, its error, and the serving lines the serving
check proves (``servers.launches``). Built from DST's manifest, report, config and shard headers."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..errors import ConvertError
from ..formats import checkpoint as ckpt, json_input, nvfp4
from ..quant.rules import DEFAULT as DEFAULT_RULE, ScaleRule
from ..run.plan import README_SOURCE
from ..safepath import read_regular
from ..servers import headers, launches
from ..state.files import MANIFEST
from ..state.records import read_json
from ..verify import REPORT
from .source import repo_id_ok

CARD_LINES = 24  # lines of the model card `upload --dry-run` shows


@dataclass(frozen=True)
class Origin:
    """Where DST was converted from, as its manifest records it: a Hub repository at a commit (every
    source shard's identity names it), else a local folder."""

    path: str                      # the folder the run read (a Hub source: the view under the cache)
    hub: str | None = None         # ORG/NAME
    commit: str | None = None

    @classmethod
    def of(cls, manifest: dict) -> "Origin":
        source = manifest.get("source") or {}
        path = p if isinstance(p := source.get("path"), str) else ""
        idents = [v for v in (source.get("shards") or {}).values() if isinstance(v, dict)]
        found = {(v.get("hub"), v.get("commit")) for v in idents}
        if len(found) == 1:
            hub, commit = next(iter(found))
            if isinstance(hub, str) and repo_id_ok(hub) and isinstance(commit, str):
                return cls(path, hub, commit)
        return cls(path)

    @property
    def argument(self) -> str:
        """SRC as the command line took it: ``ORG/NAME@COMMIT`` (pinned), or the folder's name."""
        if self.hub:
            return f"{self.hub}@{self.commit}"
        return os.path.basename(self.path.rstrip("/")) or "SRC"


@dataclass(frozen=True)
class SourceKind:
    """What the card says of the source's format: MXFP4 (exact groups) or NVFP4 (nearest, not exact)."""

    name: str          # "MXFP4" / "NVFP4"
    converted: str     # which linears became int4
    method: str        # how each group's scale and codes were chosen

    @classmethod
    def of(cls, manifest: dict) -> "SourceKind":
        quant = (manifest.get("source") or {}).get("quantization") or {}
        rule = manifest.get("scale_rule") if manifest.get("scale_rule") in ScaleRule.__members__.values() else None
        if quant.get("dialect") == nvfp4.DIALECT:
            return cls("NVFP4", "every NVFP4 linear the source's config selects (routed experts and any other)",
                       "Each group of 32 weights (two NVFP4 blocks of 16, each with its own FP8 E4M3 scale, times the "
                       "tensor's FP32 scale) is mapped to the int4 codes in [-8, 7] and the bf16 scale with the least "
                       "squared error over every positive bf16 scale. Not exact: such a group is generally not 16 "
                       "codes times one scale, so the int4 values approximate the NVFP4 ones.")
        if ScaleRule(rule or DEFAULT_RULE).optimum:
            method = ("Each MXFP4 block of 32 weights is mapped to the int4 group with the least squared error over "
                      "every bf16 scale (an exact search, not round-to-nearest with amax/7.5)"
                      + (", codes in [-7, 7]." if rule == ScaleRule.OPTIMAL_PM7 else "."))
        else:
            method = (f"Each MXFP4 block of 32 weights is mapped by the `{rule}` rule (the server's own load-time "
                      "int4 rule: round-to-nearest with amax/7, codes in [-7, 7]), not the least-squares optimum.")
        return cls("MXFP4", "the routed-expert weights", method)


def base_model(dst: str, manifest: dict, override: str | None = None) -> str:
    """The model DST was converted from: ``override``; a Hub source's repository; the source's
    ``_name_or_path`` (its config, else DST's copy of it); else the source folder's name."""
    if override:
        return override
    origin = Origin.of(manifest)
    if origin.hub:
        return origin.hub
    configs = ([os.path.join(origin.path, "config.json")] if origin.path else []) + [os.path.join(dst, "config.json")]
    for cfg in configs:
        try:
            name = (read_json(cfg) or {}).get("_name_or_path")
        except ConvertError:
            name = None
        if name:
            return str(name)
    return os.path.basename(origin.path.rstrip("/")) or "unknown"


def command(manifest: dict, report: dict, dst: str) -> str:
    """The command that made DST, as the manifest records it."""
    opts = manifest.get("options") or {}
    cmd = f"k3convert mxfp4-to-int4 {Origin.of(manifest).argument} -o {os.path.basename(dst.rstrip('/'))}"
    rule = manifest.get("scale_rule")
    if isinstance(rule, str) and rule != DEFAULT_RULE:
        cmd += f" --scale-rule {rule}"
    if report.get("max_rel_rmse") is not None:
        cmd += f" --max-rel-rmse {report['max_rel_rmse']}"
    if opts.get("sample_experts") is not None:
        cmd += f" --sample-experts {opts['sample_experts']}"
    return cmd


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def error_table(report: dict, limit: int = 10) -> str:
    """The worst ``limit`` layers by worst relative RMSE, as a markdown table, plus the totals."""
    layers = sorted(report.get("layers") or [], key=lambda r: -r["rel_rmse_worst"])
    rows = ["| layer | tensors | rel. RMSE mean | rel. RMSE worst | SNR dB (min) | output rel. err (worst) |",
            "|---:|---:|---:|---:|---:|---:|"]
    for r in layers[:limit]:
        rows.append(f"| {'-' if r['layer'] is None else r['layer']} | {r['tensors']} | {_fmt(r['rel_rmse_mean'])} "
                    f"| {_fmt(r['rel_rmse_worst'])} | {_fmt(r['snr_db_worst'], '.2f')} "
                    f"| {_fmt(r.get('out_rel_worst'))} |")
    worst = report.get("worst") or {}
    snr = min((r["snr_db_worst"] for r in layers), default=None)
    head = (f"Overall: {report.get('tensors')} converted tensors, relative RMSE mean "
            f"**{_fmt(report.get('rel_rmse_mean'))}**, worst **{_fmt(worst.get('rel_rmse'))}** "
            f"(`{worst.get('tensor')}`), lowest SNR {_fmt(snr, '.2f')} dB. "
            f"{'The' if len(layers) <= limit else f'The {limit} worst of {len(layers)}'} layers:")
    return head + "\n\n" + "\n".join(rows)


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def model_card(dst: str, base: str | None = None, repo_id: str | None = None) -> str:
    """README.md for DST, from its manifest, report and config."""
    manifest = read_json(os.path.join(dst, MANIFEST)) or {}
    report = read_json(os.path.join(dst, REPORT)) or {}
    config = read_json(os.path.join(dst, "config.json")) or {}
    name = base_model(dst, manifest, base)
    kind = SourceKind.of(manifest)
    act = manifest.get("activation") or {}
    where = ", ".join(f"`{'.'.join(p)}`" for p, _ in ckpt.quant_blocks(config)) or "-"
    size = sum(int(r.get("bytes", 0)) for r in (manifest.get("shards") or {}).values())
    repo = repo_id or "<repo>"
    front = ["---"]
    if repo_id_ok(name):
        front += [f"base_model: {name}", "base_model_relation: quantized"]
    front += ["tags:", "- compressed-tensors", "- int4", "- w4a16", "- k3convert", "---", ""]
    activation, serving_act = activation_section(act)
    serving = launches.section(*headers.load(dst), repo, custom_tokenizer=_custom_tokenizer(dst))
    source_card = (f"\nThe source model's own card is kept beside this one as `{README_SOURCE}`.\n"
                   if os.path.exists(os.path.join(dst, README_SOURCE)) else "")
    origin = Origin.of(manifest)
    from_hub = ("" if not origin.hub else f" at commit `{origin.commit}`" if name == origin.hub
                else f" (converted from the Hub repository `{origin.hub}` at commit `{origin.commit}`)")
    bf16 = [m for m in (manifest.get("source") or {}).get("dequantized") or [] if isinstance(m, str)]
    others = (f"The source's {len(bf16)} other MXFP4 linear(s) (e.g. `{bf16[0]}`) are plain bf16 weights "
              "holding exactly their MXFP4 values; everything else" if bf16 else "Everything else")
    which = ("Routed experts (`...experts.{E}.{w1,w2,w3}`)" if kind.name == "MXFP4"
             else "Every NVFP4 linear of the source (routed experts and any other its config selects)")
    body = f"""# {name.split('/')[-1]} — int4 (group 32){' routed experts' if kind.name == 'MXFP4' else ''}

An int4 version of **{name}**{from_hub}: {kind.converted}, published as {kind.name}, requantized to
int4 with one bf16 scale per 32 weights, in the compressed-tensors `pack-quantized` format. Which
servers run it, and with which command, is under *Serving*: each line there was checked against
this checkpoint. {others} is byte-identical to the source.
{source_card}
## Quantization

- {which}: int4, **group size 32, symmetric**, one **bf16 scale**
  per group (dequantized value = q × scale, q in [-8, 7]); no activation quantization (W4A16).
- Tensors per converted matrix: `weight_packed` int32 `[out, in/8]` (eight q+8 nibbles per word, least
  significant first), `weight_scale` bf16 `[out, in/32]`, `weight_shape` int64 `[out, in]`.
- `quantization_config`: `quant_method: compressed-tensors`, `format: pack-quantized`, stated at {where}
  (every block that described {kind.name} was replaced, top-level and nested; the `ignore` list is kept).
- {'Attention, shared experts, router, embeddings, norms, vision tower' if kind.name == 'MXFP4' else
   f'Everything the source did not store as {kind.name}'}: unchanged from the source{
    ' (MXFP4 ones decoded to bf16, exactly)' if bf16 else ''}.{_fp8_bf16_line(manifest)}
- Size: {_size(size)} in {len(manifest.get('shards') or {})} shard(s).

{activation}
These are stated in `config.json`, in every shard's safetensors metadata, and in `{MANIFEST}`.

## How it was converted

- Tool: k3convert {manifest.get('version', __version__)} (`{manifest.get('source_format')}` →
  `{manifest.get('target_format')}`), finished {manifest.get('finished_at', '-')}.
- Command (reconstructed from the manifest): `{command(manifest, report, dst)}`
- {kind.method}
- `{MANIFEST}` holds a digest of every shard (SHA-256 over its 64 MiB chunks); `k3convert verify`
  re-checks them and the structure.

## Error against the {kind.name} weights

Relative RMSE = ‖W_int4 − W_src‖ / ‖W_src‖ per tensor (W_src: the {kind.name} values); output error = the same
on y = W x for a fixed random x (sampled experts). Per-tensor figures: `{report.get('tensor_table',
'k3convert_tensors.jsonl.zst')}`.

{error_table(report)}

{serving}
### Any other server

- It must support this model's architecture (`{config.get('model_type')}`,
  {', '.join(config.get('architectures') or []) or '-'}){serving_act}.
- It must read the quantization config where it sits ({where}) and support
  compressed-tensors **W4A16 MoE with group size 32, symmetric**, and hold {_size(size)} of weights plus
  the KV cache across its GPUs.
"""
    return "\n".join(front) + body


def _fp8_bf16_line(manifest: dict) -> str:
    """A card bullet for the FP8 linears written as bf16 (formats/fp8_mxfp4.py ``fp8_to_bf16``), or ''."""
    rec = (((manifest.get("source") or {}).get("quantization") or {}).get("fp8_to_bf16") or {})
    mods = [m for m in rec.get("modules") or [] if isinstance(m, str)]
    if not mods:
        return ""
    why = "; ".join(w for w in rec.get("why") or [] if isinstance(w, str))
    return (f"\n- Except {len(mods)} FP8 linear(s) (e.g. `{mods[0]}`) written as bf16 ({why}): "
            f"{rec.get('values', '')}.")


def _custom_tokenizer(dst: str) -> bool:
    """Whether DST's tokenizer_config.json maps a class to the repository's code (``auto_map``), which
    vLLM then loads only with --trust-remote-code. Untrusted: anything unreadable counts as no."""
    data = read_or_none(os.path.join(dst, "tokenizer_config.json"))
    try:
        cfg = json_input.loads(data.decode(), constants=True) if data else None
    except (ValueError, UnicodeDecodeError):
        cfg = None
    return isinstance(cfg, dict) and "auto_map" in cfg


def activation_section(act: dict) -> tuple[str, str]:
    """The card's activation section and its serving caveat, as the config states the activation
    (the manifest's ``activation``): SiTU with its betas, or whatever else it names."""
    name = act.get("hidden_act")
    fields = ", ".join(f"`{k}: {v}`" for k, v in act.items())
    if name == "situ":
        return (f"""## Expert activation: SiTU, not SiLU

The experts use SiTU: `a = beta * tanh(g / beta) * sigmoid(g)`, `u = linear_beta * tanh(u / linear_beta)`,
`out = a * u` (g = w1 x, u = w3 x), with {fields}.
A kernel that assumes SiLU loads this checkpoint without complaint and produces garbage.""",
                " **including the SiTU expert activation** with the parameters above; check that its logs do "
                "not fall back to SiLU")
    return (f"""## Expert activation: {name}

The experts use the activation the source's config names, unchanged by the conversion: {fields or '-'}.""",
            f" with its `{name}` expert activation")


def read_or_none(path: str) -> bytes | None:
    """A regular file's bytes; None if it is missing, unreadable or anything else (a FIFO is
    never waited on: the path may come from DST's manifest, which is untrusted)."""
    try:
        return read_regular(path)
    except (ConvertError, OSError):
        return None


CARD_LINES = 24  # lines of the model card `upload --dry-run` shows


def card_preview(card: str, lines: int = CARD_LINES) -> str:
    """The first ``lines`` of the model card, indented, and how many more there are."""
    text = card.splitlines()
    more = f"\n    ... ({len(text) - lines} more lines)" if len(text) > lines else ""
    return f" (the model card, {len(text)} lines):\n" + "\n".join(f"    {t}".rstrip() for t in text[:lines]) + more
