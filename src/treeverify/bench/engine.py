"""Engine benchmarks on a GPU: graphs vs eager agreement, decode vs the memory roofline,
batch throughput, verify-forward time per tree budget, and speculative decoding end to end.

Every function returns plain dicts (the JSON rows); `treeverify bench engine` runs the suites
and writes them. Timings: the engine's own step loop (host included) by wall clock around
`LLM.step()`, and a captured forward alone by CUDA events around graph replays.
"""

from __future__ import annotations

import gc
import time

import torch

from treeverify.bench.kernel import median_replay_seconds
from treeverify.engine.kv_cache import bytes_per_token
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.spec import parents_to_tree_mask

HBM_BYTES_PER_S = 4.24e12  # H200 HBM3e, the figure the targets use (shared/design)


def _free(*objs) -> None:
    del objs
    gc.collect()
    torch.cuda.empty_cache()


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 256), (length,), generator=g).tolist() for _ in range(n)]


def repetitive_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Text that repeats (a code-like block several times): where an n-gram drafter pays."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        block = torch.randint(32, 127, (int(torch.randint(12, 40, (1,), generator=g)),),
                              generator=g).tolist()  # fmt: skip
        out.append((block * (length // len(block) + 1))[:length])
    return out


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _margin(info) -> float | None:
    """logit(top1) - logit(top2) at a position (from the eager run's logprobs)."""
    if info is None or len(info.top) < 2:
        return None
    return round(info.top[0][1] - info.top[1][1], 5)


def graphs_vs_eager(model: str, *, batches=(1, 3, 8), prompt_len=48, max_tokens=32,
                    num_pages=2048, **llm_kw) -> list[dict]:  # fmt: skip
    """Greedy outputs with CUDA graphs on vs off, per batch size; divergences with margins."""
    rows = []
    outs = {}
    for graphs in (False, True):
        llm = LLM(model, device="cuda", num_pages=num_pages, disable_cuda_graph=not graphs,
                  **llm_kw)  # fmt: skip
        vocab = llm.vocab_size
        for b in batches:
            prompts = _prompts(b, prompt_len, seed=b, vocab=vocab)
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=2 if not graphs else None)  # fmt: skip
            outs[(graphs, b)] = llm.generate(prompts, sp)
        replays = llm.cuda_graph_info.get("replays", 0)
        _free(llm)
    for b in batches:
        eager, graph = outs[(False, b)], outs[(True, b)]
        div = []
        for i, (e, g) in enumerate(zip(eager, graph, strict=True)):
            at = _first_divergence(e.token_ids, g.token_ids)
            if at is not None:
                div.append({"request": i, "position": at, "eager_margin": _margin(e.logprobs[at])})
        rows.append({"model": model, "batch": b, "tokens": max_tokens, "identical": not div,
                     "divergences": div})  # fmt: skip
    rows.append({"model": model, "graph_replays": replays})
    return rows


def _weight_bytes(llm: LLM) -> int:
    """Bytes of weights one decode step reads: every parameter once, the input embedding
    only if it is the LM head too (tied); for MoE, only the k routed experts of each layer."""
    model = llm.forward_parts().model
    seen, total = set(), 0
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    for p in model.parameters():
        if id(p) in seen or (p is embed and not tied):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    cfg = llm.model_config
    if hasattr(cfg, "n_routed_experts"):  # read only k of E experts per MoE layer (batch 1)
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * embed.element_size()
        moe_layers = sum(1 for m in model.modules() if hasattr(m, "n_experts"))
        total -= moe_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    return total


def decode_speed(model: str, *, batch: int, prompt_len: int = 512, steps: int = 128,
                 graphs: bool = True, num_pages: int = 4096, **llm_kw) -> dict:  # fmt: skip
    """Decode steps of `batch` requests after their prefill: engine wall time per step, the
    captured forward alone, and both against the memory roofline at that context."""
    llm = LLM(model, device="cuda", num_pages=num_pages, disable_cuda_graph=not graphs,
              cuda_graph_max_bs=max(batch, 1), max_num_seqs=max(batch, 1), **llm_kw)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    seqs = [llm.add_request(p, sp) for p in _prompts(batch, prompt_len, seed=7,
                                                     vocab=llm.vocab_size)]  # fmt: skip
    while any(s.num_output_tokens == 0 for s in seqs):
        llm.step()  # prefill (and the first token)
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while llm.has_unfinished():
        llm.step()
        n += 1
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / max(n, 1)
    mid_ctx = prompt_len + steps // 2
    net = llm.forward_parts().model  # `model` stays the name the row reports
    kv = bytes_per_token(net.kv_cache_spec(), next(net.parameters()).dtype)
    moved = _weight_bytes(llm) + batch * mid_ctx * kv
    floor_ms = moved / HBM_BYTES_PER_S * 1e3
    row = {
        "model": model, "batch": batch, "graphs": graphs, "prompt_len": prompt_len,
        "decode_steps": n, "step_ms": round(step_ms, 4),
        "tokens_per_s": round(batch * 1e3 / step_ms, 1),
        "bytes_per_step": moved, "roofline_ms": round(floor_ms, 4),
        "engine_pct_of_roofline": round(100 * floor_ms / step_ms, 1),
    }  # fmt: skip
    graph = llm.captured_graph(batch) if graphs else None
    if graph is not None:
        fwd = median_replay_seconds(graph, 50) * 1e3
        # the share of an engine step outside its forward (host work not hidden, the step's
        # own kernels beyond the forward: with plain steps launched ahead, its argmax/advance)
        row.update(forward_ms=round(fwd, 4),
                   forward_pct_of_roofline=round(100 * floor_ms / fwd, 1),
                   outside_forward_pct=round(100 * max(0.0, step_ms - fwd) / step_ms, 1),
                   decode_lookahead=llm.ahead is not None)  # fmt: skip
    _free(llm)
    return row


@torch.inference_mode()
def verify_forward(model: str, *, budgets=(16, 32, 64, 128, 256, 512, 1024), batches=(1, 8),
                   prefix: int = 1024, num_pages: int = 4096) -> list[dict]:  # fmt: skip
    """The captured verify forward over trees of budget+1 nodes after `prefix` cached tokens,
    per (batch, budget): median ms of graph replays (attention through TreeAttentionPlan)."""
    from treeverify.engine.cuda_graphs import CudaGraphs

    llm = LLM(model, device="cuda", num_pages=num_pages, disable_cuda_graph=True,
              max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * (max(budgets) + 1),
              speculative_algorithm="DDTREE", speculative_ddtree_budget=max(budgets),
              speculative_adaptive=False)  # fmt: skip
    rows = []
    parts = llm.forward_parts()
    attention, ps = parts.attention, parts.cache.page_size
    for budget in budgets:
        n = llm.config.tree_size_for(budget)  # budget + 1 (DDTree's fixed width)
        for b in batches:
            pages_per = (prefix + n + ps - 1) // ps
            # the stage's page table sized as the engine sizes it (a request's pages at most),
            # not the whole pool: the graph unpacks all of it every replay
            graphs = CudaGraphs(parts.model, attention, buckets=[(b, n)], max_pages=pages_per + 1)
            graphs.capture()
            tables = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(b)]
            slots = torch.tensor([t[0] * ps + prefix + j for t in tables for j in range(n)])
            g = torch.Generator().manual_seed(budget * 100 + b)
            masks = []
            for _ in range(b):  # a random tree per request (parents precede children)
                par = (torch.rand(n, generator=g) * torch.arange(n)).long()  # (n,) parent < i
                par[0] = -1
                masks.append(parents_to_tree_mask(par[None]))  # (n, W)
            ids = torch.zeros(b * n, dtype=torch.int64, device="cuda")  # (B*n,)
            pos = torch.arange(n, device="cuda").repeat(b) + prefix  # (B*n,)
            graphs.stages[(b, n)].write_device_step([prefix] * b, tables, ids, slots,
                                                    torch.cat(masks).cuda(), pos=pos)  # fmt: skip
            graph = graphs.steps[(b, n)].graph
            graph.replay()  # the first replay after staging, untimed
            ms = median_replay_seconds(graph, 20) * 1e3
            attention.forget((b, n))
            rows.append({"model": model, "batch": b, "budget": budget, "prefix": prefix,
                         "verify_forward_ms": round(ms, 4)})  # fmt: skip
            del graphs
            gc.collect()
    _free(llm)
    return rows


def speculative_speed(model: str, *, algorithms=("none", "CHAIN", "DDTREE"), batch: int = 1,
                      prompt_len: int = 256, max_tokens: int = 256, budget: int = 16,
                      depth: int = 4, num_pages: int = 4096, graphs: bool = True,
                      drafter: str = "ngram") -> list[dict]:  # fmt: skip
    """Tokens/s of no speculation vs CHAIN vs DDTREE (n-gram drafter) on repetitive prompts;
    per-phase round time; outputs compared to the plain run (greedy, first divergence).
    "DDTREE" is the fixed budget with the n-gram drafter's rounds on the general path
    (`ngram_whole_rounds=False`, host votes), "DDTREE+whole" the same as whole-round graphs (the
    engine's default): that pair is the A/B; "DDTREE+adaptive" the per-step budget up to it."""
    rows, plain = [], None
    prompts = repetitive_prompts(batch, prompt_len, seed=3)
    for algo in algorithms:
        kw = {} if algo == "none" else dict(
            speculative_algorithm=algo.split("+")[0], speculative_ddtree_budget=budget,
            speculative_adaptive=algo.endswith("+adaptive") if "DDTREE" in algo else None,
            speculative_num_draft_tokens=depth, speculative_draft_model_path=drafter)  # fmt: skip
        if algo == "DDTREE":  # the A/B side of "DDTREE+whole": n-gram rounds on the general path
            kw["ngram_whole_rounds"] = False
        llm = LLM(model, device="cuda", num_pages=num_pages, disable_cuda_graph=not graphs,
                  max_num_seqs=max(batch, 1), cuda_graph_max_bs=max(batch, 1), **kw)  # fmt: skip
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=2 if algo == "none" else None)  # fmt: skip
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        llm.reset_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        toks = sum(len(o.token_ids) for o in outs)
        row = {"model": model, "algorithm": algo, "drafter": drafter, "batch": batch,
               "budget": budget,
               "depth": depth, "graphs": graphs, "tokens": toks,
               "tokens_per_s": round(toks / secs, 1)}  # fmt: skip
        if algo == "none":
            plain = outs
        else:
            st = llm.spec_stats
            if st["adaptive"] is not None:
                row["steps_by_budget"] = st["adaptive"]["steps_by_budget"]
            row.update(avg_accept_length=st["avg_spec_accept_length"], rounds=st["rounds"],
                       whole_round_steps=st["whole_round_steps"],
                       phase_seconds=st["phase_seconds"], round_seconds=st["round_seconds"],
                       forward_seconds=st["forward_seconds"],
                       outside_forward_pct=None if st["outside_forward_share"] is None
                       else round(100 * st["outside_forward_share"], 1))  # fmt: skip
            if plain is not None:
                div = []
                for i, (a, b) in enumerate(zip(plain, outs, strict=True)):
                    at = _first_divergence(a.token_ids, b.token_ids)
                    if at is not None:
                        div.append({"request": i, "position": at,
                                    "plain_margin": _margin(a.logprobs[at])})  # fmt: skip
                row["identical_to_plain"] = not div
                row["divergences"] = div
        rows.append(row)
        _free(llm)
    return rows


