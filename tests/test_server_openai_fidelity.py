"""OpenAI fidelity of a real `treeverify serve`: unimplemented fields are refused by name,
logprobs keep distinct tokens apart, max_tokens defaults to the rest of the context, chat
templates come from chat_template.jinja or --chat-template, hub ids resolve from the local cache.
"""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from treeverify.server.testing import ServerProcess  # noqa: E402

CTX = 96
MSG = [{"role": "user", "content": "world"}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model", "tiny-llama", "--context-length", str(CTX)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


REFUSED = [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"parallel_tool_calls": True}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"modalities": ["audio"]}, "modalities"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("path,extra,param", REFUSED, ids=[p for _, _, p in REFUSED])
def test_unimplemented_fields_are_400_naming_them(server, path, extra, param):
    base = {"prompt": "hi"} if "chat" not in path else {"messages": MSG}
    r = _post(server, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_message_fields_we_ignore_are_refused(server):
    """A participant `name` where the model's chat template has no place for one (tiny-llama's
    built-in format): a 400 naming it, not a name silently dropped (templates that read
    message['name'] get it: tests/test_server_text_bound.py)."""
    r = _post(server, "/v1/chat/completions", {"messages": [{**MSG[0], "name": "bob"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.name", r.text
    assert "template" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/v1/completions", {"best_of": 1, "suffix": None}),
        ("/v1/chat/completions", {"tools": [], "tool_choice": "none"}),
        ("/v1/chat/completions", {"response_format": {"type": "text"}}),
    ],
)
def test_do_nothing_values_are_accepted(server, path, extra):
    base = {"prompt": "hi"} if "chat" not in path else {"messages": MSG}
    r = _post(server, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


def test_chat_top_logprobs_needs_logprobs(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model="tiny-llama", messages=MSG, max_tokens=2, top_logprobs=2
        )


def test_logprobs_20_are_20_distinct_tokens_with_ids(client):
    prompt = "caf\u00e9 \u20ac\U0001f600 \u00fc"  # non-ASCII: byte tokens nearby
    r = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=20,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    ids = lp.model_extra["token_ids"]
    assert len(ids) == len(lp.tokens) == len(lp.top_logprobs) == 12
    assert bytes(ids).decode("utf-8", errors="replace") == r.choices[0].text  # byte vocab
    byte_keys = 0
    for chosen_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 20  # one entry per distinct token, none collapsed
        for key in top:
            if key.startswith("bytes:"):
                assert re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", key), key
                byte_keys += 1
        assert max(top.values()) == pytest.approx(chosen_lp, abs=1e-4)  # greedy: the top one
    assert byte_keys > 0  # the vocabulary's non-UTF-8 bytes are kept apart by their byte form


def test_without_max_tokens_the_reply_may_fill_the_context(client):
    r = client.completions.create(
        model="tiny-llama", prompt="Once", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == CTX - r.usage.prompt_tokens > 16


# ---- chat templates and hub ids (a tiny-llama checkpoint in a fake local HF cache) ------------
WORDS = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}


def _hf_checkpoint(directory) -> None:
    """tiny-llama written as a Hugging Face directory with a word-level tokenizer."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from treeverify.models import load_model

    cfg, model, _ = load_model("tiny-llama")
    directory.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
    }
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, str(directory / "model.safetensors"))
    tok = Tokenizer(models.WordLevel(WORDS, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    tcfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ messages[0].content }}"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tcfg))
    # transformers >= 4.43 layout: the template in its own file wins over tokenizer_config's
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}hello hello hello {{ m.content }}{% endfor %}"
    )


def _chat_prompt_tokens(srv: ServerProcess, model: str) -> int:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=model, messages=MSG, max_tokens=2, temperature=0)
    return r.usage.prompt_tokens


def test_hub_id_from_the_local_cache_with_chat_template_jinja(tmp_path):
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--treeverify-tests--tiny"
    _hf_checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with ServerProcess(["--model", "treeverify-tests/tiny"], env=env) as srv:
        models = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["treeverify-tests/tiny"]
        assert _chat_prompt_tokens(srv, "treeverify-tests/tiny") == 4  # "hello x3 world"


def test_chat_template_flag_overrides(tmp_path):
    model_dir = tmp_path / "tiny"
    _hf_checkpoint(model_dir)
    template = tmp_path / "mine.jinja"
    template.write_text("hello {{ messages[-1].content }}")
    with ServerProcess(["--model", str(model_dir), "--chat-template", str(template)]) as srv:
        assert _chat_prompt_tokens(srv, str(model_dir)) == 2
    (model_dir / "chat_template.jinja").unlink()  # no template file: tokenizer_config's
    with ServerProcess(["--model", str(model_dir)]) as srv:
        assert _chat_prompt_tokens(srv, str(model_dir)) == 1
