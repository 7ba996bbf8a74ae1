"""``mxfp4-to-int4`` (a local or Hub SRC) and ``finalize``."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import click

from ..errors import ConvertError
from ..profiles import MAX_EXPERTS
from ..quant.rules import DEFAULT as DEFAULT_RULE, RULES as SCALE_RULES
from ..state.files import REPORT
from ..state.manifest import Status
from ..terminal.progress import Progress, human_sizes, interactive, rate_line, say
from . import jobfile
from .params import WORKERS_ENV, ProfileName, Source, Whole, WorkerCount, fail

FP4_ALIAS = "fp4-to-int4"   # the same command, named for both FP4 formats it converts (docs/decisions.md)


@click.command("mxfp4-to-int4")
@click.argument("src", type=Source(file_okay=False))
@jobfile.option
@click.option("-o", "--output", "dst", type=click.Path(), help="Output directory [default: SRC-int4 beside SRC].")
@click.option("--max-rel-rmse", type=float, default=0.15, show_default=True,
              help="Fail (exit 3) if any tensor's relative RMSE vs the FP4 weights exceeds this.")
@click.option("--devices", default=None, help="Comma list like cuda:0,cuda:1 or cpu [default: every GPU, else CPU].")
@click.option("--workers", type=WorkerCount(), default=lambda: os.environ.get(WORKERS_ENV, "auto"),
              show_default="auto",
              help="CPU worker processes (no GPU): a number, or auto: one per 2 cores, as many as fit in "
                   "half the free memory and no more than there are shards (--dry-run shows the choice); "
                   f"{WORKERS_ENV} sets a site's default (the command line and a job file win over it).")
@click.option("--workers-per-gpu", type=Whole(min=1), default=2, show_default=True,
              help="Worker processes per GPU: each converts one shard at a time, so two keep a GPU's "
                   "storage busy while one of them computes.")
@click.option("--sample-experts", type=Whole(min=0, max=MAX_EXPERTS), default=4, show_default=True,
              help="Experts per layer whose output error ||(Wq-W)x||/||Wx|| is measured.")
@click.option("--overwrite", is_flag=True, help="Replace a DST that holds a different conversion.")
@click.option("--shards", "shard_spec", default=None, help="Only these shards, 1-based in name order: 3,5-9.")
@click.option("--part", default=None, help="Only part i of n (round robin over shards): for job arrays, e.g. 2/8.")
@click.option("--profile", type=ProfileName(), default=None,
              help="Model profile: a name from configs/profiles or a .toml file [default: chosen from config.json].")
@click.option("--drop-activation-quant", is_flag=True,
              help="Convert a source that also quantizes activations (or KV cache) to weight-only int4; "
                   "what is dropped is recorded in the manifest and report.")
@click.option("--scale-rule", type=click.Choice([str(r) for r in SCALE_RULES]), default=str(DEFAULT_RULE),
              show_default=True,
              help="optimal: the exact least-squares int4 per group, right for MI300X/MI325X too (an aiter that "
                   "misreads code -8 is found by the plugin's load-time self-test, which re-optimizes those groups "
                   "over [-7, 7]); optimal-pm7: the same over codes [-7, 7] (no -8: nothing to redo at load); "
                   "vllm-gfx942: bit-identical to what vLLM (0.33, 0.34) computes at load time on gfx942 "
                   "(aiter per_1x32_i4_quant; docs/convert.md: Which scale rule).")
@click.option("--fp8-bf16-at-tp", "fp8_bf16_tp", type=Whole(min=1), default=None,
              help="An FP8 source (MiMo-V2, Ling-3): write as bf16 the FP8 linears (with their fused siblings) that "
                   "vLLM's compressed-tensors FP8 scheme refuses at this TP size, so the output loads there; their "
                   "added error is stated in the manifest (docs/mimo.md) [default: every FP8 linear kept as is].")
@click.option("--dry-run", is_flag=True, help="Check everything, print the plan, convert nothing.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), default="bar", show_default=True,
              help="json: one JSON line per event on stderr, for schedulers and log collectors.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="A Hub SRC: where shards are downloaded (huggingface_hub's cache layout) [default: HF_HUB_CACHE].")
@click.option("--ahead", type=Whole(min=1), default=2, show_default=True,
              help="A Hub SRC: source shards on disk at once (one converting while the next downloads).")
@click.option("--keep-source", is_flag=True,
              help="A Hub SRC: keep the downloaded shards in the cache [default: each is removed once converted].")
def mxfp4_to_int4(src, dst, max_rel_rmse, devices, workers, workers_per_gpu, sample_experts, overwrite, shard_spec,
                  part, profile, drop_activation_quant, scale_rule, dry_run, progress, cache_dir=None, ahead=2,
                  keep_source=False, fp8_bf16_tp=None) -> None:
    """Convert the MXFP4 or NVFP4 checkpoint SRC into an int4 checkpoint a server loads directly.

    Also called fp4-to-int4 (the same command). NVFP4 sources: docs/nvfp4.md.

    Exit codes: 0 done, 2 bad input, 3 error threshold exceeded, 4 output/IO problem
    (DST not usable, locked, disk full), 130 interrupted (run again to resume), 1 other.
    """
    from ..run.pipeline import Options, convert, default_dst, describe

    opts = Options(max_rel_rmse=max_rel_rmse, sample_experts=sample_experts, workers=workers,
                   workers_per_gpu=workers_per_gpu,
                   devices=devices.split(",") if devices else None, overwrite=overwrite, shard_spec=shard_spec,
                   part=part, profile=profile, drop_activation_quant=drop_activation_quant, scale_rule=scale_rule,
                   fp8_bf16_tp=fp8_bf16_tp)
    bar = Progress(progress)
    from ..hub.source import HubSource
    if isinstance(src, HubSource):
        return _from_hub(src, dst, opts, bar, progress, dry_run, cache_dir, ahead, keep_source)
    with _reported(bar):
        if dry_run:
            if progress == "bar" and interactive():
                say(f"reading the shard headers of {src}…")
            plan = opts.plan(src)
            with _plan_shown(progress):
                _show_plan(describe(plan, dst or default_dst(plan.src), opts), progress)
            return
        bar.start()
        summary = convert(src, dst, opts, bar)
    _finished(summary, progress)


@contextlib.contextmanager
def _reported(bar):
    """A conversion's errors and Ctrl-C as the CLI reports them (one line, the exit code), the bar
    closed first whatever happens."""
    try:
        yield
    except ConvertError as e:
        bar.close()
        fail(e)
    except KeyboardInterrupt:
        bar.close()
        click.echo("k3convert: interrupted; run the same command again to resume", err=True)
        sys.exit(130)
    bar.close()


@contextlib.contextmanager
def _plan_shown(progress: str):
    """A dry run refused for want of room still shows its plan (what it exists for), then the refusal."""
    from ..run.space import NoRoom
    try:
        yield
    except NoRoom as e:
        if e.plan is not None:
            _show_plan(e.plan, progress)
        raise


def _show_plan(info: dict, progress: str) -> None:
    """--dry-run's answer: JSON with --progress json, else one aligned line per item."""
    click.echo(json.dumps(info, indent=2) if progress == "json" else "\n".join(
        f"{k:>28}: {v}" for k, v in human_sizes(info).items()))


