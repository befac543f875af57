"""Fuzz the app's OpenAPI schema (schemathesis, in-process ASGI, real tiny engine): no 5xx."""

from __future__ import annotations

import itertools

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from treeverify.server.app import create_app  # noqa: E402
from treeverify.server.engine_loop import EngineLoop  # noqa: E402

CTX = 48


@pytest.fixture(scope="module")
def engine():
    from treeverify.engine.llm import LLM

    loop = EngineLoop(LLM("tiny-llama", num_pages=64, page_size=16, max_num_seqs=16))
    loop.start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def api_schema(engine):
    app = create_app(engine, "tiny-llama", CTX, health_generate_timeout_s=10.0)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_no_server_errors(api_schema):
    """Every operation, valid and invalid inputs, bounded examples: no 5xx, no exception."""
    seen = []
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    for result, mode in itertools.product(api_schema.get_all_operations(), modes):
        op = result.ok()
        if mode is modes[1] and op.method.upper() != "POST":
            continue  # nothing to make invalid in a parameterless GET
        seen.append(op.path)

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)
            if response.status_code >= 400:
                assert response.json()["error"]["message"]

        check()
    assert {"/v1/completions", "/v1/chat/completions", "/health_generate"} <= set(seen)


def test_engine_survived_the_fuzz(engine):
    assert engine._thread.is_alive() and engine.stats.step_errors == 0
    assert engine.heartbeat_age() < 5
