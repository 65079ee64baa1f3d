"""Anthropic's Messages API with the official ``anthropic`` SDK against a real gateway.

Plain turns on the tiny model (stream and not, count_tokens, stop sequences, errors), and a real
tool loop on ``tiny-agent``'s answers (the scripted engine on the untrained ``tiny``,
``agent_gateway``): the model calls ``read``, the client runs it and echoes the turn back in
Anthropic's form (``tool_use`` / ``tool_result`` blocks), and the whole conversation is one
token-exact chain whose logprobs a forward pass of the same untrained weights reproduces.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.embedded import EmbeddedNatsServer

from ..support.agent_loop import READ_TOOL
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway

READ = {
    "name": READ_TOOL["function"]["name"],  # type: ignore[index]
    "description": READ_TOOL["function"]["description"],  # type: ignore[index]
    "input_schema": READ_TOOL["function"]["parameters"],  # type: ignore[index]
}
USER = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0}  # not in the anthropic SDK 2.x signature any more; older clients send it


def _client(gateway: RunningGateway, session: str | None = None) -> anthropic.Anthropic:
    base = gateway.base_url + (f"/sessions/{session}" if session else "")
    return anthropic.Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0, timeout=120)


def test_a_message_and_its_stream_carry_the_same_tokens(gateway: RunningGateway, tiny_model_path: Path) -> None:
    with _client(gateway) as client:
        whole = client.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY)  # type: ignore[arg-type]
        events: list[str] = []
        with client.messages.stream(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY) as stream:  # type: ignore[arg-type]
            deltas = 0
            for event in stream:
                events.append(event.type)
                deltas += event.type == "content_block_delta"
            final = stream.get_final_message()
        counted = client.messages.count_tokens(model="tiny", messages=USER)  # type: ignore[arg-type]
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "tiny"
    assert whole.id.startswith("msg_") and final.id.startswith("msg_") and whole.id != final.id
    assert [block.type for block in whole.content] == ["text"]
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 12
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert whole.usage.input_tokens == len(prompt) == counted.input_tokens
    # Greedy: the stream says the same, token by token (one delta per sampled token or so).
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == 12 and final.stop_reason == "max_tokens"
    # Steps that queue behind a busy loop are merged into one frame (the adaptive coalescing of
    # http/_sse.py): on a loaded machine all 12 tokens can arrive in one delta (seen in a full-suite
    # run). One token per chunk for a reader that keeps up is tests/gateway/test_streaming.py's contract.
    assert deltas >= 1
    core = [e for e in events if e not in ("text",)]  # the SDK adds its own "text" helper events
    assert core[0] == "message_start" and core[1] == "content_block_start"
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(core[2:-3]) == {"content_block_delta"}


def test_stop_sequences_end_the_message_and_are_named(gateway: RunningGateway) -> None:
    story = [{"role": "user", "content": "Write a long story about a robot."}]
    with _client(gateway) as client:
        free = client.messages.create(model="tiny", max_tokens=40, messages=story, extra_body=GREEDY)  # type: ignore[arg-type]
        text = free.content[0].text  # type: ignore[union-attr]
        assert len(text) > 12, text
        stop = text[8:11]
        cut = client.messages.create(model="tiny", max_tokens=40, messages=story, stop_sequences=[stop],  # type: ignore[arg-type]
                                     extra_body=GREEDY)  # fmt: skip
        with client.messages.stream(model="tiny", max_tokens=40, messages=story, stop_sequences=[stop],  # type: ignore[arg-type]
                                    extra_body=GREEDY) as stream:  # fmt: skip
            streamed = stream.get_final_message()
    before = text[: text.index(stop)]
    for message in (cut, streamed):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert "".join(b.text for b in message.content if b.type == "text") == before


def test_errors_take_anthropics_shape(gateway: RunningGateway) -> None:
    with _client(gateway) as client:
        with pytest.raises(anthropic.NotFoundError) as missing:
            client.messages.create(model="claude-nope", max_tokens=4, messages=USER)  # type: ignore[arg-type]
        assert missing.value.body["type"] == "error"  # type: ignore[index]
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
        with pytest.raises(anthropic.BadRequestError, match="does not take images"):
            client.messages.create(
                model="tiny",
                max_tokens=4,
                messages=[{"role": "user", "content": [image]}],  # type: ignore[list-item]
            )
        # Server tools run on Anthropic's side: not offered to the model; naming one is refused.
        served = client.messages.create(model="tiny", max_tokens=2, messages=USER,  # type: ignore[arg-type]
                                        tools=[{"type": "web_search_20250305", "name": "web_search"}])  # type: ignore[list-item]  # fmt: skip
        assert served.stop_reason == "max_tokens"
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model="tiny", max_tokens=2, messages=USER,  # type: ignore[arg-type]
                                   tools=[{"type": "web_search_20250305", "name": "web_search"}],  # type: ignore[list-item]
                                   tool_choice={"type": "tool", "name": "web_search"})  # fmt: skip
        # Claude Code's mid-conversation system messages, and its HEAD / preconnect.
        mid = client.messages.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}])  # type: ignore[list-item,misc]  # fmt: skip
        assert mid.usage.input_tokens > 0
    assert httpx.head(f"{gateway.base_url}/", timeout=10).status_code == 200
    raw = httpx.post(f"{gateway.base_url}/v1/messages", json={"model": "tiny", "messages": USER}, timeout=10)
    assert raw.status_code == 400
    assert raw.json()["type"] == "error" and raw.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raw.json()["error"]["message"]
    # The chat routes keep OpenAI's shape.
    chat = httpx.post(f"{gateway.base_url}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "invalid_request_error"


def _turn(client: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool) -> Any:
    kwargs: dict[str, Any] = {"model": "tiny-agent", "max_tokens": 64, "system": "You are a coding agent.",
                              "messages": messages, "tools": [READ]}  # fmt: skip
    kwargs["extra_body"] = GREEDY  # the script decides the answer; greedy pins the logprobs' distribution
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as events:
        partial_json = [e.partial_json for e in events if e.type == "input_json"]
        message = events.get_final_message()
    if message.stop_reason == "tool_use":
        assert partial_json, "tool arguments stream as input_json_delta"
    return message


@pytest.mark.parametrize("stream", [True, False])
def test_a_tool_loop_is_one_token_exact_chain(
    agent_gateway: RunningGateway, agent_model_path: Path, tmp_path: Path, stream: bool
) -> None:
    (tmp_path / "README.md").write_text("The secret word is lighthouse.\n")
    session = f"anth{secrets.token_hex(4)}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does the README say?"}]
    with _client(agent_gateway, session) as client:
        for round_ in range(2):
            asked = _turn(client, messages, stream)
            assert asked.stop_reason == "tool_use", asked
            calls = [b for b in asked.content if b.type == "tool_use"]
            assert [c.name for c in calls] == ["read"] and calls[0].input == {"path": "README.md"}
            # The echo is the SDK's own serialisation of the blocks it received.
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in asked.content]})
            results = [{"type": "tool_result", "tool_use_id": c.id, "content": (tmp_path / c.input["path"]).read_text()}
                       for c in calls]  # fmt: skip
            messages.append({"role": "user", "content": results})
            answer = _turn(client, messages, stream)
            assert answer.stop_reason == "end_turn"
            assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == "Done: I read the file."
            messages.append({"role": "assistant", "content": answer.content[0].text})
            messages.append({"role": "user", "content": f"Read it again ({round_})."})
    body = httpx.get(f"{agent_gateway.base_url}/sessions/{session}", headers={"x-api-key": "sk-ant-test"},
                     timeout=10).json()  # fmt: skip
    turns = body["turns"]
    assert len(turns) == 4
    [chain] = body["chains"]  # the echoes were recognised: one chain, every turn reusing the last
    assert chain["turn_ids"] == [t["turn_id"] for t in turns]
    assert all(t["matches_full_render"] for t in turns)
    for turn in turns:
        start = len(turn["prompt_ids"])
        assert chain["token_ids"][start : start + len(turn["output_ids"])] == turn["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()
    assert_chain_logprobs(model, chain["token_ids"], chain["mask"], chain["logprobs"])


def test_a_messages_turn_makes_the_events_a_chat_turn_makes(
    capture_gateway: RunningGateway,
    nats_server: EmbeddedNatsServer,
) -> None:
    """The same conversation through both protocols: the same event kinds and fields, the same
    prompt ids; the Messages turn's events record the same tokens its client saw."""
    from ..support.capture import KEY, of_session, wait_for

    prompt = [{"role": "user", "content": "Tell me about the sea."}]
    chat_session, messages_session = f"c{secrets.token_hex(4)}", f"m{secrets.token_hex(4)}"
    chat = httpx.post(f"{capture_gateway.base_url}/sessions/{chat_session}/v1/chat/completions",
                      json={"model": "tiny", "messages": prompt, "max_tokens": 8, "temperature": 0},
                      headers={"authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
    assert chat.status_code == 200, chat.text
    base = f"{capture_gateway.base_url}/sessions/{messages_session}"
    client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)
    with client, client.messages.stream(model="tiny", max_tokens=8, messages=prompt, extra_body=GREEDY) as stream:  # type: ignore[arg-type]
        message = stream.get_final_message()
    for session in (chat_session, messages_session):
        httpx.post(f"{capture_gateway.base_url}/sessions/{session}/close", headers={"x-api-key": KEY}, timeout=10)

    def both_closed(events: list[Any]) -> bool:
        sessions = (chat_session, messages_session)
        return all("session.closed" in [e.kind for e in of_session(events, s)] for s in sessions)

    events = wait_for(nats_server.url, both_closed)
    by_protocol = [of_session(events, s) for s in (chat_session, messages_session)]
    assert [e.kind for e in by_protocol[0]] == [e.kind for e in by_protocol[1]]
    for chat_event, messages_event in zip(*by_protocol, strict=True):
        assert type(chat_event) is type(messages_event)
        assert set(chat_event.model_dump()) == set(messages_event.model_dump())
    [chat_turn] = [e for e in by_protocol[0] if e.kind == "turn.completed"]
    [messages_turn] = [e for e in by_protocol[1] if e.kind == "turn.completed"]
    assert chat_turn.prompt_ids == messages_turn.prompt_ids  # type: ignore[attr-defined]
    assert chat_turn.output_ids == messages_turn.output_ids  # type: ignore[attr-defined]  # greedy
    assert messages_turn.content == message.content[0].text  # type: ignore[attr-defined,union-attr]
    assert len(messages_turn.output_ids) == message.usage.output_tokens  # type: ignore[attr-defined]
