"""Which vLLM and aiter an image holds, and whether the plugin takes that aiter: `python -m` this module.

The aiter distribution is named `amd-aiter` where built from ROCm/aiter's setup.py (vLLM's ROCm image)
and `aiter` on some other images, so it is found by the import package it provides, not by one name.
Versions are read from package metadata; aiter's kernel module is imported only for its signature,
and the pre-#4646 module is looked up without being imported (route.SILU_INT4_MODULE).
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from . import route

AITER_NAMES = ("amd-aiter", "aiter")   # distribution names aiter is installed under, ours first


@dataclass(frozen=True)
class Dist:
    """One installed distribution: its name as installed and its version."""

    name: str
    version: str


def aiter_dist() -> Dist | None:
    """The distribution that installed the `aiter` import package, by whatever name; else the version
    aiter's build wrote into aiter/_version.py (pyproject.toml `write_to`: a checkout on the path);
    None if neither says."""
    try:
        providers = metadata.packages_distributions().get("aiter", [])
    except Exception:  # noqa: BLE001 - a broken dist-info elsewhere must not hide aiter's
        providers = []
    for name in dict.fromkeys((*providers, *AITER_NAMES)):
        try:
            return Dist(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    version = _assigned(_package_file("aiter", "_version.py"), "__version__")
    return Dist("aiter/_version.py", version) if version else None


def _package_file(package: str, name: str) -> Path | None:
    """A file of an importable package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except Exception:  # noqa: BLE001
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        if Path(root, name).is_file():
            return Path(root, name)
    return None


def _assigned(path: Path | None, name: str) -> str | None:
    """The string literal a Python file assigns to ``name`` (``a = b = '...'`` too), read as text."""
    text = path.read_text(errors="replace") if path else ""
    m = re.search(rf"""^{name}\s*=(?:\s*\w+\s*=)*\s*['"]([^'"\n]+)['"]""", text, re.MULTILINE)
    return m[1] if m else None


def vllm_dist() -> Dist | None:
    """vLLM's version and, where its `_version.py` records one, the commit it was built from."""
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
    commit = _assigned(_package_file("vllm", "_version.py"), "__commit_id__")
    return Dist("vllm", f"{version} (commit {commit})" if commit else version)


def has_module(name: str) -> bool:
    """Whether ``name`` is importable, found without importing it (its parent packages are imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # noqa: BLE001 - a parent that cannot be imported holds no such module
        return False


def gemm1_check() -> str | None:
    """route.gemm1_problem for the installed aiter (this imports aiter's kernel module)."""
    try:
        gemm1 = getattr(importlib.import_module(route.KERNEL_MODULE), "flydsl_a16w4_gemm1", None)
    except Exception as exc:  # noqa: BLE001 - aiter's own words, as the plugin reports them
        return route.gemm1_problem(None, f"{type(exc).__name__}: {exc}".splitlines()[0])
    return route.gemm1_problem(gemm1)


def report() -> tuple[list[str], bool]:
    """(lines to print, whether the plugin would take this aiter)."""
    vllm, aiter = vllm_dist(), aiter_dist()
    lines = [f"vllm: {vllm.version if vllm else 'not installed'}",
             f"aiter: {f'{aiter.name} {aiter.version}' if aiter else 'no distribution provides it'}"]
    if not has_module("aiter"):
        return [*lines, "aiter: not importable"], False
    gemm1_why, old = gemm1_check(), has_module(route.SILU_INT4_MODULE)
    lines.append(f"stage 1: {route.KERNEL_MODULE}.flydsl_a16w4_gemm1 takes {', '.join(route.GEMM1_PARAMS)}: "
                 f"{'no' if gemm1_why else 'yes'}")
    lines.append(f"pre-#4646: {route.SILU_INT4_MODULE} (SiLU for int4) present: {'yes' if old else 'no'}")
    problems = [why for why in (gemm1_why, route.aiter_window_problem(old)) if why is not None]
    return [*lines, *(f"{route.PREFIX} {why}" for why in problems)], not problems


def main() -> int:
    lines, ok = report()
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
