"""scripts/bench_pair.py speed, run as the GPU round runs it but small, in a real process on the
CPU: every text gets a row per config, greedy texts are checked token for token against plain
decoding, and the sampled text (--sampled, issue 13's "text the drafter cannot predict") is
timed but not compared (sampling is lossless in distribution, not token for token)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_speed_rows_for_greedy_and_sampled_texts(tmp_path: Path) -> None:
    out = tmp_path / "pair.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_pair.py"), "speed", "--cpu",
           "--n", "1", "--tokens", "12", "--batches", "1", "--budget", "8", "--adaptive", "8",
           "--sampled", "--interleave", "--repeat", "2", "--no-judge",
           "--ab-config", "plain_margin=0.05,TREEVERIFY_CONTEXT_LAZY=0",
           "--json", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    configs = {r["config"] for r in rows}
    assert {
        "none",
        "DDTREE(dflash) b=8",
        "DDTREE(dflash) adaptive<=8",
        "DDTREE(dflash) adaptive<=8 [plain_margin=0.05,TREEVERIFY_CONTEXT_LAZY=0]",
    } <= configs
    for text in ("code", "prose", "prose-sampled"):
        mine = [r for r in rows if r["text"] == text]
        assert {r["config"] for r in mine} == configs, text
        assert all(r["tokens"] == 12 and r["tokens_per_s"] > 0 for r in mine), text
    greedy_spec = [r for r in rows if r["text"] != "prose-sampled" and r["config"] != "none"]
    assert greedy_spec and all(r["identical_to_plain"] for r in greedy_spec)
    assert not any("identical_to_plain" in r for r in rows if r["text"] == "prose-sampled")
    for r in rows:  # where each pass's wall time went: its steps and the rest, per pass
        assert len(r["passes_step_walls"]) == 2
        for w, tps in zip(r["passes_step_walls"], r["passes_tokens_per_s"], strict=True):
            assert w["steps"] >= 1 and 0 < w["step_ms_median"] <= max(
                s for _, s in w["slowest_steps_ms"]
            )
            pass_ms = r["tokens"] / tps * 1e3
            assert w["outside_ms"] >= 0 and w["step_ms_sum"] + w["outside_ms"] == pytest.approx(
                pass_ms, rel=0.02
            )
    for r in rows:  # an adaptive engine's decisions per pass (the median's may not be the last)
        if "adaptive" in r["config"]:
            passes = r["passes_decisions"]
            assert len(passes) == 2
            assert all(p["events_complete"] for p in passes)  # a short run: every event kept
            for p in passes:  # each probe counted is in the pass's log, at a decision of it
                assert sum(e["kind"] == "probe" for e in p["events"]) == p["explorations"], p
            for k in ("switches", "explorations", "cost_trials", "accept_trials"):
                # per pass, not cumulative (the engine's running total), never negative
                assert all(p[k] >= 0 for p in passes)
                assert sum(p[k] for p in passes) <= r["controller"][k], (k, passes)
            assert [sum(p["steps_by_budget"].values()) for p in passes][-1] == sum(
                r["steps_by_budget"].values()
            )  # the last pass's: the row's own
        else:
            assert "passes_decisions" not in r
    for r in rows:  # whole rounds' counters (every DFlash engine has them; plain decoding
        # none): every round a replay, each launched ahead either taken or dropped
        if "dflash" in r["config"]:
            assert "round_graphs" in r, r["config"]
        if r["config"] == "none":
            assert "round_graphs" not in r
        if "round_graphs" in r:
            g = r["round_graphs"]
            assert g["replays"] >= 1, r["config"]
            assert 0 <= g["ahead_used"] + g["ahead_discarded"] <= g["replays"], g
            # and each pass's own (after its warm-up): never negative, within the total
            per_pass = [w["round_graphs"] for w in r["passes_step_walls"]]
            assert all(min(p.values()) >= 0 for p in per_pass), per_pass
            if r["config"] == "DDTREE(dflash) b=8":  # (an adaptive pass may stay plain)
                assert all(p["replays"] >= 1 for p in per_pass), per_pass
            assert sum(p["replays"] for p in per_pass) <= g["replays"], (per_pass, g)
        else:
            assert all("round_graphs" not in w for w in r["passes_step_walls"])
    sampled_dd = next(r for r in rows if r["text"] == "prose-sampled"
                      and r["config"] == "DDTREE(dflash) b=8")  # fmt: skip
    # T=1 on prose: the tiny drafter accepts little (it does predict greedy prose: ~4 tokens)
    assert 1.0 <= sampled_dd["accept_length"] < 3.0


def _bench_pair_module():
    spec = importlib.util.spec_from_file_location("bench_pair", ROOT / "scripts" / "bench_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("greedy_warmup", [False, True])
def test_warmup_samples_as_the_pass_does(greedy_warmup: bool) -> None:
    """A sampled pass's untimed warm-up samples too (unless --greedy-warmup): a greedy warm-up
    made every sampled pass open with a greedy-to-sampled batch change, restarting an adaptive
    controller's probes. The real engine runs; its generate is wrapped only to see the params."""
    from treeverify.engine.llm import LLM

    timed = _bench_pair_module().timed
    llm = LLM("tiny-code", max_num_seqs=2)
    seen = []
    real = llm.generate

    def spy(prompts, sp):
        seen.append(sp)
        return real(prompts, sp)

    llm.generate = spy
    outs, secs, _ = timed(llm, ["def f(x):", "import os"], 2, 3, temperature=1.0,
                          greedy_warmup=greedy_warmup)  # fmt: skip
    assert [len(o) for o in outs] == [3, 3] and secs > 0
    (warm,) = seen
    assert warm.max_tokens == 4
    assert warm.temperature == (0.0 if greedy_warmup else 1.0)
    assert (warm.seed is None) == greedy_warmup  # a sampled warm-up is seeded (repeatable)


def test_an_adaptive_ab_switch_is_set_only_while_its_engine_is_built(monkeypatch) -> None:
    """`--adaptive-ab TREEVERIFY_X=V`: that engine is built with the switch (read at build),
    knobs beside it still reach the controller, and the environment is as it was after."""
    import argparse

    monkeypatch.delenv("TREEVERIFY_CONTEXT_LAZY", raising=False)
    mod = _bench_pair_module()
    args = argparse.Namespace(cpu=True, clock="wall", controller_set=[], target="tiny-code",
                              num_pages=64, no_graphs=False)  # fmt: skip
    llm = mod.engine(args, "DDTREE", str(mod.DATA / "tiny-code-dflash"), 16, 15, 2,
                     ("TREEVERIFY_CONTEXT_LAZY=0", "plain_margin=0.05"))  # fmt: skip
    assert not llm.spec.source.context.lazy  # the switch against its default
    assert llm.controller.cfg.plain_margin == 0.05
    assert "TREEVERIFY_CONTEXT_LAZY" not in __import__("os").environ
    plain = mod.engine(args, "DDTREE", str(mod.DATA / "tiny-code-dflash"), 16, 15, 2, True)
    assert plain.spec.source.context.lazy
