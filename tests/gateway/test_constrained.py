"""Constrained decoding on the tiny models: structured outputs and forced tool calls.

``agent_gateway`` answers by tiny-agent's script on the untrained ``tiny``: a call of ``read`` when
it is offered after a user message, "Hello from tiny-agent." when no tool is. A grammar that
refuses a scripted token masks it as it would a model's choice, and the untrained model samples
the rest under the grammar. So what is asserted is what the grammar guarantees whatever the
weights: the schemas are bounded where a test needs the answer to end (every document the grammar
allows fits the budget), or long where it needs it cut, and what the gateway records must
reproduce under the trainer's recompute with the grammar's masks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
import torch
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.completion._request import ChatCompletionRequest
from stream_gateway.constraints import replay_masks, response_format_constraint, tool_choice_constraint
from stream_gateway.engines.transformers import end_of_turn_ids

from ..support.agent_loop import BASH_TOOL, READ_TOOL
from ..support.servers import RunningGateway
from .test_conformance import check, streamed_chunks

TOOLS = [READ_TOOL, BASH_TOOL]
# bash with a bounded command: a forced call of it ends within a few dozen tokens, whatever the
# untrained model writes in it (an unbounded string ends when the model happens to close it).
SHORT_COMMAND = {
    "type": "object",
    "properties": {"command": {"type": "string", "maxLength": 12}},
    "required": ["command"],
}
SHORT_BASH = {
    "type": "function",
    "function": {"name": "bash", "description": "Run a command", "parameters": SHORT_COMMAND},
}
BOUNDED_TOOLS = [READ_TOOL, SHORT_BASH]


class City(BaseModel):
    city: str
    population: int


class BoundedCityModel(BaseModel):
    city: str = Field(max_length=12)
    population: int = Field(ge=0, le=99_999_999)


CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True},
}


@pytest.fixture
def client(agent_gateway: RunningGateway) -> Any:
    with OpenAI(base_url=agent_gateway.base_url + "/v1", api_key="x", timeout=120, max_retries=0) as client:
        yield client


def _session_turns(gateway: RunningGateway, session_id: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session_id}", timeout=30)
    turns: list[dict[str, Any]] = response.json()["turns"]
    return turns


def test_parse_with_a_pydantic_response_format(client: OpenAI) -> None:
    # The script says hello; the grammar refuses it and the model writes the document. Bounded
    # fields: every document the grammar allows ends within the budget (12 characters of city, each
    # at worst a surrogate pair of \uXXXX escapes a character a token, 8 digits, keys: under 200).
    reply = client.chat.completions.parse(
        model="tiny-agent",
        messages=[{"role": "user", "content": "a city and its population"}],
        response_format=BoundedCityModel,
        max_tokens=200,
        seed=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, BoundedCityModel)
    assert not (choice.message.content or "").startswith("Hello")


# City with bounds the grammar enforces: every document of it ends within a few tokens.
BOUNDED_CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


def _closed(prefix: str) -> Any:
    """``prefix`` (JSON cut off anywhere) completed: its open string and containers closed, and a
    member cut before its value (a dangling key, colon or comma) left out."""
    closers, in_string, escaped = [], False, False
    for char in prefix:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]":
            closers.pop()
    text = prefix + ('"' if in_string else "")
    tail = "".join(reversed(closers))
    try:
        return json.loads(text + tail)
    except json.JSONDecodeError:  # cut after a key, its colon, or a comma: that member is not there yet
        return json.loads(re.sub(r'(?:(?<=\{)|,)\s*"(?:[^"\\]|\\.)*"\s*:?\s*$|,\s*$', "", text) + tail)


def _present_only(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without ``required`` and its strings without ``minLength``: what a document cut
    short must still satisfy."""
    properties = {
        name: {k: v for k, v in rule.items() if k != "minLength"} for name, rule in schema.get("properties", {}).items()
    }
    return {k: v for k, v in schema.items() if k != "required"} | ({"properties": properties} if properties else {})


