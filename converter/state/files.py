"""The names of the files k3convert writes in DST beside the shards."""
from __future__ import annotations

MANIFEST = "k3convert_manifest.json"
REPORT = "k3convert_report.json"            # per-layer error summary, written by finalize
TENSOR_TABLE = "k3convert_tensors.jsonl.zst"  # every converted tensor's figures
STATE_DIR = ".k3convert"  # per-shard figure tables and the lock, inside DST
