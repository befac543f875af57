"""Issue 16 part 2b (GPU, needs the sglang package): treeverify's SGLang backend vs SGLang's own
TritonAttnBackend on SGLang's batch objects in TARGET_VERIFY mode, eager and in a captured CUDA
graph replayed with new metadata (new prefixes, trees and pages of the same batch size).

The smallest honest harness, not a ModelRunner: SGLang's process config published as a
scheduler process publishes it (bench/sglang_context.py); real `ForwardBatch`, `ForwardMode`,
`EagleVerifyInput`, `RadixAttention` and `TritonAttnBackend` where they construct; a runner
namespace with the attributes Triton's constructor reads (any it reads beyond those is None and
listed in the JSON under `runner_defaults`); a plain token pool with SGLang's pool methods. What
was published and substituted is recorded in the JSON (`harness`). Construction was checked on
a CPU with CUDA faked (DEVICE="cpu"); run on the H200 2026-12-01 (docs/sglang.md, part (b)).

Each backend's replay is timed alone and back to back after its checks, then both graphs again
in turns (`--interleave` rounds, default 5): the "in turns" row's ratios are the medians of each
round's, robust to the GPU drifting during the run.

    python scripts/sglang_backend_compare.py --json out.json [--pages 1,16] [--replays 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import random
import statistics
import sys
from types import SimpleNamespace

import torch

from treeverify.bench.kernel import _git_commit, _rel_err
from treeverify.bench.sglang_context import (
    STUB_NAMES,
    hf_config_for,
    publish_server_args,
    stub_sgl_kernel_if_absent,
)
from treeverify.kernels.reference import tree_attention_reference
from treeverify.spec import parents_to_tree_mask, to_sglang_verify

HARNESS: dict[str, str] = {}
KV_STORE = "sglang"  # --kv-store: the MHA pool's K/V store, SGLang's own or plain indexed writes
PROFILE = False  # --profile: each replay's kernels and their device times in the JSON
DEVICE = "cuda"  # where the harness puts its tensors (a CPU construction check sets "cpu")
TOPK = 4  # EAGLE tree branching: topk > 1 is the tree verify treeverify owns
SHAPES = {  # name: (Hq, Hkv, Dqk, Dv, mla) per GPU, as the grid's models
    "llama8b": (32, 8, 128, 128, False),
    "kimi_tp8": (8, 1, 576, 512, True),
}


class Permissive(SimpleNamespace):
    """A namespace that answers None for attributes it was not given and remembers which."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.__dict__.setdefault("_defaulted", set()).add(name)
        return None


class Pool:
    """A token pool with SGLang's pool methods: K (and V unless MLA) per layer, [slots, H, D]."""

    def __init__(self, slots, hkv, dqk, dv, mla, dtype):
        self.k = torch.zeros(slots, hkv, dqk, dtype=dtype, device=DEVICE)
        self.v = None if mla else torch.zeros(slots, hkv, dv, dtype=dtype, device=DEVICE)
        self.dv, self.start_layer, self.size = dv, 0, slots

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.k[..., : self.dv] if self.v is None else self.v

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        if hasattr(loc, "loc"):  # SGLang 0.5.23 passes a KVWriteLoc: a plain pool writes
            loc = loc.full_loc if loc.full_loc is not None else loc.loc  # its full-attn loc
        k = cache_k.view(-1, *self.k.shape[1:])  # (T, Hkv, Dqk)
        if self.v is None:  # MLA: SGLang's MLATokenToKVPool writes by indexing too
            self.k[loc] = k
            return
        v = cache_v.view(-1, *self.v.shape[1:])  # (T, Hkv, Dv)
        hkv, item = self.k.shape[1], self.k.element_size()
        store = sglang_mha_store(hkv * self.k.shape[2] * item, hkv * self.v.shape[2] * item)
        if store is None:
            self.k[loc] = k
            self.v[loc] = v
            return
        store(k, v, self.k, self.v, loc, row_dim=hkv * self.k.shape[2],
              store_dtype=self.k.dtype, device_module=torch.cuda, size_limit=self.k.shape[0],
              alt_stream=None, v_row_dim=hkv * self.v.shape[2])  # fmt: skip


