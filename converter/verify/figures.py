"""Check "figures": the per-tensor table has one finite row per converted tensor and the report
counts them. Sets ``ctx.rows`` for the re-decode."""
from __future__ import annotations

import math
import os

from ..checks import Check
from ..errors import VerifyFailed
from ..run.plan import PACKED
from ..run.validate import error_ratio, ratio_line
from ..state.files import REPORT, TENSOR_TABLE
from ..state.manifest import Report
from ..state.records import read_rows
from .context import Context
from .dst import _typed, converted_modules, read_obj, scale_rule

REPORT_TYPES = Report.TYPES
ROW_TYPES = {"name": str, "rel_rmse": float, "max_abs": float}


def table_rows(table: list[dict], path: str) -> dict[str, dict]:
    """The figure table's rows by tensor name; VerifyFailed naming the first line that lacks a field of
    ROW_TYPES or holds one of another type. One inline type test a row; the detailed check on failure."""
    rows: dict[str, dict] = {}
    num = (int, float)
    for i, r in enumerate(table):
        if not (type(r) is dict and type(r.get("name")) is str and type(r.get("rel_rmse")) in num
                and type(r.get("max_abs")) in num):
            _typed(r, ROW_TYPES, path, f"line {i + 1}")
            missing = [k for k in ROW_TYPES if k not in r]
            if missing:
                raise VerifyFailed(f"line {i + 1} has no {', '.join(missing)}", file=path)
        rows[r["name"]] = r
    return rows


def run(ctx: Context) -> list[Check]:
    d = ctx.dst
    c = Check("figures")
    path = os.path.join(d.path, TENSOR_TABLE)
    if not os.path.exists(path):
        c.fail(f"{TENSOR_TABLE} is missing")
        return [c]
    try:
        table = read_rows(path)
    except Exception as e:  # zstd or JSON damage: a problem of DST, not a crash
        c.fail(f"{TENSOR_TABLE} is unreadable ({e})")
        return [c]
    rows = ctx.rows = table_rows(table, path)
    want = {f"{m}.{PACKED}" for m in converted_modules(d)}
    for n in sorted(want - set(rows)):
        c.fail(f"{n}: converted but has no row in {TENSOR_TABLE}")
    for n in sorted(set(rows) - want):
        c.fail(f"{n}: row in {TENSOR_TABLE} but no such converted tensor")
    for n, r in sorted(rows.items()):
        if r.get("nonfinite") or not math.isfinite(r.get("rel_rmse", math.nan)):
            c.fail(f"{n}: non-finite values or error recorded")
    report = read_obj(os.path.join(d.path, REPORT), c, REPORT_TYPES)
    if report is not None and report.get("tensors") != len(rows):
        c.fail(f"{REPORT} counts {report.get('tensors')} tensors, {TENSOR_TABLE} has {len(rows)}")
    worst = max((r["rel_rmse"] for r in rows.values()), default=0.0)
    c.summary = f"{len(rows)} per-tensor rows, worst relative RMSE {worst:.4f}"
    if line := ratio_line(error_ratio(list(rows.values())), scale_rule(d)):
        c.notes.append(line)
    return [c]
