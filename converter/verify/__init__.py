"""Check a converted DST before anyone serves or uploads it: bytes, structure, activation, numbers.

Three layers, each reported as a pass/fail line with the problems it found:
checksums (every shard against the manifest), structure (every file under DST named by the
manifest with its recorded digest, index, config, tensor shapes and dtypes, SiTU stated
everywhere a loader looks, the figure table), and, given the source, every file recomputed
from SRC (``outputs.expected``, what finalize writes) and a re-decode of sampled experts
through a path independent of the converter's own reader (``safetensors.safe_open`` +
compressed-tensors' unpacker), whose error must match the figures the conversion recorded
and whose groups must be exactly optimal.

One module per check, each with ``run(ctx) -> list[Check]`` (empty when it does not apply),
run in the order of ``CHECKS``: adding a check is a module and a line there. A check imports
what it needs (torch, safetensors, compressed-tensors) inside ``run``, so the structural checks
of a plain ``verify`` load none of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..checks import Check, VerifyResult
from . import (
    checksums,
    config,
    figures,
    index,
    listing,
    manifest,
    passthrough,
    redecode,
    serving,
    situ,
    source_files,
    source_identity,
    tensors,
)
from .context import open_context

if TYPE_CHECKING:
    from ..servers.rules import ServingRequest

# The report's order: bytes, structure, then (with --source) SRC, then (with --serving) the server.
CHECKS = (manifest, checksums, listing, index, config, tensors, situ, figures,
          source_files, source_identity, redecode, passthrough, serving)
# What each check does, said while it runs (``on_start``): the slow ones take seconds to minutes.
DOING = {manifest: "manifest", checksums: "checksums: hashing every shard", listing: "files under DST",
         index: "index", config: "config: the quantization blocks and what they select", tensors: "tensors",
         situ: "situ", figures: "figures", source_files: "from source: recomputing every file from SRC",
         source_identity: "source: SRC's shards", redecode: "re-decode: sampled experts from SRC's and DST's bytes",
         passthrough: "passthrough: sampled tensors against SRC", serving: "serving: the server's int4 MoE path"}


def verify(dst: str, source: str | None = None, sample: int | None = 8, *, checksums: bool = True,
           workers: int = 4, serving: ServingRequest | None = None,
           loader_matcher: bool | None = None,
           on_check: Callable[[Check], None] | None = None,
           on_start: Callable[[str], None] | None = None) -> VerifyResult:
    """Verify DST; problems are listed in the result (BadInput only when DST or SRC is unreadable;
    VerifyFailed when DST's manifest is there but not JSON: nothing else can be judged without it).

    ``sample``: converted tensors re-decoded when ``source`` is given (None: every one).
    ``checksums=False`` skips hashing the shards (the structural checks stay).
    ``serving`` (a ``servers.ServingRequest``) adds the "serving" check: the rules of that server's
    int4 MoE path at its topology.
    ``loader_matcher``: compressed-tensors' ``is_match`` re-decides the config's selection
    (seconds of imports); default: with ``source``, whose re-decode loads compressed-tensors anyway.
    ``on_check``: called with each check as it ends (the CLI prints it at once).
    ``on_start``: called with what each check does (``DOING``) as it begins (the CLI shows it while it runs).
    """
    ctx = open_context(dst, source, sample=sample, checksums=checksums, workers=workers, serving=serving,
                       loader_matcher=source is not None if loader_matcher is None else loader_matcher)
    for check in CHECKS:
        if on_start is not None:
            on_start(DOING[check])
        done = check.run(ctx)
        ctx.result.checks += done
        if on_check is not None:
            for c in done:
                on_check(c)
    return ctx.result


# The public names other modules, scripts and tests import from converter.verify (private ones are
# imported from the module that defines them).
from ..errors import VerifyFailed  # noqa: E402
from ..state.files import REPORT  # noqa: E402
from .config import fp8_group_problems, fp8_modules, int4_block_problems  # noqa: E402
from .dst import BLOCK_TYPES, CONFIG_TYPES, INDEX_TYPES, MANIFEST_TYPES, Dst, converted_modules, scale_rule  # noqa: E402
from .figures import REPORT_TYPES, ROW_TYPES, table_rows  # noqa: E402
from .optimum import brute_force_min  # noqa: E402
from .redecode import OPT_GROUPS, OPT_TENSORS, REL_TOL  # noqa: E402
from .sample import spread  # noqa: E402
from .selection import CHECKED_BY_LOADER, selection_problems  # noqa: E402
from .source_files import differences  # noqa: E402

__all__ = ["CHECKS", "Check", "VerifyResult", "verify", "VerifyFailed", "REPORT", "int4_block_problems",
           "fp8_modules", "fp8_group_problems", "Dst", "converted_modules", "scale_rule", "INDEX_TYPES",
           "MANIFEST_TYPES", "CONFIG_TYPES", "BLOCK_TYPES", "REPORT_TYPES", "ROW_TYPES", "table_rows",
           "brute_force_min", "spread", "selection_problems", "CHECKED_BY_LOADER", "differences",
           "REL_TOL", "OPT_GROUPS", "OPT_TENSORS"]