@functools.cache
def sglang_mha_store(row_bytes: int, v_row_bytes: int):
    """SGLang's own MHA KV store (memory_pool._set_kv_buffer_impl, where its MHATokenToKVPool's
    set_kv_buffer ends: one fused JIT store_cache kernel for K and V where that kernel builds),
    so both backends' replays store K/V as an SGLang server does; None (plain indexed writes)
    where it does not import or store_cache does not build: SGLang's own fallback, less the
    alt-stream overlap of V's write its graph runner would add. HARNESS["kv store"] says which."""
    HARNESS["kv store"] = "plain indexed writes (--kv-store plain)"
    if KV_STORE == "plain":
        return None
    try:  # the module imports much of SGLang: any failure means the plain writes
        impl = importlib.import_module("sglang.srt.mem_cache.memory_pool")._set_kv_buffer_impl
    except Exception as exc:
        HARNESS["kv store"] = f"plain indexed writes (SGLang's store: {exc!r})"
        return None
    fused = _real("sglang.kernels.ops.kvcache.kvcache", "can_use_store_cache")
    try:
        jit = fused is not None and bool(fused(row_bytes, v_row_bytes))
    except Exception as exc:  # the JIT build failing is SGLang's fallback case too
        jit, HARNESS["store_cache"] = False, f"{type(exc).__name__}: {exc}"
    if not jit:  # SGLang's fallback path would import its model runner: the same writes here
        HARNESS["kv store"] = "plain indexed writes, SGLang's own fallback (no store_cache)"
        return None
    HARNESS["kv store"] = "SGLang _set_kv_buffer_impl: its fused JIT store_cache kernel"
    return impl


def _real(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        HARNESS[f"{module}.{name}"] = f"unavailable ({type(exc).__name__}: {exc})"
        return None


def _dataclass_instance(cls, **values):
    """An instance of SGLang's dataclass `cls` with `values`, other fields at their defaults
    (None where a field has none), without running its __init__/__post_init__."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        object.__setattr__(obj, f.name, value)
    for k, v in values.items():  # values that are not fields (properties aside)
        if not hasattr(obj, k):
            object.__setattr__(obj, k, v)
    return obj


class Step:
    """One verify step's data written into fixed buffers (the graph's addresses)."""

    def __init__(self, bsz, n, max_prefix, page_size, shape, ctx):
        hq, hkv, dqk, dv, mla = shape
        self.bsz, self.n, self.ps, self.shape = bsz, n, page_size, shape
        pages = bsz * -(-(max_prefix + n) // page_size) + 2
        self.pool = Pool(pages * page_size, hkv, dqk, dv, mla, torch.bfloat16)
        self.num_pages = pages
        self.req_to_token = torch.zeros(bsz + 1, ctx, dtype=torch.int32, device=DEVICE)
        self.req_pool_indices = torch.arange(1, bsz + 1, dtype=torch.int64, device=DEVICE)
        self.seq_lens = torch.zeros(bsz, dtype=torch.int64, device=DEVICE)
        self.out_cache_loc = torch.zeros(bsz * n, dtype=torch.int64, device=DEVICE)
        self.q = torch.zeros(bsz * n, hq, dqk, dtype=torch.bfloat16, device=DEVICE)
        self.k = torch.zeros(bsz * n, hkv, dqk, dtype=torch.bfloat16, device=DEVICE)
        self.v = torch.zeros(bsz * n, hkv, dv, dtype=torch.bfloat16, device=DEVICE)
        self.max_prefix = max_prefix

    def draw(self, rng: random.Random):
        """New prefixes, pages, trees and data, written in place; returns SGLang's custom mask
        and the reference's metadata (block table, prefix lengths, qo_indptr, tree bits)."""
        bsz, n, ps = self.bsz, self.n, self.ps
        prefix = [rng.randint(1, self.max_prefix) for _ in range(bsz)]
        free = list(range(1, self.num_pages))
        rng.shuffle(free)
        table = []
        self.pool.k.normal_()
        if self.pool.v is not None:
            self.pool.v.normal_()
        for b in range(bsz):
            pages = [free.pop() for _ in range(-(-(prefix[b] + n) // ps))]
            table.append(pages)
            t = torch.arange(prefix[b] + n)
            slots = torch.tensor(pages)[t // ps] * ps + t % ps
            self.req_to_token[b + 1, : len(slots)] = slots.to(DEVICE, torch.int32)
            self.out_cache_loc[b * n : (b + 1) * n] = slots[prefix[b] :].to(DEVICE)
        self.seq_lens.copy_(torch.tensor(prefix))
        for t in (self.q, self.k, self.v):
            t.normal_()
        if self.pool.v is None:  # MLA: V is the first Dv columns of the K row
            self.v.copy_(self.k[..., : self.v.shape[-1]])
        parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, n)] for _ in range(bsz)])
        plen = torch.tensor(prefix)
        layout = to_sglang_verify(parents, plen, mask_capacity=int(n * (plen.sum() + bsz * n)))
        width = max(len(p) for p in table)
        block_table = torch.tensor([p + [0] * (width - len(p)) for p in table], dtype=torch.int32)
        return layout.custom_mask.bool().to(DEVICE), {  # bool, as the EAGLE worker hands it over
            "block_table": block_table.to(DEVICE),
            "prefix_lens": plen.to(DEVICE, torch.int32),
            "qo_indptr": layout.qo_indptr.to(DEVICE),
            "tree_mask": parents_to_tree_mask(parents).to(DEVICE),
        }

    def reference(self, ref_inputs, scale):
        hq, hkv, dqk, dv, mla = self.shape
        k_cache = self.pool.k.view(-1, self.ps, hkv, dqk)
        v_cache = None if mla else self.pool.v.view(-1, self.ps, hkv, dv)
        return tree_attention_reference(
            self.q, k_cache, v_cache, ref_inputs["block_table"], ref_inputs["prefix_lens"],
            ref_inputs["qo_indptr"], ref_inputs["tree_mask"], scale,
            v_head_dim=dv if mla else None, check_data=False,
        )  # fmt: skip


