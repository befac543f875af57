"""Registering `--attention-backend treeverify`: SGLang absent or too old -> one clear error naming
`pip install sglang` (also from the launcher, without a traceback); with an SGLang that has
0.5.23's registry (faked here, module by module), install() registers once and the factory wraps
the chosen stock backend."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from treeverify.integrations.sglang import (
    BACKEND_NAME,
    SGLangUnavailableError,
    install,
    require_sglang,
)
from treeverify.integrations.sglang.backend import TreeverifyAttnBackend


def test_absent_sglang_raises_an_import_error_naming_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'sglang>=0.5.23'"):
        require_sglang()
    with pytest.raises(SGLangUnavailableError, match="pip install"):
        install()


@pytest.mark.parametrize("version", ["0.5.9", "0.4.23", "0.5.22.post3"])
def test_old_sglang_is_refused_with_the_version(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(__version__=version))
    with pytest.raises(SGLangUnavailableError, match=rf"needs SGLang >= 0.5.23, found {version}"):
        install()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_launcher_without_sglang_says_why_without_a_traceback():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "treeverify.integrations.sglang.launch", "--model-path", "x"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "pip install 'sglang>=0.5.23'" in proc.stderr
    assert "Traceback" not in proc.stderr


def _fake_sglang(monkeypatch, version="0.5.23", tp=2):
    """The modules install() and the factory touch, with 0.5.23's names."""
    made = {}

    def mod(name, **attrs):
        m = ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        made[name] = m
        return m

    backends = {}

    def register_attention_backend(name):
        def deco(fn):
            backends[name] = fn
            return fn

        return deco

    choices = ["triton", "flashinfer", "fa3"]
    mod("sglang", __version__=version)
    for name in ("sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention",
                 "sglang.srt.arg_groups"):  # fmt: skip
        mod(name)
    stock = SimpleNamespace(built=[])
    backends["triton"] = lambda runner: stock.built.append(("triton", runner)) or "TRITON"
    backends["flashinfer"] = lambda runner: "FLASHINFER"
    mod("sglang.srt.layers.attention.attention_registry", ATTENTION_BACKENDS=backends,
        register_attention_backend=register_attention_backend)  # fmt: skip
    mod("sglang.srt.arg_groups.choices", ATTENTION_BACKEND_CHOICES=choices,
        add_attention_backend_choices=choices.extend)  # fmt: skip
    mod("sglang.srt.arg_groups.speculative_hook",
        _PAGE_TREE_SPEC_BACKENDS=("flashinfer", "fa3", "triton"))  # fmt: skip
    mod("sglang.srt.runtime_context", get_parallel=lambda: SimpleNamespace(attn_tp_size=tp))
    return backends, choices, stock, made


def _runner(mla: bool, page_size=16):
    slots = 64 * page_size
    k = torch.zeros(slots, 1 if mla else 4, 576 if mla else 128, dtype=torch.bfloat16)
    v = k[..., :512] if mla else torch.zeros(slots, 4, 128, dtype=torch.bfloat16)
    pool = SimpleNamespace(start_layer=0, get_key_buffer=lambda i: k, get_value_buffer=lambda i: v)
    return SimpleNamespace(
        token_to_kv_pool=pool, use_mla_backend=mla, page_size=page_size, device="cpu",
        model_config=SimpleNamespace(num_attention_heads=16 if mla else 32),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(8, 300, dtype=torch.int32)),
        server_args=SimpleNamespace(speculative_num_draft_tokens=65),
    )  # fmt: skip


def test_install_registers_once_and_the_factory_wraps_the_fallback(monkeypatch):
    backends, choices, stock, made = _fake_sglang(monkeypatch)
    monkeypatch.delenv("TREEVERIFY_SGLANG_FALLBACK", raising=False)
    monkeypatch.setenv("TREEVERIFY_SGLANG_KERNEL", "torch")
    install()
    install()  # idempotent: every SGLang process may call it
    assert choices.count(BACKEND_NAME) == 1 and BACKEND_NAME in backends
    hook = made["sglang.srt.arg_groups.speculative_hook"]
    assert hook._PAGE_TREE_SPEC_BACKENDS == ("flashinfer", "fa3", "triton", BACKEND_NAME)
    runner = _runner(mla=False)
    backend = backends[BACKEND_NAME](runner)
    assert isinstance(backend, TreeverifyAttnBackend)
    assert backend.fallback == "TRITON" and stock.built == [("triton", runner)]
    g = backend.geometry
    assert (g.num_qo_heads, g.num_kv_heads, g.head_dim_qk, g.head_dim_v) == (16, 4, 128, 128)
    assert (g.mla, g.page_size, g.max_context_len, g.draft_tokens) == (False, 16, 300, 65)
    assert (
        backend.kernel == "torch" and backend.req_to_token is runner.req_to_token_pool.req_to_token
    )
    mla = backends[BACKEND_NAME](_runner(mla=True, page_size=1))
    assert (mla.geometry.mla, mla.geometry.num_kv_heads, mla.geometry.head_dim_v) == (True, 1, 512)
    assert mla.geometry.num_qo_heads == 8


def test_factory_refuses_a_bad_fallback(monkeypatch):
    backends, *_ = _fake_sglang(monkeypatch)
    install()
    monkeypatch.setenv("TREEVERIFY_SGLANG_FALLBACK", "flashinfer")
    assert backends[BACKEND_NAME](_runner(mla=False)).fallback == "FLASHINFER"
    with pytest.raises(ValueError, match="TREEVERIFY_SGLANG_FALLBACK: 'flashinfer' cannot serve"):
        backends[BACKEND_NAME](_runner(mla=True))  # MLA hands us concatenated q/k in all modes
    for bad in ("nope", BACKEND_NAME):
        monkeypatch.setenv("TREEVERIFY_SGLANG_FALLBACK", bad)
        with pytest.raises(ValueError, match="not a stock SGLang attention backend"):
            backends[BACKEND_NAME](_runner(mla=False))
    monkeypatch.setenv("TREEVERIFY_SGLANG_FALLBACK", "triton")
    translating = _runner(mla=False)
    translating.kv_index_translator = SimpleNamespace(is_translating=True)
    with pytest.raises(ValueError, match="translates KV ids"):
        backends[BACKEND_NAME](translating)
    monkeypatch.setenv("TREEVERIFY_SGLANG_KERNEL", "fast")
    with pytest.raises(ValueError, match="TREEVERIFY_SGLANG_KERNEL"):
        from treeverify import env

        env.sglang_kernel()


def test_plugin_entry_point_only_warns_beside_an_old_sglang(monkeypatch, caplog):
    from treeverify.integrations.sglang.registry import plugin

    backends, choices, *_ = _fake_sglang(monkeypatch, version="0.5.20")
    plugin()  # must not break an SGLang that does not use treeverify
    assert BACKEND_NAME not in backends and BACKEND_NAME not in choices
    assert "found 0.5.20" in caplog.text
