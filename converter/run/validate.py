"""Error figures per tensor and per layer (docs/spec.md §6), and the report users read."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are used: the coordinating process never needs it
    import torch



@dataclass
class TensorFigures:
    name: str
    layer: int | None
    rel_rmse: float      # ||W_int4 - W_mxfp4|| / ||W_mxfp4||
    max_abs: float
    snr_db: float
    nonfinite: int
    out_rel: float | None = None  # ||(W_int4 - W_mxfp4) x|| / ||W_mxfp4 x||, sampled tensors only
    # the same two figures for the other scale rule on the same weights (report's "compare_rule":
    # the server's load-time rule when this run wrote the optimum, the optimum otherwise)
    cmp_rel_rmse: float | None = None
    cmp_out_rel: float | None = None

    def row(self) -> dict:
        return asdict(self)


def _rel(err2: float, ref2: float) -> float:
    return math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)


def figures(name: str, layer: int | None, err2: float, ref2: float, max_abs: float,
            nonfinite: int, out_rel: float | None = None, cmp_err2: float | None = None,
            cmp_out_rel: float | None = None) -> TensorFigures:
    snr = 10 * math.log10(ref2 / err2) if err2 > 0 else math.inf
    cmp = None if cmp_err2 is None else _rel(cmp_err2, ref2)
    return TensorFigures(name, layer, _rel(err2, ref2), max_abs, snr, nonfinite, out_rel, cmp, cmp_out_rel)


def error_ratio(rows: list, ours: str = "rel_rmse", other: str = "cmp_rel_rmse") -> float | None:
    """Mean of the other rule's figure over the mean of ours, on the rows that have both
    (dicts or TensorFigures): "server load-time int4: 1.37x our error"."""
    get = (lambda r, k: r.get(k)) if rows and isinstance(rows[0], dict) else getattr
    pairs = [(get(r, ours), get(r, other)) for r in rows]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    a = math.fsum(p[0] for p in pairs)
    return math.fsum(p[1] for p in pairs) / a if pairs and a > 0 else None


_PROBES: dict[tuple[int, str], "torch.Tensor"] = {}


def probe(cols: int, device: "torch.device | str" = "cpu") -> "torch.Tensor":
    """The fixed random input x for output errors: the same for a given width on every run."""
    import torch

    key = (cols, str(device))
    if key not in _PROBES:
        x = torch.randn(cols, generator=torch.Generator().manual_seed(cols))
        _PROBES[key] = x.to(device)
    return _PROBES[key]


def output_error(packed: "torch.Tensor", scales: "torch.Tensor", words: "torch.Tensor",
                 int4_scales: "torch.Tensor") -> float:
    """||(W_int4 - W) x|| / ||W x|| for the fixed probe x, decoding on the tensors' device (GPU)."""
    import torch

    from ..formats import int4, mxfp4

    w = mxfp4.decode(packed, scales)
    x = probe(w.shape[1], w.device)
    ref = w @ x
    err = int4.decode(words, int4_scales) @ x - ref
    den = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(err)) / den if den > 0 else 0.0


def mean(xs) -> float:
    """The mean, summed exactly (math.fsum): the same figure whatever order the tensors came
    in, so a report does not change with the core count or the number of workers."""
    xs = list(xs)
    return math.fsum(xs) / len(xs) if xs else 0.0


def layer_summary(rows: list[TensorFigures]) -> list[dict]:
    """Per layer: how many tensors, and the mean and worst of each figure."""
    by_layer: dict = {}
    for r in rows:
        by_layer.setdefault(r.layer, []).append(r)
    out = []
    for layer in sorted(by_layer, key=lambda x: (x is None, x)):
        rs = by_layer[layer]
        outs = [r.out_rel for r in rs if r.out_rel is not None]
        out.append({
            "layer": layer, "tensors": len(rs),
            "rel_rmse_mean": mean(r.rel_rmse for r in rs),
            "rel_rmse_worst": max(r.rel_rmse for r in rs),
            "snr_db_mean": mean(r.snr_db for r in rs),
            "snr_db_worst": min(r.snr_db for r in rs),
            "max_abs_worst": max(r.max_abs for r in rs),
            "nonfinite": sum(r.nonfinite for r in rs),
            "out_rel_mean": mean(outs) if outs else None,
            "out_rel_worst": max(outs) if outs else None,
            **_cmp_summary(rs),
        })
    return out


def _cmp_summary(rs: list[TensorFigures]) -> dict:
    """Per layer, the other scale rule's figures (absent for tables written before them)."""
    cmp = [r.cmp_rel_rmse for r in rs if r.cmp_rel_rmse is not None]
    if not cmp:
        return {}
    outs = [r.cmp_out_rel for r in rs if r.cmp_out_rel is not None]
    return {"cmp_rel_rmse_mean": mean(cmp), "cmp_rel_rmse_worst": max(cmp),
            "cmp_out_rel_worst": max(outs) if outs else None, "cmp_ratio": error_ratio(rs)}


def _num(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def format_table(layers: list[dict], limit: int = 12, rule: str = "optimal") -> str:
    """A compact table for the terminal: the worst layers first when there are many; with the
    other scale rule's figures and their ratio to ours where the report has them. Each heading
    names one column, with its unit, and sits right-aligned over its numbers, two spaces apart."""
    cmp = any(r.get("cmp_rel_rmse_mean") is not None for r in layers)
    shown = sorted(layers, key=lambda r: -r["rel_rmse_worst"])[:limit] if len(layers) > limit else layers
    cols = [("layer", lambda r: "-" if r["layer"] is None else str(r["layer"])),
            ("tensors", lambda r: str(r["tensors"])),
            ("rel RMSE mean", lambda r: _num(r["rel_rmse_mean"], ".4f")),
            ("rel RMSE worst", lambda r: _num(r["rel_rmse_worst"], ".4f")),
            ("SNR min (dB)", lambda r: _num(r["snr_db_worst"], ".2f")),
            ("out err worst", lambda r: _num(r["out_rel_worst"], ".4f"))]
    if cmp:
        cols += [(f"{cmp_label(rule)[0]} rel RMSE", lambda r: _num(r.get("cmp_rel_rmse_mean"), ".4f")),
                 ("ratio (x ours)", lambda r: _num(r.get("cmp_ratio"), ".2f", "x"))]
    cells = [[f(r) for _, f in cols] for r in shown]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (h, _) in enumerate(cols)]
    lines = ["  ".join(h.rjust(w) for (h, _), w in zip(cols, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    if len(layers) > limit:
        lines.append(f"({limit} worst of {len(layers)} layers shown)")
    return "\n".join(lines)


def cmp_label(rule: str) -> tuple[str, str]:
    """(short column name, sentence start) for the other rule's figures in a run of ``rule``."""
    if rule == "vllm-gfx942":
        return "optimal", "the optimal rule (k3convert's default)"
    return "server", "server load-time int4 (vLLM gfx942)"


def ratio_line(ratio: float | None, rule: str = "optimal") -> str | None:
    """"server load-time int4 (vLLM gfx942): 1.37x our error", or None without figures."""
    if ratio is None:
        return None
    if rule == "vllm-gfx942":
        return (f"written with the server's load-time rule (vllm-gfx942); {cmp_label(rule)[1]} would give "
                f"{ratio:.2f}x this error")
    return f"{cmp_label(rule)[1]}: {ratio:.2f}x our error"

