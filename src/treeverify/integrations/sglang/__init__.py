"""treeverify's tree-verify kernel as an SGLang (>= 0.5.23) attention backend.

`--attention-backend treeverify` after `install()` (or through the `sglang.srt.plugins` entry
point, or `python -m treeverify.integrations.sglang.launch`); docs/sglang.md says how to run it.
Nothing here imports SGLang until it is used, so the package imports without it.

- availability.py: `require_sglang()`, the version check and the one clear error;
- registry.py: `install()`, the plugin entry point, SGLang's factory for our name;
- backend.py: `TreeverifyAttnBackend`, verify on our plan, every other mode on a stock backend;
- verify_metadata.py: SGLang's verify batch (req_to_token, seq_lens, flat mask) -> plan buffers;
- geometry.py: the shapes a plan needs, from SGLang's ModelRunner.
"""

from __future__ import annotations

from treeverify.integrations.sglang.availability import SGLangUnavailableError, require_sglang
from treeverify.integrations.sglang.registry import BACKEND_NAME, install

__all__ = [
    "BACKEND_NAME",
    "SGLangUnavailableError",
    "TreeverifyAttnBackend",
    "install",
    "require_sglang",
]


def __getattr__(name: str):
    if name == "TreeverifyAttnBackend":
        from treeverify.integrations.sglang.backend import TreeverifyAttnBackend

        return TreeverifyAttnBackend
    raise AttributeError(name)
