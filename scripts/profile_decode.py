"""Where a captured batch-1 decode forward spends its time (GPU machine): kernels by total
device time and count, from torch.profiler over graph replays. Usage:
PYTHONPATH=src python3 scripts/profile_decode.py [model] [batch]"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from treeverify.engine.llm import LLM
from treeverify.engine.sampling_params import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "random:llama-1b"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
llm = LLM(model, device="cuda", num_pages=2048, cuda_graph_max_bs=max(batch, 1),
          max_num_seqs=max(batch, 1))  # fmt: skip
sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
llm.generate([list(range(100, 612))] * batch, sp)
graph = llm.captured_graph(batch)
for _ in range(5):
    graph.replay()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
events.sort(key=lambda e: -e.device_time_total)
total = sum(e.device_time_total for e in events) / 10
count = sum(e.count for e in events) / 10
print(
    f"{model} batch {batch}: {count:.0f} kernels per forward, {total / 1e3:.3f} ms of kernel time"
)
print(f"{'us/forward':>11} {'count':>6}  kernel")
for e in events[:25]:
    print(f"{e.device_time_total / 10:11.1f} {e.count / 10:6.0f}  {e.key[:110]}")
