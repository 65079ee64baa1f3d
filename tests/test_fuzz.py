"""schemathesis against the gateway's own OpenAPI document (``/openapi.json``): generated requests,
valid and not, on every route; none may get a server error (5xx).

The engine is the synthetic one with a small context, so that valid requests that generate are
cheap; the HTTP layer, validation, sessions and streaming are the real ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from stream_gateway import Settings
from stream_gateway.engines import build_engine

from .servers import RunningGateway, run_gateway


@pytest.fixture(scope="module")
def fuzzed_gateway(tiny_model_path: Path) -> Iterator[RunningGateway]:
    settings_ = Settings(
        model=str(tiny_model_path),
        engine="synthetic",
        served_model_name="tiny",
        max_model_len=256,
        default_max_tokens=8,
    )
    with run_gateway(build_engine(settings_), settings_) as running:
        yield running


@pytest.fixture(scope="module")
def gateway_schema(fuzzed_gateway: RunningGateway) -> Any:
    return schemathesis.openapi.from_url(f"{fuzzed_gateway.base_url}/openapi.json")


def test_the_openapi_document_has_the_real_bodies(fuzzed_gateway: RunningGateway) -> None:
    document = httpx.get(f"{fuzzed_gateway.base_url}/openapi.json", timeout=30).json()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    fields = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "tools", "response_format", "return_token_ids"} <= set(fields)


def test_no_request_gets_a_server_error(gateway_schema: Any) -> None:
    # schemathesis's own pytest plugin does not run under this pytest; each operation's hypothesis
    # strategy is driven here instead, with its "not a server error" check.
    operations = [result.ok() for result in gateway_schema.get_all_operations()]
    assert len(operations) >= 21  # chat, token-in, Messages (+ count_tokens), Responses, sessions, admin, ...
    statuses: dict[str, set[int]] = {}
    for operation in operations:
        seen = statuses.setdefault(operation.label, set())

        @given(case=operation.as_strategy())
        @settings(
            max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
        )
        def run(case: Any) -> None:
            seen.add(case.call_and_validate(checks=[not_a_server_error], timeout=60).status_code)  # noqa: B023

        run()  # at once, so the loop variable it reads is this operation's
    # The generated requests reached the handlers: valid ones answered, invalid ones refused.
    # (Valid chat bodies are rare among generated ones: messages must satisfy per-role rules the
    # schema cannot say; valid text completions are common.)
    completions = set().union(*(codes for label, codes in statuses.items() if label.endswith("completions")))
    assert 200 in completions and 400 in completions, statuses
    for protocol in ("/v1/messages", "/v1/responses"):  # the other protocols' routes are reached too
        codes = set().union(*(c for label, c in statuses.items() if label.endswith(protocol)))
        assert codes & {200, 400, 404}, (protocol, statuses)
