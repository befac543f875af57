"""One request's prefill chunk as a padded chain bucket (1, n) (ModelRunner._run_prefill), on the
CPU: the stage's layout, the padded forward against the plain eager prefill (tokens, logprobs,
the drafter's context rows), and the staged + unpacked path (what a captured graph replays)
against the eager padded one. On a GPU every short prefill takes this path and
tests/test_engine_gpu.py compares graphs on and off.
"""

from __future__ import annotations

import random

import pytest
import torch

from treeverify.engine.cuda_graphs import CudaGraphs
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.step_stage import StepStage
from treeverify.kernels.bits import chain_bits


def test_write_prefill_pads_a_chain():
    stage = StepStage(batch=1, n=40, words=2, pages=5, scratch_slot=999, device=torch.device("cpu"))
    v = stage.views
    for t in v.values():
        t.fill_(-7)  # poison: every field the step uses must be written
    tokens, slots = list(range(100, 130)), list(range(70, 100))  # P = 30 of n = 40
    stage.write_prefill(tokens, 12, slots, [4, 2, 8])
    assert v["ids"].tolist() == tokens + [0] * 10
    assert v["pos"].tolist() == list(range(12, 42)) + [41] * 10  # padding at the last position
    assert v["slots"].tolist() == slots + [999] * 10  # padding K/V to the scratch slot
    assert v["valid"].tolist() == [1] * 30 + [0] * 10
    assert v["prefix"].tolist() == [12] and v["qo"].tolist() == [0, 40]
    assert v["mask"].equal(chain_bits(40))  # row i sees rows 0..i: no real row sees padding
    assert v["table"].t()[0, :3].tolist() == [4, 2, 8]
    with pytest.raises(ValueError, match="tokens: 41"):
        stage.write_prefill(list(range(41)), 0, list(range(41)), [1, 2, 3])
    with pytest.raises(ValueError, match="bucket \\(2, 8\\)"):
        StepStage(2, 8, 1, 2, 9, torch.device("cpu")).write_prefill([1, 2], 0, [5, 6], [1])


def engine(padded: bool, **kw) -> LLM:
    llm = LLM("tiny-llama", device="cpu", num_pages=96, max_num_seqs=2, **kw)
    if padded:  # what a GPU engine sets (EngineConfig.prefill_graph_sizes)
        llm.runner.plan_batch_sizes = [1, 2]
        llm.runner.prefill_sizes = [32, 64]
    return llm


def test_padded_prefill_equals_the_plain_prefill(monkeypatch):
    """Greedy tokens and their logprobs with prefills padded to 32/64 rows equal the plain
    eager prefill's (fp32 on the CPU: the padding is invisible to the real rows); prompts of 3,
    20, 33 and 64 tokens take the padded path, 100 tokens (past the largest bucket) does not."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 20, 33, 64, 100)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    want = engine(False).generate(prompts, sp)
    llm = engine(True)
    ran = []
    real = llm.runner._run_prefill
    monkeypatch.setattr(llm.runner, "_run_prefill", lambda c, n: ran.append(n) or real(c, n))
    got = [llm.generate([p], sp)[0] for p in prompts]  # one at a time: single-request steps
    assert ran == [32, 32, 64, 64]
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_padded_prefill_keeps_the_drafters_context_rows():
    """DDTREE with the DFlash drafter: the padded prefill hands the drafter only the real rows
    (hidden states sliced to the chunk), so its context rows equal the plain prefill's and the
    greedy output equals plain decoding."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = list(range(40, 90))  # 50 tokens: bucket 64
    kw = dict(speculative_algorithm="DDTREE", speculative_draft_model_path="tiny-dflash",
              speculative_ddtree_budget=8, speculative_adaptive=False)  # fmt: skip
    outs, rows = [], []
    for padded in (False, True):
        llm = engine(padded, **kw)
        seq = llm.add_request(prompt, sp)
        llm.step()  # the prefill
        kv, start = llm.spec.source.context.keys_values(seq.request_id)
        rows.append((kv.clone(), start))
        while not seq.is_finished:
            llm.step()
        outs.append(llm.output(seq).token_ids)
    assert rows[0][1] == rows[1][1] and rows[0][0].shape == rows[1][0].shape
    torch.testing.assert_close(rows[1][0], rows[0][0], rtol=1e-4, atol=1e-4)
    plain = engine(False).generate([prompt], sp)[0].token_ids
    assert outs[0] == outs[1] == plain


