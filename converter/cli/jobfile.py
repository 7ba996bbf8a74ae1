"""Job files: any option of a command, kept in a TOML file under version control.

``k3convert mxfp4-to-int4 --config job.toml`` reads the file's top-level keys as the
command's options (the command line wins). Keys are the long option names (``output``,
``max-rel-rmse``, ...) or, for the source directory, ``src``; dashes and underscores are the
same. Relative paths (a profile file's included) are taken relative to the job file, so a job
file means the same thing from any working directory (a batch scheduler's included). Several
``--config`` files apply in order, a later file's keys winning.
"""
from __future__ import annotations

import datetime
import os
import tomllib
from typing import Any

import click


def _keys(param: click.Parameter) -> set[str]:
    """The key a job file uses for ``param``: its long flag(s), or an argument's name."""
    if isinstance(param, click.Argument):
        return {(param.name or "").replace("_", "-")}
    return {o[2:] for o in param.opts if o.startswith("--")}


def load(path: str, command: click.Command) -> dict[str, Any]:
    """The job file as click defaults for ``command``: {parameter name: value}.

    Unknown keys are an error (a typo must not be ignored silently), as are values of the
    wrong kind; click converts and checks each value like one typed on the command line.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"file {path}: cannot read: {e.strerror}", param_hint="--config") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"file {path}: not valid TOML ({e})", param_hint="--config") from None
    by_key = {k: p for p in command.params if p.name != "config" for k in _keys(p)}
    base = os.path.dirname(os.path.abspath(path))
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in data.items():
        param = by_key.get(key.replace("_", "-"))
        if param is None:
            known = ", ".join(sorted(by_key))
            raise click.BadParameter(f"file {path}: unknown key {key!r} (known: {known})", param_hint="--config")
        if param.name in seen:
            raise click.BadParameter(f"file {path}: {seen[param.name]!r} and {key!r} are the same option: keep one",
                                     param_hint="--config")
        seen[param.name] = key
        if why := value_problem(param, value):
            raise click.BadParameter(f"file {path}: {key} = {value!r}: {why}", param_hint="--config")
        if isinstance(value, list):  # devices = ["cuda:0", "cuda:1"]
            value = ",".join(str(v) for v in value)
        if isinstance(value, str) and (isinstance(param.type, click.Path) or _names_file(param, value)):
            joined = os.path.normpath(os.path.join(base, os.path.expanduser(value)))  # e.g. profile = "k3.toml"
            # src = "ORG/NAME": a Hub repo id where no such path lies beside the job file (cli.params.Source)
            value = value if getattr(param.type, "hub_ok", False) and not os.path.lexists(joined) else joined
        out[param.name] = value
    return out


def _names_file(param: click.Parameter, value: str) -> bool:
    """Whether an option that takes a name or a file (``--profile``) is given a file here."""
    is_file = getattr(param.type, "is_file", None)
    return bool(is_file and is_file(value))


def value_problem(param: click.Parameter, value: Any) -> str | None:
    """Why a TOML value cannot stand for ``param`` as the command line would type it, or None.

    TOML has types the command line does not: each must be the one the option takes (a flag a
    boolean, a path or name a string, a number a number; never a date, a table or a boolean for a
    number), so that a job file means exactly what the same command line means.
    """
    if isinstance(value, (datetime.date, datetime.time)):
        return "a date or time, not an option value"
    if isinstance(value, dict):
        return "a table, not a value"
    if isinstance(param, click.Option) and param.is_flag:
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(value, bool):
        return "expected a value, not true/false"
    kind = param.type
    if isinstance(value, list):
        if not isinstance(kind, click.types.StringParamType) or not all(isinstance(v, (str, int)) and
                                                                       not isinstance(v, bool) for v in value):
            return "a list, where one value is expected"
        return None
    if isinstance(kind, (click.types.IntParamType,)):            # IntRange included
        return None if isinstance(value, int) else "expected a whole number"
    if isinstance(kind, (click.types.FloatParamType,)):          # FloatRange included
        return None if isinstance(value, (int, float)) else "expected a number"
    if isinstance(value, float):  # workers = 2.7 or 1e3: the command line takes no fraction there either
        return "expected a whole number, not a fraction or exponent"
    if isinstance(kind, (click.Path, click.Choice, click.types.StringParamType)):
        return None if isinstance(value, str) else "expected a string"
    return None if isinstance(value, (str, int, float)) else "expected a string or a number"


def option(f):
    """The ``--config FILE`` option: eager, so its values become the other options' defaults.
    Given more than once (a site's file, then a model's), the files apply in order: a later
    file's key replaces an earlier one's, and the command line wins over both."""

    def callback(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
        for path in value or ():
            ctx.default_map = {**(ctx.default_map or {}), **load(path, ctx.command)}

    return click.option("--config", type=click.Path(exists=True, dir_okay=False), is_eager=True, multiple=True,
                        expose_value=False, callback=callback,
                        help="Job file (TOML) with any of this command's options; the command line wins. "
                             "Repeatable: files apply in order, a later one's keys win.")(f)
