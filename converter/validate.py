"""Error figures per tensor and per layer (SPEC §6), and the report users read."""
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

    def row(self) -> dict:
        return asdict(self)


def figures(name: str, layer: int | None, err2: float, ref2: float, max_abs: float,
            nonfinite: int, out_rel: float | None = None) -> TensorFigures:
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
    snr = 10 * math.log10(ref2 / err2) if err2 > 0 else math.inf
    return TensorFigures(name, layer, rel, max_abs, snr, nonfinite, out_rel)


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

    from .formats import int4, mxfp4

    w = mxfp4.decode(packed, scales)
    x = probe(w.shape[1], w.device)
    ref = w @ x
    err = int4.decode(words, int4_scales) @ x - ref
    den = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(err)) / den if den > 0 else 0.0


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
            "rel_rmse_mean": sum(r.rel_rmse for r in rs) / len(rs),
            "rel_rmse_worst": max(r.rel_rmse for r in rs),
            "snr_db_mean": sum(r.snr_db for r in rs) / len(rs),
            "snr_db_worst": min(r.snr_db for r in rs),
            "max_abs_worst": max(r.max_abs for r in rs),
            "nonfinite": sum(r.nonfinite for r in rs),
            "out_rel_mean": sum(outs) / len(outs) if outs else None,
            "out_rel_worst": max(outs) if outs else None,
        })
    return out


def format_table(layers: list[dict], limit: int = 12) -> str:
    """A compact table for the terminal: the worst layers first when there are many."""
    head = f"{'layer':>5} {'tensors':>7} {'relRMSE mean':>12} {'worst':>8} {'SNR dB min':>10} {'out err worst':>13}"
    shown = sorted(layers, key=lambda r: -r["rel_rmse_worst"])[:limit] if len(layers) > limit else layers
    lines = [head]
    for r in shown:
        out = f"{r['out_rel_worst']:.4f}" if r["out_rel_worst"] is not None else "-"
        layer = "-" if r["layer"] is None else r["layer"]
        lines.append(f"{layer:>5} {r['tensors']:>7} {r['rel_rmse_mean']:>12.4f} {r['rel_rmse_worst']:>8.4f} "
                     f"{r['snr_db_worst']:>10.2f} {out:>13}")
    if len(layers) > limit:
        lines.append(f"({limit} worst of {len(layers)} layers shown)")
    return "\n".join(lines)