def build_runner(step: Step, shape, page_size: int, n: int, ctx: int) -> Permissive:
    hq, hkv, dqk, dv, mla = shape
    server_args = publish_server_args(
        HARNESS, page_size=page_size, n=n, ctx=ctx, topk=TOPK, device=DEVICE
    )
    arch_enum = _real("sglang.srt.configs.model_config", "AttentionArch")
    arch = getattr(arch_enum, "MLA" if mla else "MHA", None) if arch_enum else None
    model_config = Permissive(
        num_attention_heads=hq, get_max_num_attention_heads=lambda: hq, head_dim=dqk,
        get_num_kv_heads=lambda tp, dcp=1: hkv, attention_arch=arch, v_head_dim=dv,
        swa_v_head_dim=dv, context_len=ctx, is_encoder_decoder=False, is_draft_model=False,
        hf_config=hf_config_for(HARNESS, shape, ctx),
    )  # fmt: skip
    pool = SimpleNamespace(req_to_token=step.req_to_token, size=step.req_to_token.shape[0])
    translator = None
    translator_cls = _real("sglang.srt.mem_cache.kv_index_translator", "KVIndexTranslator")
    if translator_cls is not None:  # a plain pool's translator: the identity, as SGLang builds it
        try:
            translator = translator_cls(
                req_to_token=step.req_to_token, token_to_kv_pool_allocator=None,
                token_to_kv_pool=step.pool, page_size=page_size, device=DEVICE,
            )  # fmt: skip
        except Exception as exc:
            HARNESS["KVIndexTranslator()"] = f"failed ({type(exc).__name__}: {exc})"
    spec_cls = _real("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm")
    runner = Permissive(
        kv_index_translator=translator,
        model_config=model_config, server_args=server_args, req_to_token_pool=pool,
        token_to_kv_pool=step.pool, sliding_window_size=None, hybrid_gdn_config=None,
        kimi_linear_config=None, linear_attn_model_spec=None, device=DEVICE, gpu_id=0,
        page_size=page_size, use_mla_backend=mla, dtype=torch.bfloat16, is_draft_worker=False,
        spec_algorithm=spec_cls.from_string("EAGLE") if spec_cls else None,
    )  # fmt: skip
    resolve = _real("sglang.srt.speculative.spec_utils", "resolve_num_tokens_per_req")
    if resolve is not None:  # what ModelRunner's method returns for a speculative target runner
        runner.decode_num_tokens_per_req = lambda num_draft_tokens=None: resolve(
            phase="target_verify", spec_algorithm=runner.spec_algorithm, is_draft_worker=False,
            num_draft_tokens=num_draft_tokens,
        )  # fmt: skip
        HARNESS["runner.decode_num_tokens_per_req"] = (
            "spec_utils.resolve_num_tokens_per_req(phase='target_verify', EAGLE, target), as "
            "ModelRunner.decode_num_tokens_per_req answers for a speculative target"
        )
    return runner


