"""Compile the Triton kernels ahead of time for a GPU target, without a GPU, in a fresh process.

The tests that import the kernels for the interpreter (``TRITON_INTERPRET=1``,
:mod:`interpreted`) leave Triton unable to compile in their process, so a compilation runs a
script in a child Python with the variable removed. The script gets
:func:`missing_toolchain` (defined in :data:`TOOLCHAIN`, prepended to it) and prints one JSON
object as its last line: the results, or ``{"skip": reason}`` when this Triton cannot compile
for the target at all (no backend for it, no ``ptxas``). Any other failure, a compilation error
included (``ptxas`` rejecting the kernel's PTX, an MLIR pass failing), makes the child exit
non-zero and the test fail: it is what these tests exist to catch, never a reason to skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Source of ``missing_toolchain(triple)``, prepended to every script.
TOOLCHAIN = r'''
import json, sys


def missing_toolchain(triple):
    """Why this Triton cannot compile for the ``GPUTarget(*triple)`` here; None if it can."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    target = GPUTarget(*triple)
    if not any(b.compiler.supports_target(target) for b in backends.values()):
        return f"Triton has no backend for {triple}"
    if target.backend == "cuda":
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            get_ptxas(target.arch)  # the tool's lookup: RuntimeError("Cannot find ptxas")
        except RuntimeError as exc:
            return str(exc)
    return None

'''


def run(script: str, *argv: str, path: Path | None = None) -> dict:
    """The JSON object ``script`` prints last, run after :data:`TOOLCHAIN` in a fresh process
    without ``TRITON_INTERPRET`` (``path``: one more import directory). Skips the calling test
    when the script reports ``{"skip": reason}``; fails it when the script fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    dirs = [str(Path(__file__).resolve().parents[2])] + ([str(path)] if path else [])
    env["PYTHONPATH"] = os.pathsep.join([*dirs, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", TOOLCHAIN + script, *argv], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"cannot compile here: {result['skip']}")
    return result
