"""The fused draw and logprobs kernels give the plain tensor ops' tokens, token for token, and
log-softmax's logprobs: compiled on the GPU, and on the CPU under Triton's interpreter where
Triton is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import draws

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_draw_kernels_equal_the_plain_ops_on_the_gpu():
    draws.check("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs them compiled")
def test_draw_kernels_equal_the_plain_ops_under_the_interpreter():
    pytest.importorskip("triton")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    code = "from tests.helpers import draws; draws.check('cpu', quick=True)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
