"""The ``k3convert`` command: a thin layer over converter.pipeline and friends."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import click

from . import __version__, jobfile
from .errors import BadInput, ConvertError
from .manifest import REPORT
from .profiles import MAX_EXPERTS
from .quant.rules import RULES as SCALE_RULES
from .progress import (ETA_AFTER_S, Progress as _Progress, eta, human_bytes, human_seconds,  # noqa: F401
                       human_sizes, interactive, rate_line, say)
from .serving import SERVERS
from .suggest import unknown_command


class _WorkerCount(click.ParamType):
    """``--workers``: a positive number, or ``auto`` (None: chosen from the machine)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        try:
            n = value if isinstance(value, int) and not isinstance(value, bool) else int(str(value))
        except ValueError:
            n = 0
        if n < 1:
            if ctx is not None and param is not None and \
                    ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"{WORKERS_ENV}={value!r} (the environment): not a positive number or auto")
            self.fail(f"{value!r} is not a positive number or auto", param, ctx)
        return n


class _ProfileName(click.types.StringParamType):
    """``--profile``: a bundled profile's name, or a profile file (``profiles.is_file``), which a job
    file names relative to itself (``jobfile.load``)."""

    name = "NAME|FILE.toml"

    @staticmethod
    def is_file(value: str) -> bool:
        from .profiles import is_file
        return is_file(value)


WORKERS_ENV = "K3CONVERT_WORKERS"


def _fail(e: ConvertError) -> None:
    click.echo(f"k3convert: error: {e}", err=True)
    sys.exit(e.exit_code)


class _Main(click.Group):
    """The command group, with click's usage errors (a bad option value from the command line, a job
    file or the environment) as our one line, ``k3convert: error: ...``, exit 2; an unknown command
    names the close ones. From the command line the process leaves at once when done
    (fastexit: no seconds of torch teardown, no process left behind)."""

    def resolve_command(self, ctx, args):
        name = click.utils.make_str(args[0]) if args else None
        if name is not None and self.get_command(ctx, name) is None and not name.startswith("-"):
            raise click.UsageError(unknown_command(name, self.list_commands(ctx)), ctx)
        return super().resolve_command(ctx, args)

    def __call__(self, *args, **kwargs):
        """``main()`` with the process's own arguments is the command line (the ``k3convert`` script,
        ``python -m converter``): it leaves at once. Given arguments (click's test runner, a
        script driving the CLI), it exits as click does."""
        try:
            return self.main(*args, **kwargs)
        except SystemExit as e:
            if (args[0] if args else kwargs.get("args")) is not None:
                raise
            from .fastexit import leave
            leave(e.code)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as e:
            click.echo(f"k3convert: error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3convert")
def main() -> None:
    """Convert Kimi K3's MXFP4 routed experts to int4 group 32, once, offline."""


@main.command("mxfp4-to-int4")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@jobfile.option
@click.option("-o", "--output", "dst", type=click.Path(), help="Output directory [default: SRC-int4 beside SRC].")
@click.option("--max-rel-rmse", type=float, default=0.15, show_default=True,
              help="Fail (exit 3) if any tensor's relative RMSE vs the MXFP4 weights exceeds this.")
@click.option("--devices", default=None, help="Comma list like cuda:0,cuda:1 or cpu [default: every GPU, else CPU].")
@click.option("--workers", type=_WorkerCount(), default=lambda: os.environ.get(WORKERS_ENV, "auto"),
              show_default="auto",
              help="CPU worker processes (no GPU): a number, or auto: one per 2 cores, as many as fit in "
                   "half the free memory and no more than there are shards (--dry-run shows the choice); "
                   f"{WORKERS_ENV} sets a site's default (the command line and a job file win over it).")
@click.option("--workers-per-gpu", type=click.IntRange(min=1), default=2, show_default=True,
              help="Worker processes per GPU: each converts one shard at a time, so two keep a GPU's "
                   "storage busy while one of them computes.")
@click.option("--sample-experts", type=click.IntRange(min=0, max=MAX_EXPERTS), default=4, show_default=True,
              help="Experts per layer whose output error ||(Wq-W)x||/||Wx|| is measured.")
