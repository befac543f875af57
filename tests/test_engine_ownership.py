"""One owner for each piece of sequence state: `num_cached_tokens` is read-only, written only
through `Sequence.mark_cached`, which only the scheduler (and BlockManager.fork) call."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from treeverify.engine.block_manager import BlockManager
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.scheduler import Scheduler
from treeverify.engine.sequence import Sequence

SRC = Path(__file__).resolve().parents[1] / "src" / "treeverify"
STATE = {"num_cached_tokens", "_num_cached_tokens"}
WRITER = "mark_cached"
# (file, function) allowed to write the state itself, and files allowed to call the writer
WRITES_ALLOWED = {("engine/sequence.py", "__init__"), ("engine/sequence.py", WRITER)}
CALLERS_ALLOWED = {"engine/scheduler.py", "engine/block_manager.py"}


def state_writes(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) of every write of the state and every writer call."""
    out = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):  # tuple targets too
                if isinstance(sub, ast.Attribute) and sub.attr in STATE:
                    out.append((node.lineno, func, f"= .{sub.attr}"))
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == WRITER:
                out.append((node.lineno, func, f"{WRITER}()"))
            if (isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in STATE):  # fmt: skip
                out.append((node.lineno, func, f"setattr .{node.args[1].value}"))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(source), "<module>")
    return sorted(out)


def test_the_scan_finds_writes():
    planted = (
        "def step(seq, a, b):\n"
        "    seq.num_cached_tokens += 2\n"
        "    a.x, b._num_cached_tokens = 1, 2\n"
        "    seq.mark_cached(3)\n"
        "    setattr(seq, 'num_cached_tokens', 4)\n"
        "    n = seq.num_cached_tokens\n"
    )
    assert [(line, what) for line, _, what in state_writes(planted)] == [
        (2, "= .num_cached_tokens"), (3, "= ._num_cached_tokens"), (4, "mark_cached()"),
        (5, "setattr .num_cached_tokens"),
    ]  # fmt: skip


def test_num_cached_tokens_has_one_writer():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for line, func, what in state_writes(path.read_text()):
            ok = (rel, func) in WRITES_ALLOWED if what.startswith(("=", "setattr")) else (
                rel in CALLERS_ALLOWED or (rel, func) in WRITES_ALLOWED)  # fmt: skip
            if not ok:
                bad.append(f"{rel}:{line} ({func}): {what}")
    assert not bad, "num_cached_tokens written outside its owner:\n" + "\n".join(bad)


def test_the_state_is_read_only_and_checked():
    seq = Sequence("a", [1, 2, 3])
    with pytest.raises(AttributeError):
        seq.num_cached_tokens = 2
    with pytest.raises(ValueError, match="num_cached_tokens 1 outside 0..0"):
        seq.mark_cached(1)  # no slot held yet: its K/V cannot be in the pool
    bm = BlockManager(num_pages=4, page_size=4)
    bm.allocate(seq)
    seq.mark_cached(3)
    with pytest.raises(ValueError, match="outside 0..3"):
        seq.mark_cached(4)


def test_a_round_moves_num_cached_tokens_in_postprocess():
    """kv_ahead: a round's accepted nodes count as cached; the bonus is the next root."""
    s = Scheduler(BlockManager(num_pages=16, page_size=4), max_num_batched_tokens=64)
    a = s.add(Sequence("a", [5, 6, 7], SamplingParams(max_tokens=20)))
    s.postprocess(s.schedule(), [8])  # prefill + first token
    assert (a.num_cached_tokens, a.num_uncached_tokens) == (3, 1)
    batch = s.schedule()  # the root (8) is this step's decode
    s.block_manager.reserve(a, 4)  # the verify forward's node slots ...
    s.block_manager.commit(a, 2)  # ... two accepted nodes kept
    s.postprocess(batch, [[9, 10, 11]], kv_ahead=[2])
    assert a.output_token_ids == [8, 9, 10, 11]
    assert (a.num_cached_tokens, a.num_uncached_tokens) == (6, 1)  # 11 (the bonus) is not
    with pytest.raises(ValueError, match="kv_ahead has 2 entries for 1"):
        s.postprocess(s.schedule(), [1], kv_ahead=[0, 0])


def test_speculative_decoding_keeps_one_uncached_token():
    llm = LLM("tiny-llama", num_pages=64, speculative_algorithm="DDTREE",
              speculative_ddtree_budget=4, speculative_adaptive=False)  # fmt: skip
    rng = random.Random()
    block = [rng.randrange(256) for _ in range(rng.randint(5, 9))]
    seq = llm.add_request(block * 5, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while not seq.is_finished:
        llm.step()
        if not seq.is_finished and seq.num_output_tokens:
            assert seq.num_uncached_tokens == 1  # every accepted node's K/V counted, not the bonus
    assert llm.spec_stats["rounds"] > 0


def test_tail_token_ids_is_the_end_of_all_token_ids():
    seq = Sequence("a", [1, 2, 3, 4])
    for out in ([], [5], [5, 6, 7, 8, 9]):
        seq.output_token_ids = list(out)
        for n in range(0, 12):
            assert seq.tail_token_ids(n) == (seq.all_token_ids[-n:] if n else [])
