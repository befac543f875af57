"""Accept lengths and tokens/s of a target + DFlash drafter pair (tiny-code by default), with
treeverify's engine, on held-out code and on English prose. CPU (small runs) or GPU (graphs on).

    PYTHONPATH=src python3 scripts/bench_pair.py accept [--budgets 8,16,32,64,128,256] --json A.json
    PYTHONPATH=src python3 scripts/bench_pair.py speed [--batches 1,8] --json S.json

accept: greedy, N held-out code prompts in one batch; DFlash CHAIN (depth block-1) and DDTREE per
        budget: average accept length (committed tokens per round, bonus included), tokens/s, and
        whether the output equals plain greedy decoding.
speed:  per batch size (b concurrent requests) and per text (code, prose): none, CHAIN(DFlash),
        DDTREE(DFlash), DDTREE(n-gram): tokens/s and accept length, the same greedy check.
Timings are wall clock around `LLM.generate` after one untimed warm-up generate; the engine's own
startup (load, capture) is left out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from treeverify import env
from treeverify.bench.kernel import _git_commit
from treeverify.engine.budget_controller import CLOCKS
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "src/treeverify/models/data"
PROSE = Path(__file__).resolve().parent / "prompts" / "english_prose.txt"


def code_prompts(path: Path, n: int) -> list[str]:
    prompts = json.loads(path.read_text())["prompts"]
    if len(prompts) < n:
        raise ValueError(f"--code-prompts: {path} has {len(prompts)} prompts, {n} wanted")
    return prompts[:n]


def prose_prompts(path: Path, n: int) -> list[str]:
    paras = [p.strip() for p in path.read_text().split("\n\n") if p.strip()]
    return [paras[i % len(paras)] for i in range(n)]


def engine(args, algo: str | None, drafter: str, budget: int, depth: int, max_seqs: int,
           adaptive: bool | str | tuple[str, ...] = False) -> LLM:  # fmt: skip
    """`adaptive`: True (the controller picks budgets), False (fixed), "general" (fixed,
    every round on the general path: no whole-round graphs, the A/B of engine/round_graphs.py)
    or "read-first" (fixed, whole rounds without lookahead: each round read before the next is
    launched, the A/B of the overlap), "ngram-general" (fixed, n-gram rounds on the general
    path, host votes: `ngram_whole_rounds=False`; whole rounds are the default), "no-trials" /
    "no-accept-trials" (adaptive without cost / acceptance trials: the A/Bs of docs/ddtree.md's
    stale costs and thin evidence), or a tuple of KNOB=VALUE (adaptive with those controller
    knobs on top of --controller-set: the A/B of --adaptive-ab)."""
    dev = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    kw = {}
    if adaptive == "general":
        kw["disable_round_graphs"], adaptive = True, False
    elif adaptive == "read-first":
        kw["round_lookahead"], adaptive = False, False
    elif adaptive == "ngram-general":
        kw["ngram_whole_rounds"], adaptive = False, False
    extra: tuple[str, ...] = ()
    env_set: dict[str, str] = {}  # TREEVERIFY_* switches set while this engine is built
    if isinstance(adaptive, tuple):
        env_set = dict(k.split("=", 1) for k in adaptive if k.startswith("TREEVERIFY_"))
        extra = tuple(k for k in adaptive if not k.startswith("TREEVERIFY_"))
        adaptive = True
    trials, accept_trials = adaptive != "no-trials", adaptive != "no-accept-trials"
    adaptive = bool(adaptive)
    if algo:
        kw |= dict(
            speculative_algorithm=algo,
            speculative_ddtree_budget=budget,
            speculative_num_draft_tokens=depth,
            speculative_draft_model_path=drafter,
        )
    if algo == "DDTREE":  # a fixed budget unless this config measures the adaptive one
        kw["speculative_adaptive"] = adaptive
        if adaptive:  # the controller's step costs on the same clock as the benchmark's
            kw["speculative_cost_clock"] = args.clock
            kw["speculative_controller"] = (f"cost_trials={trials}",
                                            f"accept_trials={accept_trials}",
                                            *args.controller_set, *extra)  # fmt: skip
    with env.set_while(env_set):  # switches are read when an engine is built
        return LLM(args.target, device=dev, num_pages=args.num_pages, max_num_seqs=max_seqs,
                   cuda_graph_max_bs=max_seqs, disable_cuda_graph=args.no_graphs,
                   max_num_batched_tokens=max(2048, max_seqs * (budget + 1)), **kw)  # fmt: skip


def speed_texts(args) -> dict[str, tuple[list[str], float]]:
    """The speed texts: name -> (prompts, temperature). "prose-sampled" (--sampled): the prose
    prompts at temperature 1, what the drafter cannot predict (issue 13: >= 0.95x plain there);
    its outputs are not compared with plain decoding's (sampling is lossless in distribution,
    not token for token)."""
    texts = {"code": (code_prompts(args.code_prompts, args.n), 0.0),
             "prose": (prose_prompts(args.prose, args.n), 0.0)}  # fmt: skip
    if args.sampled:
        texts["prose-sampled"] = (texts["prose"][0], 1.0)
    if args.texts:  # only these (e.g. prose-sampled alone: a quick A/B)
        unknown = set(args.texts.split(",")) - set(texts)
        if unknown:
            raise SystemExit(f"--texts: unknown {sorted(unknown)}; expected some of {list(texts)}")
        texts = {k: v for k, v in texts.items() if k in args.texts.split(",")}
    return texts


def timed(llm: LLM, prompts: list, batch: int, tokens: int, repeat: int = 1,
          clock=time.perf_counter, queue: bool = False, temperature: float = 0.0,
          at_pass_start: Callable[[], None] | None = None, greedy_warmup: bool = False,
          step_walls: dict | None = None) -> tuple[list, float, float]:  # fmt: skip
    """Greedy outputs (or, at `temperature` > 0, seeded samples) of all prompts, at most
    `batch` running at once, the seconds it took (the best of `repeat` passes: host-bound steps
    jitter; each pass starts with fresh requests) and the batch occupancy (running requests per
    step / batch, mean over the last pass's steps).

    Groups (default): `batch` prompts start together and the next group starts when all have
    finished, as a fixed-size batch job. Speculation makes requests of equal length finish at
    different steps, so a group's last steps run part-empty (plain decoding's never do): the
    occupancy says how much. `queue`: a new prompt joins as soon as one finishes (a server's
    continuous batching); the batch then stays full until the prompts run out.
    `at_pass_start`: called as each timed pass starts, after the warm-up. Spec stats are
    those of the last pass. The warm-up (4 tokens of the first group) samples as the pass does:
    a greedy warm-up before a sampled pass made the pass open with a greedy-to-sampled batch
    change, which restarts an adaptive controller's probes (b=1: 5-6 probes a pass instead of
    ~2, fortieth session) — something a server with steady sampled traffic never sees.
    `greedy_warmup`: the warm-up greedy whatever the pass (before the forty-first session).
    `step_walls`: filled with where the last pass's wall time went (`step_wall_summary`): a pass
    slower than its steps' costs suggest says whether a few steps or every step grew."""
    sp = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True,
                        seed=2026 if temperature else None)  # fmt: skip
    warm_t = 0.0 if greedy_warmup else temperature
    llm.generate(prompts[:batch], SamplingParams(temperature=warm_t, max_tokens=4, ignore_eos=True,
                                                 seed=2025 if warm_t else None))  # fmt: skip
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    best, occupancy = float("inf"), 1.0
    for _ in range(repeat):
        llm.reset_stats()  # counters of this pass only (steps per budget included)
        if at_pass_start is not None:  # after the warm-up generate: the pass's own decisions
            at_pass_start()
        sync()
        t0 = clock()
        seqs, running, steps, busy = [None] * len(prompts), [], 0, 0
        nxt, walls = 0, []
        while nxt < len(prompts) or running:
            if queue or not running:  # refill: at once (queue), or when the group is done
                while nxt < len(prompts) and len(running) < batch:
                    seqs[nxt] = llm.add_request(prompts[nxt], sp)
                    running.append(seqs[nxt])
                    nxt += 1
            s0 = clock()
            llm.step()
            walls.append(clock() - s0)
            steps += 1
            busy += len(running)
            running = [q for q in running if not q.is_finished]
        sync()
        secs = clock() - t0
        if step_walls is not None:
            step_walls.clear()
            step_walls.update(step_wall_summary(walls, secs))
        outs = [llm.output(q).token_ids for q in seqs]
        if secs < best:
            best, occupancy = secs, busy / (steps * batch)
    return outs, best, occupancy