@click.option("--overwrite", is_flag=True, help="Replace a DST that holds a different conversion.")
@click.option("--shards", "shard_spec", default=None, help="Only these shards, 1-based in name order: 3,5-9.")
@click.option("--part", default=None, help="Only part i of n (round robin over shards): for job arrays, e.g. 2/8.")
@click.option("--profile", type=_ProfileName(), default=None,
              help="Model profile: a name from configs/profiles or a .toml file [default: chosen from config.json].")
@click.option("--drop-activation-quant", is_flag=True,
              help="Convert a source that also quantizes activations (or KV cache) to weight-only int4; "
                   "what is dropped is recorded in the manifest and report.")
@click.option("--scale-rule", type=click.Choice(list(SCALE_RULES)), default="optimal", show_default=True,
              help="optimal: the exact least-squares int4 per group; optimal-pm7: the same over codes [-7, 7] "
                   "(no -8: for AITER on MI300X/MI325X until the plugin's self-test passes); vllm-gfx942: "
                   "bit-identical to what vLLM 0.33 computes at load time on gfx942 (aiter per_1x32_i4_quant; README: Which scale rule).")
@click.option("--dry-run", is_flag=True, help="Check everything, print the plan, convert nothing.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), default="bar", show_default=True,
              help="json: one JSON line per event on stderr, for schedulers and log collectors.")
def mxfp4_to_int4(src, dst, max_rel_rmse, devices, workers, workers_per_gpu, sample_experts, overwrite, shard_spec,
                  part, profile, drop_activation_quant, scale_rule, dry_run, progress) -> None:
    """Convert the MXFP4 checkpoint SRC into an int4 checkpoint a server loads directly.

    Exit codes: 0 done, 2 bad input, 3 error threshold exceeded, 4 output/IO problem
    (DST not usable, locked, disk full), 130 interrupted (run again to resume), 1 other.
    """
    from .pipeline import Options, convert, default_dst, describe
    from .validate import format_table, ratio_line

    opts = Options(max_rel_rmse=max_rel_rmse, sample_experts=sample_experts, workers=workers,
                   workers_per_gpu=workers_per_gpu,
                   devices=devices.split(",") if devices else None, overwrite=overwrite, shard_spec=shard_spec,
                   part=part, profile=profile, drop_activation_quant=drop_activation_quant, scale_rule=scale_rule)
    bar = _Progress(progress)
    try:
        if dry_run:
            if progress == "bar" and interactive():
                say(f"reading the shard headers of {src}…")
            plan = opts.plan(src)
            info = describe(plan, dst or default_dst(plan.src), opts)
            click.echo(json.dumps(info, indent=2) if progress == "json" else "\n".join(
                f"{k:>28}: {v}" for k, v in human_sizes(info).items()))
            return
        bar.start()
        summary = convert(src, dst, opts, bar)
    except ConvertError as e:
        bar.close()
        _fail(e)
    except KeyboardInterrupt:
        bar.close()
        click.echo("k3convert: interrupted; run the same command again to resume", err=True)
        sys.exit(130)
    bar.close()
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
    click.echo(f"{state}: {summary.tensors} tensors{bf16}; {rate_line(summary.bytes_in, summary.seconds)} -> {summary.dst}")
    if summary.status != "partial":
        click.echo(f"report: {os.path.join(summary.dst, REPORT)}")


@main.command()
@click.argument("dst", type=click.Path(exists=True, file_okay=False))
def finalize(dst) -> None:
    """Write index, config, report and manifest once every shard of DST is converted (job arrays)."""
    from .pipeline import finalize as finalize_dst

    try:
        summary = finalize_dst(dst)
    except ConvertError as e:
        _fail(e)
    click.echo(f"{summary.status}: {summary.shards_done}/{summary.shards_total} shards -> {dst}")
    if not summary.complete:
        sys.exit(4 if summary.status == "partial" else 3)


