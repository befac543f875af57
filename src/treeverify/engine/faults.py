"""Planted faults, TEST ONLY: the failure classes the deployment gate must catch.

Nothing here runs in a deployment: production code carries no fault branches. When
TREEVERIFY_FAULT is set (read through treeverify.env), `install(llm)` wraps the one part of the
engine the planted fault lives in, once, at startup, before warmup and graph capture. CUDA graphs
stay on, so the gate's suite exercises the path production runs (an attention fault is captured
into the graphs, reading a fixed device buffer that every step's plan() refills).

| TREEVERIFY_FAULT    | what goes wrong                                        | wrapped          |
| ------------------- | ------------------------------------------------------ | ---------------- |
| attn_past:N         | attention wrong for tokens whose context exceeds N     | PagedAttention   |
| merge_bug           | like a broken split-KV merge: wrong once prefix > 256  | PagedAttention   |
| batch_over:N        | logits corrupted in steps of more than N sequences     | ModelRunner.run, |
|                     | (a whole captured round: its committed tokens; plain   | commit_rows,     |
|                     | steps launched ahead: their decode tokens)             | LLM._plain_ahead |
| garbage_after:N     | every output token after a request's N-th is garbage   | LLM.run_batch    |
| spec_diverge        | speculative rounds commit a wrong bonus token          | commit_rows      |
| spec_greedy_sampled | sampled requests' rounds use greedy acceptance         | accept_batch     |
| capture_crash       | the server exits non-zero in the graph-capture phase   | server startup   |
| capture_hang        | the server hangs in that phase, never ready            | server startup   |
| first_request_crash | the server process dies on its first HTTP completion   | server loop      |
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from treeverify import env
from treeverify.engine.paged_attention import PagedAttention

MERGE_BUG_PREFIX = 256  # the split chunk a broken merge would show beyond
ENGINE_FAULTS = ("attn_past", "merge_bug", "batch_over", "garbage_after", "spec_diverge",
                 "spec_greedy_sampled")  # fmt: skip


def active(name: str) -> int | None:
    """The fault's parameter (0 when it takes none) if `name` is the planted fault, else None."""
    fault = env.planted_fault()
    if fault is None or fault[0] != name:
        return None
    return fault[1]


def install(llm) -> str | None:
    """Wrap the engine part the planted fault lives in (TEST ONLY); returns the fault's name,
    or None when none is planted (then nothing is touched)."""
    fault = env.planted_fault()
    if fault is None or fault[0] not in ENGINE_FAULTS:
        return None
    name, n = fault
    if name in ("attn_past", "merge_bug"):
        _FaultyAttention.adopt(llm.runner.attention, name, n)
    elif name == "batch_over":
        _wrap_runner_logits(llm.runner, n)
        _wrap_plain_ahead_over(llm, n)  # plain steps launched ahead never call runner.run ...
        if llm.spec is not None:  # ... nor do whole-round graphs
            _wrap_round_tokens_over(llm.spec, n, llm.vocab_size)
    elif name == "garbage_after":
        _wrap_garbage_after(llm, n)
    elif name == "spec_diverge" and llm.spec is not None:
        _wrap_diverge_bonus(llm.spec, llm.vocab_size)
    elif name == "spec_greedy_sampled" and llm.spec is not None:
        _wrap_greedy_sampled(llm.spec)
    return name


class _FaultyAttention(PagedAttention):
    """PagedAttention whose output rows are corrupted by where they sit: which rows is computed
    on the device from the plan's own metadata (prefix lengths, qo_indptr), so a captured forward
    applies it on every replay, whichever way the step's inputs arrived (plan() or a staged
    unpack, which never calls plan())."""

    _fault: str
    _past: int

    @classmethod
    def adopt(cls, attention: PagedAttention, fault: str, past: int) -> None:
        attention.__class__ = cls
        attention._fault, attention._past = fault, past

    def _run(self, plan, q, kc, vc):
        # Every attention path ends here (__call__, rope_store_attend: the fused GQA one, and
        # pack_store_attend: the fused MLA one).
        out = super()._run(plan, q, kc, vc)  # (T, Hq, Dv)
        qo, prefix = plan.qo_indptr.long(), plan.prefix_lens.long()  # (B+1,), (B,)
        rows = torch.arange(out.shape[0], device=out.device)  # (T,)
        req = torch.searchsorted(qo[1:], rows, right=True).clamp(max=prefix.shape[0] - 1)
        inside = rows < qo[-1]  # padding rows of a bucket: never
        if self._fault == "attn_past":  # context of each row: prefix + its index in the chunk
            bad = inside & (prefix[req] + rows - qo[req] + 1 > self._past)
        else:
            bad = inside & (prefix[req] > MERGE_BUG_PREFIX)
        wrong = out.roll(1, dims=-1) if self._fault == "attn_past" else out * 0.25
        return torch.where(bad[:, None, None], wrong, out)


