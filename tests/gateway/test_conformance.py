"""What strict clients need: OpenAI's published schemas, nullable and spec-defined fields, the
legacy ``functions`` shape, and LangChain's per-chunk view of streamed tool calls.

Every response body, stream chunk and error body here is validated against OpenAI's own schemas
(``tests/gateway/openai_spec``), read with OpenAPI 3.0's ``nullable: true`` as "or null".
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from langchain_openai import ChatOpenAI
from PIL import Image

from stream_gateway.engines import build_engine

from ..support.agent_loop import READ_TOOL
from ..support.servers import RunningGateway, run_gateway, scripted_settings

SPECS = Path(__file__).parent / "openai_spec"


def _with_nulls(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` as JSON Schema's "or null"."""
    if isinstance(node, list):
        return [_with_nulls(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _with_nulls(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def _document(spec: str = "chat-completions") -> dict[str, Any]:
    document: dict[str, Any] = _with_nulls(json.loads((SPECS / f"{spec}.schemas.json").read_text()))
    if spec == "responses":
        # OpenAI's extract gives `usage` no null, yet its API and the Open Responses schema send
        # `usage: null` until a response ends (response.created, response.in_progress): read as such.
        response = document["components"]["schemas"]["Response"]["allOf"][-1]["properties"]
        response["usage"] = {"anyOf": [response["usage"], {"type": "null"}]}
    return document


@cache
def _open_responses() -> dict[str, Any]:
    """What the Open Responses schema requires of a response object beyond OpenAI's (issue 58)."""
    return json.loads((SPECS / "open-responses-required.json").read_text())  # type: ignore[no-any-return]


def check_response(instance: Any) -> None:
    """A response object as OpenAI's schema and the Open Responses schema's required fields want it."""
    check(instance, "Response", "responses")
    jsonschema.Draft202012Validator(_open_responses()).validate(instance)


def check(instance: Any, schema: str, spec: str = "chat-completions") -> None:
    """Raise if ``instance`` is not a valid ``schema`` of OpenAI's spec (``spec``: which extract)."""
    document = _document(spec)
    root = {"$ref": f"#/components/schemas/{schema}", "components": document["components"]}
    jsonschema.Draft202012Validator(root).validate(instance)


def request_fields() -> set[str]:
    """Every top-level field OpenAI defines for ``POST /v1/chat/completions``."""
    schemas = _document()["components"]["schemas"]

    def fields(name: str) -> set[str]:
        schema = schemas[name]
        out: set[str] = set()
        for part in schema.get("allOf", [schema]):
            if "$ref" in part:
                out |= fields(part["$ref"].rsplit("/", 1)[-1])
            out |= set(part.get("properties", {}))
        return out

    return fields("CreateChatCompletionRequest")


def sse_chunks(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def streamed_chunks(gateway: RunningGateway, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed answer to ``body``, each checked against the spec's chunk schema."""
    url = f"{gateway.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        chunks = list(sse_chunks(response))
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")
    return chunks


def post(gateway: RunningGateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=120)


LOOK = [{"role": "user", "content": "look"}]


def test_streamed_and_whole_answers_match_the_spec(agent_gateway: RunningGateway) -> None:
    body = {"model": "tiny-agent", "messages": LOOK, "tools": [READ_TOOL], "logprobs": True, "top_logprobs": 2}
    whole = post(agent_gateway, body)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    check(answer, "CreateChatCompletionResponse")
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = streamed_chunks(agent_gateway, stream_body)
    with_logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert with_logprobs and all(lp["refusal"] is None for lp in with_logprobs)
    assert chunks[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]


def test_errors_match_the_spec(gateway: RunningGateway) -> None:
    bad = [
        ({"model": "tiny", "messages": []}, 400),
        ({"model": "tiny", "messages": LOOK, "temperature": 9}, 400),
        ({"model": "nope", "messages": LOOK}, 404),
        ({"model": "tiny", "messages": LOOK, "frobnicate": 1}, 400),
        ({"model": "tiny", "messages": LOOK, "audio": {"voice": "alloy", "format": "wav"}}, 400),
    ]
    for body, status in bad:
        response = post(gateway, body)
        assert response.status_code == status, (body, response.text)
        check(response.json(), "ErrorResponse")


def test_null_means_not_given(gateway: RunningGateway) -> None:
    nulls = {
        name: None
        for name in request_fields() - {"model", "messages"}
        # null where the spec does not allow it either (strict clients do not send these)
        if name not in {"user", "functions", "function_call"}
    }
    response = post(gateway, {"model": "tiny", "messages": LOOK, "max_completion_tokens": 4, **nulls})
    assert response.status_code == 200, response.text
    answer = response.json()
    check(answer, "CreateChatCompletionResponse")
    assert len(answer["choices"]) == 1 and answer["choices"][0]["logprobs"] is None  # n, logprobs: the defaults
    streamed = post(gateway, {"model": "tiny", "messages": LOOK, "max_tokens": 4, "stream": None, "n": None})
    assert streamed.status_code == 200 and streamed.json()["object"] == "chat.completion"


# A non-null value of every field OpenAI defines that the other tests do not already send.
SPEC_VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [READ_TOOL["function"]],
    "logit_bias": {"42": 5},
    "logprobs": True,
    "max_completion_tokens": 4,
    "max_tokens": 4,
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "n": 2,
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "a prediction"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "auto"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "text"},
    "safety_identifier": "s",
    "seed": 3,
    "service_tier": "auto",
    "stop": ["\n\n"],
    "store": False,
    "stream": False,
    "stream_options": None,
    "temperature": 0.5,
    "tool_choice": "auto",
    "tools": [READ_TOOL],
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "u",
    "verbosity": "low",
    "web_search_options": {},
}


# The spec fields the gateway refuses by name (400, ``unsupported_parameter``); it honours the rest.
UNSUPPORTED = {
    "audio",
    "frequency_penalty",
    "logit_bias",
    "modalities",
    "moderation",
    "presence_penalty",
    "web_search_options",
}


def test_every_spec_field_is_known(gateway: RunningGateway) -> None:
    fields = request_fields() - {"model", "messages"}
    assert fields <= set(SPEC_VALUES), f"fields new to the spec: {sorted(fields - set(SPEC_VALUES))}"
    assert fields >= UNSUPPORTED
    for name in sorted(fields):
        body = {"model": "tiny", "messages": LOOK, "max_tokens": 4, name: SPEC_VALUES[name]}
        if name == "top_logprobs":
            body["logprobs"] = True
        if name == "tool_choice":
            body["tools"] = [READ_TOOL]
        if name == "function_call":
            body["functions"] = [READ_TOOL["function"]]
        response = post(gateway, body)
        if name in UNSUPPORTED:
            # Refused by name, in OpenAI's error shape: not an "unrecognized" field, not a 200.
            assert response.status_code == 400, (name, response.status_code, response.text)
            check(response.json(), "ErrorResponse")
            error = response.json()["error"]
            assert "Unrecognized" not in error["message"], (name, error)
            assert error["type"] == "invalid_request_error", (name, error)
            assert error["code"] == "unsupported_parameter" and error["param"] == name, (name, error)
            continue
        # Honoured: a whole chat completion of OpenAI's schema that did what the body asked.
        assert response.status_code == 200, (name, response.status_code, response.text)
        answer = response.json()
        check(answer, "CreateChatCompletionResponse")
        assert answer["object"] == "chat.completion" and answer["model"] == "tiny", (name, answer)
        choices = answer["choices"]
        n = body.get("n", 1)
        assert [c["index"] for c in choices] == list(range(n)), (name, answer)
        usage = answer["usage"]
        assert 1 <= usage["completion_tokens"] <= 4 * n, (name, usage)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], (name, usage)
        for choice in choices:
            assert choice["finish_reason"] in {"stop", "length", "tool_calls", "function_call"}, (name, choice)
            assert choice["message"]["role"] == "assistant", (name, choice)
            logprobs = choice["logprobs"]
            if body.get("logprobs"):
                assert logprobs is not None and 1 <= len(logprobs["content"]) <= 4, (name, choice)
                tops = {len(entry["top_logprobs"]) for entry in logprobs["content"]}
                assert tops == {body.get("top_logprobs") or 0}, (name, choice)
            else:
                assert logprobs is None, (name, choice)


def test_legacy_functions_round_trip(agent_gateway: RunningGateway) -> None:
    base = {"model": "tiny-agent", "messages": LOOK, "functions": [READ_TOOL["function"]]}
    whole = post(agent_gateway, base)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    check(answer, "CreateChatCompletionResponse")
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "function_call"
    message = choice["message"]
    assert "tool_calls" not in message and message["content"] is None
    assert message["function_call"]["name"] == "read"
    assert json.loads(message["function_call"]["arguments"]) == {"path": "README.md"}
    session = whole.headers["x-session-id"]

    # The client sends the legacy history back: the next turn continues the first one's tokens.
    history = [*LOOK, message, {"role": "function", "name": "read", "content": "# stream-gateway"}]
    follow = post(agent_gateway, {**base, "messages": history})
    assert follow.status_code == 200, follow.text
    assert follow.headers["x-session-id"] == session
    turns = httpx.get(f"{agent_gateway.base_url}/sessions/{session}", timeout=30).json()["turns"]
    assert turns[-1]["parent_id"] == turns[0]["turn_id"]
    assert turns[-1]["reused_prompt_tokens"] > 0

    chunks = streamed_chunks(agent_gateway, base)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any("tool_calls" in d for d in deltas)
    calls = [d["function_call"] for d in deltas if "function_call" in d]
    assert calls[0]["name"] == "read" and all("name" not in c for c in calls[1:])
    assert json.loads("".join(c["arguments"] for c in calls)) == {"path": "README.md"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "function_call"


def test_legacy_functions_are_checked(gateway: RunningGateway) -> None:
    both = post(
        gateway, {"model": "tiny", "messages": LOOK, "functions": [READ_TOOL["function"]], "tools": [READ_TOOL]}
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "functions"
    alone = post(gateway, {"model": "tiny", "messages": LOOK, "function_call": "auto"})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "function_call"
    custom = post(gateway, {"model": "tiny", "messages": LOOK, "tools": [{"type": "custom", "custom": {"name": "x"}}]})
    assert custom.status_code == 400
    assert custom.json()["error"]["code"] == "unsupported_parameter"


def test_langchain_sees_one_tool_call_per_chunk(agent_gateway: RunningGateway) -> None:
    model = ChatOpenAI(
        model="tiny-agent", base_url=agent_gateway.base_url + "/v1", api_key="x", max_retries=0, timeout=120
    ).bind_tools([READ_TOOL])
    chunks = list(model.stream("look"))
    for chunk in chunks:
        # LangChain parses every entry of a chunk on its own: a second entry for the same call
        # would show up here as a nameless tool call or an invalid one.
        assert all(call["name"] for call in chunk.tool_calls), chunk
        assert not chunk.invalid_tool_calls, chunk
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("read", {"path": "README.md"})]
    assert not whole.invalid_tool_calls


def test_filtered_alternatives_are_numbers(gateway: RunningGateway) -> None:
    # top_k 1 leaves one token: the other alternatives were filtered out (-inf internally).
    body = {"model": "tiny", "messages": LOOK, "max_tokens": 3, "logprobs": True, "top_logprobs": 3, "top_k": 1}
    answer = post(gateway, body).json()
    check(answer, "CreateChatCompletionResponse")
    for entry in answer["choices"][0]["logprobs"]["content"]:
        assert [alt["logprob"] for alt in entry["top_logprobs"]][1:] == [-9999.0, -9999.0]
    assert streamed_chunks(gateway, body)


def _sse_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of a named-event SSE stream (Responses, Messages)."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name or "", json.loads(line[6:])))
    return events


def _event_schema(event_type: str) -> str:
    """The ``ResponseStreamEvent`` member for ``event_type`` (clearer errors than the whole anyOf)."""
    schemas = _document("responses")["components"]["schemas"]
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[-1]
        kind = schemas[name].get("properties", {}).get("type", {})
        if event_type in kind.get("enum", ()) or kind.get("const") == event_type:
            return str(name)
    raise AssertionError(f"{event_type!r} is not a Responses stream event")


RESPONSES_TOOL = {"type": "function", **READ_TOOL["function"]}  # type: ignore[dict-item]


@pytest.fixture(scope="module")
def vl_gateway(vl_model_path: Path) -> Iterator[RunningGateway]:
    """The scripted engine on tiny-vl-untrained: it names an image's colour."""
    settings = scripted_settings(vl_model_path, "tiny-vl")
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _red_png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (220, 40, 40)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_responses_bodies_and_events_match_openais_schemas(
    gateway: RunningGateway, agent_gateway: RunningGateway, vl_gateway: RunningGateway
) -> None:
    """Plain text on the tiny model; a system prompt; a function call by tiny-agent's script, and the
    turn after its result (multi-turn); an image: bodies, events, errors."""
    after_call = [
        {"role": "user", "content": "What does the README say?"},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path": "README.md"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "# A project"},
    ]
    image = [{"role": "user", "content": [{"type": "input_text", "text": "Colour?"},
                                          {"type": "input_image", "image_url": _red_png()}]}]  # fmt: skip
    cases = [
        (agent_gateway, {"model": "tiny-agent", "input": after_call, "tools": [RESPONSES_TOOL]}),
        (vl_gateway, {"model": "tiny-vl", "input": image}),
        (gateway, {"model": "tiny", "input": "Hello", "max_output_tokens": 6}),
        (
            gateway,
            {
                "model": "tiny",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                "instructions": "Be brief.",
                "max_output_tokens": 40,
                "temperature": 0,
            },
        ),
        (agent_gateway, {"model": "tiny-agent", "input": "What does the README say?", "tools": [RESPONSES_TOOL]}),
    ]
    kinds: set[str] = set()
    for target, body in cases:
        whole = httpx.post(f"{target.base_url}/v1/responses", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        check_response(whole.json())
        assert whole.json()["completed_at"] is not None or whole.json()["status"] == "incomplete"
        with httpx.stream("POST", f"{target.base_url}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
            events = _sse_events(r)
        for name, event in events:
            assert name == event["type"]
            check(event, _event_schema(name), "responses")
            if "response" in event:  # created, in_progress, completed, incomplete: the whole object
                check_response(event["response"])
            kinds.add(name)
        assert [e["response"]["usage"] for n, e in events if n in ("response.created", "response.in_progress")] == [
            None,
            None,
        ]
        check_response(events[-1][1]["response"])
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_text.delta", "response.completed", "response.incomplete"} <= kinds  # fmt: skip
    refused = httpx.post(f"{gateway.base_url}/v1/responses", json={"model": "tiny", "input": []}, timeout=30)
    assert refused.status_code == 400
    check(refused.json(), "ErrorResponse")


def _strict(model: Any, data: Any) -> None:
    """``data`` validates as the SDK model, and holds no field the SDK does not know (recursively)."""
    from pydantic import BaseModel, TypeAdapter

    value = TypeAdapter(model).validate_python(data)

    def walk(node: Any, path: str) -> None:
        if isinstance(node, BaseModel):
            assert not node.model_extra, f"{path}: fields the SDK does not know: {sorted(node.model_extra)}"
            for name in type(node).model_fields:
                walk(getattr(node, name), f"{path}.{name}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")

    walk(value, type(value).__name__)


def test_messages_bodies_and_events_match_anthropics_sdk_types(
    gateway: RunningGateway, agent_gateway: RunningGateway
) -> None:
    from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent

    read = {"name": "read", "description": "Read a file", "input_schema": READ_TOOL["function"]["parameters"]}  # type: ignore[index]
    cases = [
        (gateway, {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "Hello"}]}),
        (
            agent_gateway,
            {
                "model": "tiny-agent",
                "max_tokens": 64,
                "tools": [read],
                "messages": [{"role": "user", "content": "What does the README say?"}],
            },
        ),
    ]
    kinds: set[str] = set()
    for target, body in cases:
        whole = httpx.post(f"{target.base_url}/v1/messages", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        _strict(Message, whole.json())
        with httpx.stream("POST", f"{target.base_url}/v1/messages", json={**body, "stream": True}, timeout=120) as r:
            events = _sse_events(r)
        for name, event in events:
            assert name == event["type"]
            _strict(RawMessageStreamEvent, event)
            kinds.add(name + (":" + event["delta"]["type"] if name == "content_block_delta" else ""))
        count = httpx.post(f"{target.base_url}/v1/messages/count_tokens", json={k: v for k, v in body.items()
                           if k != "max_tokens"}, timeout=30)  # fmt: skip
        _strict(MessageTokensCount, count.json())
    assert {"content_block_delta:text_delta", "content_block_delta:input_json_delta", "message_delta"} <= kinds
    error = httpx.post(f"{gateway.base_url}/v1/messages", json={"model": "tiny"}, timeout=30)
    assert error.status_code == 400
    assert set(error.json()) == {"type", "error"} and set(error.json()["error"]) == {"type", "message"}