def test_staged_prefill_equals_the_eager_padded_prefill(monkeypatch):
    """The graph branch (stage written, unpacked, forward with the last valid row computed from
    the staged valid rows: what the captured graph runs), eagerly on the CPU: its logits and
    hidden rows equal the eager padded branch's."""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm = engine(True)
    runner = llm.runner
    seq = llm.add_request(list(range(7, 52)), sp)  # 45 tokens: bucket 64
    batch = llm.scheduler.schedule()
    (chunk,) = batch.chunks
    want = runner.run(batch).logits.clone()  # (1, V) the eager padded branch
    bucket = (1, 64)
    graphs = CudaGraphs(llm.model, runner.attention, buckets=[bucket], max_pages=8, prefill=(64,))
    with torch.inference_mode():
        graphs.prepare_stage(*bucket)

    def replay(bucket_, b):  # what the captured graph runs, eagerly
        with torch.inference_mode():
            for p in runner.attention.plans_for(bucket_):
                for t in (p.prefix_lens, p.qo_indptr, p.tree_mask, p.block_table):
                    t.fill_(-1)
            graphs.ids.fill_(-1)
            graphs.valid.fill_(True)
            graphs._unpack(graphs.stages[bucket_], *bucket_)
            runner.attention.select(bucket_)
            return graphs.forward_rows(64, last_row=True)

    monkeypatch.setattr(graphs, "replay", replay)
    graphs.steps[bucket] = None  # "captured"
    runner.graphs = graphs
    got = runner.run(batch).logits
    assert got.shape == want.shape == (1, llm.model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert seq.num_prompt_tokens == chunk.num_tokens == 45


def _prefill_steps(llm, monkeypatch) -> list[list[int]]:
    """Spy: the buckets `_run_prefill` ran, grouped by engine step."""
    steps: list[list[int]] = []
    real_run, real_one = llm.runner.run, llm.runner._run_prefill

    def run(batch, *a, **kw):
        steps.append([])
        return real_run(batch, *a, **kw)

    monkeypatch.setattr(llm.runner, "run", run)
    monkeypatch.setattr(llm.runner, "_run_prefill",
                        lambda c, n: steps[-1].append(n) or real_one(c, n))  # fmt: skip
    return steps


@pytest.mark.parametrize("replays", ["1", "0"])
def test_prefills_arriving_together_run_one_padded_chain_each(monkeypatch, replays):
    """Three prompts added at once make one step of three prefill chunks: with
    TREEVERIFY_PREFILL_REPLAYS=1 each runs as its own padded chain (a graph replay on a GPU) in
    that one step, with 0 the step is one eager forward; greedy tokens and logprobs equal the
    plain engine's either way (fp32: padding is invisible to real rows)."""
    monkeypatch.setenv("TREEVERIFY_PREFILL_REPLAYS", replays)
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 40, 25)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    plain = LLM("tiny-llama", device="cpu", num_pages=96, max_num_seqs=3).generate(prompts, sp)
    llm = LLM("tiny-llama", device="cpu", num_pages=96, max_num_seqs=3)
    llm.runner.plan_batch_sizes, llm.runner.prefill_sizes = [1, 2, 3], [32, 64]
    steps = _prefill_steps(llm, monkeypatch)
    got = llm.generate(prompts, sp)
    assert steps[0] == ([32, 64, 32] if replays == "1" else []), steps[:2]
    assert not any(steps[1:])  # decodes after
    for a, b in zip(got, plain, strict=True):
        assert a.token_ids == b.token_ids, seed
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4), seed


