"""A masked diffusion LM (LLaDA / Dream / MDLM convention) and its batched forward pass.

Such a model attends bidirectionally and returns logits for every position; generation appends
mask tokens and unmasks them over several passes. There is no causal KV reuse, so a pass
recomputes each sequence in full: the batch is right-padded and an attention mask hides the pad.

Loading goes through transformers: `AutoModelForMaskedLM` for architectures it knows, or
`AutoModel` with remote code (LLaDA, Dream) only when the user opted in with trust_remote_code.
The model must share the target's tokenizer (token ids mean the same text), because prompts come
tokenized and outputs are detokenized by the target's tokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer

log = logging.getLogger(__name__)


class DiffusionModel:
    def __init__(
        self,
        model: nn.Module,
        mask_token_id: int,
        device: torch.device,
        pad_token_id: int = 0,
        shift_logits: bool = False,
        max_len: int | None = None,
    ) -> None:
        self.model = model.eval()
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.device = device
        self.shift_logits = shift_logits  # Dream predicts position i from the hidden state at i-1
        self.max_len = max_len or 1 << 30

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
    ) -> tuple[DiffusionModel, object]:
        """Load a diffusion LM from a local directory; returns the model and its tokenizer."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(
                f"diffusion model {str(path)!r} is not a local directory (this machine cannot "
                "download from a model hub)"
            )
        kwargs = {"dtype": dtype or torch.float32, "trust_remote_code": trust_remote_code}
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForMaskedLM.from_pretrained(path, **kwargs)
        except ValueError as e:
            if not trust_remote_code:
                raise ValueError(
                    f"{path} is not a masked LM transformers knows ({e}); diffusion LMs with their "
                    "own code (LLaDA, Dream) need the explicit --trust-remote-code opt-in"
                ) from e
            config = AutoConfig.from_pretrained(path, trust_remote_code=True)
            model = AutoModel.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        mask_id = getattr(config, "mask_token_id", None)
        if mask_id is None:
            mask_id = tokenizer.mask_token_id
        if mask_id is None:
            raise ValueError(f"{path}: neither the config nor the tokenizer names a mask token")
        pad = tokenizer.pad_token_id
        max_len = getattr(config, "max_position_embeddings", None)
        log.info("diffusion model %s: mask token %d", path, mask_id)
        diffusion = cls(
            model.to(device),
            mask_id,
            device,
            pad_token_id=mask_id if pad is None else pad,
            shift_logits=config.model_type == "Dream",
            max_len=max_len,
        )
        return diffusion, tokenizer

    @torch.inference_mode()
    def forward(self, batch: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        """Score right-padded sequences; returns each one's last `num_logits` rows, fp32."""
        lengths = [len(ids) for ids in batch]
        width = max(lengths)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, tokens in enumerate(batch):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            attention[i, : len(tokens)] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        out = self.model(input_ids=ids, attention_mask=attention)
        logits = out.logits if hasattr(out, "logits") else out[0]
        if self.shift_logits:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        rows = [
            logits[i, n - k : n] for i, (n, k) in enumerate(zip(lengths, num_logits, strict=True))
        ]
        return [r.float() for r in rows]