def _from_hub(src, dst, opts, bar, progress, dry_run, cache_dir, ahead, keep_source) -> None:
    """mxfp4-to-int4 of a Hub repo id: look (--dry-run) or convert while downloading (converter.hub.convert)."""
    from ..hub import convert as hub_convert
    with _reported(bar):
        if dry_run:
            with _plan_shown(progress):
                _show_plan(hub_convert.describe(src, dst, opts, cache_dir or hub_convert.default_cache(), ahead),
                           progress)
            return
        bar.start()
        res = hub_convert.convert(src, dst, opts, bar, cache_dir, ahead, keep_source)
    fates = "; ".join(f"{len(names)} {fate.value}" for fate, names in res.fates.items())
    say(f"{res.fetched} shard file(s) of {src.repo}@{res.commit} ({res.fetched - res.found} downloaded, "
        f"{res.found} already in the cache); peak staging "
        f"{res.peak_staging_bytes / 1e9:.3f} GB" + (f"; in the cache: {fates}" if fates else ""))
    _finished(res.summary, progress)


def _finished(summary, progress: str) -> None:
    """The closing lines of a conversion (or its JSON event)."""
    from ..run.validate import format_table, ratio_line

    if progress == "json":
        click.echo(json.dumps({"event": "finished", "time": round(time.time(), 3), "dst": summary.dst,
                               "complete": summary.complete, "seconds": round(summary.seconds, 3),
                               "bytes_in": summary.bytes_in,
                               "worst": summary.worst}), err=True)
        return
    click.echo(format_table(summary.layers, rule=summary.scale_rule))
    if line := ratio_line(summary.cmp_ratio, summary.scale_rule):
        click.echo(line)
    state = "complete" if summary.complete else \
        f"{summary.shards_done}/{summary.shards_total} shards done (the run that converts the last one completes DST)"
    bf16 = f" (+{summary.bf16} non-expert MXFP4 module(s) as exact bf16)" if summary.bf16 else ""
    click.echo(f"{state}: {summary.tensors} tensors{bf16}; "
               f"{rate_line(summary.bytes_in, summary.seconds)} -> {summary.dst}")
    if summary.status != Status.PARTIAL:
        click.echo(f"report: {os.path.join(summary.dst, REPORT)}")


@click.command()
@click.argument("dst", type=click.Path(exists=True, file_okay=False))
def finalize(dst) -> None:
    """Write index, config, report and manifest once every shard of DST is converted (job arrays)."""
    from ..run.pipeline import finalize as finalize_dst

    try:
        summary = finalize_dst(dst)
    except ConvertError as e:
        fail(e)
    click.echo(f"{summary.status}: {summary.shards_done}/{summary.shards_total} shards -> {dst}")
    if not summary.complete:
        sys.exit(4 if summary.status == Status.PARTIAL else 3)
