"""The ``k3convert`` command: a thin layer over converter.pipeline and friends."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import click

from . import __version__
from .errors import ConvertError


class _Progress:
    """Turns pipeline events into a tqdm bar (bytes, GB/s, ETA) or JSON lines."""

    def __init__(self, mode: str):
        self.mode, self.bar, self.done, self.total = mode, None, 0, 0

    def __call__(self, kind: str, f: dict) -> None:
        if self.mode == "json":
            click.echo(json.dumps({"event": kind, "time": round(time.time(), 3), **f}), err=True)
            return
        if self.mode == "none":
            return
        if kind == "plan":
            from tqdm import tqdm
            self.total = f["todo"]
            self.bar = tqdm(total=f["bytes_in"], unit="B", unit_scale=True, unit_divisor=1000,
                            desc=f"shards 0/{self.total}", dynamic_ncols=True, file=sys.stderr)
            click.echo(f"converting {f['todo']} of {f['shards']} shards on {', '.join(sorted(set(f['devices'])))}"
                       f" ({len(f['devices'])} worker(s))", err=True)
        elif kind == "bytes" and self.bar:
            self.bar.update(f["n"])
        elif kind == "done" and self.bar:
            self.done += 1
            self.bar.set_description(f"shards {self.done}/{self.total}")

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _fail(e: ConvertError) -> None:
    click.echo(f"k3convert: error: {e}", err=True)
    sys.exit(e.exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3convert")
def main() -> None:
    """Convert Kimi K3's MXFP4 routed experts to int4 group 32, once, offline."""


@main.command("mxfp4-to-int4")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", "dst", type=click.Path(), help="Output directory [default: SRC-int4 beside SRC].")
@click.option("--max-rel-rmse", type=float, default=0.15, show_default=True,
              help="Fail (exit 3) if any tensor's relative RMSE vs the MXFP4 weights exceeds this.")
@click.option("--devices", default=None, help="Comma list like cuda:0,cuda:1 or cpu [default: every GPU, else CPU].")
@click.option("--workers", type=int, default=1, show_default=True, help="CPU worker processes (no GPU).")
@click.option("--sample-experts", type=int, default=4, show_default=True,
              help="Experts per layer whose output error ||(Wq-W)x||/||Wx|| is measured.")
@click.option("--overwrite", is_flag=True, help="Replace a DST that holds a different conversion.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), default="bar", show_default=True)
def mxfp4_to_int4(src, dst, max_rel_rmse, devices, workers, sample_experts, overwrite, progress) -> None:
    """Convert the MXFP4 checkpoint SRC into an int4 checkpoint a server loads directly."""
    from .pipeline import Options, convert
    from .validate import format_table

    opts = Options(max_rel_rmse=max_rel_rmse, sample_experts=sample_experts, workers=workers,
                   devices=devices.split(",") if devices else None, overwrite=overwrite)
    bar = _Progress(progress)
    try:
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
        click.echo(json.dumps({"event": "finished", "dst": summary.dst, "complete": summary.complete,
                               "seconds": round(summary.seconds, 3), "worst": summary.worst}), err=True)
        return
    click.echo(format_table(summary.layers))
    rate = summary.bytes_in / summary.seconds / 1e9 if summary.seconds else 0
    state = "complete" if summary.complete else f"{summary.shards_done}/{summary.shards_total} shards (partial)"
    click.echo(f"{state}: {summary.tensors} tensors in {summary.seconds:.1f} s ({rate:.2f} GB/s) -> {summary.dst}")
    click.echo(f"report: {os.path.join(summary.dst, 'k3convert_report.json')}")


@main.command("make-fixture")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--layers", type=int, default=4, show_default=True, help="Layers (layer 0 dense).")
@click.option("--experts", type=int, default=8, show_default=True)
@click.option("--shards", type=int, default=3, show_default=True)
@click.option("--real-dims", is_flag=True, help="Real K3 expert shapes: w1/w3 [3072, 3584], w2 [3584, 3072].")
@click.option("--seed", type=int, default=0, show_default=True)
def make_fixture_cmd(dst, layers, experts, shards, real_dims, seed) -> None:
    """Write a small Kimi-K3-shaped MXFP4 checkpoint to DST."""
    from .fixture import FixtureSpec, make_fixture

    kw = {"layers": layers, "experts": experts, "shards": shards, "seed": seed}
    spec = FixtureSpec.real_dims(**kw) if real_dims else FixtureSpec(**kw)
    names = make_fixture(dst, spec)
    size = sum(os.path.getsize(os.path.join(dst, n)) for n in names)
    click.echo(f"wrote {len(names)} shards, {size / 1e6:.1f} MB -> {dst}")


@main.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to put the fixture and its conversion [default: a new temporary directory].")
@click.pass_context
def demo(ctx, workdir) -> None:
    """Make a small K3-shaped checkpoint and convert it: the whole job, in seconds."""
    workdir = workdir or tempfile.mkdtemp(prefix="k3convert-demo-")
    src = os.path.join(workdir, "kimi-k3-fixture")
    if not os.path.exists(src):
        ctx.invoke(make_fixture_cmd, dst=src, layers=4, experts=8, shards=3, real_dims=False, seed=0)
    ctx.invoke(mxfp4_to_int4, src=src, dst=os.path.join(workdir, "kimi-k3-fixture-int4"), max_rel_rmse=0.15,
               devices=None, workers=1, sample_experts=4, overwrite=True, progress="bar")


if __name__ == "__main__":
    main()
