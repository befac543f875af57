"""tree_attention_reference (and the torch path of tree_attention) against an independent float64
dense implementation that builds each request's (T, P+T) mask from the tree's parent list."""

from __future__ import annotations

import math
import time
import zlib

import pytest
import torch

import treeverify.kernels as kernels
from treeverify.kernels import api, tree_attention, tree_attention_reference

# ---------------------------------------------------------------- independent test oracle


def dense_tree_attention_naive(p, rows=None):
    """float64, per request and per head: dense mask from parents, plain softmax.

    p: a problem from make_problem. rows: optional {request: [local rows]} to compute only those
    (others stay NaN). Returns (total_q, Hq, Dv) float64.
    """
    q, k_cache, v_cache = p["q"].double(), p["k_cache"].double(), p["v_cache"]
    dv = p["dv"]
    v_cache = k_cache[..., :dv] if v_cache is None else v_cache.double()
    page_size, hq, hkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    out = torch.full((q.shape[0], hq, dv), math.nan, dtype=torch.float64)
    start = 0
    for b, (plen, parents) in enumerate(zip(p["prefix"], p["parents"], strict=True)):
        t = len(parents)
        pos = torch.arange(plen + t)
        pages = p["block_table"][b].long()[pos // page_size]
        keys, values = k_cache[pages, pos % page_size], v_cache[pages, pos % page_size]
        mask = torch.zeros(t, plen + t, dtype=torch.bool)
        mask[:, :plen] = True
        for i in range(t):
            j = i
            while j >= 0:
                mask[i, plen + j] = True
                j = parents[j]
        for i in rows.get(b, []) if rows is not None else range(t):
            for h in range(hq):
                kv = h // (hq // hkv)
                s = keys[:, kv] @ q[start + i, h] * p["sm_scale"]
                s[~mask[i]] = -math.inf
                out[start + i, h] = torch.softmax(s, dim=0) @ values[:, kv]
        start += t
    return out


def make_problem(seed, *, hq, hkv, dqk, dv, mla=False, page_size, prefix, trees, dtype):
    """Random tree_attention inputs: shuffled pages, random topological trees, q scaled so the
    softmax is peaky (a wrong mask bit moves the output)."""
    gen = torch.Generator().manual_seed(seed)
    parents = [
        [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)] for t in trees
    ]
    need = [-(-(plen + t) // page_size) for plen, t in zip(prefix, trees, strict=True)]
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(trees), max(need) + 2), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    words = -(-max(trees) // 32)
    mask_rows = []
    for par in parents:
        for i in range(len(par)):
            bits, j = 0, i
            while j >= 0:
                bits |= 1 << j
                j = par[j]
            row = [(bits >> (32 * w)) & 0xFFFFFFFF for w in range(words)]
            mask_rows.append([x - (1 << 32) if x >= 1 << 31 else x for x in row])
    total = sum(trees)
    return {
        "q": (3 * torch.randn(total, hq, dqk, generator=gen)).to(dtype),
        "k_cache": torch.randn(num_pages, page_size, hkv, dqk, generator=gen).to(dtype),
        "v_cache": None
        if mla
        else torch.randn(num_pages, page_size, hkv, dv, generator=gen).to(dtype),
        "block_table": table,
        "prefix_lens": torch.tensor(prefix, dtype=torch.int32),
        "qo_indptr": torch.tensor([0] + [sum(trees[: i + 1]) for i in range(len(trees))]).int(),
        "tree_mask": torch.tensor(mask_rows, dtype=torch.int32),
        "sm_scale": 1 / math.sqrt(dqk),
        "dv": dv,
        "mla": mla,
        "prefix": list(prefix),
        "parents": parents,
    }


def args(p):
    keys = ("q", "k_cache", "v_cache", "block_table", "prefix_lens", "qo_indptr", "tree_mask")
    return [p[k] for k in keys] + [p["sm_scale"]]


def run_ref(p, **kw):
    return tree_attention_reference(*args(p), v_head_dim=p["dv"] if p["mla"] else None, **kw)


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 5e-3}

# ---------------------------------------------------------------- against the oracle

FAMILIES = {
    "gqa": dict(hq=8, hkv=2, dqk=64, dv=64),
    "mha": dict(hq=4, hkv=4, dqk=32, dv=32),
    "mla": dict(hq=2, hkv=1, dqk=576, dv=512, mla=True),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_naive(family, page_size, dtype):
    seed = zlib.crc32(f"{family}/{page_size}/{dtype}".encode())
    p = make_problem(
        seed, page_size=page_size, prefix=(0, 45, 130), trees=(7, 1, 40),
        dtype=DTYPES[dtype], **FAMILIES[family],
    )  # fmt: skip
    out = run_ref(p, chunk_size=64)
    assert out.dtype == DTYPES[dtype] and out.shape == (48, FAMILIES[family]["hq"], p["dv"])
    assert rel_err(out, dense_tree_attention_naive(p)) < TOL[DTYPES[dtype]]


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    g = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    hkv, group, d = pick([1, 2, 4]), pick([1, 2, 4]), pick([16, 64, 128])
    batch = pick([1, 2, 3, 5])
    prefix = [int(torch.randint(0, 300, (1,), generator=g)) for _ in range(batch)]
    prefix[0] = 0
    trees = [int(torch.randint(1, 70, (1,), generator=g)) for _ in range(batch)]
    p = make_problem(
        seed, hq=hkv * group, hkv=hkv, dqk=d, dv=d, page_size=pick([1, 16, 64]),
        prefix=prefix, trees=trees, dtype=torch.float32,
    )  # fmt: skip
    out = run_ref(p, chunk_size=pick([1, 17, 64, 4096]))
    assert rel_err(out, dense_tree_attention_naive(p)) < TOL[torch.float32]


@pytest.mark.parametrize("family", ["gqa", "mla"])
def test_tree_1025_nodes(family):
    heads = dict(FAMILIES[family], hq=2, hkv=1 if family == "mla" else 2)
    p = make_problem(7, page_size=16, prefix=(50, 0), trees=(1025, 3), dtype=torch.float32, **heads)
    assert p["tree_mask"].shape == (1028, 33)
    out = run_ref(p, chunk_size=256)
    assert rel_err(out, dense_tree_attention_naive(p)) < TOL[torch.float32]


@pytest.mark.parametrize(
    "prefix,chunk",
    [
        (64, 32),  # prefix a multiple of the chunk: the tree starts a chunk
        (64, 64),
        (63, 32),  # a chunk straddles prefix and tree
        (100, 7),  # many chunks, tree split across chunks
        (0, 1),  # one key per chunk, no prefix
        (5, 4096),  # a single chunk holds everything
    ],
)
def test_chunk_boundaries(prefix, chunk):
    p = make_problem(
        prefix + chunk, hq=4, hkv=2, dqk=32, dv=32, page_size=16,
        prefix=(prefix, 3), trees=(20, 9), dtype=torch.float32,
    )  # fmt: skip
    out = run_ref(p, chunk_size=chunk)
    assert rel_err(out, dense_tree_attention_naive(p)) < TOL[torch.float32]
    assert torch.allclose(out, run_ref(p), rtol=0, atol=1e-5)


def test_float64_inputs_are_exact():
    p = make_problem(
        3, hq=4, hkv=1, dqk=32, dv=32, page_size=16, prefix=(33,), trees=(17,), dtype=torch.float64
    )
    out = run_ref(p, chunk_size=8)
    assert out.dtype == torch.float64
    assert rel_err(out, dense_tree_attention_naive(p)) < TOL[torch.float64]


def test_mla_equals_gqa_with_separate_v():
    p = make_problem(
        4, page_size=16, prefix=(70, 0), trees=(9, 12), dtype=torch.float32, **FAMILIES["mla"]
    )
    mla = run_ref(p)
    separate = dict(p, v_cache=p["k_cache"][..., :512].contiguous(), mla=False)
    torch.testing.assert_close(run_ref(separate), mla, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_out_written_in_place(backend):
    p = make_problem(
        5, hq=8, hkv=2, dqk=64, dv=64, page_size=1, prefix=(0, 20), trees=(6, 30),
        dtype=torch.bfloat16,
    )  # fmt: skip
    out = torch.full((36, 8, 64), math.nan, dtype=torch.bfloat16)
    returned = tree_attention(*args(p), out=out, backend=backend)
    assert returned is out
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, run_ref(p), rtol=0, atol=0)
    assert rel_err(out, dense_tree_attention_naive(p)) < TOL[torch.bfloat16]


def test_out_strided_view_written():
    p = make_problem(
        6, hq=2, hkv=2, dqk=16, dv=16, page_size=16, prefix=(10,), trees=(5,), dtype=torch.float32
    )
    base = torch.full((5, 2, 32), math.nan)
    out = base[..., ::2]  # non-contiguous
    tree_attention(*args(p), out=out, backend="torch")
    assert torch.isfinite(out).all() and base[..., 1::2].isnan().all()
    torch.testing.assert_close(out, run_ref(p))


def test_32k_prefix_1025_tree_smoke():
    """Real sizes at small head count: bounded memory and time; spot rows against the oracle."""
    p = make_problem(
        11, hq=2, hkv=1, dqk=32, dv=32, page_size=16, prefix=(32768,), trees=(1025,),
        dtype=torch.bfloat16,
    )  # fmt: skip
    start = time.perf_counter()
    out = run_ref(p)
    elapsed = time.perf_counter() - start
    assert elapsed < 30
    rows = [0, 1, 2, 511, 1000, 1024]
    ref = dense_tree_attention_naive(p, rows={0: rows})
    assert rel_err(out[rows], ref[rows]) < TOL[torch.bfloat16]
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- dispatch


def test_unknown_backend_names_backend():
    p = make_problem(
        1, hq=2, hkv=1, dqk=16, dv=16, page_size=1, prefix=(2,), trees=(2,), dtype=torch.float32
    )
    with pytest.raises(ValueError, match="backend"):
        tree_attention(*args(p), backend="flash")


def test_cuda_backend_on_cpu_tensors_is_refused():
    p = make_problem(
        1, hq=2, hkv=1, dqk=16, dv=16, page_size=1, prefix=(2,), trees=(2,), dtype=torch.float16
    )
    with pytest.raises(ValueError, match="backend: 'cuda' needs tensors on a CUDA device"):
        tree_attention(*args(p), backend="cuda")


def test_cuda_backend_unavailable_says_why(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "treeverify.kernels.cuda", None)
    with pytest.raises(RuntimeError, match="cuda backend is unavailable"):
        api.cuda_backend()
    assert not api.cuda_backend_available()
    assert api.resolve_backend("auto", torch.device("cpu"), torch.float16) == "torch"


def test_auto_resolves_to_torch_on_cpu():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert api.resolve_backend("auto", torch.device("cpu"), dtype) == "torch"


def test_plan_is_loaded_lazily():
    with pytest.raises(AttributeError, match="no_such_name"):
        kernels.no_such_name  # noqa: B018
    try:
        plan = kernels.TreeAttentionPlan
    except ModuleNotFoundError as exc:  # plan.py not written yet
        assert exc.name == "treeverify.kernels.plan"
    else:
        assert plan.__name__ == "TreeAttentionPlan"
