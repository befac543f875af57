"""The kernel benchmark grid (shared/bench/cases.json, copied into the package) and its inputs.

`make_inputs` builds one case's tensors exactly as tree_attention takes them: random bf16 data
(never zeros), random topological trees, and a shuffled page table so pages are not contiguous.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources

import torch

from treeverify.spec import parents_to_tree_mask


@dataclass(frozen=True)
class Case:
    model: str
    B: int
    L: int  # committed prefix per request
    N: int  # tree nodes per request
    hq: int
    hkv: int
    dqk: int
    dv: int
    mla: bool

    @property
    def name(self) -> str:
        return f"{self.model}/B{self.B}/L{self.L}/N{self.N}"


def load_grid() -> tuple[list[Case], dict]:
    """The 54 cases and the ceilings (bandwidth, peak FLOP/s, minimum latency)."""
    data = json.loads(resources.files("treeverify.bench").joinpath("cases.json").read_text())
    return [Case(**c) for c in data["cases"]], data["ceilings_h200"]


def floor_seconds(case: Case, ceilings: dict) -> float:
    """max(prefix KV bytes / bw, flops / peak, min latency), the grid's own formula."""
    width = case.dqk if case.mla else case.dqk + case.dv
    kv_bytes = case.B * case.L * case.hkv * width * 2
    flops = 2 * case.B * case.N * case.hq * case.L * (case.dqk + case.dv)
    return max(
        kv_bytes / ceilings["bw_bytes_per_s"],
        flops / ceilings["peak_flops"],
        ceilings["min_latency_s"],
    )


def case_bytes_flops(case: Case) -> tuple[int, int]:
    width = case.dqk if case.mla else case.dqk + case.dv
    return (
        case.B * case.L * case.hkv * width * 2,
        2 * case.B * case.N * case.hq * case.L * (case.dqk + case.dv),
    )


def random_parents(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, n) int64: parent[0] = -1, parent[i] uniform in [0, i)."""
    u = torch.rand(batch, n, generator=gen)
    idx = torch.arange(n)
    parents = (u * idx).floor().to(torch.int64)
    parents[:, 0] = -1
    return parents


def make_inputs(
    case: Case,
    *,
    page_size: int = 16,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    prefix_lens: list[int] | None = None,
    tree_sizes: list[int] | None = None,
) -> dict:
    """Tensors for tree_attention; prefix/tree sizes default to the case's (L, N) for all."""
    gen = torch.Generator().manual_seed(seed)
    prefix = prefix_lens if prefix_lens is not None else [case.L] * case.B
    trees = tree_sizes if tree_sizes is not None else [case.N] * case.B
    pages_per_req = [math.ceil((p + t) / page_size) for p, t in zip(prefix, trees, strict=True)]
    max_pages = max(pages_per_req)
    num_pages = sum(pages_per_req) + 1
    perm = torch.randperm(num_pages, generator=gen)
    block_table = torch.zeros(len(prefix), max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        block_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    total_q = sum(trees)
    qo = torch.tensor([0, *torch.tensor(trees).cumsum(0).tolist()], dtype=torch.int32)
    masks = []
    for t in trees:
        masks.append(parents_to_tree_mask(random_parents(1, t, gen)))  # (t, W)
    words = max(m.shape[1] for m in masks)
    tree_mask = torch.zeros(total_q, words, dtype=torch.int32)
    row = 0
    for m in masks:
        tree_mask[row : row + m.shape[0], : m.shape[1]] = m
        row += m.shape[0]
    dev = torch.device(device)
    # Data drawn on the target device: GB-sized caches would take minutes on the host.
    gdev = torch.Generator(device=dev).manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gdev, device=dev, dtype=dtype)

    k_cache = randn(num_pages, page_size, case.hkv, case.dqk)
    v_cache = None if case.mla else randn(num_pages, page_size, case.hkv, case.dv)
    q = randn(total_q, case.hq, case.dqk)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table.to(dev),
        "prefix_lens": torch.tensor(prefix, dtype=torch.int32, device=dev),
        "qo_indptr": qo.to(dev),
        "tree_mask": tree_mask.to(dev),
        "sm_scale": case.dqk**-0.5 if not case.mla else 192**-0.5,
        "v_head_dim": case.dv if case.mla else None,
    }
