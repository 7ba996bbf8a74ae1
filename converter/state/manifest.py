"""The manifest and the report: one schema each, written by finalize and read back by verify, upload and
inspect. Each dataclass holds the fields in the order they are written, and ``TYPES`` the types a
reader checks a file of DST against (``formats.json_input.type_problems``): a field of another type
fails verification naming it, never a TypeError further on. The two live together so that what is
written and what is read cannot drift apart."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from .. import __version__
from ..digest import ALGORITHM as DIGEST_ALGORITHM
from ..formats.dialect import TARGET_FORMAT
from ..formats.json_input import ListOf, MapOf
from .files import TENSOR_TABLE

TOOL = "k3convert"


class Status(StrEnum):
    """Where a DST stands: ``complete`` only when every shard is done and within --max-rel-rmse."""

    PARTIAL = "partial"
    COMPLETE = "complete"
    FAILED_VALIDATION = "failed-validation"


_FINGERPRINT = {"size": int, "edge_blake2b": str, "mtime_ns": int}
_FILE = {"bytes": int, "digest": str}


@dataclass
class Source:
    """What was converted: the source's path, profile, quantization and fingerprints (run.json's)."""

    path: str
    profile: dict[str, Any]
    quantization: dict[str, Any]
    dropped_tensors: list[str]
    dequantized: list[str]
    config: dict[str, Any] | None
    shards: dict[str, dict[str, Any]]

    TYPES: ClassVar[dict[str, Any]] = {
        "path": str, "shards": MapOf(_FINGERPRINT), "profile": dict,
        "quantization": {"dialect": str, "packed_suffix": str, "scale_bias": int, "blocks": ListOf(str)},
    }


@dataclass(kw_only=True)
class Manifest:
    """DST's manifest (``k3convert_manifest.json``): written last, it says whether DST is complete,
    and records every output shard and every file beside them with its size and digest. Fields in the
    order they are written."""

    tool: str = TOOL
    version: str = __version__
    status: Status
    complete: bool = False
    source_format: str
    target_format: str = TARGET_FORMAT
    activation: dict[str, Any]
    source: Source
    options: dict[str, Any]
    scale_rule: str
    digest_algorithm: str = DIGEST_ALGORITHM
    shards: dict[str, dict[str, Any]]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    finished_at: str | None = None   # written only once complete

    TYPES: ClassVar[dict[str, Any]] = {
        "tool": str, "version": str, "status": str, "complete": bool, "source_format": str, "target_format": str,
        "digest_algorithm": str, "activation": dict, "options": dict, "source": Source.TYPES,
        "shards": MapOf(_FILE), "files": MapOf(_FILE),
    }

    def to_json(self) -> dict[str, Any]:
        out = _plain(self)
        if self.finished_at is None:
            del out["finished_at"]
        return out


@dataclass(kw_only=True)
class Report:
    """The report users read (``k3convert_report.json``): the error figures per layer, the worst
    tensor, and the scale rule with the other rule's figures on the same weights. Fields in the order
    they are written; ``rule``'s sit at the top level of the file."""

    tool: str = TOOL
    version: str = __version__
    source: str
    status: Status
    profile: dict[str, Any]
    quantization: dict[str, Any]
    dropped_tensors: list[str]
    dequantized: list[str]
    source_format: str
    target_format: str = TARGET_FORMAT
    activation: dict[str, Any]
    max_rel_rmse: float
    tensors: int
    worst: dict[str, Any] | None
    rel_rmse_mean: float
    rule: dict[str, Any]        # scale_rule, compare_rule, cmp_rel_rmse_mean, cmp_ratio, compare (run.finalize)
    tensor_table: str = TENSOR_TABLE
    layers: list[dict[str, Any]]

    TYPES: ClassVar[dict[str, Any]] = {"tensors": int}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in _plain(self).items():
            if k == "rule":
                out.update(v)
            else:
                out[k] = v
        return out


def _plain(value: Any) -> Any:
    """A field as JSON holds it: nested dataclasses as dicts, enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, StrEnum):
        return str(value)
    return value
