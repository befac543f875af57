"""The staged step inputs (engine/step_stage.py) against the general path, on the CPU.

A replayed CUDA-graph step reads everything from a bucket's `StepStage`, unpacked by the graph's
first nodes. Here the same unpack runs eagerly (no GPU needed): a real decode batch staged and
unpacked must give the same logits as the general path's `PagedAttention.plan` + forward, and
the stage's fields must hold exactly the layout the kernels expect, padding included. The GPU
tests (test_engine_gpu.py) run the captured version against eager decoding.
"""

from __future__ import annotations

import torch

from treeverify.engine.cuda_graphs import CudaGraphs
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.step_stage import StepStage


def test_decodes_fill_every_field_and_pad_the_rest():
    stage = StepStage(batch=4, n=1, words=1, pages=6, scratch_slot=999, device=torch.device("cpu"))
    v = stage.views
    for t in v.values():
        t.fill_(-7)  # poison: every field the step uses must be written
    stage.write_decodes([11, 12, 13], [5, 17, 2], [37, 81, 3], [[2, 3], [4, 5], [9]])
    assert v["ids"].tolist() == [11, 12, 13, 0]
    assert v["pos"].tolist() == [5, 17, 2, 0] and v["prefix"].tolist() == [5, 17, 2, 0]
    assert v["slots"].tolist() == [37, 81, 3, 999]  # padding rows write to the scratch slot
    assert v["qo"].tolist() == [0, 1, 2, 3, 3]  # the padding request is an empty tree
    assert v["valid"].tolist() == [1, 1, 1, 0]
    assert v["mask"][:, 0].tolist() == [1, 1, 1, 0]
    table = v["table"].t()  # (B, pages)
    assert table[:, :2].tolist() == [[2, 3], [4, 5], [9, 0], [0, 0]]
    # only the page rows in use are copied: the rest keeps what it held (read by no kernel)
    assert (table[:, 2:] == -7).all()


def test_a_table_grown_by_a_page_is_not_current_until_restaged():
    """`table_current`: what a step launched ahead checks before restaging the page table (a
    hold may have added a page; restaging every step was a copy a round for nothing)."""
    stage = StepStage(batch=2, n=1, words=1, pages=4, scratch_slot=99, device=torch.device("cpu"))
    tables = [[2, 3], [4]]
    assert not stage.table_current(tables)  # nothing staged yet
    stage.write_decodes([1, 2], [20, 5], [50, 69], tables)
    assert stage.table_current(tables)
    tables[1].append(7)  # a hold added a page
    assert not stage.table_current(tables)
    stage.views["table"].fill_(-7)
    stage.write_table(tables)
    assert stage.table_current(tables)
    assert stage.views["table"].t()[:, :2].tolist() == [[2, 3], [4, 7]]
    # a round's commit gave a reserved tail page back (the block manager makes a new list
    # then) and a hold regrew the table with another page: the same length, another table
    tables[0] = tables[0][:-1]
    tables[0].append(5)
    assert not stage.table_current(tables)
    stage.write_table(tables)
    assert stage.table_current(tables) and not stage.table_current([list(t) for t in tables])


def test_device_step_stages_host_part_and_copies_device_rows():
    stage = StepStage(batch=2, n=3, words=1, pages=4, scratch_slot=50, device=torch.device("cpu"))
    v = stage.views
    for t in v.values():
        t.fill_(-7)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    pos = torch.tensor([4, 5, 5, 9, 10, 11])
    slots = torch.tensor([20, 21, 22, 30, 31, 32])
    mask = torch.tensor([[1], [3], [5], [1], [3], [7]], dtype=torch.int32)
    stage.write_device_step([4, 9], [[1, 2], [3]], ids, slots, mask, pos=pos)
    assert v["ids"].tolist() == ids.tolist() and v["pos"].tolist() == pos.tolist()
    assert v["slots"].tolist() == slots.tolist() and v["mask"].equal(mask)
    assert v["qo"].tolist() == [0, 3, 6] and v["prefix"].tolist() == [4, 9]
    assert v["valid"].tolist() == [1] * 6


