"""The engine's rotary embedding is transformers' Llama one, bit for bit, for every rope type."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from stride.engine.model import Rotary

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},  # fmt: skip
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64},  # fmt: skip
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_equals_transformers(rope):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                         rope_parameters=ROPES[rope])  # fmt: skip
    ours, theirs = Rotary(config), LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 1, dtype=torch.float32)
    for positions in (torch.arange(7)[None], torch.arange(100, 300)[None], torch.arange(5)[None]):
        for a, b in zip(ours(x, positions), theirs(x, positions), strict=True):
            assert torch.equal(a, b)
