"""A target whose forward does (almost) nothing, for measuring an engine's host work on the CPU.

On a GPU a plain decode step is one graph replay, so what the host does around it (scheduling,
staging, sampling, the drafter's bookkeeping) is the step's cost at small batch. On the CPU the
real forward hides that under milliseconds of matmuls; with the forward replaced by this one,
the remaining time is the host's. The logits are a fixed random row per call (sampled decoding
still draws varied tokens; greedy repeats one), the tapped hidden states the input embeddings
repeated: shapes and dtypes as the real model's, values meaningless.

    from null_model import make_null
    make_null(llm)      # after LLM(...), before generating; CPU only (a graph baked the old one)
"""

from __future__ import annotations

import torch


def make_null(llm) -> None:
    model = llm.runner.model
    if llm.device.type != "cpu":
        raise ValueError("make_null: CPU engines only (captured graphs keep the real forward)")
    vocab = model.config.vocab_size
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0))  # (V,) fp32
    taps = max(1, len(getattr(model, "capture_layers", ()) or ()))

    def forward(input_ids, positions, attention=None, logits_indices=None, token_valid=None):
        x = model.model.embed_tokens(input_ids)  # (T, hidden)
        model.captured = x.repeat(1, taps) if model.capture_layers else None  # (T, taps * hidden)
        n = input_ids.shape[0] if logits_indices is None else logits_indices.shape[0]
        return row.expand(n, vocab)  # (N, V) fp32, read-only view

    model.forward = forward
