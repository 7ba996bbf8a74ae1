"""Shared fixtures for the end-to-end, CLI and bad-input tests.

The source checkpoint is built ONCE per session, its MXFP4 tensors produced by
compressed-tensors' own MXFP4 compressor (not by converter.formats.mxfp4), and converted
ONCE per session; tests that mutate a checkpoint work on a copy (``src_copy``).
Decoding in the tests goes through compressed-tensors and safetensors, never through the
converter's own readers, unless a test compares the two on purpose.
"""
from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent / "support"))  # the helpers (support/__init__.py)

import hashlib
import json
import math
import os
import shutil
import struct
from dataclasses import dataclass, field

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors import MXFP4PackedCompressor
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
from safetensors import safe_open
from safetensors.torch import save_file

from converter.cli import main as cli_main
from converter.fixture import FixtureSpec, make_fixture
from converter.run.options import Options
from converter.run.pipeline import convert

# The command's --workers default is auto (several processes on a large machine); the tests that
# patch this process (a full disk, a failing read) need its one worker here, on any machine.
os.environ.setdefault("K3CONVERT_WORKERS", "1")

INDEX = "model.safetensors.index.json"
MANIFEST = "k3convert_manifest.json"
REPORT = "k3convert_report.json"
TABLE = "k3convert_tensors.jsonl.zst"

# Tiny but K3-shaped: layer 0 dense, layers 1..2 MoE; w1/w3 [64, 96], w2 [96, 64]
# (in-dims 96 and 64, both multiples of 32, out != in so transposes would show).
# Shard 0 holds no experts (a copy-only shard), shards 1 and 2 hold one MoE layer each.
SPEC = FixtureSpec(layers=3, experts=4, hidden=64, inter=64, latent=96, shards=3, vocab=64, seed=1234)

MXFP4_SCHEME = QuantizationScheme(targets=["Linear"], **MXFP4A16)


def ct_mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (packed uint8 [out, in/2], E8M0 uint8 [out, in/32]) by compressed-tensors.

    Scales come from compressed-tensors' MX observer rule (generate_mx_scales), values are
    quantized and packed by MXFP4PackedCompressor.compress (quantize -> pack_fp4_to_uint8,
    compress_mx_scale). Row 0's first group is zeroed so every tensor has an all-zero block.
    """
    rows, cols = w.shape
    w = w.clone()
    w[0, :32] = 0
    amax = w.reshape(rows, cols // 32, 32).abs().amax(-1)
    exps = generate_mx_scales(amax).clamp(0, 254).to(torch.uint8)  # all-zero block: -inf -> 0
    sd = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": decompress_mx_scale(exps)}, MXFP4_SCHEME)
    assert torch.equal(sd["weight_scale"], exps)  # compress_mx_scale round-trips the exponents
    return sd["weight_packed"], sd["weight_scale"]


def heavy_tailed(*shape: int) -> torch.Tensor:
    """float32 weights like a trained model's: Student-t (4 degrees of freedom) over sqrt(in)."""
    return torch.distributions.StudentT(4.0).sample(shape) / math.sqrt(shape[-1])


# ---------------------------------------------------------------- independent decoders

def mxfp4_unless_excluded(tensors: dict[str, torch.Tensor], exclude: list[str]) -> list[str]:
    """Make MXFP4 (X.weight + X.weight_scale, in place) every bf16 linear ``X.weight`` (``*_proj``) that
    none of Quark's ``exclude`` patterns (fnmatch, on the module name) matches, as a Quark template
    export quantizes every Linear it does not exclude. Returns those modules, sorted."""
    import fnmatch
    linears = sorted(n[: -len(".weight")] for n, t in tensors.items() if n.endswith("_proj.weight")
                     and t.dtype == torch.bfloat16 and t.dim() == 2
                     and not any(fnmatch.fnmatch(n[: -len(".weight")], p) for p in exclude))
    for m in linears:
        tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"] = ct_mxfp4_encode(tensors[f"{m}.weight"].float())
    return linears


