"""Scripts for the ``scripted`` engine: rules that say what a model answers, read off its prompt ids.

A :class:`Script` is an ordered list of :class:`Rule`; the first rule whose conditions hold for a
prompt gives the reply. The engine sees what a real model sees, token ids, so a rule reads the
prompt as the model's chat template rendered it (:class:`PromptView`): the tools the template
listed, the role of the last message, whether that message holds a tool result or an image, its
text. The conditions understand ChatML with Hermes tool calls (Qwen2.5 and Qwen3, SmolLM2, every
built-in model); for other templates a rule matches the decoded prompt with a regular expression.

A reply is written the way the model writes one: a thought between the model's thinking tags
(only for a model whose template thinks, and only where its generation prompt leaves thinking
open), text, and tool calls in the model's own format (``<tool_call>`` JSON), then the end of the
turn. ``{model}`` in a text is the served model's name, ``{colour}`` the dominant colour of the
last image (:func:`dominant_colour`).

Deliberate choices:

* The script is data (JSON), not Python, so a user's demo or test states it in a file beside
  ``--script`` and the same file drives a gateway in another process.
* :data:`DEFAULT_SCRIPT` is the repertoire the trained ``tiny-agent`` family learned (read a file
  with whichever reading tool is offered, say it is done after the result, say hello otherwise,
  think first on a thinking model, name an image's colour), so demos and tests written against
  those models run unchanged on untrained weights.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "DEFAULT_SCRIPT",
    "NAMED_COLOURS",
    "PromptView",
    "Rule",
    "Script",
    "ToolCall",
    "When",
    "dominant_colour",
    "load_script",
    "render_reply",
]

_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.S)

# The colours ``{colour}`` names: the nearest of these to most of an image's pixels.
NAMED_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 205, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "grey": (128, 128, 128),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolCall(_Strict):
    """A tool call a reply makes: the tool's name and its arguments (a JSON object)."""

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class When(_Strict):
    """A rule's conditions; all that are given must hold (none given: always)."""

    last: Literal["system", "user", "tool", "assistant"] | None = Field(
        default=None, description="the role of the last message; 'tool': a turn of tool results"
    )
    tool: str | None = Field(default=None, description="a tool of this name is offered")
    tools: bool | None = Field(default=None, description="any tool is offered (true) or none (false)")
    image: bool | None = Field(default=None, description="the last message holds an image")
    contains: str | None = Field(default=None, description="the last message's text holds this")
    matches: str | None = Field(default=None, description="a regular expression found in the whole decoded prompt")

    @field_validator("matches")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            re.compile(value)
        return value

    def holds(self, view: PromptView) -> bool:
        """Whether every condition given holds for ``view``."""
        return (
            (self.last is None or view.last_role == self.last)
            and (self.tool is None or self.tool in view.tools)
            and (self.tools is None or bool(view.tools) == self.tools)
            and (self.image is None or view.image == self.image)
            and (self.contains is None or self.contains in view.last_text)
            and (self.matches is None or re.search(self.matches, view.text) is not None)
        )


class Rule(_Strict):
    """When it applies, and what the model then says: a thought, text, tool calls."""

    when: When = Field(default_factory=lambda: When())
    think: str | None = Field(default=None, description="a thought, on a model that thinks")
    say: str = Field(default="", description="the answer's text; {model} and {colour} are filled in")
    call: list[ToolCall] = Field(default_factory=list, description="tool calls after the text")


class Script(_Strict):
    """Rules in order: the first that holds answers. A prompt no rule takes gets an empty answer."""

    rules: list[Rule] = Field(default_factory=list)

    def reply(self, view: PromptView) -> Rule | None:
        """The first rule that holds for ``view``."""
        return next((rule for rule in self.rules if rule.when.holds(view)), None)


def _reader(name: str, arguments: dict[str, Any], thought: str) -> Rule:
    return Rule(when=When(last="user", tool=name), think=thought, call=[ToolCall(name=name, arguments=arguments)])


