"""The end of a greedy decode step in two Triton launches (engine/decode_step_end.py) on the CPU
interpreter (TRITON_INTERPRET=1), against the PyTorch ops it replaces (the reference and the
default): fresh random logits with ties placed within one chunk and across chunks (the first
index wins, as torch.argmax), a vocabulary that is not a multiple of the chunk, padding rows,
positions crossing a page boundary; the stage twin's ids, positions, prefix lengths and slots
must come out equal. (On a GPU the fused end runs with TREEVERIFY_FUSED_DECODE_STEP=1, the
default; its A/B is `engine_flag_ab` on bench engine decode.)
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import cache_cleared, interpret_on_cpu

interpret_on_cpu("tests/test_decode_ahead_gpu.py")

from treeverify.engine import decode_step_end  # noqa: E402
from treeverify.engine.round_state import RoundState  # noqa: E402
from treeverify.engine.step_stage import StepStage  # noqa: E402

interpreted = cache_cleared(decode_step_end._kernels)

PAGE = 4


def _stage(rng: torch.Generator, bucket: int, real: int) -> StepStage:
    """A decode stage of `bucket` rows, `real` of them requests (the rest padding), positions
    that cross a page boundary when advanced, random pages in the table."""
    st = StepStage(bucket, 1, 1, 8, scratch_slot=999, device="cpu")
    starts = [int(x) for x in torch.randint(1, 30, (real,), generator=rng)]
    starts[0] = 2 * PAGE - 1  # its next position is the first of a new page
    tables = [torch.randperm(64, generator=rng)[:8].tolist() for _ in range(real)]
    tokens = torch.randint(0, 100, (real,), generator=rng).tolist()
    slots = [tables[i][p // PAGE] * PAGE + p % PAGE for i, p in enumerate(starts)]
    st.write_decodes(tokens, starts, slots, tables)
    return st


@pytest.mark.parametrize(("vocab", "chunk"), [(1000, 128), (4096, 4096), (777, 64)])
@pytest.mark.parametrize(("bucket", "real"), [(1, 1), (4, 3)])
def test_fused_step_end_equals_the_pytorch_ops(vocab, chunk, bucket, real):
    rng = torch.Generator().manual_seed(vocab * 31 + bucket)
    logits = torch.randn(bucket, vocab, generator=rng)  # (b, V) fp32
    top = logits.max() + 1.0
    logits[0, [5, 6]] = top  # a tie within the first chunk: index 5 wins
    early = min(chunk + 3, vocab - 2)  # in the second chunk (the first if there is one)
    if bucket > 1:
        logits[1, [vocab - 1, early]] = top  # a tie across chunks: the earlier one wins
    want_stage, got_stage = _stage(rng, bucket, real), None
    rng2 = torch.Generator().manual_seed(vocab * 31 + bucket)
    torch.randn(bucket, vocab, generator=rng2)  # the same stage again from the same draws
    got_stage = _stage(rng2, bucket, real)
    assert torch.equal(want_stage.dev, got_stage.dev)
    got_stage.views["slots"].fill_(-7)  # poisoned: the kernel must write every row's slot
    got_stage.views["slots"][bucket:] = want_stage.views["slots"][bucket:]
    state = RoundState(torch.device("cpu"), PAGE)
    want = decode_step_end.end_step_torch(logits, want_stage.views, bucket, 999, state)
    got = decode_step_end.end_step(logits, got_stage.views, bucket, 999, PAGE, chunk=chunk)
    assert torch.equal(got, want)
    assert got[0] == 5 and (bucket == 1 or got[1] == early)
    for name in ("ids", "pos", "prefix", "slots", "table", "valid"):
        assert torch.equal(got_stage.views[name], want_stage.views[name]), name
    assert got_stage.views["slots"][0] == got_stage.views["table"][2, 0] * PAGE  # a new page


def test_bad_logits_are_a_value_error():
    st = StepStage(2, 1, 1, 8, scratch_slot=999, device="cpu")
    with pytest.raises(ValueError, match="logits"):
        decode_step_end.end_step(torch.zeros(3, 16), st.views, 2, 999, PAGE)
