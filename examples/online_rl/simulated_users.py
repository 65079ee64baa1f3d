"""Simulated live users: concurrent multi-turn OpenAI-SDK clients that rate every answer.

Each user loops until told to stop, one session at a time: 1-3 turns through
``/sessions/<id>/v1``, then a programmatic reward on what the assistant said, sent as
``POST /sessions/<id>/feedback``, then ``POST /sessions/<id>/close`` (the assembler emits the
trajectory on close). Users never wait for the trainer: weights change under them, mid-stream.

GRPO needs several answers to the same conversation. :class:`GroupDispenser` hands out session
slots so that every group (one scripted conversation: the same user messages, with or without
tools) gets exactly ``group_size`` sessions, taken by whichever users are free; each session names
its group in the OpenAI ``metadata`` of its first request, which is what the batcher's default
``--group-key metadata:group`` groups by. Whether a session streams is chosen per session: it does
not change what is sampled, so it may differ inside a group; tools change the prompt (the chat
template lists them), so they are part of the group's script.

What a user sees is counted (:class:`UserStatistics`): turns served, errors (any ``openai``
exception, including an error frame inside a stream, which the SDK raises as ``APIError``, and a
feedback or close request that fails) and aborted streams (a reply that ended without a
``finish_reason``).
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import openai
from openai import AsyncOpenAI

__all__ = [
    "Conversation",
    "GroupDispenser",
    "UserStatistics",
    "UserTraffic",
    "digit_fraction",
]

SYSTEM = "You are a terse assistant. Answer with numbers only."
FIRST_MESSAGES = (
    "What is 17 times 3?",
    "How many days are in a leap year?",
    "What is my order number?",
    "How many legs do 7 spiders have?",
    "What is 2 to the power of 10?",
    "Count from one to ten.",
    "What year did the first moon landing happen?",
    "What is the PIN for the front door?",
)
FOLLOW_UPS = (
    "And plus 12?",
    "Now write it backwards.",
    "Say it again, digits only.",
    "What is half of that?",
    "Read the file numbers.txt and tell me the total.",
)
READ_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
_API_KEY = "sk-simulated-user"
_FINISHED = frozenset({"stop", "length", "tool_calls"})


def digit_fraction(text: str) -> float:
    """The reward: the share of the non-whitespace characters that are ASCII digits (0.0 for no text)."""
    characters = [c for c in text if not c.isspace()]
    if not characters:
        return 0.0
    return sum(c in "0123456789" for c in characters) / len(characters)


@dataclass(frozen=True, slots=True)
class Conversation:
    """One GRPO group's script: the user messages, in order, and whether the ``read`` tool is offered."""

    group: str
    user_messages: tuple[str, ...]
    tools: bool


class GroupDispenser:
    """Hands out session slots: each new :class:`Conversation` exactly ``group_size`` times, in order."""

    def __init__(self, group_size: int, seed: int) -> None:
        self._group_size = group_size
        self._rng = random.Random(seed)
        self._groups = 0
        self._current: Conversation | None = None
        self._handed = 0

    def next_slot(self) -> tuple[Conversation, int]:
        """The conversation of the next session, and the session's index in its group."""
        if self._current is None or self._handed == self._group_size:
            self._current = self._new_conversation()
            self._handed = 0
        self._handed += 1
        return self._current, self._handed - 1

    def _new_conversation(self) -> Conversation:
        self._groups += 1
        turns = self._rng.randint(1, 3)
        messages = (self._rng.choice(FIRST_MESSAGES), *self._rng.sample(FOLLOW_UPS, turns - 1))
        return Conversation(f"g{self._groups:05d}", messages, tools=self._rng.random() < 1 / 3)


