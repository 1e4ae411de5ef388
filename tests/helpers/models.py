"""Tiny random models and a tiny tokenizer, built in-process: fast, exact in fp32, no downloads."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    PreTrainedTokenizerFast,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b",
    "Once upon a time there was a small model that could count: 1, 2, 3, 4, 5.",
    "Hello, world! Stride serves language models; speculative decoding drafts tokens.",
    "for i in range(10): print(i) # loops, lists, dicts and strings in Python",
    "Ünïcödé ✓ 日本語 emojis 🙂 and other bytes keep byte-level BPE honest.",
]
VOCAB_SIZE = 384

ARCHS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2", use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "mistral": dict(model_type="mistral", sliding_window=None),
}


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model_dir(
    path: Path, arch: str = "llama", seed: int = 0, layers: int = 2, **overrides
) -> Path:
    """Write a random `arch` model with the tiny tokenizer to `path` (a Hugging Face directory)."""
    tokenizer = make_tokenizer()
    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    fields.update(ARCHS[arch])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_decisive(model, tokenizer, path)


def save_decisive(model, tokenizer, path: Path) -> Path:
    """Rescale `model`'s matrices and write it with `tokenizer` to `path`. Random init gives
    near-uniform logits; a larger scale makes greedy choices decisive."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_hf(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


MASK = VOCAB_SIZE  # the tiny tokenizer plus one added mask token


def make_diffusion_dir(path: Path, seed: int = 0) -> Path:
    """A tiny random bidirectional masked LM (BERT) over the tiny tokenizer plus a mask token."""
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    assert tokenizer.mask_token_id == MASK
    config = BertConfig(
        vocab_size=VOCAB_SIZE + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return save_decisive(BertForMaskedLM(config), tokenizer, path)

