"""treeverify: tree speculative-decoding verify attention — fast, capture-safe, checked.

The package root stays light (no torch import); the op lives in ``treeverify.kernels``.
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("treeverify")
except _metadata.PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.1.0+src"

__all__ = ["__version__"]
