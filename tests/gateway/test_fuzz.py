"""schemathesis against the gateway's own OpenAPI document (``/openapi.json``): generated requests,
valid and not, on every route; none may get a server error (5xx).

The engine is the synthetic one with a small context, so that valid requests that generate are
cheap; the HTTP layer, validation, sessions and streaming are the real ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, run_gateway
from .test_conformance import _event_schema, _strict, check


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


# The Messages and Responses routes, by the protocol path they end with.
MESSAGES, COUNT_TOKENS, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
PROTOCOL_PATHS = (COUNT_TOKENS, MESSAGES, RESPONSES)  # count_tokens first: it ends with neither other


def _protocol(path: str) -> str | None:
    return next((p for p in PROTOCOL_PATHS if path.endswith(p)), None)


def _valid_session_id(session_id: str) -> bool:
    """The gateway's rule for session ids (README, docs/http-api.md): 1-128 printable ASCII."""
    return 0 < len(session_id) <= 128 and session_id.isascii() and session_id.isprintable()


def _utf8(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except (TypeError, ValueError):
        return False
    return True


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of a named-event SSE body."""
    events, name = [], ""
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def _check_error(path: str, status: int, answer: Any) -> dict[str, Any]:
    """An error body of the route's protocol (Anthropic's on Messages routes, OpenAI's elsewhere)
    with the error type of ``status``; returns the inner error object."""
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    if _protocol(path) in (MESSAGES, COUNT_TOKENS):
        assert isinstance(answer, dict) and set(answer) == {"type", "error"} and answer["type"] == "error", answer
        error: dict[str, Any] = answer["error"]
        assert set(error) == {"type", "message"} and isinstance(error["message"], str), answer
    else:
        check(answer, "ErrorResponse")
        assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
        error = answer["error"]
    assert error["type"] == kind and error["message"], (status, answer)
    return error


def _check_answer(path: str, body: Any, status: int, content_type: str, text: str) -> None:
    """A 200 answer of the route's protocol: a whole body or its event stream, of the served model."""
    assert status == 200
    protocol = _protocol(path)
    if protocol == COUNT_TOKENS:
        answer = json.loads(text)
        assert set(answer) == {"input_tokens"} and isinstance(answer["input_tokens"], int), answer
        assert answer["input_tokens"] > 0, answer
        return
    from anthropic.types import Message, RawMessageStreamEvent

    if isinstance(body, dict) and body.get("stream") is True:
        assert content_type.startswith("text/event-stream"), content_type
        events = _events(text)
        assert events, text
        for name, event in events:
            assert name == event["type"], (name, event)
            if protocol == MESSAGES:
                _strict(RawMessageStreamEvent, event)
            else:
                check(event, _event_schema(name), "responses")
        last = events[-1][1]
        if protocol == MESSAGES:
            assert events[0][0] == "message_start" and last["type"] == "message_stop", events
        else:
            assert last["type"] in {"response.completed", "response.incomplete"}, last
            assert last["response"]["model"] == "tiny"
        return
    assert content_type.startswith("application/json"), content_type
    answer = json.loads(text)
    if protocol == MESSAGES:
        _strict(Message, answer)
    else:
        check(answer, "Response", "responses")
        assert answer["status"] in {"completed", "incomplete"}, answer
    assert answer["model"] == "tiny", answer


class _Oracle:
    """What a generated request to a Messages or Responses route calls for, from the gateway's
    published request schemas (the model enum aside) and its session id rule."""

    def __init__(self, document: dict[str, Any]) -> None:
        self._components = document["components"]
        self._bodies = {
            path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            for path, ops in document["paths"].items()
            if _protocol(path) and "post" in ops
        }

    def __call__(self, path: str, case: Any, status: int, content_type: str, text: str) -> None:
        protocol = _protocol(path)
        assert protocol is not None
        assert status in (200, 400, 404), (status, text)
        body = case.body
        session_id = unquote(case.path_parameters["session_id"]) if "{session_id}" in path else None
        schema = {"$ref": self._bodies[path], "components": self._components}
        # Well formed: JSON text (no lone surrogates) valid against the published schema once a
        # model name (a string) is "tiny".
        well_formed = (
            isinstance(body, dict)
            and _utf8(body)
            and isinstance(body.get("model"), str)
            and jsonschema.Draft202012Validator(schema).is_valid({**body, "model": "tiny"})
        )
        known_model = well_formed and body["model"] == "tiny"
        # Session routes check the id (count_tokens uses no session and ignores it).
        session_ok = session_id is None or protocol == COUNT_TOKENS or _valid_session_id(session_id)
        # On Responses, a previous response id names one this gateway holds: generated ones never do.
        previous = body.get("previous_response_id") if protocol == RESPONSES and well_formed else None
        if status == 200:
            # Only a request that is well formed, for the served model, in a valid session, answers.
            assert well_formed and known_model and session_ok and previous is None, (path, body, session_id)
            _check_answer(path, body, status, content_type, text)
            return
        error = _check_error(path, status, json.loads(text))
        if status == 400 and previous is not None:
            assert error.get("code") == "previous_response_not_found" or not known_model or not session_ok, error
        if status == 404:
            # Only an unknown model is not found, and only once the body has parsed (a malformed
            # one is a 400 first) and the session id passed.
            assert well_formed and session_ok, (path, body, session_id, error)
            assert not known_model and f"`{body['model']}`" in error["message"], (path, body, error)
            if protocol == RESPONSES:
                assert error["code"] == "model_not_found" and error["param"] == "model", error


def test_no_request_gets_a_server_error(gateway_schema: Any, fuzzed_gateway: RunningGateway) -> None:
    # schemathesis's own pytest plugin does not run under this pytest; each operation's hypothesis
    # strategy is driven here instead, with its "not a server error" check. On the Messages and
    # Responses routes, schema-breaking requests are generated too, and every answer is checked
    # against what the request calls for (_Oracle).
    oracle = _Oracle(httpx.get(f"{fuzzed_gateway.base_url}/openapi.json", timeout=30).json())
    operations = [result.ok() for result in gateway_schema.get_all_operations()]
    assert len(operations) >= 21  # chat, token-in, Messages (+ count_tokens), Responses, sessions, admin, ...
    statuses: dict[tuple[str, GenerationMode], set[int]] = {}
    for operation in operations:
        protocol = _protocol(operation.path) if operation.method.upper() == "POST" else None
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if protocol else [GenerationMode.POSITIVE]
        for mode in modes:
            seen = statuses.setdefault((operation.label, mode), set())

            @given(case=operation.as_strategy(mode))
            @settings(
                max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
            )
            def run(case: Any) -> None:
                response = case.call_and_validate(checks=[not_a_server_error], timeout=60)
                seen.add(response.status_code)  # noqa: B023
                if protocol:  # noqa: B023
                    content_type = (response.headers.get("content-type") or [""])[0]
                    oracle(operation.path, case, response.status_code, content_type, response.text)  # noqa: B023

            run()  # at once, so the loop variables it reads are this operation's
    # The generated requests reached the handlers: valid ones answered, invalid ones refused.
    # (Valid chat bodies are rare among generated ones: messages must satisfy per-role rules the
    # schema cannot say; valid text completions are common.)
    completions = set().union(*(c for (label, _), c in statuses.items() if label.endswith("completions")))
    assert 200 in completions and 400 in completions, statuses

    def codes(path: str, mode: GenerationMode) -> set[int]:
        return set().union(*(c for (label, m), c in statuses.items() if label.endswith(path) and m == mode))

    for path in PROTOCOL_PATHS:  # the other protocols' routes are reached too, both ways
        valid, broken = codes(path, GenerationMode.POSITIVE), codes(path, GenerationMode.NEGATIVE)
        assert {200, 400} <= valid, (path, statuses)
        assert 400 in broken and 200 not in broken, (path, statuses)


def _bodies(protocol: str) -> dict[str, Any]:
    """A valid body for ``protocol``'s route, and others each refused for one reason."""
    if protocol == RESPONSES:
        valid: dict[str, Any] = {"model": "tiny", "input": "Hello", "max_output_tokens": 4}
        return {
            "valid": valid,
            "missing input": {"model": "tiny"},
            "temperature out of range": {**valid, "temperature": 9},
            "max_output_tokens 0": {**valid, "max_output_tokens": 0},
            "empty input": {**valid, "input": []},
        }
    valid = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}
    if protocol == MESSAGES:
        valid["max_tokens"] = 4
    bodies = {
        "valid": valid,
        "missing messages": {k: v for k, v in valid.items() if k != "messages"},
        "no messages": {**valid, "messages": []},
        "unknown role": {**valid, "messages": [{"role": "robot", "content": "Hello"}]},
    }
    if protocol == MESSAGES:
        bodies["missing max_tokens"] = {k: v for k, v in valid.items() if k != "max_tokens"}
        bodies["max_tokens 0"] = {**valid, "max_tokens": 0}
        bodies["temperature out of range"] = {**valid, "temperature": 1.5}
    return bodies


