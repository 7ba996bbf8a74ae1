"""Model profiles: what the tool would otherwise hard-code about a model family.

A profile (``configs/profiles/NAME.toml``) says how to recognise a checkpoint from its
config.json, which MXFP4 dialect it uses, which activation fields must be stated, and, where
the model is known, the expert matrices it must hold, so that an incomplete download is
caught in preflight. The profile is chosen from config.json (``--profile`` overrides) and
recorded in the manifest.
"""
from __future__ import annotations

import os
import re
import string
import tomllib
from dataclasses import dataclass, field
from typing import Any

from .errors import BadInput
from .formats import dialect
from .formats.checkpoint import dotted, is_mxfp4, quant_blocks

SHOWN = 8  # missing modules named in an error
# bounds on the config numbers that size the expected-module table (Kimi K3: 61 layers,
# 384 experts, 7168 wide); far above any real model, far below what would exhaust memory
MAX_LAYERS, MAX_EXPERTS, MAX_DIM = 4096, 65536, 1 << 24
MAX_MODULES = 10_000_000
_TENSORS = ("weight_packed", "weight_scale", "weight")  # a quantized module's tensors, either dialect


def bundled_dir() -> str:
    """configs/profiles of this checkout (source or editable install), else the wheel's copy."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "profiles")
    if os.path.isdir(here):
        return here
    from importlib.resources import files
    return str(files("converter.configs") / "profiles")


def lookup(config: dict, path: str) -> Any:
    """The value at a dotted path of config.json, or KeyError."""
    value: Any = config
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(path)
        value = value[key]
    return value


@dataclass(frozen=True)
class Profile:
    name: str
    path: str
    description: str
    source: str                               # MXFP4 dialect: "compressed-tensors" or "quark"
    match: dict[str, Any] = field(default_factory=dict)
    required_activation: tuple[str, ...] = ("hidden_act",)
    inventory: dict[str, Any] | None = None
    optional_activation: tuple[str, ...] = ()   # carried when the config states them (MiniMax swiglu_beta)
    experts_only: bool = False                 # any MXFP4 module but a routed expert is written as exact bf16
    text: str = field(default="", compare=False, repr=False)   # the file as read: a run records it (sources)

    def matches(self, config: dict) -> tuple[bool, str]:
        """Whether config.json is of this family, and the facts that say so."""
        said = []
        for key, want in self.match.items():
            try:
                got = lookup(config, key)
            except KeyError:
                return False, f"config.json has no {key}"
            if got not in (want if isinstance(want, list) else [want]):
                return False, f"{key} = {got!r}, not {want!r}"
            said.append(f"{key} = {got!r}")
        return True, ", ".join(said)

    def record(self) -> dict[str, str]:
        return {"name": self.name, "file": os.path.basename(self.path)}


def load(path: str) -> Profile:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BadInput(f"cannot read profile: {e.strerror}", file=path) from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise BadInput(f"profile is not valid TOML ({e})", file=path) from None
    return parse(text, path)


def parse(text: str, path: str) -> Profile:
    """A profile from its TOML text; ``path`` names it (where it was read, or where a run recorded it)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"profile is not valid TOML ({e})", file=path) from None
    try:
        dialect.named(data["source"], path)  # a dialect that is registered (formats.dialect)
        return Profile(name=data["name"], path=path, description=data.get("description", ""),
                       source=data["source"], match=dict(data.get("match") or {}),
                       required_activation=tuple((data.get("activation") or {}).get("required", ["hidden_act"])),
                       inventory=_inventory(data.get("inventory"), path),
                       optional_activation=tuple((data.get("activation") or {}).get("optional", [])),
                       experts_only=data.get("experts_only", False) is True, text=text)
    except KeyError as e:
        raise BadInput(f"profile lacks {e.args[0]!r}", file=path) from None


def _keys(value: Any, n: int | None = None) -> bool:
    """Whether ``value`` is a list of config-key strings (of length ``n``, if given)."""
    return isinstance(value, list) and bool(value) and all(isinstance(k, str) for k in value) \
        and (n is None or len(value) == n)


def _inventory(inv: Any, path: str) -> dict[str, Any] | None:
    """The [inventory] table, checked when the file is read: a bad one is named, not a KeyError later."""
    if inv is None:
        return None
    shapes = inv.get("shapes") if isinstance(inv, dict) else None
    ok = isinstance(inv, dict) and isinstance(inv.get("module"), str) and isinstance(inv.get("experts"), str) \
        and (_keys(inv.get("layers"), 2) or isinstance(inv.get("layer_mask"), str)
             and isinstance(inv.get("layer_count", ""), str)) \
        and isinstance(shapes, dict) and bool(shapes) \
        and all(_keys(d, 2) for d in shapes.values())
    ok = ok and isinstance(inv.get("mtp_layers", ""), str) and ("mtp_layers" not in inv or "layers" in inv)
    try:
        ok = ok and bool(inv["module"].format(layer=0, expert=0, proj="w"))
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise BadInput("[inventory] needs module (a name with {layer}, {expert}, {proj}), layers (two config "
                       "keys) or layer_mask (a config key: one 0/1 per layer, 1 = MoE; optional layer_count: the key "
                       "whose layers are all MoE when config.json has no mask), experts (a config key) and "
                       "[inventory.shapes] (proj = [out key, in key]); optional mtp_layers (a config key: layers after "
                       "layers' end that may hold the draft's experts, with layers only)", file=path)
    return inv


