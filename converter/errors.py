"""Errors the tool reports to users: one line, naming the file and tensor, and an exit code."""
from __future__ import annotations


class ConvertError(Exception):
    """Base: a problem the user must fix. ``exit_code`` is documented in the README."""

    exit_code = 1

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        where = ", ".join(x for x in (file and f"file {file}", tensor and f"tensor {tensor}") if x)
        super().__init__(f"{where}: {message}" if where else message)
        self.file, self.tensor = file, tensor


class BadInput(ConvertError):
    """The source checkpoint is malformed, truncated, or not something we convert."""

    exit_code = 2


class ThresholdExceeded(ConvertError):
    """Conversion finished, but a tensor's error is above --max-rel-rmse."""

    exit_code = 3


class Interrupted(ConvertError):
    """Stopped by a signal; finished shards are kept and the next run resumes."""

    exit_code = 130


class OutputError(ConvertError):
    """DST cannot be written (exists with other content, read-only, disk full, locked)."""

    exit_code = 4


class VerifyFailed(ConvertError):
    """A converted checkpoint failed verification (checksums, structure or re-decoded error)."""

    exit_code = 5


def from_event(f: dict) -> ConvertError:
    """An error event (a worker's, a fetcher's: ``message``, ``code``, ``file``, ``tensor``) as the
    exception the CLI turns into its one line and exit code."""
    kinds: dict[object, type[ConvertError]] = {BadInput.exit_code: BadInput, OutputError.exit_code: OutputError}
    err = kinds.get(f.get("code"), ConvertError)(f["message"])
    err.file, err.tensor = f.get("file"), f.get("tensor")
    return err
