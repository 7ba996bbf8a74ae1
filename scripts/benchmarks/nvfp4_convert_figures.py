"""Error figures of NVFP4 conversions, from each DST's own figure table (k3convert_tensors.jsonl.zst):
per-tensor relative RMSE against the FP4 values, ours (``rel_rmse``) and the server's load-time rule
(``cmp_rel_rmse``), means over the tensors and their ratio (as the report's "x our error").

    PYTHONPATH=. python scripts/benchmarks/nvfp4_convert_figures.py DST [DST ...]
"""
from __future__ import annotations

import json
import os
import sys

from converter.state.records import read_rows


def main(dsts: list[str]) -> None:
    for dst in dsts:
        rows = list(read_rows(os.path.join(dst, "k3convert_tensors.jsonl.zst")))
        with open(os.path.join(dst, "k3convert_manifest.json")) as f:
            fmt = json.load(f)["source_format"]
        ours = sum(r["rel_rmse"] for r in rows) / len(rows)
        server = sum(r["cmp_rel_rmse"] for r in rows) / len(rows)
        print(f"{dst}: {fmt}, {len(rows)} tensors, ours {ours:.4f} (worst {max(r['rel_rmse'] for r in rows):.4f}), "
              f"server rule {server:.4f}, {server / ours:.3f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
