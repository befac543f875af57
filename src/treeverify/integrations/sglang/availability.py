"""Is a usable SGLang installed? One clear error instead of a traceback from deep inside."""

from __future__ import annotations

import importlib
import re

MIN_VERSION = (0, 5, 23)
INSTALL_HINT = "pip install 'sglang>=0.5.23'"


class SGLangUnavailableError(ImportError):
    """SGLang is missing or too old for treeverify's attention backend."""


def _parse(version: str) -> tuple[int, ...]:
    parts = re.findall(r"\d+", version.split("+")[0])[:3]
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))


def require_sglang():
    """Import and return the ``sglang`` package, or raise SGLangUnavailableError saying why."""
    try:
        sglang = importlib.import_module("sglang")
    except ImportError as exc:
        raise SGLangUnavailableError(
            f"treeverify's SGLang backend needs SGLang >= 0.5.23, which is not importable here "
            f"({exc}); install it with `{INSTALL_HINT}`"
        ) from None
    version = getattr(sglang, "__version__", None)
    if version is None:
        try:
            version = importlib.import_module("sglang.version").__version__
        except (ImportError, AttributeError):
            version = "unknown"
    if version == "unknown" or _parse(version) < MIN_VERSION:
        raise SGLangUnavailableError(
            f"treeverify's SGLang backend needs SGLang >= 0.5.23, found {version}; upgrade with "
            f"`{INSTALL_HINT}`"
        )
    return sglang