def step_wall_summary(walls: list[float], secs: float) -> dict:
    """A pass's wall time split: its engine steps (host clock around each `step()`: a step
    launched ahead includes its wait for the one before) and the rest (requests added, the final
    sync); the median step and the five slowest with their index in the pass (ms)."""
    ms = [w * 1e3 for w in walls]
    slow = sorted(range(len(ms)), key=ms.__getitem__, reverse=True)[:5]
    return {"steps": len(ms), "step_ms_sum": round(sum(ms), 3),
            "outside_ms": round(secs * 1e3 - sum(ms), 3),
            "step_ms_median": round(statistics.median(ms), 4) if ms else None,
            "slowest_steps_ms": [[i, round(ms[i], 3)] for i in slow]}  # fmt: skip


def row(llm: LLM, name: str, outs, secs: float, plain) -> dict:
    toks = sum(len(o) for o in outs)
    r = {"config": name, "tokens": toks, "seconds": round(secs, 3),
         "tokens_per_s": round(toks / secs, 1)}  # fmt: skip
    st = llm.spec_stats
    if st is not None:
        r.update(
            accept_length=st["avg_spec_accept_length"],
            rounds=st["rounds"],
            drafter=st["drafter"],
            budget=st["budget"],
            depth=st["num_draft_tokens"],
        )
    if plain is not None:
        r["identical_to_plain"] = outs == plain
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                  for a, b in zip(outs, plain, strict=True)]  # fmt: skip
        r["diverged_requests"] = sum(f is not None for f in firsts)
        r["first_divergence"] = min((f for f in firsts if f is not None), default=None)
    return r


