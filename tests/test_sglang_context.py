"""bench/sglang_context.py without SGLang: the sgl_kernel stub imports any submodule, records
the names touched and refuses to run anything; publishing needs SGLang and says so."""

from __future__ import annotations

import importlib
import random
import sys

import pytest

from treeverify.bench import sglang_context


def test_sgl_kernel_stub_imports_placeholders_that_refuse_to_run(monkeypatch):
    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("sgl_kernel is installed: the stub is not used")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the stub's finder goes away
    for name in [m for m in sys.modules if m.startswith("sgl_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    harness: dict = {}
    try:
        sglang_context.stub_sgl_kernel_if_absent(harness)
        assert "stubbed" in harness["sgl_kernel"]
        sub = f"op_{random.randrange(10**6)}"
        module = importlib.import_module(f"sgl_kernel.{sub}")
        assert importlib.import_module("sgl_kernel.utils").is_arch_support_pdl() is False
        kernel = module.fused_thing.variant
        assert f"sgl_kernel.{sub}.fused_thing.variant" in sglang_context.STUB_NAMES
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{sub}.fused_thing.variant"):
            kernel(1, 2)
    finally:  # the stub's modules must not outlive the test
        for name in [m for m in sys.modules if m.startswith("sgl_kernel")]:
            del sys.modules[name]


def test_publish_without_sglang_is_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError):
        sglang_context.publish_server_args({}, page_size=16, n=8, ctx=256, topk=4, device="cuda")
