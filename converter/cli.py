"""The ``k3convert`` command: a thin layer over converter.pipeline and friends."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

import click

from . import __version__, jobfile
from .errors import BadInput, ConvertError, OutputError
from .failure import params_in, report, stream_for
from .profiles import MAX_EXPERTS
from .progress import (  # noqa: F401
    ETA_AFTER_S,
    QUIET_ENV,
    Progress as _Progress,
    Status,
    eta,
    human_bytes,
    human_seconds,
    human_sizes,
    interactive,
    libraries_quiet,
    rate_line,
    say,
    set_quiet,
)
from .quant.rules import DEFAULT as DEFAULT_RULE, RULES as SCALE_RULES
from .servers.rules import SERVERS
from .state.files import REPORT
from .suggest import unknown_command


class _WorkerCount(click.ParamType):
    """``--workers``: a positive number, or ``auto`` (None: chosen from the machine)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        from .whole import whole
        n = value if isinstance(value, int) and not isinstance(value, bool) else whole(str(value))  # ASCII digits
        if n is None or n < 1:
            if ctx is not None and param is not None and \
                    ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"{WORKERS_ENV}={value!r} (the environment): not a positive number or auto")
            self.fail(f"{value!r} is not a positive number or auto", param, ctx)
        return n


class _Whole(click.IntRange):
    """A count: ASCII digits only (``whole``), never ``int()``'s ``1_0``, ``٢`` or ``+3`` (T11), in range."""

    name = "N"

    def convert(self, value, param, ctx):
        from .whole import whole
        if isinstance(value, str) and whole(value) is None:
            self.fail(f"{value!r} is not a whole number (ASCII digits)", param, ctx)
        return super().convert(value, param, ctx)


class _ProfileName(click.types.StringParamType):
    """``--profile``: a bundled profile's name, or a profile file (``profiles.is_file``), which a job
    file names relative to itself (``jobfile.load``)."""

    name = "NAME|FILE.toml"

    @staticmethod
    def is_file(value: str) -> bool:
        from .profiles import is_file
        return is_file(value)


WORKERS_ENV = "K3CONVERT_WORKERS"


class _Source(click.Path):
    """SRC: a path (it exists: checked as click.Path checks it), else a Hub repo id ORG/NAME[@REVISION]
    (converter.hub_source.HubSource); neither: click's own "does not exist" line."""

    name = "SRC|ORG/NAME[@REV]"
    hub_ok = True   # a job file's src that names no path beside it stays a repo id (jobfile.load)

    def __init__(self, **kw):
        super().__init__(exists=True, **kw)

    def convert(self, value, param, ctx):
        from .hub_source import HubSource, hub_id_problem, meant_for_hub, parse_source
        if isinstance(value, HubSource):
            return value
        if not os.path.lexists(value) and meant_for_hub(value) and (why := hub_id_problem(value)):
            self.fail(f"{value!r}: {why}", param, ctx)
        if os.path.lexists(value) or hub_id_problem(value):
            return super().convert(value, param, ctx)
        return parse_source(value)


def _fail(e: ConvertError) -> None:
    """The error as one line, or as JSON where the command prints JSON (``failure``); its exit code."""
    ctx = click.get_current_context(silent=True)
    report(str(e), e.exit_code, stream_for(ctx.params if ctx else {}), file=e.file, tensor=e.tensor)
    sys.exit(e.exit_code)