class DivergenceJudge:
    """Where a speculative output differs from plain decoding, is it a near-tie? The target in
    fp32 (eager, PyTorch attention: neither run's kernels) scores the two tokens at the first
    differing position after prompt + common prefix; the gap (nats) is reported per request. A
    bf16 engine may flip a near-tie between two batch shapes; a real bug shows a large gap."""

    def __init__(self, args):
        from treeverify.models import TorchAttention, load_model

        dev = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
        _, self.model, self.tok = load_model(args.target, dtype=torch.float32, device=dev)
        self.attention, self.dev = TorchAttention(), dev

    @torch.inference_mode()
    def gaps(self, prompts: list, plain: list[list[int]], outs: list[list[int]]) -> list[dict]:
        found = []
        for prompt, a, b in zip(prompts, plain, outs, strict=True):
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if i is None:
                continue
            ids = (self.tok.encode(prompt) if isinstance(prompt, str) else list(prompt)) + a[:i]
            t = torch.tensor(ids, device=self.dev)
            logits = self.model(t, torch.arange(len(ids), device=self.dev),
                                attention=self.attention)[-1].float()  # fmt: skip
            lp = torch.log_softmax(logits, -1)
            found.append({"position": i, "plain": a[i], "spec": b[i],
                          "gap_nats": round(float(lp[a[i]] - lp[b[i]]), 5),
                          "fp32_argmax": int(lp.argmax())})  # fmt: skip
        return found


