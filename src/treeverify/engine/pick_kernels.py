"""Each row's next token, greedy or sampled, in one Triton launch over chunks of the vocabulary.

A row with temperature 0 takes the argmax of its logits (a branch per program: no hashing); a row
with temperature T > 0 takes the Gumbel-max `argmax(logits / T - log(-log(u)))` with
engine/sample_noise.py's draws `u`, hashed in the kernel from the row's key K and the drawn token's
position (no noise tensor is ever written; the division rounds as IEEE's, as torch's). Top-p / top-k
rows are not taken here (they need a sort: engine/sampler.py runs them through spec/accept.py's
sample_per_node).

    chunk_pick   grid (R, ceil(V / CHUNK)): each program the best value of one chunk of a row
                 and its first index; the chunks are then reduced by the caller (a Triton
                 `finish` in engine/decode_step_end.py, or two torch ops in `pick_tokens`)

Used by a sampled decode step launched ahead (inside its captured graph) and by the sampler's
eager path on a GPU. `pick_tokens_torch` is the reference (the CPU's path, and the tests').
"""

from __future__ import annotations

import functools

import torch

from treeverify import env
from treeverify.engine.sample_noise import M32, mix_tensor, uniform_from_seeds
from treeverify.kernels.api import triton_available
from treeverify.spec.accept import sample_per_node

CHUNK = 4096  # logits a program reduces (a power of two)


def fused_picks() -> bool:
    """Whether captured graphs pick their tokens with `chunk_pick` (greedy or sampled): the
    fused step end (TREEVERIFY_FUSED_DECODE_STEP) where Triton imports. Read when an engine's
    decode-ahead and whole-round graphs are built."""
    return env.fused_decode_step() and triton_available()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_pick(L, V, stride, Temp, Key, Pos, pos_offset, PV, PI, NC,
                   BLOCK: tl.constexpr, SAMPLED: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
        x = tl.load(L + r * stride + cols, mask=cols < V, other=float("-inf"))
        t = 0.0
        if SAMPLED:
            t = tl.load(Temp + r)
        if t > 0:  # (a greedy row of a sampled-capable graph: its argmax, no hashing)
            k = (tl.load(Key + r) & 0xFFFFFFFF).to(tl.uint32)  # K < 2^32
            p = ((tl.load(Pos + r) + pos_offset) & 0xFFFFFFFF).to(tl.uint32)
            m1 = tl.full((BLOCK,), 0x7FEB352D, tl.uint32)  # lowbias32's multipliers
            m2 = tl.full((BLOCK,), 0x846CA68B, tl.uint32)
            # (lowbias32 written out three times: a jit helper defined in this factory is not
            # visible to the kernel) S = mix(K ^ position), all lanes alike
            s = tl.full((BLOCK,), 0, tl.uint32) + (k ^ p)
            s = s ^ (s >> 16)
            s = s * m1
            s = s ^ (s >> 15)
            s = s * m2
            s = s ^ (s >> 16)
            t_v = cols.to(tl.uint32) + tl.full((BLOCK,), 0x9E3779B9, tl.uint32)  # mix(v + GOLDEN)
            t_v = t_v ^ (t_v >> 16)
            t_v = t_v * m1
            t_v = t_v ^ (t_v >> 15)
            t_v = t_v * m2
            t_v = t_v ^ (t_v >> 16)
            h = s ^ t_v  # H = mix(S ^ mix(v + GOLDEN))
            h = h ^ (h >> 16)
            h = h * m1
            h = h ^ (h >> 15)
            h = h * m2
            h = h ^ (h >> 16)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # (0, 1), exact
            g = -tl.log(-tl.log(u))
            x = tl.math.div_rn(x, tl.zeros_like(x) + t) + g  # IEEE division, as torch's
            x = tl.where(cols < V, x, float("-inf"))
        best = tl.max(x, axis=0)
        first = tl.min(tl.where(x == best, cols, V), axis=0)  # the first index of the max
        first = tl.minimum(first, V - 1)  # (a NaN row: some index, never out of range)
        tl.store(PV + r * NC + c, best)
        tl.store(PI + r * NC + c, first.to(tl.int64))

    return chunk_pick


def chunk_picks(logits: torch.Tensor, temps: torch.Tensor | None, keys: torch.Tensor | None,
                positions: torch.Tensor | None, pos_offset: int = 0,
                chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each chunk's best value and first index, (R, nc) fp32 and int64, of logits (R, V) fp32;
    temps (R,) fp32, keys (R,) int64 and positions (R,) int64 (+ pos_offset: the drawn token's
    position) on the same device, or all None for greedy rows only. Capture-safe."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected unit column stride, got {logits.stride()}")
    sampled = temps is not None
    if sampled and not (temps.shape[0] >= n and keys.shape[0] >= n and positions.shape[0] >= n):
        raise ValueError(f"temps/keys/positions: expected >= {n} rows each")
    nc = -(-vocab // chunk)
    part_v = torch.empty(n, nc, dtype=torch.float32, device=logits.device)  # (R, nc)
    part_i = torch.empty(n, nc, dtype=torch.int64, device=logits.device)  # (R, nc)
    dummy = part_i  # (unread when not sampled)
    _kernels()[(n, nc)](logits, vocab, logits.stride(0), temps if sampled else dummy,
                        keys if sampled else dummy, positions if sampled else dummy,
                        pos_offset, part_v, part_i, nc, BLOCK=chunk,
                        SAMPLED=sampled)  # fmt: skip
    return part_v, part_i


def pick_tokens(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor,
                positions: torch.Tensor, chunk: int = CHUNK,
                pos_offset: int = 0) -> torch.Tensor:  # fmt: skip
    """(R,) int64 tokens of logits (R, V) fp32 (row r draws for position positions[r] +
    pos_offset): one Triton launch, then the chunks' reduction (the first chunk holding the
    row's best: torch.argmax keeps the first). Capture-safe."""
    part_v, part_i = chunk_picks(logits, temps, keys, positions, pos_offset, chunk)
    return part_i.gather(1, part_v.argmax(1, keepdim=True))[:, 0]  # (R,)


def pick_tokens_torch(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor,
                      positions: torch.Tensor, pos_offset: int = 0) -> torch.Tensor:  # fmt: skip
    """The reference in PyTorch ops: the same tokens as `pick_tokens` (up to float rounding of
    the Gumbel terms): spec/accept.py's sample_per_node over the same draws (greedy rows their
    argmax). Capture-safe; it hashes every row (a CPU's eager step, the tests)."""
    seeds = mix_tensor(keys ^ ((positions + pos_offset) & M32))  # (R,) S
    u = uniform_from_seeds(seeds, logits.shape[-1])  # (R, V)
    return sample_per_node(logits[:, None, :], temps, noise=u[:, None, :])[:, 0]