class _Main(click.Group):
    """The command group, with click's usage errors (a bad option value from the command line, a job
    file or the environment) as our one line, ``k3convert: error: ...``, exit 2 (JSON where the command
    prints JSON: ``failure``); -q/--quiet on every command (``add_command``); an unknown command
    names the close ones. From the command line the process leaves at once when done
    (fastexit: no seconds of torch teardown, no process left behind)."""

    def add_command(self, cmd, name=None):
        cmd.params.append(click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, callback=_quiet,
                                       help=QUIET_HELP))  # `k3convert demo -q` as `k3convert -q demo`
        super().add_command(cmd, name)

    def resolve_command(self, ctx, args):
        name = click.utils.make_str(args[0]) if args else None
        self.k3_command = name  # streams.Guard: whether the command is a job
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
        from .fastexit import exit_status
        from .streams import Guard
        self.k3_command = None
        code: int | str | None = 0
        with Guard() as out:  # output that cannot be written (a closed pipe, a full disk): one line (T10)
            try:
                self._standalone(args, prog_name, complete_var, **extra)
            except SystemExit as e:
                code = e.code
        sys.exit(out.status(exit_status(code), self.k3_command))

    def _standalone(self, args, prog_name, complete_var, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as e:  # usage errors: 2; as JSON where the command prints JSON
            typed = params_in(sys.argv[1:] if args is None else args)
            how = stream_for({**typed, **(ctx.params if (ctx := getattr(e, "ctx", None)) else {})})
            report(" ".join(e.format_message().split()), e.exit_code, how)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


QUIET_HELP = (f"No progress bars or status lines on stderr ({QUIET_ENV}=1 too); results, errors and --progress "
              "json stay. TQDM_DISABLE=1 or HF_HUB_DISABLE_PROGRESS_BARS=1 turn the bars off.")


def _quiet(ctx: click.Context, param, on: bool) -> None:
    """-q/--quiet, before or after the command's name: for the whole command (``progress.quiet``), the
    Hub's bars included; the group's context ends it."""
    if on:
        root = ctx.find_root()
        set_quiet(True)
        root.call_on_close(lambda: set_quiet(False))
        root.with_resource(libraries_quiet())


@click.group(cls=_Main, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3convert")
@click.option("-q", "--quiet", is_flag=True, envvar=QUIET_ENV, expose_value=False, callback=_quiet,
              help=QUIET_HELP + " Every command takes it.")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Convert Kimi K3's MXFP4 routed experts to int4 group 32, once, offline."""
    if ctx.invoked_subcommand is None:  # bare `k3convert`: the help, as `hf` and `vllm` print it
        click.echo(ctx.get_help())


@main.command("mxfp4-to-int4")
@click.argument("src", type=_Source(file_okay=False))
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
@click.option("--workers-per-gpu", type=_Whole(min=1), default=2, show_default=True,
              help="Worker processes per GPU: each converts one shard at a time, so two keep a GPU's "
                   "storage busy while one of them computes.")
@click.option("--sample-experts", type=_Whole(min=0, max=MAX_EXPERTS), default=4, show_default=True,
              help="Experts per layer whose output error ||(Wq-W)x||/||Wx|| is measured.")
@click.option("--overwrite", is_flag=True, help="Replace a DST that holds a different conversion.")
@click.option("--shards", "shard_spec", default=None, help="Only these shards, 1-based in name order: 3,5-9.")
@click.option("--part", default=None, help="Only part i of n (round robin over shards): for job arrays, e.g. 2/8.")
@click.option("--profile", type=_ProfileName(), default=None,
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
                   "(aiter per_1x32_i4_quant; README: Which scale rule).")
@click.option("--fp8-bf16-at-tp", "fp8_bf16_tp", type=_Whole(min=1), default=None,
              help="An FP8 source (MiMo-V2, Ling-3): write as bf16 the FP8 linears (with their fused siblings) that "
                   "vLLM's compressed-tensors FP8 scheme refuses at this TP size, so the output loads there; their "
                   "added error is stated in the manifest (docs/mimo.md) [default: every FP8 linear kept as is].")
@click.option("--dry-run", is_flag=True, help="Check everything, print the plan, convert nothing.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), default="bar", show_default=True,
              help="json: one JSON line per event on stderr, for schedulers and log collectors.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="A Hub SRC: where shards are downloaded (huggingface_hub's cache layout) [default: HF_HUB_CACHE].")
@click.option("--ahead", type=_Whole(min=1), default=2, show_default=True,
              help="A Hub SRC: source shards on disk at once (one converting while the next downloads).")
@click.option("--keep-source", is_flag=True,
              help="A Hub SRC: keep the downloaded shards in the cache [default: each is removed once converted].")
def mxfp4_to_int4(src, dst, max_rel_rmse, devices, workers, workers_per_gpu, sample_experts, overwrite, shard_spec,
                  part, profile, drop_activation_quant, scale_rule, dry_run, progress, cache_dir=None, ahead=2,
                  keep_source=False, fp8_bf16_tp=None) -> None:
    """Convert the MXFP4 checkpoint SRC into an int4 checkpoint a server loads directly.

    Exit codes: 0 done, 2 bad input, 3 error threshold exceeded, 4 output/IO problem
    (DST not usable, locked, disk full), 130 interrupted (run again to resume), 1 other.
    """
    from .pipeline import Options, convert, default_dst, describe

    opts = Options(max_rel_rmse=max_rel_rmse, sample_experts=sample_experts, workers=workers,
                   workers_per_gpu=workers_per_gpu,
                   devices=devices.split(",") if devices else None, overwrite=overwrite, shard_spec=shard_spec,
                   part=part, profile=profile, drop_activation_quant=drop_activation_quant, scale_rule=scale_rule,
                   fp8_bf16_tp=fp8_bf16_tp)
    bar = _Progress(progress)
    from .hub_source import HubSource
    if isinstance(src, HubSource):
        return _from_hub(src, dst, opts, bar, progress, dry_run, cache_dir, ahead, keep_source)
    with _reported(bar):
        if dry_run:
            if progress == "bar" and interactive():
                say(f"reading the shard headers of {src}…")
            plan = opts.plan(src)
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
        _fail(e)
    except KeyboardInterrupt:
        bar.close()
        click.echo("k3convert: interrupted; run the same command again to resume", err=True)
        sys.exit(130)
    bar.close()


def _show_plan(info: dict, progress: str) -> None:
    """--dry-run's answer: JSON with --progress json, else one aligned line per item."""
    click.echo(json.dumps(info, indent=2) if progress == "json" else "\n".join(
        f"{k:>28}: {v}" for k, v in human_sizes(info).items()))


def _from_hub(src, dst, opts, bar, progress, dry_run, cache_dir, ahead, keep_source) -> None:
    """mxfp4-to-int4 of a Hub repo id: look (--dry-run) or convert while downloading (converter.hub_convert)."""
    from . import hub_convert
    with _reported(bar):
        if dry_run:
            _show_plan(hub_convert.describe(src, dst, opts, cache_dir or hub_convert.default_cache(), ahead), progress)
            return
        bar.start()
        res = hub_convert.convert(src, dst, opts, bar, cache_dir, ahead, keep_source)
    say(f"fetched {res.fetched} shard(s) of {src.repo}@{res.commit}; peak staging "
        f"{res.peak_staging_bytes / 1e9:.3f} GB; {'kept in' if keep_source else 'removed from'} the cache")
    _finished(res.summary, progress)


def _finished(summary, progress: str) -> None:
    """The closing lines of a conversion (or its JSON event)."""
    from .validate import format_table, ratio_line

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


DEMO_SERVER, DEMO_TP = "vllm-rocm-plugin", 8  # with EP: the launch README teaches (docs/serving.md)
DEMO_CHECK = f"--serving {DEMO_SERVER} --tp {DEMO_TP} --ep"


@main.command("make-fixture")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--layers", type=_Whole(min=2), default=4, show_default=True,
              help="Layers (layer 0 dense, the rest MoE).")
@click.option("--experts", type=_Whole(min=1), default=8, show_default=True)
@click.option("--shards", type=_Whole(min=1), default=3, show_default=True)
@click.option("--real-dims", is_flag=True, help="Real K3 expert shapes: w1/w3 [3072, 3584], w2 [3584, 3072].")
@click.option("--demo-dims", is_flag=True,
              help="demo's shape, w1/w3 [2048, 128]: the smallest whose conversion passes " + DEMO_CHECK + ".")
@click.option("--seed", type=_Whole(min=0), default=0, show_default=True)
@click.option("--draw", type=click.Choice(["weights", "groups"]), default=None,
              help="weights: encode Student-t weights (the bytes of fixtures before issue 33); groups: sample "
                   "groups of one encoded pool, same histograms, ~10x faster [default: groups with --real-dims "
                   "or --demo-dims, else weights].")
@click.option("--device", default="cpu", show_default=True, help="Where to draw the weights (cuda: much faster).")
@click.option("--keep-modules", is_flag=True,
              help="Cut shards only between modules [default: by size, as Hugging Face writers do, so pairs straddle].")
@click.option("--model-type", type=click.Choice(["kimi_k3", "kimi_k31"]), default="kimi_k3", show_default=True,
              help="kimi_k31: Kimi K3.1's config (its DSA block) around the same experts.")
def make_fixture_cmd(dst, layers, experts, shards, real_dims, demo_dims, seed, draw, device, keep_modules,
                     model_type) -> None:
    """Write a small Kimi-K3-shaped MXFP4 checkpoint to DST."""
    from .progress import bar, close_bar
    from .safepath import new_folder

    if real_dims and demo_dims:
        raise click.UsageError("--real-dims and --demo-dims are two shapes: give one")
    try:  # before torch loads: a checkpoint in DST is refused at once (T5)
        new_folder(dst, "make-fixture writes only into a new or empty directory")
    except ConvertError as e:
        _fail(e)
    dims = "real-dims " if real_dims else "demo-dims " if demo_dims else ""
    say(f"writing a {dims}Kimi-K3-shaped MXFP4 fixture ({layers} layers, "
        f"{experts} experts, {shards} shards) to {dst}; loading torch…")
    from .fixture import Draw, FixtureSpec, fixture_bytes, make_fixture

    kw = {"layers": layers, "experts": experts, "shards": shards, "seed": seed, "keep_modules": keep_modules,
          "model_type": model_type, **({"draw": Draw(draw)} if draw else {})}
    spec = FixtureSpec.real_dims(**kw) if real_dims else FixtureSpec.demo(**kw) if demo_dims else FixtureSpec(**kw)
    b = bar(total=fixture_bytes(spec), desc="fixture", unit="B", unit_scale=True, unit_divisor=1000)
    try:
        try:
            names = make_fixture(dst, spec, device=device, progress=b.update)
        finally:
            close_bar(b, leave=False)
    except ConvertError as e:  # DIR not empty (T5), a full disk (T14): one line
        _fail(e)
    size = sum(os.path.getsize(os.path.join(dst, n)) for n in names)
    click.echo(f"wrote {len(names)} shards, {size / 1e6:.1f} MB -> {dst}")


def _launch_check(dst: str) -> None:
    """verify DST as ``verify DST --no-checksums DEMO_CHECK`` does; VerifyFailed (exit 5) unless it passes."""
    from .servers.rules import ServingRequest
    from .servers.topology import Topology
    from .verify import verify

    request = ServingRequest.parse(DEMO_SERVER, Topology(tp=DEMO_TP, ep=True))
    try:
        verify(dst, checksums=False, serving=request).raise_if_failed()
    except ConvertError as e:
        _fail(e)


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
    try:
        workdir = workdir or tempfile.mkdtemp(prefix="k3convert-demo-")
    except OSError as e:  # a full or read-only TMPDIR (T14)
        _fail(OutputError(f"cannot create the demo's temporary directory: {e.strerror} (set TMPDIR, or use --dir)",
                          file=e.filename or tempfile.gettempdir()))
    say(f"demo: a small Kimi-K3-shaped checkpoint and its int4 conversion, in {workdir}"
        + (" (removed at the end; --keep keeps it)" if temporary and not keep else ""))
    src, dst = os.path.join(workdir, "kimi-k3-fixture"), os.path.join(workdir, "kimi-k3-fixture-int4")
    say(f"the launch check its output passes (the demo runs it last, exit 5 if not): k3convert verify {dst} "
        f"--no-checksums {DEMO_CHECK}")
    try:
        if not os.path.exists(src):
            ctx.invoke(make_fixture_cmd, dst=src, demo_dims=True)  # every other option at its default
        ctx.invoke(mxfp4_to_int4, src=src, dst=dst, overwrite=True)
        _launch_check(dst)
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
@click.option("--sample", type=_Whole(min=0), default=8, show_default=True,
              help="Converted tensors to re-decode (with --source).")
@click.option("--all", "all_", is_flag=True,
              help="Re-decode every converted tensor (with --source; slow on the real model).")
@click.option("--no-checksums", is_flag=True, help="Skip hashing the shards (structure checks only).")
@click.option("--serving", type=click.Choice(SERVERS), default=None,
              help="Also check DST against that server and target: what it loads, the MoE kernel it "
                   "picks, the memory (docs/serving.md).")
@click.option("--tp", "--tensor-parallel-size", "-tp", "tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel size the server will run with (with --serving; vLLM's spellings work too).")
@click.option("--dp", "--data-parallel-size", "-dp", "dp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel size (with --serving vllm-*).")
@click.option("--pp", "--pipeline-parallel-size", "-pp", "pp", type=click.IntRange(min=1), default=1,
              show_default=True, help="Pipeline-parallel size (with --serving vllm-*).")
@click.option("--ep", "--enable-expert-parallel", "-ep", "ep", is_flag=True,
              help="Expert parallelism (with --serving vllm-*).")
@click.option("--gpu-memory", type=float, default=None, metavar="GB",
              help="With --serving: memory of one GPU in GB [default on ROCm: MI300X 192 GiB and MI325X 256 GiB].")
@click.option("--gpu-memory-utilization", "utilization", type=float, default=0.9, show_default=True,
              help="With --serving: the share of GPU memory vLLM may take (its own flag and default).")
@click.option("--vllm-version", "vllm_version", default=None, metavar="VERSION",
              help="With --serving vllm-*: the vLLM release to check against (default: the newest proven).")
@click.option("--verbose", "-v", is_flag=True,
              help="With --serving: where the server enforces each rule (file and line), and the fixes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify_cmd(dst, src, sample, all_, no_checksums, serving, tp, dp, pp, ep, gpu_memory, utilization, vllm_version,
               verbose, as_json) -> None:
    """Check a converted DST: every file against the manifest, checksums, structure, SiTU metadata,
    (with --source) every file against SRC and the numbers, and (with --serving) whether that
    server's int4 MoE path will load it at --tp (--dp, --pp, --ep: the vLLM launch; docs/serving.md).

    Exit 0 when every check passes, 5 when one fails, 2 when DST or SRC cannot be read."""
    from .checks import check_lines, header
    from .servers.rules import ServingRequest
    from .servers.topology import Topology
    from .verify import verify

    if (tp != 1 or dp != 1 or pp != 1 or ep or verbose or vllm_version or gpu_memory is not None
            or utilization != 0.9) and serving is None:
        raise click.UsageError("--tp, --dp, --pp, --ep, --gpu-memory, --gpu-memory-utilization, --vllm-version and "
                               "--verbose are used with --serving")
    request = None
    if serving:
        try:
            request = ServingRequest.parse(serving, Topology(tp, dp, pp, ep), vllm=vllm_version, verbose=verbose,
                                           gpu_memory=gpu_memory, utilization=utilization)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    from .hub_source import HubSource, meant_for_hub, parse_source
    if src is not None and not os.path.lexists(src) and meant_for_hub(src):  # ORG/NAME@COMMIT: the HF cache's copy
        from .hub_remote import snapshot_path
        try:
            hub_src = parse_source(src)
            assert isinstance(hub_src, HubSource)   # not a local path: lexists said so
            src = snapshot_path(hub_src)
        except ConvertError as e:
            _fail(e)
    stream = not as_json and os.path.isdir(dst)   # a missing DST stays one error line
    if stream:   # the first line at once, each check as it ends: the slow ones (--source, K3's headers) last
        click.echo(header(dst) + (": reading the shard headers…" if serving else ""))
    status = Status()  # on stderr, while each check runs: what it does, and for how long

    def ended(c) -> None:
        status.end()
        click.echo("\n".join(check_lines(c)))
    try:
        result = verify(dst, src, None if all_ else sample, checksums=not no_checksums,
                        serving=request,
                        on_check=ended if stream else None, on_start=status.start if stream else None)
    except ConvertError as e:
        status.end()
        _fail(e)
    status.end()
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.footer() if stream else result.format())
    sys.exit(0 if result.ok else 5)


@main.command("inspect")
@click.argument("path", type=_Source())
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def inspect_cmd(path, as_json) -> None:
    """Describe a checkpoint (MXFP4 source, k3convert output, or other) or one shard: format,
    shards, tensors, quantization configs, SiTU fields, and for a source what converting gives.

    Exit 0, or 2 when PATH cannot be read or shards its index names are missing."""
    from .hub_source import HubSource
    from .inspect import format_info, inspect_path, missing_shards

    try:
        if isinstance(path, HubSource):
            from .hub_inspect import inspect_hub
            info = inspect_hub(path)
        else:
            info = inspect_path(path)
    except ConvertError as e:
        _fail(e)
    missing = missing_shards(info)  # described, and refused as a checkpoint: bad input
    bad = BadInput(f"{len(missing)} shard(s) named by the index are missing: {', '.join(missing)}", file=path) \
        if missing else None
    if as_json:  # one JSON object: the description, with the error and exit code when there is one
        from .failure import fields
        click.echo(json.dumps({**info, **(fields(str(bad), bad.exit_code, bad.file) if bad else {})},
                              indent=2, default=str))
        sys.exit(bad.exit_code if bad else 0)
    click.echo(format_info(info))
    if bad:
        _fail(bad)


@main.command("upload")
@click.argument("dst", type=click.Path())
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository private (an existing one keeps its visibility).")
@click.option("--revision", default=None, help="Branch to upload to (created if missing) [default: main].")
@click.option("--dry-run", is_flag=True, help="List the files and bytes that would be sent; no network, no writes.")
@click.option("--token", default=None, help="Hub token [default: the one saved by `hf auth login` / HF_TOKEN].")
@click.option("--verify-checksums", is_flag=True,
              help="With --dry-run: also re-hash every shard against the manifest (an upload always does).")
@click.option("--base-model", default=None, help="Base model named in the model card [default: from the source].")
def upload_cmd(dst, repo_id, private, revision, dry_run, token, verify_checksums, base_model) -> None:
    """Upload a complete, verified DST to the Hub as REPO_ID, with a model card (README.md) if it has none.

    The token is checked first; every file is checked against the manifest as it is read, and
    what is committed is those bytes. Resumable: run the same command again after an interruption.
    Exit codes: 0 done, 2 bad input or token, 4 the Hub out of reach or DST locked, 5 DST fails
    verification (or changed), 130 interrupted, 1 other (a Hub error)."""
    from .hub import card_preview, upload

    if os.path.isdir(dst):   # the first line at once: verify and the Hub take a while (a missing DST: one error)
        click.echo(f"upload {dst} -> {repo_id}: verifying DST, then "
                   + ("listing what would be sent…" if dry_run else "sending it…"))
    try:
        res = upload(dst, repo_id, private=private, revision=revision, dry_run=dry_run, token=token,
                     verify_checksums=verify_checksums, base=base_model)
    except ConvertError as e:
        _fail(e)
    except KeyboardInterrupt:  # T15: as README's exit codes say, not click's "Aborted!" (exit 1)
        click.echo("k3convert: interrupted; run the same command again to resume", err=True)
        sys.exit(130)
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