@dataclass(frozen=True, slots=True)
class UserStatistics:
    """What the users saw, since they started."""

    sessions_started: int
    sessions_rated: int  # feedback sent and session closed
    turns_served: int  # assistant replies received whole
    streamed_turns: int
    tool_sessions: int
    errors: int  # user-visible: exceptions, error frames
    aborted_streams: int  # streams that ended without a finish_reason
    error_messages: tuple[str, ...]  # the first five, for the summary
    first_reply: str  # what the first user heard
    last_reply: str  # ...and the latest


@dataclass(slots=True)
class _Counters:
    sessions_started: int = 0
    sessions_rated: int = 0
    turns_served: int = 0
    streamed_turns: int = 0
    tool_sessions: int = 0
    errors: int = 0
    aborted_streams: int = 0
    error_messages: list[str] = field(default_factory=list)
    first_reply: str | None = None
    last_reply: str = ""


@dataclass(frozen=True, slots=True)
class _Reply:
    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


class UserTraffic:
    """``users`` simulated users of one gateway; ``await run(stop)`` until ``stop`` is set and they are done."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        users: int,
        group_size: int,
        max_tokens: int,
        seed: int = 0,
        api_key: str = _API_KEY,
        reward: Callable[[str], float] = digit_fraction,
    ) -> None:
        """``api_key``: the bearer key every user sends (its tenant); ``reward``: what a user scores a
        session with, from everything the assistant said in it (its replies joined by newlines)."""
        self._base_url = base_url
        self._model = model
        self._users = users
        self._max_tokens = max_tokens
        self._api_key = api_key
        self._reward = reward
        self._dispenser = GroupDispenser(group_size, seed)
        self._rng = random.Random(seed + 1)
        self._counts = _Counters()

    def statistics(self) -> UserStatistics:
        """A snapshot of the counters."""
        c = self._counts
        return UserStatistics(
            sessions_started=c.sessions_started,
            sessions_rated=c.sessions_rated,
            turns_served=c.turns_served,
            streamed_turns=c.streamed_turns,
            tool_sessions=c.tool_sessions,
            errors=c.errors,
            aborted_streams=c.aborted_streams,
            error_messages=tuple(c.error_messages),
            first_reply=c.first_reply or "",
            last_reply=c.last_reply,
        )

    async def run(self, stop: anyio.Event) -> None:
        """Run every user until ``stop`` is set; each finishes the session it is in first."""
        # Sessions belong to the bearer key (the tenant): feedback and close must send the same one.
        headers = {"Authorization": f"Bearer {self._api_key}"}
        async with (
            httpx.AsyncClient(base_url=self._base_url, headers=headers, timeout=30.0) as http,
            AsyncOpenAI(base_url=f"{self._base_url}/v1", api_key=self._api_key, timeout=120.0, max_retries=0) as client,
            anyio.create_task_group() as tg,
        ):
            for _ in range(self._users):
                tg.start_soon(self._user, client, http, stop)

    async def _user(self, client: AsyncOpenAI, http: httpx.AsyncClient, stop: anyio.Event) -> None:
        while not stop.is_set():
            conversation, member = self._dispenser.next_slot()
            await self._session(client, http, conversation, member)

    async def _session(
        self, client: AsyncOpenAI, http: httpx.AsyncClient, conversation: Conversation, member: int
    ) -> None:
        session_id = f"{conversation.group}-{member}-{secrets.token_hex(3)}"
        # with_options shares the connection pool; only the base URL (the session) differs.
        session = client.with_options(base_url=f"{self._base_url}/sessions/{session_id}/v1")
        streaming = self._rng.random() < 0.5
        counts = self._counts
        counts.sessions_started += 1
        counts.tool_sessions += conversation.tools
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        said: list[str] = []
        rated = True
        for index, text in enumerate(conversation.user_messages):
            messages.append({"role": "user", "content": text})
            metadata = {"group": conversation.group} if index == 0 else None
            try:
                reply = await self._turn(session, messages, conversation.tools, streaming, metadata)
            except openai.OpenAIError as exc:  # what a user of the SDK would see
                await self._error(f"{session_id} turn {index + 1}", exc)
                rated = False
                break
            if reply.finish_reason not in _FINISHED:
                counts.aborted_streams += 1
                rated = False
                break
            counts.turns_served += 1
            counts.streamed_turns += streaming
            if counts.first_reply is None:
                counts.first_reply = reply.content
            counts.last_reply = reply.content
            said.append(reply.content)
            messages.append(_assistant_message(reply))
            messages.extend(_tool_results(reply))
        try:
            if rated:
                await self._rate_and_close(http, session_id, self._reward("\n".join(said)))
            else:
                # Unrated: the batcher drops it, and its group. A first request that failed left no session.
                await self._close(http, session_id, missing_ok=True)
        except httpx.HTTPError as exc:  # the rating did not get through: the user sees that too
            await self._error(f"{session_id} feedback/close", exc)

    async def _error(self, where: str, exc: Exception) -> None:
        self._counts.errors += 1
        if len(self._counts.error_messages) < 5:
            self._counts.error_messages.append(f"{where}: {type(exc).__name__}: {exc}")
        await anyio.sleep(1.0)  # a person would not retry at once either

    async def _turn(
        self,
        session: AsyncOpenAI,
        messages: list[dict[str, Any]],
        tools: bool,
        streaming: bool,
        metadata: dict[str, str] | None,
    ) -> _Reply:
        options: dict[str, Any] = {
            "model": self._model,
            "messages": messages,
            "max_tokens": self._max_tokens,
            "temperature": 1.0,  # the recorded logprobs are then the policy's own distribution
            "top_p": 1.0,
        }
        if tools:
            options["tools"] = [READ_TOOL]
        if metadata is not None:
            options["metadata"] = metadata
        if not streaming:
            completion = await session.chat.completions.create(**options)
            choice = completion.choices[0]
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in choice.message.tool_calls or []
                if c.type == "function"
            ]
            return _Reply(choice.message.content or "", calls, choice.finish_reason)
        content: list[str] = []
        streamed_calls: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        stream = await session.chat.completions.create(**options, stream=True)
        async with stream:
            async for chunk in stream:
                for choice in chunk.choices:
                    content.append(choice.delta.content or "")
                    for delta in choice.delta.tool_calls or []:
                        call = streamed_calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                        call["id"] = delta.id or call["id"]
                        if delta.function is not None:
                            call["name"] = delta.function.name or call["name"]
                            call["arguments"] += delta.function.arguments or ""
                    finish = choice.finish_reason or finish
        return _Reply("".join(content), [streamed_calls[i] for i in sorted(streamed_calls)], finish)

    async def _rate_and_close(self, http: httpx.AsyncClient, session_id: str, reward: float) -> None:
        # Feedback first: the assembler emits a session as soon as it is closed.
        response = await http.post(f"/sessions/{session_id}/feedback", json={"score": reward, "source": "online_rl"})
        response.raise_for_status()
        await self._close(http, session_id)
        self._counts.sessions_rated += 1

    async def _close(self, http: httpx.AsyncClient, session_id: str, *, missing_ok: bool = False) -> None:
        response = await http.post(f"/sessions/{session_id}/close")
        if not (missing_ok and response.status_code == 404):
            response.raise_for_status()


def _assistant_message(reply: _Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in reply.tool_calls
        ]
    return message


def _tool_results(reply: _Reply) -> list[dict[str, Any]]:
    """What the user's client answers to tool calls: ``read`` returns a file of numbers, others fail."""
    results = []
    for call in reply.tool_calls:
        try:
            path = json.loads(call["arguments"] or "{}").get("path", "")
        except (json.JSONDecodeError, AttributeError):
            path = ""
        text = f"{path}: 12 7 30 1" if call["name"] == "read" else f"unknown tool {call['name']!r}"
        results.append({"role": "tool", "tool_call_id": call["id"], "content": text})
    return results
