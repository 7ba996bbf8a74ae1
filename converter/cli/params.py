"""The CLI's parameter types (counts, --workers, --profile, SRC) and its one way to fail: typed values
checked once, at the edge."""
from __future__ import annotations

import os
import sys

import click

from ..errors import ConvertError
from ..terminal.failure import report, stream_for


class WorkerCount(click.ParamType):
    """``--workers``: a positive number, or ``auto`` (None: chosen from the machine)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        from ..terminal.whole import whole
        n = value if isinstance(value, int) and not isinstance(value, bool) else whole(str(value))  # ASCII digits
        if n is None or n < 1:
            if ctx is not None and param is not None and \
                    ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"{WORKERS_ENV}={value!r} (the environment): not a positive number or auto")
            self.fail(f"{value!r} is not a positive number or auto", param, ctx)
        return n


class Whole(click.IntRange):
    """A count: ASCII digits only (``whole``), never ``int()``'s ``1_0``, ``٢`` or ``+3`` (T11), in range."""

    name = "N"

    def convert(self, value, param, ctx):
        from ..terminal.whole import whole
        if isinstance(value, str) and whole(value) is None:
            self.fail(f"{value!r} is not a whole number (ASCII digits)", param, ctx)
        return super().convert(value, param, ctx)


class ProfileName(click.types.StringParamType):
    """``--profile``: a bundled profile's name, or a profile file (``profiles.is_file``), which a job
    file names relative to itself (``jobfile.load``)."""

    name = "NAME|FILE.toml"

    @staticmethod
    def is_file(value: str) -> bool:
        from ..profiles import is_file
        return is_file(value)


WORKERS_ENV = "K3CONVERT_WORKERS"


class Source(click.Path):
    """SRC: a path (it exists: checked as click.Path checks it), else a Hub repo id ORG/NAME[@REVISION]
    (converter.hub.source.HubSource); neither: click's own "does not exist" line."""

    name = "SRC|ORG/NAME[@REV]"
    hub_ok = True   # a job file's src that names no path beside it stays a repo id (jobfile.load)

    def __init__(self, **kw):
        super().__init__(exists=True, **kw)

    def convert(self, value, param, ctx):
        from ..hub.source import HubSource, hub_id_problem, meant_for_hub, parse_source
        if isinstance(value, HubSource):
            return value
        if not os.path.lexists(value) and meant_for_hub(value) and (why := hub_id_problem(value)):
            self.fail(f"{value!r}: {why}", param, ctx)
        if os.path.lexists(value) or hub_id_problem(value):
            return super().convert(value, param, ctx)
        return parse_source(value)


def fail(e: ConvertError) -> None:
    """The error as one line, or as JSON where the command prints JSON (``failure``); its exit code."""
    ctx = click.get_current_context(silent=True)
    report(str(e), e.exit_code, stream_for(ctx.params if ctx else {}), file=e.file, tensor=e.tensor)
    sys.exit(e.exit_code)


