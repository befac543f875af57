"""Prompts prefilled together against each prefilled alone (GPU, tiny-code, greedy): the first
token's logits rows and the outputs of 8 prose prompts added at once, with the step of 8
prefills as one eager forward (TREEVERIFY_PREFILL_REPLAYS=0) and as one (1, n) graph replay each
(=1), against the same prompts one at a time (a single prefill's graph). A large logits gap
would be a bug in a path; bf16 gives ~0.06 between different kernels, and outputs may part at
near-ties later (decode steps at b=8 and b=1 run different buckets).

    PYTHONPATH=src python3 scripts/prefill_together_check.py [--json P.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pair import PROSE, prose_prompts  # noqa: E402

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402


def run(name: str, replays: str, prompts: list[str], sp: SamplingParams):
    """(outputs, (8, V) first logits rows) of one way of prefilling."""
    os.environ["TREEVERIFY_PREFILL_REPLAYS"] = replays  # read when the engine is built
    llm = LLM("tiny-code", device="cuda", num_pages=512, max_num_seqs=len(prompts))
    rows: list[torch.Tensor] = []
    real = llm.runner.run

    def spy(batch, *a, **k):
        out = real(batch, *a, **k)
        if batch.prefills and not batch.decodes:
            rows.append(out.logits.float().clone())
        return out

    llm.runner.run = spy
    if name == "alone":
        outs = [llm.generate([p], sp)[0].token_ids for p in prompts]
    else:
        outs = [o.token_ids for o in llm.generate(prompts, sp)]
        if rows[0].shape[0] != len(prompts):  # the comparison is of one step of all prefills
            raise SystemExit(
                f"{name}: the first step prefilled {rows[0].shape[0]} of "
                f"{len(prompts)} prompts (the step's token budget split them)"
            )
        rows[1:] = []  # later prefill-only steps: none expected
    del llm
    torch.cuda.empty_cache()
    return outs, torch.cat(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    prompts = prose_prompts(PROSE, 8)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref_outs, ref_rows = run("alone", "1", prompts, sp)
    result = {}
    for name, replays in (("together, one eager forward", "0"), ("together, replays", "1")):
        outs, rows = run(name, replays, prompts, sp)
        result[name] = {
            "same_outputs": sum(a == b for a, b in zip(outs, ref_outs, strict=True)),
            "first_divergence": [
                next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                for a, b in zip(outs, ref_outs, strict=True)
            ],  # fmt: skip
            "max_abs_logit_diff": [
                round(float(x), 4) for x in (rows - ref_rows).abs().max(dim=-1).values
            ],  # fmt: skip
            "argmax_equal": (rows.argmax(-1) == ref_rows.argmax(-1)).tolist(),
        }
        print(name, json.dumps(result[name]))
    if args.json:
        args.json.write_text(
            json.dumps({"device": torch.cuda.get_device_name(), **result}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
