"""Sampled and greedy token picks in one Triton launch (engine/pick_kernels.py) on the CPU
interpreter (TRITON_INTERPRET=1), against the PyTorch reference: fresh random logits, rows mixed
greedy and sampled at several temperatures, a vocabulary that is not a multiple of the chunk; and
the sampled decode step end (engine/decode_step_end.py) against its PyTorch ops, stage advanced
the same. (On a GPU tests/test_decode_ahead_gpu.py runs the compiled kernels.)
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_decode_ahead_gpu.py")

from treeverify.engine import decode_step_end, pick_kernels  # noqa: E402
from treeverify.engine.round_state import RoundState  # noqa: E402
from treeverify.engine.sample_noise import mix  # noqa: E402
from treeverify.engine.step_stage import StepStage  # noqa: E402

interpreted = cache_cleared(pick_kernels._kernels)
interpreted_end = cache_cleared(decode_step_end._kernels)


def _rows(rng: torch.Generator, n: int):
    temps = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.0, 2.5][:n])  # (n,) greedy and sampled
    keys = torch.tensor([mix(int(x)) for x in torch.randint(0, 2**31, (n,), generator=rng)])
    positions = torch.randint(0, 5000, (n,), generator=rng)  # (n,) int64
    return temps, keys, positions


@pytest.mark.parametrize(("vocab", "chunk"), [(1000, 128), (777, 64), (4096, 4096)])
def test_fused_pick_equals_the_pytorch_reference(vocab, chunk):
    rng = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=rng) * 3  # (6, V) fp32
    temps, keys, positions = _rows(rng, 6)
    want = pick_kernels.pick_tokens_torch(logits, temps, keys, positions)
    got = torch.full((6,), -1, dtype=torch.int64)  # poisoned
    got = pick_kernels.pick_tokens(logits, temps, keys, positions, chunk=chunk)
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 4]], logits[[0, 4]].argmax(-1))  # greedy rows: the argmax
    # sampled rows leave the argmax somewhere over a few positions (the draws are live)
    moved = sum(
        int(pick_kernels.pick_tokens(logits, temps, keys, positions + d, chunk=chunk)[3]
            != logits[3].argmax())
        for d in range(8)
    )  # fmt: skip
    assert moved > 0


def test_sampled_step_end_equals_the_pytorch_ops():
    rng = torch.Generator().manual_seed(5)
    page, vocab, b = 4, 900, 4
    stages = []
    for _ in range(2):
        st = StepStage(b, 1, 1, 8, scratch_slot=999, device="cpu")
        st.write_decodes([11, 12, 13], [7, 3, 9], [7, 3, 9], [[1, 2, 3], [4, 5], [6, 7, 8]],
                         [0.0, 0.9, 1.3], [mix(1), mix(2), mix(3)])  # fmt: skip
        stages.append(st)
    logits = torch.randn(b, vocab, generator=rng)  # (b, V)
    want = decode_step_end.end_step_torch(
        logits, stages[0].views, b, 999, RoundState(torch.device("cpu"), page), sampled=True
    )
    got = decode_step_end.end_step(logits, stages[1].views, b, 999, page, chunk=256,
                                   sampled=True)  # fmt: skip
    assert torch.equal(got, want)
    assert got[0] == logits[0].argmax()
    for name in ("ids", "pos", "prefix", "slots", "temp", "key"):
        assert torch.equal(stages[1].views[name], stages[0].views[name]), name


def test_mismatched_rows_are_a_value_error():
    with pytest.raises(ValueError, match="temps/keys/positions"):
        three = torch.zeros(3, dtype=torch.int64)
        pick_kernels.chunk_picks(torch.zeros(3, 16), torch.zeros(2), three, three)
