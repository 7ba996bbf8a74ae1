"""Preflight: read every header, decide what converts, and fix each output shard's layout.

Everything that can be checked without reading tensor data is checked here, and all
problems are reported together, before any shard is converted.

Writers shard by size, not by module, so a module's tensors (packed, scale, an NVFP4 global
scale) may sit in different shards, in any order. They are found over the whole checkpoint; a
converted module's three output tensors go to the shard that holds its packed tensor (the large
one), which reads the others from their shards by offset, tensor by tensor (docs/decisions.md).
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .. import __version__, profiles
from ..errors import BadInput
from ..formats import checkpoint as ckpt
from ..formats.checkpoint import PACKED, SCALE, SHAPE
from ..formats.fp8_mxfp4 import Fp8Mxfp4Source
from ..formats.nvfp4 import Nvfp4Source
from ..formats.safetensors_io import MAX_HEADER, Header, Layout, OutTensor, TensorInfo, read_header
from ..quant.rules import DEFAULT as DEFAULT_RULE
from ..releases import NEWEST_VLLM
from ..safepath import _within as within, regular_problem, source_file, source_roots
from ..servers.fp8_tp import written_as_bf16
from .items import Convert, Copy, Dequant, Fp8Dequant, Item, MXFP4Module, Nvfp4Convert
from .pairing import pair_mxfp4, pair_nvfp4

__all__ = ["PACKED", "SCALE", "SHAPE", "Convert", "Nvfp4Convert", "Dequant", "Fp8Dequant", "Copy", "ShardPlan", "Plan",
           "build_plan"]


@dataclass
class ShardPlan:
    """One output shard: what it holds, in which order, and which source files it reads."""

    name: str                 # file name, the same in SRC and DST
    path: str                 # the source shard
    bytes_in: int             # the source shard's size
    header_bytes: int         # its header (counted as read, for progress)
    items: list[Item]         # in source data order
    metadata: dict[str, str]  # the output shard's safetensors metadata
    layout: Layout = field(init=False)

    def __post_init__(self) -> None:
        tensors: list[OutTensor] = []
        for it in self.items:
            tensors += [OutTensor(it.out_name, it.info.dtype, it.info.shape)] if isinstance(it, Copy) else it.outputs()
        self.layout = Layout(tensors, self.metadata)

    @property
    def converts(self) -> list[Convert]:
        return [it for it in self.items if isinstance(it, Convert)]

    @property
    def dequants(self) -> list[Dequant]:
        return [it for it in self.items if isinstance(it, Dequant)]

    @property
    def fp8_dequants(self) -> list[Fp8Dequant]:
        return [it for it in self.items if isinstance(it, Fp8Dequant)]

    @property
    def pairs(self) -> list[MXFP4Module]:
        """Every MXFP4 module whose packed tensor this shard holds (converted or dequantized)."""
        return [it for it in self.items if isinstance(it, MXFP4Module)]

    @property
    def bytes_read(self) -> int:
        """Source bytes this shard's conversion reads (its header, its items' tensors)."""
        return self.header_bytes + sum(it.nbytes for it in self.items)

    @property
    def bytes_out(self) -> int:
        return self.layout.file_size

    @property
    def sources(self) -> list[str]:
        """Every source file it reads: its own shard first, then the others that hold a scale
        of one of its modules (split pairs), by name."""
        others = ({t.path for c in self.pairs for t in c.tensors}
                  | {t.path for f in self.fp8_dequants for t in f.tensors}) - {self.path}
        return [self.path] + sorted(others, key=os.path.basename)

    @property
    def partners(self) -> list[str]:
        """The names of the other source shards it reads (split pairs)."""
        return [os.path.basename(p) for p in self.sources[1:]]


@dataclass
class Plan:
    src: str
    config: dict[str, Any]
    source: ckpt.MXFP4Source
    profile: profiles.Profile
    profile_reason: str
    activation: dict[str, Any]
    shards: list[ShardPlan]
    other_files: list[str]         # copied byte-identical (tokenizer, chat template, *.py, ...)
    dropped: list[str] = field(default_factory=list)  # tensors left out by --drop-activation-quant
    stated_in: str | None = None   # the file that states the quantization where not config.json (ckpt.stated)
    # what the source is called in the run record, manifest and report where ``src`` is only one run's
    # folder (a Hub commit's view: ``ORG/NAME@COMMIT``); None: ``src`` itself
    origin: str | None = None

    @property
    def label(self) -> str:
        """The source as recorded: ``origin``, else the folder."""
        return self.origin or self.src

    @functools.cached_property
    def experts(self) -> int:
        """Routed experts per layer (the highest index converted, plus one; 0 without any). Cached:
        a plan is not changed once made (a changed copy is a new Plan, dataclasses.replace)."""
        return 1 + max((c.expert for s in self.shards for c in s.converts if c.expert is not None), default=-1)

    @property
    def bytes_in(self) -> int:
        return sum(s.bytes_in for s in self.shards)

    @property
    def bytes_out(self) -> int:
        return sum(s.bytes_out for s in self.shards)

    @property
    def n_convert(self) -> int:
        return sum(len(s.converts) for s in self.shards)

    @property
    def dequantized(self) -> list[str]:
        """The MXFP4 modules DST holds as bf16 (``Dequant``), sorted."""
        return sorted(d.module for s in self.shards for d in s.dequants)

    @property
    def fp8_dequantized(self) -> list[str]:
        """The FP8 block linears DST holds as bf16 (``Fp8Dequant``), sorted."""
        return sorted(d.module for s in self.shards for d in s.fp8_dequants)

    @property
    def straddled(self) -> int:
        """Modules whose tensors sit in more than one shard."""
        return sum(c.split for s in self.shards for c in s.pairs)

    def weight_map(self) -> dict[str, str]:
        return {t.name: s.name for s in self.shards for t in s.layout.tensors}

    def output_config(self, rule: str = DEFAULT_RULE) -> dict[str, Any]:
        """The source config with its MXFP4 blocks replaced by int4 ones written with scale ``rule``."""
        converted = sorted(c.module for s in self.shards for c in s.converts)
        kept = sorted({it.out_name[: -len(".weight")] for s in self.shards for it in s.items
                       if isinstance(it, Copy) and it.out_name.endswith(".weight") and len(it.info.shape) == 2}
                      | set(self.dequantized))
        return self.source.int4_config(self.config, converted, kept, rule)


def metadata_value(v: Any) -> str:
    """An activation field as shard metadata (strings only): a name as it is, a number or null as JSON."""
    return v if isinstance(v, str) else json.dumps(v)


def shard_metadata(source: dict[str, str], activation: dict[str, Any], what: str) -> dict[str, str]:
    """Each output shard states the format, the tool and the activation (docs/spec.md §4)."""
    meta = dict(source)
    meta.setdefault("format", "pt")
    meta.update({k: metadata_value(v) for k, v in activation.items()})
    meta["quantization"] = f"compressed-tensors pack-quantized int4 group 32 ({what})"
    meta["converted_by"] = f"k3convert {__version__}"
    return meta




# Names DST gives its own files (and the prefix of ours): a source shard of such a name would be
# converted and then overwritten, or taken for ours. The source's README.md is kept as
# README_SOURCE (the model card of the int4 model is ours: converter.hub.upload).
README, README_SOURCE = "README.md", "README.source.md"
OWN_NAMES = frozenset(("config.json", ckpt.INDEX, README, README_SOURCE))
OWN_PREFIX = "k3convert_"
TEMPORARY = re.compile(r"\.tmp\d*$|\.partial$")  # our temporaries (".tmp" alone: older versions)
NAME_MAX = 255           # bytes in a file name (ext4, XFS, tmpfs, Lustre, GPFS)
PARTIAL = ".partial"     # a shard is written as NAME.partial, then renamed


def side_file_target(rel: str) -> str:
    """Where a side file of SRC goes in DST: the same place, except the source's model card."""
    return README_SOURCE if rel == README else rel


