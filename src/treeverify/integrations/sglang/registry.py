"""Registering `--attention-backend treeverify` with SGLang (>= 0.5.23) from outside its tree.

SGLang keeps backend factories in a module dict filled by a decorator and validates the CLI flag
against a choices list it lets plugins extend (facts: shared/design/sglang-backend.md §1). So
`install()` registers our factory and adds the name; it must run in every SGLang process before
the arguments are parsed. Two ways get it there:
* the `sglang.srt.plugins` entry point in our pyproject (`plugin()` below), which SGLang's
  `load_plugins()` calls in the launcher, the scheduler and the other subprocesses;
* `python -m treeverify.integrations.sglang.launch <sglang args>` (launch.py), for a checkout that
  is not pip-installed.
"""

from __future__ import annotations

import importlib
import logging

from treeverify.integrations.sglang.availability import SGLangUnavailableError, require_sglang

log = logging.getLogger(__name__)

BACKEND_NAME = "treeverify"
# MLA models pass the absorbed q/k as one 576-wide row to any backend outside SGLang's absorb list,
# in every mode; of the stock backends only Triton takes that layout for prefill and decode.
MLA_FALLBACKS = ("triton",)


def build_backend(runner, fallback: str | None = None, kernel: str | None = None):
    """SGLang's factory for our name: wrap the stock `fallback` backend built for `runner`."""
    from treeverify import env
    from treeverify.integrations.sglang.backend import TreeverifyAttnBackend
    from treeverify.integrations.sglang.geometry import geometry_from_runner

    registry = importlib.import_module("sglang.srt.layers.attention.attention_registry")
    name = fallback or env.sglang_fallback()
    if name == BACKEND_NAME or name not in registry.ATTENTION_BACKENDS:
        known = sorted(n for n in registry.ATTENTION_BACKENDS if n != BACKEND_NAME)
        raise ValueError(
            f"TREEVERIFY_SGLANG_FALLBACK: {name!r} is not a stock SGLang attention backend; "
            f"choose one of {known}"
        )
    geometry = geometry_from_runner(runner)
    if geometry.mla and name not in MLA_FALLBACKS:
        raise ValueError(
            f"TREEVERIFY_SGLANG_FALLBACK: {name!r} cannot serve an MLA model behind treeverify "
            f"(SGLang hands outside backends the concatenated 576-wide q/k); use one of "
            f"{list(MLA_FALLBACKS)}"
        )
    translator = getattr(runner, "kv_index_translator", None)
    if getattr(translator, "is_translating", False):
        raise ValueError(
            "token_to_kv_pool: this pool translates KV ids (unified hybrid / fused draft pool); "
            "treeverify's verify reads req_to_token as physical slots and supports plain pools"
        )
    inner = registry.ATTENTION_BACKENDS[name](runner)
    log.info("treeverify: target-verify on treeverify (%s), other modes on %s", kernel, name)
    return TreeverifyAttnBackend(
        inner, geometry, kernel=kernel or env.sglang_kernel(),
        req_to_token=runner.req_to_token_pool.req_to_token,
    )  # fmt: skip


def install() -> None:
    """Register `treeverify` as an SGLang attention backend (idempotent). Raises
    SGLangUnavailableError (an ImportError naming `pip install sglang`) without SGLang >= 0.5.23."""
    require_sglang()
    registry = importlib.import_module("sglang.srt.layers.attention.attention_registry")
    if BACKEND_NAME not in registry.ATTENTION_BACKENDS:
        registry.register_attention_backend(BACKEND_NAME)(build_backend)
    choices = importlib.import_module("sglang.srt.arg_groups.choices")
    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])
    # EAGLE trees (topk > 1) at page_size > 1 are refused unless the target backend is listed.
    hook = importlib.import_module("sglang.srt.arg_groups.speculative_hook")
    paged = getattr(hook, "_PAGE_TREE_SPEC_BACKENDS", None)
    if isinstance(paged, tuple) and BACKEND_NAME not in paged:
        hook._PAGE_TREE_SPEC_BACKENDS = (*paged, BACKEND_NAME)


def plugin() -> None:
    """The `sglang.srt.plugins` entry point: SGLang calls it in each of its processes.

    Beside an SGLang older than 0.5.23 it only warns, so installing treeverify never breaks an
    SGLang that does not use it; asking for `--attention-backend treeverify` there is then
    refused by SGLang's own argument check.
    """
    try:
        install()
    except SGLangUnavailableError as exc:
        log.warning("treeverify attention backend not registered: %s", exc)
