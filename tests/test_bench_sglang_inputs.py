"""The grid case in SGLang's verify layout reads the same attention as our paged inputs: a dense
float64 attention over SGLang's arguments (pool slots, kv_indices, flat mask) equals the reference
on the original inputs, at page sizes 1 and 16, GQA and MLA; and the call adapter fills only the
keyword arguments a kernel takes."""

from __future__ import annotations

import random

import pytest
import torch

from treeverify.bench.cases import Case, make_inputs
from treeverify.bench.sglang_inputs import call_extend_attention, sglang_layout
from treeverify.kernels import tree_attention_reference


def _dense_sglang(lay: dict, hq: int) -> torch.Tensor:
    """float64 attention straight from SGLang's arguments, the way its layout defines it."""
    n = lay["max_len_extend"]
    bsz = lay["qo_indptr"].shape[0] - 1
    out = []
    for b in range(bsz):
        lo, hi = int(lay["kv_indptr"][b]), int(lay["kv_indptr"][b + 1])
        p = hi - lo
        idx = lay["kv_indices"][lo:hi]
        k = torch.cat([lay["k_buffer"][idx], lay["k_extend"][b * n : (b + 1) * n]]).double()
        v = torch.cat([lay["v_buffer"][idx], lay["v_extend"][b * n : (b + 1) * n]]).double()
        start = int(lay["mask_indptr"][b])
        mask = lay["custom_mask"][start : start + n * (p + n)].view(n, p + n).bool()
        group = hq // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q = lay["q_extend"][b * n : (b + 1) * n].double()  # (N, Hq, D)
        s = torch.einsum("nhd,shd->hns", q, k) * lay["sm_scale"]
        s = s.masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hns,shd->nhd", s.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_layout_reads_the_same_attention(mla, page_size):
    seed = random.randrange(2**31)
    case = Case("t", 3, 70, 11, 4, 1 if mla else 2, 40 if mla else 16, 32 if mla else 16, mla)
    inp = make_inputs(case, page_size=page_size, device="cpu", dtype=torch.float32, seed=seed,
                      prefix_lens=[70, 0, 33])  # fmt: skip
    lay = sglang_layout(inp, page_size)
    assert lay["kv_indices"].dtype == torch.int64 and lay["mask_indptr"].dtype == torch.int64
    assert lay["custom_mask"].numel() == int(lay["mask_indptr"][-1]) == 11 * (103 + 33)
    ref = tree_attention_reference(
        inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["prefix_lens"],
        inp["qo_indptr"], inp["tree_mask"], inp["sm_scale"], v_head_dim=inp["v_head_dim"],
    )  # fmt: skip
    torch.testing.assert_close(_dense_sglang(lay, case.hq), ref.double(), rtol=1e-4, atol=1e-5)


def test_call_adapter_passes_only_what_a_kernel_takes():
    case = Case("t", 2, 5, 3, 2, 1, 8, 8, False)
    lay = sglang_layout(make_inputs(case, page_size=1, device="cpu", seed=1), 1)
    seen = {}

    def sglang_like(*args, k_scale, v_scale, sm_scale=None, page_size=1, logit_cap=0.0):
        seen.update(n=len(args), k_scale=k_scale, v_scale=v_scale, page_size=page_size)

    def ours_like(*args, sm_scale=None, logit_cap=0.0):
        seen.update(ours=len(args), sm_scale=sm_scale)

    call_extend_attention(sglang_like, lay, None, 16)
    call_extend_attention(ours_like, lay, None, 16)
    assert seen == dict(n=13, k_scale=1.0, v_scale=1.0, page_size=16, ours=13,
                        sm_scale=lay["sm_scale"])  # fmt: skip
    with pytest.raises(ValueError, match="equal trees"):
        sglang_layout(make_inputs(case, page_size=1, device="cpu", tree_sizes=[3, 2]), 1)