def freeze_startup() -> None:
    """What the engines' startup made (models, graphs, tables) out of the cyclic collector's
    reach, as `treeverify serve` does (server/main.py): a full collection over it is a pause
    of 100+ ms inside some timed step (one pass's 131 ms step, 2026-12-07, run 2)."""
    gc.collect()
    gc.freeze()


def free(llm) -> None:
    del llm
    gc.unfreeze()  # (a freed engine's cycles collectable again)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def configs(args, block: int, budgets: list[int]):
    """(name, algorithm, drafter, budget, depth, adaptive): plain first (the reference); no
    DFlash configs with `--drafter none` (a target without a drafter, e.g. smollm2-135m)."""
    if args.drafter == "none":
        return [("none", None, "ngram", 1, 1, False)]
    out = [("none", None, "ngram", 1, 1, False), (f"CHAIN(dflash) depth {block - 1}", "CHAIN",
           args.drafter, block - 1, block - 1, False)]  # fmt: skip
    out += [(f"DDTREE(dflash) b={b}", "DDTREE", args.drafter, b, block - 1, False)
            for b in budgets]  # fmt: skip
    return out


def run_accept(args, block: int) -> list[dict]:
    prompts = code_prompts(args.code_prompts, args.n)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows, plain = [], None
    for name, algo, drafter, budget, depth, adaptive in configs(args, block, budgets):
        llm = engine(args, algo, drafter, budget, depth, len(prompts), adaptive)
        outs, secs, _ = timed(llm, prompts, len(prompts), args.tokens)
        rows.append(row(llm, name, outs, secs, plain) | {"batch": len(prompts), "text": "code"})
        plain = outs if plain is None else plain
        print(json.dumps(rows[-1]), flush=True)
        free(llm)
    return rows


def speed_configs(args, block: int) -> list[tuple]:
    """speed's configs, plain decoding first."""
    cfgs = configs(args, block, [int(b) for b in args.budget.split(",")])
    cfgs.append((f"DDTREE(ngram) b={args.ngram_budget}", "DDTREE", "ngram", args.ngram_budget,
                 args.ngram_depth, False))  # fmt: skip
    if args.ngram_general:  # the same on the general path (the A/B of engine/ngram_rings.py)
        cfgs.append((f"DDTREE(ngram) b={args.ngram_budget} general path", "DDTREE", "ngram",
                     args.ngram_budget, args.ngram_depth, "ngram-general"))  # fmt: skip
    if args.general:  # the first DDTREE(dflash) budget again, rounds on the general path
        b = int(args.budget.split(",")[0])
        cfgs.append((f"DDTREE(dflash) b={b} general path", "DDTREE", args.drafter, b, block - 1,
                     "general"))  # fmt: skip
        cfgs.append((f"DDTREE(dflash) b={b} read first", "DDTREE", args.drafter, b, block - 1,
                     "read-first"))  # fmt: skip
    if args.adaptive:  # the controller picks each step's budget in {0, 4, ..., args.adaptive}
        cfgs.append((f"DDTREE(dflash) adaptive<={args.adaptive}", "DDTREE", args.drafter,
                     args.adaptive, block - 1, True))  # fmt: skip
        if args.no_trials_too:
            cfgs.append((f"DDTREE(dflash) adaptive<={args.adaptive} no cost trials", "DDTREE",
                         args.drafter, args.adaptive, block - 1, "no-trials"))  # fmt: skip
        if args.no_accept_trials_too:
            cfgs.append((f"DDTREE(dflash) adaptive<={args.adaptive} no acceptance trials", "DDTREE",
                         args.drafter, args.adaptive, block - 1, "no-accept-trials"))  # fmt: skip
        # the same controller with other knobs (or switches), in the same passes: one config
        # of every --adaptive-ab, one more per --ab-config
        sets = ([tuple(args.adaptive_ab)] if args.adaptive_ab else []) + [
            tuple(k for k in c.split(",") if k) for c in args.ab_config]  # fmt: skip
        for knobs in sets:
            cfgs.append((f"DDTREE(dflash) adaptive<={args.adaptive} [{','.join(knobs)}]",
                         "DDTREE", args.drafter, args.adaptive, block - 1, knobs))  # fmt: skip
        if args.ngram_adaptive:  # the n-gram drafter's (whole) rounds under the controller
            cfgs.append((f"DDTREE(ngram) adaptive<={args.adaptive}", "DDTREE", "ngram",
                         args.adaptive, args.ngram_depth, True))  # fmt: skip
    return cfgs


