"""treeverify's SGLang backend on the CPU: SGLang's verify layout -> our plan's metadata, the
backend's verify forward (torch backend of the plan) vs brute force, the graph hooks rewriting
fixed buffers, and delegation of every other mode. SGLang is faked (tests/sglang_fakes.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_fakes import Mode, brute_force_attention, make_verify_case, naive_full_mask
from treeverify.integrations.sglang.backend import TreeverifyAttnBackend, draft_tokens_per_request
from treeverify.integrations.sglang.geometry import VerifyGeometry
from treeverify.integrations.sglang.verify_metadata import (
    FULL_MASK,
    QLEN_ONLY,
    block_table_from_req_to_token,
    sglang_mask_to_bits,
)
from treeverify.kernels.bits import unpack_tree_mask
from treeverify.spec import to_sglang_verify


def _ancestor_rows(parents: list[int]) -> list[set[int]]:
    rows = []
    for i in range(len(parents)):
        seen, j = {i}, parents[i]
        while j >= 0:
            seen.add(j)
            j = parents[j]
        rows.append(seen)
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_mask_conversion_matches_brute_force_ancestors(seed):
    rng = random.Random(seed * 7919 + 11)
    bsz, n = rng.randint(1, 4), rng.choice([1, 2, 31, 32, 33, rng.randint(2, 80)])
    parents = [[-1] + [rng.randrange(i) for i in range(1, n)] for _ in range(bsz)]
    prefix = [rng.randint(0, 50) for _ in range(bsz)]
    seq_lens = torch.tensor(prefix)
    want = torch.zeros(bsz * n, n, dtype=torch.bool)
    for b, row in enumerate(parents):
        for i, seen in enumerate(_ancestor_rows(row)):
            want[b * n + i, sorted(seen)] = True
    full = torch.tensor(naive_full_mask(parents, prefix), dtype=torch.uint8)
    got = sglang_mask_to_bits(full, seq_lens, n, FULL_MASK)
    assert got.shape == (bsz * n, (n + 31) // 32) and got.dtype == torch.int32
    assert torch.equal(unpack_tree_mask(got, n), want)
    # The same tree through spec/sglang_layout.py (bool and uint8 masks read the same).
    lay = to_sglang_verify(torch.tensor(parents), seq_lens, mask_capacity=len(full) + 3)
    assert torch.equal(sglang_mask_to_bits(lay.custom_mask.bool(), seq_lens, n, FULL_MASK), got)
    # QLEN_ONLY: only the [N, N] blocks, at N*N*b.
    qlen = torch.stack([want[b * n : (b + 1) * n] for b in range(bsz)]).reshape(-1)
    assert torch.equal(sglang_mask_to_bits(qlen, seq_lens, n, QLEN_ONLY), got)


@pytest.mark.parametrize("page_size", [1, 16])
def test_block_table_from_req_to_token(page_size):
    rng = random.Random(page_size)
    case = make_verify_case(rng, page_size=page_size, mla=False, n=5, prefix=[0, 37, 70])
    b = case.batch
    pages = -(-160 // page_size)
    table = block_table_from_req_to_token(
        b.req_to_token_pool.req_to_token, b.req_pool_indices, page_size, pages
    )
    assert table.shape == (3, pages) and table.dtype == torch.int32
    for r, slots in enumerate(case.slots):
        for t, slot in enumerate(slots):  # every token of prefix + tree is where the table says
            assert int(table[r, t // page_size]) * page_size + t % page_size == slot


def _backend(case_kw, *, fallback=None, kernel="torch", **kw):
    g = VerifyGeometry(
        num_qo_heads=case_kw["hq"], num_kv_heads=1 if case_kw["mla"] else 2,
        head_dim_qk=case_kw["d"], head_dim_v=case_kw["dv"], mla=case_kw["mla"],
        page_size=case_kw["page_size"], max_context_len=160, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    return TreeverifyAttnBackend(fallback or SimpleNamespace(), g, kernel=kernel, **kw)


def _layer(layer_id=0, scale=0.3, **kw):
    return SimpleNamespace(layer_id=layer_id, scaling=scale, logit_cap=0.0, **kw)


def _run_verify(backend, case, layer, hq, d, mla, seed):
    g = torch.Generator().manual_seed(seed)
    t = case.k_draft.shape[0]
    q = torch.randn(t, hq * d, generator=g)
    out = backend.forward(q, case.k_draft, case.v_draft, layer, case.batch)
    dv = backend.geometry.head_dim_v
    assert out.shape == (t, hq * dv)
    want = brute_force_attention(case, q.view(t, hq, d), layer.layer_id, hq, dv, layer.scaling, mla)
    torch.testing.assert_close(out.view(t, hq, dv).double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mla,page_size", [(False, 1), (False, 16), (True, 1), (True, 16)], ids=str)
def test_verify_forward_equals_brute_force(mla, page_size):
    seed = random.randrange(2**31)  # fresh inputs each run; the seed is in the failure message
    rng = random.Random(seed)
    kw = dict(mla=mla, page_size=page_size, hq=4, d=24 if mla else 16, dv=16)
    n = rng.randint(1, 40)
    prefix = [rng.randint(0, 90) for _ in range(rng.randint(1, 3))]
    case = make_verify_case(rng, page_size=page_size, mla=mla, n=n, prefix=prefix, d=kw["d"],
                            dv=16, layers=2)  # fmt: skip
    backend = _backend(kw)
    if rng.random() < 0.5:  # draft slots not yet in req_to_token: out_cache_loc alone says them
        for b, row in enumerate(case.batch.req_pool_indices.tolist()):
            table = case.batch.req_to_token_pool.req_to_token
            table[row, prefix[b] : prefix[b] + n] = rng.randrange(table.shape[1])
    backend.init_forward_metadata(case.batch)
    for layer_id in (0, 1):  # one metadata fill serves every layer
        _run_verify(backend, case, _layer(layer_id, 0.1 + layer_id), 4, kw["d"], mla, seed)


def test_graph_hooks_refill_fixed_buffers_across_replays():
    rng = random.Random(random.randrange(2**31))
    kw = dict(mla=False, page_size=16, hq=4, d=16, dv=16)
    n = 9
    backend = _backend(kw, fallback=SimpleNamespace(init_cuda_graph_state=lambda *a: None))
    backend.init_cuda_graph_state(4, 4 * n)
    capture = make_verify_case(rng, page_size=16, mla=False, n=n, prefix=[1, 1, 1, 1])
    backend.init_forward_metadata_out_graph(capture.batch, in_capture=True)
    plan = backend._active
    ptrs = [t.data_ptr() for t in (plan.block_table, plan.prefix_lens, plan.qo_indptr,
                                   plan.tree_mask)]  # fmt: skip
    for _ in range(3):  # replays: new trees, prefixes, pages and fewer requests, same buffers
        bsz = rng.randint(1, 4)
        case = make_verify_case(rng, page_size=16, mla=False, n=n,
                                prefix=[rng.randint(0, 120) for _ in range(bsz)])  # fmt: skip
        backend.init_forward_metadata_out_graph(case.batch)
        assert backend._active is plan
        assert [t.data_ptr() for t in (plan.block_table, plan.prefix_lens, plan.qo_indptr,
                                       plan.tree_mask)] == ptrs  # fmt: skip
        assert plan.qo_indptr.tolist() == [min(i * n, bsz * n) for i in range(5)]
        _run_verify(backend, case, _layer(), 4, 16, False, 0)
    # A replay padded to the captured 4 requests with a mask built for the real 2 stays in bounds.
    case = make_verify_case(rng, page_size=16, mla=False, n=n, prefix=[5, 40])
    b = case.batch
    b.req_pool_indices = torch.cat([b.req_pool_indices, b.req_pool_indices.new_zeros(2)])
    b.seq_lens = torch.cat([b.seq_lens, b.seq_lens.new_ones(2)])  # SGLang's fill value 1
    backend.init_forward_metadata_out_graph(b)
    assert plan.prefix_lens.tolist() == [5, 40, 1, 1]
    # A batch no captured graph holds (SGLang runs it eagerly) gets an eager plan.
    big = make_verify_case(rng, page_size=16, mla=False, n=n, prefix=[3, 60, 7, 0, 33])
    backend.init_forward_metadata_out_graph(big.batch)
    assert backend._active is not plan and backend._active.max_batch == 8
    _run_verify(backend, big, _layer(), 4, 16, False, 1)


def test_other_modes_and_attributes_go_to_the_fallback():
    calls = []

    class Stock:
        needs_cpu_seq_lens = True

        def __getattr__(self, name):
            return lambda *a, **k: calls.append(name) or name

    backend = _backend(dict(mla=False, page_size=1, hq=2, d=8, dv=8), fallback=Stock())
    for mode in ("DECODE", "EXTEND", "IDLE", "DRAFT_EXTEND_V2"):
        fb = SimpleNamespace(forward_mode=Mode(mode))
        backend.init_forward_metadata(fb)
        backend.init_forward_metadata_out_graph(fb)
        backend.init_forward_metadata_in_graph(fb)
        assert backend.forward(None, None, None, _layer(), fb) == "forward"
        assert backend.forward_extend(None, None, None, _layer(), fb) == "forward_extend"
    assert backend.forward_decode(None, None, None, _layer(), fb) == "forward_decode"
    assert backend.get_cuda_graph_seq_len_fill_value() == "get_cuda_graph_seq_len_fill_value"
    assert calls.count("init_forward_metadata_out_graph") == 4 and "forward" in calls
    assert backend.needs_cpu_seq_lens is True and backend.support_triton() == "support_triton"
    assert backend.verify_mask is None  # the worker writes a fresh FULL_MASK
    assert backend.get_verify_buffers_to_fill_after_draft() == [None, None]  # not the fallback's


def test_verify_errors_name_the_cause():
    rng = random.Random(5)
    kw = dict(mla=False, page_size=1, hq=4, d=16, dv=16)
    case = make_verify_case(rng, page_size=1, mla=False, n=4, prefix=[3])
    backend = _backend(kw)
    with pytest.raises(RuntimeError, match="before its metadata"):
        backend.forward(torch.zeros(4, 64), case.k_draft, case.v_draft, _layer(), case.batch)
    backend.init_forward_metadata(case.batch)
    with pytest.raises(ValueError, match="logit_cap"):
        layer = _layer()
        layer.logit_cap = 30.0
        backend.forward(torch.zeros(4, 64), case.k_draft, case.v_draft, layer, case.batch)
    with pytest.raises(ValueError, match="sinks"):
        backend.forward(torch.zeros(4, 64), case.k_draft, case.v_draft, _layer(), case.batch,
                        sinks=torch.zeros(4))  # fmt: skip
    case.batch.spec_info = SimpleNamespace(custom_mask=None, draft_token_num=4)
    with pytest.raises(ValueError, match="custom_mask"):
        backend.init_forward_metadata(case.batch)
    with pytest.raises(ValueError, match="kernel"):
        _backend(kw, kernel="flash")
    with pytest.raises(ValueError, match="dtype"):
        VerifyGeometry(num_qo_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=8, mla=False,
                       page_size=1, max_context_len=8, dtype=torch.float8_e4m3fn,
                       device=torch.device("cpu"))  # fmt: skip


def test_draft_tokens_per_request_skips_sglangs_unfilled_minus_one():
    n = random.randint(2, 64)
    # EagleVerifyInput's num_tokens_per_req defaults to -1 until its __post_init__ fills it in
    assert draft_tokens_per_request(SimpleNamespace(num_tokens_per_req=-1, draft_token_num=n)) == n
    assert draft_tokens_per_request(SimpleNamespace(num_tokens_per_req=n, draft_token_num=3)) == n
    with pytest.raises(ValueError, match="spec_info"):
        draft_tokens_per_request(SimpleNamespace(num_tokens_per_req=-1, draft_token_num=None))


def _emulate_converter(mask, kv_indptr, mask_indptr, qo_indptr, batch, words, cap):
    """Python transcription of kernels/cuda's sglang_mask_to_bits, to check its inputs."""
    bits = torch.zeros(cap, words * 32, dtype=torch.bool)
    total = int(qo_indptr[batch])
    for tok in range(min(total, cap)):
        b = max(i for i in range(batch) if int(qo_indptr[i]) <= tok)
        i, n = tok - int(qo_indptr[b]), int(qo_indptr[b + 1] - qo_indptr[b])
        p = int(kv_indptr[b + 1] - kv_indptr[b])
        start = int(mask_indptr[b]) + i * (p + n) + p
        assert start >= 0 and start + n <= mask.numel(), "out-of-bounds mask read"
        bits[tok, :n] = mask[start : start + n].bool()
    return bits