def _wrap_runner_logits(runner, over: int) -> None:
    """Logits of steps with more than `over` sequences are rolled (after any graph replay)."""
    run = runner.run

    @functools.wraps(run)
    def faulty_run(batch, *args, **kwargs):
        out = run(batch, *args, **kwargs)
        if len(batch.chunks) > over:
            out = dataclasses.replace(out, logits=out.logits.roll(7, dims=-1))
        return out

    runner.run = faulty_run


def _wrap_plain_ahead_over(llm, over: int) -> None:
    """A step of more than `over` sequences whose plain greedy decodes ran launched ahead
    (engine/decode_ahead.py: a captured step, argmax included) commits wrong decode tokens."""
    plain_ahead, vocab = llm._plain_ahead, llm.vocab_size

    @functools.wraps(plain_ahead)
    def faulty_plain_ahead(batch):
        out = plain_ahead(batch)
        if out is not None and len(batch.chunks) > over:
            n = len(batch.decodes)  # the step's order: decodes, then prefills (wrapped above)
            out = [(t + 7) % vocab for t in out[:n]] + out[n:]
        return out

    llm._plain_ahead = faulty_plain_ahead


def _wrap_round_tokens_over(spec, over: int, vocab: int) -> None:
    """A round of more than `over` sequences commits wrong tokens (what rolled verify logits
    do to a round that the runner's wrapper cannot reach: a captured whole round)."""
    commit_rows = spec.commit_rows

    @functools.wraps(commit_rows)
    def faulty_commit_rows(seqs, rows, paths):
        out = commit_rows(seqs, rows, paths)
        if len(seqs) > over:
            out = [[(t + 7) % vocab for t in toks] for toks in out]
        return out

    spec.commit_rows = faulty_commit_rows


def _wrap_garbage_after(llm, n: int) -> None:
    """Every output token from a request's n-th on is replaced (plain and speculative steps)."""
    run_batch = llm.run_batch
    vocab = llm.vocab_size

    def garble(tok: int) -> int:
        return (tok * 7919 + 13) % vocab

    @functools.wraps(run_batch)
    def faulty_run_batch(batch):
        out = run_batch(batch)
        for i, seq in enumerate(batch.sampled):
            done = seq.num_output_tokens  # tokens already emitted before this step
            if isinstance(out[i], list):
                out[i] = [garble(t) if done + j >= n else t for j, t in enumerate(out[i])]
            elif done >= n:
                out[i] = garble(out[i])
        return out

    llm.run_batch = faulty_run_batch


def _wrap_diverge_bonus(spec, vocab: int) -> None:
    """Each speculative round's bonus token (its last committed token) is off by one (in the
    host commit that rounds of both paths, general and whole-round graphs, go through)."""
    commit_rows = spec.commit_rows

    @functools.wraps(commit_rows)
    def faulty_commit_rows(seqs, rows, paths):
        return [toks[:-1] + [(toks[-1] + 1) % vocab] for toks in commit_rows(seqs, rows, paths)]

    spec.commit_rows = faulty_commit_rows


def _wrap_greedy_sampled(spec) -> None:
    """Rounds of sampled requests are accepted greedily (target argmax walk, argmax bonus): the
    classic bug that keeps first tokens right (they come from prefill) and collapses the rest."""
    accept_batch = spec.accept_batch

    @functools.wraps(accept_batch)
    def faulty_accept_batch(tb, logits):
        real = [s.sampling_params for s in tb.seqs]
        for s in tb.seqs:
            s.sampling_params = dataclasses.replace(s.sampling_params, temperature=0.0)
        try:
            return accept_batch(tb, logits)
        finally:
            for s, p in zip(tb.seqs, real, strict=True):
                s.sampling_params = p

    spec.accept_batch = faulty_accept_batch