def available() -> list[Profile]:
    d = bundled_dir()
    return [load(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".toml")]


def is_file(name: str) -> bool:
    """Whether ``--profile NAME`` names a file (else a bundled profile's name)."""
    return name.endswith(".toml") or os.sep in name


def named(name: "str | Profile") -> Profile:
    """A bundled profile by name, or a profile file by path (a Profile already read: itself)."""
    if isinstance(name, Profile):
        return name
    if is_file(name):
        return load(name)
    for p in available():
        if p.name == name:
            return p
    raise BadInput(f"no profile named {name!r} (known: {', '.join(p.name for p in available())})")


def choose(config: dict, dialect: str, name: "str | Profile | None" = None, config_path: str | None = None
           ) -> tuple[Profile, str]:
    """The profile for this checkpoint and why: ``name`` if given, else the most specific
    bundled profile of the checkpoint's MXFP4 dialect whose match holds."""
    if name:
        p = named(name)
        if p.source != dialect:
            raise BadInput(f"profile {p.name!r} reads {p.source} MXFP4, but the config describes {dialect}",
                           file=config_path)
        ok, why = p.matches(config)
        return p, f"chosen by --profile{'' if ok else f' (its match does not hold: {why})'}"
    fits = [(p, why) for p in available() if p.source == dialect for ok, why in [p.matches(config)] if ok]
    if not fits:
        raise BadInput(f"no profile reads {dialect} MXFP4 checkpoints (add one to {bundled_dir()})")
    p, why = max(fits, key=lambda pw: len(pw[0].match))
    return p, (why + "; " if why else "") + _dialect_fields(config)


def _dialect_fields(config: dict) -> str:
    """The config fields that make it an MXFP4 checkpoint of its dialect, for the reason."""
    said = []
    for path, block in quant_blocks(config):
        if is_mxfp4(block):
            fields = ("quant_method", "format") if block.get("format") else ("quant_method",)
            said += [f"{dotted(path + (k,))} = {block[k]!r}" for k in fields]
    return ", ".join(said)


def expected_modules(profile: Profile, config: dict) -> dict[str, tuple[int, int]] | None:
    """module -> [out, in] of every matrix the profile's inventory requires (None: no inventory)."""
    inv = profile.inventory
    if not inv:
        return None
    def count(key: str, limit: int) -> int:
        value = lookup(config, key)
        if type(value) is not int or not 0 <= value <= limit:  # bounded before it sizes the table
            raise BadInput(f"profile {profile.name!r}: config.json {key} is {str(value)[:40]}, expected an "
                           f"integer in [0, {limit:,}]")
        return value

    layers: list[int] | range
    try:
        if "layer_mask" in inv and (_has(config, inv["layer_mask"]) or "layer_count" not in inv):
            layers = _moe_layers(profile, config, inv["layer_mask"])
        elif "layer_mask" in inv:   # no mask in config.json: every layer is MoE (MiniMax-M3, as vLLM reads it)
            layers = range(count(inv["layer_count"], MAX_LAYERS))
        else:
            layers = range(*(count(k, MAX_LAYERS) for k in inv["layers"]))
            if isinstance(inv.get("extra_layers"), str) and _has(config, inv["extra_layers"]):
                # layers past the end that the same names carry (Ling's MTP MoE layers, bailing_moe_v3_mtp.py 162-173)
                layers = range(layers.start, layers.stop + count(inv["extra_layers"], MAX_LAYERS))
        experts = count(inv["experts"], MAX_EXPERTS)
        shapes = {proj: (count(out, MAX_DIM), count(in_, MAX_DIM))   # two keys each: checked by the profile's load
                  for proj, (out, in_) in inv["shapes"].items()}
    except KeyError as e:
        raise BadInput(f"profile {profile.name!r} needs {e.args[0]} in config.json") from None
    n = len(layers) * experts * len(shapes)
    if n > MAX_MODULES:
        raise BadInput(f"profile {profile.name!r}: config.json asks for {n:,} expert matrices ({len(layers)} "
                       f"layers x {experts} experts x {len(shapes)}): more than {MAX_MODULES:,}, not a real model")
    return {inv["module"].format(layer=layer, expert=e, proj=proj): shape
            for layer in layers for e in range(experts) for proj, shape in shapes.items()}


def module_pattern(profile: Profile) -> re.Pattern[str]:
    """The inventory's module name as a pattern: {layer} and {expert} numbers, {proj} one of its projections."""
    inv = profile.inventory or {}
    fields = {"layer": r"(?P<layer>\d+)", "expert": r"(?P<expert>\d+)",
              "proj": "(?:" + "|".join(re.escape(p) for p in inv.get("shapes", {})) + ")"}
    out = ""
    for text, name, _, _ in string.Formatter().parse(inv.get("module", "")):
        out += re.escape(text) + (fields.get(name, re.escape("{" + name + "}")) if name is not None else "")
    return re.compile(out)


