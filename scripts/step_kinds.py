"""Where an engine's wall time goes, by kind of step: prefill steps, plain steps taken from the
step launched ahead (steady), plain steps read first, speculative rounds. bench_pair's tokens/s
is the sum; this splits it, for plain decoding and the adaptive DDTREE engines (DFlash and n-gram)
side by side, so a per-step or per-request loss shows where it is (`--code`: held-out code
prompts; fixed budgets 16 and 32 by name in `--configs`: a round's cost at each, step by step).

    PYTHONPATH=src python3 scripts/step_kinds.py [--batch 1] [--temperature 1] --json P.json

Host clock around each engine step (no sync inside: a sync would undo the overlap); the device
is synchronized before and after each pass. Prompts: bench_pair's prose (the speed texts').
The JSON also keeps the last pass's every step (kind, us) and, for the adaptive engines, the
controller's view at its end (/server_info's) and every step cost it was taught (batch, budget,
us, step path): where a wrong cost entry came from.

Each step's wait for the device (the time the host spent blocked on a launched step's result,
`Launched.rows`) is kept beside its wall time: wall - wait is the step's host work, so a slower
step says whether the host or the device grew. `--gc off` runs the passes with the collector
off (after a collection and a freeze, as `treeverify serve` freezes startup's objects): whether
collections make the irregular slow steps. `--configs` picks configs by name; "DDTREE(dflash)
budget 0" is the DFlash engine held at plain decoding (costs that make budget 0 always win, as
scripts/profile_budget0.py does): a plain step's price in that engine without the probes'
rounds. `--warm`: before each pass, greedy passes over held-out code and prose on the same
engine (not reported), as bench_pair's interleaved passes run the texts one after another: the
controller then starts the measured text with what greedy text taught it.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pair import DATA, PROSE, code_prompts, free, prose_prompts  # noqa: E402
from raw_json import write_rows  # noqa: E402

from treeverify.engine.launch_ahead import Launched  # noqa: E402
from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402

CONFIGS = {
    "none": {},
    "DDTREE(dflash) adaptive<=64": dict(speculative_algorithm="DDTREE",
                                        speculative_ddtree_budget=64),
    "DDTREE(ngram) adaptive<=64": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=64,
                                       speculative_draft_model_path="ngram"),
    "DDTREE(dflash) budget 0": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                                    speculative_cost_seconds={0: 1e-4, 4: 1.0, 8: 1.0, 16: 1.0}),
    # fixed budgets: what a round at each costs step by step, beside the costs the adaptive
    # engine is taught for them (its `observed_costs`)
    "DDTREE(dflash) b=16": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
                                speculative_adaptive=False),
    "DDTREE(dflash) b=32": dict(speculative_algorithm="DDTREE", speculative_ddtree_budget=32,
                                speculative_adaptive=False),
}  # fmt: skip
DEFAULT_CONFIGS = list(CONFIGS)[:3]
WAITED = [0.0]  # seconds the host spent blocked on launched steps' results (all steps so far)


_ROWS = Launched.rows


def _timed_rows(self: Launched, n: int) -> list:
    """Launched.rows (its wait for the device and the read of a few host ints), timed into
    WAITED."""
    t0 = time.perf_counter()
    try:
        return _ROWS(self, n)
    finally:
        WAITED[0] += time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_pass(llm: LLM, prompts: list[str], batch: int, params: list[SamplingParams],
             profiles: StepProfiles | None = None) -> dict:  # fmt: skip
    """Every prompt, `batch` at a time; per step kind: (steps, seconds). `profiles`: every
    step under its own cProfile, kept by kind (a diagnosis pass: the profiler's cost is in its
    times)."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # steps, s, s waited
    seen = {}
    run_batch = llm.run_batch

    def spy(b):
        seen["prefill"] = bool(b.prefills)
        return run_batch(b)

    llm.run_batch = spy
    observed = []  # the controller's step costs this pass: (batch, budget, us)
    ctl = llm.controller
    if ctl is not None:
        observe_step = ctl.observe_step

        def spy_cost(n, budget, seconds, path):
            observed.append((n, budget, round(seconds * 1e6, 1), path))
            observe_step(n, budget, seconds, path)

        ctl.observe_step = spy_cost
    trace = []  # every step of the pass: (kind, us, us waiting for the device)
    sync()
    t_all = time.perf_counter()
    try:
        for i in range(0, len(prompts), batch):
            for p, sp in zip(prompts[i : i + batch], params[i : i + batch], strict=True):
                llm.add_request(p, sp)
            while llm.has_unfinished():
                prof = cProfile.Profile() if profiles is not None else None
                w0, t0 = WAITED[0], time.perf_counter()
                if prof is not None:
                    prof.enable()
                llm.step()
                if prof is not None:
                    prof.disable()
                dt = time.perf_counter() - t0
                waited = WAITED[0] - w0
                if seen.get("prefill"):
                    kind = "prefill"
                elif llm.last_budget:
                    kind = f"round b={llm.last_budget}"
                else:
                    kind = "plain steady" if llm._step_steady and llm.ahead and llm.ahead.steady \
                        else "plain read-first"  # fmt: skip
                kinds[kind][0] += 1
                kinds[kind][1] += dt
                kinds[kind][2] += waited
                if prof is not None:
                    profiles.keep(kind, trace, prof)
                trace.append((kind, round(dt * 1e6, 1), round(waited * 1e6, 1)))
        sync()
    finally:
        del llm.run_batch
        if ctl is not None:
            del ctl.observe_step
    total = time.perf_counter() - t_all
    kinds["(outside steps)"] = [0, total - sum(v[1] for v in kinds.values()), 0.0]
    out = {"seconds": total, "kinds": {k: v for k, v in kinds.items()}, "steps": trace}
    if ctl is not None:  # what the controller believed, and the costs it was taught
        out |= {"controller": ctl.info(), "observed_costs": observed}
    return out


