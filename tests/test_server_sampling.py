"""echo, prompt logprobs, penalties and logit_bias over HTTP (real `treeverify serve`
subprocesses, tiny-llama, the openai client): echoed prompt logprobs equal a full forward of the
model (chunked prefill on), max_tokens 0 with echo (lm-eval's loglikelihood request), penalties
equal the engine's, bad values are 400s naming the field, and a speculative server serves
logprobs and penalties with the plain server's tokens and values."""

from __future__ import annotations

import random

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from treeverify.engine.llm import LLM  # noqa: E402
from treeverify.engine.sampling_params import SamplingParams  # noqa: E402
from treeverify.models import TorchAttention, load_model  # noqa: E402
from treeverify.server.testing import ServerProcess  # noqa: E402

ARGS = ["--model", "tiny-llama", "--chunked-prefill-size", "7"]
SPEC = ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "8",
        "--speculative-num-draft-tokens", "4", "--no-speculative-adaptive"]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with ServerProcess(ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _prompt() -> str:
    rng = random.Random()
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    return " ".join(rng.choice(words) for _ in range(rng.randrange(4, 9)))


def _full_forward_logprobs(text: str) -> tuple[list[int], torch.Tensor]:
    _, model, tok = load_model("tiny-llama")
    ids = tok.encode(text)
    with torch.inference_mode():
        x = model(torch.tensor(ids), torch.arange(len(ids)), attention=TorchAttention())
    return ids, torch.log_softmax(x.double(), -1)  # (T, V)


def test_echo_prompt_logprobs_equal_a_full_forward(client):
    prompt = _prompt()
    ids, ref = _full_forward_logprobs(prompt)
    r = client.completions.create(model="tiny-llama", prompt=prompt, echo=True, max_tokens=0,
                                  logprobs=3, temperature=0)  # fmt: skip
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < 1e-4
        want = ref[i - 1].topk(3).values.tolist()
        got = lp.top_logprobs[i].values()  # keys may collide (same text): values of the top 3
        assert 1 <= len(got) <= 3 and all(min(abs(g - w) for w in want) < 1e-4 for g in got)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-4 for x, y in zip(a, b, strict=True))


def test_echo_with_generation_streamed_and_not(client):
    prompt = _prompt()
    kw = dict(model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    plain = client.completions.create(**kw)
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    n_prompt = len(lp.tokens) - len(plain.choices[0].logprobs.tokens)
    assert lp.tokens[n_prompt:] == plain.choices[0].logprobs.tokens
    # the echo's forward also projects the prompt rows: equal within rounding
    assert _close(lp.token_logprobs[n_prompt:], plain.choices[0].logprobs.token_logprobs)
    chunks = list(client.completions.create(**kw, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == echoed.choices[0].text
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert streamed[0] is None and _close(streamed[1:], lp.token_logprobs[1:])
    no_lp = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, echo=True)
    assert no_lp.choices[0].text.startswith(prompt) and no_lp.choices[0].logprobs is None


def test_penalties_and_logit_bias_equal_the_engine(client):
    rng = random.Random()
    prompt = _prompt()
    llm = LLM("tiny-llama")
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    boost = (first + 1 + rng.randrange(255)) % 256  # any token but the banned one
    fields = dict(presence_penalty=round(rng.uniform(-2, 2), 3),
                  frequency_penalty=round(rng.uniform(-2, 2), 3),
                  logit_bias={str(first): -100, str(boost): 5.0})  # fmt: skip
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True}, **fields)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **fields)
    out = llm.generate([prompt], sp)[0]
    assert r.choices[0].text == out.text and first not in out.token_ids


@pytest.mark.parametrize("body,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # "²".isdigit(), but no int: was a 500
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"),
])  # fmt: skip
def test_bad_values_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(server.url + "/v1/completions", timeout=30,
                    json={"prompt": "hi", "max_tokens": 2, "temperature": 0})  # fmt: skip
    assert ok.status_code == 200


def test_speculative_server_serves_logprobs_and_penalties(client):
    prompts = ["abcabcabcabcabcabc", "The capital of France is Paris. The capital of France is"]
    kw = dict(model="tiny-llama", max_tokens=20, temperature=0, logprobs=3,
              frequency_penalty=0.03, extra_body={"ignore_eos": True})  # fmt: skip
    expected = [client.completions.create(prompt=p, **kw).choices[0] for p in prompts]
    with ServerProcess(ARGS + SPEC) as spec:
        sclient = openai.OpenAI(base_url=spec.url + "/v1", api_key="none", max_retries=0)
        got = [sclient.completions.create(prompt=p, **kw).choices[0] for p in prompts]
        info = httpx.get(spec.url + "/server_info", timeout=10).json()["speculative"]
    assert info["rounds"] > 0 and info["avg_spec_accept_length"] > 1.0  # not opted out
    for g, e in zip(got, expected, strict=True):
        assert g.text == e.text and g.logprobs.tokens == e.logprobs.tokens
        for a, b in zip(g.logprobs.token_logprobs, e.logprobs.token_logprobs, strict=True):
            assert abs(a - b) < 1e-4
