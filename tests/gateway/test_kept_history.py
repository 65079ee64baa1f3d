"""Kept histories through a real gateway (completion/_history.py, completion/_kept.py): for each
chat-shaped protocol (chat completions, Anthropic Messages, Responses) an agent's tool loop whose
every turn re-sends its history byte for byte, read through the gateway's own counters
(``gateway_history_reads_total{fact,read}``, ``gateway_history_read_items_total{fact}``).

Its first turn derives every fact whole; each continuing turn derives every fact (the parse, the
translation, the fingerprints, the text characters, the image scan, the template messages, the
render, the response store's copies) through the one owner for what it adds alone: ``delta`` once
per fact, no ``whole``, and as many items as the turn added. A turn that changes what a kept fact
depends on (Messages' system prompt, a chat request's tools) shows as a ``whole`` read of that fact.
Token-in rollouts are checked the same way in ``test_token_in.py``.

The answers come from the scripted engine (``agent_gateway``: tiny-agent's repertoire on the
untrained ``tiny``): a read of the file, "done" after its result, a read again after a new question.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import httpx
from openai import OpenAI

from ..support.agent_loop import READ_TOOL
from ..support.servers import RunningGateway

# A coding agent's long system prompt: every body is over the 4 KiB a kept one needs from its first turn.
SYSTEM = "You are a coding agent. " + "Follow the repository's conventions. " * 150
FILE = "".join(f'line {i}: some source text ] }} [ {{ " \\\n' for i in range(60))  # what the read returns
ASK = "What does the README say?"
# What an agent's first message carries before the question (Codex's environment context, Claude
# Code's reminders): the body's first 256 bytes, which pick its kept history's bucket, stay the same.
CONTEXT = "<environment_context>cwd: /src/project; shell: bash; approval: never</environment_context>\n" * 4
TURNS = 8

CHAT_FACTS = {"parsed", "counted", "imageless", "keyed", "templated", "rendered"}
_SAMPLE = re.compile(r'^gateway_history_(reads|read_items)_total\{fact="(\w+)"(?:,read="(\w+)")?\} (\S+)$', re.M)


class Reads:
    """What the gateway's kept histories read between two scrapes of its ``/metrics``."""

    def __init__(self, before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> None:
        self._changed = {key: after.get(key, 0) - before.get(key, 0) for key in after.keys() | before.keys()}

    def facts(self, read: str) -> dict[str, int]:
        """Facts derived ``delta`` or ``whole`` in between, and how many times."""
        return {fact: int(n) for (fact, how), n in self._changed.items() if how == read and n}

    def items(self) -> dict[str, int]:
        """Items (messages, template iterations) each fact was derived for anew."""
        return {fact: int(n) for (fact, how), n in self._changed.items() if how == "items" and n}


def _scrape(gateway: RunningGateway) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=30).text
    return {(fact, read or "items"): float(value) for _, fact, read, value in _SAMPLE.findall(text)}


@contextmanager
def _reads(gateway: RunningGateway) -> Iterator[list[Reads]]:
    """The reads of the requests sent in the block (the gateway serves nothing else meanwhile)."""
    before = _scrape(gateway)
    out: list[Reads] = []
    yield out
    out.append(Reads(before, _scrape(gateway)))


def _loop(gateway: RunningGateway, turn: Callable[[int], int]) -> list[tuple[Reads, int]]:
    """``TURNS`` turns of ``turn(i)`` (which answers how many messages that turn added to the
    body), each with what the kept histories read for it."""
    seen = []
    for i in range(TURNS):
        with _reads(gateway) as reads:
            added = turn(i)
        seen.append((reads[0], added))
    return seen


def _assert_only_deltas(seen: list[tuple[Reads, int]], facts: set[str], per_item: set[str]) -> None:
    """The first turn derived ``facts`` whole; every later one through the kept history alone, each
    fact of ``per_item`` for exactly the messages the turn added, none for more than five."""
    first, _ = seen[0]
    assert first.facts("whole") == dict.fromkeys(facts, 1) and first.facts("delta") == {}
    for reads, added in seen[1:]:
        assert reads.facts("delta") == dict.fromkeys(facts, 1), reads.facts("delta")
        assert reads.facts("whole") == {}, "a continuing turn read a fact whole"
        items = reads.items()
        assert {fact: items.get(fact, 0) for fact in per_item} == dict.fromkeys(per_item, added), items
        assert 0 < max(items.values()) <= 5, items  # a handful a turn, while the conversation grows past 16