def describe(llm: LLM, name: str, outs, secs: float, plain, b: int, text: str,
             occupancy: float, judge, prompts) -> dict:  # fmt: skip
    """One row: tokens/s, the engine's spec stats and controller view, the greedy check."""
    r = row(llm, name, outs, secs, plain) | {"batch": b, "text": text}
    r["occupancy"] = round(occupancy, 3)
    adaptive = (llm.spec_stats or {}).get("adaptive")
    if adaptive is not None:  # the budgets the controller ran, by steps (last pass)
        r["steps_by_budget"] = {int(k): c for k, c in adaptive["steps_by_budget"].items()}
        # what the controller believed: why it chose those budgets
        keys = (
            "accept_curve",
            "accept_curve_by_class",  # greedy and sampled requests' engine-wide curves
            "cost_seconds_batch1",
            "switches",
            "explorations",
            "cost_trials",
            "accept_trials",
        )
        r["controller"] = {k: adaptive.get(k) for k in keys}
        r["controller"][f"cost_seconds_batch{b}"] = llm.controller.cost.curve(b)
        # every step path's table (fast: tokens picked in the graphs; general: read first)
        r["controller"][f"cost_seconds_batch{b}_by_path"] = {
            p: c.cost.curve(b) for p, c in llm.controller.paths.items()
        }
        r["controller"]["calibrated_medians"] = llm.startup.get("budget_cost_seconds_measured")
    if llm.rounds is not None:  # whole rounds over every pass: how many were launched ahead
        # and taken (ahead_used), dropped, taken with rows dropped, or launched at a switched
        # budget, of all replays (the b=8 adaptive engine stepped slower than fixed 16 at the
        # same budget, fifty-third session: a lost lookahead would show here)
        r["round_graphs"] = _round_counts(llm)
    if r.get("diverged_requests") and judge is not None:
        r["divergence_gaps"] = judge.gaps(prompts, plain, outs)
    return r


def run_speed(args, block: int) -> list[dict]:
    if args.interleave:
        return run_speed_interleaved(args, block)
    batches = [int(b) for b in args.batches.split(",")]
    texts = speed_texts(args)
    cfgs = speed_configs(args, block)
    # plain decoding again, last: the first engine of a process can run slower (clocks, caches),
    # and a ratio against a slow baseline flatters every other config
    cfgs.append(("none (again)", None, "ngram", 1, 1, False))
    rows, plain = [], {}
    judge = None if args.no_judge else DivergenceJudge(args)
    for name, algo, drafter, budget, depth, adaptive in cfgs:
        llm = engine(args, algo, drafter, budget, depth, max(batches), adaptive)
        freeze_startup()
        for text, (prompts, temp) in texts.items():
            for b in batches:
                outs, secs, occupancy = timed(llm, prompts, b, args.tokens, args.repeat,
                                              CLOCKS[args.clock], args.queue, temp,
                                              greedy_warmup=args.greedy_warmup)  # fmt: skip
                key = (text, b)
                r = describe(llm, name, outs, secs, None if temp else plain.get(key), b, text,
                             occupancy, judge, prompts)  # fmt: skip
                rows.append(r)
                plain.setdefault(key, outs)
                print(json.dumps(_brief(r)), flush=True)
        free(llm)
    for r in rows:  # speedups against plain decoding of the same text and batch
        base = max(
            x["tokens_per_s"]
            for x in rows
            if x["config"].startswith("none")
            and x["text"] == r["text"]
            and x["batch"] == r["batch"]
        )  # the faster plain
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / base, 3)
    return rows


