"""Presence / frequency penalties and logit_bias, on the device, per request, capture-safe.

Each running request that uses them holds one row of fixed-size tables, allocated once at
startup (``max_num_seqs`` rows plus a null row of zeros for requests without processing):

    counts      (S+1, V) fp32   occurrences of each token among the request's generated tokens
    presence    (S+1,)   fp32   frequency (S+1,) fp32
    bias_ids    (S+1, K) int64  bias_values (S+1, K) fp32, K = 300; padding entries (0, 0.0)

A row is filled when its request is first processed (counts rebuilt from the tokens generated so
far, so preemption and re-admission need nothing special), grows by a scatter when tokens commit
(`commit`), and is released when the request stops running. `apply` is fixed-shape tensor code
with no host read, so it may run inside a captured graph; OpenAI's formula:

    x - (frequency * c + presence * (c > 0)) + bias

A speculative tree's node i is processed with the committed counts plus the tokens of its own
path below the root (its ancestors-or-self): the counts plain decoding would have at that token.
Those entries are recomputed with the same expression and written over the row (duplicates write
equal values), so a tree node's processed logits equal plain decoding's bit for bit.
"""

from __future__ import annotations

import torch

from treeverify.engine.sampling_params import MAX_LOGIT_BIAS
from treeverify.engine.sequence import Sequence, SequenceStatus
from treeverify.kernels.staging import to_device  # pinned: an upload never waits for the stream


