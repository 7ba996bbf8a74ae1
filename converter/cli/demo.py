"""``make-fixture`` and ``demo``: a small K3-shaped checkpoint, and the whole job on it."""
from __future__ import annotations

import os
import tempfile

import click

from ..errors import ConvertError, OutputError
from ..terminal.progress import say
from .convert import mxfp4_to_int4
from .params import Whole, fail

DEMO_SERVER, DEMO_TP = "vllm-rocm-plugin", 8  # with EP: the launch README teaches (docs/serving.md)
DEMO_CHECK = f"--serving {DEMO_SERVER} --tp {DEMO_TP} --ep"


@click.command("make-fixture")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--layers", type=Whole(min=2), default=4, show_default=True,
              help="Layers (layer 0 dense, the rest MoE).")
@click.option("--experts", type=Whole(min=1), default=8, show_default=True)
@click.option("--shards", type=Whole(min=1), default=3, show_default=True)
@click.option("--real-dims", is_flag=True, help="Real K3 expert shapes: w1/w3 [3072, 3584], w2 [3584, 3072].")
@click.option("--demo-dims", is_flag=True,
              help="demo's shape, w1/w3 [2048, 128]: the smallest whose conversion passes " + DEMO_CHECK + ".")
@click.option("--seed", type=Whole(min=0), default=0, show_default=True)
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
    from ..safepath import new_folder
    from ..terminal.progress import bar, close_bar

    if real_dims and demo_dims:
        raise click.UsageError("--real-dims and --demo-dims are two shapes: give one")
    try:  # before torch loads: a checkpoint in DST is refused at once (T5)
        new_folder(dst, "make-fixture writes only into a new or empty directory")
    except ConvertError as e:
        fail(e)
    dims = "real-dims " if real_dims else "demo-dims " if demo_dims else ""
    say(f"writing a {dims}Kimi-K3-shaped MXFP4 fixture ({layers} layers, "
        f"{experts} experts, {shards} shards) to {dst}; loading torch…")
    from ..fixture import Draw, FixtureSpec, fixture_bytes, make_fixture

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
        fail(e)
    size = sum(os.path.getsize(os.path.join(dst, n)) for n in names)
    click.echo(f"wrote {len(names)} shards, {size / 1e6:.1f} MB -> {dst}")


def _launch_check(dst: str) -> None:
    """verify DST as ``verify DST --no-checksums DEMO_CHECK`` does; VerifyFailed (exit 5) unless it passes."""
    from ..servers.rules import ServingRequest
    from ..servers.topology import Topology
    from ..verify import verify

    request = ServingRequest.parse(DEMO_SERVER, Topology(tp=DEMO_TP, ep=True))
    try:
        verify(dst, checksums=False, serving=request).raise_if_failed()
    except ConvertError as e:
        fail(e)


@click.command()
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
        fail(OutputError(f"cannot create the demo's temporary directory: {e.strerror} (set TMPDIR, or use --dir)",
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
