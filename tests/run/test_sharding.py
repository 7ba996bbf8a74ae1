"""Checkpoints sharded by code we did not write (issue 8 §1, §2).

Each source here is a small K3-shaped model whose routed experts were packed by
compressed-tensors' MXFP4 compressor (conftest.ct_mxfp4_encode), sharded by
huggingface_hub.split_torch_state_dict_into_shards (the real library and its size rule),
written with safetensors.torch.save_file, and indexed as huggingface_hub documents. The state
dict orders and size limits are chosen so that the library cuts where each case needs, and
every case first asserts, from the library's own index, that the cut really is there:

  a) packed in shard k, its scale in shard k+1 (compressed-tensors' own tensor order);
  b) scale first: a module's scale in shard k, its packed tensor in shard k+1;
  c) distance > 1: packed and scale two or more shards apart, non-expert tensors between;
  d) non-expert tensors larger than max_shard_size, each in a shard of its own;
  e) one model.safetensors, no index.

Each converts to the same tensors, byte for byte, as the same model sharded with every
module's tensors kept together. Outputs are read by name with safetensors.safe_open, never
with converter code. Job arrays, resume, source-change detection, --dry-run and the
partner-read-by-offset rule are checked on the straddled sources.
"""
from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from compressed_tensors.compressors import MXFP4PackedCompressor
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

import converter.run.shard as shard_mod
from converter.errors import Interrupted, OutputError
from converter.fixture import FixtureSpec, config as k3_config
from converter.inspect import inspect_path
from converter.run.options import Options
from converter.run.pipeline import convert
from tests.conftest import (
    INDEX,
    MANIFEST,
    MXFP4_SCHEME,
    REPORT,
    assert_clean_error,
    assert_not_complete,
    ct_mxfp4_encode,
    raw_header,
    read_json,
    rewrite_shard,
    run_cli,
    shard_names,
    tensor_bytes,
    tree_hash,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]
STATE = ".k3convert"
PREFIX = "language_model.model"
# compressed-tensors' own order of a module's compressed tensors: ("weight_packed", "weight_scale")
PAIR = MXFP4PackedCompressor.compression_param_names(MXFP4_SCHEME)
PACKED, SCALE = (f".{p}" for p in PAIR)
SHAPE = ".weight_shape"

# Layer 0 dense, layers 1-2 MoE, 4 experts: w1/w3 [64, 96], w2 [96, 64] (packed 3072 B, scale
# 192 B). Non-expert tensors are larger: embed and lm_head [256, 32] bf16 (16 KiB), each shared
# expert projection [128, 32] (8 KiB), attention [32, 32] (2 KiB).
SPEC = FixtureSpec(layers=3, experts=4, hidden=32, inter=64, latent=96, vocab=256, seed=8)
SHARED_INTER = 128
MODULES = (SPEC.layers - 1) * SPEC.experts * 3


# ------------------------------------------------------------------------------ the model

def k3_state_dict(spec: FixtureSpec, shared_inter: int, seed: int) -> dict[str, torch.Tensor]:
    """Tensors in module registration order, each routed expert as compressed-tensors packs it.

    Every tensor owns its storage: huggingface_hub sizes a tensor by its storage."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, lat = spec.hidden, spec.inter, spec.latent

    def bf16(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16)

    sd = {f"{PREFIX}.embed_tokens.weight": bf16(spec.vocab, h)}
    for layer in range(spec.layers):
        p = f"{PREFIX}.layers.{layer}"
        sd[f"{p}.input_layernorm.weight"] = bf16(1, h)[0].clone()
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}.self_attn.{proj}.weight"] = bf16(h, h)
        mlp = ((inter, h), (inter, h), (h, inter))
        if layer == 0:
            for proj, shape in zip(("gate_proj", "up_proj", "down_proj"), mlp):
                sd[f"{p}.mlp.{proj}.weight"] = bf16(*shape)
            continue
        m = f"{p}.block_sparse_moe"
        sd[f"{m}.gate.weight"] = bf16(spec.experts, h)
        for e in range(spec.experts):
            for w, shape in (("w1", (inter, lat)), ("w2", (lat, inter)), ("w3", (inter, lat))):
                packed, scale = ct_mxfp4_encode(torch.randn(*shape, generator=gen) * 0.02)
                sd[f"{m}.experts.{e}.{w}{PACKED}"] = packed.clone()
                sd[f"{m}.experts.{e}.{w}{SCALE}"] = scale.clone()
        shared = ((shared_inter, h), (shared_inter, h), (h, shared_inter))
        for proj, shape in zip(("gate_proj", "up_proj", "down_proj"), shared):
            sd[f"{m}.shared_experts.{proj}.weight"] = bf16(*shape)
    sd[f"{PREFIX}.norm.weight"] = bf16(1, h)[0].clone()
    sd["language_model.lm_head.weight"] = bf16(spec.vocab, h)
    return sd


def modules_of(names) -> list[str]:
    return [n[: -len(PACKED)] for n in names if n.endswith(PACKED)]


def natural(sd: dict) -> dict:
    return dict(sd)


def scale_first(sd: dict) -> dict:
    """Every module's scale right before its packed tensor."""
    out = {}
    for k, v in sd.items():
        if k.endswith(PACKED):
            out[k[: -len(PACKED)] + SCALE] = sd[k[: -len(PACKED)] + SCALE]
        if k not in out:
            out[k] = v
    return out