def _shard_name_problem(shard: str, index: str) -> str | None:
    """A shard name DST cannot hold beside its own files (D13), or cannot write (D10)."""
    where = f"file {index}, shard {shard!r}"
    if shard in OWN_NAMES or shard.startswith(OWN_PREFIX) or TEMPORARY.search(shard):
        return f"{where}: k3convert writes a file of that name (or pattern) in DST itself: rename the shard"
    if len(shard.encode()) + len(PARTIAL) > NAME_MAX:
        return (f"{where}: the name is {len(shard.encode())} bytes, over {NAME_MAX - len(PARTIAL)}: k3convert writes "
                f"it as NAME{PARTIAL} first, which must fit the file system's {NAME_MAX}-byte limit: rename the shard")
    return None


def _read_headers(src: str, by_shard: dict[str, list[str]], roots: tuple[str, ...],
                  problems: list[str]) -> dict[str, Header]:
    headers = {}
    index = os.path.join(src, ckpt.INDEX)
    for shard in sorted(by_shard):
        path = os.path.join(src, shard)
        if why := _shard_name_problem(shard, index):
            problems.append(why)
            continue
        if not os.path.lexists(path):
            problems.append(f"file {path}: missing, but {ckpt.INDEX} names it for {len(by_shard[shard])} tensors")
            continue
        if why := regular_problem(path):
            problems.append(f"file {path}: {why}")
            continue
        try:
            headers[shard] = read_header(source_file(src, shard, roots))
        except BadInput as e:
            problems.append(str(e))
            continue
        problems += [f"file {path}, tensor {name}: in {ckpt.INDEX} but not in the shard"
                     for name in by_shard[shard] if name not in headers[shard].tensors]
        listed = set(by_shard[shard])
        problems += [f"file {path}, tensor {name}: in the shard but not in {ckpt.INDEX} (refusing to guess "
                     "whether it belongs to the checkpoint: add it to the index or remove it)"
                     for name in headers[shard].tensors if name not in listed]
    return headers


