"""SGLang's process as its attention backends expect it, for harnesses that build those backends
outside a server (scripts/sglang_backend_compare.py): SGLang 0.5.23's process-wide config
published as a scheduler process publishes it, a transformers config of a shape (no weights),
and an `sgl_kernel` stub where that CUDA-only package is absent. Every function records what it
published or substituted in the caller's `harness` dict (the JSON's `harness`). SGLang is
imported only inside the functions.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

STUB_NAMES: set[str] = set()  # sgl_kernel names SGLang touched while importing


class _Placeholder:
    """Stands in for an sgl_kernel object at import time (module-level tables read attributes
    of it); calling it raises, so no stubbed kernel can run unnoticed."""

    def __init__(self, path: str):
        self._path = path
        STUB_NAMES.add(path)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._path}: sgl_kernel is stubbed in this harness")


class _SglKernelStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `sgl_kernel` and any submodule as modules of placeholders."""

    def find_spec(self, name, path, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = type(sys)(spec.name)
        module.__path__ = []

        def placeholder(attr):  # PEP 562: names the module does not define
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Placeholder(f"{spec.name}.{attr}")

        module.__getattr__ = placeholder
        return module

    def exec_module(self, module):
        if module.__name__ == "sgl_kernel.utils":
            module.is_arch_support_pdl = lambda: False


def stub_sgl_kernel_if_absent(harness: dict) -> None:
    """Without sgl_kernel installed, import it (and any submodule) as placeholders."""
    if importlib.util.find_spec("sgl_kernel") is None:  # CUDA-only imports across sglang.srt
        sys.meta_path.insert(0, _SglKernelStub())
        harness["sgl_kernel"] = (
            "not installed: stubbed (utils.is_arch_support_pdl -> False; any other name is a "
            "placeholder that raises if called: see sgl_kernel_names)"
        )


def publish_server_args(harness: dict, *, page_size: int, n: int, ctx: int, topk: int, device: str):
    """Publish SGLang's process-wide config (its RuntimeContext) the way a scheduler process
    does: `publish(ServerArgs(...), role="scheduler")` with the launcher's placement (WORLD rank
    0, GPU 0, TP 1). SGLang 0.5.23's backends read their settings from it (get_exec(),
    get_spec(), get_schedule(), get_parallel()), not from the runner. model_path "dummy", as in
    SGLang's own tests: its resolution pipeline then stops before the model-dependent hooks (no
    config download, no GPU memory probe), so the published leaves are these fields and
    ServerArgs' defaults; the caller's model config stands in for the model. Returns the
    published ServerArgs; records what was published and the leaves the backends read."""
    server_args_cls = importlib.import_module("sglang.srt.server_args").ServerArgs
    ctx_mod = importlib.import_module("sglang.srt.runtime_context")
    fields = dict(
        model_path="dummy", attention_backend="triton", page_size=page_size,
        context_length=ctx, speculative_algorithm="EAGLE", speculative_num_steps=1,
        speculative_eagle_topk=topk, speculative_num_draft_tokens=n, device=device,
    )  # fmt: skip
    server_args = server_args_cls(**fields)
    ctx_mod.reset_context()  # last publish wins; start from nothing each shape
    ctx_mod.publish(server_args, role="scheduler", ranks=ctx_mod.SpawnRanks(world_rank=0, gpu_id=0))
    exec_, spec, sched, par = (ctx_mod.get_exec(), ctx_mod.get_spec(), ctx_mod.get_schedule(),
                               ctx_mod.get_parallel())  # fmt: skip
    read = {  # the leaves TritonAttnBackend's constructor reads, as resolved
        "spec.speculative_num_draft_tokens": spec.speculative_num_draft_tokens,
        "spec.speculative_num_steps": spec.speculative_num_steps,
        "spec.speculative_eagle_topk": spec.speculative_eagle_topk,
        "schedule.page_size": sched.page_size,
        "schedule.chunked_prefill_size": sched.chunked_prefill_size,
        "exec.kernel.triton_attention_num_kv_splits": exec_.kernel.triton_attention_num_kv_splits,
        "exec.kernel.triton_attention_split_tile_size":
            exec_.kernel.triton_attention_split_tile_size,
        "exec.kernel.enable_lean_attention": exec_.kernel.enable_lean_attention,
        "exec.deterministic.enable_deterministic_inference":
            exec_.deterministic.enable_deterministic_inference,
        "parallel.attn_tp_size": par.attn_tp_size, "parallel.attn_dcp_size": par.attn_dcp_size,
    }  # fmt: skip
    harness["publish()"] = (
        "runtime_context.publish(ServerArgs(**published_fields), role='scheduler', "
        "ranks=SpawnRanks(world_rank=0, gpu_id=0)) per shape/page size; see published_*"
    )
    harness.setdefault("published_fields", {})[f"page_size={page_size}"] = repr(fields)
    harness.setdefault("published_read", {})[f"page_size={page_size}"] = repr(read)
    return server_args


def hf_config_for(harness: dict, shape: tuple, ctx: int):
    """A transformers config of the shape's family (no weights): SGLang's backends probe its type
    for hybrid/linear-attention models. Llama for GQA, DeepSeek-V3 for MLA (latent 512 + rope
    64), heads as on one GPU. `shape` is (Hq, Hkv, Dqk, Dv, mla)."""
    hq, hkv, dqk, dv, mla = shape
    transformers = importlib.import_module("transformers")
    if mla:
        config = transformers.DeepseekV3Config(
            num_attention_heads=hq, num_key_value_heads=hq, kv_lora_rank=dv,
            qk_rope_head_dim=dqk - dv, max_position_embeddings=ctx,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            num_attention_heads=hq, num_key_value_heads=hkv, head_dim=dqk,
            hidden_size=hq * dqk, max_position_embeddings=ctx,
        )  # fmt: skip
    harness[f"hf_config[{'mla' if mla else 'gqa'}]"] = f"transformers.{type(config).__name__}"
    return config
