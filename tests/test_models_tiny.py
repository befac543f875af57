"""Tiny built-in models are deterministic; the byte tokenizer round-trips; the flat batch is
batching-invariant (a request's logits do not depend on its neighbours)."""

from __future__ import annotations

import pytest
import torch

from treeverify.models import ByteTokenizer, TorchAttention, load_model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-kimi"])
def test_tiny_models_deterministic(name):
    ids = torch.tensor([256, 104, 105, 33])
    pos = torch.arange(4)
    with torch.no_grad():
        a = load_model(name)[1](ids, pos)
        b = load_model(name)[1](ids, pos)
        c = load_model(name, seed=1)[1](ids, pos)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert a.shape == (4, 259) and a.dtype == torch.float32


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-kimi"])
def test_flat_batch_invariance(name):
    _, model, tok = load_model(name)
    seqs = [tok.encode("first request", add_bos=True), tok.encode("2nd", add_bos=True)]
    with torch.no_grad():
        alone = [model(torch.tensor(s), torch.arange(len(s))) for s in seqs]
        both = model(
            torch.tensor(seqs[0] + seqs[1]),
            torch.cat([torch.arange(len(s)) for s in seqs]),
            attention=TorchAttention([len(s) for s in seqs]),
        )
        last = model(torch.tensor(seqs[0]), torch.arange(len(seqs[0])),
                     logits_indices=torch.tensor([len(seqs[0]) - 1]))  # fmt: skip
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last[0], alone[0][-1])


def test_tiny_bf16_builds():
    _, model, _ = load_model("tiny-kimi", dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router kept fp32
    with torch.no_grad():
        out = model(torch.tensor([256, 65, 66]), torch.arange(3))
    assert torch.isfinite(out).all()


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in ["", "hello", "héllo wörld ✓ 🌳", "line\nbreak\ttab\x00nul"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, add_bos=True) + [tok.eos_token_id]) == text
    assert tok.encode("a", add_bos=True) == [256, 97]
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<|bos|>hi<|eos|>"
    assert tok.eos_token_ids == [257] and tok.pad_token_id == 258 and tok.vocab_size == 259
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi\n<|assistant|>\n"
    assert tok.decode(tok.encode(text)) == text


def test_unknown_name():
    with pytest.raises(FileNotFoundError, match="tiny-nope"):
        load_model("tiny-nope")