def test_prefills_arriving_together_keep_each_drafters_context_rows(monkeypatch):
    """DDTREE with the DFlash drafter, two prompts in one step of two padded chains: each
    request's context rows are its own chunk's real rows (the hidden rows of both replays kept
    in the step's order), as in the plain engine's one eager forward; greedy output equals plain
    decoding."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(40, 90)), list(range(100, 121))]  # buckets 64 and 32
    kw = dict(speculative_algorithm="DDTREE", speculative_draft_model_path="tiny-dflash",
              speculative_ddtree_budget=8, speculative_adaptive=False)  # fmt: skip
    rows, outs = [], []
    for padded in (False, True):
        llm = LLM("tiny-llama", device="cpu", num_pages=96, max_num_seqs=2, **kw)
        if padded:
            llm.runner.plan_batch_sizes, llm.runner.prefill_sizes = [1, 2], [32, 64]
            steps = _prefill_steps(llm, monkeypatch)
        seqs = [llm.add_request(p, sp) for p in prompts]
        llm.step()  # both prefills
        if padded:
            assert steps == [[64, 32]]
        rows.append([llm.spec.source.context.keys_values(q.request_id) for q in seqs])
        while not all(q.is_finished for q in seqs):
            llm.step()
        outs.append([llm.output(q).token_ids for q in seqs])
    for (kv0, s0), (kv1, s1) in zip(rows[0], rows[1], strict=True):
        assert s0 == s1 and kv0.shape == kv1.shape
        torch.testing.assert_close(kv1, kv0, rtol=1e-4, atol=1e-4)
    plain = LLM("tiny-llama", device="cpu", num_pages=96, max_num_seqs=2).generate(prompts, sp)
    assert outs[0] == outs[1] == [o.token_ids for o in plain]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefill_graphs_on_a_gpu_equal_eager_and_replay_their_bucket():
    """tiny-code on a GPU: short prompts' prefills replay their (1, n) graph; greedy tokens equal
    the eager padded prefill's (graphs off) and, within bf16 near-ties, the plain prefill's
    (prefill graphs off); a 600-token prompt (past 512) runs eagerly."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 8000, (n,), generator=g).tolist() for n in (5, 40, 200, 600)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for name, kw in (("graphs", {}), ("eager", {"disable_cuda_graph": True}),
                     ("plain", {"disable_prefill_graphs": True})):  # fmt: skip
        llm = LLM("tiny-code", device="cuda", num_pages=256, max_num_seqs=2, **kw)
        replayed = []
        if name == "graphs":
            graphs = llm.runner.graphs
            assert {(1, n) for n in (32, 64, 128, 256, 512)} <= set(graphs.steps)

            def spy(bucket, b, _seen=replayed, _real=graphs.replay):
                _seen.append(bucket)
                return _real(bucket, b)

            graphs.replay = spy
        outs[name] = [llm.generate([p], sp)[0].token_ids for p in prompts]
        if name == "graphs":
            assert [bn for bn in replayed if bn[1] > 1] == [(1, 32), (1, 64), (1, 256)]
        del llm
        torch.cuda.empty_cache()
    assert outs["graphs"] == outs["eager"]
    same = sum(a == b for a, b in zip(outs["graphs"], outs["plain"], strict=True))
    assert same >= 3, (outs["graphs"], outs["plain"])  # a bf16 near-tie may part one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefills_arriving_together_replay_their_buckets_on_a_gpu():
    """tiny-code on a GPU, four prompts added at once: the first step replays four (1, n)
    prefill graphs (TREEVERIFY_PREFILL_REPLAYS, default on), and the greedy tokens equal the
    eager padded chains' (graphs off: the same chains, same kernels' shapes)."""
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(3, 8000, (n,), generator=g).tolist() for n in (5, 40, 200, 90)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for name, kw in (("graphs", {}), ("eager", {"disable_cuda_graph": True})):
        llm = LLM("tiny-code", device="cuda", num_pages=256, max_num_seqs=4, **kw)
        replayed = []
        if name == "graphs":
            graphs = llm.runner.graphs

            def spy(bucket, b, _seen=replayed, _real=graphs.replay):
                _seen.append(bucket)
                return _real(bucket, b)

            graphs.replay = spy
        outs[name] = [o.token_ids for o in llm.generate(prompts, sp)]
        if name == "graphs":
            assert replayed[:4] == [(1, 32), (1, 64), (1, 256), (1, 128)], replayed[:6]
        del llm
        torch.cuda.empty_cache()
    assert outs["graphs"] == outs["eager"]