# A document of at least 400 characters: no token of tiny's vocabulary is longer than 13
# characters, so no document of it ends within 30 tokens, whatever the model writes.
LONG_NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 400}},
    "required": ["note"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("response_format", "schema", "finish", "max_tokens"),
    [
        # Every document of the schema is longer than the budget: cut off.
        (
            {"type": "json_schema", "json_schema": {"name": "Note", "schema": LONG_NOTE, "strict": True}},
            LONG_NOTE,
            "length",
            30,
        ),
        # Bounded, the grammar closes the object within the budget and then allows only the end of the turn.
        (
            {"type": "json_schema", "json_schema": {"name": "City", "schema": BOUNDED_CITY, "strict": True}},
            BOUNDED_CITY,
            "stop",
            200,
        ),
        # One token: an object is open, never closed and ended in it (the end of the turn takes a token of its own).
        ({"type": "json_object"}, {"type": "object"}, "length", 1),
    ],
    ids=["json_schema-cut", "json_schema-bounded", "json_object-cut"],
)
def test_streamed_json_schema_and_json_object(
    agent_gateway: RunningGateway, response_format: dict[str, Any], schema: dict[str, Any], finish: str, max_tokens: int
) -> None:
    body = {
        "model": "tiny-agent",
        "messages": [{"role": "user", "content": "json please"}],
        "response_format": response_format,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    chunks = streamed_chunks(agent_gateway, body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    tokens = chunks[-1]["usage"]["completion_tokens"]
    # Unconstrained, the script says hello: the grammar refused it, and the model wrote JSON of the schema.
    assert text.startswith("{") and "<tool_call>" not in text, text
    assert finishes[-1] == finish, (finishes[-1], tokens, text)
    if finish == "stop":
        # The whole document, and it ended before the budget did.
        assert tokens < max_tokens, (tokens, text)
        document = json.loads(text)
    else:
        # Cut off: what was written is the start of a document of the schema (every member there is valid).
        assert tokens == max_tokens, (tokens, text)
        document = _closed(text)
        schema = _present_only(schema)
    jsonschema.validate(document, schema)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(agent_gateway: RunningGateway, client: OpenAI, stream: bool) -> None:
    messages = [{"role": "user", "content": "What does the README say?"}]
    free = client.chat.completions.create(model="tiny-agent", messages=messages, tools=BOUNDED_TOOLS, max_tokens=40)  # type: ignore[arg-type]
    [read] = free.choices[0].message.tool_calls or []  # the script calls read given the choice
    assert (read.function.name, json.loads(read.function.arguments)) == ("read", {"path": "README.md"})  # type: ignore[union-attr]
    only_bash = [{"type": "function", "function": {"name": "bash"}}]
    for tool_choice, names in (
        # The script's call of read is one the grammar allows: it stands, and the turn ends after it.
        ("required", {"read"}),
        # The grammar refuses read: the model writes one call of bash.
        ({"type": "function", "function": {"name": "bash"}}, {"bash"}),
        # OpenAI's allowed_tools (openai 3.57 sends it): every tool stays in the prompt, the calls are
        # narrowed to bash; with parallel_tool_calls false the grammar allows exactly one of them.
        ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": only_bash}}, {"bash"}),
    ):
        body = {
            "model": "tiny-agent",
            "messages": messages,
            "tools": BOUNDED_TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": 400,
            "seed": 11,
            "stream": stream,
            "parallel_tool_calls": not (isinstance(tool_choice, dict) and tool_choice["type"] == "allowed_tools"),
        }
        if stream:
            chunks = streamed_chunks(agent_gateway, body)
            deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
            calls = [(d["function"]["name"], d["function"]["arguments"]) for d in deltas if d.get("id")]
        else:
            answer = httpx.post(f"{agent_gateway.base_url}/v1/chat/completions", json=body, timeout=120).json()
            check(answer, "CreateChatCompletionResponse")
            finish = answer["choices"][0]["finish_reason"]
            calls = [
                (c["function"]["name"], c["function"]["arguments"])
                for c in answer["choices"][0]["message"]["tool_calls"]
            ]
        assert finish == "tool_calls", (tool_choice, calls)
        assert calls and {name for name, _ in calls} == names, (tool_choice, calls)
        if tool_choice == "required":
            assert [(name, json.loads(arguments)) for name, arguments in calls] == [("read", {"path": "README.md"})]
        if isinstance(tool_choice, dict):  # a named function; allowed_tools without parallel calls
            assert len(calls) == 1, calls
        for name, arguments in calls:
            parameters = next(t["function"]["parameters"] for t in BOUNDED_TOOLS if t["function"]["name"] == name)
            jsonschema.validate(json.loads(arguments), parameters)


def test_langchain_structured_output(agent_gateway: RunningGateway) -> None:
    # The budget and temperature on the model itself: with_structured_output drops what .bind() set
    # (langchain-openai 1.7 sent neither, so the request ran at the default temperature).
    model = ChatOpenAI(
        model="tiny-agent",
        base_url=agent_gateway.base_url + "/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
        max_tokens=256,
        temperature=0,
    )
    # by function calling: a named tool_choice; by json_schema: response_format. Bounded fields, so
    # every document the grammar allows ends within the token budget, however the model leans
    # (an unbounded string at temperature 0 ran past 48 tokens when the batch before differed).
    # The budget covers the longest: 12 characters each written as a \uXXXX escape (72 tokens at
    # worst, a character a token), 8 digits, the keys and separators and the tool call around them
    # a character a token (under 90): 96 ran out once in a full run, when the batch beside it leaned
    # the model to escapes.
    for method in ("function_calling", "json_schema"):
        structured = model.with_structured_output(BoundedCityModel, method=method, include_raw=True)
        result = structured.invoke("a city")
        # What the gateway answered and why LangChain could not read it, should it not.
        assert isinstance(result["parsed"], BoundedCityModel), (method, result["raw"], result["parsing_error"])


def test_forced_calls_hold_the_declared_arguments_only(agent_gateway: RunningGateway) -> None:
    """A schema that says nothing of other properties gets none (as OpenAI's strict mode and vLLM's
    xgrammar read it): at temperature 1.0 over several seeds, every forced call ends, with exactly
    the declared keys. Before, JSON Schema's default let a tiny model add keys until max_tokens."""
    tool = {"type": "function", "function": {"name": "BoundedCityModel",
            "parameters": BoundedCityModel.model_json_schema()}}  # fmt: skip
    for seed in range(6):
        body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "a city"}], "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "BoundedCityModel"}}, "seed": seed,
                "max_tokens": 400, "temperature": 1.0}  # fmt: skip
        answer = httpx.post(f"{agent_gateway.base_url}/v1/chat/completions", json=body, timeout=120).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (seed, choice)
        [call] = choice["message"]["tool_calls"]
        assert set(json.loads(call["function"]["arguments"])) == {"city", "population"}, (seed, call)


