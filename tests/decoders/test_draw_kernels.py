"""The fused draw and logprobs kernels give the plain tensor ops' tokens, token for token, and
log-softmax's logprobs: compiled on the GPU, and on the CPU under Triton's interpreter where
Triton is installed."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import draws, interpreter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_draw_kernels_equal_the_plain_ops_on_the_gpu():
    draws.check("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs them compiled")
def test_draw_kernels_equal_the_plain_ops_under_the_interpreter():
    pytest.importorskip("triton")
    interpreter.run("from tests.helpers import draws; draws.check('cpu', quick=True)", 300)