def unexpected_modules(profile: Profile, config: dict, expected: dict[str, Any], found: Any) -> list[str]:
    """Converted modules named like the inventory's experts that the config does not describe (a layer
    it does not make MoE, an expert number past its count): a server builds no parameter for them.

    Layers [end, end + ``mtp_layers``), ``end`` the second of ``layers``, are let through, neither required nor
    refused: vLLM's K3 draft builds its MoE layers there (models/kimi_k3/amd/mtp.py 124-135). Only names missing
    from ``expected`` are matched, so a checkpoint the config describes costs no pattern match."""
    inv = profile.inventory
    if not inv:
        return []
    pattern, mtp = module_pattern(profile), range(0)
    if inv.get("mtp_layers"):
        try:
            n = lookup(config, inv["mtp_layers"])
        except KeyError:
            n = 0   # KimiLinearConfig's default num_nextn_predict_layers (configs/kimi_linear.py 49)
        if type(n) is not int or not 0 <= n <= MAX_LAYERS:
            raise BadInput(f"profile {profile.name!r}: config.json {inv['mtp_layers']} is {str(n)[:40]}, expected "
                           f"an integer in [0, {MAX_LAYERS:,}]")
        end = lookup(config, inv["layers"][1])   # checked by expected_modules
        mtp = range(end, end + n)
    out = []
    for module in found:
        if module in expected:
            continue
        m = pattern.fullmatch(module)
        if m and int(m.group("layer")) not in mtp:
            out.append(module)
    return out


def extras_problem(profile: Profile, expected: dict[str, Any], extra: list[str], packed: Any) -> str:
    """One line for converted modules the config does not describe: the first by file and tensor, the count."""
    inv = profile.inventory or {}
    keys = list(inv.get("layers") or [inv.get("layer_mask"), inv.get("layer_count")]) + [inv.get("experts")]
    first = packed(extra[0])
    return (f"file {first.path}, tensor {first.name}: config.json does not describe this expert matrix "
            f"({', '.join(k for k in keys if k)} give {len(expected):,}; the checkpoint holds {len(extra):,} more): "
            f"a server builds no parameter for it; correct config.json or remove the extra experts")


def _has(config: dict, key: str) -> bool:
    try:
        return lookup(config, key) is not None
    except KeyError:
        return False


def _moe_layers(profile: Profile, config: dict, key: str) -> list[int]:
    """The MoE layers of a per-layer 0/1 list (MiniMax-M3's and MiMo's ``moe_layer_freq``), or of a
    per-layer list of names where the inventory's ``moe_value`` names the MoE layers (GLM-5.3's
    ``mlp_layer_types``, "sparse")."""
    mask = lookup(config, key)
    named = (profile.inventory or {}).get("moe_value")
    if isinstance(named, str):
        if not (isinstance(mask, list) and len(mask) <= MAX_LAYERS and all(isinstance(x, str) for x in mask)):
            raise BadInput(f"profile {profile.name!r}: config.json {key} is {str(mask)[:40]}, expected one name "
                           f"per layer, {named!r} for MoE (at most {MAX_LAYERS:,})")
        return [i for i, kind in enumerate(mask) if kind == named]
    if not (isinstance(mask, list) and len(mask) <= MAX_LAYERS and all(type(x) in (int, bool) for x in mask)):
        raise BadInput(f"profile {profile.name!r}: config.json {key} is {str(mask)[:40]}, expected one integer "
                       f"per layer, nonzero for MoE (at most {MAX_LAYERS:,})")
    return [i for i, moe in enumerate(mask) if moe]


def inventory_problems(expected: dict[str, tuple[int, int]], found: dict[str, tuple[int, int]],
                       where: dict[str, str]) -> list[str]:
    """What an incomplete or different checkpoint lacks, in one line.

    ``found``: module -> [out, in] of the matrices that will be converted; ``where``: tensor
    name -> shard, from the index, to say where a missing module should have been.
    """
    missing = [m for m in expected if m not in found]
    wrong = [m for m in expected if m in found and tuple(found[m]) != tuple(expected[m])]
    problems = []
    if missing:
        def place(m: str) -> str:
            shards = sorted({where[t] for t in (f"{m}.{x}" for x in _TENSORS) if t in where})
            return f"{m} ({'the index puts it in ' + ', '.join(shards) if shards else 'not in the index'})"
        shown = ", ".join(place(m) for m in missing[:SHOWN])
        more = f" and {len(missing) - SHOWN:,} more" if len(missing) > SHOWN else ""
        problems.append(f"expected {len(expected):,} expert matrices, found {len(expected) - len(missing):,}: "
                        f"missing {shown}{more}")
    for m in wrong[:SHOWN]:
        problems.append(f"module {m}: shape {list(found[m])}, the profile expects {list(expected[m])}")
    return problems
