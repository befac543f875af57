"""BlockManager: pages, ref counts, free, fork, and reserve/commit rollback (no torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from treeverify.engine import BlockManager, SamplingParams, Sequence

SRC = Path(__file__).resolve().parents[1] / "src"


def seq(rid: str = "r", n: int = 1) -> Sequence:
    return Sequence(rid, list(range(n)))


def test_engine_modules_import_without_torch():
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(SRC)!r})
        sys.modules["torch"] = None  # any 'import torch' now raises ImportError
        import treeverify.engine
        from treeverify.engine import block_manager, sampling_params, scheduler, sequence
        assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_allocate_slots_and_pages():
    bm = BlockManager(num_pages=4, page_size=4)
    s = seq("a", 6)
    assert bm.can_allocate(s)
    slots = bm.allocate(s)
    assert s.block_table == [0, 1]
    assert slots == [0, 1, 2, 3, 4, 5]
    assert bm.num_free_pages == 2 and bm.ref_counts == [1, 1, 0, 0]
    assert bm.append_slots(s, 2) == [6, 7]  # fills page 1, no new page
    assert bm.num_free_pages == 2
    assert bm.append_slots(s, 1) == [8]
    assert s.block_table == [0, 1, 2] and s.num_slots == 9
    assert bm.slot(s, 8) == 8
    bm.check([s])


def test_exhausted_pool_refuses():
    bm = BlockManager(num_pages=2, page_size=4)
    a, b = seq("a", 5), seq("b", 4)
    bm.allocate(a)
    assert not bm.can_allocate(b)
    with pytest.raises(RuntimeError, match="need 1 new pages, only 0 free"):
        bm.allocate(b)
    assert not bm.owns(b)
    assert bm.can_allocate(a, 3)  # fits in a's partly filled page
    assert not bm.can_allocate(a, 4)
    bm.free(a)
    assert bm.can_allocate(b) and bm.num_free_pages == 2
    bm.check([])


def test_misuse_is_reported():
    bm = BlockManager(num_pages=2, page_size=2)
    a = seq("a", 2)
    with pytest.raises(ValueError, match="holds no allocation"):
        bm.append_slots(a, 1)
    bm.allocate(a)
    with pytest.raises(ValueError, match="already holds pages"):
        bm.allocate(a)
    with pytest.raises(ValueError, match="only 0 slots are reserved"):
        bm.commit(a, 1)
    bm.reserve(a, 2)
    with pytest.raises(RuntimeError, match="reserved slots; commit first"):
        bm.append_slots(a, 1)
    with pytest.raises(RuntimeError, match="commit before reserving again"):
        bm.reserve(a, 1)
    with pytest.raises(ValueError, match="only 2 slots are reserved"):
        bm.commit(a, 3)
    bm.commit(a, 0)
    bm.free(a)
    with pytest.raises(ValueError, match="freed already"):
        bm.free(a)
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(4, 0)


def test_reserve_commit_frees_only_rejected_pages():
    bm = BlockManager(num_pages=8, page_size=4)
    a = seq("a", 5)
    bm.allocate(a)  # pages [0, 1], 5 slots
    slots = bm.reserve(a, 9)  # tree of 9 nodes: positions 5..13 -> pages 1, 2, 3
    assert slots == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert a.block_table == [0, 1, 2, 3]
    before = a.block_table
    freed = bm.commit(a, 3)  # accepted path of 3: positions 5..7 stay
    assert freed == [3, 2]
    assert a.block_table == [0, 1] and a.num_slots == 8
    # a table that lost pages is a new list (a staged step compares tables by identity)
    assert a.block_table is not before and before == [0, 1, 2, 3]
    assert bm.num_free_pages == 6
    kept = a.block_table
    bm.reserve(a, 4)
    assert bm.commit(a, 4) == [] and a.num_slots == 12 and a.block_table == [0, 1, 2]
    assert a.block_table is kept  # grown in place, nothing given back
    bm.check([a])


def test_hold_keeps_pages_ahead_for_a_round_launched_early():
    """A round launched before the previous one's result is read writes up to `upto`: those
    pages stay in the table through commit, later slots take them, release gives the rest back."""
    bm = BlockManager(num_pages=8, page_size=4)
    a = seq("a", 5)
    bm.allocate(a)  # pages [0, 1], 5 slots
    bm.reserve(a, 3)  # this round: positions 5..7
    assert bm.hold(a, 16)  # the next round may reach position 15: pages 2, 3 held
    assert a.block_table == [0, 1, 2, 3] and bm.num_free_pages == 4
    assert bm.commit(a, 1) == []  # 6 slots kept, the held pages stay
    assert a.num_slots == 6 and a.block_table == [0, 1, 2, 3]
    bm.check([a])
    assert bm.append_slots(a, 5) == [6, 7, 8, 9, 10]  # held pages, no new one
    assert bm.num_free_pages == 4
    assert not bm.hold(a, 40)  # 10 pages: more than the pool; nothing taken
    assert a.block_table == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="release_hold"):
        bm.fork(a, seq("b", 11))
    assert bm.release_hold(a) == [3]  # 11 slots need pages 0..2
    bm.check([a])
    bm.free(a)
    assert bm.num_free_pages == 8
    bm.check([])


def test_fork_shares_full_pages_and_copies_partial():
    bm = BlockManager(num_pages=6, page_size=4)
    p = seq("p", 6)
    bm.allocate(p)  # pages [0, 1], page 1 half full
    c = seq("c", 6)
    copies = bm.fork(p, c)
    assert copies == [(1, 2)]
    assert c.block_table == [0, 2] and bm.ref_counts[:3] == [2, 1, 1]
    bm.append_slots(c, 3)
    bm.append_slots(p, 3)
    assert c.block_table == [0, 2, 3] and p.block_table == [0, 1, 4]
    bm.check([p, c])
    bm.free(p)
    assert bm.ref_counts[0] == 1  # still the child's
    bm.check([c])
    bm.free(c)
    assert bm.num_free_pages == 6
    bm.check([])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations against a model: per sequence, its slot count and reservation."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_pages=12, page_size=3)
        self.live: dict[str, Sequence] = {}
        self.model: dict[str, tuple[int, int]] = {}  # rid -> (num_slots, reserved)
        self.held: dict[str, int] = {}  # rid -> positions below it keep their pages
        self.next_id = 0

    def _new(self) -> Sequence:
        self.next_id += 1
        return seq(f"s{self.next_id}")

    @rule(n=st.integers(0, 10))
    def allocate(self, n):
        s = self._new()
        ok = self.bm.can_allocate(s, n)
        if ok:
            self.bm.allocate(s, n)
            self.live[s.request_id] = s
            self.model[s.request_id] = (n, 0)
        else:
            free_before = self.bm.num_free_pages
            with pytest.raises(RuntimeError):
                self.bm.allocate(s, n)
            assert self.bm.num_free_pages == free_before and not self.bm.owns(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(0, 7))
    def append(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        s, (slots, res) = self.live[rid], self.model[rid]
        if res:
            with pytest.raises(RuntimeError):
                self.bm.append_slots(s, n)
        elif self.bm.can_allocate(s, n):
            out = self.bm.append_slots(s, n)
            assert out == [self.bm.slot(s, p) for p in range(slots, slots + n)]
            self.model[rid] = (slots + n, 0)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(0, 9))
    def reserve(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        s, (slots, res) = self.live[rid], self.model[rid]
        if not res and self.bm.can_allocate(s, n):
            self.bm.reserve(s, n)
            self.model[rid] = (slots + n, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        s, (slots, res) = self.live[rid], self.model[rid]
        kept = data.draw(st.integers(0, res))
        pages_before = list(s.block_table)
        free_before = self.bm.num_free_pages
        freed = self.bm.commit(s, kept)
        new_slots = slots - res + kept
        keep_pages = -(-max(new_slots, self.held.get(rid, 0)) // self.bm.page_size)
        assert s.block_table == pages_before[:keep_pages]
        assert sorted(freed) == sorted(pages_before[keep_pages:])  # private: all come back
        assert self.bm.num_free_pages == free_before + len(freed)
        self.model[rid] = (new_slots, 0)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), ahead=st.integers(0, 12))
    def hold(self, data, ahead):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        s, (slots, _) = self.live[rid], self.model[rid]
        pages_before, free_before = list(s.block_table), self.bm.num_free_pages
        need = max(0, -(-(slots + ahead) // self.bm.page_size) - len(pages_before))
        ok = self.bm.hold(s, slots + ahead)
        assert ok == (need <= free_before)
        if ok:
            self.held[rid] = max(slots + ahead, self.held.get(rid, 0))
            assert s.block_table[: len(pages_before)] == pages_before
            assert self.bm.num_free_pages == free_before - need
        else:  # nothing taken
            assert s.block_table == pages_before and self.bm.num_free_pages == free_before

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_hold(self, data):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        s, (slots, _) = self.live[rid], self.model[rid]
        self.bm.release_hold(s)
        del self.held[rid]
        assert len(s.block_table) == -(-slots // self.bm.page_size)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(self.live.pop(rid))
        del self.model[rid]
        self.held.pop(rid, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        p, (slots, res) = self.live[rid], self.model[rid]
        if res or rid in self.held or not self.bm.can_fork(p):
            return
        c = self._new()
        self.bm.fork(p, c)
        self.live[c.request_id] = c
        self.model[c.request_id] = (slots, 0)

    @invariant()
    def pages_accounted(self):
        seqs = list(self.live.values())
        self.bm.check(seqs)  # ref counts == table occurrences, free list == unreferenced
        owned = {p for s in seqs for p in s.block_table}
        assert self.bm.num_free_pages + len(owned) == self.bm.num_pages
        for rid, s in self.live.items():
            assert s.num_slots == self.model[rid][0]
            assert s.num_reserved_slots == self.model[rid][1]
        # a page another sequence can see is never one this sequence writes next
        for s in seqs:
            if s.num_slots % self.bm.page_size:
                assert self.bm.ref_counts[s.block_table[s.num_slots // self.bm.page_size]] == 1
            for p in s.block_table[-(-s.num_slots // self.bm.page_size) :]:  # held pages
                assert self.bm.ref_counts[p] == 1


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(
    prefix=st.integers(1, 20),
    tree=st.integers(0, 20),
    kept=st.data(),
    page_size=st.integers(1, 8),
)
@settings(max_examples=200, deadline=None)
def test_commit_leaves_exactly_the_pages_of_prefix_plus_kept(prefix, tree, kept, page_size):
    bm = BlockManager(num_pages=64, page_size=page_size)
    s = seq("a", prefix)
    bm.allocate(s)
    bm.reserve(s, tree)
    k = kept.draw(st.integers(0, tree))
    bm.commit(s, k)
    assert len(s.block_table) == -(-(prefix + k) // page_size)
    assert bm.num_free_pages == 64 - len(s.block_table)
    bm.check([s])


def test_sampling_params_validation():
    SamplingParams(temperature=0, top_p=1, top_k=0, max_tokens=1, logprobs=20, seed=3)
    SamplingParams(temperature=1, top_k=2**31 - 1)  # past any vocabulary: every token kept
    for kwargs, name in [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2**31}, "top_k"),  # past 2**63 it overflowed in the sampler: a step error
        ({"max_tokens": -1}, "max_tokens"),  # 0 is allowed: echo with prompt logprobs only
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="x").stop == ["x"]


def test_span_slots_equal_slot_per_position():
    """Random page sizes, fragmented pages (interleaved growth of several sequences), spans that
    cross pages: the vectorised slots equal `slot` position by position; out of range is named."""
    import random

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    bm = BlockManager(num_pages=400, page_size=rng.choice([1, 4, 16]))
    seqs = [seq(f"r{i}", rng.randint(1, 30)) for i in range(5)]
    for s in seqs:
        bm.allocate(s)
    for _ in range(40):  # interleaved growth: page tables are not contiguous
        s = rng.choice(seqs)
        bm.append_slots(s, rng.randint(1, 9))
    n = rng.randint(1, 12)
    firsts = [rng.randint(0, max(0, s.num_slots - n)) for s in seqs]
    use = [(s, f) for s, f in zip(seqs, firsts, strict=True) if f + n <= s.num_slots]
    got = bm.span_slots([s for s, _ in use], [f for _, f in use], n).tolist()
    want = [[bm.slot(s, f + i) for i in range(n)] for s, f in use]
    assert got == want, seed
    with pytest.raises(ValueError, match="'r0': positions"):
        bm.span_slots([seqs[0]], [seqs[0].num_slots - n + 1], n)
