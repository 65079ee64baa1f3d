"""OpenAI's Responses API with the official ``openai`` SDK against a real gateway.

Plain responses on the tiny model (stream and not), and a real function-call loop on the
scripted engine serving ``tiny-agent``'s answers on the untrained ``tiny`` (``agent_gateway``), both
stateless (the client sends the whole conversation as items, like Codex
with ``store: false``) and continued by ``previous_response_id``: one token-exact chain whose
logprobs a forward pass of the same untrained weights reproduces.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.embedded import EmbeddedNatsServer

from ..support.agent_loop import READ_TOOL
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway

READ = {"type": "function", **READ_TOOL["function"]}  # type: ignore[dict-item]
SEA = "Tell me about the sea."


def _client(gateway: RunningGateway, session: str | None = None) -> OpenAI:
    base = gateway.base_url + (f"/sessions/{session}" if session else "") + "/v1"
    return OpenAI(base_url=base, api_key="sk-responses", max_retries=0, timeout=120)


def test_a_response_and_its_stream_carry_the_same_tokens(gateway: RunningGateway, tiny_model_path: Path) -> None:
    with _client(gateway) as client:
        whole = client.responses.create(model="tiny", input=SEA, max_output_tokens=12, temperature=0, store=False)
        events = list(client.responses.create(model="tiny", input=SEA, max_output_tokens=12, temperature=0,
                                              stream=True))  # fmt: skip
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == "tiny"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert [item.type for item in whole.output] == ["message"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": SEA}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)  # fmt: skip
    assert whole.usage.input_tokens == len(prompt) and whole.usage.output_tokens == 12  # type: ignore[union-attr]
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    # One delta per engine step; a busy machine may coalesce all 12 tokens into one (the adaptive stream interval).
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) - 8 >= 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == 12  # type: ignore[union-attr]


def test_bad_responses_requests_are_refused_clearly(gateway: RunningGateway) -> None:
    with _client(gateway) as client:
        # Hosted tools are not offered to the model (the gateway runs none); the request is served.
        hosted = client.responses.create(model="tiny", input=SEA, max_output_tokens=2,
                                         tools=[{"type": "web_search"}, READ])  # type: ignore[list-item]  # fmt: skip
        assert [tool.type for tool in hosted.tools] == ["function"]
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="tiny", input=SEA, tools=[{"type": "web_search"}],  # type: ignore[list-item]
                                    tool_choice={"type": "function", "name": "web_search"})  # fmt: skip
        image = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/x.png"}]}]
        with pytest.raises(openai.BadRequestError, match="does not take images"):
            client.responses.create(model="tiny", input=image)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as unknown:
            client.responses.create(model="tiny", input="more", previous_response_id="resp_nope")
        assert unknown.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="gpt-nope", input=SEA)


def _respond(client: OpenAI, stream: bool, **kwargs: Any) -> Any:
    # The script decides the answer; greedy only pins what the model would sample after it.
    kwargs["temperature"] = 0
    if not stream:
        return client.responses.create(model="tiny-agent", tools=[READ], max_output_tokens=64, **kwargs)  # type: ignore[list-item]
    events = list(client.responses.create(model="tiny-agent", tools=[READ], max_output_tokens=64, stream=True,  # type: ignore[list-item]
                                          **kwargs))  # fmt: skip
    kinds = {event.type for event in events}
    response = events[-1].response
    if any(item.type == "function_call" for item in response.output):
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    return response


@pytest.mark.parametrize(("stream", "continued"), [(True, False), (False, False), (True, True)])
def test_a_function_call_loop_is_one_token_exact_chain(
    agent_gateway: RunningGateway, agent_model_path: Path, tmp_path: Path, stream: bool, continued: bool
) -> None:
    (tmp_path / "README.md").write_text("The secret word is lighthouse.\n")
    session = f"resp{secrets.token_hex(4)}"
    items: list[Any] = [{"role": "user", "content": "What does the README say?"}]
    previous: str | None = None
    with _client(agent_gateway, session) as client:
        for round_ in range(2):
            sent = items if not continued or previous is None else items[-1:]
            asked = _respond(client, stream, input=sent, instructions="You are a coding agent.", store=False,
                             **({"previous_response_id": previous} if continued and previous else {}))  # fmt: skip
            calls = [item for item in asked.output if item.type == "function_call"]
            assert [c.name for c in calls] == ["read"] and json.loads(calls[0].arguments) == {"path": "README.md"}
            # Stateless clients send the output items back as they got them, then the results.
            items += [item.model_dump(exclude_none=True) for item in asked.output]
            items += [{"type": "function_call_output", "call_id": c.call_id,
                       "output": (tmp_path / json.loads(c.arguments)["path"]).read_text()} for c in calls]  # fmt: skip
            sent = items if not continued else items[-len(calls) :]
            answer = _respond(client, stream, input=sent, instructions="You are a coding agent.", store=False,
                              **({"previous_response_id": asked.id} if continued else {}))  # fmt: skip
            assert answer.status == "completed" and answer.output_text == "Done: I read the file."
            items += [item.model_dump(exclude_none=True) for item in answer.output]
            items.append({"role": "user", "content": f"Read it again ({round_})."})
            previous = answer.id
    body = httpx.get(f"{agent_gateway.base_url}/sessions/{session}", headers={"authorization": "Bearer sk-responses"},
                     timeout=10).json()  # fmt: skip
    turns = body["turns"]
    assert len(turns) == 4
    [chain] = body["chains"]  # every echo recognised: one chain
    assert chain["turn_ids"] == [t["turn_id"] for t in turns]
    assert all(t["matches_full_render"] for t in turns)
    model = AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()
    assert_chain_logprobs(model, chain["token_ids"], chain["mask"], chain["logprobs"])


def test_allowed_tools_in_the_responses_form_narrow_the_calls(agent_gateway: RunningGateway) -> None:
    """``tool_choice: {type: allowed_tools, mode, tools: [{type: function, name}]}``, the Responses
    API's flat form (openai 3.57's ``ToolChoiceAllowed``): the script calls ``read`` given the choice;
    allowed only ``write``, the grammar refuses ``read`` and the one call (``parallel_tool_calls``
    false; its path bounded, so the untrained model's call always fits) names ``write`` with its
    declared arguments; a name that is not among the tools is a 400 naming the field."""
    path = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}
    write = {"type": "function", "name": "write", "description": "Write a file.", "parameters": path}
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "write"}]}
    with _client(agent_gateway) as client:
        free = client.responses.create(model="tiny-agent", input="What does the README say?", tools=[READ, write])
        assert [item.name for item in free.output if item.type == "function_call"] == ["read"]
        asked = client.responses.create(model="tiny-agent", input="What does the README say?", tools=[READ, write],
                                        tool_choice=allowed, parallel_tool_calls=False, max_output_tokens=64)  # type: ignore[arg-type]  # fmt: skip
        calls = [item for item in asked.output if item.type == "function_call"]
        assert asked.status == "completed" and [c.name for c in calls] == ["write"]
        assert set(json.loads(calls[0].arguments)) == {"path"}
        unknown = {**allowed, "tools": [{"type": "function", "name": "delete"}]}
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="tiny-agent", input="x", tools=[READ, write], tool_choice=unknown)  # type: ignore[arg-type]
        assert refused.value.body["param"] == "tool_choice.allowed_tools"  # type: ignore[index]


def test_a_previous_response_of_another_key_is_not_continued(gateway: RunningGateway) -> None:
    first = httpx.post(f"{gateway.base_url}/v1/responses", json={"model": "tiny", "input": SEA, "max_output_tokens": 2},
                       headers={"authorization": "Bearer key-a"}, timeout=60)  # fmt: skip
    assert first.status_code == 200, first.text
    follow = {"model": "tiny", "input": "More?", "max_output_tokens": 2, "previous_response_id": first.json()["id"]}
    same = httpx.post(f"{gateway.base_url}/v1/responses", json=follow, headers={"authorization": "Bearer key-a"},
                      timeout=60)  # fmt: skip
    other = httpx.post(f"{gateway.base_url}/v1/responses", json=follow, headers={"authorization": "Bearer key-b"},
                       timeout=60)  # fmt: skip
    assert same.status_code == 200, same.text
    assert other.status_code == 400 and other.json()["error"]["code"] == "previous_response_not_found"


def test_a_responses_turn_makes_the_events_a_chat_turn_makes(
    capture_gateway: RunningGateway,
    nats_server: EmbeddedNatsServer,
) -> None:
    """The same conversation through chat completions and Responses: the same event kinds and
    fields, the same prompt and (greedy) output ids."""
    from ..support.capture import KEY, of_session, wait_for

    prompt = [{"role": "user", "content": SEA}]
    chat_session, responses_session = f"c{secrets.token_hex(4)}", f"r{secrets.token_hex(4)}"
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "messages": prompt, "max_tokens": 8, "temperature": 0}
    url = f"{capture_gateway.base_url}/sessions/{chat_session}/v1/chat/completions"
    chat = httpx.post(url, headers=headers, json=body, timeout=60)
    assert chat.status_code == 200, chat.text
    base = f"{capture_gateway.base_url}/sessions/{responses_session}/v1"
    with OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60) as client:
        events = list(client.responses.create(model="tiny", input=SEA, max_output_tokens=8, temperature=0,
                                              stream=True))  # fmt: skip
    response = events[-1].response  # type: ignore[union-attr]
    for session in (chat_session, responses_session):
        httpx.post(f"{capture_gateway.base_url}/sessions/{session}/close", headers=headers, timeout=10)

    def both_closed(found: list[Any]) -> bool:
        sessions = (chat_session, responses_session)
        return all("session.closed" in [e.kind for e in of_session(found, s)] for s in sessions)

    stored = wait_for(nats_server.url, both_closed)
    by_protocol = [of_session(stored, s) for s in (chat_session, responses_session)]
    assert [e.kind for e in by_protocol[0]] == [e.kind for e in by_protocol[1]]
    for chat_event, responses_event in zip(*by_protocol, strict=True):
        assert type(chat_event) is type(responses_event)
        assert set(chat_event.model_dump()) == set(responses_event.model_dump())
    [chat_turn] = [e for e in by_protocol[0] if e.kind == "turn.completed"]
    [responses_turn] = [e for e in by_protocol[1] if e.kind == "turn.completed"]
    assert chat_turn.prompt_ids == responses_turn.prompt_ids  # type: ignore[attr-defined]
    assert chat_turn.output_ids == responses_turn.output_ids  # type: ignore[attr-defined]
    assert responses_turn.content == response.output_text  # type: ignore[attr-defined]


def test_a_strict_clients_fields_are_echoed_or_refused_by_name(agent_gateway: RunningGateway) -> None:
    """Issue 58: what the request asked comes back in the response object; what cannot be honoured is a 400."""
    url = f"{agent_gateway.base_url}/v1/responses"
    asked = {"model": "tiny-agent", "input": "hi", "safety_identifier": "user-7", "prompt_cache_key": "k1",
             "max_tool_calls": 3, "service_tier": "auto", "reasoning": {"effort": "low"}}  # fmt: skip
    body = httpx.post(url, json=asked, timeout=60).json()
    assert (body["safety_identifier"], body["prompt_cache_key"], body["max_tool_calls"]) == ("user-7", "k1", 3)
    assert body["reasoning"] == {"effort": "low", "summary": None}
    assert (body["background"], body["service_tier"], body["top_logprobs"]) == (False, "default", 0)
    assert body["presence_penalty"] == body["frequency_penalty"] == 0.0
    assert body["status"] == "completed" and body["completed_at"] >= body["created_at"]
    for field, value in (("background", True), ("top_logprobs", 2)):
        refused = httpx.post(url, json={"model": "tiny-agent", "input": "hi", field: value}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
