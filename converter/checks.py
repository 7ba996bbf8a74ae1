"""The report types every check module shares (``verify``, ``serving``): one named check, and the list.

Kept apart so that the checks can import it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import VerifyFailed

SHOWN = 20             # problems printed per check


@dataclass
class Check:
    """One line of the report: a named check, what it covered, and what it found wrong."""

    name: str
    summary: str = ""
    problems: list[str] = field(default_factory=list)
    skipped: bool = False
    notes: list[str] = field(default_factory=list)   # worth saying, not a failure

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, message: str) -> None:
        self.problems.append(message)

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else ("PASS" if self.ok else "FAIL")


@dataclass
class VerifyResult:
    dst: str
    checks: list[Check] = field(default_factory=list)
    decoder: str | None = None   # which int4 reader the re-decode used
    sampled: int = 0             # converted tensors re-decoded
    files: list[str] = field(default_factory=list)  # DST's output files, as accepted: what upload sends

    @property
    def problems(self) -> list[str]:
        return [f"{c.name}: {p}" for c in self.checks for p in c.problems]

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def raise_if_failed(self) -> None:
        if not self.ok:
            shown = self.problems[:SHOWN]
            more = len(self.problems) - len(shown)
            raise VerifyFailed(f"{len(self.problems)} verification problem(s):\n  " + "\n  ".join(shown)
                               + (f"\n  ... and {more} more" if more else ""), file=self.dst)

    def to_dict(self) -> dict[str, Any]:
        return {"dst": self.dst, "ok": self.ok, "decoder": self.decoder, "sampled": self.sampled,
                "files": self.files,
                "checks": [{"name": c.name, "status": c.status, "summary": c.summary, "problems": c.problems,
                            "notes": c.notes}
                           for c in self.checks]}

    def format(self) -> str:
        """The pass/fail list for the terminal."""
        return "\n".join([header(self.dst), *(line for c in self.checks for line in check_lines(c)), self.footer()])

    def footer(self) -> str:
        n = len(self.problems)
        return f"result: {'PASS' if self.ok else 'FAIL'}" + (f" ({n} problem(s))" if n else "")


def header(dst: str) -> str:
    return f"verify {dst}"


def check_lines(c: Check) -> list[str]:
    """One check's lines of the pass/fail list (printed as each check ends, by the CLI)."""
    lines = [f"  {c.status}  {c.name:<12} {c.summary}"]
    lines += [f"        - {p}" for p in c.problems[:SHOWN]]
    lines += [f"        note: {n}" for n in c.notes]
    if len(c.problems) > SHOWN:
        lines.append(f"        ... and {len(c.problems) - SHOWN} more")
    return lines