def name_problem(name: str) -> str | None:
    """Why a side file or folder name cannot be published, or None: the Hub holds UTF-8 names only
    (a name of other bytes converts and verifies, then the upload fails), and a control character
    would break the one-line messages and the listing."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "its name is not valid UTF-8: the Hub cannot hold it (upload would fail); rename it"
    if not name.isprintable():
        return "its name holds a control character: rename it"
    return None


def shown(path: str) -> str:
    """A path for a one-line message: undecodable bytes as \\xNN escapes, control characters escaped."""
    text = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text if text.isprintable() else ascii(text)[1:-1]


def _linked_folder_problem(src: str, d: str, name: str, roots: tuple[str, ...]) -> str | None:
    """A link to a folder inside SRC is walked, its files copied as regular files under the link's
    name (docs/decisions.md); one that leads outside SRC, or to a folder it lies in (a loop), is refused."""
    path = os.path.join(d, name)
    real = os.path.realpath(path)
    if not any(within(real, r) for r in roots):
        return (f"file {shown(path)}: a link to the folder {shown(real)}, outside the checkpoint directory: "
                "refusing to read it")
    rel, above = os.path.relpath(d, src), [src]
    for part in ([] if rel == "." else rel.split(os.sep)):
        above.append(os.path.join(above[-1], part))
    if real in {os.path.realpath(p) for p in above}:
        return f"file {shown(path)}: a link to a folder it lies in (a loop): refusing to walk it; remove the link"
    return None


# a side file some writers add that repeats config.json's quantization_config (auto-round 0.16's model-free
# export, compressors/model_free.py 1576-1581): copied, it would describe DST's int4 weights as MXFP4
RESTATED_QUANT_CONFIGS = ("quantization_config.json",)


def _restated_quant_configs(src: str, config: dict) -> set[str]:
    """The side files of RESTATED_QUANT_CONFIGS that hold exactly one of config.json's MXFP4 blocks: not copied
    (config.json's replaced block is DST's one description); one that says anything else is copied as it is."""
    blocks = [b for _, b in ckpt.quant_blocks(config)]
    out = set()
    for rel in RESTATED_QUANT_CONFIGS:
        path = os.path.join(src, rel)
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 1 << 24:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                if json.load(f) in blocks:
                    out.add(rel)
        except (OSError, ValueError):
            continue
    return out


def _other_files(src: str, skip: set[str], roots: tuple[str, ...], problems: list[str]) -> list[str]:
    """Side files (tokenizer, chat template, remote code) to copy; each must lie inside SRC and have a
    name the Hub can hold. Links to folders inside SRC are followed (their files copied as regular files)."""
    found = []
    for d, dirs, files in os.walk(src, followlinks=True):
        keep = []
        for x in sorted(dirs):
            if x.startswith("."):  # .cache (HF downloads), .git
                continue
            path = os.path.join(d, x)
            why = name_problem(x)
            why = why and f"folder {shown(path)}: {why}"
            if why is None and os.path.islink(path):
                why = _linked_folder_problem(src, d, x, roots)
            if why:
                problems.append(why)
            else:
                keep.append(x)
        dirs[:] = keep
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(d, f), src)
            if rel in skip or f.startswith(OWN_PREFIX) or f.startswith("."):
                continue
            path = os.path.join(src, rel)
            if why := name_problem(f):
                problems.append(f"file {shown(path)}: {why}")
                continue
            try:
                source_file(src, rel, roots)
            except BadInput as e:
                problems.append(str(e))
                continue
            if why := regular_problem(path):
                problems.append(f"file {path}: {why}")
            elif f.endswith(".safetensors"):
                problems.append(f"file {path}: a .safetensors file that {ckpt.INDEX} does not name: refusing to "
                                "copy weights unconverted (add it to the index or remove it)")
            elif rel == README_SOURCE or TEMPORARY.search(f):
                problems.append(f"file {path}: k3convert uses that name (or pattern) in DST itself: rename it")
            else:
                found.append(rel)
    return found


def _header_problem(sp: ShardPlan) -> str | None:
    """An output header over safetensors' limit (the exact bytes the writer will write, fixed by the
    plan): safe_open would refuse the shard. Converting adds a third tensor per module and the
    activation metadata, so a source header just under the limit can end over it."""
    n = len(sp.layout.header) - 8
    if n <= MAX_HEADER:
        return None
    return (f"file {sp.path}: the converted shard's header would be {n:,} bytes (the source's is "
            f"{sp.header_bytes - 8:,}), over safetensors' limit of {MAX_HEADER:,}: safe_open would refuse it; "
            "split this shard into smaller ones (fewer tensors or less metadata) and convert again")


def build_plan(src: str, profile: str | profiles.Profile | None = None, drop_activation_quant: bool = False,
               fp8_bf16_tp: int | None = None) -> Plan:
    """Check the whole source and plan the conversion, or raise BadInput listing every problem."""
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise BadInput("not a directory", file=src)
    roots = source_roots(src)
    config_path = source_file(src, "config.json", roots)
    config = ckpt.load_json(config_path)  # a FIFO is refused, never waited on (json_input.load_file)
    config, stated_in = ckpt.stated(src, config, config_path, roots)
    prof, why = profiles.choose(config, ckpt.dialect(config, stated_in), profile, config_path)
    source = ckpt.mxfp4_source(config, stated_in, drop_activation_quant, prof.source)
    act = ckpt.activation(config, config_path, prof.required_activation, prof.optional_activation)
    wm = ckpt.weight_map(src)
    problems: list[str] = []
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    headers = _read_headers(src, by_shard, roots, problems)

    tensors: dict[str, TensorInfo] = {}
    for shard, h in headers.items():
        for name, t in h.tensors.items():
            if name in tensors:
                problems.append(f"tensor {name}: in both {os.path.basename(tensors[name].path)} and {shard}")
            else:
                tensors[name] = t
    source = source.seen(tensors)
    if fp8_bf16_tp is not None and (isinstance(fp8_bf16_tp, bool) or not isinstance(fp8_bf16_tp, int)
                                    or fp8_bf16_tp < 1):
        problems.append(f"--fp8-bf16-at-tp {fp8_bf16_tp!r}: expected a whole number >= 1")
    elif fp8_bf16_tp is not None and not getattr(source, "fp8_modules", ()):
        problems.append(f"--fp8-bf16-at-tp {fp8_bf16_tp}: the source has no FP8 block linears")
    elif isinstance(source, Fp8Mxfp4Source):   # FP8 linears vLLM would load wrong or refuse: bf16 (Fp8Dequant)
        source = source.with_bf16(*written_as_bf16(config, source.fp8_modules, source.weight_block, tensors,
                                                   fp8_bf16_tp, NEWEST_VLLM))
    fp8_bf16 = [Fp8Dequant(m, tensors[f"{m}.weight"], tensors[f"{m}.weight_scale_inv"], source.weight_block)
                for m in source.bf16_modules] if isinstance(source, Fp8Mxfp4Source) else []
    problems += source.tensor_problems(tensors)
    unread = {n for n, shard in wm.items() if shard not in headers}
    converts = pair_nvfp4(tensors, source, problems, unread) if isinstance(source, Nvfp4Source) else \
        pair_mxfp4(tensors, source, problems, unread)
    modules: dict[str, Convert | Dequant] = dict(converts)
    if prof.experts_only and isinstance(source, Nvfp4Source):   # Dequant decodes MXFP4 bytes only
        problems.append(f"profile {prof.name!r} writes non-expert linears as bf16, which NVFP4 sources do not support")
    elif prof.experts_only:  # the rest loads as bf16, exactly: shared experts, dense MLPs of Quark's templates
        converts = {m: c for m, c in converts.items() if ckpt.match_name(m, ckpt.EXPERT_TARGET)}
        modules = {m: c if m in converts else Dequant(c.module, c.packed, c.scale, c.rows, c.cols)
                   for m, c in modules.items()}
    consumed = ({t.name for c in modules.values() for t in c.tensors}
                | {t.name for f in fp8_bf16 for t in (f.weight, f.scale)})
    dropped = sorted(n for n in tensors if n not in consumed and n.endswith(source.dropped_tensors))
    expected = profiles.expected_modules(prof, config)
    if expected is not None and not problems:  # what the other checks cannot see: an index that lacks modules
        problems += profiles.inventory_problems(
            expected, {m: (c.rows, c.cols) for m, c in converts.items()}, wm)
        if extra := profiles.unexpected_modules(prof, config, expected, converts):   # and one that holds more
            problems.append(profiles.extras_problem(prof, expected, extra, lambda m: converts[m].packed))

    by_packed: dict[str, list[Convert | Dequant | Fp8Dequant]] = {}
    for c in modules.values():
        by_packed.setdefault(c.packed.path, []).append(c)
    for f in fp8_bf16:
        by_packed.setdefault(f.weight.path, []).append(f)
    skip = consumed | set(dropped)
    what = "routed experts" if all(c.expert is not None for c in converts.values()) else "MXFP4 linears"
    shards = []
    for shard, h in headers.items():
        items: list[tuple[int, Item]] = [(c.weight.start if isinstance(c, Fp8Dequant) else c.packed.start, c)
                                         for c in by_packed.get(h.path, [])]
        items += [(t.start, Copy(t, source.out_name(n))) for n, t in h.tensors.items() if n not in skip]
        items.sort(key=lambda x: x[0])
        shards.append(ShardPlan(shard, h.path, h.file_size, h.data_start, [it for _, it in items],
                                shard_metadata(h.metadata, act, what)))
        if too_big := _header_problem(shards[-1]):
            problems.append(too_big)
    if not problems and not converts:
        problems.append(f"directory {src}: the quantization config selects no {source.packed_suffix}/"
                        f"{source.scale_suffix} pair")
    restated = _restated_quant_configs(src, config) | set(source.restated_files)
    others = _other_files(src, {"config.json", ckpt.INDEX} | set(by_shard) | restated, roots, problems)
    if problems:
        raise BadInput(f"{len(problems)} problem(s) in {src}:\n  " + "\n  ".join(problems)
                       if len(problems) > 1 else problems[0])
    return Plan(src, config, source, prof, why, act, shards, others, dropped,
                None if stated_in == config_path else stated_in)
