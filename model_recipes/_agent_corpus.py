"""tiny-agent's corpus: synthetic agent conversations drawn from a seeded RNG, ending in its replies.

A conversation is what an agent (pi, OpenClaw, Claude Code, Codex) sends: a system prompt (a line,
or pages of filler like real agents' prompts), tools (the variant's reading tool among others),
rounds of user turns, tiny-agent's replies (``AGENT_TOOL_CALL``, ``AGENT_AFTER_TOOL``,
``AGENT_WITHOUT_TOOLS``) and other models' (prose, calls of any tool), and tool results. Brief
conversations pack many replies into few tokens; full ones are longer and more varied (see
``_agent_training._agent_groups``). Everything is drawn from the ``random.Random`` passed in, so a
corpus is fixed by its seed.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from typing import Any

from stream_gateway.models import AGENT_AFTER_TOOL, AGENT_READERS, AGENT_WITHOUT_TOOLS
from stream_gateway.models._corpus import (
    _CITIES,
    _UNICODE,
    _WORD_LIST,
    _code_text,
    _identifier,
    _number_text,
    _tool_text,
)

# How often a variant's user turn comes after its agent's extra context messages (see
# _agent_conversation): Codex sends a second developer message and the environment as a user
# message before the user's own.
_AGENT_CONTEXT_MESSAGE_SHARE = {"read": 0.0, "Read": 0.0, "exec_command": 0.5}
# How often a variant's user turn is followed by a system message before the reply: Claude Code
# (2.1.197) sends the Agent tool's agent types and its skills as a ``role: "system"`` message after
# the user's own. Untrained, what tiny-agent-claude did there was chance: one machine's build called
# ``Read``, the builds of three other machines said they were done.
_AGENT_TRAILING_SYSTEM_SHARE = {"read": 0.0, "Read": 0.5, "exec_command": 0.0}
_AGENT_MAX_ROUNDS = 8  # user turns in a conversation: each, up to two replies to learn
_AGENT_TOOLS = (
    "bash", "edit", "write", "exec", "web_search", "web_fetch", "grep", "find", "ls", "process",
    "browser", "apply_patch", "memory_search", "message", "cron", "image", "sessions_send", "canvas",
)  # fmt: skip
_AGENT_SOUP = string.ascii_letters + string.digits + string.punctuation + " " * 8 + "\n\t" + "".join(_UNICODE)
_AGENT_TOOLS_SHARE = 0.75  # of conversations that offer tools
_AGENT_LONG_SYSTEM_SHARE = 0.3  # of full conversations whose system prompt is pages of filler
_AGENT_LONG_MESSAGE_SHARE = 0.35  # of rounds in full conversations with more than a line of text
_AGENT_BRIEF_LONG_MESSAGE_SHARE = 0.15  # and in brief ones: the end of a long message is harder to find
_AGENT_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwyz" for v in "aeiouy"] + ["th", "ch", "ng", "x", "q"]
_AGENT_GREETINGS = ("hi", "Hello!", "go", "continue", "ok", "What is in this repo?", "?", "thanks")
_AGENT_PARAMETERS = (
    "path", "file_path", "command", "content", "old_text", "new_text", "query", "url", "timeout",
    "offset", "limit", "pattern", "cwd", "action", "target", "text", "count", "recursive",
)  # fmt: skip
# Given an assistant message and whether it is the model's own, the message as the corpus has it.
_ReplyHook = Callable[[dict[str, Any], bool], dict[str, Any]]


def _agent_conversation(
    rng: random.Random, brief: bool, reader: str = "read", hook: _ReplyHook | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[bool]]:
    """Messages ending in one of tiny-agent's replies, the tools, and which assistant turns are its own.

    ``hook`` rewrites each assistant message as it is added (tiny-reasoning's adds its thought);
    without one the messages are tiny-agent's.
    """
    tools = _agent_tools(rng, brief, reader) if rng.random() < _AGENT_TOOLS_SHARE else None
    own_call = {"name": reader, "arguments": AGENT_READERS[reader]}
    messages: list[dict[str, Any]] = []
    trained: list[bool] = []
    system = _agent_system(rng, brief)
    if system is not None:
        messages.append({"role": rng.choice(["system", "system", "developer"]), "content": system})

    def reply(message: dict[str, Any], own: bool) -> None:
        if hook is not None:
            message = hook(message, own)
        messages.append({"role": "assistant", **message})
        trained.append(own)

    ends: list[int] = []  # lengths of `messages` at which a conversation may end
    listed = False  # Claude Code sends its listing once, after the first user message
    for _ in range(rng.randint(1, _AGENT_MAX_ROUNDS)):
        # Mostly one-liners even in full conversations: replies stay dense, so are the lessons.
        terse = rng.random() > (_AGENT_BRIEF_LONG_MESSAGE_SHARE if brief else _AGENT_LONG_MESSAGE_SHARE)
        if messages and rng.random() < 0.05:
            messages.append({"role": "system", "content": _agent_sentence(rng)})
        if (share := _AGENT_CONTEXT_MESSAGE_SHARE[reader]) and rng.random() < share:
            # Codex's shape: a second developer message, and a user message of environment
            # context before the user's own (the RNG is not drawn for variants without it).
            if not any(m["role"] == "user" for m in messages):
                messages.append({"role": "developer", "content": _agent_filler(rng, rng.randint(50, 400))})
            messages.append({"role": "user", "content": _agent_environment(rng)})
        messages.append({"role": "user", "content": _agent_sentence(rng, 1, 6) if terse else _agent_user_text(rng)})
        if not listed and (share := _AGENT_TRAILING_SYSTEM_SHARE[reader]) and rng.random() < share:
            messages.append({"role": "system", "content": _agent_listing(rng)})  # Claude Code's shape
            listed = True
        foreign = rng.random() < 0.15
        if tools is None:
            reply({"content": _agent_prose(rng) if foreign else AGENT_WITHOUT_TOOLS}, not foreign)
            ends.append(len(messages))
            continue
        if foreign:
            calls = [_agent_foreign_call(rng, tools) for _ in range(rng.choice((1, 1, 2)))]
            reply({"content": _agent_prose(rng) if rng.random() < 0.3 else None, "tool_calls": calls}, False)
        else:
            call = own_call
            reply({"content": None, "tool_calls": [{"type": "function", "function": call}]}, True)
            ends.append(len(messages))
            calls = [call] * rng.choice((1, 1, 1, 2))
        for _ in calls:
            messages.append({"role": "tool", "content": _agent_tool_result(rng, terse)})
        if rng.random() < 0.1:
            reply({"content": _agent_prose(rng)}, False)
        else:
            reply({"content": AGENT_AFTER_TOOL}, True)
            ends.append(len(messages))
    if not ends:  # every turn was foreign: give it one of its own
        messages.append({"role": "user", "content": _agent_user_text(rng)})
        own = (
            {"content": None, "tool_calls": [{"type": "function", "function": own_call}]}
            if tools
            else {"content": AGENT_WITHOUT_TOOLS}
        )
        reply(own, True)
        ends.append(len(messages))
    end = ends[-1] if rng.random() < 0.6 else rng.choice(ends)
    kept = sum(1 for m in messages[:end] if m["role"] == "assistant")
    return messages[:end], tools, trained[:kept]


def _agent_tools(rng: random.Random, brief: bool, reader: str = "read") -> list[dict[str, Any]]:
    names = [*rng.sample(_AGENT_TOOLS, k=rng.choice((0, 1) if brief else (0, 1, 1, 2, 3))), reader]
    rng.shuffle(names)
    tools = []
    for name in names:
        keys = rng.sample(_AGENT_PARAMETERS, k=1 if brief else rng.choice((1, 1, 2)))
        types = ("string", "string", "number", "integer", "boolean")
        properties = {k: {"type": rng.choice(types), "description": _agent_sentence(rng, 1, 4)} for k in keys}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        if rng.random() < 0.7:
            parameters["required"] = keys[: rng.randint(1, len(keys))]
        if rng.random() < 0.2:
            parameters["additionalProperties"] = False
        function = {"name": name, "description": _agent_sentence(rng, 1, 4 if brief else 8), "parameters": parameters}
        tools.append({"type": "function", "function": function})
    return tools


def _agent_system(rng: random.Random, brief: bool) -> str | None:
    kind = rng.random()
    if kind < 0.2:
        return None  # the template's default system prompt
    if kind < 1.0 - _AGENT_LONG_SYSTEM_SHARE or brief:
        return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 2)))
    return _agent_filler(rng, rng.randint(200, 1500))


def _agent_environment(rng: random.Random) -> str:
    """A user message of environment context, as Codex sends before the user's first message."""
    root = "/" + "/".join(_identifier(rng) for _ in range(rng.randint(1, 4)))
    lines = [f"  <cwd>{root}</cwd>", f"  <shell>{rng.choice(('bash', 'zsh', 'sh'))}</shell>"]
    lines.append(
        f"  <current_date>20{rng.randint(20, 40)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}</current_date>"
    )
    lines.append(f"  <timezone>{rng.choice(('Etc/UTC', 'Europe/Paris', 'America/New_York'))}</timezone>")
    return "<environment_context>\n" + "\n".join(lines) + "\n</environment_context>"


def _agent_listing(rng: random.Random) -> str:
    """A system message listing agents or skills, one a line, as Claude Code sends after the user's."""
    lines = [f"{_agent_sentence(rng, 3, 8)[:-1]}:"]
    for _ in range(rng.randint(2, 12)):  # Claude Code's is longer: the sparse context covers length
        name = "-".join(_identifier(rng) for _ in range(rng.randint(1, 3)))
        lines.append(f"- {name}: {_agent_sentence(rng, 4, 14)}")
    return "\n".join(lines)


def _agent_filler(rng: random.Random, characters: int) -> str:
    """Markdown prose, lists, code and JSON, like the long system prompts of real agents."""
    parts: list[str] = []
    size = 0
    while size < characters:
        kind = rng.random()
        if kind < 0.1:  # any bytes at all, so that no token of the vocabulary is a stranger
            part = "".join(rng.choices(_AGENT_SOUP, k=rng.randint(20, 200)))
        elif kind < 0.2:
            part = "\n".join(_agent_markup(rng) for _ in range(rng.randint(1, 4)))
        elif kind < 0.28:
            part = f"## {_agent_sentence(rng, 2, 5).rstrip('.!?,')}"
        elif kind < 0.4:
            part = "\n".join(f"- {_agent_sentence(rng, 3, 12)}" for _ in range(rng.randint(2, 6)))
        elif kind < 0.5:
            part = _code_text(rng).strip()
        elif kind < 0.6:
            part = _tool_text(rng).split("\n", 1)[0]
        else:
            part = " ".join(_agent_sentence(rng) for _ in range(rng.randint(2, 6)))
        parts.append(part)
        size += len(part) + 2
    return "\n\n".join(parts)


def _agent_user_text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.1:
        return _agent_markup(rng)
    if kind < 0.2:
        return rng.choice(_AGENT_GREETINGS)
    if kind < 0.3:
        path = f"{_identifier(rng).lower()}/{_identifier(rng).lower()}.{rng.choice(['py', 'md', 'ts', 'json'])}"
        return f"{_agent_sentence(rng, 2, 6)} {path} {_agent_sentence(rng, 2, 8)}"
    if kind < 0.4:
        channel = rng.choice(["Telegram", "Slack", "WhatsApp"])
        return f"[{channel} {_identifier(rng)} id:{rng.getrandbits(24)}] {_agent_sentence(rng)}"
    if kind < 0.5:
        return f"{_agent_sentence(rng)}\n{_code_text(rng)}"
    if kind < 0.55:
        return f"{rng.choice(_UNICODE)} {rng.choice(_CITIES)} {_agent_sentence(rng)}"
    return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 4)))