def runs(sd: dict) -> dict:
    """Per MoE layer, the experts' packed tensors in one run and their scales in another, with
    the shared experts between: packed run first in odd layers, scale run first in even ones."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"(.*\.layers\.(\d+)\.block_sparse_moe)\.experts\.", k)
        if k in out:
            continue
        if not m:
            out[k] = v
            continue
        layer = m.group(1)
        packed = [n for n in sd if n.startswith(layer + ".experts.") and n.endswith(PACKED)]
        scales = [n for n in sd if n.startswith(layer + ".experts.") and n.endswith(SCALE)]
        shared = [n for n in sd if n.startswith(layer + ".shared_experts.")]
        first, second = (packed, scales) if int(m.group(2)) % 2 else (scales, packed)
        for n in first + shared + second:
            out[n] = sd[n]
    return out


# ------------------------------------------------------------------------------ sharded sources

@dataclass(frozen=True)
class Source:
    """A checkpoint as huggingface_hub split it: where each tensor went, by its index."""

    path: str
    weight_map: dict[str, str]  # tensor -> shard file (split.tensor_to_filename)
    max_shard_size: int | str

    @property
    def files(self) -> list[str]:
        """Shard files in name order (the order of --shards and --part)."""
        return sorted(set(self.weight_map.values()))

    def no(self, shard: str) -> int:
        """1-based position of a shard in name order."""
        return self.files.index(shard) + 1

    def straddled(self) -> dict[str, tuple[str, str]]:
        """module -> (packed shard, scale shard), for modules whose two tensors are apart."""
        wm = self.weight_map
        pairs = {m: (wm[m + PACKED], wm[m + SCALE]) for m in modules_of(wm)}
        return {m: ps for m, ps in pairs.items() if ps[0] != ps[1]}

    def partners(self) -> dict[str, list[str]]:
        """shard -> the other shards its conversion reads (where its modules' scales are)."""
        out: dict[str, set[str]] = {}
        for packed, scale in self.straddled().values():
            out.setdefault(packed, set()).add(scale)
        return {k: sorted(v) for k, v in sorted(out.items())}


def write_checkpoint(root: str, sd: dict[str, torch.Tensor], max_shard_size: int | str,
                     spec: FixtureSpec = SPEC) -> Source:
    """Shard ``sd`` with huggingface_hub and save it as its docstring shows (safetensors
    save_file with format=pt; an index only when sharded), plus a K3 config.json."""
    os.makedirs(root)
    split = split_torch_state_dict_into_shards(sd, max_shard_size=max_shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    for filename, names in split.filename_to_tensors.items():
        save_file({n: sd[n] for n in names}, os.path.join(root, filename), metadata={"format": "pt"})
    if split.is_sharded:
        write_json(os.path.join(root, INDEX), {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
    write_json(os.path.join(root, "config.json"), k3_config(spec))
    return Source(root, dict(split.tensor_to_filename), max_shard_size)


# What each case's cut must be, asserted from the library's index (and the files it wrote).

def _cut_a(src: Source, sd: dict) -> None:
    apart = src.straddled()
    assert apart, "no module's packed and scale tensors were split"
    for m, (packed, scale) in apart.items():
        assert src.no(scale) == src.no(packed) + 1, (m, packed, scale)
        assert list(sd).index(m + PACKED) < list(sd).index(m + SCALE)


def _cut_b(src: Source, sd: dict) -> None:
    apart = src.straddled()
    assert apart, "no module's scale and packed tensors were split"
    for m, (packed, scale) in apart.items():
        assert src.no(packed) == src.no(scale) + 1, (m, packed, scale)
        assert list(sd).index(m + SCALE) + 1 == list(sd).index(m + PACKED)  # scale right before packed


def _cut_c(src: Source, sd: dict) -> None:
    """Both orders, each with a module whose packed and scale shards have a shard of
    non-expert tensors only (the shared experts) between them."""
    non_expert = {src.no(f) for f in src.files
                  if all(".experts." not in t for t, g in src.weight_map.items() if g == f)}
    seen = set()
    for m, (packed, scale) in src.straddled().items():
        p, s = src.no(packed), src.no(scale)
        if any(min(p, s) < k < max(p, s) for k in non_expert):
            seen.add("packed first" if p < s else "scale first")
    assert seen == {"packed first", "scale first"}, seen


def _cut_d(src: Source, sd: dict) -> None:
    limit = src.max_shard_size
    wm = src.weight_map
    for big in (f"{PREFIX}.embed_tokens.weight", "language_model.lm_head.weight"):
        assert sd[big].numel() * sd[big].element_size() > limit
        assert [t for t, f in wm.items() if f == wm[big]] == [big]  # a shard of its own
        assert os.path.getsize(os.path.join(src.path, wm[big])) > limit
    # the library numbers an oversized tensor's shard when it meets it: lm_head's comes before
    # the shard of the tensors just before it in the state dict
    assert src.no(wm["language_model.lm_head.weight"]) < src.no(wm[f"{PREFIX}.norm.weight"])
    assert src.straddled()


def _cut_e(src: Source, sd: dict) -> None:
    assert src.files == ["model.safetensors"]
    assert sorted(os.listdir(src.path)) == ["config.json", "model.safetensors"]  # no index


def _cut_none(src: Source, sd: dict) -> None:
    assert len(src.files) > 2 and not src.straddled()


@dataclass(frozen=True)
class Case:
    order: Callable[[dict], dict]
    max_shard_size: int | str  # bytes, or as huggingface_hub spells it ("5GB")
    check_cut: Callable[[Source, dict], None]
    cli: bool = False  # converted with the k3convert command rather than the library


CASES = {
    "a_packed_then_scale": Case(natural, 46_000, _cut_a),
    "b_scale_first": Case(scale_first, 40_000, _cut_b),
    "c_far_apart": Case(runs, 22_000, _cut_c, cli=True),
    "d_oversized_tensor": Case(natural, 14_000, _cut_d),
    "e_single_file": Case(natural, "5GB", _cut_e),  # the library's default limit
}
# The reference: the same model in the same order, at a limit where every cut falls between modules.
TOGETHER = Case(natural, 30_000, _cut_none)


@pytest.fixture(scope="session")
def model() -> dict[str, torch.Tensor]:
    return k3_state_dict(SPEC, SHARED_INTER, SPEC.seed)


@pytest.fixture(scope="session")
def sources(model, tmp_path_factory) -> dict[str, Source]:
    root = tmp_path_factory.mktemp("hf-sharded")
    return {name: write_checkpoint(str(root / name), case.order(model), case.max_shard_size)
            for name, case in {**CASES, "together": TOGETHER}.items()}


@pytest.fixture(scope="session")
def dst_of(sources, tmp_path_factory) -> Callable[[str], str]:
    """name -> DST of that source, converted once per session (the CLI case with the command)."""
    root = tmp_path_factory.mktemp("hf-converted")
    done: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in done:
            src, dst = sources[name].path, str(root / name)
            if name in CASES and CASES[name].cli:
                r = run_cli("mxfp4-to-int4", src, "-o", dst, "--devices", "cpu", "--progress", "none")
                assert r.exit_code == 0, r.output
                assert r.stdout.splitlines()[-2].startswith("complete:"), r.stdout
            else:
                assert convert(src, dst, Options(devices=["cpu"])).complete
            done[name] = dst
        return done[name]

    return get


# ------------------------------------------------------------------------------ reading outputs (safetensors only)

def tensors_of(root: str) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (shard, tensor) over every .safetensors file in root, through safe_open."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for shard in shard_names(root):
        with safe_open(os.path.join(root, shard), framework="pt") as f:
            for k in f.keys():
                assert k not in out, f"{k} in {out[k][0]} and {shard}"
                out[k] = (shard, f.get_tensor(k))
    return out


def assert_same_tensors(dst: str, ref: str) -> None:
    """The same output tensors, dtype, shape and bytes (which shard holds them may differ)."""
    got, want = tensors_of(dst), tensors_of(ref)
    assert sorted(got) == sorted(want)
    for name, (_, w) in want.items():
        g = got[name][1]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert tensor_bytes(g) == tensor_bytes(w), f"{name}: bytes differ"


def assert_index_true(dst: str) -> None:
    """The index maps every tensor to the shard that holds it; total_size is their bytes."""
    index = read_json(os.path.join(dst, INDEX))
    held = tensors_of(dst)
    assert index["weight_map"] == {k: shard for k, (shard, _) in held.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in held.values())


def assert_placed(src: Source, dst: str) -> None:
    """Shards keep their names; a module's three outputs go to the shard of its packed tensor."""
    out = read_json(os.path.join(dst, INDEX))["weight_map"]
    assert shard_names(dst) == src.files
    want = {}
    for t, shard in src.weight_map.items():
        if t.endswith(PACKED):
            m = t[: -len(PACKED)]
            want.update({m + PACKED: shard, m + SCALE: shard, m + SHAPE: shard})
        elif not t.endswith(SCALE):
            want[t] = shard
    assert out == want


def assert_same_output(dst: str, ref: str) -> None:
    """Every file the reference run wrote, byte for byte (manifest and report hold timings)."""
    names = sorted(f for f in os.listdir(ref) if os.path.isfile(os.path.join(ref, f)) and f not in (MANIFEST, REPORT))
    assert INDEX in names and "config.json" in names
    for f in names:
        assert filecmp.cmp(os.path.join(dst, f), os.path.join(ref, f), shallow=False), f
    assert not [f for f in os.listdir(dst) if f.endswith(".partial")]
    m = read_json(os.path.join(dst, MANIFEST))
    assert m["complete"] is True and sorted(m["shards"]) == shard_names(ref)


def record(dst: str, shard: str) -> dict | None:
    path = os.path.join(dst, STATE, shard + ".done.json")
    return read_json(path) if os.path.exists(path) else None


# ------------------------------------------------------------------------------ §2: every kind of cut converts

@pytest.mark.parametrize("name", sorted({**CASES, "together": TOGETHER}))
def test_library_cut_is_where_intended(name, model, sources):
    case = {**CASES, "together": TOGETHER}[name]
    case.check_cut(sources[name], case.order(model))


@pytest.mark.parametrize("name", sorted(CASES))
def test_converts_to_the_bytes_of_modules_kept_together(name, sources, dst_of):
    src, dst, ref = sources[name], dst_of(name), dst_of("together")
    assert_same_tensors(dst, ref)
    assert_index_true(dst)
    assert_placed(src, dst)
    partners = src.partners()
    for shard in src.files:  # each shard's record names every source file it was made from
        assert record(dst, shard)["sources"] == [shard] + partners.get(shard, [])
    manifest = read_json(os.path.join(dst, MANIFEST))
    assert manifest["complete"] is True and sorted(manifest["shards"]) == src.files
    r = run_cli("verify", dst, "--source", src.path, "--all")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().endswith("result: PASS"), r.stdout


@pytest.mark.parametrize("name", sorted(CASES))
def test_inspect_source(name, sources, model):
    src = sources[name]
    info = inspect_path(src.path)
    assert info["format"] == "mxfp4-source", info["description"]
    assert "error" not in info["plan"], info["plan"]
    assert info["plan"]["tensors_to_convert"] == MODULES
    assert info["plan"]["source_tensors_converted"] == 2 * MODULES
    assert [s["name"] for s in info["shards"]] == src.files
    assert info["tensors"] == len(model) and info["quantized_modules"] == MODULES
    if name == "c_far_apart":
        r = run_cli("inspect", src.path)
        assert r.exit_code == 0, r.output
        assert f"{MODULES} MXFP4 matrices to convert" in r.stdout


# ------------------------------------------------------------------------------ §1: job arrays

def _straddle(src: Source, far: bool = False) -> tuple[str, str, str]:
    """(module, packed shard, scale shard) of the first straddled module (``far``: two or more apart)."""
    for m, (packed, scale) in src.straddled().items():
        if not far or abs(src.no(packed) - src.no(scale)) >= 2:
            return m, packed, scale
    raise AssertionError("no such module")


@pytest.mark.parametrize("parts", [("1/2", "2/2"), ("2/2", "1/2")])
def test_parts_in_sequence_equal_one_run(parts, sources, dst_of, tmp_path):
    """--part i/2 round robin: the packed shard and the shard of its scale land in different parts."""
    src, ref = sources["a_packed_then_scale"], dst_of("a_packed_then_scale")
    for m, (packed, scale) in src.straddled().items():
        assert (src.no(packed) - src.no(scale)) % 2 == 1, m  # in different parts
    dst = str(tmp_path / "dst")
    first = convert(src.path, dst, Options(devices=["cpu"], part=parts[0]))
    assert not first.complete
    assert_not_complete(dst)
    assert read_json(os.path.join(dst, MANIFEST))["status"] == "partial"
    info = inspect_path(dst)  # an unfinished DST: what is done so far
    assert info["format"] == "k3convert-int4" and "unfinished" in info["description"]
    mine = [f for f in src.files if (src.no(f) - 1) % 2 == int(parts[0][0]) - 1]
    assert [s["name"] for s in info["shards"]] == mine
    assert convert(src.path, dst, Options(devices=["cpu"], part=parts[1])).complete
    assert_same_output(dst, ref)


def test_shard_ranges_far_apart_equal_one_run(sources, dst_of, tmp_path):
    """--shards: a module's packed shard in the first run, its scale (two or more shards later) in the second."""
    src, ref = sources["c_far_apart"], dst_of("c_far_apart")
    m, packed, scale = _straddle(src, far=True)
    k, n = src.no(packed), len(src.files)
    assert k + 2 <= src.no(scale)
    dst = str(tmp_path / "dst")
    assert not convert(src.path, dst, Options(devices=["cpu"], shard_spec=f"1-{k}")).complete
    assert record(dst, packed)["sources"][1:] == src.partners()[packed] and scale in src.partners()[packed]
    assert record(dst, scale) is None
    r = run_cli("finalize", dst)
    assert r.exit_code == 4 and r.stdout.startswith("partial:"), r.output
    assert_not_complete(dst)
    assert convert(src.path, dst, Options(devices=["cpu"], shard_spec=f"{k + 1}-{n}")).complete
    assert_same_output(dst, ref)
    r = run_cli("finalize", dst)
    assert r.exit_code == 0 and r.stdout.startswith("complete:"), r.output
    assert_same_output(dst, ref)


def _spawn(src: str, dst: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "converter", "mxfp4-to-int4", src, "-o", dst, "--progress", "json",
                             "--devices", "cpu", *extra], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float = 180) -> tuple[int, list[dict], str]:
    """(exit code, JSON events, other stderr lines) of a run; killed (its process group) on timeout."""
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError("run did not finish") from None
    events, text = [], []
    for line in err.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            text.append(line)
    return p.returncode, events, "\n".join(text)


def test_parts_as_two_concurrent_processes(sources, dst_of, tmp_path):
    src, ref = sources["a_packed_then_scale"], dst_of("a_packed_then_scale")
    dst = str(tmp_path / "dst")
    procs = [_spawn(src.path, dst, "--part", "1/2"), _spawn(src.path, dst, "--part", "2/2")]
    try:
        results = [_finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for rc, _, text in results:
        assert rc == 0, text
    done = [{e["shard"] for e in ev if e["event"] == "done"} for _, ev, _ in results]
    assert done[0] == {f for f in src.files if src.no(f) % 2 == 1} and done[1] == set(src.files) - done[0]
    assert_same_output(dst, ref)
    # completed once every shard was done: the run that finished the last shard says complete;
    # a run that finished before the other's last shard says partial
    last_done = [max(e["time"] for e in ev if e["event"] == "done") for _, ev, _ in results]
    finished = [[e for e in ev if e["event"] == "finished"][-1] for _, ev, _ in results]
    assert finished[last_done.index(max(last_done))]["complete"] is True
    for fin, other in zip(finished, last_done[::-1]):
        if fin["time"] < other - 0.1:
            assert fin["complete"] is False
    state = os.path.join(dst, STATE)
    last_record = max(os.stat(os.path.join(state, f + ".done.json")).st_mtime_ns for f in src.files)
    assert os.stat(os.path.join(dst, MANIFEST)).st_mtime_ns >= last_record


# ------------------------------------------------------------------------------ §1: resume and changed partners

def test_resume_after_the_packed_shard_is_done(sources, dst_of, tmp_path, monkeypatch):
    """The packed shard is finished; the run converting its partner fails mid-shard; the next run
    keeps the packed shard (not redone) and finishes the rest, equal to one uninterrupted run."""
    src, ref = sources["a_packed_then_scale"], dst_of("a_packed_then_scale")
    m, packed, scale = _straddle(src)
    dst = str(tmp_path / "dst")
    convert(src.path, dst, Options(devices=["cpu"], shard_spec=str(src.no(packed))))
    assert record(dst, packed)["sources"] == [packed, scale]
    kept = os.stat(os.path.join(dst, packed)).st_mtime_ns

    def interrupted(fd, buf, offset, path, name):
        raise KeyboardInterrupt  # Ctrl-C once the partner's .partial is open, at its first read

    with monkeypatch.context() as mp:
        mp.setattr(shard_mod, "_pread", interrupted)
        with pytest.raises(Interrupted):
            convert(src.path, dst, Options(devices=["cpu"], shard_spec=str(src.no(scale))))
    assert record(dst, scale) is None and not os.path.exists(os.path.join(dst, scale + ".partial"))
    assert_not_complete(dst)

    events: list[tuple[str, dict]] = []
    assert convert(src.path, dst, Options(devices=["cpu"]), lambda kind, f: events.append((kind, f))).complete
    started = {f["shard"] for kind, f in events if kind == "start"}
    assert started == set(src.files) - {packed}
    assert os.stat(os.path.join(dst, packed)).st_mtime_ns == kept
    assert_same_output(dst, ref)


@pytest.mark.parametrize("change", ["scale bytes", "scale bytes, mtime restored", "mtime only"])
def test_changed_partner_is_refused(change, sources, dst_of, tmp_path):
    """The packed shard is done, then its PARTNER changes: a shard that holds the module's scale
    and no packed tensor at all (nothing of its own to convert). The next run refuses: it must
    not keep a shard made from the old scale. The source fingerprint is size, mtime and a hash
    of the first and last MiB (docs/decisions.md); these shards are under 1 MiB, so the hash
    covers every byte and a restored mtime does not hide the change."""
    case = sources["c_far_apart"]
    m, packed, scale = next((m, p, s) for m, (p, s) in case.straddled().items()
                            if not any(t.endswith(PACKED) for t, f in case.weight_map.items() if f == s))
    src = str(tmp_path / "src")
    shutil.copytree(case.path, src)
    dst = str(tmp_path / "dst")
    convert(src, dst, Options(devices=["cpu"], shard_spec=str(case.no(packed))))
    assert record(dst, packed)["sources"][1:] == case.partners()[packed] and scale in case.partners()[packed]
    before = tree_hash(dst)
    path = os.path.join(src, scale)
    st = os.stat(path)
    assert st.st_size < 1 << 20
    if change == "mtime only":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    else:
        def bump(tensors: dict) -> None:  # every E8M0 byte of the scale one higher (x2)
            assert int(tensors[m + SCALE].max()) < 254
            tensors[m + SCALE] += 1

        rewrite_shard(path, bump)  # same names, shapes and metadata: the same size
        assert os.path.getsize(path) == st.st_size
        if "restored" in change:
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert os.stat(path).st_mtime_ns == st.st_mtime_ns

    if change == "mtime only":  # the same bytes (issue 32 T9): the recorded content is compared, and matches
        assert convert(src, dst, Options(devices=["cpu"])).complete
        r = run_cli("verify", dst, "--source", src, "--all")
        assert r.exit_code == 0, r.output
        return
    with pytest.raises(OutputError, match="source files changed"):
        convert(src, dst, Options(devices=["cpu"]))
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--devices", "cpu", "--progress", "none")
    assert r.exit_code == 4 and f"holds a different conversion (source files changed: {scale} changed)" in r.stderr, \
        r.output
    assert tree_hash(dst) == before  # nothing kept as if it were still right, nothing new written

    assert convert(src, dst, Options(devices=["cpu"], overwrite=True)).complete
    with safe_open(os.path.join(dst, packed), framework="pt") as f:
        new_scale = f.get_tensor(m + SCALE)
    with safe_open(os.path.join(dst_of("c_far_apart"), packed), framework="pt") as f:
        old_scale = f.get_tensor(m + SCALE)
    assert torch.equal(new_scale, old_scale) == (change == "mtime only")
    r = run_cli("verify", dst, "--source", src, "--all")
    assert r.exit_code == 0, r.output


# Larger shards, so that a scale can sit past a shard's first MiB and before its last one.
BIG = FixtureSpec(layers=2, experts=2, hidden=256, inter=1024, latent=512, vocab=2048, seed=9)


def test_mid_file_partner_change_keeping_size_and_mtime(tmp_path):
    """A change in the middle of a partner shard that keeps its size and restores its mtime (R2):
    the write and the utime both move the file's ctime, a hint (not identity: issue 25 S1) that
    makes the resumed run re-read the scale ranges the packed shard's record holds a digest of;
    they differ, so it refuses instead of keeping the packed shard made from the old scale."""
    src = write_checkpoint(str(tmp_path / "src"), k3_state_dict(BIG, 1024, BIG.seed), 3_940_000, BIG)
    m, packed, scale = _straddle(src)
    assert (src.no(packed), src.no(scale)) == (1, 2)
    path = os.path.join(src.path, scale)
    header, data_start = raw_header(path)
    lo, hi = (data_start + x for x in header[m + SCALE]["data_offsets"])
    assert 1 << 20 <= lo and hi <= os.path.getsize(path) - (1 << 20)  # outside the first and last MiB
    dst = str(tmp_path / "dst")
    convert(src.path, dst, Options(devices=["cpu"], shard_spec="1"))
    with open(os.path.join(dst, packed), "rb") as f:
        made = f.read()

    st = os.stat(path)
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, hi - lo, lo)
        assert max(old) < 254
        os.pwrite(fd, bytes(b + 1 for b in old), lo)
    finally:
        os.close(fd)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size

    with pytest.raises(OutputError, match=f"source files changed: {scale} changed"):
        convert(src.path, dst, Options(devices=["cpu"]))
    with open(os.path.join(dst, packed), "rb") as f:
        assert f.read() == made  # nothing rewritten


def test_mid_file_own_shard_change_keeping_size_and_mtime(tmp_path):
    """Issue 25 S1 keeps R2 for a finished shard's own source: its middle changed (past the first
    and before the last MiB), size and mtime restored. The ctime hint moved, so the digest its
    converter recorded of every byte it read is recomputed: it differs, the next part refuses.
    A copy of SRC made with cp -a (the same bytes, every hint moved) continues instead."""
    src = write_checkpoint(str(tmp_path / "src"), k3_state_dict(BIG, 1024, BIG.seed), 3_940_000, BIG)
    shard = next(f for f in src.files if os.path.getsize(os.path.join(src.path, f)) > 3 << 20)
    path = os.path.join(src.path, shard)
    dst = str(tmp_path / "dst")
    convert(src.path, dst, Options(devices=["cpu"], shard_spec=str(src.no(shard))))
    copy = str(tmp_path / "copy")
    subprocess.run(["cp", "-a", src.path, copy], check=True)  # before the edit: the bytes converted

    st = os.stat(path)
    fd = os.open(path, os.O_RDWR)
    try:
        mid = st.st_size // 2
        assert 1 << 20 <= mid < st.st_size - (1 << 20)
        os.pwrite(fd, bytes([os.pread(fd, 1, mid)[0] ^ 0x01]), mid)
    finally:
        os.close(fd)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size
    with pytest.raises(OutputError, match=f"source files changed: {re.escape(shard)} changed"):
        convert(src.path, dst, Options(devices=["cpu"]))

    # the unchanged bytes elsewhere (another inode and ctime for every file): the same source
    shutil.rmtree(src.path)
    os.rename(copy, src.path)  # the path is identity: the copy takes the original's place
    assert convert(src.path, dst, Options(devices=["cpu"])).complete


# ------------------------------------------------------------------------------ §1: --dry-run and reads

def test_dry_run_shows_straddled_modules(sources, tmp_path):
    src = sources["c_far_apart"]
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src.path, "-o", dst, "--dry-run", "--progress", "json", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["modules_split_across_shards"] == len(src.straddled()) > 0
    assert info["also_reads"] == src.partners()

    r = run_cli("mxfp4-to-int4", src.path, "-o", dst, "--dry-run", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    lines = dict(line.strip().split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert int(lines["modules_split_across_shards"]) == len(src.straddled())
    for shard, partners in src.partners().items():
        assert shard in lines["also_reads"] and all(p in lines["also_reads"] for p in partners)

    # one job of an array: only its own shards, and what they read from the others
    r = run_cli("mxfp4-to-int4", src.path, "-o", dst, "--dry-run", "--progress", "json", "--devices", "cpu",
                "--part", "1/2")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    mine = {f for f in src.files if src.no(f) % 2 == 1}
    assert info["also_reads"] == {k: v for k, v in src.partners().items() if k in mine}
    assert info["modules_split_across_shards"] == sum(p in mine for p, _ in src.straddled().values())
    assert not os.path.exists(dst)


def test_partner_tensors_read_by_offset_only(sources, tmp_path, monkeypatch):
    """Memory stays bounded: converting a shard reads from another shard exactly the bytes of
    the scale tensors it needs, at their offsets, once each; never a whole shard."""
    src = sources["c_far_apart"]
    ranges = {}
    for f in src.files:
        header, start = raw_header(os.path.join(src.path, f))
        ranges.update({(f, t): (start + v["data_offsets"][0], start + v["data_offsets"][1])
                       for t, v in header.items() if t != "__metadata__"})
    reads: list[tuple[str | None, str, str, int, int]] = []
    now: dict[str, str | None] = {"shard": None}
    real_read, real_convert = shard_mod._pread, shard_mod.ShardConverter.convert

    def convert_one(self, sp, *args, **kw):
        now["shard"] = sp.name
        try:
            return real_convert(self, sp, *args, **kw)
        finally:
            now["shard"] = None

    def pread(fd, buf, offset, path, name):
        reads.append((now["shard"], os.path.basename(path), name, offset, memoryview(buf).nbytes))
        return real_read(fd, buf, offset, path, name)

    monkeypatch.setattr(shard_mod.ShardConverter, "convert", convert_one)
    monkeypatch.setattr(shard_mod, "_pread", pread)
    events: list[tuple[str, dict]] = []
    dst = str(tmp_path / "dst")
    assert convert(src.path, dst, Options(devices=["cpu"]), lambda kind, f: events.append((kind, f))).complete
    # progress counts each source byte once: a partner's scale with the shard that reads it
    (plan,) = [f for kind, f in events if kind == "plan"]
    total = sum(os.path.getsize(os.path.join(src.path, f)) for f in src.files)
    assert plan["bytes_in"] == sum(f["n"] for kind, f in events if kind == "bytes") == total
    assert reads and all(shard is not None for shard, *_ in reads)  # every read inside one shard's conversion
    # every source tensor read once, exactly its bytes, at its offset
    assert sorted((f, name) for _, f, name, _, _ in reads) == sorted(ranges)
    for _, f, name, offset, size in reads:
        assert (offset, offset + size) == ranges[(f, name)], name
    foreign = [r for r in reads if r[0] != r[1]]
    want = sorted((packed, scale, m + SCALE) for m, (packed, scale) in src.straddled().items())
    assert sorted((shard, f, name) for shard, f, name, _, _ in foreign) == want  # only the scales it needs


def test_bad_scale_in_partner_names_partner_file(sources, tmp_path):
    """A NaN E8M0 byte (255) in a straddled module's scale: one line naming the partner shard
    (where the byte is) and the scale tensor, exit 2, nothing complete."""
    case = sources["b_scale_first"]
    m, packed, scale = _straddle(case)
    src = str(tmp_path / "src")
    shutil.copytree(case.path, src)
    path = os.path.join(src, scale)
    rewrite_shard(path, lambda tensors: tensors[m + SCALE][1].fill_(255))
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--devices", "cpu", "--progress", "none")
    assert_clean_error(r, f"file {path}", f"tensor {m + SCALE}", "255", code=2)
    assert_not_complete(dst)
    assert record(dst, packed) is None
