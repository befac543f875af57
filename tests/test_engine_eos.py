"""Every EOS id of a Hugging Face directory stops generation: config.json's and
generation_config.json's, each an int or a list (tiny-llama written as an HF directory here)."""

from __future__ import annotations

import json
import random

import pytest

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402
from treeverify.models import load_model  # noqa: E402

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 259,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 256,
}  # fmt: skip


def _write_dir(directory, config_eos, generation_eos) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, model, _ = load_model("tiny-llama")
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**CONFIG, "eos_token_id": config_eos}))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(
            json.dumps({"eos_token_id": generation_eos})
        )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, str(directory / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({}))


def _new_positions(tokens: list[int], start: int) -> list[int]:
    """Indices from `start` on whose token did not occur before."""
    return [i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i]]


@pytest.mark.parametrize("layout", ["generation_list", "config_list", "config_int"])
def test_every_eos_id_stops(tmp_path, layout):
    rng = random.Random()
    run = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_llm = LLM("tiny-llama")
    for _ in range(50):  # a random prompt whose greedy output has two first occurrences after 2
        prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 9))]
        plain = plain_llm.generate([prompt], run)[0].token_ids
        new = _new_positions(plain, 2)
        if len(new) >= 2 and not {257, 258} & set(plain):  # those are EOS ids below too
            break
    first, second = sorted(rng.sample(new, 2))  # the earlier of two EOS ids stops it
    config_eos, generation_eos = {
        "generation_list": (257, [plain[second], plain[first]]),
        "config_list": ([258, plain[first]], None),
        "config_int": (plain[first], [257]),
    }[layout]
    d = tmp_path / "hf"
    _write_dir(d, config_eos, generation_eos)
    llm = LLM(str(d))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.token_ids == plain[: first + 1] and out.finish_reason == "stop"
    # ignore_eos generates past all of them
    assert llm.generate([prompt], run)[0].token_ids == plain
