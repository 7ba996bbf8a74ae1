"""Our safetensors header reader against the safetensors library's own (0.8, ``safe_open``).

Every malformed file below is refused by both: by ours with one line naming the file and, when
one is at fault, the tensor; by the library when it opens the file or loads a tensor. Files the
library accepts (zero-size tensors sharing an offset, padded headers, any JSON order, unknown
keys in an entry, ...) we accept too, with the offsets it uses. The few files ours refuses and
the library takes are listed, with why, in STRICTER. Each row names what each reader says.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converter.errors import BadInput
from converter.formats.safetensors_io import read_header
from tests.conftest import tensor_bytes

LIB_MAX_HEADER = 100_000_000  # safetensors/src/tensor.rs MAX_HEADER_SIZE, not our constant
NO_TORCH_DTYPE = {"F6_E2M3", "F6_E3M2"}  # valid in a header; safe_open(framework="pt") cannot load them


def pattern(n: int) -> bytes:
    """Data bytes that differ from place to place, so a wrong offset reads different bytes."""
    return bytes(i * 7 % 251 for i in range(n))


def st(header: str | bytes | dict, data: int | bytes = 0, n: int | None = None) -> bytes:
    """A safetensors file by hand: the 8-byte length (``n``, else the real one), the header
    (JSON text as is, or a dict to dump), then ``data`` (bytes, or a count of pattern bytes)."""
    if isinstance(header, dict):
        header = json.dumps(header)
    raw = header.encode() if isinstance(header, str) else header
    body = data if isinstance(data, bytes) else pattern(data)
    return struct.pack("<Q", len(raw) if n is None else n) + raw + body


def e(dtype: object = "U8", shape: object = (4,), off: object = (0, 4), **extra: object) -> dict:
    """One header entry."""
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(off) if isinstance(off, tuple) else off, **extra}


def j(name: str, entry: dict | None = None) -> str:
    """``"name": entry`` as JSON text, to write headers a dict cannot hold (a name twice)."""
    return f"{json.dumps(name)}:{json.dumps(entry or e())}"


def nested(depth: int) -> list:
    x: list = []
    for _ in range(depth - 1):
        x = [x]
    return x


def load_all(path: str) -> dict[str, tuple[str, tuple[int, ...], bytes | None]]:
    """What safe_open makes of the file: name -> (dtype, shape, bytes), loading every tensor
    (bytes None for a dtype torch lacks, after checking that loading it fails)."""
    out = {}
    with safe_open(path, framework="pt") as f:
        for k in f.keys():
            s = f.get_slice(k)
            dtype, shape = s.get_dtype(), tuple(s.get_shape())
            if dtype in NO_TORCH_DTYPE:
                with pytest.raises(Exception, match="Dtype not understood"):
                    f.get_tensor(k)
                out[k] = (dtype, shape, None)
            else:
                out[k] = (dtype, shape, tensor_bytes(f.get_tensor(k)))
        out["__metadata__"] = f.metadata() or {}
    return out


def assert_readers_agree(path: str) -> None:
    """Both readers accept the file and see the same tensors; ours' offsets hold the bytes the
    library loads."""
    lib = load_all(path)
    ours = read_header(path)
    assert ours.metadata == lib.pop("__metadata__")
    assert set(ours.tensors) == set(lib)
    with open(path, "rb") as f:
        data = f.read()
    assert ours.file_size == len(data)
    for name, (dtype, shape, raw) in lib.items():
        t = ours.tensors[name]
        assert (t.name, t.dtype, t.shape, t.path) == (name, dtype, shape, path)
        assert ours.data_start <= t.start <= t.end <= len(data)
        if raw is not None:
            assert data[t.start:t.end] == raw, name


@dataclass(frozen=True)
class Bad:
    id: str
    file: bytes
    tensor: str | None  # as our message shows it; None: the file as a whole is at fault
    ours: str           # in our message
    lib: str            # in safe_open's error (on opening, or on get_tensor where noted)
    size: int = 0       # extend the file (sparse) to this size


U32 = 1 << 32
REFUSED = [
    # ---- the header is not a JSON object
    Bad("header-array", st("[]"), None, "header is a JSON array, not an object", "expected struct HashMetadata"),
    Bad("header-string", st('"x"'), None, "header is a JSON string", "expected struct HashMetadata"),
    Bad("header-number", st("1"), None, "header is a JSON number", "expected struct HashMetadata"),
    Bad("header-null", st("null"), None, "header is a JSON null", "expected struct HashMetadata"),
    Bad("header-empty", st(""), None, "corrupt header JSON", "EOF while parsing"),
    Bad("json-cut", st('{"a":'), None, "corrupt header JSON", "EOF while parsing"),
    Bad("json-trailing-comma", st("{%s,}" % j("a"), 4), None, "corrupt header JSON", "trailing comma"),
    Bad("json-two-values", st("{}{}"), None, "corrupt header JSON", "trailing characters"),
    Bad("json-nul-padding", st("{%s}\0\0" % j("a"), 4), None, "corrupt header JSON", "trailing characters"),
    Bad("json-nan", st('{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,4]}}', 4), None,
        "NaN is not JSON", "expected value"),
    Bad("json-1e400-in-unknown-key", st('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1e400}}', 4),
        None, "number out of range", "number out of range"),
    Bad("json-control-char", st('{"a\tb":%s}' % json.dumps(e()), 4), None, "corrupt header JSON", "control character"),
    Bad("invalid-utf8", st(b'{"\xff":' + json.dumps(e()).encode() + b"}", 4), None, "corrupt header JSON",
        "invalid UTF-8"),
    Bad("utf8-bom", st("\ufeff{%s}" % j("a"), 4), None, "BOM", "expected value"),
    Bad("lone-surrogate-in-name", st('{"\\ud800":%s}' % json.dumps(e()), 4), None, "surrogates not allowed",
        "hex escape"),
    Bad("lone-surrogate-in-metadata", st('{"__metadata__":{"k":"\\udc00"},%s}' % j("a"), 4), None,
        "surrogates not allowed", "lone leading surrogate"),
    # ---- the 8-byte length
    Bad("shorter-than-8-bytes", b"\x10\0\0\0", None, "shorter than a safetensors header", "header too small"),
    Bad("header-length-past-eof", st("{}", n=100), None, "does not fit a file of 10 bytes", "invalid header length"),
    Bad("header-over-limit", st("{}", n=LIB_MAX_HEADER + 1), None, "over the safetensors limit", "header too large"),
    # a length between 10^8 and 100 MiB, in a file that long: only the limit refuses it
    Bad("header-over-limit-in-file", st("{}", n=LIB_MAX_HEADER + 1), None, "over the safetensors limit",
        "header too large", size=8 + LIB_MAX_HEADER + 1),
    # ---- data_offsets against each other and the file
    Bad("overlap", st({"a": e(shape=(8,), off=(0, 8)), "b": e(shape=(8,), off=(4, 12))}, 12), "b",
        "data_offsets 4..12 overlap those of tensor a", "invalid offset for tensor `b`"),
    Bad("same-offsets", st({"a": e(), "b": e()}, 4), "b", "overlap those of tensor a",
        "invalid offset for tensor"),  # which of the two it names varies from run to run
    Bad("zero-size-inside-another", st({"a": e(shape=(8,), off=(0, 8)), "z": e(shape=(0,), off=(4, 4))}, 8),
        "z", "overlap those of tensor a", "invalid offset for tensor `z`"),
    Bad("hole", st({"a": e(), "b": e(off=(8, 12))}, 12), "b", "hole of 4 bytes (tensor a ends at 4)",
        "invalid offset for tensor `b`"),
    Bad("data-not-from-0", st({"a": e(off=(4, 8))}, 8), "a", "hole of 4 bytes (data starts at offset 0)",
        "invalid offset for tensor `a`"),
    Bad("past-eof", st({"a": e(), "b": e(off=(4, 8))}, 6), "b", "data ends at byte", "incomplete metadata"),
    Bad("far-past-eof", st({"a": e(off=(1 << 40, (1 << 40) + 4))}, 4), "a", "hole", "invalid offset for tensor `a`"),
    Bad("trailing-bytes", st({"a": e()}, 5), "a", "1 byte(s) follow the last tensor's data", "incomplete metadata"),
    Bad("trailing-bytes-no-tensor", st({}, 3), None, "3 byte(s) follow", "incomplete metadata"),
    Bad("begin-after-end", st({"a": e(shape=(0,), off=(4, 0)), "b": e()}, 4), "a", "end before they begin",
        "invalid offset for tensor `a`"),
    Bad("size-not-shape", st({"a": e(off=(0, 5))}, 5), "a", "hold 5 bytes, U8[4] needs 4",
        "invalid shape, data type, or offset"),
    Bad("size-not-dtype", st({"a": e("BF16")}, 4), "a", "needs 8", "invalid shape, data type, or offset"),
    Bad("f4-half-byte", st({"a": e("F4", (3,), (0, 2))}, 2), "a", "not a whole number of bytes", "subbytes"),
    # ---- a name twice: the library keeps the last entry; each file is built so that this
    # leaves its offsets broken (a consistent duplicate it accepts: see STRICTER)
    Bad("name-twice-leaves-hole", st("{%s,%s}" % (j("a"), j("a", e(off=(4, 8)))), 8), "a",
        "the header names this tensor twice", "invalid offset for tensor `a`"),
    Bad("name-twice-leaves-tail",
        st("{%s,%s,%s}" % (j("b"), j("a", e(off=(4, 8))), j("a", e(shape=(0,), off=(4, 4)))), 8),
        "a", "the header names this tensor twice", "incomplete metadata"),
    Bad("metadata-twice", st('{"__metadata__":{},"__metadata__":{},%s}' % j("a"), 4), None,
        "two __metadata__", "duplicate field `__metadata__`"),
    Bad("field-twice", st('{"a":{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}}', 4), "a",
        "header entry names 'dtype' twice", "duplicate field `dtype`"),
    # ---- one entry
    Bad("entry-null", st({"a": None}), "a", "header entry is None, not an object", "expected struct TensorInfo"),
    Bad("entry-string", st({"a": "U8"}), "a", "not an object", "expected struct TensorInfo"),
    Bad("entry-missing-dtype", st({"a": {"shape": [4], "data_offsets": [0, 4]}}, 4), "a", "lacks dtype",
        "missing field `dtype`"),
    Bad("entry-missing-shape", st({"a": {"dtype": "U8", "data_offsets": [0, 4]}}, 4), "a", "lacks shape",
        "missing field `shape`"),
    Bad("entry-missing-offsets", st({"a": {"dtype": "U8", "shape": [4]}}, 4), "a", "lacks data_offsets",
        "missing field `data_offsets`"),
    Bad("entry-unknown-key-too-deep", st({"a": e(x=nested(126))}, 4), "a", "nested deeper than 127",
        "recursion limit exceeded"),
    Bad("dtype-unknown", st({"a": e("Q4")}, 4), "a", "unknown dtype 'Q4'", "unknown variant `Q4`"),
    Bad("dtype-lowercase", st({"a": e("u8")}, 4), "a", "unknown dtype 'u8'", "unknown variant `u8`"),
    Bad("dtype-null", st({"a": e(None)}, 4), "a", "unknown dtype None", "invalid type: null"),
    Bad("shape-negative", st({"a": e(shape=(-4,))}, 4), "a", "shape [-4] is not", "invalid value: integer `-4`"),
    Bad("shape-float", st('{"a":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}}', 4), "a", "shape [4.0] is not",
        "invalid type: floating point `4.0`"),
    Bad("shape-exponent", st('{"a":{"dtype":"U8","shape":[4e0],"data_offsets":[0,4]}}', 4), "a", "shape [4.0] is not",
        "invalid type: floating point `4.0`"),
    Bad("shape-minus-zero", st('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'), "a", "is not a list of",
        "invalid type: floating point `-0.0`"),
    Bad("shape-bool", st({"a": e(shape=[True], off=(0, 1))}, 1), "a", "shape [True] is not", "invalid type: boolean"),
    Bad("shape-string", st({"a": e(shape=["4"])}, 4), "a", "shape ['4'] is not", "invalid type: string"),
    Bad("shape-not-a-list", st({"a": e(shape=4)}, 4), "a", "shape 4 is not", "expected a sequence"),
    Bad("shape-over-64-bits", st({"a": e(shape=(1 << 64, 0), off=(0, 0))}), "a", "is not a list of integers",
        "invalid type: floating point"),
    Bad("shape-overflow", st({"a": e(shape=(U32, U32), off=(0, 0))}), "a", "overflows 64 bits",
        "overflow computing buffer size"),
    Bad("shape-overflow-before-0", st({"a": e(shape=(U32, U32, 0), off=(0, 0))}), "a", "overflows 64 bits",
        "overflow computing buffer size"),
    Bad("shape-bits-overflow", st({"a": e("U64", (1 << 61,), (0, 0))}), "a", "overflows 64 bits",
        "overflow computing buffer size"),
    # the library opens this one; torch's int64 sizes cannot hold the dimension (get_tensor)
    Bad("shape-dim-over-int64", st({"a": e(shape=((1 << 64) - 1, 0), off=(0, 0))}), "a", "0..2^63-1",
        "Overflow when unpacking long long"),
    Bad("offsets-three", st({"a": e(off=(0, 4, 4))}, 4), "a", "not two integers", "invalid length 3"),
    Bad("offsets-float", st('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4.0]}}', 4), "a", "not two integers",
        "invalid type: floating point `4.0`"),
    Bad("offsets-negative", st({"a": e(shape=(0,), off=(-4, -4))}), "a", "not two integers",
        "invalid value: integer `-4`"),
    Bad("offsets-object", st({"a": e(off={"0": 0, "1": 4})}, 4), "a", "not two integers",
        "expected a tuple of size 2"),
    # ---- __metadata__
    Bad("metadata-number-value", st({"__metadata__": {"k": 1}, "a": e()}, 4), None,
        "__metadata__ is not a map of strings to strings", "expected a string"),
    Bad("metadata-nested", st({"__metadata__": {"k": {"x": "y"}}, "a": e()}, 4), None, "__metadata__ is not",
        "expected a string"),
    Bad("metadata-list", st({"__metadata__": [], "a": e()}, 4), None, "__metadata__ is not", "expected a map"),
    Bad("metadata-string", st({"__metadata__": "x", "a": e()}, 4), None, "__metadata__ is not", "expected a map"),
    # ---- our message stays one line, and names even a name that prints badly
    Bad("name-with-newline", st({"a\nb": e(off=(0, 5))}, 5), "'a\\nb'", "hold 5 bytes",
        "invalid shape, data type, or offset"),
    Bad("name-empty", st({"": e(off=(0, 5))}, 5), "''", "hold 5 bytes", "invalid shape, data type, or offset"),
]


def write(tmp_path, data: bytes, size: int = 0) -> str:
    path = str(tmp_path / "model.safetensors")
    with open(path, "wb") as f:
        f.write(data)
    if size:
        os.truncate(path, size)
    return path


@pytest.mark.parametrize("case", REFUSED, ids=[c.id for c in REFUSED])
def test_refused_by_both(tmp_path, case: Bad):
    path = write(tmp_path, case.file, case.size)
    with pytest.raises(BadInput) as ei:
        read_header(path)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert (ei.value.file, ei.value.tensor) == (path, case.tensor), msg
    prefix = f"file {path}" + (f", tensor {case.tensor}: " if case.tensor is not None else ": ")
    assert msg.startswith(prefix), msg
    assert case.ours in msg, msg
    with pytest.raises(Exception, match=re.escape(case.lib)):
        load_all(path)


@dataclass(frozen=True)
class Strict:
    id: str
    file: bytes
    tensor: str | None
    ours: str
    why: str  # why we refuse what the library takes


STRICTER = [
    Strict("name-twice-identical", st("{%s,%s}" % (j("a"), j("a")), 4), "a", "names this tensor twice",
           "the library keeps the last entry silently: which one the writer meant is unknown"),
    Strict("name-twice-consistent", st("{%s,%s}" % (j("a", e(off=(4, 8))), j("a")), 4), "a", "names this tensor twice",
           "the last entry alone tiles the data, so the library keeps it and forgets the first"),
    Strict("metadata-key-twice", st('{"__metadata__":{"k":"1","k":"2"},%s}' % j("a"), 4), None, "names 'k' twice",
           "the library keeps the last value"),
    Strict("entry-as-array", st('{"a":["U8",[4],[0,4]]}', 4), "a", "not an object",
           "serde reads a struct from an array in field order; no writer produces it"),
    Strict("dtype-as-object", st('{"a":{"dtype":{"U8":null},"shape":[4],"data_offsets":[0,4]}}', 4), "a",
           "unknown dtype", "serde reads a unit enum variant from {name: null}; no writer produces it"),
]


@pytest.mark.parametrize("case", STRICTER, ids=[c.id for c in STRICTER])
def test_refused_by_ours_only(tmp_path, case: Strict):
    path = write(tmp_path, case.file)
    load_all(path)  # the library accepts it: if that changes, move the case to REFUSED
    with pytest.raises(BadInput) as ei:
        read_header(path)
    assert (ei.value.file, ei.value.tensor) == (path, case.tensor)
    assert case.ours in str(ei.value) and "\n" not in str(ei.value)


ACCEPTED = {
    "no-tensors": st("{}"),
    "metadata-only": st({"__metadata__": {"format": "pt"}}),
    "metadata-null": st({"__metadata__": None, "a": e()}, 4),
    "metadata-empty": st({"__metadata__": {}, "a": e()}, 4),
    "zero-size-sharing-offsets": st({"z0": e(shape=(0,), off=(0, 0)), "a": e(), "z1": e(shape=(0, 5), off=(4, 4)),
                                     "z2": e("BF16", (3, 0), (4, 4)), "b": e(off=(4, 8)),
                                     "z3": e(shape=(0,), off=(8, 8))}, 8),
    "zero-size-huge-dims": st({"a": e(shape=(0, (1 << 63) - 1), off=(0, 0))}),
    "header-padded-with-spaces": st("{%s}       " % j("a"), 4),
    "header-padded-with-whitespace": st("\n\t {%s}\r\n " % j("a"), 4),
    "any-json-order": st({"c": e(off=(8, 12)), "a": e(), "b": e(off=(4, 8))}, 12),
    "unknown-keys-in-entry": st({"a": e(x=1, y=[1.5, "s", None], z=nested(125), big=10 ** 30)}, 4),
    "name-unusual": st({"": e(), "a\nb": e(off=(4, 8)), "é\u4e2d": e(off=(8, 12))}, 12),
    "name-escapes": st('{"a\\u0062":%s,"\\ud83d\\ude00":%s}' % (json.dumps(e()), json.dumps(e(off=(4, 8)))), 8),
    "scalar-and-rare-dtypes": st({"s": e("F32", (), (0, 4)), "c": e("C64", (1,), (4, 12)),
                                  "b": e("BOOL", (2,), (12, 14)), "f8": e("F8_E4M3FNUZ", (2,), (14, 16)),
                                  "e8": e("F8_E8M0", (2,), (16, 18))}, 18),
    "sub-byte-dtypes": st({"f4": e("F4", (2, 4), (0, 4)), "f6a": e("F6_E2M3", (4,), (4, 7)),
                           "f6b": e("F6_E3M2", (2, 4), (7, 13))}, 13),
}


@pytest.mark.parametrize("data", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted_by_both(tmp_path, data: bytes):
    assert_readers_agree(write(tmp_path, data))


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w.bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "w.f32": torch.randn(7, generator=g),
        "w.f16": torch.randn(2, 2, generator=g).half(),
        "w.u8": torch.randint(0, 256, (4, 9), generator=g, dtype=torch.uint8),
        "w.i32": torch.randint(-2**31, 2**31 - 1, (6,), generator=g, dtype=torch.int32),
        "w.i64": torch.randint(-2**62, 2**62, (2, 3), generator=g, dtype=torch.int64),
        "w.bool": torch.randint(0, 2, (5,), generator=g).bool(),
        "w.f8": torch.randn(11, generator=g).to(torch.float8_e4m3fn),
        "w.scalar": torch.tensor(3.5),
        "empty.a": torch.zeros(0, 4),
        "empty.b": torch.zeros(3, 0, dtype=torch.bfloat16),
        "empty.c": torch.zeros(0, dtype=torch.int64),
    }


@pytest.mark.parametrize("metadata", [None, {"format": "pt", "note": "x"}], ids=["no-metadata", "metadata"])
def test_save_file_output_read_like_safe_open(tmp_path, metadata):
    """Files the library writes (header padded to 8 bytes, zero-size tensors sharing offsets)."""
    path = str(tmp_path / "a.safetensors")
    save_file(_tensors(0), path, metadata=metadata)
    assert_readers_agree(path)


def test_many_tensors(tmp_path):
    """A shard-sized header: thousands of tensors, offsets still those of the library."""
    path = str(tmp_path / "many.safetensors")
    tensors = {f"model.layers.{i // 64}.mlp.experts.{i % 64}.w": torch.full((i % 5, 3), i, dtype=torch.int16)
               for i in range(5000)}
    save_file(tensors, path)
    assert_readers_agree(path)
