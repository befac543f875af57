"""Stop strings are matched only against the new tail of the text, with the same result as a
search of the whole output (first stop, its index, the cut text), multi-byte characters included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from treeverify.engine import BlockManager, SamplingParams, Scheduler, Sequence
from treeverify.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
ALPHABET = "ab\u00e9\u20ac\U0001f600"  # 1- to 4-byte characters: tokens split them


def reference_stop(tokens: list[int], stops: list[str]) -> tuple[int, int, str] | None:
    """(tokens consumed, index, stop) of the first stop found by searching all text each step."""
    for n in range(1, len(tokens) + 1):
        text = TOK.decode(tokens[:n])
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            return n, i, s
    return None


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    picks=st.lists(st.tuples(st.integers(0, 39), st.integers(1, 6)), min_size=1, max_size=4),
    extra=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=3),
)
def test_tail_matching_equals_full_search(text, picks, extra):
    stops = [text[i : i + n] for i, n in picks if text[i : i + n]] + extra
    tokens = TOK.encode(text)
    sched = Scheduler(BlockManager(64, 4), detokenize=TOK.decode)
    seq = Sequence("r", [1], SamplingParams(max_tokens=len(tokens) + 1, stop=stops))
    for tok in tokens:
        seq.output_token_ids.append(tok)
        if sched._check_stop(seq, tok):
            break
    want = reference_stop(tokens, stops)
    if want is None:
        assert not seq.is_finished
        return
    n, i, s = want
    assert seq.finish_reason == "stop" and seq.num_output_tokens == n
    assert (seq.stop_text_index, seq.stop_string) == (i, s)
    assert seq.output_text == TOK.decode(tokens[:n])[:i]
