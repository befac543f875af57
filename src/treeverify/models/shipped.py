"""Checkpoints shipped inside the package (src/treeverify/models/data/<name>/, Hugging Face layout).

`tiny-code` is a Llama trained on Python source by scripts/train_tiny_code.py; its DFlash drafter
`tiny-code-dflash` (published DFlash v1 layout) by scripts/train_tiny_dflash.py (docs/dflash.md).
They load through the same code as any local checkpoint: these names only map to directories.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
SHIPPED_MODELS = ("tiny-code",)
SHIPPED_DRAFTERS = ("tiny-code-dflash",)
OWN_DRAFTER = {"tiny-code": "tiny-code-dflash"}  # a model -> the drafter trained against it


def shipped_dir(name: str) -> Path | None:
    """The directory of a shipped model or drafter name, None for any other string."""
    if name in SHIPPED_MODELS or name in SHIPPED_DRAFTERS:
        return DATA_DIR / name
    return None


def own_drafter(model: str) -> str | None:
    """The drafter shipped for `model` (a shipped name or its directory), else None."""
    name = str(model)
    for m, d in OWN_DRAFTER.items():
        if name == m or Path(name).resolve() == DATA_DIR / m:
            return d
    return None