def test_a_chat_conversation_reads_only_what_each_turn_adds(agent_gateway: RunningGateway) -> None:
    session = f"kept{secrets.token_hex(4)}"
    url = f"{agent_gateway.base_url}/sessions/{session}/v1"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    with OpenAI(base_url=url, api_key="sk-kept", max_retries=0, timeout=120) as client:

        def send(tools: list[Any], max_tokens: int = 64) -> Any:
            create: Any = client.chat.completions.create
            return create(model="tiny-agent", messages=messages, tools=tools, max_tokens=max_tokens, temperature=0)

        def turn(i: int) -> int:
            reply = send([READ_TOOL]).choices[0]
            echoed = reply.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
            messages.append(echoed)
            for call in reply.message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": FILE})
            if not reply.message.tool_calls:
                messages.append({"role": "user", "content": f"{ASK} ({i})"})
            return 2

        seen = _loop(agent_gateway, turn)
        # The tools change (an agent that loads another tool): the keys and the render, which depend
        # on them, are derived whole, and say so; the rest is still read for the delta alone.
        with _reads(agent_gateway) as reads:
            send([READ_TOOL, {**READ_TOOL, "function": {"name": "ls"}}], max_tokens=8)
    # (The render's count is of template iterations: the old last message's may run again.)
    _assert_only_deltas(seen, CHAT_FACTS, CHAT_FACTS - {"rendered"})
    assert reads[0].facts("whole") == {"keyed": 1, "rendered": 1}  # a render replays under the same tools only
    assert set(reads[0].facts("delta")) == CHAT_FACTS - {"keyed", "rendered"}
    assert len(messages) > 2 * TURNS


def _text(block: Any) -> dict[str, Any]:
    """A content block echoed as Claude Code does (the SDK's own serialisation)."""
    return dict(block.model_dump(exclude_none=True))


def test_a_messages_conversation_reads_only_what_each_turn_adds(agent_gateway: RunningGateway) -> None:
    """Claude Code's shape: the system prompt as blocks, ``tool_use`` / ``tool_result`` blocks, and
    the cache mark moved to the new last message each turn (the message that lost it is read again)."""
    function: Any = READ_TOOL["function"]
    read = {"name": "read", "description": "Read a file", "input_schema": function["parameters"]}
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    mark = {"cache_control": {"type": "ephemeral"}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": CONTEXT + ASK}]}]
    repeated = [0]  # messages the next body repeats byte for byte
    base = f"{agent_gateway.base_url}/sessions/kept{secrets.token_hex(4)}"
    with anthropic.Anthropic(base_url=base, api_key="sk-kept", max_retries=0, timeout=120) as client:

        def send(system: Any = system) -> Any:
            create: Any = client.messages.create
            return create(model="tiny-agent", max_tokens=64, system=system, messages=messages, tools=[read],
                          extra_body={"temperature": 0})  # fmt: skip

        def turn(i: int) -> int:
            answer = send()
            added = len(messages) - repeated[0]
            last = messages[-1]["content"][-1]
            if "cache_control" in last:  # the mark moves on: this message's bytes change
                messages[-1]["content"][-1] = {k: v for k, v in last.items() if k != "cache_control"}
            repeated[0] = len(messages) - ("cache_control" in last)
            messages.append({"role": "assistant", "content": [_text(b) for b in answer.content]})
            calls = [b for b in answer.content if b.type == "tool_use"]
            results = [{"type": "tool_result", "tool_use_id": c.id, "content": FILE} for c in calls]
            messages.append({"role": "user", "content": results or [{"type": "text", "text": f"{ASK} ({i})"}]})
            messages[-1]["content"][-1] = {**messages[-1]["content"][-1], **mark}
            return added  # the first body's every message; then the two added, and the one whose mark moved

        seen = _loop(agent_gateway, turn)
        # Another system prompt after the same messages: the body's bytes still continue, but the
        # kept translation served the old prompt, so the translation (and the chat request it
        # makes) is derived whole, and the counters say so.
        with _reads(agent_gateway) as reads:
            send([{"type": "text", "text": SYSTEM + " Be brief."}])
    _assert_only_deltas(seen, {"translated", *CHAT_FACTS}, {"parsed", "translated"})
    assert reads[0].facts("delta") == {"parsed": 1}
    assert reads[0].facts("whole") == dict.fromkeys({"translated", *CHAT_FACTS} - {"parsed"}, 1)


def test_a_responses_conversation_reads_only_what_each_turn_adds(agent_gateway: RunningGateway) -> None:
    """Codex's shape (``store: false``, the whole input each turn): output items echoed as they came,
    function call outputs after them; the response store's copies of the chat messages are read
    through the kept history too."""
    function: Any = READ_TOOL["function"]
    read = {"type": "function", **function}
    first = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": CONTEXT + ASK}]}
    items: list[Any] = [first]
    sent = [0]
    base = f"{agent_gateway.base_url}/sessions/kept{secrets.token_hex(4)}/v1"
    with OpenAI(base_url=base, api_key="sk-kept", max_retries=0, timeout=120) as client:

        def turn(i: int) -> int:
            create: Any = client.responses.create
            response = create(model="tiny-agent", input=items, instructions=SYSTEM, tools=[read], store=False,
                              max_output_tokens=64, temperature=0)  # fmt: skip
            added, sent[0] = len(items) - sent[0], len(items)
            items.extend(item.model_dump(exclude_none=True) for item in response.output)
            calls = [item for item in response.output if item.type == "function_call"]
            for call in calls:
                assert json.loads(call.arguments) == {"path": "README.md"}
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": FILE})
            if not calls:
                items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]})
            return added

        seen = _loop(agent_gateway, turn)
    facts = {"translated", "stored", *CHAT_FACTS}
    _assert_only_deltas(seen, facts, {"parsed", "translated"})
