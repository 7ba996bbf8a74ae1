"""``inspect``: what a checkpoint directory, one shard or a Hub repository holds."""
from __future__ import annotations

import json
import sys

import click

from ..errors import BadInput, ConvertError
from .params import Source, fail


@click.command("inspect")
@click.argument("path", type=Source())
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def inspect_cmd(path, as_json) -> None:
    """Describe a checkpoint (MXFP4 source, k3convert output, or other) or one shard: format,
    shards, tensors, quantization configs, SiTU fields, and for a source what converting gives.

    Exit 0, or 2 when PATH cannot be read or shards its index names are missing."""
    from ..hub.source import HubSource
    from ..inspect import format_info, inspect_path, missing_shards

    try:
        if isinstance(path, HubSource):
            from ..hub.inspect import inspect_hub
            info = inspect_hub(path)
        else:
            info = inspect_path(path)
    except ConvertError as e:
        fail(e)
    missing = missing_shards(info)  # described, and refused as a checkpoint: bad input
    bad = BadInput(f"{len(missing)} shard(s) named by the index are missing: {', '.join(missing)}", file=path) \
        if missing else None
    if as_json:  # one JSON object: the description, with the error and exit code when there is one
        from ..terminal.failure import fields
        click.echo(json.dumps({**info, **(fields(str(bad), bad.exit_code, bad.file) if bad else {})},
                              indent=2, default=str))
        sys.exit(bad.exit_code if bad else 0)
    click.echo(format_info(info))
    if bad:
        fail(bad)