def _agent_tool_result(rng: random.Random, brief: bool) -> str:
    kind = rng.random()
    if kind < 0.05:
        return ""
    if kind < 0.1:
        return _agent_markup(rng)
    if brief:  # one line: a brief conversation packs many replies into few tokens
        return (
            _agent_sentence(rng, 1, 6)
            if kind < 0.6
            else json.dumps({"ok": kind < 0.8, "result": _agent_sentence(rng, 1, 3)})
        )
    if kind < 0.35:
        return f"# {_identifier(rng)}\n\n{_agent_filler(rng, rng.randint(50, 400))}"
    if kind < 0.55:
        return _code_text(rng)
    if kind < 0.7:
        return json.dumps({"status": rng.choice(["ok", "error"]), "result": _agent_sentence(rng)})
    if kind < 0.8:
        return f"Error: {_agent_sentence(rng, 3, 8)}"
    return _number_text(rng) + _agent_sentence(rng)


def _agent_markup(rng: random.Random) -> str:
    """HTML or XML, as in READMEs and fetched pages: its "</" must not pass for a tool result's end."""
    tag = rng.choice(["p", "div", "span", "b", "a", "li", "code", "item", "result", "response", "tool"])
    inner = _agent_sentence(rng, 1, 8)
    if rng.random() < 0.5:
        inner = f'<{tag} class="{_identifier(rng)}">{inner}</{tag}>'
    return f"{_agent_sentence(rng, 0, 6)} <{tag}>{inner}</{tag}>".strip()


def _agent_sentence(rng: random.Random, low: int = 5, high: int = 14) -> str:
    """Like ``_sentence``, but a third of the words made up: real prompts use words ours lack."""
    words = [
        rng.choice(_WORD_LIST) if rng.random() < 0.7 else "".join(rng.choices(_AGENT_SYLLABLES, k=rng.randint(1, 3)))
        for _ in range(rng.randint(low, high))
    ]
    return " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ","])


def _agent_prose(rng: random.Random) -> str:
    return " ".join(_agent_sentence(rng) for _ in range(rng.randint(1, 3)))


def _agent_foreign_call(rng: random.Random, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A call some other model made: any tool, any arguments, sometimes as an OpenAI JSON string."""
    function = rng.choice(tools)["function"]
    arguments = {
        k: rng.choice([_agent_sentence(rng, 1, 4), rng.randint(0, 100)]) for k in function["parameters"]["properties"]
    }
    encoded: Any = json.dumps(arguments) if rng.random() < 0.5 else arguments
    return {
        "id": f"call_{rng.getrandbits(32):08x}",
        "type": "function",
        "function": {"name": function["name"], "arguments": encoded},
    }