_COUNTERS = ("switches", "explorations", "cost_trials", "accept_trials", "step_index")


def _round_counts(llm: LLM) -> dict[str, int] | None:
    """The whole rounds' cumulative replays and lookahead counters (None: no round graphs)."""
    if llm.rounds is None:
        return None
    info = llm.rounds.info
    keys = ("replays", "ahead_used", "ahead_discarded", "ahead_partial", "ahead_switched")
    return {k: info[k] for k in keys}


def _decision_counts(llm: LLM) -> dict[str, int] | None:
    """The adaptive controller's cumulative counters (None: no controller)."""
    ctl = llm.controller
    return None if ctl is None else {k: getattr(ctl, k) for k in _COUNTERS}


def _pass_decisions(llm: LLM, before: dict[str, int]) -> dict:
    """One pass of an adaptive engine: its steps by budget (reset at each pass's start) and
    how many switches, probes and trials it made, and each of them (the controller's
    decision log: at which decision, from where, and why; `step_index` counts the pass's
    decisions)."""
    ctl = llm.controller
    out = {"steps_by_budget": {b: c for b, c in ctl.steps_by_budget.items() if c}}
    out |= {k: getattr(ctl, k) - before[k] for k in _COUNTERS}
    start = before["step_index"]  # (a pass with more events than the log keeps: its oldest gone)
    return out | {"events": ctl.events.since(start),
                  "events_complete": ctl.events.complete_since(start)}  # fmt: skip


def _brief(row: dict) -> dict:
    """A row as printed while the run goes: its passes' decision logs left to the JSON file
    (hundreds of events would push everything else out of a log's tail)."""
    passes = row.get("passes_decisions")
    if not passes:
        return row
    return row | {"passes_decisions": [{k: v for k, v in p.items() if k != "events"}
                                       for p in passes]}  # fmt: skip


def speed_table(rows: list[dict]) -> str:
    """The speed rows as one short table, printed last: text, batch, config, tokens/s, x plain,
    accept length, the median step (ms, the median pass's: interleaved runs), and an adaptive
    engine's probes and switches per pass."""
    lines = [f"{'text':<14} {'b':>2} {'config':<62} {'tok/s':>9} {'x plain':>7} {'tau':>5} "
             f"{'step ms':>7}  probes/switches a pass"]  # fmt: skip
    for r in rows:
        passes = r.get("passes_decisions") or []
        ps = " ".join(f"{p['explorations']}/{p['switches']}" for p in passes)
        tau = r.get("accept_length")
        meds = sorted(w["step_ms_median"] for w in r.get("passes_step_walls") or []
                      if w.get("step_ms_median") is not None)  # fmt: skip
        step = f"{meds[len(meds) // 2]:.3f}" if meds else "-"
        lines.append(f"{r['text']:<14} {r['batch']:>2} {r['config'][:62]:<62} "
                     f"{r['tokens_per_s']:>9.1f} {r.get('speedup_vs_plain', 1.0):>7.3f} "
                     f"{'-' if tau is None else f'{tau:.2f}':>5} {step:>7}  {ps}")  # fmt: skip
    return "\n".join(lines)