def ct_mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float64 [out, in] with compressed-tensors' unpack_fp4_from_uint8/decompress_mx_scale."""
    rows, half = packed.shape
    v = unpack_fp4_from_uint8(packed, rows, half * 2, dtype=torch.float32).double()
    return v * decompress_mx_scale(scale).double().repeat_interleave(32, dim=1)


def ct_int4_q(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """int4 codes q in [-8, 7] (int8) with compressed-tensors' unpack_from_int32."""
    return unpack_from_int32(packed, 4, torch.Size(shape.tolist()))


def ct_int4_values(tensors: dict, module: str) -> torch.Tensor:
    """A converted module's int4 values q * scale (float64 [out, in]), decoded by compressed-tensors;
    ``tensors``: name -> (shard, tensor), as all_tensors returns."""
    q = ct_int4_q(tensors[f"{module}.weight_packed"][1], tensors[f"{module}.weight_shape"][1]).double()
    return q * tensors[f"{module}.weight_scale"][1].double().repeat_interleave(32, dim=1)


# ---------------------------------------------------------------- file helpers

def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def chunked_sha256(path: str, chunk: int = 64 << 20) -> str:
    """The manifest's shard digest, by its definition: SHA-256 of the SHA-256s of 64 MiB chunks."""
    digests = []
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block and digests:
                break
            digests.append(hashlib.sha256(block).digest())
            if len(block) < chunk:
                break
    return hashlib.sha256(b"".join(digests)).hexdigest()


def tree_hash(root: str) -> dict[str, str]:
    """relpath -> sha256 of every file under root (hidden ones included)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = sha256(p)
    return out


def shard_names(root: str) -> list[str]:
    return sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))


def raw_header(path: str) -> tuple[dict, int]:
    """The safetensors header JSON and where data starts, parsed here by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def load_shard(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def all_tensors(root: str) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (shard file, tensor) over every shard in root."""
    out = {}
    for s in shard_names(root):
        tensors, _ = load_shard(os.path.join(root, s))
        for k, v in tensors.items():
            assert k not in out, f"{k} in two shards"
            out[k] = (s, v)
    return out


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def rewrite_shard(path: str, edit) -> None:
    """Load a shard, let ``edit(tensors)`` change the dict in place, save it (metadata kept)."""
    tensors, meta = load_shard(path)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)


def sync_index(root: str) -> None:
    """Rewrite the index's weight_map and total_size from the shards actually there."""
    index = read_json(os.path.join(root, INDEX))
    wm, total = {}, 0
    for s in shard_names(root):
        tensors, _ = load_shard(os.path.join(root, s))
        for k, v in tensors.items():
            wm[k] = s
            total += v.numel() * v.element_size()
    index["weight_map"] = dict(sorted(wm.items()))
    index["metadata"]["total_size"] = total
    write_json(os.path.join(root, INDEX), index)


def expert_modules(root: str) -> dict[str, str]:
    """module -> shard file for every MXFP4 pair in a SOURCE checkpoint (from its index)."""
    wm = read_json(os.path.join(root, INDEX))["weight_map"]
    return {k[: -len(".weight_packed")]: s for k, s in wm.items() if k.endswith(".weight_packed")}


# ---------------------------------------------------------------- CLI helpers

def run_cli(*args: str):
    """Invoke the k3convert CLI in-process; returns click's Result (stdout, stderr split)."""
    return CliRunner().invoke(cli_main, [str(a) for a in args])


def assert_clean_error(result, *needles: str, code: int, one_line: bool = True) -> str:
    """Exit ``code``, no traceback, a 'k3convert: error:' message naming every needle."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), f"uncaught {result.exception!r}"
    err = result.stderr.strip()
    assert err.startswith("k3convert: error: "), err
    if one_line:
        assert "\n" not in err, f"error is not one line:\n{err}"
    assert "Traceback" not in result.output
    for n in needles:
        assert n in err, f"{n!r} not named in: {err}"
    return err


def assert_not_complete(dst: str) -> None:
    """Nothing in DST looks like a finished conversion."""
    if not os.path.exists(dst):
        return
    man = os.path.join(dst, MANIFEST)
    if os.path.exists(man):
        assert read_json(man).get("complete") is not True
    for f in (INDEX, "config.json", REPORT):
        assert not os.path.exists(os.path.join(dst, f)), f"{f} written to a failed DST"


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def fixture_src(tmp_path_factory) -> str:
    """The session's source checkpoint. Read-only by convention: mutate ``src_copy``."""
    path = str(tmp_path_factory.mktemp("fixture") / "kimi-k3-mini")
    make_fixture(path, SPEC, encoder=ct_mxfp4_encode)
    return path


@pytest.fixture
def src_copy(fixture_src, tmp_path) -> str:
    dst = str(tmp_path / "src")
    shutil.copytree(fixture_src, dst)
    return dst


@dataclass
class Converted:
    src: str
    dst: str
    summary: object
    events: list = field(default_factory=list)
    src_before: dict = field(default_factory=dict)
    src_after: dict = field(default_factory=dict)


@pytest.fixture(scope="session")
def converted(fixture_src, tmp_path_factory) -> Converted:
    """fixture_src converted once with the library entry point and default options."""
    dst = str(tmp_path_factory.mktemp("converted") / "kimi-k3-mini-int4")
    before = tree_hash(fixture_src)
    events: list = []
    summary = convert(fixture_src, dst, Options(), lambda kind, f: events.append((kind, f)))
    return Converted(fixture_src, dst, summary, events, before, tree_hash(fixture_src))


@pytest.fixture(scope="session")
def converted_default(tmp_path_factory):
    """(src, dst): the default K3-shaped fixture and its conversion, made once per session."""
    from converter.fixture import FixtureSpec, make_fixture
    from converter.run.options import Options
    from converter.run.pipeline import convert

    root = tmp_path_factory.mktemp("k3default")
    src, dst = str(root / "src"), str(root / "dst")
    make_fixture(src, FixtureSpec())
    convert(src, dst, Options())
    return src, dst


# --------------------------------------------------------------------------- other MoE models

def converted_model(tmp_path_factory, name: str, write) -> tuple[str, str]:
    """(src, dst): a model fixture written by ``write(src)`` and converted with default options."""
    root = tmp_path_factory.mktemp(name)
    src, dst = str(root / "src"), str(root / "dst")
    write(src)
    convert(src, dst, Options())
    return src, dst


def with_config(src: str, root: str, edit) -> str:
    """A copy of checkpoint ``src`` under ``root`` whose config.json ``edit(cfg)`` changed."""
    out = os.path.join(root, "edited")
    shutil.copytree(src, out)
    cfg = read_json(os.path.join(out, "config.json"))
    edit(cfg)
    write_json(os.path.join(out, "config.json"), cfg)
    return out


def assert_verified_and_on_triton(src: str, dst: str, servers: tuple[str, ...] = (), activation: str = "silu") -> None:
    """verify --source passes; stock vLLM 0.33 on gfx942 takes the experts with TRITON and ``activation``;
    and each of ``servers`` passes too."""
    import serving_rules as serving

    from converter.verify import verify

    result = verify(dst, src)
    assert result.ok, [p for c in result.checks for p in c.problems]
    rocm = {r.rule: r for r in serving.rules(dst, "vllm-rocm", 1)}
    assert all(r.ok for r in rocm.values()), [r.message for r in rocm.values() if not r.ok]
    assert f"TRITON (TritonWNA16Experts), {activation};" in rocm["kernel"].message
    for server in servers:
        assert all(r.ok for r in serving.rules(dst, server, 1)), server


def assert_missing_module_named(src: str, shard: str, module: str, suffixes: tuple[str, ...], expected: int,
                                dst: str) -> None:
    """Remove ``module``'s tensors (``module + suffix``) from ``shard`` of ``src``: converting to ``dst``
    then fails in preflight, the profile's inventory naming the missing module."""
    import re

    from safetensors.torch import load_file

    from converter.errors import BadInput

    path = os.path.join(src, shard)
    tensors = load_file(path)
    for suffix in suffixes:
        del tensors[module + suffix]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(BadInput, match=rf"expected {expected} expert matrices, found {expected - 1}: "
                                       rf"missing {re.escape(module)}"):
        convert(src, dst, Options())
