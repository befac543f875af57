"""`python -m treeverify.integrations.sglang.launch <sglang launch_server args>`.

Registers `--attention-backend treeverify` (registry.install), then runs SGLang's own
`sglang.launch_server` with the remaining arguments. The registration also runs when this module
is imported, because SGLang's spawned subprocesses re-import the main module; pip-installed
treeverify does not need this launcher (its `sglang.srt.plugins` entry point does the same).
"""

from __future__ import annotations

import runpy
import sys

from treeverify.integrations.sglang.availability import SGLangUnavailableError
from treeverify.integrations.sglang.registry import install

try:  # at import: spawned SGLang subprocesses import this module as their __mp_main__
    install()
    _INSTALL_ERROR: SGLangUnavailableError | None = None
except SGLangUnavailableError as exc:
    _INSTALL_ERROR = exc


def main(argv: list[str] | None = None) -> int:
    if _INSTALL_ERROR is not None:
        print(f"error: {_INSTALL_ERROR}", file=sys.stderr)
        return 2
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