def test_staged_unpack_gives_the_general_paths_logits():
    """A real decode batch of a real engine (tiny-llama, CPU): staged + unpacked + forward over
    the bucket equals the general path (plan from the chunks + forward), row for row."""
    llm = LLM("tiny-llama", device="cpu", num_pages=64, max_num_seqs=4)
    llm.runner.plan_batch_sizes = [4]  # decode steps use the bucket's plans, as on a GPU
    g = torch.Generator().manual_seed(3)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for n in (9, 23, 40):
        llm.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), sp)
    for _ in range(3):  # prefill, then decodes
        llm.step()
    batch = llm.scheduler.schedule()
    chunks = batch.chunks
    assert len(chunks) == 3 and all(c.num_tokens == 1 for c in chunks)
    runner, att = llm.runner, llm.runner.attention
    bucket = (4, 1)
    want = runner.run(batch).per_sequence()  # the general path (eager, the bucket's plans)
    want = torch.cat([w.clone() for w in want])  # (3, V)
    graphs = CudaGraphs(llm.model, att, buckets=[bucket], max_pages=8)
    assert att.bucket == bucket and att.plans_for(bucket)
    stage = graphs._stage(*bucket)
    tables = [c.seq.block_table for c in chunks]
    stage.write_decodes([c.token_ids[0] for c in chunks], [c.start for c in chunks],
                        [c.slots[0] for c in chunks], tables)  # fmt: skip
    with torch.inference_mode():  # the plans were made (as in a capture) in inference mode
        for p in att.plans_for(bucket):  # poison the plans: the unpack must rewrite them
            for t in (p.prefix_lens, p.qo_indptr, p.tree_mask, p.block_table):
                t.fill_(-1)
        graphs.ids.fill_(-1)
        graphs._unpack(stage, *bucket)
        got = graphs.forward_rows(4)[:3]  # (3, V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_staged_round_gives_the_general_paths_logits(monkeypatch):
    """A real DDTREE round (tiny-llama, n-gram drafter, CPU): `ModelRunner._replay_round` stages
    the TreeBatch (positions computed from the staged prefixes) and the unpacked forward equals
    the general path's (StepBatch + plan), for every tree node."""
    llm = LLM("tiny-llama", device="cpu", num_pages=64, max_num_seqs=4,
              speculative_algorithm="DDTREE", speculative_ddtree_budget=4)  # fmt: skip
    runner, att = llm.runner, llm.runner.attention
    runner.plan_batch_sizes = [4]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for k in range(3):
        llm.add_request(list(range(10 + k, 30 + k)) * 2, sp)  # repetitive: n-gram drafts
    for _ in range(2):
        llm.step()
    batch = llm.scheduler.schedule()
    assert batch.chunks and all(c.num_tokens == 1 for c in batch.chunks)
    tb = llm.spec.draft_batch([c.seq for c in batch.chunks], llm.device)
    n = tb.nodes
    want = runner.run(batch, tb).logits.clone()  # (B*N, V) the general path
    bucket = (4, n)
    assert att.bucket == bucket and tb.slots_host is not None
    graphs = CudaGraphs(llm.model, att, buckets=[bucket], max_pages=8)
    stage = graphs._stage(*bucket)

    def replay(bucket_, b):  # what the captured graph runs, eagerly
        with torch.inference_mode():
            for p in att.plans_for(bucket_):
                for t in (p.prefix_lens, p.qo_indptr, p.tree_mask, p.block_table):
                    t.fill_(-1)
            graphs.pos.fill_(-1)
            graphs._unpack(stage, *bucket_)
            return graphs.forward_rows(bucket_[0] * bucket_[1])[: b * bucket_[1]]

    monkeypatch.setattr(graphs, "replay", replay)
    runner.graphs = graphs

    def no_step_batch(*a, **k):
        raise AssertionError("a whole round must not build a StepBatch")

    monkeypatch.setattr("treeverify.engine.model_runner.StepBatch.build", no_step_batch)
    got = runner.run(batch, tb).logits  # (B*N, V) through _replay_round
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    b = len(batch.chunks)
    starts = torch.tensor([c.start for c in batch.chunks])
    assert stage.views["pos"][: b * n].view(b, n).equal(starts[:, None] + tb.depths)


def test_a_request_past_the_staged_page_table_runs_eagerly(monkeypatch):
    """The stage holds page tables up to the pages a request of the model's context can need;
    a request past that (the LLM API does not bound contexts by the model's) must not reach the
    graph: its step runs on the general path, with the same logits."""
    llm = LLM("tiny-llama", device="cpu", num_pages=64, max_num_seqs=4)
    llm.runner.plan_batch_sizes = [4]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    llm.add_request(torch.randint(0, 256, (70,), generator=g).tolist(), sp)  # 5 pages of 16
    llm.add_request(torch.randint(0, 256, (9,), generator=g).tolist(), sp)
    llm.step()
    batch = llm.scheduler.schedule()
    assert all(c.num_tokens == 1 for c in batch.chunks)
    want = torch.cat([w.clone() for w in llm.runner.run(batch).per_sequence()])
    graphs = CudaGraphs(llm.model, llm.runner.attention, buckets=[(4, 1)], max_pages=3)
    graphs._stage(4, 1)

    def replay(bucket, b):
        raise AssertionError("a request with more pages than staged must not replay")

    monkeypatch.setattr(graphs, "replay", replay)
    llm.runner.graphs = graphs
    got = torch.cat(llm.runner.run(batch).per_sequence())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_decode_shaped_step_off_the_fast_path_is_staged_with_its_chain_mask(monkeypatch):
    """A step of one-token chunks while a request still collects prompt logprobs (its last
    prefill chunk is one token) has no prompt rows to keep: it is staged like any decode step
    (it once went through StepBatch and failed there on its missing tree mask)."""
    llm = LLM("tiny-llama", device="cpu", num_pages=64, max_num_seqs=4)
    llm.runner.plan_batch_sizes = [4]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    g = torch.Generator().manual_seed(6)
    for n in (12, 30):
        llm.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), sp)
    llm.step()
    batch = llm.scheduler.schedule()
    assert all(c.num_tokens == 1 for c in batch.chunks)
    runner, att = llm.runner, llm.runner.attention
    want = torch.cat([w.clone() for w in runner.run(batch).per_sequence()])
    graphs = CudaGraphs(llm.model, att, buckets=[(4, 1)], max_pages=8)
    stage = graphs._stage(4, 1)
    used = []

    def replay(bucket, b):  # the captured graph's work, eagerly
        used.append(bucket)
        with torch.inference_mode():
            graphs._unpack(stage, *bucket)
            return graphs.forward_rows(bucket[0] * bucket[1])[: b * bucket[1]]

    monkeypatch.setattr(graphs, "replay", replay)
    runner.graphs = graphs
    rid = batch.chunks[0].seq.request_id
    got = torch.cat(runner.run(batch, None, {rid: 0}).per_sequence())
    assert used == [(4, 1)]  # staged and replayed, not run eagerly
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
