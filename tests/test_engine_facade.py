"""The engine facade: the server and the benchmarks use LLM's public methods, never its parts;
the methods do what they say (abort frees pages, has_unfinished flips, usage counts)."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

SRC = Path(__file__).resolve().parents[1] / "src" / "treeverify"
# LLM's parts: what the step loop owns and nobody outside the engine may touch.
INTERNALS = {"scheduler", "block_manager", "model", "runner", "spec", "controller", "cache",
             "processor"}  # fmt: skip


def _is_llm(node: ast.expr) -> bool:
    """`llm`, or `<anything>.llm` (self.llm, engine.llm, self.engine.llm)."""
    return (isinstance(node, ast.Name) and node.id == "llm") or (
        isinstance(node, ast.Attribute) and node.attr == "llm"
    )


def reaches_into_llm(source: str) -> list[tuple[int, str]]:
    """(line, `llm.<attr>`) of every use of an LLM part or private attribute in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        private = isinstance(node, ast.Attribute) and (
            node.attr in INTERNALS or node.attr.startswith("_")
        )
        if private and _is_llm(node.value):
            out.append((node.lineno, f"llm.{node.attr}"))
        # getattr(llm, "scheduler") is the same reach, spelt differently
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "getattr" and len(node.args) >= 2 and _is_llm(node.args[0])
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in INTERNALS):  # fmt: skip
            out.append((node.lineno, f"getattr(llm, {node.args[1].value!r})"))
    return sorted(out)


def test_the_scan_finds_a_reach():
    planted = (
        "def f(self, engine, llm):\n"
        "    self.llm.scheduler.abort('x')\n"
        "    n = engine.llm.block_manager.num_pages\n"
        "    llm._next_id = 0\n"
        "    getattr(llm, 'model')\n"
        "    llm.abort('x'); llm.config.page_size\n"
    )
    assert reaches_into_llm(planted) == [
        (2, "llm.scheduler"), (3, "llm.block_manager"), (4, "llm._next_id"),
        (5, "getattr(llm, 'model')"),
    ]  # fmt: skip


@pytest.mark.parametrize("package", ["server", "bench"])
def test_server_and_bench_use_the_facade_only(package):
    found = [
        f"{path.relative_to(SRC.parent)}:{line}: {what}"
        for path in sorted((SRC / package).glob("*.py"))
        for line, what in reaches_into_llm(path.read_text())
    ]
    assert not found, "reaches into the engine's parts (add an LLM method instead):\n" + "\n".join(
        found
    )


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random()
    return [[rng.randrange(256) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def test_abort_frees_pages_and_has_unfinished_flips():
    llm = LLM("tiny-llama", num_pages=64, page_size=4, max_num_seqs=4)
    assert not llm.has_unfinished() and llm.usage().used_pages == 0
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = (llm.add_request(p, sp) for p in _prompts(2))
    assert llm.has_unfinished() and llm.usage().waiting == 2
    llm.step()
    use = llm.usage()
    assert (use.running, use.waiting, use.num_pages) == (2, 0, 64) and use.used_pages > 0
    held_by_a = len(a.block_table)
    assert llm.abort(a.request_id) is True
    assert a.finish_reason == "abort" and llm.usage().used_pages == use.used_pages - held_by_a
    assert llm.abort(a.request_id) is False and llm.abort("never-added") is False
    assert llm.output(a).finish_reason == "abort"
    assert llm.has_unfinished()
    llm.abort(b.request_id)
    assert not llm.has_unfinished() and llm.usage() == type(use)(0, 0, 0, 64)


def test_abort_drops_the_drafter_and_controller_state():
    llm = LLM("tiny-llama", num_pages=64, speculative_algorithm="DDTREE",
              speculative_ddtree_budget=4)  # fmt: skip
    forgotten = []
    for part in (llm.spec.source, llm.controller):  # spies: whatever they keep per request
        part.forget = lambda rid, part=part, f=part.forget: (forgotten.append((part, rid)), f(rid))
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seq = llm.add_request(_prompts(1)[0], sp)
    for _ in range(3):
        llm.step()
    assert llm.abort(seq.request_id)
    assert forgotten == [(llm.spec.source, seq.request_id), (llm.controller, seq.request_id)]


def test_reports_and_reset_stats():
    # a given cost curve where a round is cheaper than a plain step: the controller speculates
    llm = LLM("tiny-llama", num_pages=64, speculative_algorithm="DDTREE",
              speculative_ddtree_budget=4, speculative_cost_seconds={0: 1.0, 4: 0.5})  # fmt: skip
    rep = list(range(60, 70)) * 4  # repetitive: the n-gram drafter proposes, rounds run
    llm.generate([rep], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    st = llm.spec_stats
    assert st["rounds"] > 0 and sum(st["adaptive"]["steps_by_budget"].values()) > 0
    llm.reset_stats()
    st = llm.spec_stats
    assert st["rounds"] == 0 and set(st["adaptive"]["steps_by_budget"].values()) == {0}
    assert llm.moe_imbalance() is None  # a dense model
    assert llm.captured_graph(1) is None and llm.cuda_graph_info["enabled"] is False  # CPU
    parts = llm.forward_parts()
    assert parts.cache.page_size == llm.config.page_size


def test_moe_imbalance_counts_routed_tokens():
    llm = LLM("tiny-kimi", num_pages=64)
    assert llm.moe_imbalance() is not None  # warmup routed a few tokens already
    llm.generate(_prompts(2), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.moe_imbalance() >= 1.0  # max/mean over experts: at least 1 once tokens ran
