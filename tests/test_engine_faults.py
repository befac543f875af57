"""The planted faults (TEST ONLY, engine/faults.py) are inert by default and, when planted, break
exactly the failure class they name; the gate's suite (tests/test_gate_*) proves it catches them."""

from __future__ import annotations

import pytest

from treeverify import env
from treeverify.engine import faults
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = "a fairly long prompt " * 5  # ~100 tokens


def _run(**kw) -> list[list[int]]:
    return [o.token_ids for o in LLM("tiny-llama", **kw).generate(["Hi", LONG], GREEDY)]


@pytest.fixture(scope="module")
def healthy():
    return _run()


def test_no_fault_is_active_by_default(monkeypatch, healthy):
    monkeypatch.delenv("TREEVERIFY_FAULT", raising=False)
    assert faults.active("attn_past") is None
    assert LLM("tiny-llama").planted_fault is None
    assert _run() == healthy


@pytest.mark.parametrize(
    "fault,short_ok,long_ok",
    [("attn_past:64", True, False), ("garbage_after:6", False, False), ("batch_over:1", False,
                                                                          False)],
)  # fmt: skip
def test_planted_faults_break_only_their_class(monkeypatch, healthy, fault, short_ok, long_ok):
    monkeypatch.setenv("TREEVERIFY_FAULT", fault)
    got = _run()
    assert (got[0] == healthy[0]) == short_ok and (got[1] == healthy[1]) == long_ok
    if fault.startswith("garbage_after"):
        assert got[0][:6] == healthy[0][:6]  # the first N tokens are still right


def _staggered(**kw) -> list[list[int]]:
    """Two requests whose prefills run alone (one sequence a forward) and whose decodes then
    run together: only steps of two decodes have more than one sequence."""
    llm = LLM("tiny-llama", **kw)
    a = llm.add_request(LONG, GREEDY)
    llm.step()  # a's prefill alone
    b = llm.add_request("Hi", GREEDY)
    while not (a.is_finished and b.is_finished):
        llm.step()
    if kw.get("decode_lookahead"):
        assert llm.ahead is not None and llm.ahead.ahead_used > 0  # the path under test ran
    return [list(a.output_token_ids), list(b.output_token_ids)]


@pytest.mark.parametrize("lookahead", [False, True])
def test_batch_over_reaches_plain_steps_launched_ahead(monkeypatch, lookahead):
    """Plain greedy steps launched ahead (engine/decode_ahead.py: on by default where graphs
    are captured) never call runner.run, so batch_over wraps their tokens too (eagerly on the
    CPU with decode_lookahead=True, the steps a GPU replays)."""
    clean = _staggered(decode_lookahead=lookahead)
    monkeypatch.setenv("TREEVERIFY_FAULT", "batch_over:1")
    got = _staggered(decode_lookahead=lookahead)
    assert got[0][:1] == clean[0][:1]  # a's first token: its prefill ran alone
    assert got[0] != clean[0] and got[1] != clean[1]


def test_attn_past_starts_where_the_context_crosses(monkeypatch):
    """attn_past:N corrupts exactly the rows whose context exceeds N, decode steps included: a
    56-token prompt's token j comes from a row of context 56 + j, so tokens 0..8 stay right
    (the rows are picked on the device from the plan's metadata, as in a replayed graph)."""
    prompt = list(range(3, 59))  # 56 tokens
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = LLM("tiny-llama").generate([prompt], sp)[0].token_ids
    monkeypatch.setenv("TREEVERIFY_FAULT", "attn_past:64")
    got = LLM("tiny-llama").generate([prompt], sp)[0].token_ids
    assert got[:9] == want[:9] and got != want


def test_spec_diverge_only_with_speculation(monkeypatch, healthy):
    monkeypatch.setenv("TREEVERIFY_FAULT", "spec_diverge")
    assert _run() == healthy  # plain decoding untouched
    spec = _run(speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
                speculative_num_draft_tokens=4)  # fmt: skip
    assert spec != healthy


def test_bad_fault_spec_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TREEVERIFY_FAULT", "attn_past:lots")
    with pytest.raises(ValueError, match="TREEVERIFY_FAULT"):
        faults.active("attn_past")
    # a name not in the table planted nothing, silently: a typo let a fault test believe it
    # had planted one
    monkeypatch.setenv("TREEVERIFY_FAULT", "attn_pst:64")
    with pytest.raises(ValueError, match="TREEVERIFY_FAULT: unknown fault 'attn_pst'"):
        faults.active("attn_past")
    for name in env.FAULT_NAMES:  # the table and the names the code acts on agree
        assert name in faults.__doc__
    assert set(faults.ENGINE_FAULTS) <= set(env.FAULT_NAMES)