def test_constrained_requests_are_checked(agent_gateway: RunningGateway) -> None:
    def post(extra: dict[str, Any]) -> httpx.Response:
        body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
        return httpx.post(f"{agent_gateway.base_url}/v1/chat/completions", json=body, timeout=60)

    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": CITY_FORMAT, "tools": TOOLS, "tool_choice": "required"}, "response_format"),
    ]
    for extra, param in cases:
        response = post(extra)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (extra, error)
        check(response.json(), "ErrorResponse")


def test_constrained_logprobs_reproduce_with_the_grammar(agent_gateway: RunningGateway, agent_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(agent_model_path)
    model = AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()
    eos = end_of_turn_ids(model, tokenizer)
    vocab = model.config.vocab_size
    requests = [
        ({"response_format": CITY_FORMAT}, response_format_constraint(CITY_FORMAT)),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "bash"}}},
            None,  # built below: it needs the request's tools as the gateway parsed them
        ),
    ]
    masked_somewhere = False
    for extra, constraint in requests:
        body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "go"}], "max_tokens": 40, **extra}
        response = httpx.post(f"{agent_gateway.base_url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        [turn] = _session_turns(agent_gateway, response.headers["x-session-id"])
        if constraint is None:
            parsed = ChatCompletionRequest.model_validate(body)
            constraint = tool_choice_constraint(parsed.tool_choice, parsed.tools, tokenizer, "hermes")
        assert constraint is not None
        prompt, output, recorded = turn["prompt_ids"], turn["output_ids"], turn["logprobs"]
        masks = replay_masks(constraint.grammar, tokenizer, output, eos, vocab)
        ids = torch.tensor([prompt + output])
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        plain = torch.log_softmax(logits, -1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
        logits = logits.clone()
        logits[~torch.from_numpy(np.stack(masks))] = float("-inf")
        constrained = torch.log_softmax(logits, -1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
        # What was recorded is the masked distribution the tokens were drawn from...
        torch.testing.assert_close(constrained, torch.tensor(recorded), atol=2e-4, rtol=0)
        # ...which a plain forward pass does not give wherever the grammar ruled something out.
        masked_somewhere |= bool((plain - constrained).abs().max() > 1e-3)
    assert masked_somewhere


def test_allowed_tools_in_auto_mode_narrows_the_calls(agent_gateway: RunningGateway) -> None:
    """``mode: auto``: a text answer or calls of the allowed tools, never a call of another one.
    The script calls ``read``: its ``<tool_call>`` token (a token of its own, which text cannot
    hold) opens a call, the grammar refuses ``read``, and the model writes a call of ``bash``
    (exactly one: ``parallel_tool_calls`` is false, so nothing is left to the model's choice)."""
    only_bash = [{"type": "function", "function": {"name": "bash"}}]
    for seed in range(4):  # each seed a different draw of the model's, every one held to the grammar
        body = {"model": "tiny-agent", "messages": [{"role": "user", "content": "What does the README say?"}],
                "tools": BOUNDED_TOOLS, "max_tokens": 400, "seed": seed, "parallel_tool_calls": False,
                "tool_choice": {"type": "allowed_tools",
                                "allowed_tools": {"mode": "auto", "tools": only_bash}}}  # fmt: skip
        answer = httpx.post(f"{agent_gateway.base_url}/v1/chat/completions", json=body, timeout=120).json()
        check(answer, "CreateChatCompletionResponse")
        choice = answer["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = message.get("tool_calls") or []
        assert [call["function"]["name"] for call in calls] == ["bash"], message
        assert "<tool_call>" not in (message.get("content") or "")
    unknown = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
               "function": {"name": "nope"}}]}}  # fmt: skip
    refused = httpx.post(f"{agent_gateway.base_url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-agent", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
        "tool_choice": unknown})  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice.allowed_tools"