class StepProfiles:
    """Per kind of step ("round", "after round": the step that follows one, "plain": every
    other plain step; prefills left out), the steps' cProfiles added up, and their count.
    `alone`: indexes of steps in the pass kept apart ("step i"): a step that is slow at the same
    index in every pass (a batch flush of the DFlash context, a request's last step)."""

    def __init__(self, alone: frozenset[int] = frozenset()) -> None:
        self.stats: dict[str, pstats.Stats] = {}
        self.steps: dict[str, int] = defaultdict(int)
        self.alone = alone

    def keep(self, kind: str, trace: list, prof: cProfile.Profile) -> None:
        """One step's profile (`kind` as run_pass names it; `trace`: the steps before it)."""
        if len(trace) in self.alone:
            key = f"step {len(trace)} ({kind})"
        elif kind == "prefill":
            return
        elif kind.startswith("round"):
            key = "round"
        else:
            key = "after round" if trace and trace[-1][0].startswith("round") else "plain"
        if key in self.stats:
            self.stats[key].add(prof)
        else:
            self.stats[key] = pstats.Stats(prof)
        self.steps[key] += 1

    def write(self, path: Path, name: str, top: int = 45) -> None:
        """Each kind's functions by cumulative time, appended to `path`, in microseconds per
        step (pstats' own table rounds to milliseconds: a 0.3 ms step reads as zeros)."""
        with path.open("a") as f:
            for key, stats in self.stats.items():
                n = self.steps[key]
                head = f"{'calls':>8} {'own us':>9} {'cumulative us':>13}  function"
                f.write(f"\n===== {name}: {key} steps ({n} of them), us per step\n{head}\n")
                by_cum = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]
                for (file, line, func), (_, calls, own, cum, _) in by_cum:
                    where = f"{Path(file).name}:{line}({func})" if line else func
                    f.write(f"{calls / n:8.2f} {own * 1e6 / n:9.1f} {cum * 1e6 / n:13.1f}  "
                            f"{where}\n")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-code")
    ap.add_argument("--prose", type=Path, default=PROSE)
    ap.add_argument(
        "--code", action="store_true", help="held-out code prompts instead of prose (predictable)"
    )
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3, help="passes; the last one is reported")
    ap.add_argument(
        "--gc",
        choices=("on", "off"),
        default="on",
        help="off: the passes run with the collector off, startup's objects frozen",
    )
    ap.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated, of: {'; '.join(CONFIGS)}",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="greedy code and prose passes on the same engine before each pass",
    )
    ap.add_argument(
        "--warm-tokens",
        type=int,
        default=0,
        help="with --warm: tokens a warm request generates (default --tokens); 4 with "
        "--warm-n 8 is bench_pair's greedy warm-up before the forty-first session",
    )
    ap.add_argument("--warm-n", type=int, default=0, help="with --warm: prompts a warm text "
                    "runs (default --n)")  # fmt: skip
    ap.add_argument(
        "--profile-rounds",
        type=Path,
        default=None,
        help="after the timed passes, one more pass with every step under cProfile; the "
        "cumulative stats of rounds, of the steps right after them and of other plain steps "
        "written to this text file (where a probe's host time goes)",
    )
    ap.add_argument(
        "--profile-steps",
        default="",
        help="with --profile-rounds: these step indexes of the pass (comma list; 0 is the "
        "prefill) profiled each on its own, e.g. the steps every pass finds slow",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        ap.error(f"--configs: unknown {unknown}; expected some of {list(CONFIGS)}")
    Launched.rows = _timed_rows  # the wait counted (the same read)
    prompts = (code_prompts(DATA / "tiny-code" / "heldout.json", args.n) if args.code
               else prose_prompts(args.prose, args.n))  # fmt: skip
    params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.tokens,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    warm_n = args.warm_n or args.n
    warm = [code_prompts(DATA / "tiny-code" / "heldout.json", warm_n),
            prose_prompts(args.prose, warm_n)] if args.warm else []  # fmt: skip
    greedy = [SamplingParams(temperature=0.0, max_tokens=args.warm_tokens or args.tokens,
                             ignore_eos=True) for _ in range(warm_n)]  # fmt: skip
    rows = []
    for name in names:
        kw = CONFIGS[name]
        llm = LLM(args.target, device=dev, max_num_seqs=args.batch, num_pages=512, **kw)
        if args.gc == "off":
            gc.collect()
            gc.freeze()
            gc.disable()
        try:
            for _ in range(args.repeat):
                for texts in warm:
                    run_pass(llm, texts, args.batch, greedy)
                res = run_pass(llm, prompts, args.batch, params)
        finally:
            gc.enable()
            gc.unfreeze()
        if args.profile_rounds is not None:  # after the timed passes: their figures unprofiled
            alone = frozenset(int(i) for i in args.profile_steps.split(",") if i.strip())
            profiles = StepProfiles(alone)
            for texts in warm:
                run_pass(llm, texts, args.batch, greedy)
            run_pass(llm, prompts, args.batch, params, profiles)
            profiles.write(args.profile_rounds, name)
        tokens = len(prompts) * args.tokens
        rows.append({"config": name, "gc": args.gc, "warm": args.warm,
                     "tokens_per_s": round(tokens / res["seconds"], 1)} | res)  # fmt: skip
        print(f"--- {name}: {res['seconds'] * 1e3:.1f} ms, {tokens / res['seconds']:.0f} tok/s")
        for kind, (n, s, w) in sorted(res["kinds"].items(), key=lambda kv: -kv[1][1]):
            per = f"{1e6 * s / n:8.1f} us each, {1e6 * w / n:6.1f} waiting" if n else ""
            print(f"      {kind:24s} {n:6d} steps {1e3 * s:9.2f} ms {per}")
        if "controller" in res:
            info = res["controller"]
            print(
                f"      controller: steps {info['steps_by_budget']}, costs (b=1, ms) "
                f"{ {b: round(c * 1e3, 3) for b, c in info['cost_seconds_batch1'].items()} }"
            )
        free(llm)
    if args.json:
        write_rows(args.json, "step_kinds.py", argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
