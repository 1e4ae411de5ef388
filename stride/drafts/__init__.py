"""Draft heads that ship with Stride: one EAGLE-3 head directory per target model.

Each directory (named after its target) holds `config.json` and `model.safetensors` in the
EAGLE-3 layout, without the draft vocabulary's head rows, which are read from the target
(`engine.eagle.save_head`), and a `MODEL_CARD.md` saying how it was trained and what it
accepts. `stride draft train` reproduces them. This module reads only JSON: the server asks it
which draft is the default before any model loads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HEADS = Path(__file__).parent
EAGLE3 = "LlamaForCausalLMEagle3"


def shipped_head(served_name: str) -> Path | None:
    """The shipped head for a model served as `served_name` (a name, or the path it was loaded
    from): the head directory whose name the model's file or directory name starts with."""
    name = Path(served_name).name
    for head in sorted(HEADS.iterdir()):
        if (head / "config.json").is_file() and name.startswith(head.name):
            return head
    return None


def is_head(path: str | Path) -> bool:
    """Does `path` hold an EAGLE head (either layout) rather than a model of its own?"""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    if EAGLE3 in (raw.get("architectures") or []) or "draft_vocab_size" in raw:
        return True
    # EAGLE-1/2 heads come with a plain Llama config: their weights say what they are.
    return any("fc.weight" in _tensor_names(f) for f in path.glob("*.safetensors"))


def _tensor_names(file: Path) -> set[str]:
    """The tensor names in a safetensors file's header (8-byte length, then JSON)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return set(json.loads(f.read(size))) - {"__metadata__"}


def pick(
    draft_head: str | None, draft_model: str | None, served_name: str
) -> tuple[str | None, str | None]:
    """(EAGLE head, draft model) a server uses: `--draft-model` may name a head; without
    either, the head shipped for the served model, if any."""
    if draft_head is None and draft_model is not None and is_head(draft_model):
        draft_head, draft_model = draft_model, None
    if draft_head is None and draft_model is None:
        shipped = shipped_head(served_name)
        draft_head = None if shipped is None else str(shipped)
    return draft_head, draft_model
