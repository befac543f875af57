"""Host time of speculative rounds (GPU machine): cProfile over DDTREE steps on a repetitive
prompt, functions by own time. Usage: PYTHONPATH=src python3 scripts/profile_round.py [model]"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from treeverify.bench.engine import repetitive_prompts
from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "random:llama-1b"
llm = LLM(model, device="cuda", num_pages=2048, cuda_graph_max_bs=1, max_num_seqs=1,
          speculative_algorithm="DDTREE", speculative_ddtree_budget=16,
          speculative_adaptive=False)  # fmt: skip
llm.add_request(repetitive_prompts(1, 256, 3)[0],
                SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))  # fmt: skip
for _ in range(5):
    llm.step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    llm.step()
prof.disable()
print(llm.spec_stats)
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
pstats.Stats(prof).sort_stats("cumulative").print_stats("treeverify", 40)
