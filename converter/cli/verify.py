"""``verify``: a converted DST against its manifest, its source and (--serving) a server's rules."""
from __future__ import annotations

import json
import os
import sys

import click

from ..errors import ConvertError
from ..servers.rules import SERVERS
from ..terminal.progress import Status
from .params import Whole, fail


@click.command("verify")
@click.argument("dst", type=click.Path())
@click.option("--source", "src", type=click.Path(), default=None,
              help="The MXFP4 source: recompute every file DST must hold from it, and re-decode sampled experts "
                   "from its bytes against the recorded figures.")
@click.option("--sample", type=Whole(min=0), default=8, show_default=True,
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
@click.option("--gpu-memory-utilization", "utilization", type=float, default=None, metavar="FRACTION",
              help="With --serving: the share of GPU memory vLLM may take [default: what the release checked "
                   "uses when the flag is not given (docs/serving.md)].")
@click.option("--vllm-version", "vllm_version", default=None, metavar="VERSION",
              help="With --serving vllm-*: the vLLM release to check against (default: the newest proven).")
@click.option("--verbose", "-v", is_flag=True,
              help="With --serving: where the server enforces each rule (file and line), and the fixes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="--source ORG/NAME@COMMIT: the Hub cache holding its files (the conversion's --cache-dir) "
                   "[default: HF_HUB_CACHE].")
def verify_cmd(dst, src, sample, all_, no_checksums, serving, tp, dp, pp, ep, gpu_memory, utilization, vllm_version,
               verbose, as_json, cache_dir=None) -> None:
    """Check a converted DST: every file against the manifest, checksums, structure, SiTU metadata,
    (with --source) every file against SRC and the numbers, and (with --serving) whether that
    server's int4 MoE path will load it at --tp (--dp, --pp, --ep: the vLLM launch; docs/serving.md).

    Exit 0 when every check passes, 5 when one fails, 2 when DST or SRC cannot be read."""
    from ..checks import check_lines, header
    from ..servers.rules import ServingRequest
    from ..servers.topology import Topology
    from ..verify import verify

    if (tp != 1 or dp != 1 or pp != 1 or ep or verbose or vllm_version or gpu_memory is not None
            or utilization is not None) and serving is None:
        raise click.UsageError("--tp, --dp, --pp, --ep, --gpu-memory, --gpu-memory-utilization, --vllm-version and "
                               "--verbose are used with --serving")
    if cache_dir is not None and (src is None or os.path.lexists(src)):
        raise click.UsageError("--cache-dir is used with --source ORG/NAME@COMMIT (a Hub source)")
    request = None
    if serving:
        try:
            request = ServingRequest.parse(serving, Topology(tp, dp, pp, ep), vllm=vllm_version, verbose=verbose,
                                           gpu_memory=gpu_memory, utilization=utilization)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    from ..hub.source import HubSource, meant_for_hub, parse_source
    if src is not None and not os.path.lexists(src) and meant_for_hub(src):  # ORG/NAME@COMMIT: the HF cache's copy
        from ..hub.remote import snapshot_path
        try:
            hub_src = parse_source(src)
            assert isinstance(hub_src, HubSource)   # not a local path: lexists said so
            src = snapshot_path(hub_src, cache_dir)
        except ConvertError as e:
            fail(e)
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
        fail(e)
    status.end()
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.footer() if stream else result.format())
    sys.exit(0 if result.ok else 5)