@pytest.mark.parametrize("protocol", [MESSAGES, COUNT_TOKENS, RESPONSES])
@pytest.mark.parametrize("session", [False, True], ids=["plain", "session"])
def test_messages_and_responses_answer_as_the_input_calls_for(
    fuzzed_gateway: RunningGateway, protocol: str, session: bool
) -> None:
    path = ("/sessions/fuzz-session" if session else "") + protocol
    url = fuzzed_gateway.base_url + path

    def expect(status: int, body: Any, *, content: bytes | None = None, url: str = url) -> dict[str, Any] | None:
        if content is None:
            response = httpx.post(url, json=body, timeout=60)
        else:
            response = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == status, (path, body, content, response.text)
        content_type = response.headers.get("content-type", "")
        if status == 200:
            _check_answer(path, body, status, content_type, response.text)
            return None
        return _check_error(path, status, response.json())

    bodies = _bodies(protocol)
    valid = bodies.pop("valid")
    expect(200, valid)
    if protocol != COUNT_TOKENS:
        expect(200, {**valid, "stream": True})
    for reason, body in bodies.items():
        error = expect(400, body)
        assert error is not None, reason
    expect(400, None, content=b'{"model": "tiny", ')  # not JSON
    expect(400, None, content=b'["model", "tiny"]')  # not an object
    error = expect(404, {**valid, "model": "nope"})
    assert error is not None and "`nope`" in error["message"], error
    if protocol == RESPONSES:
        assert error["code"] == "model_not_found" and error["param"] == "model", error
        # A response this gateway does not hold: 400, as docs/http-api.md says (and OpenAI answers).
        error = expect(400, {**valid, "previous_response_id": "resp_nope"})
        assert error is not None and error["code"] == "previous_response_not_found", error
        assert error["param"] == "previous_response_id", error
    # A body that does not parse is refused before its model is looked up.
    expect(400, {**bodies[next(iter(bodies))], "model": "nope"})
    if session and protocol != COUNT_TOKENS:
        for bad in ("%C3%A9t%C3%A9", "a" * 129, "tab%09here"):
            error = expect(400, valid, url=f"{fuzzed_gateway.base_url}/sessions/{bad}{protocol}")
            assert error is not None and "session id" in error["message"], error
