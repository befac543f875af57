"""LogitsProcessor on random trees: each node's processed logits equal, bit for bit, plain
processing with the committed counts plus the node's own path below the root, and a float64
recomputation within rounding; roots and padding nodes see only the committed counts."""

from __future__ import annotations

import os
import random

import torch

from treeverify.engine.logits_processor import LogitsProcessor
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.sequence import Sequence, SequenceStatus


def _random_tree(rng: random.Random, n: int, vocab: int, padding: int):
    parents = [-1] + [rng.randrange(i) for i in range(1, n - padding)] + [-1] * padding
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tokens, parents


def _path(parents: list[int], i: int) -> list[int]:
    out = []
    while parents[i] >= 0:
        out.append(i)
        i = parents[i]
    return out


def test_tree_nodes_equal_plain_processing_of_their_paths():
    rng = random.Random()
    vocab, b, n = 11, 3, rng.randrange(6, 14)  # a small vocab: tokens repeat along paths
    proc = LogitsProcessor(max_num_seqs=4, vocab_size=vocab, device=torch.device("cpu"))
    seqs = []
    for i in range(b):
        sp = SamplingParams(presence_penalty=rng.uniform(-2, 2),
                            frequency_penalty=rng.uniform(-2, 2),
                            logit_bias={rng.randrange(vocab): rng.uniform(-100, 100)})  # fmt: skip
        seq = Sequence(f"r{i}", [1, 2], sp)
        seq.status = SequenceStatus.RUNNING
        seq.output_token_ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        seqs.append(seq)
    trees = [_random_tree(rng, n, vocab, padding=rng.randrange(3)) for _ in range(b)]
    tokens = torch.tensor([t for t, _ in trees])  # (B, N)
    parents = torch.tensor([p for _, p in trees])  # (B, N)
    logits = torch.randn(b, n, vocab)
    rows = proc.rows(seqs)
    depth = max(len(_path(p, i)) for _, p in trees for i in range(n))
    got = proc.apply(logits, rows, tokens, parents, max_depth=depth)  # (B, N, V)
    for bi, seq in enumerate(seqs):
        p = seq.sampling_params
        for i in range(n):
            committed = seq.output_token_ids + [trees[bi][0][j] for j in _path(trees[bi][1], i)]
            count = torch.bincount(torch.tensor(committed, dtype=torch.int64), minlength=vocab)
            # plain processing of this node as the next decode step would see it
            plain = LogitsProcessor(max_num_seqs=1, vocab_size=vocab, device=torch.device("cpu"))
            one = Sequence("one", [1], p)
            one.status = SequenceStatus.RUNNING
            one.output_token_ids = committed
            expect = plain.apply(logits[bi, i].view(1, 1, -1), plain.rows([one]))[0, 0]
            assert torch.equal(got[bi, i], expect), (bi, i)
            x = logits[bi, i].double() - p.frequency_penalty * count.double()
            x = x - p.presence_penalty * (count > 0).double()
            for tid, bias in p.logit_bias.items():
                x[tid] += bias
            assert torch.allclose(got[bi, i].double(), x, atol=1e-4)


def test_rows_are_reused_and_rebuilt_after_preemption():
    proc = LogitsProcessor(max_num_seqs=2, vocab_size=5, device=torch.device("cpu"))
    sp = SamplingParams(frequency_penalty=1.0)
    a, b = Sequence("a", [1], sp), Sequence("b", [1], sp)
    for s in (a, b):
        s.status = SequenceStatus.RUNNING
    a.output_token_ids = [3, 3]
    ra = int(proc.rows([a])[0])
    assert proc.counts[ra].tolist() == [0, 0, 0, 2, 0]
    a.output_token_ids.append(4)
    proc.commit()
    assert proc.counts[ra].tolist() == [0, 0, 0, 2, 1]
    a.status = SequenceStatus.PREEMPTED
    proc.commit()  # released; b may take the row, a rebuilds its counts when it runs again
    rb = int(proc.rows([b])[0])
    assert proc.counts[rb].tolist() == [0] * 5
    a.status = SequenceStatus.RUNNING
    ra = int(proc.rows([a])[0])
    assert ra != rb and proc.counts[ra].tolist() == [0, 0, 0, 2, 1]
    assert int(proc.rows([Sequence("c", [1])])[0]) == proc.null_row  # no processing


def test_commit_counts_every_request_in_one_scatter_equal_to_a_bincount():
    """Several requests commit tokens over steps (one, several, repeats, none): after each
    commit every held row equals a bincount of that request's output tokens, the other rows
    stay as they were (one scatter over the flattened table must not spill across rows), and
    the penalties staged for a row are the request's."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    rng = random.Random(seed)
    vocab, n = 11, 3
    proc = LogitsProcessor(max_num_seqs=n + 1, vocab_size=vocab, device=torch.device("cpu"))
    seqs = []
    for i in range(n):
        sp = SamplingParams(frequency_penalty=0.5 * i + 0.25, presence_penalty=0.25 * i)
        seq = Sequence(f"r{i}", [1], sp)
        seq.status = SequenceStatus.RUNNING
        seq.output_token_ids = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
        seqs.append(seq)
    rows = proc.rows(seqs).tolist()
    for step in range(6):
        for seq in seqs:
            seq.output_token_ids += [rng.randrange(vocab) for _ in range(rng.randrange(3))]
        proc.commit()
        for seq, row in zip(seqs, rows, strict=True):
            want = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64),
                                  minlength=vocab).float()  # fmt: skip
            assert torch.equal(proc.counts[row], want), f"step {step}, {seq.request_id}"
    for row in set(range(n + 2)) - set(rows):  # free rows and the null row: untouched
        assert not proc.counts[row].any()
    for i, row in enumerate(rows):
        assert proc.frequency[row].item() == 0.5 * i + 0.25
        assert proc.presence[row].item() == 0.25 * i