@main.command("make-fixture")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--layers", type=int, default=4, show_default=True, help="Layers (layer 0 dense).")
@click.option("--experts", type=int, default=8, show_default=True)
@click.option("--shards", type=int, default=3, show_default=True)
@click.option("--real-dims", is_flag=True, help="Real K3 expert shapes: w1/w3 [3072, 3584], w2 [3584, 3072].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="Where to draw the weights (cuda: much faster).")
@click.option("--keep-modules", is_flag=True,
              help="Cut shards only between modules [default: by size, as Hugging Face writers do, so pairs straddle].")
def make_fixture_cmd(dst, layers, experts, shards, real_dims, seed, device, keep_modules) -> None:
    """Write a small Kimi-K3-shaped MXFP4 checkpoint to DST."""
    from .progress import bar, close_bar

    say(f"writing a {'real-dims ' if real_dims else ''}Kimi-K3-shaped MXFP4 fixture ({layers} layers, "
        f"{experts} experts, {shards} shards) to {dst}; loading torch…")
    from .fixture import FixtureSpec, fixture_bytes, make_fixture

    kw = {"layers": layers, "experts": experts, "shards": shards, "seed": seed, "keep_modules": keep_modules}
    spec = FixtureSpec.real_dims(**kw) if real_dims else FixtureSpec(**kw)
    b = bar(total=fixture_bytes(spec), desc="fixture", unit="B", unit_scale=True, unit_divisor=1000)
    try:
        names = make_fixture(dst, spec, device=device, progress=b.update)
    finally:
        close_bar(b, leave=False)
    size = sum(os.path.getsize(os.path.join(dst, n)) for n in names)
    click.echo(f"wrote {len(names)} shards, {size / 1e6:.1f} MB -> {dst}")


@main.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to put the fixture and its conversion, kept [default: a new temporary directory, "
                   "removed at the end unless --keep].")
@click.option("--keep", is_flag=True, help="Keep the temporary directory (its path is printed).")
@click.pass_context
def demo(ctx, workdir, keep) -> None:
    """Make a small K3-shaped checkpoint and convert it: the whole job, in seconds."""
    import shutil

    temporary = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="k3convert-demo-")
    say(f"demo: a small Kimi-K3-shaped checkpoint and its int4 conversion, in {workdir}"
        + (" (removed at the end; --keep keeps it)" if temporary and not keep else ""))
    src = os.path.join(workdir, "kimi-k3-fixture")
    try:
        if not os.path.exists(src):
            ctx.invoke(make_fixture_cmd, dst=src)  # every other option at its default
        ctx.invoke(mxfp4_to_int4, src=src, dst=os.path.join(workdir, "kimi-k3-fixture-int4"), overwrite=True)
    finally:
        if temporary and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if temporary:
        click.echo(f"kept in {workdir}" if keep else f"removed {workdir} (--keep keeps it)")


@main.command("verify")
@click.argument("dst", type=click.Path())
@click.option("--source", "src", type=click.Path(), default=None,
              help="The MXFP4 source: recompute every file DST must hold from it, and re-decode sampled experts "
                   "from its bytes against the recorded figures.")
@click.option("--sample", type=int, default=8, show_default=True, help="Converted tensors to re-decode (with --source).")
@click.option("--all", "all_", is_flag=True, help="Re-decode every converted tensor (with --source; slow on the real model).")
@click.option("--no-checksums", is_flag=True, help="Skip hashing the shards (structure checks only).")
@click.option("--serving", type=click.Choice(SERVERS), default=None,
              help="Also check DST against that server and target: what it loads, the MoE kernel it "
                   "picks, the memory (docs/serving.md).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel size the server will run with (with --serving).")
@click.option("--dp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel size, vLLM's --data-parallel-size (with --serving vllm-*).")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Pipeline-parallel size, vLLM's --pipeline-parallel-size (with --serving vllm-*).")
@click.option("--ep", is_flag=True,
              help="Expert parallelism, vLLM's --enable-expert-parallel (with --serving vllm-*).")
