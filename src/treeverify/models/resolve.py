"""``--model`` -> what ``load_model`` takes: a built-in name, a local directory, or a hub id
resolved from the local Hugging Face cache (offline: nothing is downloaded).

A name that resolves to nothing raises ``ModelNotFound`` with one line that says what was tried,
so the CLI can print it and exit 2 instead of a traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(Exception):
    """--model names no built-in model, no model directory and no cached hub id."""


def _builtin_names() -> list[str]:
    from treeverify.models.gguf_loader import GGUF_MODELS
    from treeverify.models.shipped import SHIPPED_MODELS
    from treeverify.models.tiny import TINY_MODELS

    return sorted((*TINY_MODELS, *GGUF_MODELS, *SHIPPED_MODELS))


def resolve_model(name: str) -> str:
    """A built-in name unchanged, a local model directory, or a cached hub snapshot's path."""
    builtins = _builtin_names()
    if name in builtins or name.startswith("random:"):
        return name
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"--model {name}: the directory has no config.json (not a Hugging Face model)"
            )
        return str(path)
    if path.exists():
        raise ModelNotFound(f"--model {name}: not a directory")
    if _HUB_ID.match(name) and not name.startswith((".", "~")):
        return str(_from_hub_cache(name))
    raise ModelNotFound(
        f"--model {name}: no such directory; expected one of {', '.join(builtins)}, a local "
        f"Hugging Face directory, or a hub id (org/name) already in the local cache"
    )


def _from_hub_cache(repo_id: str) -> Path:
    """The cached snapshot of ``repo_id`` (HF_HUB_CACHE / HF_HOME honoured by huggingface_hub)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        raise ModelNotFound(
            f"--model {repo_id}: resolving a hub id needs huggingface_hub "
            f"(pip install 'treeverify[server]'), or pass a local directory"
        ) from None
    try:
        snapshot = Path(snapshot_download(repo_id=repo_id, local_files_only=True))
    except Exception as exc:  # not cached, a malformed id, ...: one line either way
        raise ModelNotFound(
            f"--model {repo_id}: not a local directory and not in the local Hugging Face cache "
            f"({HF_HUB_CACHE}); this server never downloads: fetch it first "
            f"(hf download {repo_id}) ({type(exc).__name__})"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ModelNotFound(f"--model {repo_id}: the cached snapshot {snapshot} has no config.json")
    return snapshot
