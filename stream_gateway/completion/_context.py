"""Token-exact prompts for continued conversations (contracts T2 and T3 of docs/sessions.md).

When a request continues a known turn, its prompt is that turn's prompt ids, then the ids the
engine sampled for it, then only the *new* messages tokenized as the chat template renders them at
that position. The echoed assistant message is never re-tokenized, however the client
re-serialised it.

Finding "the new messages as rendered at that position" uses the template itself::

    base = render(context,               no generation prompt)  # the parent's prompt, less its generation prompt
    upto = render(context + [assistant], no generation prompt)
    full = render(all messages,          generation prompt)

``upto`` must start with ``base`` and ``full`` with ``upto`` (the template is *prefix-stable* at
this boundary). How the template would render the assistant message itself does not matter: the
sampled ids stand in for it. The new text is ``full[len(upto):]``, preceded by whatever of the template's
end-of-turn marker the model did not sample itself (``"\\n"`` after a sampled ``<|im_end|>``,
all of ``"<|im_end|>\\n"`` after a turn cut by ``max_tokens``).

Templates that are not prefix-stable (Qwen3-style templates that strip ``<think>`` blocks of
earlier turns, or templates that render the system prompt differently as the conversation
grows) fail that check: the request then starts a new root turn from a full render. Tokens are
never spliced where the text does not line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from stream_gateway._errors import InvalidRequest
from stream_gateway.completion._prompt import template_message
from stream_gateway.completion._request import Message, Tool
from stream_gateway.sessions import Turn

_PROBE = "\u2063probe\u2063"


@dataclass(frozen=True, slots=True)
class Context:
    """The prompt for one request and where it came from."""

    prompt_ids: list[int]
    parent: Turn | None
    reused_prompt_tokens: int
    matches_full_render: bool
    fallback_reason: str | None = None  # why a matched parent could not be continued


class ContextBuilder:
    """Builds prompts for one tokenizer and its chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise InvalidRequest("the served model has no chat template; chat completions need one")
        self._tokenizer = tokenizer
        self._turn_end = self._probe_turn_end()
        self._end_ids = {
            int(i)
            for i in (tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens)
            if isinstance(i, int)
        }

    def build(self, messages: Sequence[Message], tools: Sequence[Tool] | None, parent: Turn | None) -> Context:
        """The prompt for ``messages``, continuing ``parent`` (a turn they extend) when possible."""
        specs = _tool_specs(tools)
        rendered = [template_message(m) for m in messages]
        full = self._render(rendered, specs, generation=True)
        full_ids = self._encode(full)
        if parent is None:
            return Context(full_ids, None, 0, True)
        k = parent.context_length
        try:
            base = self._render(rendered[:k], specs, generation=False)
            upto = self._render(rendered[: k + 1], specs, generation=False)
        except InvalidRequest:
            return Context(full_ids, None, 0, True, "the template cannot render the shorter conversation")
        if not (upto.startswith(base) and full.startswith(upto) and upto.endswith(self._turn_end)):
            return Context(full_ids, None, 0, True, "the chat template is not prefix-stable here")
        sampled = parent.output_ids
        bridge = self._turn_end
        if sampled and sampled[-1] in self._end_ids:
            end_text = str(self._tokenizer.decode([sampled[-1]]))
            if self._turn_end.startswith(end_text):
                bridge = self._turn_end[len(end_text) :]
        reused = len(parent.prompt_ids) + len(sampled)
        prompt = [*parent.prompt_ids, *sampled, *self._encode(bridge + full[len(upto) :])]
        return Context(prompt, parent, reused, prompt == full_ids)

    def render_ids(self, messages: Sequence[Message], tools: Sequence[Tool] | None) -> list[int]:
        """A fresh full render of ``messages`` with the generation prompt, tokenized."""
        return self._encode(self._render([template_message(m) for m in messages], _tool_specs(tools), generation=True))

    def _render(self, messages: list[dict[str, Any]], tools: Any, *, generation: bool) -> str:
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation, tokenize=False
            )
        except TemplateError as exc:
            # Templates raise for conversations they cannot render (e.g. roles out of order).
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        assert isinstance(text, str)
        return text

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _probe_turn_end(self) -> str:
        """The text a template puts after an assistant message's content (``"<|im_end|>\\n"``)."""
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        text = self._render(conversation, None, generation=False)
        return text[text.rindex(_PROBE) + len(_PROBE) :]


# Below this much message text (and without tools), a prompt is built on the event loop: the
# render and tokenization then cost less than the hop to a worker thread and back (~0.1-0.3 ms,
# more when the machine is idle), and they hold the GIL either way. Measured on the tiny model's
# tokenizer: ~0.17 ms for 40 characters, ~0.4 ms for 500; 2,000 take 1.1 ms and go to a thread.
INLINE_BUILD_CHARS = 512


def cheap_to_build(messages: Sequence[Message], tools: Sequence[Tool] | None, parent: Turn | None) -> bool:
    """Whether :meth:`ContextBuilder.build` for these is cheap enough to run on the event loop."""
    if tools or parent is not None:  # tool schemas render long; a continuation renders three times
        return False
    budget = INLINE_BUILD_CHARS
    for message in messages:
        if message.tool_calls:
            return False
        budget -= len(message.text())
        if budget < 0:
            return False
    return True


def _tool_specs(tools: Sequence[Tool] | None) -> Any:
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
