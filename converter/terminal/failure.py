"""How a command's error reaches its reader: ``k3convert: error: ...`` on stderr, or, when the
command speaks JSON (``--json``, ``--progress json``), one JSON object on the stream its JSON goes
to, so that the program reading that stream gets the error and the exit code in its own format."""
from __future__ import annotations

import enum
import json
import time
from typing import Any, Mapping, Sequence

import click


class ErrorStream(enum.Enum):
    TEXT = "text"      # one line on stderr
    STDOUT = "stdout"  # {"error", "exit_code"} on stdout: --json, and --dry-run's plan with --progress json
    EVENTS = "events"  # a "failed" event closing the --progress json events on stderr (as "finished" does)


def stream_for(params: Mapping[str, Any]) -> ErrorStream:
    """Where a command given these options prints JSON, and so its error."""
    if params.get("as_json"):
        return ErrorStream.STDOUT
    if params.get("progress") == "json":
        return ErrorStream.STDOUT if params.get("dry_run") else ErrorStream.EVENTS
    return ErrorStream.TEXT


def params_in(args: Sequence[str]) -> dict[str, Any]:
    """The options ``stream_for`` reads, from the command line as typed: for an error raised before
    click has read them (an unknown option, a bad value)."""
    args = list(args)
    args = args[: args.index("--")] if "--" in args else args
    progress = [b for a, b in zip(args, args[1:] + [""]) if a == "--progress"]
    progress += [a.split("=", 1)[1] for a in args if a.startswith("--progress=")]
    return {"as_json": "--json" in args, "progress": progress[-1] if progress else None,
            "dry_run": "--dry-run" in args}


def fields(message: str, code: int, file: str | None = None, tensor: str | None = None) -> dict[str, Any]:
    """The error as JSON: the one line, the exit code, and the file and tensor when known."""
    return {"error": message, "exit_code": code, **({"file": file} if file else {}),
            **({"tensor": tensor} if tensor else {})}


def report(message: str, code: int, how: ErrorStream, *, file: str | None = None, tensor: str | None = None) -> None:
    if how is ErrorStream.TEXT:
        click.echo(f"k3convert: error: {message}", err=True)
    elif how is ErrorStream.STDOUT:
        click.echo(json.dumps(fields(message, code, file, tensor), indent=2))
    else:
        click.echo(json.dumps({"event": "failed", "time": round(time.time(), 3),
                               **fields(message, code, file, tensor)}), err=True)
