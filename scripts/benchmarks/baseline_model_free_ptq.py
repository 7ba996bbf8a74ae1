#!/usr/bin/env python3
"""Baseline: convert an MXFP4 checkpoint to int4 W4A16 g32 the way a user can today.

Why: k3convert is benchmarked against this path (wall time, peak RSS, error). It is
llm-compressor's ``model_free_ptq`` chained after compressed-tensors'
``CompressedTensorsDequantizer``, i.e. MXFP4 -> bf16 -> RTN int4 (scale = absmax/7.5
per group of 32, static_minmax observer) -> compressed-tensors ``pack-quantized``.

Tested with llmcompressor 0.14.0.1, which pins compressed-tensors==0.19.0 and
transformers<=5.17; install it in its own venv so the project's env is untouched:
    python -m venv --system-site-packages /tmp/llmc_venv   # reuses torch 2.13.0+cpu
    /tmp/llmc_venv/bin/pip install llmcompressor==0.14.0.1
    /tmp/llmc_venv/bin/python scripts/benchmarks/baseline_model_free_ptq.py SRC DST --workers 2

Library code (all tensor work): shard reading, the MXFP4 decode
(``CompressedTensorsDequantizer`` -> ``MXFP4PackedCompressor.decompress``), observer,
int4 quantization and int32 packing (``ModelFreePtqConverter`` -> ``compress_module``),
shard/index writing and the top-level ``quantization_config`` (``model_free_ptq``).
Glue (this file, no tensor math): argparse; the W4A16 preset with group_size 32; the
ignore list; a pre-flight name check that only routed experts will be quantized.

Why the ignore list is longer than the source's: model_free_ptq matches tensor *names*
(target "Linear" means every ``*.weight`` except ``*norm``), so non-Linear weights the
source list never needed to name (embeddings, the MoE router ``gate``) must be ignored
explicitly or they get quantized.

Caveats (library behaviour, kept as-is so the baseline stays faithful):
- A config with ``text_config.quantization_config`` (Kimi K3) is left stale: the
  library writes a new top-level ``quantization_config`` but the nested one still
  says mxfp4-pack-quantized.
- Each worker loads a whole shard and dequantizes every expert in it to bf16 (4x the
  packed bytes) before writing, so peak RSS grows with shard size x workers.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
from compressed_tensors.utils import match_quantizable_tensors
from compressed_tensors.utils.safetensors_load import get_quantization_config
from llmcompressor.entrypoints.model_free import model_free_ptq

EXPERT_RE = re.compile(r".*\.experts\.\d+\.(w[123]|gate_proj|up_proj|down_proj)$")  # routed experts only
EXTRA_IGNORE = [  # module-name regexes; ``*norm`` modules are skipped by the library
    r"re:.*self_attn.*",
    r"re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*lm_head.*",
    r"re:.*embed_tokens.*",
    r"re:.*block_sparse_moe\.gate$",
    r"re:.*vision_tower.*",
    r"re:.*mm_projector.*",
]


def build_scheme() -> QuantizationScheme:
    """The library's W4A16 preset (int4, symmetric, group, static) at group_size 32."""
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights = scheme.weights.model_copy(update={"group_size": 32})
    return scheme


def build_ignore(src: Path) -> list[str]:
    """The source's own ignore list (top-level or text_config) plus EXTRA_IGNORE."""
    qcfg = get_quantization_config(str(src / "config.json")) or {}
    ignore = list(qcfg.get("ignore") or [])
    return ignore + [r for r in EXTRA_IGNORE if r not in ignore]


def check_targets(src: Path, ignore: list[str]) -> int:
    """Fail before any work if a non-expert weight would be quantized."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text())["weight_map"]
    else:
        from safetensors import safe_open

        names = {}
        for f in src.glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                names.update(dict.fromkeys(fh.keys()))
    targeted = [m for m, _ in match_quantizable_tensors(
        names, ignore, ["Linear"], param_targets=["weight", "weight_packed"])]
    stray = sorted(m for m in targeted if not EXPERT_RE.match(m))
    if stray:
        raise SystemExit(f"would quantize {len(stray)} non-expert weights, e.g. "
                         f"{stray[:5]}; extend EXTRA_IGNORE")
    return len(targeted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="MXFP4 compressed-tensors checkpoint dir")
    ap.add_argument("dst", type=Path, help="output dir (int4 pack-quantized)")
    ap.add_argument("--workers", type=int, default=1, help="concurrent shard jobs")
    args = ap.parse_args()

    ignore = build_ignore(args.src)
    n = check_targets(args.src, ignore)
    print(f"quantizing {n} routed-expert matrices; ignore={ignore}")

    t0 = time.perf_counter()
    model_free_ptq(
        model_stub=args.src,
        save_directory=args.dst,
        scheme=build_scheme(),
        ignore=ignore,
        max_workers=args.workers,
        device="cpu",
        converter=CompressedTensorsDequantizer(args.src, dtype=torch.bfloat16),
    )
    print(f"done in {time.perf_counter() - t0:.1f}s -> {args.dst}")


if __name__ == "__main__":
    main()
