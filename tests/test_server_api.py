"""The OpenAI API of a real `treeverify serve` subprocess (tiny-llama on CPU, loopback)."""

from __future__ import annotations

import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from treeverify.server.testing import ServerProcess  # noqa: E402

CTX = 128
PROMPTS = ["The capital of France is", "Once upon a time", "def main():", "1, 2, 3,"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model", "tiny-llama", "--context-length", str(CTX)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny-llama", prompt=prompt, **kw)


def _good(server) -> None:
    """A good request still succeeds (the server kept serving)."""
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "ok", "max_tokens": 2, "temperature": 0},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_models_lists_context_length(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]
    assert models[0].model_extra["max_model_len"] == CTX
    card = client.models.retrieve("tiny-llama")  # GET /v1/models/{id}
    assert card.id == "tiny-llama" and card.model_extra["max_model_len"] == CTX
    with pytest.raises(openai.NotFoundError, match="tiny-llama"):
        client.models.retrieve("gpt-17")


@pytest.mark.parametrize("stop", [None, ["["]])
def test_completion_stream_equals_non_stream(client, stop):
    full = _complete(client, PROMPTS[0], stop=stop)
    chunks = list(_complete(client, PROMPTS[0], stop=stop, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_stream_equals_non_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    kw = dict(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(**kw, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_sixteen_concurrent_clients_match_sequential(server, client):
    expected = {p: _complete(client, p).choices[0].text for p in PROMPTS}
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        results[i] = _complete(c, PROMPTS[i % len(PROMPTS)]).choices[0].text

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 16
    for i, text in results.items():
        assert text == expected[PROMPTS[i % len(PROMPTS)]], i


def test_usage_counts(client):
    r = _complete(client, PROMPTS[1], max_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(PROMPTS[1].encode())  # byte tokenizer
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    chunks = list(
        _complete(
            client,
            PROMPTS[1],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completion_logprobs_shape(client):
    r = _complete(client, PROMPTS[2], max_tokens=6, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset)
    for x, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert x <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) >= x - 1e-5  # greedy: the chosen token is the best


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5  # greedy picks the top one


def test_n_with_seed(client):
    kw = dict(max_tokens=6, temperature=1.0, seed=7)
    r = _complete(client, PROMPTS[0], n=3, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    again = _complete(client, PROMPTS[0], n=3, **kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    second = _complete(client, PROMPTS[0], max_tokens=6, temperature=1.0, seed=8)
    assert second.choices[0].text == r.choices[1].text  # choice j samples with seed + j
    assert r.usage.prompt_tokens == len(PROMPTS[0].encode())


def test_prompt_list_and_token_ids(client):
    r = _complete(client, PROMPTS[:2], max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1]
    ids = list(PROMPTS[0].encode())
    by_ids = _complete(client, ids, max_tokens=4)
    assert by_ids.choices[0].text == r.choices[0].text


BAD = [
    ("malformed json", b'{"prompt": "x", ', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("wrong type max_tokens", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("prompt over context", {"prompt": "y" * (CTX + 5)}, 400, "prompt"),
    ("unknown model", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("wrong type temperature", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("negative temperature", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("missing prompt", {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt", {"prompt": ""}, 400, "prompt"),
    ("token id out of vocab", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("too many logprobs", {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("n zero", {"prompt": "x", "n": 0}, 400, "n"),
    ("stop wrong type", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("empty stop string", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("seed string", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    # lone surrogates: valid JSON escapes, not text (the tokenizer raised TypeError: a 500)
    ("lone surrogate", b'{"prompt": "\\ud800abc", "max_tokens": 2}', 400, "prompt"),
    ("lone surrogate in a list", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', 400, "prompt"),
    ("lone surrogate in a message", None, 400, "messages"),
    ("negative token id", {"prompt": [5, -1]}, 400, "prompt.1"),
    # past int64: overflowed in the sampler's tensor, a step error that failed every request
    # in flight with a 500 (a new user's audit, fifty-seventh session)
    ("top_k past int64", {"prompt": "x", "top_k": 2**63}, 400, "top_k"),
    # field names that begin like pydantic's union tags ("str...", "int...") were dropped
    ("stream wrong type", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (
        "stream_options wrong type",
        {"prompt": "x", "stream": True, "stream_options": "x"},
        400,
        "stream_options",
    ),  # fmt: skip
    (
        "stream_options unknown field",
        {"prompt": "x", "stream": True, "stream_options": {"foo": 1}},
        400,
        "stream_options.foo",
    ),  # fmt: skip
    (
        "stop lone surrogate",
        b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}',
        400,
        "stop",
    ),  # fmt: skip
    ("prompt far past the context", {"prompt": "y" * (CTX * 64)}, 400, "prompt"),
]


def test_a_union_field_reports_the_telling_branch(server):
    # prompt is a string, strings, token ids or lists of ids: [-1] fails every branch; the
    # message is the token-id branch's (was the string branch's "Input should be a valid string")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [[3, -2]]}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt.0.1", err
    assert "greater than or equal to 0" in err["message"], err


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_input(server, name, body, status, param):
    url = server.url + "/v1/completions"
    if body is None:  # a chat request's (bytes: the client would not encode a lone surrogate)
        url = server.url + "/v1/chat/completions"
        body = b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], "max_tokens": 2}'
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"], err
    _good(server)


BAD_CHAT = [
    ("no messages", {"messages": []}, "messages"),
    ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (
        "top_logprobs too big",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99},
        "top_logprobs",
    ),
    (
        "max_tokens over context",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": CTX},
        "max_tokens",
    ),
    (  # the field the request sent, not max_tokens (a new user's audit)
        "max_completion_tokens over context",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": CTX},
        "max_completion_tokens",
    ),
    (  # both sent and different: one was silently dropped before
        "max_tokens and max_completion_tokens disagree",
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "max_completion_tokens": 5,
        },
        "max_completion_tokens",
    ),  # fmt: skip
    ("user message without content", {"messages": [{"role": "user"}]}, "messages.0.content"),
    (
        "tool_choice",
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
        "tool_choice",
    ),  # fmt: skip
]


@pytest.mark.parametrize("name,body,param", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_input(server, name, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err
    _good(server)


def test_chat_accepts_openai_message_fields(client, server):
    """An assistant turn without content, and max_completion_tokens equal to max_tokens:
    accepted as OpenAI accepts them."""
    r = client.chat.completions.create(
        model="tiny-llama", max_tokens=3, max_completion_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": "again"}],
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 3
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200  # load balancers


def test_a_refused_request_leaves_the_requests_in_flight_alone(server):
    """A bad sampling field is refused before the engine sees it: a long request already
    running finishes normally (top_k past int64 once failed every request in flight)."""
    body = {"prompt": "abc", "max_tokens": CTX - 10, "ignore_eos": True, "temperature": 0}
    out = {}
    long = threading.Thread(target=lambda: out.setdefault(
        "r", httpx.post(server.url + "/v1/completions", json=body, timeout=120)))  # fmt: skip
    long.start()
    time.sleep(0.2)
    bad = httpx.post(server.url + "/v1/completions",
                     json={"prompt": "x", "top_k": 2**63}, timeout=30)  # fmt: skip
    long.join(120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
    assert out["r"].status_code == 200, out["r"].text
    assert out["r"].json()["choices"][0]["finish_reason"] == "length"


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _complete(client, "x", max_tokens=CTX * 10)
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def _stats(server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()["stats"]


def test_client_disconnect_aborts_request(server):
    before = _stats(server)["aborted_requests"]
    body = {"prompt": "abc", "max_tokens": CTX - 10, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", server.url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                break  # got a token: hang up mid-stream
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        s = _stats(server)
        if s["aborted_requests"] > before and s["running"] == 0 and s["waiting"] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"request not aborted after disconnect: {s}")
    _good(server)


def test_metrics_exposes_counters(server):
    _good(server)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "treeverify_requests_total",
        "treeverify_prompt_tokens_total",
        "treeverify_generation_tokens_total",
        "treeverify_time_to_first_token_seconds",
        "treeverify_inter_token_latency_seconds",
        "treeverify_kv_cache_usage_ratio",
        "treeverify_moe_expert_imbalance",
    ):
        assert name in text, name
    assert 'endpoint="/v1/completions",status="200"' in text


def test_server_info(server):
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    assert info["attention_backend"] == "torch"
    assert info["context_length"] == CTX and info["kv_capacity_tokens"] >= CTX
    assert info["cuda_graph"]["buckets"] == [] and info["speculative"]["enabled"] is False
    assert info["stats"]["generated_tokens"] >= 0 and "version" in info
    cfg = info["engine_config"]  # the engine's resolved knobs and derived sizes
    assert cfg["model"] == "tiny-llama" and cfg["device"] == "cpu" and cfg["dtype"] == "float32"
    assert cfg["num_pages"] == info["num_pages"] and cfg["page_size"] == info["page_size"]
    assert cfg["derived"]["capacity_tokens"] == info["kv_capacity_tokens"]
    assert cfg["derived"]["tree_sizes"] == [] and cfg["speculative_algorithm"] is None
    # startup's objects frozen out of the garbage collector (a full collection over them was
    # a 125-141 ms pause on a CPU: scripts/gc_pause.py)
    assert info["startup"]["gc_frozen_objects"] > 10_000


def test_bench_serve_against_server(server, tmp_path):
    import argparse

    from treeverify.server import bench_serve

    p = argparse.ArgumentParser()
    bench_serve.add_parser(p.add_subparsers())
    out = tmp_path / "bench.json"
    args = p.parse_args(
        [
            "serve",
            "--url",
            server.url,
            "--concurrency",
            "1,2",
            "--num-requests",
            "3",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert bench_serve.run(args) == 0
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for lv in result["levels"]:
        assert lv["failures"] == 0 and lv["completed"] == 3 and lv["output_tokens"] == 12
        assert lv["ttft_s"]["p50"] > 0 and lv["itl_s"]["p99"] >= lv["itl_s"]["p50"]
