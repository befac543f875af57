"""StepBatch: one step's flat forward inputs for prefill chunks, plain decodes and speculative
trees at once; each tree in its sequence's place (positions P + depth, slots P + i, its mask)."""

from __future__ import annotations

import random

import torch

from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.scheduler import ScheduledBatch, ScheduledChunk
from treeverify.engine.sequence import Sequence
from treeverify.engine.speculative import TreeBatch
from treeverify.engine.step_batch import StepBatch
from treeverify.kernels.bits import chain_bits
from treeverify.spec import parents_to_tree_mask


def _seq(rid: str, n: int, rng: random.Random) -> Sequence:
    return Sequence(rid, [rng.randrange(1000) for _ in range(n)], SamplingParams())


def _decode(seq: Sequence, rng: random.Random) -> ScheduledChunk:
    p = seq.num_tokens - 1
    return ScheduledChunk(seq, p, 1, [rng.randrange(10_000)])


def _trees(seqs: list[Sequence], n: int, rng: random.Random) -> TreeBatch:
    b = len(seqs)
    parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, n)] for _ in range(b)])
    depths = torch.zeros(b, n, dtype=torch.int64)
    for i in range(1, n):
        depths[:, i] = depths.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    tokens = torch.randint(0, 1000, (b, n))
    slots = torch.tensor([[s.num_tokens - 1 + i + 5000 * k for i in range(n)]
                          for k, s in enumerate(seqs)])  # fmt: skip
    return TreeBatch(seqs, tokens, parents, depths, slots, parents_to_tree_mask(parents),
                     int(depths.max()), 0.0, n - 1)  # fmt: skip


def test_a_mixed_step_puts_each_tree_in_its_place():
    rng = random.Random()
    n = rng.randint(2, 40)
    a, b, c, d = (_seq(x, rng.randint(2, 30), rng) for x in "abcd")
    # decodes a (tree), b (plain: opted out), c (tree), then d's prefill chunk
    batch = ScheduledBatch(decodes=[_decode(a, rng), _decode(b, rng), _decode(c, rng)])
    d_len = rng.randint(1, d.num_tokens)
    batch.prefills = [ScheduledChunk(d, 0, d_len, [rng.randrange(10_000) for _ in range(d_len)])]
    tb = _trees([a, c], n, rng)
    step = StepBatch.build(batch, tb, torch.device("cpu"), prompt_from={"d": 0})

    ids, pos, slots, mask_rows = [], [], [], []
    for chunk in batch.chunks:  # the expected layout, built per token on the host
        k = {"a": 0, "c": 1}.get(chunk.seq.request_id)
        if k is None:
            q = chunk.num_tokens
            ids += chunk.token_ids
            pos += list(range(chunk.start, chunk.start + q))
            slots += chunk.slots
            mask_rows += chain_bits(q).tolist()
        else:
            ids += tb.tokens[k].tolist()
            pos += (chunk.start + tb.depths[k]).tolist()
            slots += tb.slots[k].tolist()
            mask_rows += tb.mask[k * n : (k + 1) * n].tolist()
    assert step.ids.tolist() == ids and step.positions.tolist() == pos
    assert step.slots.tolist() == slots
    assert step.query_lens == [n, 1, n, d_len] and step.prefix_lens == [c.start for c in
                                                                        batch.chunks]  # fmt: skip
    assert not step.decode_shaped
    for got, want in zip(step.mask.tolist(), mask_rows, strict=True):
        assert got[: len(want)] == want and not any(got[len(want) :])
    sampled = [s.request_id for s in batch.sampled]
    spans = dict(zip(sampled, step.spans, strict=True))
    rows = step.logits_rows or list(range(len(ids)))  # None: every row, in order
    assert [rows[i] for i in range(*_range(spans["a"]))] == list(range(n))
    assert [rows[i] for i in range(*_range(spans["b"]))] == [n]
    assert [rows[i] for i in range(*_range(spans["c"]))] == list(range(n + 1, 2 * n + 1))
    if "d" in spans:  # the prefill chunk reached the end of d: its last token is sampled
        assert rows[spans["d"][0]] == 2 * n + d_len
    (rid, first, at, m), = step.prompt_spans  # fmt: skip
    assert (rid, first, m) == ("d", 0, min(d_len, d.num_prompt_tokens - 1))
    assert rows[at : at + m] == list(range(2 * n + 1, 2 * n + 1 + m))


def _range(span: tuple[int, int]) -> tuple[int, int]:
    return span[0], span[0] + span[1]


def test_a_step_of_trees_only_uses_the_tree_batch_as_is():
    rng = random.Random()
    n = rng.randint(2, 20)
    seqs = [_seq(f"s{i}", rng.randint(2, 30), rng) for i in range(3)]
    batch = ScheduledBatch(decodes=[_decode(s, rng) for s in seqs])
    tb = _trees(seqs, n, rng)
    step = StepBatch.build(batch, tb, torch.device("cpu"))
    assert step.mask is tb.mask and step.decode_shaped and step.logits_rows is None
    assert step.ids.tolist() == tb.tokens.reshape(-1).tolist()
    starts = torch.tensor([s.num_tokens - 1 for s in seqs])[:, None]
    assert step.positions.tolist() == (starts + tb.depths).reshape(-1).tolist()
    plain = StepBatch.build(batch, None, torch.device("cpu"))  # the same decodes, no trees
    assert plain.mask is None and plain.decode_shaped and plain.query_lens == [1, 1, 1]
