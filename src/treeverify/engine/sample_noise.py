"""The uniform draws of sampled decoding: a counter-based hash of (request key, position, token).

A sampled token is the Gumbel-max of its row, `argmax(logits / T - log(-log(u)))`, with one
uniform `u` per vocabulary entry. Every path that picks a sampled token draws the same `u` for
the same (request, position): the eager sampler (engine/sampler.py), the fused step end of a
sampled decode step launched ahead (engine/decode_step_end.py) and a speculative round's lossless
acceptance (sampler.draw_nodes: a node at depth d draws what plain decoding draws d places on).
So a request's draws do not depend on its batch neighbours, on speculation or on which path
ran, and a seeded request is reproducible, on the CPU and on a GPU alike: the hash is integer
arithmetic, exact on both (the Gumbel scores built from it go through a float log, whose last
bit may differ between torch and the kernel: a token can differ only at a near-tie, as with
any change of kernel). A request's state is 32 bits (K): two unseeded requests collide at the
birthday rate (~1 in 2^32 a pair), as the per-request generator seeds before them did (31).

Until 2026-12-05 each sampled row built a torch.Generator seeded by (seed, position) and drew
with torch.rand: ~18 small kernels and a generator per row, 0.24 ms a step at b=1 and ~1.9 ms at
b=8 on the H200 (sampled plain decoding 2.3x / 6.4x slower than greedy), and nothing a captured
graph could replay, since a generator's seed is host state. A hash needs only (key, position) on
the device. The draws, all integers taken mod 2^32 and `mix` the lowbias32 finalizer (xor-shift
16, multiply 0x7FEB352D, xor-shift 15, multiply 0x846CA68B, xor-shift 16; a bijection):

    K(key)       = mix(mix(key mod 2^32) ^ (key >> 32))      per request, on the host
    S(K, pos)    = mix(K ^ pos)                              per (request, position)
    H(S, v)      = mix(S ^ mix(v + 0x9E3779B9))              per vocabulary entry v
    u            = ((H >> 9) + 0.5) / 2^23                   in (0, 1): never 0 or 1

(23 bits, so that `+ 0.5` is exact in float32: with 24 the top value would round to 1.0 and
its Gumbel term to +inf.)

`key` is the request's seed (mod 2^63), or for an unseeded request a hash of its id (random per
process). PyTorch has no 32-bit unsigned multiply, so the reference here keeps values in int64
and multiplies in 16-bit halves (no int64 overflow anywhere); the Triton kernels use uint32.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from treeverify.engine.sequence import Sequence
from treeverify.kernels.staging import to_device

M32 = 0xFFFF_FFFF
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
GOLDEN = 0x9E3779B9  # added to the token id before it is mixed (mix(0) == 0)


def mix(x: int) -> int:
    """lowbias32 on one Python int in [0, 2^32)."""
    x ^= x >> 16
    x = (x * MUL1) & M32
    x ^= x >> 15
    x = (x * MUL2) & M32
    return x ^ (x >> 16)


def request_key(seq: Sequence) -> int:
    """K of a request: its seed's, else its id's (Python's string hash: random per process)."""
    seed = seq.sampling_params.seed
    key = seed % (1 << 63) if seed is not None else hash(seq.request_id) & 0x7FFF_FFFF_FFFF_FFFF
    return mix(mix(key & M32) ^ (key >> 32))


def row_seed(k: int, position: int) -> int:
    """S of a request's draw for the token at `position` (0-based over prompt + output)."""
    return mix(k ^ (position & M32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), in 16-bit halves so nothing overflows."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M32


def mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 elementwise on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MUL2)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=8)
def _token_terms(vocab: int, device: torch.device) -> torch.Tensor:
    """mix(v + GOLDEN) for every token id v: (V,) int64, the same for every draw."""
    v = torch.arange(vocab, dtype=torch.int64, device=device)
    return mix_tensor((v + GOLDEN) & M32)


def uniform_from_seeds(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, V) float32 draws in (0, 1) for (R,) int64 row seeds S (one row per token drawn).
    On the CPU through numpy's uint32 (wrapping multiplies are defined there): ~17x faster
    than the int64 halves (136 x 8192 draws, one thread: 1.7 vs 30 ms), which had made a
    sampled DDTREE round on the CPU ~3.5x a greedy one; the same bits (tests)."""
    if seeds.device.type == "cpu":
        return _uniform_numpy(seeds, vocab)
    return _uniform_torch(seeds, vocab)


def _uniform_torch(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    terms = _token_terms(vocab, seeds.device)  # (V,)
    h = mix_tensor(seeds[:, None] ^ terms[None, :])  # (R, V)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@functools.lru_cache(maxsize=8)
def _token_terms_u32(vocab: int) -> np.ndarray:
    return _token_terms(vocab, torch.device("cpu")).numpy().astype(np.uint32)  # (V,)


def _mix_u32(x: np.ndarray) -> np.ndarray:
    """lowbias32 in place on a uint32 array (numpy's unsigned multiplies wrap mod 2^32)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(MUL1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(MUL2)
    x ^= x >> np.uint32(16)
    return x


def _uniform_numpy(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    s = seeds.detach().numpy().astype(np.uint32)  # (R,) values < 2^32: exact
    h = _mix_u32(s[:, None] ^ _token_terms_u32(vocab)[None, :])  # (R, V)
    u = (h >> np.uint32(9)).astype(np.float32)
    u += np.float32(0.5)  # exact: 23-bit integers
    u *= np.float32(1.0 / (1 << 23))
    return torch.from_numpy(u)


def uniform_noise(seeds: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """(R, V) draws for R host-side row seeds (`row_seed`), one upload."""
    return uniform_from_seeds(to_device(torch.tensor(seeds, dtype=torch.int64), device), vocab)