def penalize(x: torch.Tensor, count: torch.Tensor, frequency: torch.Tensor,
             presence: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The one penalty expression (every caller uses it, so results agree bit for bit)."""
    return x - (frequency * count + presence * (count > 0).float())


def path_tokens(tokens: torch.Tensor, parents: torch.Tensor, max_depth: int):
    """Per node, the tokens of its ancestors-or-self below the root: (B, N, L) tokens and a
    (B, N, L) validity mask (self first, then parent, ...); roots and padding have none."""
    b, n = parents.shape
    cur = torch.arange(n, device=parents.device).expand(b, n)  # (B, N)
    toks, valid = [], []
    for _ in range(max(max_depth, 1)):
        safe = cur.clamp(min=0)
        par = parents.gather(1, safe)
        ok = (cur >= 0) & (par >= 0)  # a non-root node on the path
        toks.append(tokens.gather(1, safe))
        valid.append(ok)
        cur = torch.where(ok, par, torch.full_like(par, -1))
    return torch.stack(toks, -1), torch.stack(valid, -1)


class LogitsProcessor:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        s, self.vocab = max_num_seqs + 1, vocab_size
        self.null_row = max_num_seqs  # all zeros: leaves logits unchanged
        self.counts = torch.zeros(s, vocab_size, dtype=torch.float32, device=device)
        self.presence = torch.zeros(s, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(s, dtype=torch.float32, device=device)
        self.bias_ids = torch.zeros(s, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(s, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.device = device
        self._free = list(range(max_num_seqs))
        self._held: dict[str, list] = {}  # request id -> [seq, row, tokens counted]

    @property
    def bytes(self) -> int:
        tables = (self.counts, self.presence, self.frequency, self.bias_ids, self.bias_values)
        return sum(t.numel() * t.element_size() for t in tables)

    @staticmethod
    def needed(seqs: list[Sequence]) -> bool:
        return any(s.sampling_params.processes_logits for s in seqs)

    # ---- rows (host bookkeeping, small device writes) ------------------------------------------
    def rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """(B,) int64 table row of each sequence (the null row for those without processing)."""
        out = []
        for seq in seqs:
            if not seq.sampling_params.processes_logits:
                out.append(self.null_row)
                continue
            held = self._held.get(seq.request_id)
            out.append(held[1] if held is not None else self._take(seq))
        return to_device(torch.tensor(out, dtype=torch.int64), self.device)

    def _take(self, seq: Sequence) -> int:
        if not self._free:
            self.release_stopped()
        row = self._free.pop()
        p = seq.sampling_params
        self.counts[row].zero_()
        self._add([(row, seq.output_token_ids)])
        self.presence[row].fill_(p.presence_penalty)  # (a kernel argument: no host copy)
        self.frequency[row].fill_(p.frequency_penalty)
        ids, vals = list(p.logit_bias), list(p.logit_bias.values())
        pad = MAX_LOGIT_BIAS - len(ids)
        self.bias_ids[row] = to_device(
            torch.tensor(ids + [0] * pad, dtype=torch.int64), self.device
        )
        self.bias_values[row] = to_device(torch.tensor(vals + [0.0] * pad), self.device)
        self._held[seq.request_id] = [seq, row, seq.num_output_tokens]
        return row

    def _add(self, parts: list[tuple[int, list[int]]]) -> None:
        """Count each (row, token ids) in one scatter_add_ over the flattened table, its index
        uploaded through pinned memory: no sync (index_put_ with accumulate=True sorts with a
        host round trip on a GPU, ~8 ms a call measured on the H200: spec/ngram.py). Adding
        ones is exact in fp32 in any order."""
        flat = [row * self.vocab + t for row, ids in parts for t in ids]
        if flat:
            idx = to_device(torch.tensor(flat, dtype=torch.int64), self.device)  # (K,)
            self.counts.view(-1).scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))

    def commit(self) -> None:
        """After a step: count the tokens each running request committed (all requests in one
        scatter); release the rows of requests that stopped running (finished, aborted,
        preempted)."""
        self.release_stopped()
        parts = []
        for held in self._held.values():
            seq, row, counted = held
            if seq.num_output_tokens > counted:
                parts.append((row, seq.output_token_ids[counted:]))
                held[2] = seq.num_output_tokens
        self._add(parts)

    def release_stopped(self) -> None:
        for rid, (seq, row, _) in list(self._held.items()):
            if seq.status is not SequenceStatus.RUNNING:
                del self._held[rid]
                self._free.append(row)

    # ---- the processing (device, fixed shapes, no host read) -----------------------------------
    def apply(
        self,
        logits: torch.Tensor,  # (B, N, V): N = 1 for plain rows, tree nodes otherwise
        rows: torch.Tensor,  # (B,) int64 from `rows`
        tokens: torch.Tensor | None = None,  # (B, N) tree tokens, node 0 = the root
        parents: torch.Tensor | None = None,  # (B, N), -1 for roots and padding
        max_depth: int = 0,
    ) -> torch.Tensor:
        """Processed fp32 logits (B, N, V), a new tensor."""
        b, n, v = logits.shape
        x = logits.float()
        freq = self.frequency[rows].view(b, 1, 1)
        pres = self.presence[rows].view(b, 1, 1)
        base = self.counts[rows]  # (B, V)
        out = penalize(x, base[:, None, :], freq, pres)  # (B, N, V)
        if tokens is not None and n > 1:
            tok, valid = path_tokens(tokens, parents, max_depth)  # (B, N, L) each
            tok = tok.clamp(0, v - 1)
            same = (tok[..., :, None] == tok[..., None, :]) & valid[..., None, :]
            extra = (same & valid[..., :, None]).sum(-1).float()  # (B, N, L) on the path
            count = base.gather(1, tok.view(b, -1)).view(tok.shape) + extra
            val = penalize(x.gather(2, tok), count, freq, pres)  # (B, N, L)
            # Entries off the path repeat the first one (self, or a no-op write for roots).
            tok = torch.where(valid, tok, tok[..., :1])
            val = torch.where(valid, val, val[..., :1])
            out.scatter_(2, tok, val)
        ids = self.bias_ids[rows][:, None, :].expand(b, n, -1)  # (B, N, K)
        vals = self.bias_values[rows][:, None, :].expand(b, n, -1)
        return out.scatter_add_(2, ids, vals)