@click.option("--verbose", "-v", is_flag=True,
              help="With --serving: where the server enforces each rule (file and line), and the fixes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify_cmd(dst, src, sample, all_, no_checksums, serving, tp, dp, pp, ep, verbose, as_json) -> None:
    """Check a converted DST: every file against the manifest, checksums, structure, SiTU metadata,
    (with --source) every file against SRC and the numbers, and (with --serving) whether that
    server's int4 MoE path will load it at --tp (--dp, --pp, --ep: the vLLM launch; docs/serving.md).

    Exit 0 when every check passes, 5 when one fails, 2 when DST or SRC cannot be read."""
    from .checks import check_lines, header
    from .verify import verify

    from .serving import topology
    from .topology import Topology

    if (tp != 1 or dp != 1 or pp != 1 or ep or verbose) and serving is None:
        raise click.UsageError("--tp, --dp, --pp, --ep and --verbose are used with --serving")
    topo = None
    if serving:
        try:
            topo = topology(serving, Topology(tp, dp, pp, ep))
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    stream = not as_json and os.path.isdir(dst)   # a missing DST stays one error line
    if stream:   # the first line at once, each check as it ends: the slow ones (--source, K3's headers) last
        click.echo(header(dst) + (": reading the shard headers…" if serving else ""))
    try:
        result = verify(dst, src, None if all_ else sample, checksums=not no_checksums,
                        serving=(serving, topo, verbose) if serving else None,
                        on_check=(lambda c: click.echo("\n".join(check_lines(c)))) if stream else None)
    except ConvertError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.footer() if stream else result.format())
    sys.exit(0 if result.ok else 5)


@main.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def inspect_cmd(path, as_json) -> None:
    """Describe a checkpoint (MXFP4 source, k3convert output, or other) or one shard: format,
    shards, tensors, quantization configs, SiTU fields, and for a source what converting gives.

    Exit 0, or 2 when PATH cannot be read or shards its index names are missing."""
    from .inspect import format_info, inspect_path, missing_shards

    try:
        info = inspect_path(path)
    except ConvertError as e:
        _fail(e)
    click.echo(json.dumps(info, indent=2, default=str) if as_json else format_info(info))
    if missing := missing_shards(info):  # described above, and refused as a checkpoint: bad input
        _fail(BadInput(f"{len(missing)} shard(s) named by the index are missing: {', '.join(missing)}", file=path))


@main.command("upload")
@click.argument("dst", type=click.Path())
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository private (an existing one keeps its visibility).")
@click.option("--revision", default=None, help="Branch to upload to (created if missing) [default: main].")
@click.option("--dry-run", is_flag=True, help="List the files and bytes that would be sent; no network, no writes.")
@click.option("--token", default=None, help="Hub token [default: the one saved by `hf auth login` / HF_TOKEN].")
@click.option("--verify-checksums", is_flag=True, help="Also re-hash every shard against the manifest first.")
@click.option("--base-model", default=None, help="Base model named in the model card [default: from the source].")
def upload_cmd(dst, repo_id, private, revision, dry_run, token, verify_checksums, base_model) -> None:
    """Upload a complete, verified DST to the Hub as REPO_ID, with a model card (README.md) if it has none.

    Resumable: run the same command again after an interruption."""
    from .hub import card_preview, upload

    if os.path.isdir(dst):   # the first line at once: verify and the Hub take a while (a missing DST: one error)
        click.echo(f"upload {dst} -> {repo_id}: verifying DST, then "
                   + ("listing what would be sent…" if dry_run else "sending it…"))
    try:
        res = upload(dst, repo_id, private=private, revision=revision, dry_run=dry_run, token=token,
                     verify_checksums=verify_checksums, base=base_model)
    except ConvertError as e:
        _fail(e)
    if dry_run:
        for path, size in res.files:
            click.echo(f"{size:>16,d}  {path}")
    click.echo(f"README.md: {res.readme}" + (card_preview(res.card) if dry_run and res.card else ""))
    verb = "would upload" if dry_run else f"uploaded with HfApi.{res.method}"
    click.echo(f"{verb} {len(res.files)} files, {res.total_bytes / 1e9:.3f} GB -> {repo_id}"
               + (f" (revision {revision})" if revision else ""))
    for note in res.notes:
        click.echo(f"note: {note}")

if __name__ == "__main__":
    main()