def build_layer(shape, scale: float):
    hq, hkv, dqk, dv, mla = shape
    cls = _real("sglang.srt.layers.radix_attention", "RadixAttention")
    if cls is not None:
        try:
            return cls(hq, dqk, scale, num_kv_heads=hkv, layer_id=0, v_head_dim=dv)
        except Exception as exc:
            HARNESS["RadixAttention()"] = f"failed ({type(exc).__name__}: {exc}): namespace"
    return Permissive(
        tp_q_head_num=hq, tp_k_head_num=hkv, tp_v_head_num=hkv, qk_head_dim=dqk, head_dim=dqk,
        v_head_dim=dv, scaling=scale, logit_cap=0.0, layer_id=0, sliding_window_size=-1,
        is_cross_attention=False,
    )  # fmt: skip


def build_batch(step: Step, mask: torch.Tensor, backend):
    fb_cls = _real("sglang.srt.model_executor.forward_batch_info", "ForwardBatch")
    mode = _real("sglang.srt.model_executor.forward_batch_info", "ForwardMode").TARGET_VERIFY
    verify_cls = _real("sglang.srt.speculative.eagle_info", "EagleVerifyInput")
    # num_tokens_per_req as EagleVerifyInput.__post_init__ fills it (not run here)
    spec = dict(custom_mask=mask, draft_token_num=step.n, num_tokens_per_req=step.n, topk=TOPK,
                spec_steps=1)  # fmt: skip
    spec_info = _dataclass_instance(verify_cls, **spec) if verify_cls else Permissive(**spec)
    fields = dict(
        forward_mode=mode, batch_size=step.bsz, req_pool_indices=step.req_pool_indices,
        seq_lens=step.seq_lens, seq_lens_cpu=step.seq_lens.cpu(),
        seq_lens_sum=int(step.seq_lens.sum()), out_cache_loc=step.out_cache_loc,
        input_ids=torch.zeros(step.bsz * step.n, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(step.bsz * step.n, dtype=torch.int64, device=DEVICE),
        req_to_token_pool=SimpleNamespace(req_to_token=step.req_to_token),
        token_to_kv_pool=step.pool, spec_info=spec_info, attn_backend=backend,
    )  # fmt: skip
    if dataclasses.is_dataclass(fb_cls):
        return _dataclass_instance(fb_cls, **fields)
    HARNESS["ForwardBatch"] = "not a dataclass here: namespace"
    return Permissive(**fields)


IN_TURNS = "treeverify, in turns with sglang_triton"  # the backend name of interleaved_row's row


def compare(name, make_backend, step, shape, layer, scale, seed, replays) -> tuple[dict, dict]:
    """Eager, then capture + replays with new metadata, for one backend; errors vs reference.
    Returns the row and what a later replay of the graph needs (`interleaved_row`): the graph,
    the backend, its last batch and that replay's checked output."""
    from treeverify.bench.kernel import (
        back_to_back_replay_seconds,
        median_replay_seconds,
        replay_kernel_times,
    )

    row: dict = {"backend": name}
    backend = make_backend()
    translator = getattr(step, "translator", None)
    for target in (backend, getattr(backend, "fallback", None)):  # the runner binds it in SGLang
        if target is not None and getattr(target, "kv_index_translator", None) is None:
            target.kv_index_translator = translator
    rng = random.Random(seed)
    torch.manual_seed(seed)
    mask, ref_in = step.draw(rng)
    fb = build_batch(step, mask, backend)
    backend.init_forward_metadata(fb)
    out = backend.forward(step.q, step.k, step.v, layer, fb).clone()
    ref = step.reference(ref_in, scale)
    row["eager_rel_err"] = _rel_err(out.view_as(ref), ref)
    backend.init_cuda_graph_state(step.bsz, step.bsz * step.n)
    mask, ref_in = step.draw(rng)
    fb = build_batch(step, mask, backend)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        backend.init_forward_metadata_in_graph(fb)
        static_out = backend.forward(step.q, step.k, step.v, layer, fb)
    torch.cuda.current_stream().wait_stream(stream)
    row["graph_rel_err"], row["graph_vs_eager"] = [], []
    got = None
    for _ in range(replays):  # new prefixes, trees, pages: same bucket, same buffers
        mask, ref_in = step.draw(rng)
        fb = build_batch(step, mask, backend)
        backend.init_forward_metadata_out_graph(fb)
        graph.replay()
        torch.cuda.synchronize()
        got = static_out.clone()
        ref = step.reference(ref_in, scale)
        row["graph_rel_err"].append(_rel_err(got.view_as(ref), ref))
        backend.init_forward_metadata(fb)
        eager = backend.forward(step.q, step.k, step.v, layer, fb)
        row["graph_vs_eager"].append(_rel_err(got, eager))
    row["replay_us"] = median_replay_seconds(graph, 20) * 1e6
    row["replay_us_back_to_back"] = back_to_back_replay_seconds(graph, 20) * 1e6
    if PROFILE:
        row["replay_kernels"] = replay_kernel_times(graph)
    replayable = {"graph": graph, "backend": backend, "batch": fb, "out": static_out,
                  "checked": got}  # fmt: skip
    return row, replayable


def interleaved_row(replayables: dict, rounds: int) -> dict:
    """Our graph and SGLang's timed in turns (bench.kernel.interleaved_replay_us): ours' median
    times and the median of each round's ratio, SGLang's / ours (alone, back to back).

    Both backends drew the same batches into shared pools (one seed), so each graph's last
    batch is the pools' state again; its metadata is refilled from that batch, its output
    poisoned, and one replay must give the output its last checked replay gave, before and
    after the timing: else the row is an error, not a ratio (a first try without the refill
    timed SGLang's graph at 11-17 us a replay, against ~400 in its own turn: not the same
    work)."""
    from treeverify.bench.kernel import interleaved_replay_us, median_round_ratio

    def refill_and_check(name: str, when: str) -> None:
        r = replayables[name]
        r["backend"].init_forward_metadata_out_graph(r["batch"])
        r["out"].fill_(float("nan"))
        r["graph"].replay()
        torch.cuda.synchronize()
        if not torch.equal(r["out"], r["checked"]):
            raise RuntimeError(f"{name}: its graph's output {when} the turns differs from its "
                               "last checked replay's")  # fmt: skip

    if any(r["checked"] is None for r in replayables.values()):
        return {"backend": IN_TURNS,
                "error": "no checked replay to compare with (--replays 0)"}  # fmt: skip
    try:
        for name in replayables:
            refill_and_check(name, "before")
        times = interleaved_replay_us({n: r["graph"] for n, r in replayables.items()},
                                      rounds=rounds)  # fmt: skip
        for name in replayables:
            refill_and_check(name, "after")
    except RuntimeError as exc:
        return {"backend": IN_TURNS, "error": str(exc)}
    ours, theirs = times["treeverify"], times["sglang_triton"]
    return {
        "backend": IN_TURNS,
        "rounds": rounds,
        "times_us": times,
        "replay_us": statistics.median(ours["alone"]),
        "speedup_vs_sglang_triton": median_round_ratio(theirs["alone"], ours["alone"]),
        "replay_us_back_to_back": statistics.median(ours["back_to_back"]),
        "speedup_back_to_back": median_round_ratio(theirs["back_to_back"], ours["back_to_back"]),
    }


def run(args) -> dict:
    from treeverify.integrations.sglang import install
    from treeverify.integrations.sglang.registry import build_backend

    stub_sgl_kernel_if_absent(HARNESS)
    try:  # the registration path as SGLang would run it; the comparison does not depend on it
        install()
        HARNESS["install()"] = "ok"
    except Exception as exc:
        HARNESS["install()"] = f"failed: {type(exc).__name__}: {exc}"
    triton_cls = _real("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend")
    if triton_cls is None:
        raise ImportError(HARNESS["sglang.srt.layers.attention.triton_backend.TritonAttnBackend"])
    rows, defaulted = [], set()
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        scale = 192**-0.5 if shape[4] else shape[2] ** -0.5
        for page_size in [int(p) for p in args.pages.split(",")]:
            step = Step(args.batch, args.n, args.max_prefix, page_size, shape, args.ctx)
            runner = build_runner(step, shape, page_size, args.n, args.ctx)
            step.translator = runner.kv_index_translator
            layer = build_layer(shape, scale)
            makers = {
                "sglang_triton": lambda r=runner: triton_cls(r),
                "treeverify": lambda r=runner: build_backend(r, "triton", args.kernel),
            }
            replayables = {}
            for name, make in makers.items():
                key = {"shape": shape_name, "page_size": page_size}
                try:
                    part, replayables[name] = compare(name, make, step, shape, layer, scale,
                                                      args.seed, args.replays)  # fmt: skip
                    row = key | part
                except Exception as exc:  # report what did not run, keep going
                    row = key | {"backend": name, "error": f"{type(exc).__name__}: {exc}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if len(replayables) == 2 and args.interleave > 0:
                # Time both in turns, so a drift of the GPU during the run moves both sides of
                # a ratio (interleaved_row checks that each graph still does its own work).
                row = {"shape": shape_name, "page_size": page_size} | interleaved_row(
                    replayables, args.interleave)  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            del replayables
            defaulted |= runner.__dict__.get("_defaulted", set())
            defaulted |= {f"model_config.{a}" for a in runner.model_config.__dict__.get(
                "_defaulted", set())}  # fmt: skip
    for r in rows:
        if r["backend"] != "treeverify":
            continue
        twin = [o for o in rows if o["backend"] == "sglang_triton" and o["shape"] == r["shape"]
                and o["page_size"] == r["page_size"]]  # fmt: skip
        for key, name in (("replay_us", "speedup_vs_sglang_triton"),
                          ("replay_us_back_to_back", "speedup_back_to_back")):  # fmt: skip
            if twin and key in r and key in twin[0]:
                r[name] = twin[0][key] / r[key]
    return {"commit": _git_commit(), "gpu": torch.cuda.get_device_name(),
            "command": " ".join(sys.argv), "sglang_version": importlib.import_module(
                "sglang").__version__, "harness": HARNESS,
            "sgl_kernel_names": sorted(STUB_NAMES), "runner_defaults": sorted(defaulted),
            "rows": rows}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--shapes", default="llama8b,kimi_tp8")
    p.add_argument("--pages", default="1,16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n", type=int, default=64, help="verified tokens per request")
    p.add_argument("--max-prefix", type=int, default=4096)
    p.add_argument("--ctx", type=int, default=8192, help="req_to_token columns")
    p.add_argument("--replays", type=int, default=3)
    p.add_argument("--kernel", default="cuda", help="treeverify plan backend: cuda or triton")
    p.add_argument("--seed", type=int, default=random.randrange(2**31))
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--profile", action="store_true", help="each replay's kernel times")
    p.add_argument("--interleave", type=int, default=5, metavar="ROUNDS",
                   help="then time both graphs in turns, ROUNDS times (0: not)")  # fmt: skip
    p.add_argument("--kv-store", choices=("sglang", "plain"), default="sglang",
                   help="the MHA pool's K/V store: SGLang's or indexed writes")  # fmt: skip
    args = p.parse_args()
    global PROFILE, KV_STORE
    PROFILE, KV_STORE = args.profile, args.kv_store
    if not torch.cuda.is_available():
        print("sglang_backend_compare: needs a CUDA GPU", file=sys.stderr)
        return 3
    try:
        result = run(args)
    except ImportError as exc:
        print(f"sglang_backend_compare: {exc}; docs/sglang.md lists the wheels", file=sys.stderr)
        return 3
    result["seed"] = args.seed
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    errs = [e for r in result["rows"] for k in ("eager_rel_err", "graph_rel_err", "graph_vs_eager")
            for e in ([r[k]] if isinstance(r.get(k), float) else r.get(k, []))]  # fmt: skip
    # A failed in-turns timing is a measurement lost, not a wrong output: said, not failed on.
    timing = [r for r in result["rows"] if r["backend"] == IN_TURNS]
    for r in timing:
        if "error" in r:
            print(f"in-turns timing not measured: {r['error']}", file=sys.stderr)
    checked = [r for r in result["rows"] if r not in timing]
    bad = any("error" in r for r in checked) or not errs or max(errs) > args.tol
    print(json.dumps({"harness": HARNESS, "max_rel_err": max(errs) if errs else None}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