@pytest.mark.parametrize("mode", [FULL_MASK, QLEN_ONLY])
def test_gpu_converter_inputs_read_the_right_bytes_even_padded(mode):
    from treeverify.integrations.sglang.verify_metadata import mask_indptrs

    rng = random.Random(random.randrange(2**31))
    n, prefix = rng.randint(1, 40), [rng.randint(0, 30) for _ in range(3)]
    parents = [[-1] + [rng.randrange(i) for i in range(1, n)] for _ in prefix]
    full = torch.tensor(naive_full_mask(parents, prefix), dtype=torch.uint8)
    seq = torch.tensor(prefix)
    mask = full
    if mode == QLEN_ONLY:
        dense = unpack_tree_mask(sglang_mask_to_bits(full, seq, n, FULL_MASK), n)
        mask = dense.reshape(-1).to(torch.uint8)
    want = unpack_tree_mask(sglang_mask_to_bits(mask, seq, n, mode), n)
    # A plan for 5 requests, 2 of them graph padding with SGLang's fill value 1.
    plens = torch.tensor(prefix + [1, 1], dtype=torch.int32)
    qo = torch.arange(6, dtype=torch.int32) * n
    kv_indptr, mask_indptr = torch.zeros(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int64)
    mask_indptrs(plens, n, mask.numel(), mode, kv_indptr, mask_indptr)
    got = _emulate_converter(mask, kv_indptr, mask_indptr, qo, 5, 2, 5 * n)
    assert torch.equal(got[: 3 * n, :n], want)
