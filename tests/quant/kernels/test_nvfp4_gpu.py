"""The NVFP4 scale search's Triton kernel (``kernels/triton_nvfp4.py``) gives the numba kernel's scales
bit for bit, and both the exhaustive optimum over every positive bf16 scale (issue 42 §3).

The kernel runs under Triton's interpreter in a child process (``interpreted.run_interpreted``: the
variable must be set before triton is imported) on small inputs: the adversarial groups of
tests/formats/test_nvfp4.py in both global-scale conventions, and realistic groups (heavy-tailed weights
through compressed-tensors' own NVFP4 encoder). Its compilation for AMD CDNA is in test_kernel_amd.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from interpreted import run_interpreted  # noqa: E402

from converter.quant import nvfp4_requant as nv  # noqa: E402
from tests.formats.test_nvfp4 import _groups  # noqa: E402

GSCALES = {"ct-divide": nv.GlobalScale(1703.2871, True), "modelopt-multiply": nv.GlobalScale(3.7e-4, False),
           "unit": nv.GlobalScale(1.0, False)}
# the server rule's edges: values around its amax floor bf16(1e-6), and values past bf16's range
SERVER_EDGES = {"server-tiny": nv.GlobalScale(2.5e-7, False), "server-overflow": nv.GlobalScale(1e36, False)}


def _cases() -> dict[str, tuple[torch.Tensor, torch.Tensor, nv.GlobalScale]]:
    """name -> (packed uint8 [G, 16], E4M3 block scales [G, 2], global scale)."""
    from tests.models.test_nvfp4_convert import ct_nvfp4_encode
    out = {}
    for name, gs in GSCALES.items():
        packed, scales = _groups(40, 3)
        out[f"adversarial-{name}"] = (packed, scales, gs)
    for name, gs in SERVER_EDGES.items():
        packed, scales = _groups(40, 4)
        out[name] = (packed, scales, gs)
    torch.manual_seed(42)
    w = torch.distributions.StudentT(4.0).sample((2, 512)) / 20
    enc = ct_nvfp4_encode(w)
    out["student-t"] = (enc["weight_packed"].reshape(-1, 16), enc["weight_scale"].reshape(-1, 2),
                        nv.GlobalScale(float(enc["weight_global_scale"]), True))
    return out


def _child_main(path: str) -> None:
    from converter.kernels.triton_nvfp4 import requantize
    res = {}
    for name, (packed, scales, gs) in _cases().items():
        for key, x in zip(("scale", "words", "err2", "ref2", "amax", "server"), requantize(packed, scales, gs.value, gs.divide)):
            res[f"{name}/{key}"] = x.numpy()
    np.savez(path, **res)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> dict[str, np.ndarray]:
    return run_interpreted(__name__, tmp_path_factory.mktemp("nvfp4") / "out.npz")


@pytest.mark.parametrize("name", [f"adversarial-{n}" for n in GSCALES] + ["student-t"])
def test_kernel_scales_are_the_cpu_search_and_the_optimum(kernel, name):
    packed, scales, gs = _cases()[name]
    got = torch.from_numpy(kernel[f"{name}/scale"])
    cpu = nv.search(packed, scales, gs)
    assert torch.equal(got.view(torch.int64), cpu.view(torch.int64)), (got != cpu).nonzero()
    v = nv.decode(packed, scales, gs).reshape(-1, 32)
    ours = nv.optimal(v, cpu)
    # the kernel's codes are the CPU path's bytes; its figures the same sums (any order)
    assert torch.equal(torch.from_numpy(kernel[f"{name}/words"]).reshape(-1), nv.pack_int4(ours.q).reshape(-1))
    diff = ours.q.double() * cpu.unsqueeze(1) - v
    assert torch.allclose(torch.from_numpy(kernel[f"{name}/err2"]), ours.err2, rtol=1e-13, atol=0)
    assert torch.allclose(torch.from_numpy(kernel[f"{name}/ref2"]), (v * v).sum(1), rtol=1e-13, atol=0)
    assert torch.equal(torch.from_numpy(kernel[f"{name}/amax"]), diff.abs().amax(1))
    best, best_scale = nv.brute_force(v)
    err = ours.err2
    assert not ((err - best).abs() > 1e-12 * best + 1e-300).any()
    nonzero = v.abs().amax(1) > 0
    # ties go to the smaller scale, as the exhaustive search's argmin (first in ascending order) does
    assert torch.equal(got[nonzero], best_scale[nonzero]) and not got[~nonzero].any()


@pytest.mark.parametrize("name", [f"adversarial-{n}" for n in GSCALES] + ["student-t", *SERVER_EDGES])
def test_kernel_server_figure_is_the_torch_rule(kernel, name):
    """The server rule's squared error the kernel gives per group is ``nvfp4_requant.server_rule``'s (torch:
    bf16 values, aiter's amax / 7 and RTN), inf exactly where that rule's bf16 values are not finite."""
    packed, scales, gs = _cases()[name]
    v = nv.decode(packed, scales, gs).reshape(-1, 32)
    ref = nv.server_rule(v)
    got = torch.from_numpy(kernel[f"{name}/server"])
    bad = ref.out_of_range
    assert torch.equal(torch.isinf(got), bad)
    assert torch.allclose(got[~bad], ref.err2[~bad], rtol=1e-13, atol=0)
    amax = v.abs().amax(1)
    if name == "server-tiny":   # the floor is met: groups below it, nonzero, and above it
        assert ((amax > 0) & (amax < 1e-6)).any() and (amax > 1e-6).any()
    if name == "server-overflow":
        assert bad.any() and not bad.all()