DEFAULT_SCRIPT = Script(
    rules=[
        Rule(when=When(image=True), say="The image is {colour}."),
        Rule(when=When(last="tool"), think="The result is in, now answer.", say="Done: I read the file."),
        _reader("read", {"path": "README.md"}, "I should use read for it."),
        _reader("Read", {"file_path": "README.md"}, "I should use Read for it."),
        _reader("exec_command", {"cmd": "cat README.md"}, "I should use exec_command for it."),
        # Claude Code and Codex put a system or developer message after the user's own.
        Rule(
            when=When(last="system", tool="Read"),
            think="I should use Read for it.",
            call=[ToolCall(name="Read", arguments={"file_path": "README.md"})],
        ),
        Rule(think="No tools; say hi.", say="Hello from {model}."),
    ]
)


def load_script(path: str | Path) -> Script:
    """The script in the JSON file ``path``; a clear ``ValueError`` for a file that is not one."""
    try:
        return Script.model_validate_json(Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read the script {path}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{path} is not a script (docs/engines.md#scripted): {exc}") from exc


@dataclass(frozen=True, slots=True)
class PromptView:
    """A prompt as a scripted model reads it: the decoded text and what the template laid out."""

    text: str
    tools: frozenset[str]
    last_role: str | None
    last_text: str
    image: bool
    thinking: Literal["open", "closed", "none"]  # what the generation prompt leaves of thinking

    @classmethod
    def read(
        cls, text: str, *, image_token: str | None = None, think_tags: tuple[str, str] | None = None
    ) -> PromptView:
        """Read ``text`` (a prompt decoded with its special tokens) as ChatML with Hermes tools."""
        tools: set[str] = set()
        found = _TOOLS.search(text)
        if found:
            for line in found.group(1).splitlines():
                try:
                    tool = json.loads(line)
                except ValueError:
                    continue
                function = tool.get("function", tool) if isinstance(tool, dict) else None
                if isinstance(function, dict) and isinstance(function.get("name"), str):
                    tools.add(function["name"])
        turns = text.split(_IM_START)
        # The last turn is the generation prompt ("assistant\n", perhaps a thinking block); the
        # message before it is the one the model answers.
        last_role, last_text = None, ""
        if len(turns) >= 3:
            role, _, body = turns[-2].partition("\n")
            last_text = body.split(_IM_END)[0]
            last_role = "tool" if role == "user" and last_text.lstrip().startswith("<tool_response>") else role
        thinking: Literal["open", "closed", "none"] = "none"
        if think_tags is not None:
            thinking = "closed" if len(turns) >= 2 and think_tags[1] in turns[-1] else "open"
        image = image_token is not None and image_token in last_text
        return cls(text, frozenset(tools), last_role, last_text, image, thinking)


def render_reply(
    rule: Rule,
    view: PromptView,
    *,
    model: str,
    colour: str | None,
    think_tags: tuple[str, str] | None,
    prompt_opens_thought: bool,
) -> str:
    """The reply's text as the model samples it, without the end-of-turn token."""
    answer = rule.say.replace("{model}", model).replace("{colour}", colour or "unknown")
    calls = [
        f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {json.dumps(c.arguments)}}}\n</tool_call>'
        for c in rule.call
    ]
    body = "\n".join([answer, *calls]) if answer else "\n".join(calls)
    if think_tags is None or view.thinking != "open" or rule.think is None:
        return body
    opened, closed = think_tags
    thought = f"{rule.think}\n{closed}\n\n{body}"
    return f"\n{thought}" if prompt_opens_thought else f"{opened}\n{thought}"


def dominant_colour(images: Sequence[bytes]) -> str | None:
    """The name in :data:`NAMED_COLOURS` nearest to most pixels of the last image; None without one."""
    if not images:
        return None
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(images[-1])) as image:
        pixels = np.asarray(image.convert("RGB").resize((64, 64)), dtype=np.float32).reshape(-1, 3)
    names = list(NAMED_COLOURS)
    palette = np.array([NAMED_COLOURS[n] for n in names], dtype=np.float32)
    nearest = ((pixels[:, None, :] - palette[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)
    return names[int(np.bincount(nearest, minlength=len(names)).argmax())]