def run_speed_interleaved(args, block: int) -> list[dict]:
    """Every engine alive at once; each pass runs every config back to back (the order rotated
    per pass), so a slow stretch of the machine hits all configs alike. Per config: the median
    tokens/s over passes, every pass's figure, and `speedup_vs_plain` = the median over passes
    of the ratio to plain decoding's time in the same pass (paired)."""
    batches = [int(b) for b in args.batches.split(",")]
    texts = speed_texts(args)
    cfgs = speed_configs(args, block)
    engines = [engine(args, algo, drafter, budget, depth, max(batches), adaptive)
               for _, algo, drafter, budget, depth, adaptive in cfgs]  # fmt: skip
    judge = None if args.no_judge else DivergenceJudge(args)
    freeze_startup()
    rows = []
    for text, (prompts, temp) in texts.items():
        for b in batches:
            secs = {c[0]: [] for c in cfgs}
            passes = {c[0]: [] for c in cfgs}  # an adaptive engine's decisions, pass by pass
            walls = {c[0]: [] for c in cfgs}  # where each pass's wall time went
            last = {}
            pairs = list(zip(cfgs, engines, strict=True))
            for p in range(args.repeat):
                k = p % len(pairs)  # each pass starts one config later
                for (name, *_), llm in pairs[k:] + pairs[:k]:
                    before: dict[str, int] = {}  # the controller's counters at the pass's start
                    rounds0: dict[str, int] = {}  # ... and the whole rounds' (after the warm-up)

                    def mark(llm=llm, before=before, rounds0=rounds0) -> None:
                        before.update(_decision_counts(llm) or {})
                        rounds0.update(_round_counts(llm) or {})

                    walls[name].append({})
                    outs, s_, occupancy = timed(llm, prompts, b, args.tokens, 1,
                                                CLOCKS[args.clock], args.queue, temp,
                                                mark, args.greedy_warmup,
                                                walls[name][-1])  # fmt: skip
                    secs[name].append(s_)
                    last[name] = (outs, occupancy)
                    if rounds0:  # this pass's rounds: an adaptive engine's first pass stepped
                        # 0.1-0.2 ms slower than its later ones (2026-12-07): lookahead lost?
                        now = _round_counts(llm)
                        walls[name][-1]["round_graphs"] = {k: now[k] - rounds0[k] for k in now}
                    if before:
                        passes[name].append(_pass_decisions(llm, before))
            plain_name = cfgs[0][0]
            plain_outs = last[plain_name][0]
            for (name, *_), llm in zip(cfgs, engines, strict=True):
                outs, occupancy = last[name]
                med = statistics.median(secs[name])
                greedy_ref = None if name == plain_name or temp else plain_outs
                r = describe(llm, name, outs, med, greedy_ref, b, text, occupancy, judge,
                             prompts)  # fmt: skip
                toks = r["tokens"]
                r["passes_tokens_per_s"] = [round(toks / x, 1) for x in secs[name]]
                r["passes_step_walls"] = walls[name]
                if passes[name]:  # the median pass's speed may come from another pass's
                    r["passes_decisions"] = passes[name]  # budgets than the last pass's
                r["speedup_vs_plain"] = round(
                    statistics.median(
                        [q / x for q, x in zip(secs[plain_name], secs[name], strict=True)]
                    ),
                    3,
                )
                rows.append(r)
                print(json.dumps(_brief(r)), flush=True)
    for llm in engines:
        free(llm)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("accept", "speed"))
    p.add_argument("--target", default="tiny-code", help="model name or directory")
    p.add_argument(
        "--drafter",
        default=str(DATA / "tiny-code-dflash"),
        help="DFlash drafter directory; 'none': n-gram configs only",
    )
    p.add_argument("--code-prompts", type=Path, default=DATA / "tiny-code" / "heldout.json")
    p.add_argument("--prose", type=Path, default=PROSE)
    p.add_argument("--n", type=int, default=16, help="prompts per text")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--budgets", default="8,16,32,64,128,256")
    p.add_argument("--budget", default="32", help="speed: DDTREE(dflash) budgets, comma list")
    p.add_argument("--ngram-budget", type=int, default=32)
    p.add_argument("--ngram-depth", type=int, default=8)
    p.add_argument(
        "--ngram-general",
        action="store_true",
        help="speed: also DDTREE(ngram) with its rounds on the general path (whole rounds off)",
    )
    p.add_argument(
        "--general",
        action="store_true",
        help="speed: also the first DDTREE(dflash) budget with whole-round graphs off",
    )
    p.add_argument(
        "--adaptive",
        type=int,
        default=0,
        help="speed: also DDTREE(dflash) with the adaptive budget up to this (0: off)",
    )
    p.add_argument(
        "--no-trials-too",
        action="store_true",
        help="speed, with --adaptive: also the adaptive budget without cost trials (A/B)",
    )
    p.add_argument(
        "--no-accept-trials-too",
        action="store_true",
        help="speed, with --adaptive: also the adaptive budget without acceptance trials (A/B)",
    )
    p.add_argument(
        "--ngram-adaptive",
        action="store_true",
        help="speed, with --adaptive: also DDTREE(ngram) with the adaptive budget (does the "
        "controller turn speculation down where n-gram rounds lose, e.g. at batch 8?)",
    )
    p.add_argument("--repeat", type=int, default=1,
                   help="speed: best of this many passes (--interleave: the median)")  # fmt: skip
    p.add_argument(
        "--interleave",
        action="store_true",
        help="speed: every engine alive at once, each pass running every config back to back; "
        "medians and pass-paired ratios to plain decoding (host-bound steps jitter)",
    )
    p.add_argument(
        "--no-judge", action="store_true", help="skip the fp32 near-tie check of divergences"
    )
    p.add_argument(
        "--sampled",
        action="store_true",
        help="speed: also the prose prompts at temperature 1 (text the drafter cannot predict)",
    )
    p.add_argument(
        "--greedy-warmup",
        action="store_true",
        help="speed: each pass's untimed warm-up greedy even before a sampled pass (the "
        "benchmark before the forty-first session: every sampled pass opened with a batch change)",
    )
    p.add_argument("--texts", default="", help="speed: only these texts, comma list "
                   "(code, prose, prose-sampled with --sampled); default all")  # fmt: skip
    p.add_argument("--batches", default="1,8")
    p.add_argument(
        "--queue",
        action="store_true",
        help="speed: a new prompt joins as one finishes (continuous batching) instead of groups "
        "of --batches prompts; use --n > the batch so the batch stays full",
    )
    p.add_argument(
        "--controller-set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="a ControllerConfig knob for the adaptive configs (repeatable), e.g. "
        "prior_rounds=128: the A/B of a controller setting on the GPU",
    )
    p.add_argument(
        "--adaptive-ab",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="with --adaptive: one more adaptive config with these controller knobs (repeatable), "
        "in the same passes: e.g. plain_margin=0.05, the rule before 5a4c446; a TREEVERIFY_* "
        "switch (e.g. TREEVERIFY_CONTEXT_LAZY=1) is set while that engine is built instead",
    )
    p.add_argument(
        "--ab-config",
        action="append",
        default=[],
        metavar="KNOB=VALUE[,KNOB=VALUE]",
        help="with --adaptive: one more adaptive config per use (repeatable), its knobs or "
        "TREEVERIFY_* switches comma-separated: several A/Bs in the same passes",
    )
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="process: CPU seconds of this process with 1 torch thread (a shared CPU machine: "
        "neighbours do not count); wall on a GPU",
    )
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    if args.clock == "process":
        if torch.cuda.is_available() and not args.cpu:
            p.error("--clock process: CPU runs only (GPU work is not process time)")
        torch.set_num_threads(1)
    block = 0
    if args.drafter != "none":
        block = json.loads((Path(args.drafter) / "config.json").read_text())
        block = block.get("block_size") or block["dflash_config"]["block_size"]
    elif args.adaptive or args.mode == "accept":
        p.error("--drafter none: only `speed` without --adaptive (the DFlash configs need one)")
    t0 = time.perf_counter()
    rows = run_accept(args, block) if args.mode == "accept" else run_speed(args, block)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "cpu"
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": _git_commit(), "command": " ".join(sys.argv),
              "mode": args.mode, "queue": args.queue, "interleave": args.interleave,
              "device": dev, "target": args.target,
              "drafter": args.drafter,
              "prompts_per_text": args.n, "tokens_per_prompt": args.tokens,
              "graphs": not args.no_graphs, "torch": torch.__version__, "clock": args.clock,
              "warmup": "greedy" if args.greedy_warmup else "as the pass samples",
              "torch_threads": torch.get_num_threads(), "rows": rows,
              "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=1))
    if args.mode == "speed":
        print(speed_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
