"""Per-tensor Python cost of ``verify``'s structure checks at Kimi K3 scale, without any data.

Builds K3's names (61 layers x 384 experts x 3 projections, the fixture's naming) in memory and
times, best of ``--repeats`` in CPU seconds (compressed-tensors imported first, untimed): the weight map's type check (``INDEX_TYPES``) over
``--rows`` entries, the figure table's per-row checks over ``--rows`` rows, and
``selection_problems`` (the config's targets/ignore against every module).

    PYTHONPATH=. python scripts/benchmarks/bench_verify_overhead.py [--rows 497000] [--repeats 3]

``PYTHONPATH=/tmp/before`` (``git archive REV converter | tar -x -C /tmp/before``) times an
older tree the same way.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale_rule import cpu_seconds  # noqa: E402  (one timer for the CPU benchmarks)

from converter import verify
from converter.fixture import FixtureSpec, _tensors, config
from converter.formats import checkpoint as ckpt
from converter.formats.compressed_tensors import compressed_tensors_source


def old_rows(table: list[dict], path: str) -> dict:
    """The per-row loop as it was (for trees without ``verify.table_rows``)."""
    rows = {}
    for i, r in enumerate(table):
        verify.dst._typed(r, verify.ROW_TYPES, path, f"line {i + 1}")
        missing = [k for k in verify.ROW_TYPES if k not in r]
        if missing:
            raise verify.VerifyFailed(f"line {i + 1} has no {', '.join(missing)}", file=path)
        rows[r["name"]] = r
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=497_000)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    spec = FixtureSpec(layers=a.layers + 1, experts=a.experts)  # layer 0 is dense: 61 MoE layers
    src_config = config(spec)
    listed = list(_tensors(spec))
    converted = sorted({n for n, _, k in listed if k == "packed"})
    plain = sorted(n[:-7] for n, _, k in listed if k == "bf16" and n.endswith(".weight"))
    source = compressed_tensors_source(src_config, "config.json")
    blocks = ckpt.quant_blocks(source.int4_config(src_config, converted, []))

    index = {"metadata": {"total_size": 1}, "weight_map": {f"t.{i}.weight_packed": f"model-{i % 96:05d}.safetensors"
                                                           for i in range(a.rows)}}
    table = [{"name": f"t.{i}.weight_packed", "rel_rmse": 0.1, "max_abs": 0.01, "groups": 9} for i in range(a.rows)]
    rows_fn = getattr(verify, "table_rows", old_rows)

    verify.selection._name_matcher()  # imports compressed-tensors (seconds, once a process): not timed
    t_index = cpu_seconds(lambda: verify.dst._typed(index, verify.INDEX_TYPES, "index.json"), a.repeats)
    t_rows = cpu_seconds(lambda: rows_fn(table, "k3convert_tensors.jsonl.zst"), a.repeats)
    t_sel = cpu_seconds(lambda: verify.selection_problems(blocks, converted, plain), a.repeats)
    assert verify.selection_problems(blocks, converted, plain) == []
    print(f"{a.rows} index entries: weight-map type check {t_index:.3f} s")
    print(f"{a.rows} table rows: per-row checks {t_rows:.3f} s")
    print(f"{len(converted)} converted + {len(plain)} bf16 modules: selection_problems {t_sel:.3f} s")


if __name__ == "__main__":
    main()
