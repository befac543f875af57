"""The draws of sampled decoding (engine/sample_noise.py): the tensor hash equals its one-value
definition, the draws are uniform and independent across tokens, positions and requests, and a
token drawn from them follows the softmax (so sampled decoding stays an exact sample)."""

from __future__ import annotations

import math

import torch

from treeverify.engine.pick_kernels import pick_tokens_torch
from treeverify.engine.sample_noise import (
    GOLDEN,
    M32,
    mix,
    mix_tensor,
    request_key,
    row_seed,
    uniform_from_seeds,
    uniform_noise,
)
from treeverify.engine.sampling_params import SamplingParams
from treeverify.engine.sequence import Sequence


def test_tensor_hash_equals_the_scalar_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randint(0, 2**32, (500,), generator=g, dtype=torch.int64),
                   torch.tensor([0, 1, M32, 2**31, 2**31 - 1])])  # fmt: skip
    assert mix_tensor(x).tolist() == [mix(int(v)) for v in x]
    seeds = [row_seed(request_key(_seq(s)), q) for s, q in ((7, 0), (7, 1), (2**62 + 5, 99))]
    u = uniform_noise(seeds, 300, torch.device("cpu"))  # (3, 300)
    for r, s in enumerate(seeds):
        for v in (0, 1, 150, 299):
            h = mix(s ^ mix((v + GOLDEN) & M32))
            assert u[r, v].item() == ((h >> 9) + 0.5) / 2**23  # exact in float32


def test_cpu_draws_equal_the_tensor_hash():
    # the CPU's numpy uint32 path and the int64 path other devices take: the same bits
    from treeverify.engine.sample_noise import _uniform_numpy, _uniform_torch

    g = torch.Generator().manual_seed(1)
    seeds = torch.cat([torch.randint(0, 2**32, (37,), generator=g, dtype=torch.int64),
                       torch.tensor([0, M32, 2**31])])  # fmt: skip
    a, b = _uniform_numpy(seeds, 1000), _uniform_torch(seeds, 1000)  # (40, 1000)
    assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert torch.equal(uniform_from_seeds(seeds, 1000), a)


def _seq(seed: int | None, rid: str = "r") -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(temperature=1.0, seed=seed))


def test_draws_are_uniform_and_independent():
    seeds = torch.tensor([row_seed(mix(k), q) for k in range(4) for q in range(64)])
    u = uniform_from_seeds(seeds, 4096)  # (256, 4096)
    assert u.min() > 0 and u.max() < 1
    top = uniform_from_seeds(torch.tensor([0]), 1)  # the extremes stay inside (0, 1)
    assert ((M32 >> 9) + 0.5) / 2**23 < 1 and top.item() < 1
    assert abs(u.mean().item() - 0.5) < 2e-3  # sd of the mean ~ 0.29 / 1024
    hist = torch.histc(u, bins=32, min=0, max=1)
    expect = u.numel() / 32
    chi2 = ((hist - expect) ** 2 / expect).sum().item()
    assert chi2 < 80  # 31 degrees of freedom: p ~ 1e-6
    flat = u - 0.5
    for a, b in ((flat[:, :-1], flat[:, 1:]), (flat[:-1], flat[1:]), (flat[:64], flat[64:128])):
        corr = (a * b).mean().item() / (1 / 12)  # neighbours: tokens, positions, requests
        assert abs(corr) < 0.01


def test_a_seed_repeats_and_requests_differ():
    a, b = request_key(_seq(11, "x")), request_key(_seq(11, "y"))
    assert a == b  # the seed, not the id, keys a seeded request
    assert request_key(_seq(12)) != a
    assert request_key(_seq(None, "x")) != request_key(_seq(None, "y"))


def test_drawn_tokens_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temp = 0.8
    n = 20000
    rows = logits.expand(n, -1).contiguous()  # (n, 6)
    positions = torch.arange(n, dtype=torch.int64)
    keys = torch.full((n,), request_key(_seq(3)), dtype=torch.int64)
    toks = pick_tokens_torch(rows, torch.full((n,), temp), keys, positions)
    counts = torch.bincount(toks, minlength=6).double()
    p = torch.softmax(logits.double() / temp, -1)
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 25, (counts / n, p)  # 5 degrees of freedom: p ~ 1e-4
    assert math.isclose(counts[0].item() / n, p[0].item(), abs_tol=0.015)
