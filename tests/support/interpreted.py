"""Run a test module's ``_child_main(out.npz)`` in a child process under ``TRITON_INTERPRET=1``.

Triton reads the variable at import, so the kernels run interpreted only in a fresh process;
the child writes its arrays to an .npz that the test compares with the CPU path.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]


def run_interpreted(module: str, out: pathlib.Path) -> dict[str, np.ndarray]:
    """``module._child_main(out)`` under the Triton interpreter (``module``: the test's ``__name__``); its arrays."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]))
    code = f"import sys, {module} as t; t._child_main(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}