SUITES = ("graphs", "decode", "verify", "spec")


def run_suites(suites: list[str], models: dict[str, str]) -> dict:
    """The engine suites on their models (keys: graphs, decode, verify, spec, each a comma list
    of model names); rows per suite, each row or suite failure recorded rather than raised."""
    out: dict = {}
    for suite in suites:
        rows: list = []
        for model in [m for m in models.get(suite, "").split(",") if m]:
            t0 = time.perf_counter()
            try:
                if suite == "graphs":
                    rows += graphs_vs_eager(model)
                elif suite == "decode":
                    rows.append(decode_speed(model, batch=1))
                    rows.append(decode_speed(model, batch=1, graphs=False))
                    rows.append(decode_speed(model, batch=32, prompt_len=256))
                elif suite == "verify":
                    rows += verify_forward(model)
                elif suite == "spec":
                    rows += speculative_speed(model, algorithms=("none", "CHAIN", "DDTREE",
                                                                 "DDTREE+whole",
                                                                 "DDTREE+adaptive"))  # fmt: skip
                    rows += speculative_speed(model, batch=8, max_tokens=128,
                                              algorithms=("none", "CHAIN", "DDTREE",
                                                          "DDTREE+whole"))  # fmt: skip
                    if model == "tiny-llama":  # the seeded DFlash drafter fits tiny-llama only
                        rows += speculative_speed(model, algorithms=("none", "DDTREE"),
                                                  drafter="tiny-dflash")  # fmt: skip
            except Exception as exc:  # keep going: one model's failure is one row
                rows.append({"model": model, "error": f"{type(exc).__name__}: {exc}"})
                _free()
            print(f"[bench engine] {suite} {model}: {time.perf_counter() - t0:.1f} s", flush=True)
        out[suite] = rows
    return out


def print_summary(result: dict) -> None:
    for suite, rows in result.items():
        print(f"--- {suite}")
        for r in rows:
            keys = [k for k in r if k not in ("divergences", "phase_seconds")]
            print("  " + "  ".join(f"{k}={r[k]}" for k in keys))
