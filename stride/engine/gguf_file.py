"""A GGUF file served as a Hugging Face directory whose weights stay quantized on disk.

The first time a GGUF file is served, what is slow to get out of it is written into a cache
directory once: `config.json` (with `architectures`), `generation_config.json`, the tokenizer
(converting the GGUF vocabulary takes seconds), a symlink `model.gguf` to the file itself and an
index of its tensors (name, type, shape, byte offset). The weights are never written out: every
load reads the quantized blocks straight from the file and dequantizes them with torch, in the
same float32 operations as `gguf`'s numpy reference (which transformers' GGUF loader uses), so a
float32 model holds bit-identical weights. Dequantized float32 would take 517 MB on disk for
the default model (its GGUF: 98 MB); bfloat16 would halve that but cannot hold Q4_1's values
exactly (docs/BENCHMARKS.md has the measurements). The directory loads in transformers as
`from_pretrained(path, gguf_file="model.gguf")`.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

GGUF_LINK = "model.gguf"
INDEX = "gguf_tensors.json"
# The tokenizer class the cache names: transformers 5 saves `TokenizersBackend`, which only it
# knows; this name every transformers since 4.0 loads (in 5 it is the same class).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def is_gguf_dir(path: Path) -> bool:
    return (path / INDEX).is_file() and (path / GGUF_LINK).exists()


def transformers_kwargs(path: Path) -> dict[str, str]:
    """What transformers' `from_pretrained` needs to load the model directory `path` itself
    (bench/ and tests/ compare against it): the GGUF file's name when the weights are in one."""
    return {"gguf_file": GGUF_LINK} if is_gguf_dir(path) else {}


def convert(gguf: Path, out: Path) -> None:
    """Write `out`: config, generation config, tokenizer, tensor index and a link to `gguf`.

    Each conversion writes a directory of its own and renames it into place, so processes that
    start on one file at once (a server beside a trainer, workers of one node) all succeed: the
    first to finish provides `out`, the others drop their copy."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    start = time.perf_counter()
    log.info("first use of %s: converting its tokenizer and config into %s", gguf.name, out)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.architectures = [_architecture(config.model_type)]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights stay in the GGUF file, read as they are
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    settings = json.loads((tmp / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = TOKENIZER_CLASS
    (tmp / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    log.info("tokenizer converted (%.1f s); indexing the weights", time.perf_counter() - start)
    reader = GGUFReader(gguf)
    arch = str(reader.fields["general.architecture"].contents())
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        tensors[name] = {
            "type": t.tensor_type.name,
            "shape": [int(n) for n in reversed(t.shape)],  # GGUF lists the fastest axis first
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
            "heads": _permuted_heads(arch, t.name, config),
        }
    (tmp / INDEX).write_text(json.dumps({"file": gguf.name, "tensors": tensors}, indent=1))
    (tmp / GGUF_LINK).symlink_to(gguf.resolve())
    if not is_gguf_dir(out):
        shutil.rmtree(out, ignore_errors=True)  # an older Stride's cache: 517 MB of float32
    try:
        tmp.rename(out)
    except OSError:  # another conversion finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_gguf_dir(out):
            raise
    log.info("converted in %.1f s (later starts reuse it)", time.perf_counter() - start)


def _architecture(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


# GGUF's per-block tensor names -> Hugging Face's (the Llama family's layout).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None: not a weight of
    the model (e.g. precomputed rotary factors)."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    return None


def _permuted_heads(arch: str, name: str, config) -> int | None:
    """llama.cpp stores Llama's q/k rows interleaved for its rotary; transformers undoes it
    (`LlamaTensorProcessor`): the head count to undo it with, or None."""
    if arch != "llama" or not name.endswith("weight"):
        return None
    if ".attn_q." in name:
        return config.num_attention_heads
    if ".attn_k." in name:
        return config.num_key_value_heads
    return None


def load_weights(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every weight of the GGUF directory `path`, dequantized, as `dtype` on `device`; `shard`
    maps each (name, whole tensor) to what this process keeps of it (a tensor-parallel slice).

    On one thread: these element-wise ops on tensors of a few hundred thousand values gain
    nothing from more, and on a busy machine OpenMP's spin-waits slow the whole load down
    (docs/BENCHMARKS.md, "Design choices").
    """
    index = json.loads((path / INDEX).read_text())
    state = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with open(path / GGUF_LINK, "rb") as f:
            for name, t in index["tensors"].items():
                f.seek(t["offset"])
                raw = torch.from_numpy(np.fromfile(f, dtype=np.uint8, count=t["bytes"]))
                w = dequantize(raw, t["type"], t["shape"])
                if t["heads"]:
                    w = _unpermute(w, t["heads"])
                if shard is not None:
                    w = shard(name, w)
                state[name] = w.to(device=device, dtype=dtype)
    finally:
        torch.set_num_threads(threads)
    return state


def dequantize(raw: torch.Tensor, kind: str, shape: list[int]) -> torch.Tensor:
    """Bytes of one tensor -> float32 values, bit for bit as `gguf.quants.dequantize` makes them.

    Q4_1 and Q8_0 (what the default model holds) and plain floats run in torch; any other kind
    goes through gguf's numpy reference itself.
    """
    if kind == "F32":
        return raw.view(torch.float32).reshape(shape)
    if kind in ("F16", "BF16"):
        return raw.view(torch.float16 if kind == "F16" else torch.bfloat16).float().reshape(shape)
    if kind == "Q4_1":  # blocks of 32: fp16 scale d, fp16 minimum m, 16 bytes of 4-bit q
        blocks = raw.view(-1, 20)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        qs = blocks[:, 4:]
        q = torch.stack([qs & 0x0F, qs >> 4], dim=1).reshape(-1, 32).float()
        return (d * q + m).reshape(shape)  # two roundings, like numpy's (d * q) + m
    if kind == "Q8_0":  # blocks of 32: fp16 scale d, 32 int8 q
        blocks = raw.view(-1, 34)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    values = reference(raw.numpy().reshape(shape[0], -1), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
