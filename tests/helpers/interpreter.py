"""Kernels checked on the CPU under Triton's interpreter: a subprocess started with
TRITON_INTERPRET=1, which Triton reads when a kernel is defined (too late in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, timeout: float) -> None:
    """Run `code` (Python) in the repository under the interpreter; fail with its stderr."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
