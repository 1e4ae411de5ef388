"""MASK-slot adapters that ship with Stride: one directory per base model, for `introspective`.

Each directory (named after its model) holds `config.json` and `model.safetensors`
(`engine.adapter`) and a `MODEL_CARD.md` saying how it was trained and how many tokens a pass
it makes on held-out prompts; `python -m stride.train --kind introspective` reproduces them.
This module reads only file names: the server asks it which adapter applies before any model
loads.
"""

from __future__ import annotations

from pathlib import Path

ADAPTERS = Path(__file__).parent


def shipped_adapter(served_name: str) -> Path | None:
    """The shipped adapter for a model served as `served_name` (a name, or the path it was
    loaded from): the directory whose name the model's file or directory name starts with."""
    name = Path(served_name).name
    for adapter in sorted(ADAPTERS.iterdir()):
        if (adapter / "config.json").is_file() and name.startswith(adapter.name):
            return adapter
    return None


def pick(mask_adapter: str | None, served_name: str) -> str | None:
    """The adapter a server uses: `--mask-adapter`, else the one shipped for its model."""
    if mask_adapter is not None:
        return mask_adapter
    shipped = shipped_adapter(served_name)
    return None if shipped is None else str(shipped)
